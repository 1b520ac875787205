//! A worker's side of the parameter servers: push gradients into the shards, pull
//! parameters out of them.

use super::server::{lock_shard, Update};
use super::{doorbell, inbox_at, slot_at, RemoteMemory, APPLIED_AT, INBOX_ACK, LOCK_AT, PARAMS_AT, SLOT_GRADS, VERSION_AT};
use crate::error::{invalid, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

impl RemoteMemory {
    /// Pushes the accumulated gradient `acc` (over `count` minibatches) to every shard:
    /// one bulk write into the next inbox slot and one atomic doorbell per shard. Waits
    /// (under the deadline) only while both slots are still being applied.
    pub fn push(&mut self, acc: &[f32], count: u64) -> Result<()> {
        let r = self.push_all(acc, count);
        self.noted(r)
    }

    fn push_all(&mut self, acc: &[f32], count: u64) -> Result<()> {
        if acc.len() != *self.bounds.last().unwrap_or(&0) {
            return Err(invalid(format!("push: {} values, the parameters have {}", acc.len(), self.bounds.last().unwrap_or(&0))));
        }
        for i in 0..self.servers.len() {
            if let Some(base) = self.win.mapped(self.servers[i]) {
                self.apply_in_place(i, base, acc, count)?;
                continue;
            }
            let (lo, hi) = self.shard_range(i);
            // SAFETY: f32 slice viewed as bytes.
            let bytes = unsafe { std::slice::from_raw_parts(acc[lo..hi].as_ptr() as *const u8, (hi - lo) * 4) };
            if self.win.accumulates(self.servers[i]) {
                // The push-number field names the pushing rank instead: the shard's lock
                // records who applies.
                self.win.accumulate(self.servers[i], PARAMS_AT, bytes, doorbell(self.rank as u64, count, self.pulled_at[i]))?;
                continue;
            }
            let push = self.sent[i] + 1;
            // The slot is free once the shard has applied its previous occupant, push − 2.
            self.wait_acked(i, push.saturating_sub(2), &format!("push to parameter shard {i} on rank {}", self.servers[i]))?;
            let slot = slot_at(self.shard_len, self.rank, push);
            self.win.write(self.servers[i], slot + SLOT_GRADS, bytes)?;
            self.win.fetch_add(self.servers[i], slot, doorbell(push, count, self.pulled_at[i]))?;
            self.sent[i] = push;
        }
        Ok(())
    }

    /// A push to a shard whose memory is mapped here: apply it directly, under the lock.
    fn apply_in_place(&mut self, i: usize, base: *mut u8, acc: &[f32], count: u64) -> Result<()> {
        let server = self.servers[i];
        // SAFETY: `base` maps the shard's whole window, laid out as in the module docs.
        let lock = unsafe { &*(base.add(LOCK_AT) as *const AtomicU64) };
        if let Err((holder, waited)) = lock_shard(lock, self.rank, self.timeout) {
            let what = format!("push to parameter shard {i} on rank {server}: the shard stayed locked by rank {holder}");
            return Err(self.gone(holder, &what, waited));
        }
        let (lo, hi) = self.shard_range(i);
        // SAFETY: the shard's words and parameters lie inside the mapping; we hold the lock.
        let update = unsafe { Update::begin(base, self.rule, self.lr, count, self.pulled_at[i]) };
        // SAFETY: the slice is the shard's length.
        unsafe { update.add(0, &acc[lo..hi]) };
        update.finish(true);
        lock.store(0, Ordering::Release);
        Ok(())
    }

    /// Waits until shard `i` has applied `want` of our pushes.
    fn wait_acked(&mut self, i: usize, want: u64, what: &str) -> Result<()> {
        let (server, ack_at) = (self.servers[i], inbox_at(self.shard_len, self.rank) + INBOX_ACK);
        let start = Instant::now();
        while self.acked[i] < want {
            self.acked[i] = self.read_word(server, ack_at)?;
            if self.acked[i] >= want {
                break;
            }
            if start.elapsed() > self.timeout {
                return Err(self.gone(server, what, start.elapsed()));
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Waits until every shard has applied all of this worker's pushes.
    pub fn flush(&mut self) -> Result<()> {
        let r =
            (0..self.servers.len()).try_for_each(|i| self.wait_acked(i, self.sent[i], &format!("flush to parameter shard {i} on rank {}", self.servers[i])));
        self.noted(r)
    }

    /// Reads the full parameter vector; never a half-applied update (seqlock).
    /// Also records each shard's update count, for the staleness-aware rule.
    pub fn pull(&mut self, out: &mut [f32]) -> Result<()> {
        let r = self.pull_all(out);
        self.noted(r)
    }

    fn pull_all(&mut self, out: &mut [f32]) -> Result<()> {
        for (i, &server) in self.servers.iter().enumerate() {
            let (lo, hi) = self.shard_range(i);
            let start = Instant::now();
            loop {
                let (mut v1, mut v2) = ([0u8; 8], [0u8; 8]);
                // SAFETY: f32 slice viewed as bytes.
                let bytes = unsafe { std::slice::from_raw_parts_mut(out[lo..hi].as_mut_ptr() as *mut u8, (hi - lo) * 4) };
                self.win.read_sequence(server, &mut [(VERSION_AT, &mut v1), (PARAMS_AT, bytes), (VERSION_AT, &mut v2)])?;
                let (v1, v2) = (u64::from_ne_bytes(v1), u64::from_ne_bytes(v2));
                if v1 == v2 && v1 % 2 == 0 {
                    self.pulled_at[i] = v1 / 2;
                    break;
                }
                if start.elapsed() > self.timeout {
                    return Err(self.gone(server, &format!("pull from parameter shard {i} on rank {server}"), start.elapsed()));
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Updates applied by shard `i` so far (read remotely).
    pub fn applied(&self, i: usize) -> Result<u64> {
        self.read_word(self.servers[i], APPLIED_AT)
    }
}
