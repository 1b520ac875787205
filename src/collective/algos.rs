//! Collective algorithms over point-to-point links (any transport), each documented with
//! its cost in steps (α) and bytes a rank sends (β), S = buffer bytes, W = ranks.

use super::reduce::{reduce_bytes, scale};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::transport::frame::CallHeader;
use crate::transport::{Links, RecvOp, SendOp, Sink};
use std::time::Instant;

/// What an algorithm needs: the links, the call being run, its deadline.
pub struct Ctx<'a> {
    pub links: &'a mut Links,
    pub call: CallHeader,
    pub deadline: Instant,
    pub rank: usize,
    pub world: usize,
    pub dtype: DType,
    pub op: ReduceOp,
}

impl Ctx<'_> {
    fn exchange(&mut self, sends: &mut [SendOp<'_>], recvs: &mut [RecvOp<'_>]) -> Result<()> {
        self.links.exchange(&self.call, sends, recvs, self.deadline)
    }

    fn modw(&self, x: isize) -> usize {
        x.rem_euclid(self.world as isize) as usize
    }
}

/// Element-balanced split of `count` elements into `w` parts, as byte offsets (w+1 entries).
pub fn part_bounds(count: usize, w: usize, elem: usize) -> Vec<usize> {
    (0..=w).map(|i| (count * i / w) * elem).collect()
}

/// A mutable view of `[lo, hi)` of `base`.
///
/// # Safety
/// `base` must be valid for `hi` bytes, and the caller must not create overlapping views
/// that are used at the same time.
unsafe fn view<'a>(base: *mut u8, lo: usize, hi: usize) -> &'a mut [u8] {
    std::slice::from_raw_parts_mut(base.add(lo), hi - lo)
}

/// Ring reduce-scatter over parts given by `bounds`: W−1 steps; at step s rank r sends part
/// r−s+shift to r+1 and reduces part r−s−1+shift arriving from r−1 into place.
/// Afterwards rank r holds the reduced part r+1+shift. Cost (W−1)α + (W−1)/W·Sβ.
pub fn ring_reduce_scatter(cx: &mut Ctx<'_>, buf: &mut [u8], bounds: &[usize], shift: isize, step0: u32) -> Result<()> {
    let (w, r) = (cx.world, cx.rank as isize);
    let (next, prev) = ((cx.rank + 1) % w, (cx.rank + w - 1) % w);
    let (dtype, op) = (cx.dtype, cx.op);
    let red = move |d: &mut [u8], s: &[u8]| reduce_bytes(dtype, op, d, s);
    let base = buf.as_mut_ptr();
    for s in 0..w.saturating_sub(1) {
        let sp = cx.modw(r - s as isize + shift);
        let rp = cx.modw(r - s as isize - 1 + shift);
        // SAFETY: sp != rp (w >= 2), so the two views are disjoint parts of `buf`.
        let (sbuf, rbuf) = unsafe { (view(base, bounds[sp], bounds[sp + 1]), view(base, bounds[rp], bounds[rp + 1])) };
        let step = step0 + s as u32;
        cx.exchange(
            &mut [SendOp { peer: next, step, data: sbuf }],
            &mut [RecvOp { peer: prev, step, sink: Sink::Reduce { dst: rbuf, elem: dtype.size(), reduce: &red } }],
        )?;
    }
    Ok(())
}

/// Ring allgather: rank r starts owning part r+own; W−1 steps circulate every part.
/// Cost (W−1)α + (W−1)/W·Sβ.
pub fn ring_allgather(cx: &mut Ctx<'_>, buf: &mut [u8], bounds: &[usize], own: isize, step0: u32) -> Result<()> {
    let (w, r) = (cx.world, cx.rank as isize);
    let (next, prev) = ((cx.rank + 1) % w, (cx.rank + w - 1) % w);
    let base = buf.as_mut_ptr();
    for s in 0..w.saturating_sub(1) {
        let sp = cx.modw(r + own - s as isize);
        let rp = cx.modw(r + own - s as isize - 1);
        // SAFETY: sp != rp, disjoint parts of `buf`.
        let (sbuf, rbuf) = unsafe { (view(base, bounds[sp], bounds[sp + 1]), view(base, bounds[rp], bounds[rp + 1])) };
        let step = step0 + s as u32;
        cx.exchange(&mut [SendOp { peer: next, step, data: sbuf }], &mut [RecvOp { peer: prev, step, sink: Sink::Copy(rbuf) }])?;
    }
    Ok(())
}

