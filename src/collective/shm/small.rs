//! The small form (see the module comment of `collective::shm`): one barrier, every rank
//! reduces every input itself.

use super::{encode_call, ShmCtx, SMALL_HEADER};
use crate::collective::reduce::reduce_all;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;

/// Latency-optimised one-host allreduce for small buffers: one barrier instead of the
/// staged form's three or more.
/// Every rank copies its call header and its input into its small area, announces it,
/// waits for all, then reduces all inputs itself, in rank order, so every rank gets
/// bit-identical results. Consecutive calls alternate between the two halves of the small
/// area: a rank may only overwrite a half once every peer has arrived at the call after
/// the one that read it, which that later call's barrier guarantees (whatever form it
/// took). No other form writes this area. The call is checked against the header in the
/// half, not the control page: a peer may have returned and announced its next call.
pub(super) fn shm_allreduce_small(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let (at, half) = (cx.staged_capacity(), cx.small_half());
    debug_assert!(buf.len() <= cx.small_capacity());
    let base = cx.ctl.phase(me).load(Ordering::Relaxed);
    let slot = |r: usize| {
        // SAFETY: the half lies inside rank r's staging area, past the staged form's part.
        unsafe { cx.ctl.stage(r).add(at + (base % 2) as usize * half) }
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
        // SAFETY: as above: every rank's half is complete and stays until the next call.
        unsafe { std::ptr::copy_nonoverlapping(slot(p), theirs.as_mut_ptr(), theirs.len()) };
        if theirs != header {
            // A peer in another form of the call wrote no header here: name its call from
            // the control page, which it has not left yet (it waits for our next phase).
            cx.check_calls()?;
            return Err(Error::Protocol(format!("rank {p}'s shared call header does not match {} (a different size of allreduce?)", cx.call)));
        }
    }
    let len = buf.len();
    // SAFETY: as above: every rank's half is complete and stays until the next call.
    let data = |p: usize| unsafe { std::slice::from_raw_parts(slot(p).add(SMALL_HEADER), len) };
    // Rank 0's buffer already holds its input.
    if me != 0 {
        buf.copy_from_slice(data(0));
    }
    reduce_all(dtype, op, w, buf, (1..w).map(data));
    Ok(())
}
