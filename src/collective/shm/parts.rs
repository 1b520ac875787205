//! Reduce-scatter, allgather, all-to-all, reduce and broadcast on one host, through the
//! ranks' staging areas (every call below `LARGE_MIN`, and large calls of private buffers
//! unless cross-memory attach has timed faster; `pull` takes the others). Per segment (as
//! many bytes of every part as a slot holds):
//!
//! - reduce-scatter copies the parts its peers own into its slots, and after a barrier
//!   reduces its own part out of the peers' slots straight into the receive buffer (the
//!   first half of the staged allreduce, `staged`);
//! - all-to-all does the same with a copy for the reduction;
//! - allgather copies its part into its staging area, and after a barrier copies every
//!   peer's out (the staged allreduce's second half);
//! - reduce stages like reduce-scatter, reduces its part into its own slot, and after
//!   another barrier the root copies every finished part out.
//!
//! One more barrier per segment: nobody reads a staging area any more when its owner writes
//! the next segment into it. Broadcast instead pipelines its segments through the two
//! halves of the root's area (one writer, so no barrier per segment). What peers read is
//! written with plain or streaming stores, as a [`StoreChooser`](super::StoreChooser) per
//! collective has timed faster (as for the staged allreduce: in a slow minute of this host,
//! plain copies into staging ran at a third of the speed).

use super::staged::{copy_for_peers, copy_out, streams_out};
use super::{PeerBlocks, ScatterParts, ShmCtx, BLOCK};
use crate::collective::reduce::{reduce_all, reduce_all_from};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use std::sync::atomic::Ordering;

/// Runs the segments `0..n` in steps of `seg` bytes: each step `step(off, len)` of a
/// segment (the first writes this rank's share into its staging area, the later ones read
/// the peers') is followed by a barrier; the call headers are checked after the first
/// barrier of the first segment, where every rank is sure to be in this call.
fn by_segments(cx: &ShmCtx<'_>, n: usize, seg: usize, steps: &mut [&mut dyn FnMut(usize, usize)]) -> Result<()> {
    let mut phase = cx.ctl.phase(cx.rank).load(Ordering::Relaxed);
    let mut off = 0;
    loop {
        let len = (n - off).min(seg);
        for (i, step) in steps.iter_mut().enumerate() {
            step(off, len);
            phase += 1;
            cx.advance(phase);
            cx.wait_all(phase)?;
            if off == 0 && i == 0 {
                cx.check_calls()?;
            }
        }
        off += len;
        if off >= n {
            return Ok(());
        }
    }
}

/// Stages bytes `off..off + len` of every peer's block of our input (`block(p)`) in that
/// peer's slot of our staging area (slots of `slot` bytes): the first step of a
/// reduce-scatter's or an all-to-all's segment.
fn stage_blocks<'s>(cx: &ShmCtx<'_>, block: impl Fn(usize) -> &'s [u8], slot: usize, off: usize, len: usize, streaming: bool) {
    for p in (0..cx.world).filter(|&p| p != cx.rank) {
        // SAFETY: slot p of our own staging area (`len` <= a slot); peers read it only after
        // the barrier that follows, and have stopped reading what the segment before left
        // there (they passed the barrier that ended it).
        unsafe { copy_for_peers(cx.ctl.stage(cx.rank).add(p * slot), &block(p)[off..][..len], streaming) };
    }
}

/// Reduce-scatter: rank r gets the reduction of part r of every rank's input in its
/// output (in place, its own part).
pub(super) fn reduce_scatter(cx: &ShmCtx<'_>, parts: ScatterParts<'_>, dtype: DType, op: ReduceOp, streaming: bool) -> Result<()> {
    let (w, me, n) = (cx.world, cx.rank, parts.out.len());
    let slot = cx.slot_len()?;
    let others = || (0..w).filter(move |&p| p != me);
    let ScatterParts { peers, own, out } = parts;
    let mut stage = |off: usize, len: usize| stage_blocks(cx, |p| peers.of(p), slot, off, len, streaming);
    let mut take = |off: usize, len: usize| {
        let mine = &mut out[off..off + len];
        for b in (0..len).step_by(BLOCK) {
            let e = (b + BLOCK).min(len);
            // SAFETY: slot `me` of every peer's staging area holds this segment of part
            // `me` (first barrier) and is not rewritten before the segment's last barrier.
            let theirs = others().map(|p| unsafe { std::slice::from_raw_parts(cx.ctl.stage(p).add(me * slot + b), e - b) });
            match own {
                // Our part is the first operand, read where it lies (copying it into the
                // output first was a pass more over memory).
                Some(own) => reduce_all_from(dtype, op, w, &mut mine[b..e], &own[off + b..][..e - b], theirs),
                None => reduce_all(dtype, op, w, &mut mine[b..e], theirs),
            }
        }
    };
    by_segments(cx, n, slot, &mut [&mut stage, &mut take])
}

