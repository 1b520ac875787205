//! Remote-memory layer: parameter-server shards and the token ring of the dynamic-delay
//! cyclic gradient update (ALGORITHMS.md §3), on the one-sided operations of every
//! transport (mapped memory on shm, the one-sided service on tcp; verbs later).
//!
//! Every rank exposes one window laid out as:
//!
//! | offset | what |
//! |---|---|
//! | 0 | token word: how many times the token reached this rank (incremented by the passer) |
//! | 64 | holders (meaningful on rank 0): +1 on taking the token, −1 on passing it — a second holder shows up as a non-zero old value |
//! | 128 | shard version (seqlock: odd while an update is being applied) |
//! | 192 | pushes applied by this shard |
//! | 256 | the shard's parameters (f32) |
//! | then | one inbox per worker: sequence word, acknowledged word, gradient count, gradients |
//!
//! A worker pushes by writing its gradients into its inbox, then bumping the inbox's
//! sequence word atomically; the shard's server thread applies them, bumps the version
//! around the update and acknowledges. A pull reads version, parameters, version, and
//! retries unless both versions are equal and even, so it never sees a half-applied update.

use crate::comm::Communicator;
use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use crate::transport::onesided::Window;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN_AT: usize = 0;
const HOLDERS_AT: usize = 64;
const VERSION_AT: usize = 128;
const APPLIED_AT: usize = 192;
const PARAMS_AT: usize = 256;
const INBOX_SEQ: usize = 0;
const INBOX_ACK: usize = 64;
const INBOX_COUNT: usize = 128;
const INBOX_GRADS: usize = 192;

/// How a shard applies a pushed gradient sum `a` accumulated over `c` minibatches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ApplyRule {
    /// θ −= η·a
    Sum,
    /// θ −= η·a/c
    Mean,
}

/// The parameter-server shards and token ring of one communicator.
pub struct RemoteMemory {
    win: Arc<Window>,
    /// Ranks that serve shards, in shard order.
    servers: Vec<usize>,
    /// Parameters in shard i: `bounds[i]..bounds[i+1]` of the full vector.
    bounds: Vec<usize>,
    shard_len: usize,
    world: usize,
    rank: usize,
    timeout: Duration,
    /// Times this rank has taken the token.
    taken: u64,
    stop: Arc<AtomicBool>,
    server: Option<std::thread::JoinHandle<()>>,
    /// Where a failing rank leaves its reason and a survivor looks it up (the store keys
    /// the engine uses for collectives), and the global rank of each rank.
    reasons: Option<(Arc<crate::bootstrap::StoreClient>, String)>,
    global: Vec<usize>,
}

fn inbox_bytes(shard_len: usize) -> usize {
    (INBOX_GRADS + 4 * shard_len).next_multiple_of(64)
}

fn inbox_at(shard_len: usize, worker: usize) -> usize {
    (PARAMS_AT + 4 * shard_len).next_multiple_of(64) + worker * inbox_bytes(shard_len)
}

fn word(region: &Region, at: usize) -> &AtomicU64 {
    // SAFETY: `at` is 8-aligned inside the live region; all accesses to these words are
    // atomic (locally) or one-sided atomics/whole-word writes (remotely).
    unsafe { &*(region.as_ptr().add(at) as *const AtomicU64) }
}

impl RemoteMemory {
    /// Sets up shards of `params` (initial values, same on every rank) served by `servers`
    /// and the token ring over all ranks, starting at rank 0. Collective.
    pub fn new(comm: &Communicator, servers: &[usize], params: &[f32], rule: ApplyRule, lr: f32) -> Result<Self> {
        let (world, rank) = (comm.size(), comm.rank());
        if servers.is_empty() || servers.iter().any(|&s| s >= world) {
            return Err(invalid(format!("parameter servers {servers:?} must be ranks of this communicator (size {world})")));
        }
        let n = params.len();
        let bounds: Vec<usize> = (0..=servers.len()).map(|i| n * i / servers.len()).collect();
        let shard_len = (0..servers.len()).map(|i| bounds[i + 1] - bounds[i]).max().unwrap_or(0);
        let bytes = inbox_at(shard_len, world);
        let region = Arc::new(Region::shared("gradwire-rma", bytes)?);
        if rank == 0 {
            word(&region, TOKEN_AT).store(1, Ordering::Release);
        }
        let my_shard = servers.iter().position(|&s| s == rank);
        if let Some(i) = my_shard {
            let shard = &params[bounds[i]..bounds[i + 1]];
            // SAFETY: nobody can reach the region before `expose` returns.
            unsafe { std::ptr::copy_nonoverlapping(shard.as_ptr(), region.as_ptr().add(PARAMS_AT) as *mut f32, shard.len()) };
        }
        let win = Arc::new(comm.expose(region.clone())?);
        let stop = Arc::new(AtomicBool::new(false));
        let server = my_shard.map(|i| {
            let (region, stop, len) = (region.clone(), stop.clone(), bounds[i + 1] - bounds[i]);
            std::thread::spawn(move || serve(&region, len, shard_len, world, rule, lr, &stop))
        });
        comm.barrier()?;
        let reasons = comm.store.clone().map(|s| (s, comm.prefix.clone()));
        let global = comm.global_ranks().to_vec();
        Ok(RemoteMemory {
            win,
            servers: servers.to_vec(),
            bounds,
            shard_len,
            world,
            rank,
            timeout: comm.config().timeout,
            taken: 0,
            stop,
            server,
            reasons,
            global,
        })
    }

