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
//! | 256 | shard lock: 0 free, else 1 + the rank applying an update |
//! | 320 | the shard's parameters (f32) |
//! | then | one inbox per worker: acknowledged word, then two slots (doorbell word, gradients) |
//!
//! A worker pushes by writing its gradients into the next slot of its inbox, then ringing
//! the slot's doorbell with one atomic add: push number, minibatch count and the shard
//! version its parameters came from, packed in one word (see `doorbell`), so that a push
//! costs one bulk write and one atomic. The shard's server thread applies slot after slot,
//! bumps the version around each update and acknowledges. Two slots let the worker write
//! push k+1 while the shard applies push k. A pull reads version, parameters, version, and
//! retries unless both versions are equal and even, so it never sees a half-applied update.
//!
//! On shared memory a worker reaches the shard's memory as directly as the server thread
//! does, so it applies its push itself, under the shard lock: one pass over memory instead
//! of a copy into the inbox and a second pass to apply it.
//!
//! The completion flag is an atomic rather than verbs' write-with-immediate on purpose: the
//! server polls memory on every transport alike and needs no receive queue or completion
//! queue of its own.

use crate::comm::Communicator;
use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use crate::transport::onesided::Window;
use crate::transport::Backoff;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN_AT: usize = 0;
const HOLDERS_AT: usize = 64;
const VERSION_AT: usize = 128;
const APPLIED_AT: usize = 192;
const LOCK_AT: usize = 256;
const PARAMS_AT: usize = 320;
/// Per inbox: pushes applied so far (written by the shard), then the two slots.
const INBOX_ACK: usize = 0;
const INBOX_SLOTS: usize = 64;
/// Per slot: the doorbell word (0 = empty), then the gradients.
const SLOT_GRADS: usize = 64;

/// How a shard applies a pushed gradient sum `a` accumulated over `c` minibatches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ApplyRule {
    /// θ −= η·a
    Sum,
    /// θ −= η·a/c
    Mean,
    /// θ −= η·a/(c·τ), τ = updates the shard applied since the worker's last pull (at least
    /// 1): the staleness-aware rule, the mean gradient scaled down by its staleness.
    Staleness,
}

/// Packs a doorbell word: bit 63 set (0 reads as "empty"), the push number mod 2^15 (only
/// the next one is ever expected), the minibatch count (24 bits, saturating) and the shard's
/// update count when the worker last pulled (mod 2^24: only differences matter).
fn doorbell(push: u64, count: u64, base: u64) -> u64 {
    (1 << 63) | ((push & 0x7FFF) << 48) | (count.min(0xFF_FFFF) << 24) | (base & 0xFF_FFFF)
}

/// The fields of a doorbell word: (push number mod 2^15, minibatch count, base).
fn doorbell_fields(d: u64) -> (u64, u64, u64) {
    ((d >> 48) & 0x7FFF, (d >> 24) & 0xFF_FFFF, d & 0xFF_FFFF)
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
    /// Per shard: pushes sent through the inbox (in-place pushes are complete on return).
    sent: Vec<u64>,
    /// Per shard: the last acknowledged count we saw, and its update count at our last pull.
    acked: Vec<u64>,
    pulled_at: Vec<u64>,
    stop: Arc<AtomicBool>,
    server: Option<std::thread::JoinHandle<()>>,
    rule: ApplyRule,
    lr: f32,
    /// Where a failing rank leaves its reason and a survivor looks it up (the store keys
    /// the engine uses for collectives), and the global rank of each rank.
    reasons: Option<(Arc<crate::bootstrap::StoreClient>, String)>,
    global: Vec<usize>,
}

fn slot_bytes(shard_len: usize) -> usize {
    (SLOT_GRADS + 4 * shard_len).next_multiple_of(64)
}

fn inbox_at(shard_len: usize, worker: usize) -> usize {
    (PARAMS_AT + 4 * shard_len).next_multiple_of(64) + worker * (INBOX_SLOTS + 2 * slot_bytes(shard_len))
}