/// Reduce to `root`: `buf` is every rank's input and the root's result; the others' stay
/// as they are. Per segment: every rank stages the parts its peers own (as in
/// reduce-scatter) and, after a barrier, reduces its own part out of its buffer and the
/// peers' slots into its own slot of its staging area, which no peer reads until the
/// next barrier; then the root copies every finished part into its buffer.
pub(super) fn reduce(cx: &ShmCtx<'_>, buf: &mut [u8], root: usize, dtype: DType, op: ReduceOp, streaming: bool) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let elem = dtype.size();
    let slot = cx.slot_len()?;
    let seg = slot * w;
    let ptr = buf.as_mut_ptr();
    let part = |len: usize, p: usize| {
        let bounds = crate::collective::algos::part_bounds(len / elem, w, elem);
        bounds[p]..bounds[p + 1]
    };
    let others = || (0..w).filter(move |&p| p != me);
    let mut stage = |off: usize, len: usize| {
        for p in others() {
            let r = part(len, p);
            // SAFETY: slot p of our own staging area (a part is at most a slot); `off + r`
            // lies in `buf`, which only the root writes, in the segment's last step (after
            // its own staging of the segment, on this thread). Peers read the slot only
            // after the barrier that follows.
            unsafe { copy_for_peers(cx.ctl.stage(me).add(p * slot), std::slice::from_raw_parts(ptr.add(off + r.start), r.len()), streaming) };
        }
    };
    let mut reduce_mine = |off: usize, len: usize| {
        let r = part(len, me);
        // SAFETY: slot `me` of our own staging area: no peer reads it before the barrier
        // that follows (they read slot p of ours, p != me).
        let mine = unsafe { std::slice::from_raw_parts_mut(cx.ctl.stage(me).add(me * slot), r.len()) };
        // SAFETY: our input's part, in `buf`, which nobody writes during this step.
        let input = unsafe { std::slice::from_raw_parts(ptr.add(off + r.start), r.len()) };
        for b in (0..r.len()).step_by(BLOCK) {
            let e = (b + BLOCK).min(r.len());
            // SAFETY: slot `me` of every peer's staging area holds this segment of part `me`
            // (first barrier) and is not rewritten before the segment's last barrier.
            let theirs = others().map(|p| unsafe { std::slice::from_raw_parts(cx.ctl.stage(p).add(me * slot + b), e - b) });
            reduce_all_from(dtype, op, w, &mut mine[b..e], &input[b..e], theirs);
        }
    };
    let mut gather = |off: usize, len: usize| {
        if me == root {
            for p in 0..w {
                let r = part(len, p);
                // SAFETY: slot p of p's staging area holds the finished part p (second
                // barrier) until the segment's last barrier; `off + r` lies in `buf`, whose
                // bytes of this segment nobody reads any more.
                unsafe { std::ptr::copy_nonoverlapping(cx.ctl.stage(p).add(p * slot), ptr.add(off + r.start), r.len()) };
            }
        }
    };
    by_segments(cx, buf.len(), seg, &mut [&mut stage, &mut reduce_mine, &mut gather])
}

/// Allgather: every rank's `send` lands, in rank order, in every rank's output (ours in
/// `own`, unless in place: `own` None, `send` is our block of the output).
pub(super) fn allgather(cx: &ShmCtx<'_>, send: &[u8], mut own: Option<&mut [u8]>, mut peers: PeerBlocks<'_>, streaming: bool) -> Result<()> {
    let (w, me, n) = (cx.world, cx.rank, send.len());
    let stream_out = streams_out(n * w + own.as_ref().map_or(0, |_| n));
    let mut stage = |off: usize, len: usize| {
        // Our part goes into our staging area and, unless in place, into its place in the
        // output block by block, read from `send` once: the second copy finds the block
        // in cache.
        for b in (off..off + len).step_by(BLOCK) {
            let block = &send[b..(b + BLOCK).min(off + len)];
            // SAFETY: inside our own staging area (`len` <= the staged area); peers read
            // it only after the barrier that follows, and have stopped reading the segment
            // before (they passed the barrier that ended it).
            unsafe { copy_for_peers(cx.ctl.stage(me).add(b - off), block, streaming) };
            if let Some(own) = own.as_deref_mut() {
                copy_out(&mut own[b..][..block.len()], block, stream_out);
            }
        }
    };
    let mut take = |off: usize, len: usize| {
        for p in (0..w).filter(|&p| p != me) {
            // SAFETY: p's staging area holds this segment of its part (first barrier) and
            // is not rewritten before the segment's last barrier.
            let theirs = unsafe { std::slice::from_raw_parts(cx.ctl.stage(p), len) };
            copy_out(&mut peers.of(p)[off..][..len], theirs, stream_out);
        }
    };
    // One part per rank and segment: the whole staged area serves ours.
    by_segments(cx, n, cx.slot_len()? * w, &mut [&mut stage, &mut take])
}