    fn shard_range(&self, i: usize) -> (usize, usize) {
        (self.bounds[i], self.bounds[i + 1])
    }

    fn gone(&self, peer: usize, what: &str, waited: Duration) -> Error {
        match self.win.peer_gone(peer) {
            Some(why) => Error::PeerLost { rank: self.rank, peer, op: what.into(), cause: why },
            None => Error::Timeout { rank: self.rank, peer, op: what.into(), waited_ms: waited.as_millis() as u64 },
        }
    }

    fn read_word(&self, peer: usize, at: usize) -> Result<u64> {
        let mut b = [0u8; 8];
        self.win.read(peer, at, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Pushes the accumulated gradient `acc` (over `count` minibatches) to every shard.
    /// Waits (under the deadline) until each shard has applied this worker's previous push.
    pub fn push(&self, acc: &[f32], count: u64) -> Result<()> {
        if acc.len() != *self.bounds.last().unwrap_or(&0) {
            return Err(invalid(format!("push: {} values, the parameters have {}", acc.len(), self.bounds.last().unwrap_or(&0))));
        }
        let inbox = inbox_at(self.shard_len, self.rank);
        for (i, &server) in self.servers.iter().enumerate() {
            let what = format!("push to parameter shard {i} on rank {server}");
            let start = Instant::now();
            // The inbox is free once the shard acknowledged everything we sent.
            loop {
                let (seq, ack) = (self.read_word(server, inbox + INBOX_SEQ)?, self.read_word(server, inbox + INBOX_ACK)?);
                if seq == ack {
                    break;
                }
                if start.elapsed() > self.timeout {
                    return Err(self.gone(server, &what, start.elapsed()));
                }
                std::thread::yield_now();
            }
            let (lo, hi) = self.shard_range(i);
            // SAFETY: f32 slice viewed as bytes.
            let bytes = unsafe { std::slice::from_raw_parts(acc[lo..hi].as_ptr() as *const u8, (hi - lo) * 4) };
            self.win.write(server, inbox + INBOX_GRADS, bytes)?;
            self.win.write(server, inbox + INBOX_COUNT, &count.to_ne_bytes())?;
            self.win.fetch_add(server, inbox + INBOX_SEQ, 1)?;
        }
        Ok(())
    }

    /// Waits until every shard has applied this worker's pushes.
    pub fn flush(&self) -> Result<()> {
        let inbox = inbox_at(self.shard_len, self.rank);
        for &server in &self.servers {
            let start = Instant::now();
            while self.read_word(server, inbox + INBOX_SEQ)? != self.read_word(server, inbox + INBOX_ACK)? {
                if start.elapsed() > self.timeout {
                    return Err(self.gone(server, &format!("flush to rank {server}"), start.elapsed()));
                }
                std::thread::yield_now();
            }
        }
        Ok(())
    }

    /// Reads the full parameter vector; never a half-applied update (seqlock).
    pub fn pull(&self, out: &mut [f32]) -> Result<()> {
        for (i, &server) in self.servers.iter().enumerate() {
            let (lo, hi) = self.shard_range(i);
            let start = Instant::now();
            loop {
                let v1 = self.read_word(server, VERSION_AT)?;
                // SAFETY: f32 slice viewed as bytes.
                let bytes = unsafe { std::slice::from_raw_parts_mut(out[lo..hi].as_mut_ptr() as *mut u8, (hi - lo) * 4) };
                self.win.read(server, PARAMS_AT, bytes)?;
                let v2 = self.read_word(server, VERSION_AT)?;
                if v1 == v2 && v1 % 2 == 0 {
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

    /// Whether the token is here now (never blocks).
    pub fn has_token(&self) -> bool {
        word(self.win.local(), TOKEN_AT).load(Ordering::Acquire) > self.taken
    }

    /// Takes the token that has arrived (see [`RemoteMemory::has_token`]), checking through
    /// rank 0's holder count that nobody else holds it.
    pub fn take_token(&mut self) -> Result<()> {
        if !self.has_token() {
            return Err(invalid("take_token: the token is not here"));
        }
        self.taken += 1;
        let others = self.win.fetch_add(0, HOLDERS_AT, 1)?;
        if others != 0 {
            return Err(Error::Protocol(format!("rank {}: token duplicated: {others} other holder(s) at the same time", self.rank)));
        }
        Ok(())
    }

    /// Passes the token to the next rank of the ring.
    pub fn pass_token(&self) -> Result<()> {
        self.win.fetch_add(0, HOLDERS_AT, u64::MAX)?;
        self.win.fetch_add((self.rank + 1) % self.world, TOKEN_AT, 1)?;
        Ok(())
    }

    /// Waits until the token arrives (fixed cyclic schedule). On the deadline, names the
    /// rank that holds it — the last in ring order to have received it — and whether that
    /// process is gone.
    pub fn wait_token(&self) -> Result<()> {
        let start = Instant::now();
        while !self.has_token() {
            if start.elapsed() > self.timeout {
                let e = self.diagnose_token(start.elapsed());
                // Leave the reason where later survivors look (we may exit before they do).
                if let Some((store, prefix)) = &self.reasons {
                    let _ = store.set(&self.reason_key(prefix, self.rank), e.to_string().as_bytes());
                }
                return Err(e);
            }
            std::thread::yield_now();
        }
        Ok(())
    }

    /// Who holds the token that never came. Token counts rise along the ring, so the holder
    /// follows the highest-numbered rank with the largest count; ranks that cannot be read
    /// any more (dead, or exited after failing themselves) are skipped, so that a late
    /// survivor still names the rank that died holding the token, not one that exited
    /// because of it.
    fn diagnose_token(&self, waited: Duration) -> Error {
        let counts: Vec<Option<u64>> = (0..self.world).map(|r| self.read_word(r, TOKEN_AT).ok()).collect();
        let max = counts.iter().flatten().copied().max().unwrap_or(0);
        let last_max = (0..self.world).rev().find(|&r| counts[r] == Some(max)).unwrap_or(0);
        let next = (last_max + 1) % self.world;
        let what = "token ring: waiting for the token";
        if counts[next].is_none() {
            // It may have exited after failing itself: then its own reason names the culprit.
            let first = self
                .reasons
                .as_ref()
                .and_then(|(store, prefix)| store.get(&self.reason_key(prefix, next), Instant::now() + Duration::from_millis(300)).ok().flatten());
            let cause = match first {
                Some(why) => format!("it received the token last and cannot be reached; it had failed first: {}", String::from_utf8_lossy(&why)),
                None => "it received the token last and cannot be reached".into(),
            };
            Error::PeerLost { rank: self.rank, peer: next, op: what.into(), cause }
        } else {
            self.gone(last_max, &format!("{what}, last received by rank {last_max}"), waited)
        }
    }

    fn reason_key(&self, prefix: &str, local: usize) -> String {
        crate::engine::failure_key(prefix, self.global.get(local).copied().unwrap_or(local))
    }

    /// Rank 0's count of current token holders (0 or 1 when all is well).
    pub fn holders(&self) -> Result<u64> {
        self.read_word(0, HOLDERS_AT)
    }
}

impl Drop for RemoteMemory {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.server.take() {
            let _ = t.join();
        }
    }
}

/// A shard's server thread: applies pushed gradients in arrival order, bracketing each
/// update with version bumps, then acknowledges the inbox.
fn serve(region: &Region, len: usize, shard_len: usize, workers: usize, rule: ApplyRule, lr: f32, stop: &AtomicBool) {
    let version = word(region, VERSION_AT);
    let applied = word(region, APPLIED_AT);
    let mut idle = 0u32;
    while !stop.load(Ordering::Acquire) {
        let mut worked = false;
        for w in 0..workers {
            let inbox = inbox_at(shard_len, w);
            let (seq, ack) = (word(region, inbox + INBOX_SEQ).load(Ordering::Acquire), word(region, inbox + INBOX_ACK).load(Ordering::Acquire));
            if seq == ack {
                continue;
            }
            let count = word(region, inbox + INBOX_COUNT).load(Ordering::Acquire).max(1) as f32;
            let scale = match rule {
                ApplyRule::Sum => lr,
                ApplyRule::Mean => lr / count,
            };
            version.fetch_add(1, Ordering::AcqRel); // odd: update in progress
                                                    // SAFETY: the parameters and this inbox lie inside the region; the worker does
                                                    // not touch its inbox until we acknowledge, and pulls retry across the update.
            unsafe {
                let p = std::slice::from_raw_parts_mut(region.as_ptr().add(PARAMS_AT) as *mut f32, len);
                let g = std::slice::from_raw_parts(region.as_ptr().add(inbox + INBOX_GRADS) as *const f32, len);
                p.iter_mut().zip(g).for_each(|(p, g)| *p -= scale * g);
            }
            version.fetch_add(1, Ordering::AcqRel); // even: stable
            applied.fetch_add(1, Ordering::AcqRel);
            word(region, inbox + INBOX_ACK).store(seq, Ordering::Release);
            worked = true;
        }
        if worked {
            idle = 0;
        } else {
            idle += 1;
            if idle < 64 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}
