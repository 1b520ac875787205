//! The staged form (see the module comment of `collective::shm`): per segment of about
//! 1 MiB, copy in, reduce one's part, copy out, through the ranks' staging areas.

use super::{ShmCtx, BLOCK};
use crate::collective::reduce::reduce_all;
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::mem::last_level_cache;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// Staged allreduce (see the module comment). A rank's own part does not pass through
/// staging on the way in: it is reduced in its buffer, then staged once for the peers
/// (one copy fewer than staging every part both ways). Segments of about 1 MiB keep the
/// staging areas in cache, which larger segments do not.
///
/// Returns how long the call took, less the wait for the peers to arrive at its first
/// barrier: what [`StoreChooser`] compares.
pub(super) fn shm_allreduce_staged(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, streaming: bool) -> Result<Duration> {
    let (w, me) = (cx.world, cx.rank);
    let elem = dtype.size();
    // Part p of every segment has the same slot in the staging areas, whatever the
    // segment's length.
    let slot_len = cx.slot_len()?;
    let slot = |p: usize| p * slot_len;
    let seg = slot_len * w;
    let mut base = cx.ctl.phase(me).load(Ordering::Relaxed);
    let mut off = 0;
    let others = || (0..w).filter(move |&p| p != me);
    // Timed: the first copy-in, then everything after the first barrier (not the wait for
    // the peers to arrive, which has nothing to do with the stores).
    let started = Instant::now();
    let (mut first_copy_in, mut since) = (Duration::ZERO, started);
    loop {
        let len = (buf.len() - off).min(seg);
        let bounds = crate::collective::algos::part_bounds(len / elem, w, elem);
        let part = |p: usize| bounds[p]..bounds[p + 1];
        // (1) Copy in the parts the peers reduce, publish.
        debug_assert!((0..w).all(|p| part(p).len() <= slot_len));
        for p in others() {
            // SAFETY: our own staging area, slot p (a part is at most a slot); peers read
            // it only after the Release store below and stop before barrier base+2. What
            // peers may still read of ours, from the segment before, is slot `me`.
            unsafe { copy_for_peers(cx.ctl.stage(me).add(slot(p)), &buf[off..][part(p)], streaming) };
        }
        if off == 0 {
            first_copy_in = started.elapsed();
        }
        cx.advance(base + 1);
        cx.wait_all(base + 1)?;
        if off == 0 {
            cx.check_calls()?;
            since = Instant::now();
        }
        // (2) Reduce my part of every peer's staging area into my buffer, block by block,
        // and stage each finished block for the peers while it is in cache.
        let mine = &mut buf[off..][part(me)];
        for b in (0..mine.len()).step_by(BLOCK) {
            let e = (b + BLOCK).min(mine.len());
            // SAFETY: slot `me` of every peer's staging area is only read, by us, until
            // barrier base+2; the range lies in it.
            let theirs = others().map(|p| unsafe { std::slice::from_raw_parts(cx.ctl.stage(p).add(slot(me) + b), e - b) });
            reduce_all(dtype, op, w, &mut mine[b..e], theirs);
            // SAFETY: slot `me` of our staging area: only we write it; peers read it only
            // after barrier base+2, and have finished reading it for the segment
            // before, since they have passed barrier base+1.
            unsafe { copy_for_peers(cx.ctl.stage(me).add(slot(me) + b), &mine[b..e], streaming) };
        }
        cx.advance(base + 2);
        cx.wait_all(base + 2)?;
        // (3) Copy the peers' finished parts out of their staging areas. No barrier after
        // it between segments: p writes slot p again only in phase (2) of its next segment,
        // after a barrier that we pass only once this copy is done.
        for p in others() {
            // SAFETY: slot p of p's staging area is final after barrier base+2 and is not
            // written again before our next barrier (above).
            unsafe { std::ptr::copy_nonoverlapping(cx.ctl.stage(p).add(slot(p)), buf.as_mut_ptr().add(off + bounds[p]), part(p).len()) };
        }
        base += 2;
        off += len;
        if off >= buf.len() {
            // The call ends with every copy-out done, as every other form ends: no later
            // call needs to reason about this one, and the time [`StoreChooser`] compares
            // ends at the same moment on every rank (without it, ranks timed differently
            // and fell out of step on their choice, which cost half as much again).
            cx.advance(base + 1);
            cx.wait_all(base + 1)?;
            return Ok(first_copy_in + since.elapsed());
        }
    }
}

/// Whether a call writes its output with streaming stores, given the bytes it works on
/// (send and receive; a broadcast's buffer, counted once: from 16 MiB, where the root's
/// and ours together first outgrow this host's cache, streaming lost). Past the last-level
/// cache the output is not read back from cache, and plain stores would first read every
/// line of it. (The staging areas take their own kind of stores: their segments stay in
/// cache with plain ones.)
pub(super) fn streams_out(bytes: usize) -> bool {
    bytes >= last_level_cache()
}

/// Copies `src` into the caller's `dst`, with streaming stores if `streaming`.
pub(super) fn copy_out(dst: &mut [u8], src: &[u8], streaming: bool) {
    assert_eq!(dst.len(), src.len());
    // SAFETY: `dst` is writable for `src.len()` bytes (a slice of that length), disjoint from `src`.
    unsafe { copy_for_peers(dst.as_mut_ptr(), src, streaming) }
}

/// Copies `src` to `dst` in our staging area, for peers to read: with non-temporal stores
/// when `streaming` (x86-64), so the lines go to memory instead of staying modified in this
/// core's cache, from where every peer's read has to fetch them. ([`copy_out`] writes
/// outputs too large for the cache with it too, fenced alike.) How fast that fetch is
/// changes on a virtual machine from one minute to the next (benches/peers/handoff.c): in
/// some minutes streaming stores are several times faster, in others plain stores win by
/// keeping everything in cache. Hence [`StoreChooser`].
///
/// # Safety
/// `dst..dst + src.len()` is writable and does not overlap `src`.
pub(super) unsafe fn copy_for_peers(dst: *mut u8, src: &[u8], streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if streaming {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = src.len();
        let head = dst.align_offset(16).min(n);
        let body_end = head + (n - head) / 16 * 16;
        // SAFETY: the first `head` bytes of both ranges (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head) };
        for i in (head..body_end).step_by(16) {
            // SAFETY: dst + i is 16-aligned and i + 16 <= n; SSE2 is part of x86-64.
            unsafe { _mm_stream_si128(dst.add(i) as *mut __m128i, _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i)) };
        }
        // SAFETY: the last bytes of both ranges (the caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(body_end), dst.add(body_end), n - body_end) };
        // Streaming stores are weakly ordered: make them visible before the phase store
        // that publishes them.
        // SAFETY: SSE2 is part of x86-64.
        unsafe { _mm_sfence() };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = streaming;
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
}
