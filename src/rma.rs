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
//! of a copy into the inbox and a second pass to apply it. Over tcp a push is one
//! accumulate request: the shard's one-sided service applies the gradients, under the same
//! lock, chunk by chunk as they arrive, while they are in cache (the inbox and server
//! thread would take a second pass over memory on the same core). The inbox serves verbs,
//! where the NIC writes and the shard's thread applies. A tcp push whose sender dies or
//! stalls past the deadline half-way leaves what arrived applied and uncounted (the rest of
//! that worker's gradient is lost with it), and frees the shard for the others.
//!
//! The completion flag is an atomic rather than verbs' write-with-immediate on purpose: the
//! server polls memory on every transport alike and needs no receive queue or completion
//! queue of its own.

use crate::comm::Communicator;
use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use crate::transport::onesided::{Accumulate, AccumulateError, Window};
use crate::transport::Backoff;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TOKEN_AT: usize = 0;
const HOLDERS_AT: usize = 64;
const VERSION_AT: usize = 128;
const APPLIED_AT: usize = 192;
const LOCK_AT: usize = 256;
/// Where a shard's parameters start in its window (public so that benchmarks can time raw
/// one-sided operations on the same offsets: a page-aligned source runs the kernel's tcp
/// copy at half speed here, see BENCHMARKS.md).
pub const PARAMS_AT: usize = 320;
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
    /// The token's passes counted over every rank at the last look, and when they last
    /// changed: a token that stops moving for the deadline is a stalled ring.
    token_moves: (u64, Instant),
    /// When [`RemoteMemory::poll_token`] last counted the passes.
    token_counted: Instant,
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
        agree_on_shape(comm, n, servers)?;
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
        let accumulator = my_shard.map(|i| {
            let len = bounds[i + 1] - bounds[i];
            Arc::new(ShardAccumulator { region: region.clone(), len, rule, lr, timeout: comm.config().timeout }) as Arc<dyn Accumulate>
        });
        let win = Arc::new(comm.expose_with(region.clone(), accumulator)?);
        let stop = Arc::new(AtomicBool::new(false));
        // Workers that map the shard apply their pushes in place, and tcp workers' pushes
        // are applied as they arrive; a server thread is needed only for verbs workers.
        let polled = (0..world).any(|p| win.mapped(p).is_none() && !win.accumulates(p));
        let server = my_shard.filter(|_| polled).map(|i| {
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
            token_moves: (0, Instant::now()),
            token_counted: Instant::now(),
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

    /// Whether the token is here (the dynamic-delay schedule, which never waits for it);
    /// fails when it has not moved anywhere in the ring for the deadline (its holder died,
    /// stopped, or did not take its turn for that long), naming the holder. Counts the
    /// passes at most every 1/8 deadline.
    pub fn poll_token(&mut self) -> Result<bool> {
        if self.has_token() {
            return Ok(true);
        }
        let now = Instant::now();
        if now.duration_since(self.token_counted) < (self.timeout / 8).max(Duration::from_millis(10)) {
            return Ok(false);
        }
        self.token_counted = now;
        let passes = (0..self.world).try_fold(0u64, |sum, r| self.read_word(r, TOKEN_AT).map(|c| sum.wrapping_add(c)));
        let passes = self.noted(passes)?;
        if passes != self.token_moves.0 {
            self.token_moves = (passes, now);
        } else if now.duration_since(self.token_moves.1) > self.timeout {
            return self.noted(Err(self.diagnose_token(now.duration_since(self.token_moves.1))));
        }
        Ok(false)
    }

    /// Waits until the token arrives (fixed cyclic schedule). On the deadline, names the
    /// rank that holds it — the last in ring order to have received it — and whether that
    /// process is gone; a peer on this host that dies meanwhile is noticed within 20 ms
    /// (one behind a network, when a one-sided operation to it fails).
    pub fn wait_token(&self) -> Result<()> {
        let start = Instant::now();
        while !self.has_token() {
            if start.elapsed() > self.timeout {
                return self.noted(Err(self.diagnose_token(start.elapsed())));
            }
            let alive = (0..self.world).try_for_each(|p| self.win.alive(p, "token ring: waiting for the token"));
            self.noted(alive)?;
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
            // It may have exited after failing itself: then `noted` adds its reason.
            Error::PeerLost { rank: self.rank, peer: next, op: what.into(), cause: "it received the token last and cannot be reached".into() }
        } else {
            self.gone(last_max, &format!("{what}, last received by rank {last_max}"), waited)
        }
    }

    /// Passes `r` through; an error is first left where later survivors look (we may exit
    /// before they do) and, when it names a peer that failed before us and said why, it
    /// carries that reason: the survivors of one death name the rank that died, not the
    /// ranks that exited because of it.
    fn noted<T>(&self, r: Result<T>) -> Result<T> {
        let Err(mut e) = r else { return r };
        let Some((store, prefix)) = &self.reasons else { return Err(e) };
        if let Error::PeerLost { peer, cause, .. } | Error::Timeout { peer, op: cause, .. } = &mut e {
            if let Ok(Some(why)) = store.get(&self.reason_key(prefix, *peer), Instant::now() + Duration::from_millis(300)) {
                *cause = format!("{cause}; it had failed first: {}", String::from_utf8_lossy(&why));
            }
        }
        let _ = store.set(&self.reason_key(prefix, self.rank), e.to_string().as_bytes());
        Err(e)
    }

    fn reason_key(&self, prefix: &str, local: usize) -> String {
        crate::bootstrap::store::failure_key(prefix, self.global.get(local).copied().unwrap_or(local))
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

/// Checks that every rank passed the same number of parameters and the same servers: the
/// shards' layout follows from both, and a rank that mapped a shard of another size would
/// write outside it. Both travel as f64 (exact below 2^53; the servers as a 52-bit hash).
fn agree_on_shape(comm: &Communicator, params: usize, servers: &[usize]) -> Result<()> {
    let hash = servers.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &s| (h ^ s as u64).wrapping_mul(0x0100_0000_01b3)) >> 12;
    let mine = [params as f64, hash as f64];
    let mut all = vec![0f64; 2 * comm.size()];
    comm.allgather(&mine, &mut all)?;
    match all.chunks(2).position(|theirs| theirs != mine) {
        None => Ok(()),
        Some(r) => Err(Error::Config(format!(
            "parameter-server mismatch: rank {r} set up {} parameters{}, this rank {params} on servers {servers:?}; every rank must pass the same",
            all[2 * r],
            if all[2 * r + 1] == mine[1] { "" } else { " on other servers" }
        ))),
    }
}

/// Takes a shard's lock for `rank` (0 free, else 1 + the rank applying an update). On the
/// deadline, returns the holder and how long we waited.
fn lock_shard(lock: &AtomicU64, rank: usize, timeout: Duration) -> std::result::Result<(), (usize, Duration)> {
    let backoff = Backoff::new(Duration::ZERO);
    while lock.compare_exchange(0, rank as u64 + 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
        if backoff.idle() > timeout {
            return Err((lock.load(Ordering::Relaxed).saturating_sub(1) as usize, backoff.idle()));
        }
        backoff.pause();
    }
    Ok(())
}

/// One push being applied to a shard: bracketed by version bumps (odd while in progress,
/// so pulls retry across it).
struct Update<'a> {
    version: &'a AtomicU64,
    applied: &'a AtomicU64,
    done: u64,
    params: *mut f32,
    scale: f32,
}

impl Update<'_> {
    /// Starts applying a push of `count` minibatches based on the shard's update number
    /// `pulled_at`.
    ///
    /// # Safety
    /// `base` maps a whole shard window and the caller holds the shard lock until `finish`.
    unsafe fn begin(base: *mut u8, rule: ApplyRule, lr: f32, count: u64, pulled_at: u64) -> Self {
        let version = &*(base.add(VERSION_AT) as *const AtomicU64);
        let applied = &*(base.add(APPLIED_AT) as *const AtomicU64);
        let done = applied.load(Ordering::Relaxed);
        let scale = match rule {
            ApplyRule::Sum => lr,
            ApplyRule::Mean => lr / count.max(1) as f32,
            ApplyRule::Staleness => lr / (count.max(1) * (done.wrapping_sub(pulled_at) & 0xFF_FFFF).max(1)) as f32,
        };
        version.fetch_add(1, Ordering::AcqRel);
        Update { version, applied, done, params: base.add(PARAMS_AT) as *mut f32, scale }
    }

    /// θ[at..] −= scale · grads.
    ///
    /// # Safety
    /// `at + grads.len()` is within the shard.
    unsafe fn add(&self, at: usize, grads: &[f32]) {
        let params = std::slice::from_raw_parts_mut(self.params.add(at), grads.len());
        params.iter_mut().zip(grads).for_each(|(p, g)| *p -= self.scale * g);
    }

    /// Ends the update: pulls may read again; counted as applied if `complete` (a push whose
    /// sender vanished half-way is not).
    fn finish(self, complete: bool) {
        self.version.fetch_add(1, Ordering::AcqRel);
        if complete {
            self.applied.store(self.done + 1, Ordering::Release);
        }
    }
}