/// Ring allreduce (bandwidth-optimal for large buffers): reduce-scatter then allgather.
/// Cost 2(W−1)α + 2(W−1)/W·Sβ. Every rank ends with bit-identical data because each part
/// is finished by exactly one rank and then copied.
pub fn ring_allreduce(cx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
    let w = cx.world;
    let elem = cx.dtype.size();
    let bounds = part_bounds(buf.len() / elem, w, elem);
    ring_reduce_scatter(cx, buf, &bounds, 0, 0)?;
    let owned = (cx.rank + 1) % w;
    if cx.op == ReduceOp::Avg {
        scale(cx.dtype, &mut buf[bounds[owned]..bounds[owned + 1]], 1.0 / w as f64);
    }
    ring_allgather(cx, buf, &bounds, 1, w as u32)
}

/// Recursive doubling (latency-optimal for small buffers): ⌈log2 W⌉ (+2 when W is not a
/// power of two) steps of whole-buffer exchanges. Cost ⌈log2 W⌉(α + Sβ). Partners combine
/// the same two values, so every rank ends bit-identical.
pub fn recursive_doubling_allreduce(cx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
    let (w, r) = (cx.world, cx.rank);
    let (dtype, op) = (cx.dtype, cx.op);
    let red = move |d: &mut [u8], s: &[u8]| reduce_bytes(dtype, op, d, s);
    let p2 = 1usize << (usize::BITS - 1 - w.leading_zeros());
    let extra = w - p2;
    // Fold: ranks p2.. hand their data to rank r-p2 and wait for the result.
    if r >= p2 {
        cx.exchange(&mut [SendOp { peer: r - p2, step: 0, data: buf }], &mut [])?;
        return cx.exchange(&mut [], &mut [RecvOp { peer: r - p2, step: 99, sink: Sink::Copy(buf) }]);
    }
    if r < extra {
        cx.exchange(&mut [], &mut [RecvOp { peer: r + p2, step: 0, sink: Sink::Reduce { dst: buf, elem: dtype.size(), reduce: &red } }])?;
    }
    let mut tmp = vec![0u8; buf.len()];
    let mut mask = 1;
    let mut step = 1;
    while mask < p2 {
        let partner = r ^ mask;
        cx.exchange(&mut [SendOp { peer: partner, step, data: buf }], &mut [RecvOp { peer: partner, step, sink: Sink::Copy(&mut tmp) }])?;
        reduce_bytes(dtype, op, buf, &tmp);
        mask <<= 1;
        step += 1;
    }
    if op == ReduceOp::Avg {
        scale(dtype, buf, 1.0 / w as f64);
    }
    if r < extra {
        cx.exchange(&mut [SendOp { peer: r + p2, step: 99, data: buf }], &mut [])?;
    }
    Ok(())
}

