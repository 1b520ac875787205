//! Reduce-scatter and allgather on one host, through the ranks' staging areas: the two
//! halves of the staged allreduce (`staged`), each a collective of its own. Per segment
//! (as many bytes of every part as a slot holds): reduce-scatter copies the parts the peers
//! own into its slots, and after one barrier reduces its own part out of the peers' slots
//! straight into the receive buffer; allgather copies its part into its staging area, and
//! after one barrier copies every peer's out. One more barrier per segment: nobody reads a
//! staging area any more when its owner writes the next segment into it.

use super::ShmCtx;
use crate::collective::reduce::reduce_all;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;

/// Reduction block: every source's block is combined into the destination block while it
/// is still in L1/L2.
const BLOCK: usize = 32 << 10;

/// Bytes of one part a segment moves: a slot of the staged form's area per rank, whole
/// cache lines where there is room, and always a multiple of every element size.
fn slot_len(cx: &ShmCtx<'_>) -> Result<usize> {
    let slot = match cx.staged_capacity() / cx.world {
        n if n >= 64 => n / 64 * 64,
        n => n / 8 * 8,
    };
    if slot == 0 {
        return Err(Error::InvalidArgument(format!("GRADWIRE_SHM_STAGE_BYTES={} leaves no staging room for {} ranks", cx.ctl.stage_len(), cx.world)));
    }
    Ok(slot)
}

/// Reduce-scatter: `send` holds W parts of `recv.len()` bytes; rank r gets the reduction of
/// part r of every rank's `send` in `recv`.
pub(super) fn reduce_scatter(cx: &ShmCtx<'_>, send: &[u8], recv: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, me, n) = (cx.world, cx.rank, recv.len());
    debug_assert_eq!(send.len(), n * w);
    let slot = slot_len(cx)?;
    let mut base = cx.ctl.phase(me).load(Ordering::Relaxed);
    let others = || (0..w).filter(move |&p| p != me);
    let mut off = 0;
    loop {
        let len = (n - off).min(slot);
        for p in others() {
            // SAFETY: slot p of our own staging area (`len` <= a slot); peers read it only
            // after the Release store below, and have stopped reading what the segment
            // before left there (they passed the barrier that ended it).
            unsafe { std::ptr::copy_nonoverlapping(send[p * n + off..][..len].as_ptr(), cx.ctl.stage(me).add(p * slot), len) };
        }
        cx.advance(base + 1);
        cx.wait_all(base + 1)?;
        if off == 0 {
            cx.check_calls()?;
        }
        let mine = &mut recv[off..off + len];
        mine.copy_from_slice(&send[me * n + off..][..len]);
        for b in (0..len).step_by(BLOCK) {
            let e = (b + BLOCK).min(len);
            // SAFETY: slot `me` of every peer's staging area holds this segment of part
            // `me` (barrier base+1) and is not rewritten before barrier base+2.
            let theirs = others().map(|p| unsafe { std::slice::from_raw_parts(cx.ctl.stage(p).add(me * slot + b), e - b) });
            reduce_all(dtype, op, w, &mut mine[b..e], theirs);
        }
        cx.advance(base + 2);
        cx.wait_all(base + 2)?;
        base += 2;
        off += len;
        if off >= n {
            return Ok(());
        }
    }
}

/// Allgather: every rank's `send` lands, in rank order, in every rank's `recv`.
pub(super) fn allgather(cx: &ShmCtx<'_>, send: &[u8], recv: &mut [u8]) -> Result<()> {
    let (w, me, n) = (cx.world, cx.rank, send.len());
    debug_assert_eq!(recv.len(), n * w);
    // One part per rank and segment: the whole staged area serves ours.
    let seg = slot_len(cx)? * w;
    let mut base = cx.ctl.phase(me).load(Ordering::Relaxed);
    recv[me * n..][..n].copy_from_slice(send);
    let mut off = 0;
    loop {
        let len = (n - off).min(seg);
        // SAFETY: the start of our own staging area (`len` <= the staged area); peers read
        // it only after the Release store below, and have stopped reading the segment
        // before (they passed the barrier that ended it).
        unsafe { std::ptr::copy_nonoverlapping(send[off..].as_ptr(), cx.ctl.stage(me), len) };
        cx.advance(base + 1);
        cx.wait_all(base + 1)?;
        if off == 0 {
            cx.check_calls()?;
        }
        for p in (0..w).filter(|&p| p != me) {
            // SAFETY: p's staging area holds this segment of its part (barrier base+1) and
            // is not rewritten before barrier base+2.
            let theirs = unsafe { std::slice::from_raw_parts(cx.ctl.stage(p), len) };
            recv[p * n + off..][..len].copy_from_slice(theirs);
        }
        cx.advance(base + 2);
        cx.wait_all(base + 2)?;
        base += 2;
        off += len;
        if off >= n {
            return Ok(());
        }
    }
}