/// The shard's side of pushes over tcp (see the module docs): run by the one-sided service
/// thread that receives them.
struct ShardAccumulator {
    region: Arc<Region>,
    len: usize,
    rule: ApplyRule,
    lr: f32,
    timeout: Duration,
}

/// Gradients received per chunk of an accumulated push: small enough to stay in cache
/// between the receive and the update, large enough to keep system calls rare.
const ACCUMULATE_CHUNK: usize = 64 * 1024;

impl Accumulate for ShardAccumulator {
    fn accumulate(&self, tag: u64, off: usize, len: usize, recv: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>) -> std::result::Result<(), AccumulateError> {
        if off != PARAMS_AT || len != 4 * self.len {
            return Err(AccumulateError::Refused(format!("a push must cover the shard's {} parameters at {PARAMS_AT}, not {len} bytes at {off}", self.len)));
        }
        let (worker, count, pulled_at) = doorbell_fields(tag);
        if let Err((holder, waited)) = lock_shard(word(&self.region, LOCK_AT), worker as usize, self.timeout) {
            return Err(AccumulateError::Refused(format!("the shard stayed locked by rank {holder} for {} ms", waited.as_millis())));
        }
        let base = self.region.as_ptr();
        // SAFETY: the region is a whole shard window; we hold the lock.
        let update = unsafe { Update::begin(base, self.rule, self.lr, count, pulled_at) };
        let mut chunk = vec![0f32; ACCUMULATE_CHUNK / 4];
        let mut receive_and_add = || -> std::io::Result<()> {
            for at in (0..self.len).step_by(chunk.len()) {
                let n = (self.len - at).min(chunk.len());
                // SAFETY: f32 buffer viewed as bytes.
                recv(unsafe { std::slice::from_raw_parts_mut(chunk.as_mut_ptr() as *mut u8, n * 4) })?;
                // SAFETY: at + n ≤ the shard's length.
                unsafe { update.add(at, &chunk[..n]) };
            }
            Ok(())
        };
        let outcome = receive_and_add();
        update.finish(outcome.is_ok());
        word(&self.region, LOCK_AT).store(0, Ordering::Release);
        Ok(outcome?)
    }
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
                let update = Update::begin(region.as_ptr(), rule, lr, count, pulled_at);
                update.add(0, grads);
                update.finish(true);
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
