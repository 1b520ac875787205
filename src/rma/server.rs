//! A shard's side: the lock pushes apply under, the one-sided accumulate that applies a
//! tcp push as it arrives, and the server thread that applies inbox slots.

use super::{doorbell_fields, inbox_at, slot_at, word, ApplyRule, APPLIED_AT, INBOX_ACK, LOCK_AT, PARAMS_AT, SLOT_GRADS, VERSION_AT};
use crate::mem::Region;
use crate::transport::onesided::{Accumulate, AccumulateError};
use crate::transport::Backoff;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Takes a shard's lock for `rank` (0 free, else 1 + the rank applying an update). On the
/// deadline, returns the holder and how long we waited.
pub(super) fn lock_shard(lock: &AtomicU64, rank: usize, timeout: Duration) -> std::result::Result<(), (usize, Duration)> {
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
pub(super) struct Update<'a> {
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
    pub(super) unsafe fn begin(base: *mut u8, rule: ApplyRule, lr: f32, count: u64, pulled_at: u64) -> Self {
        // SAFETY: 8-aligned words of the shard window (the caller's contract), which
        // outlives the update.
        let (version, applied) = unsafe { (&*(base.add(VERSION_AT) as *const AtomicU64), &*(base.add(APPLIED_AT) as *const AtomicU64)) };
        let done = applied.load(Ordering::Relaxed);
        let scale = match rule {
            ApplyRule::Sum => lr,
            ApplyRule::Mean => lr / count.max(1) as f32,
            ApplyRule::Staleness => lr / (count.max(1) * (done.wrapping_sub(pulled_at) & 0xFF_FFFF).max(1)) as f32,
        };
        version.fetch_add(1, Ordering::AcqRel);
        // SAFETY: the parameters lie in the shard window (the caller's contract).
        let params = unsafe { base.add(PARAMS_AT) as *mut f32 };
        Update { version, applied, done, params, scale }
    }

    /// θ[at..] −= scale · grads.
    ///
    /// # Safety
    /// `at + grads.len()` is within the shard.
    pub(super) unsafe fn add(&self, at: usize, grads: &[f32]) {
        // SAFETY: within the shard (the caller's contract), whose lock we hold.
        let params = unsafe { std::slice::from_raw_parts_mut(self.params.add(at), grads.len()) };
        params.iter_mut().zip(grads).for_each(|(p, g)| *p -= self.scale * g);
    }

    /// Ends the update: pulls may read again; counted as applied if `complete` (a push whose
    /// sender vanished half-way is not).
    pub(super) fn finish(self, complete: bool) {
        self.version.fetch_add(1, Ordering::AcqRel);
        if complete {
            self.applied.store(self.done + 1, Ordering::Release);
        }
    }
}

/// The shard's side of pushes over tcp (see the module docs): run by the one-sided service
/// thread that receives them.
pub(super) struct ShardAccumulator {
    pub(super) region: Arc<Region>,
    pub(super) len: usize,
    pub(super) rule: ApplyRule,
    pub(super) lr: f32,
    pub(super) timeout: Duration,
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
pub(super) fn serve(region: &Region, me: usize, len: usize, shard_len: usize, workers: usize, (rule, lr): (ApplyRule, f32), stop: &AtomicBool) {
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