/// All-to-all: `send` and `recv` hold W blocks of `recv.len() / W` bytes; block p of our
/// `send` goes to rank p, block p of `recv` comes from rank p.
pub(super) fn alltoall(cx: &ShmCtx<'_>, send: &[u8], recv: &mut [u8], streaming: bool) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let n = recv.len() / w;
    let stream_out = streams_out(send.len() + recv.len());
    copy_out(&mut recv[me * n..][..n], &send[me * n..][..n], stream_out);
    let slot = cx.slot_len()?;
    let others = || (0..w).filter(move |&p| p != me);
    let mut stage = |off: usize, len: usize| stage_blocks(cx, |p| &send[p * n..][..n], slot, off, len, streaming);
    let mut take = |off: usize, len: usize| {
        for p in others() {
            // SAFETY: slot `me` of p's staging area holds this segment of p's block for us
            // (first barrier) and is not rewritten before the segment's last barrier.
            let theirs = unsafe { std::slice::from_raw_parts(cx.ctl.stage(p).add(me * slot), len) };
            copy_out(&mut recv[p * n + off..][..len], theirs, stream_out);
        }
    };
    by_segments(cx, n, slot, &mut [&mut stage, &mut take])
}

/// Segments a broadcast is cut into at least, where its size allows (see [`broadcast`]).
const BROADCAST_SEGMENTS: usize = 8;
/// The smallest broadcast segment: below it a segment's phase handoff costs more than
/// the overlap saves.
const MIN_BROADCAST_SEGMENT: usize = 64 << 10;

/// Broadcast: the root's `buf` into every rank's, pipelined through the two halves of the
/// root's staged area: the root writes segment k + 1 into one half while the others copy
/// segment k out of the other (one barrier per segment would serialise the two copies
/// and fall behind the links' pipelined chain). Phase base + k + 1 says, from the root, that segment k is in its half k % 2;
/// from any other rank, that it has copied segment k out. The call ends with one barrier
/// for all (every rank then stands at the same phase). A call the halves would cut into
/// fewer than [`BROADCAST_SEGMENTS`] segments goes in smaller ones (of at least
/// [`MIN_BROADCAST_SEGMENT`] bytes), so that the two copies overlap there too.
pub(super) fn broadcast(cx: &ShmCtx<'_>, buf: &mut [u8], root: usize, streaming: bool) -> Result<()> {
    let (me, n) = (cx.rank, buf.len());
    let half = cx.slot_len()? * cx.world / 2 / 64 * 64;
    if half == 0 {
        return Err(crate::error::invalid(format!("GRADWIRE_SHM_STAGE_BYTES={} leaves no staging room for a broadcast", cx.ctl.stage_len())));
    }
    // A 1 MiB broadcast in two 576 KiB halves would overlap only half of the two copies.
    let seg = n.div_ceil(BROADCAST_SEGMENTS).next_multiple_of(64).max(MIN_BROADCAST_SEGMENT).min(half);
    let base = cx.ctl.phase(me).load(Ordering::Relaxed);
    let segments = n.div_ceil(seg).max(1) as u64;
    let stream_out = streams_out(n);
    let area = |k: u64| {
        // SAFETY: half k % 2 of the root's staged area (2 halves fit in it).
        unsafe { cx.ctl.stage(root).add((k % 2) as usize * half) }
    };
    for k in 0..segments {
        let (off, len) = (k as usize * seg, (n - (k as usize * seg).min(n)).min(seg));
        if me == root {
            if k >= 2 {
                // Half k % 2 held segment k − 2: every rank has copied it out.
                cx.wait_all(base + k - 1)?;
            }
            // SAFETY: our own staging area's half k % 2, which nobody reads now (above)
            // until we announce it; `off + len <= n`.
            unsafe { copy_for_peers(area(k), &buf[off..off + len], streaming) };
        } else {
            cx.wait_for(root, base + k + 1)?;
            if k == 0 {
                // Only the root is sure to be in this call; it checks everyone's at the end.
                cx.check_call_of(root)?;
            }
            // SAFETY: the root wrote segment k into half k % 2 (its phase) and rewrites it
            // only once we announce below that we have copied it.
            let theirs = unsafe { std::slice::from_raw_parts(area(k), len) };
            copy_out(&mut buf[off..off + len], theirs, stream_out);
        }
        cx.advance(base + k + 1);
    }
    if me == root {
        // Every rank has copied the last segment; they are all still in this call (they
        // wait for our last phase below), so their call headers are this call's.
        cx.wait_all(base + segments)?;
        cx.check_calls()?;
    }
    cx.advance(base + segments + 1);
    cx.wait_all(base + segments + 1)
}
