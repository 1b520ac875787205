//! One-host allreduce through shared memory, in three forms chosen by size (see
//! [`shm_allreduce`]):
//!
//! - small (at most [`SMALL_MAX`]): one barrier; every rank reduces every input itself;
//! - staged: per segment of the buffer (at most the staging size): (1) every rank copies
//!   its input into its own staging area; (2) rank r reduces part r of every rank's
//!   staging area into its own part r, reading the peers' memory directly; (3) every rank
//!   copies each finished part from its owner's staging area into its output. Three
//!   barriers per segment, made of per-rank phase counters (no shared contended line);
//! - zero-copy (from [`ZERO_COPY_MIN`], where cross-memory attach is permitted): rank r
//!   reduces part r straight out of the peers' own buffers.
//!
//! The small form reads its peers' staging after its only barrier, while they may have
//! returned already; so it has an area of its own at the end of the staging area, which
//! the staged form never writes.

use super::reduce::{reduce_bytes, scale};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::transport::frame::{CallHeader, FrameHeader, FrameKind};
use crate::transport::shm::ShmDomain;
use crate::transport::Backoff;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Reduction block: every source's block is combined into the destination block while it
/// is still in L1/L2.
const BLOCK: usize = 32 << 10;

/// Waits shorter than this do not look for a dead peer in /proc (see `check_peer`).
const PROC_CHECK_AFTER: Duration = Duration::from_micros(100);

pub struct ShmCtx<'a> {
    pub dom: &'a ShmDomain,
    pub rank: usize,
    pub world: usize,
    pub call: CallHeader,
    pub deadline: Instant,
    pub abort: &'a AtomicBool,
    pub spin: Duration,
}

/// Encodes a call for publication in the shared control page.
pub fn encode_call(call: &CallHeader) -> [u8; crate::transport::frame::HEADER_LEN] {
    FrameHeader { kind: FrameKind::Data, call: *call, step: 0, len: 0 }.encode()
}

