//! Remote-memory layer: parameter-server shards and the token ring of the dynamic-delay
//! cyclic gradient update (docs/algorithms.md §3), on the one-sided operations of every
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

mod server;
mod shard;
mod token;

use crate::comm::Communicator;
use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use crate::transport::onesided::{Accumulate, Window};
use server::{serve, ShardAccumulator};
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
/// copy at about half speed).
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
        let reasons = comm.rendezvous.store.clone().map(|s| (s, comm.rendezvous.prefix.clone()));
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