/// Binomial-tree broadcast: ⌈log2 W⌉ steps of the whole buffer. Cost ⌈log2 W⌉(α + Sβ).
pub fn binomial_broadcast(cx: &mut Ctx<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let w = cx.world;
    let v = (cx.rank + w - root) % w;
    let real = |x: usize| (x + root) % w;
    let mut mask = 1;
    while mask < w {
        if v & mask != 0 {
            cx.exchange(&mut [], &mut [RecvOp { peer: real(v - mask), step: 0, sink: Sink::Copy(buf) }])?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if v + mask < w {
            cx.exchange(&mut [SendOp { peer: real(v + mask), step: 0, data: buf }], &mut [])?;
        }
        mask >>= 1;
    }
    Ok(())
}

/// Pipelined chain broadcast for large buffers: the buffer moves along root → root+1 → …
/// in `pieces`; each rank forwards piece k while receiving piece k+1.
/// Cost (pieces + W − 2)α + Sβ (about S/B, independent of W).
pub fn chain_broadcast(cx: &mut Ctx<'_>, buf: &mut [u8], root: usize, piece: usize) -> Result<()> {
    let w = cx.world;
    let v = (cx.rank + w - root) % w;
    let (next, prev) = ((cx.rank + 1) % w, (cx.rank + w - 1) % w);
    let elem = cx.dtype.size();
    let piece = piece.max(elem) / elem * elem;
    let n = buf.len().div_ceil(piece).max(1);
    let len = buf.len();
    let bound = |k: usize| (k * piece).min(len);
    let base = buf.as_mut_ptr();
    let last = v == w - 1;
    // Step k: the root sends piece k; every other rank receives piece k and (unless it is
    // the last in the chain) forwards piece k-1.
    for k in 0..=n {
        let (send_piece, recv_piece) = if v == 0 { ((k < n).then_some(k), None) } else { ((!last && k >= 1).then(|| k - 1), (k < n).then_some(k)) };
        // SAFETY: pieces k and k-1 are disjoint ranges of `buf`.
        let mut sends: Vec<SendOp<'_>> =
            send_piece.map(|p| SendOp { peer: next, step: p as u32, data: unsafe { view(base, bound(p), bound(p + 1)) } }).into_iter().collect();
        let mut recvs: Vec<RecvOp<'_>> =
            recv_piece.map(|p| RecvOp { peer: prev, step: p as u32, sink: Sink::Copy(unsafe { view(base, bound(p), bound(p + 1)) }) }).into_iter().collect();
        if !sends.is_empty() || !recvs.is_empty() {
            cx.exchange(&mut sends, &mut recvs)?;
        }
    }
    Ok(())
}

/// Binomial-tree reduce to `root` on a private copy (non-roots keep their input).
/// Cost ⌈log2 W⌉(α + Sβ).
pub fn binomial_reduce(cx: &mut Ctx<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let w = cx.world;
    let v = (cx.rank + w - root) % w;
    let real = |x: usize| (x + root) % w;
    let (dtype, op) = (cx.dtype, cx.op);
    let red = move |d: &mut [u8], s: &[u8]| reduce_bytes(dtype, op, d, s);
    let mut work = if v == 0 { Vec::new() } else { buf.to_vec() };
    let acc: &mut [u8] = if v == 0 { buf } else { &mut work };
    let mut mask = 1;
    while mask < w {
        if v & mask != 0 {
            cx.exchange(&mut [SendOp { peer: real(v - mask), step: mask.trailing_zeros(), data: acc }], &mut [])?;
            return Ok(());
        }
        if v + mask < w {
            cx.exchange(
                &mut [],
                &mut [RecvOp { peer: real(v + mask), step: mask.trailing_zeros(), sink: Sink::Reduce { dst: acc, elem: dtype.size(), reduce: &red } }],
            )?;
        }
        mask <<= 1;
    }
    if op == ReduceOp::Avg {
        scale(dtype, acc, 1.0 / w as f64);
    }
    Ok(())
}

/// Dissemination barrier: ⌈log2 W⌉ rounds of empty messages. Cost ⌈log2 W⌉α.
pub fn dissemination_barrier(cx: &mut Ctx<'_>) -> Result<()> {
    let (w, r) = (cx.world, cx.rank);
    let mut dist = 1;
    let mut step = 0;
    while dist < w {
        cx.exchange(&mut [SendOp { peer: (r + dist) % w, step, data: &[] }], &mut [RecvOp { peer: (r + w - dist) % w, step, sink: Sink::Copy(&mut []) }])?;
        dist <<= 1;
        step += 1;
    }
    Ok(())
}