impl ShmCtx<'_> {
    /// Waits until every other rank's phase counter reaches `target`.
    fn wait_all(&self, target: u64) -> Result<()> {
        let backoff = Backoff::new(self.spin);
        for p in 0..self.world {
            if p == self.rank {
                continue;
            }
            let ph = self.dom.phase(p);
            let mut iter = 0u64;
            while ph.load(Ordering::Acquire) < target {
                iter += 1;
                if iter % 64 == 0 {
                    self.check_peer(p, backoff.idle())?;
                }
                backoff.pause();
            }
        }
        Ok(())
    }

    /// Checks every rank's published call against ours.
    fn check_calls(&self) -> Result<()> {
        for p in 0..self.world {
            let h = FrameHeader::decode(&self.dom.call_of(p)).map_err(|e| Error::Protocol(format!("rank {p}'s shared call header: {e}")))?;
            if h.call != self.call {
                return Err(Error::Mismatch { rank: self.rank, mine: self.call.to_string(), peer: p, theirs: h.call.to_string() });
            }
        }
        Ok(())
    }

    fn check_peer(&self, p: usize, waited: Duration) -> Result<()> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::Aborted { rank: self.rank, peer: self.rank, reason: "aborted locally".into() });
        }
        // The abort flag is a shared-memory read; asking /proc whether the process lives
        // costs microseconds, which a short wait cannot afford (the peer would arrive while
        // we sit in the syscall), so that waits until the wait is no longer short.
        let gone = if waited >= PROC_CHECK_AFTER { self.dom.peer_gone(p) } else { self.dom.aborted_reason(p) };
        if let Some(why) = gone {
            return Err(Error::PeerLost { rank: self.rank, peer: p, op: self.call.to_string(), cause: why });
        }
        // A peer that started a different call with the same sequence number will never
        // reach our phase: report the mismatch now instead of at the deadline.
        if let Ok(h) = FrameHeader::decode(&self.dom.call_of(p)) {
            if h.call.seq == self.call.seq && h.call != self.call {
                return Err(Error::Mismatch { rank: self.rank, mine: self.call.to_string(), peer: p, theirs: h.call.to_string() });
            }
        }
        if Instant::now() >= self.deadline {
            return Err(Error::Timeout { rank: self.rank, peer: p, op: format!("{} (shared-memory phase)", self.call), waited_ms: waited.as_millis() as u64 });
        }
        Ok(())
    }

    fn advance(&self, to: u64) {
        self.dom.phase(self.rank).store(to, Ordering::Release);
    }

    /// After a failed zero-copy call: waits until every peer has announced `done` (which
    /// it does only after its last write into our buffer), aborted or exited. A peer never
    /// waits for us on the way there, so this ends; the bound is for a peer that is frozen.
    fn let_writers_finish(&self, done: u64) {
        let until = Instant::now() + WRITERS_GRACE;
        for p in (0..self.world).filter(|&p| p != self.rank) {
            while self.dom.phase(p).load(Ordering::Acquire) < done && self.dom.peer_gone(p).is_none() {
                if Instant::now() >= until {
                    log::warn!("rank {}: rank {p} neither finished nor failed its part of {} within {WRITERS_GRACE:?}", self.rank, self.call);
                    return;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

/// Longest a failed zero-copy call waits for peers still writing into its buffer.
const WRITERS_GRACE: Duration = Duration::from_secs(2);

/// In-place allreduce of `buf` among all ranks of the domain (all on this host), in the
/// form its size calls for. Every rank picks the same: the sizes match (checked) and the
/// cross-memory attach permission was agreed at setup.
pub fn shm_allreduce(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    if buf.len() <= cx.small_capacity() && buf.len() * cx.world <= SMALL_READ_MAX {
        shm_allreduce_small(cx, buf, dtype, op)
    } else if buf.len() >= ZERO_COPY_MIN && cx.dom.cma {
        shm_allreduce_zero_copy(cx, buf, dtype, op)
    } else {
        shm_allreduce_staged(cx, buf, dtype, op)
    }
}

/// Staged allreduce (see the module comment).
fn shm_allreduce_staged(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let elem = dtype.size();
    let seg = cx.staged_capacity() / elem * elem;
    let mut base = cx.dom.phase(me).load(Ordering::Relaxed);
    let mut off = 0;
    loop {
        let len = (buf.len() - off).min(seg);
        let bounds = super::algos::part_bounds(len / elem, w, elem);
        // (1) Copy in, publish.
        // SAFETY: our own staging area, at least `seg` bytes; peers read it only after the
        // Release store below and stop before our next write (barrier base+3).
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(off), cx.dom.stage(me), len) };
        cx.advance(base + 1);
        cx.wait_all(base + 1)?;
        if off == 0 {
            cx.check_calls()?;
        }
        // (2) Reduce my part from every peer's staging area into mine.
        let (lo, hi) = (bounds[me], bounds[me + 1]);
        // SAFETY: part `me` of our staging area is written only by us in this phase; the
        // peers' parts `me` are only read by us until barrier base+2.
        let mine = unsafe { std::slice::from_raw_parts_mut(cx.dom.stage(me).add(lo), hi - lo) };
        for b in (0..mine.len()).step_by(BLOCK) {
            let e = (b + BLOCK).min(mine.len());
            for p in (0..w).filter(|&p| p != me) {
                // SAFETY: see above; the range lies in p's staging area.
                let theirs = unsafe { std::slice::from_raw_parts(cx.dom.stage(p).add(lo + b), e - b) };
                reduce_bytes(dtype, op, &mut mine[b..e], theirs);
            }
        }
        if op == ReduceOp::Avg {
            scale(dtype, mine, 1.0 / w as f64);
        }
        cx.advance(base + 2);
        cx.wait_all(base + 2)?;
        // (3) Copy every finished part out of its owner's staging area.
        for p in 0..w {
            let (lo, hi) = (bounds[p], bounds[p + 1]);
            // SAFETY: part p of p's staging area is final after barrier base+2 and is not
            // written again before barrier base+3.
            unsafe { std::ptr::copy_nonoverlapping(cx.dom.stage(p).add(lo), buf.as_mut_ptr().add(off + lo), hi - lo) };
        }
        cx.advance(base + 3);
        cx.wait_all(base + 3)?;
        base += 3;
        off += len;
        if off >= buf.len() {
            return Ok(());
        }
    }
}

/// Largest buffer for the one-barrier small form.
pub const SMALL_MAX: usize = 64 << 10;

/// The small form has every rank read every input (W·S bytes); beyond this the staged
/// form, where each rank reduces 1/W of them, wins. Alternating runs, 4 ranks: 4 KiB
/// 6.2-6.7 µs against 11.7-17.5 staged, 16 KiB 13-19 against 17, 32 KiB 22-32 against
/// 22-23, 64 KiB 39-48 against 34-42; 2 ranks: even at 64 KiB.
const SMALL_READ_MAX: usize = 128 << 10;

/// Room for the call header in front of each half of the small form's area (a cache line).
const SMALL_HEADER: usize = 64;

impl ShmCtx<'_> {
    /// Bytes of each of the small form's two halves: a call header and the data (the
    /// area is at most a quarter of the staging area; whole cache lines).
    fn small_half(&self) -> usize {
        (self.dom.stage_len() / 8).min(SMALL_HEADER + SMALL_MAX) / 64 * 64
    }

    /// Largest buffer the small form takes.
    fn small_capacity(&self) -> usize {
        self.small_half().saturating_sub(SMALL_HEADER)
    }

    /// Bytes of the staging area the staged form uses: all but the small form's area.
    fn staged_capacity(&self) -> usize {
        self.dom.stage_len() - 2 * self.small_half()
    }
}

/// Latency-optimised one-host allreduce for small buffers: one barrier instead of three.
/// Every rank copies its call header and its input into its small area, announces it,
/// waits for all, then reduces all inputs itself, in rank order, so every rank gets
/// bit-identical results. Consecutive calls alternate between the two halves of the small
/// area: a rank may only overwrite a half once every peer has arrived at the call after
/// the one that read it, which that later call's barrier guarantees (whatever form it
/// took). No other form writes this area. The call is checked against the header in the
/// half, not the control page: a peer may have returned and announced its next call.
fn shm_allreduce_small(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let (at, half) = (cx.staged_capacity(), cx.small_half());
    debug_assert!(buf.len() <= cx.small_capacity());
    let base = cx.dom.phase(me).load(Ordering::Relaxed);
    let slot = |r: usize| {
        // SAFETY: the half lies inside rank r's staging area, past the staged form's part.
        unsafe { cx.dom.stage(r).add(at + (base % 2) as usize * half) }
    };
    let header = encode_call(&cx.call);
    // SAFETY: our own half, header then data; see the function comment for why no peer
    // reads it now.
    unsafe {
        std::ptr::copy_nonoverlapping(header.as_ptr(), slot(me), header.len());
        std::ptr::copy_nonoverlapping(buf.as_ptr(), slot(me).add(SMALL_HEADER), buf.len());
    }
    cx.advance(base + 1);
    cx.wait_all(base + 1)?;
    // SAFETY (all reads below): every rank's half is complete (barrier above) and is not
    // rewritten before everyone has arrived at the next call.
    for p in (0..w).filter(|&p| p != me) {
        let mut theirs = [0u8; crate::transport::frame::HEADER_LEN];
        unsafe { std::ptr::copy_nonoverlapping(slot(p), theirs.as_mut_ptr(), theirs.len()) };
        if theirs != header {
            // A peer in another form of the call wrote no header here: name its call from
            // the control page, which it has not left yet (it waits for our next phase).
            cx.check_calls()?;
            return Err(Error::Protocol(format!("rank {p}'s shared call header does not match {} (a different size of allreduce?)", cx.call)));
        }
    }
    let len = buf.len();
    let data = |p: usize| unsafe { std::slice::from_raw_parts(slot(p).add(SMALL_HEADER), len) };
    // Rank 0's buffer already holds its input.
    if me != 0 {
        buf.copy_from_slice(data(0));
    }
    for p in 1..w {
        reduce_bytes(dtype, op, buf, data(p));
    }
    if op == ReduceOp::Avg {
        scale(dtype, buf, 1.0 / w as f64);
    }
    Ok(())
}

/// From this size on the zero-copy path wins; below it the staged copies stay in cache and
/// cross-memory attach's page pinning costs more than it saves (alternating runs at 4 MiB
/// and 4 ranks: staged 2.0-3.4 GB/s busbw against 2.1-2.6 zero-copy; at 2 ranks even).
pub const ZERO_COPY_MIN: usize = 8 << 20;

/// Bytes read from a peer per cross-memory-attach call in the reduce phase: the scratch
/// stays in L2 while it is combined.
const CMA_BLOCK: usize = 256 << 10;

/// Zero-copy one-host allreduce: rank r reduces part r straight out of the peers' own
/// buffers and writes each finished block straight into every peer's buffer, while it is
/// still in cache. A peer buffer in a shared region (`gradwire_alloc`) is mapped and used
/// in place; any other goes through cross-memory attach (a kernel copy through an L2-sized
/// scratch each way, plus pinning its pages). Bytes moved per rank: S read (its part of
/// every buffer), S written (its part of every buffer): 2 S, against 2.5 S (W=2) and
/// 2.75 S (W=4) when each rank reduces its part in place and then reads the other
/// finished parts from their owners. Only rank r touches part r of any buffer, so nothing
/// it writes is read by anyone else, and how it reaches a peer is its own choice. Two
/// barriers: all buffers published; all parts reduced and written (nobody reads or writes
/// our buffer any more).
fn shm_allreduce_zero_copy(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let base = cx.dom.phase(cx.rank).load(Ordering::Relaxed);
    cx.dom.publish_buffer(buf);
    cx.advance(base + 1);
    let done = reduce_and_write_parts(cx, buf, dtype, op, base);
    if let Err(e) = &done {
        // Peers that passed the first barrier may still be writing their parts into our
        // buffer: the caller must not get it back before they have finished, failed or
        // exited. We fail the communicator now rather than after returning (the engine
        // would), so that a peer doing the same does not wait for us.
        cx.dom.set_aborted(&e.to_string());
        cx.let_writers_finish(base + 2);
    }
    done
}

/// The zero-copy form after this rank's first announcement (phase `base + 1`).
fn reduce_and_write_parts(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, base: u64) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let elem = dtype.size();
    let bounds = super::algos::part_bounds(buf.len() / elem, w, elem);
    cx.wait_all(base + 1)?;
    cx.check_calls()?;
    let addrs: Vec<usize> = (0..w).map(|p| cx.dom.buffer_addr(p)).collect();
    let mapped: Vec<Option<*mut u8>> = (0..w).map(|p| if p == me { None } else { cx.dom.peer_buffer(p, buf.len()) }).collect();
    let lost =
        |p: usize, what: &str, e: std::io::Error| Error::PeerLost { rank: me, peer: p, op: cx.call.to_string(), cause: format!("{what} its buffer: {e}") };
    let (lo, hi) = (bounds[me], bounds[me + 1]);
    let mut scratch = vec![0u64; CMA_BLOCK / 8];
    // SAFETY: a u64 vector viewed as bytes.
    let scratch = unsafe { std::slice::from_raw_parts_mut(scratch.as_mut_ptr() as *mut u8, CMA_BLOCK) };
    let peers = || (0..w).filter(move |&p| p != me);
    let mut b = lo;
    while b < hi {
        let e = (b + CMA_BLOCK).min(hi);
        for p in peers() {
            match mapped[p] {
                // SAFETY: bytes b..e of p's buffer (part `me`), which only we touch until
                // the last barrier; the mapping outlives this call.
                Some(theirs) => reduce_bytes(dtype, op, &mut buf[b..e], unsafe { std::slice::from_raw_parts(theirs.add(b), e - b) }),
                None => {
                    cx.dom.read_peer(p, addrs[p] + b, &mut scratch[..e - b]).map_err(|err| lost(p, "reading", err))?;
                    reduce_bytes(dtype, op, &mut buf[b..e], &scratch[..e - b]);
                }
            }
        }
        if op == ReduceOp::Avg {
            scale(dtype, &mut buf[b..e], 1.0 / w as f64);
        }
        for p in peers() {
            match mapped[p] {
                // SAFETY: as above.
                Some(theirs) => unsafe { std::ptr::copy_nonoverlapping(buf[b..e].as_ptr(), theirs.add(b), e - b) },
                None => cx.dom.write_peer(p, addrs[p] + b, &buf[b..e]).map_err(|err| lost(p, "writing", err))?,
            }
        }
        b = e;
    }
    cx.advance(base + 2);
    cx.wait_all(base + 2)
}