/// Where push number `push` (from 1) of `worker` goes: slots alternate.
fn slot_at(shard_len: usize, worker: usize, push: u64) -> usize {
    inbox_at(shard_len, worker) + INBOX_SLOTS + (push % 2) as usize * slot_bytes(shard_len)
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
        // Workers that map the shard apply their pushes in place; a server thread is needed
        // only for workers behind a network.
        let server = my_shard.filter(|_| !win.all_mapped()).map(|i| {
            let (region, stop, len) = (region.clone(), stop.clone(), bounds[i + 1] - bounds[i]);
            std::thread::spawn(move || serve(&region, rank, len, shard_len, world, (rule, lr), &stop))
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
            sent: vec![0; servers.len()],
            acked: vec![0; servers.len()],
            pulled_at: vec![0; servers.len()],
            stop,
            server,
            rule,
            lr,
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

    /// Pushes the accumulated gradient `acc` (over `count` minibatches) to every shard:
    /// one bulk write into the next inbox slot and one atomic doorbell per shard. Waits
    /// (under the deadline) only while both slots are still being applied.
    pub fn push(&mut self, acc: &[f32], count: u64) -> Result<()> {
        if acc.len() != *self.bounds.last().unwrap_or(&0) {
            return Err(invalid(format!("push: {} values, the parameters have {}", acc.len(), self.bounds.last().unwrap_or(&0))));
        }
        for i in 0..self.servers.len() {
            if let Some(base) = self.win.mapped(self.servers[i]) {
                self.apply_in_place(i, base, acc, count)?;
                continue;
            }
            let push = self.sent[i] + 1;
            // The slot is free once the shard has applied its previous occupant, push − 2.
            self.wait_acked(i, push.saturating_sub(2), &format!("push to parameter shard {i} on rank {}", self.servers[i]))?;
            let (lo, hi) = self.shard_range(i);
            // SAFETY: f32 slice viewed as bytes.
            let bytes = unsafe { std::slice::from_raw_parts(acc[lo..hi].as_ptr() as *const u8, (hi - lo) * 4) };
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
        // SAFETY: `base` maps the shard's whole window, laid out as in the module docs; the
        // lock word is only ever touched atomically.
        let lock = unsafe { &*(base.add(LOCK_AT) as *const AtomicU64) };
        let start = Instant::now();
        let backoff = Backoff::new(Duration::ZERO);
        while lock.compare_exchange(0, self.rank as u64 + 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
            if start.elapsed() > self.timeout {
                let holder = lock.load(Ordering::Relaxed).saturating_sub(1) as usize;
                let what = format!("push to parameter shard {i} on rank {server}: the shard stayed locked by rank {holder}");
                return Err(self.gone(holder, &what, start.elapsed()));
            }
            backoff.pause();
        }
        let (lo, hi) = self.shard_range(i);
        // SAFETY: the shard's words and parameters lie inside the mapping; we hold the lock.
        unsafe { apply(base, &acc[lo..hi], self.rule, self.lr, count, self.pulled_at[i]) };
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
        for i in 0..self.servers.len() {
            self.wait_acked(i, self.sent[i], &format!("flush to parameter shard {i} on rank {}", self.servers[i]))?;
        }
        Ok(())
    }

    /// Reads the full parameter vector; never a half-applied update (seqlock).
    /// Also records each shard's update count, for the staleness-aware rule.
    pub fn pull(&mut self, out: &mut [f32]) -> Result<()> {
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

/// Applies one push to the shard whose window starts at `base`, bracketed by version bumps
/// (odd while the update is in progress, so pulls retry across it).
///
/// # Safety
/// `base` maps a whole shard window of at least `grads.len()` parameters, and the caller
/// holds the shard lock.
unsafe fn apply(base: *mut u8, grads: &[f32], rule: ApplyRule, lr: f32, count: u64, pulled_at: u64) {
    let version = &*(base.add(VERSION_AT) as *const AtomicU64);
    let applied = &*(base.add(APPLIED_AT) as *const AtomicU64);
    let done = applied.load(Ordering::Relaxed);
    let scale = match rule {
        ApplyRule::Sum => lr,
        ApplyRule::Mean => lr / count.max(1) as f32,
        ApplyRule::Staleness => lr / (count.max(1) * (done.wrapping_sub(pulled_at) & 0xFF_FFFF).max(1)) as f32,
    };
    version.fetch_add(1, Ordering::AcqRel);
    let params = std::slice::from_raw_parts_mut(base.add(PARAMS_AT) as *mut f32, grads.len());
    params.iter_mut().zip(grads).for_each(|(p, g)| *p -= scale * g);
    version.fetch_add(1, Ordering::AcqRel);
    applied.store(done + 1, Ordering::Release);
}

/// A shard's server thread: applies each remote worker's pushes in order (under the shard
/// lock, which in-place pushes from this host also take), then empties the slot and
/// acknowledges.
fn serve(region: &Region, me: usize, len: usize, shard_len: usize, workers: usize, (rule, lr): (ApplyRule, f32), stop: &AtomicBool) {
    let lock = word(region, LOCK_AT);
    // The thread shares its rank's core with that rank's communication (the tcp one-sided
    // service receiving the very pushes we wait for): poll in short naps, never by yielding
    // in a loop. Two inbox slots hide the nap from a streaming worker. A small timer slack
    // keeps the naps short.
    // SAFETY: prctl(PR_SET_TIMERSLACK) only changes this thread's timer rounding.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1000u64, 0u64, 0u64, 0u64) };
    while !stop.load(Ordering::Acquire) {
        let mut worked = false;
        for w in 0..workers {
            let ack = word(region, inbox_at(shard_len, w) + INBOX_ACK);
            let next = ack.load(Ordering::Relaxed) + 1;
            let slot = slot_at(shard_len, w, next);
            let bell = word(region, slot).load(Ordering::Acquire);
            if bell == 0 {
                continue;
            }
            let (push, count, pulled_at) = doorbell_fields(bell);
            if push != next & 0x7FFF {
                // Only a corrupted or foreign write gets here; skip it rather than apply
                // gradients twice or out of order. The worker then times out naming us.
                continue;
            }
            // A busy lock means an in-place push: try again on the next pass.
            if lock.compare_exchange(0, me as u64 + 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
                continue;
            }
            // SAFETY: the region is a whole shard window; we hold the lock; the worker does
            // not touch the slot again until we acknowledge.
            unsafe {
                let grads = std::slice::from_raw_parts(region.as_ptr().add(slot + SLOT_GRADS) as *const f32, len);
                apply(region.as_ptr(), grads, rule, lr, count, pulled_at);
            }
            lock.store(0, Ordering::Release);
            word(region, slot).store(0, Ordering::Release);
            ack.store(next, Ordering::Release);
            worked = true;
        }
        if !worked {
            std::thread::sleep(SERVER_NAP);
        }
    }
}

/// How long a shard's server thread naps between polls of its inboxes.
const SERVER_NAP: Duration = Duration::from_micros(20);
