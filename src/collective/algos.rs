//! Collective algorithms over point-to-point links (any transport), each documented with
//! its cost in steps (α) and bytes a rank sends (β), S = buffer bytes, W = ranks.

use super::reduce::{finish, reduce_all, reduce_all_from, reduce_bytes, reduce_bytes_from};
use crate::dtype::{DType, ReduceOp};
use crate::error::Result;
use crate::transport::frame::CallHeader;
use crate::transport::{Links, RecvOp, SendOp, Sink, Span};
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
    /// `dst = op(dst, src)` in this call's dtype and op: a reduce step.
    fn combine(&self) -> impl Fn(&mut [u8], &[u8]) + 'static {
        let (dtype, op) = (self.dtype, self.op);
        move |d: &mut [u8], s: &[u8]| reduce_bytes(dtype, op, d, s)
    }

    /// The reduce step that finishes each element: an average also divides there, once.
    fn combine_last(&self) -> impl Fn(&mut [u8], &[u8]) + 'static {
        let (dtype, op, w) = (self.dtype, self.op, self.world);
        move |d: &mut [u8], s: &[u8]| reduce_all(dtype, op, w, d, [s])
    }

    /// `dst = op(a, src)`, in one pass: a reduce step whose other operand is not in `dst`.
    fn combine_from(&self) -> impl Fn(&mut [u8], &[u8], &[u8]) + 'static {
        let (dtype, op) = (self.dtype, self.op);
        move |d: &mut [u8], a: &[u8], s: &[u8]| reduce_bytes_from(dtype, op, d, a, s)
    }

    /// [`Self::combine_from`] as the step that finishes each element.
    fn combine_last_from(&self) -> impl Fn(&mut [u8], &[u8], &[u8]) + 'static {
        let (dtype, op, w) = (self.dtype, self.op, self.world);
        move |d: &mut [u8], a: &[u8], s: &[u8]| reduce_all_from(dtype, op, w, d, a, [s])
    }

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
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut(base.add(lo), hi - lo) }
}

/// The steps of a ring over the parts given by `bounds`: at step g rank r sends part
/// r − g + `first` to r+1 and receives part r − g − 1 + `first` from r−1, reducing it into
/// place (or, given an `input`, combining it with the input's part there; the last reduce
/// step may land in `finished`) for the first `reduce_steps` steps and copying it after.
/// The receive of step g is what step g+1 forwards, so a reduce-scatter followed by an
/// allgather is one ring of 2(W−1) steps. An `Avg` is divided by W as the last reduce step
/// completes each part.
pub struct RingSteps<'b> {
    pub bounds: &'b [usize],
    pub first: isize,
    pub steps: usize,
    pub reduce_steps: usize,
    /// The call's own input, where it is not already in the buffer: the first step sends
    /// from it, so the ring starts at once. With reduce steps it is laid out as the buffer
    /// and every reduce step combines it with what arrives ([`Sink::ReduceFrom`]), so it is
    /// never copied into the buffer. Without (an allgather) it is this rank's part, which
    /// no step then touches in the buffer: it is copied into place beside the exchange, a
    /// piece whenever no link is ready.
    pub input: Option<&'b [u8]>,
    /// Where the part this rank finishes (at the last reduce step) lands instead of its
    /// place in the buffer: a reduce-scatter's output. Only for rings that end there.
    pub finished: Option<&'b mut [u8]>,
}

/// Runs `ring` pipelined: every part is cut into chunks of about `chunk` bytes (at most
/// [`MAX_RING_CHUNKS`] per part), and a chunk is forwarded as soon as its bytes have arrived
/// at the previous step, not when the whole step is done. A rank's link then stays busy
/// across step boundaries (the synchronous ring idles at each one until the slowest
/// neighbour catches up), and reducing one chunk overlaps with moving the next. All steps
/// are one exchange whose sends wait for the receives they forward. Cost: steps·C messages
/// of S/(W·C) bytes, the bytes of the plain ring (steps/W · Sβ); the pipeline fills in one
/// chunk.
pub fn ring_pipelined(cx: &mut Ctx<'_>, buf: &mut [u8], ring: RingSteps<'_>, chunk: usize) -> Result<()> {
    let (w, r) = (cx.world, cx.rank as isize);
    let (next, prev) = ((cx.rank + 1) % w, (cx.rank + w - 1) % w);
    let elem = cx.dtype.size();
    let (red, red_last) = (cx.combine(), cx.combine_last());
    let (red_from, red_last_from) = (cx.combine_from(), cx.combine_last_from());
    let bounds = ring.bounds;
    assert!(bounds.len() == w + 1 && bounds[w] <= buf.len(), "ring bounds must cover {w} parts of the buffer");
    // Where `input` starts in the buffer: this rank's part without reduce steps.
    let at = if ring.reduce_steps == 0 { bounds[cx.modw(r + ring.first)] } else { 0 };
    assert!(ring.input.is_none_or(|i| at + i.len() <= buf.len()), "a ring's input must lie in its buffer");
    // The part finished at the last reduce step is never forwarded when the ring ends there.
    let finished_part = cx.modw(r - ring.reduce_steps as isize + ring.first);
    let finished = ring.finished.map(|f| {
        assert!(ring.steps == ring.reduce_steps && f.len() == bounds[finished_part + 1] - bounds[finished_part], "a finished part's place must fit it");
        f.as_mut_ptr()
    });
    // Both ends of a link derive the same chunking from the same bounds. Links with a
    // rendezvous (verbs) stream a large payload themselves, and a chunk below the
    // rendezvous size would go through their credit ring instead: on soft-RoCE, 16 MiB at 2
    // ranks ran at 55 % of ib_write_bw in 1 MiB chunks. Those links keep parts whole.
    let largest = bounds.windows(2).map(|b| b[1] - b[0]).max().unwrap_or(0);
    let chunks_on = |peer: usize| {
        if cx.links.rendezvous_from(peer).is_some() {
            1
        } else {
            largest.div_ceil(chunk.max(elem)).clamp(1, MAX_RING_CHUNKS)
        }
    };
    let (c_out, c_in) = (chunks_on(next), chunks_on(prev));
    let base = buf.as_mut_ptr();
    let mut sends = Vec::with_capacity(ring.steps * c_out);
    let mut recvs = Vec::with_capacity(ring.steps * c_in);
    for g in 0..ring.steps {
        let sp = cx.modw(r - g as isize + ring.first);
        let rp = cx.modw(r - g as isize - 1 + ring.first);
        for k in 0..c_out {
            let (lo, hi) = chunk_of(bounds, sp, k, c_out, elem);
            // The receive of the previous step that brings this chunk's last byte (receives
            // from one peer complete in order, so all of it is here then).
            let after = (g > 0).then(|| (g - 1) * c_in + chunk_bringing(bounds, sp, hi, c_in, elem));
            // SAFETY: the range lies in `buf`, borrowed by this function. Ranges shared
            // between operations (a received chunk is forwarded at the next step; an
            // allgather receive overwrites bytes sent earlier) are never worked on at the
            // same time: a forwarding send waits for its receive (`after`), and bytes come
            // back around the ring only after our send of them has completed.
            let data = unsafe { Span::raw(base.add(lo), hi - lo) };
            sends.push(match ring.input {
                // The first step sends this rank's own part, still unreduced.
                Some(input) if g == 0 => SendOp::new(next, k as u32, &input[lo - at..hi - at]),
                _ => SendOp::forwarding(next, (g * c_out + k) as u32, data, after),
            });
        }
        for j in 0..c_in {
            let (lo, hi) = chunk_of(bounds, rp, j, c_in, elem);
            let last_reduce = g + 1 == ring.reduce_steps;
            // SAFETY: as above; a finished part's place is `finished`, borrowed by `ring`,
            // into which its chunks are laid out as in the part.
            let dst = unsafe {
                match finished {
                    Some(f) if last_reduce => Span::raw(f.add(lo - bounds[rp]), hi - lo),
                    _ => Span::raw(base.add(lo), hi - lo),
                }
            };
            let sink = match ring.input {
                _ if g + 1 > ring.reduce_steps => Sink::Copy(dst),
                Some(input) => Sink::ReduceFrom { dst, with: &input[lo..hi], elem, reduce: if last_reduce { &red_last_from } else { &red_from } },
                None => Sink::Reduce { dst, elem, reduce: if last_reduce { &red_last } else { &red } },
            };
            recvs.push(RecvOp { peer: prev, step: (g * c_in + j) as u32, sink });
        }
    }
    let (Some(input), 0) = (ring.input, ring.reduce_steps) else {
        return cx.exchange(&mut sends, &mut recvs);
    };
    // SAFETY: bytes `at..at + input.len()` of `buf` are the input's place, which no send or
    // receive of this ring touches (its first step sends from `input`): a borrow of its own.
    let place = unsafe { std::slice::from_raw_parts_mut(base.add(at), input.len()) };
    cx.links.exchange_copying(&cx.call, &mut sends, &mut recvs, cx.deadline, input, place)
}

/// Byte range of chunk `k` of `c` of part `part` (element-balanced, like the parts).
fn chunk_of(bounds: &[usize], part: usize, k: usize, c: usize, elem: usize) -> (usize, usize) {
    let (lo, n) = (bounds[part], (bounds[part + 1] - bounds[part]) / elem);
    (lo + n * k / c * elem, lo + n * (k + 1) / c * elem)
}

/// The first of `c` chunks of `part` that ends at or after byte `end`: the receive a
/// forwarding send of the bytes up to `end` waits for (the two ends of a rank may chunk
/// differently when only one of its links has a rendezvous).
fn chunk_bringing(bounds: &[usize], part: usize, end: usize, c: usize, elem: usize) -> usize {
    (0..c).find(|&j| chunk_of(bounds, part, j, c, elem).1 >= end).unwrap_or(c - 1)
}

/// Most chunks a ring part is cut into: bounds the exchange's bookkeeping.
pub const MAX_RING_CHUNKS: usize = 64;

/// Ring reduce-scatter of `input` (parts by `bounds`): W−1 steps; rank r's reduced (for
/// `Avg`, also divided) part r lands in `out`. The parts passed on lie in `work` (as long
/// as the input), each written once: the input's part combined with what arrived. Cost
/// (W−1)α + (W−1)/W·Sβ.
pub fn ring_reduce_scatter(cx: &mut Ctx<'_>, work: &mut [u8], input: &[u8], out: &mut [u8], bounds: &[usize], chunk: usize) -> Result<()> {
    let steps = cx.world - 1;
    let ring = RingSteps { bounds, first: -1, steps, reduce_steps: steps, input: Some(input), finished: Some(out) };
    ring_pipelined(cx, work, ring, chunk)
}

/// Ring allgather: rank r starts owning part r+own (in `buf`, or given as `input`, copied
/// into place while the ring runs); W−1 steps circulate every part. Cost (W−1)α +
/// (W−1)/W·Sβ.
pub fn ring_allgather(cx: &mut Ctx<'_>, buf: &mut [u8], input: Option<&[u8]>, bounds: &[usize], own: isize, chunk: usize) -> Result<()> {
    let ring = RingSteps { bounds, first: own, steps: cx.world - 1, reduce_steps: 0, input, finished: None };
    ring_pipelined(cx, buf, ring, chunk)
}

/// Ring allreduce (bandwidth-optimal for large buffers): reduce-scatter then allgather, as
/// one pipelined ring. Cost 2(W−1)α + 2(W−1)/W·Sβ. Every rank ends with bit-identical
/// data because each part is finished by exactly one rank and then copied. Out of place
/// (`input` given) the input is read where it lies, never copied into `buf`.
pub fn ring_allreduce(cx: &mut Ctx<'_>, buf: &mut [u8], input: Option<&[u8]>, chunk: usize) -> Result<()> {
    let w = cx.world;
    let elem = cx.dtype.size();
    let bounds = part_bounds(buf.len() / elem, w, elem);
    let ring = RingSteps { bounds: &bounds, first: 0, steps: 2 * (w - 1), reduce_steps: w - 1, input, finished: None };
    ring_pipelined(cx, buf, ring, chunk)
}

/// Allreduce of f16/bf16 that rounds each element once, as [`reduce_all`] does where every
/// copy is at hand (pairwise steps would round W−1 times): part p of every rank's buffer
/// goes straight to rank p, which reduces the W copies in f32 and rounds once; a ring
/// allgather then spreads the parts. The ring's bytes ((W−1)/W·S each way) in W steps, not
/// 2(W−1). Below `small` bytes, one step instead: every rank sends its whole buffer to
/// every other ((W−1)·S) and reduces all W copies in rank order, so every rank computes
/// the same bits.
pub fn half_allreduce(cx: &mut Ctx<'_>, buf: &mut [u8], small: usize, chunk: usize) -> Result<()> {
    let (w, me, dtype, op) = (cx.world, cx.rank, cx.dtype, cx.op);
    if buf.len() < small {
        let len = buf.len();
        let mut copies = vec![0u8; len * w];
        copies[me * len..(me + 1) * len].copy_from_slice(buf);
        {
            let mut sends: Vec<SendOp> = (0..w).filter(|&p| p != me).map(|p| SendOp::new(p, 0, buf)).collect();
            let mut rest = &mut copies[..];
            let mut recvs = Vec::with_capacity(w - 1);
            for p in 0..w {
                let (copy, tail) = std::mem::take(&mut rest).split_at_mut(len);
                rest = tail;
                if p != me {
                    recvs.push(RecvOp { peer: p, step: 0, sink: Sink::Copy(copy.into()) });
                }
            }
            cx.exchange(&mut sends, &mut recvs)?;
        }
        buf.copy_from_slice(&copies[..len]);
        reduce_all(dtype, op, w, buf, (1..w).map(|p| &copies[p * len..(p + 1) * len]));
        return Ok(());
    }
    let bounds = part_bounds(buf.len() / dtype.size(), w, dtype.size());
    direct_reduce_scatter(cx, buf, &bounds)?;
    ring_allgather(cx, buf, None, &bounds, 0, chunk)
}

/// Reduce-scatter that rounds each element once (for f16/bf16): part p of every rank's
/// buffer goes straight to rank p, all at once, and rank p reduces the W copies with
/// [`reduce_all`] into its own part of `buf` (its copy first, then the others' in rank
/// order). One step; the ring's bytes, (W−1)/W·S.
pub fn direct_reduce_scatter(cx: &mut Ctx<'_>, buf: &mut [u8], bounds: &[usize]) -> Result<()> {
    let (w, me, dtype, op) = (cx.world, cx.rank, cx.dtype, cx.op);
    let part = bounds[me + 1] - bounds[me];
    let mut copies = vec![0u8; part * (w - 1)];
    {
        let mut sends: Vec<SendOp> = (0..w).filter(|&p| p != me).map(|p| SendOp::new(p, 0, &buf[bounds[p]..bounds[p + 1]])).collect();
        let mut rest = &mut copies[..];
        let mut recvs = Vec::with_capacity(w - 1);
        for p in (0..w).filter(|&p| p != me) {
            let (copy, tail) = std::mem::take(&mut rest).split_at_mut(part);
            rest = tail;
            recvs.push(RecvOp { peer: p, step: 0, sink: Sink::Copy(copy.into()) });
        }
        cx.exchange(&mut sends, &mut recvs)?;
    }
    reduce_all(dtype, op, w, &mut buf[bounds[me]..bounds[me + 1]], (0..w - 1).map(|i| &copies[i * part..(i + 1) * part]));
    Ok(())
}

/// Recursive doubling (latency-optimal for small buffers): ⌈log2 W⌉ (+2 when W is not a
/// power of two) steps of whole-buffer exchanges. Cost ⌈log2 W⌉(α + Sβ). Partners combine
/// the same two values, so every rank ends bit-identical.
pub fn recursive_doubling_allreduce(cx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
    folded_to_power_of_two(cx, buf, |cx, buf, p2| {
        let (dtype, op, r) = (cx.dtype, cx.op, cx.rank);
        let mut tmp = vec![0u8; buf.len()];
        let mut mask = 1;
        let mut step = 1;
        while mask < p2 {
            let partner = r ^ mask;
            cx.exchange(&mut [SendOp::new(partner, step, buf)], &mut [RecvOp { peer: partner, step, sink: Sink::Copy((&mut tmp[..]).into()) }])?;
            reduce_bytes(dtype, op, buf, &tmp);
            mask <<= 1;
            step += 1;
        }
        finish(dtype, op, buf, cx.world);
        Ok(())
    })
}

/// Runs `allreduce` (given the power of two P it works on) over ranks 0..P, the largest
/// power of two ≤ W: ranks P.. first hand their data to rank r−P, which reduces it in,
/// and get the result from it at the end (+2 whole-buffer steps when W is not a power
/// of two).
fn folded_to_power_of_two(cx: &mut Ctx<'_>, buf: &mut [u8], allreduce: impl FnOnce(&mut Ctx<'_>, &mut [u8], usize) -> Result<()>) -> Result<()> {
    let (w, r) = (cx.world, cx.rank);
    let p2 = 1usize << (usize::BITS - 1 - w.leading_zeros());
    if r >= p2 {
        cx.exchange(&mut [SendOp::new(r - p2, 0, buf)], &mut [])?;
        return cx.exchange(&mut [], &mut [RecvOp { peer: r - p2, step: 99, sink: Sink::Copy(buf.into()) }]);
    }
    if r < w - p2 {
        let (red, elem) = (cx.combine(), cx.dtype.size());
        cx.exchange(&mut [], &mut [RecvOp { peer: r + p2, step: 0, sink: Sink::Reduce { dst: buf.into(), elem, reduce: &red } }])?;
    }
    allreduce(cx, buf, p2)?;
    if r < w - p2 {
        cx.exchange(&mut [SendOp::new(r + p2, 99, buf)], &mut [])?;
    }
    Ok(())
}

/// Recursive halving then doubling (Rabenseifner): log2 W halving steps, in each of which
/// partners r and r^m swap the half of their range the other keeps and reduce the half they
/// keep, then log2 W doubling steps that swap the finished pieces back. The ring's bytes,
/// (W−1)/W·S each way, in 2·log2 W steps instead of 2(W−1): a rank waits only on its
/// partner, not on a chain of W−1 others, which matters when ranks time-share cores. W not
/// a power of two: the extra ranks fold into partners first and get the result last (+2
/// whole-buffer steps). Cost 2·log2 W·α + 2(W−1)/W·Sβ. Every element is finished by one
/// rank and then copied, so every rank ends bit-identical.
pub fn halving_doubling_allreduce(cx: &mut Ctx<'_>, buf: &mut [u8]) -> Result<()> {
    folded_to_power_of_two(cx, buf, |cx, buf, p2| {
        let r = cx.rank;
        let elem = cx.dtype.size();
        let (red, red_last) = (cx.combine(), cx.combine_last());
        let base = buf.as_mut_ptr();
        // SAFETY: every range lies in `buf`, borrowed by this closure, and the two ranges
        // of one exchange (the half kept, the half given) are disjoint.
        let span = |(lo, hi): (usize, usize)| unsafe { Span::raw(base.add(lo * elem), (hi - lo) * elem) };
        let (mut range, mut mask, mut step) = ((0, buf.len() / elem), p2 / 2, 1u32);
        let mut swaps = Vec::new();
        while mask > 0 {
            let partner = r ^ mask;
            let mid = range.0 + (range.1 - range.0) / 2;
            let (keep, give) = if r & mask == 0 { ((range.0, mid), (mid, range.1)) } else { ((mid, range.1), (range.0, mid)) };
            let reduce: &dyn Fn(&mut [u8], &[u8]) = if mask == 1 { &red_last } else { &red };
            cx.exchange(
                &mut [SendOp::forwarding(partner, step, span(give), None)],
                &mut [RecvOp { peer: partner, step, sink: Sink::Reduce { dst: span(keep), elem, reduce } }],
            )?;
            swaps.push((partner, keep, give));
            range = keep;
            mask /= 2;
            step += 1;
        }
        for (partner, mine, theirs) in swaps.into_iter().rev() {
            cx.exchange(&mut [SendOp::forwarding(partner, step, span(mine), None)], &mut [RecvOp { peer: partner, step, sink: Sink::Copy(span(theirs)) }])?;
            step += 1;
        }
        Ok(())
    })
}

/// Binomial-tree broadcast: ⌈log2 W⌉ steps of the whole buffer. Cost ⌈log2 W⌉(α + Sβ).
pub fn binomial_broadcast(cx: &mut Ctx<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let w = cx.world;
    let v = (cx.rank + w - root) % w;
    let real = |x: usize| (x + root) % w;
    let mut mask = 1;
    while mask < w {
        if v & mask != 0 {
            cx.exchange(&mut [], &mut [RecvOp { peer: real(v - mask), step: 0, sink: Sink::Copy(buf.into()) }])?;
            break;
        }
        mask <<= 1;
    }
    mask >>= 1;
    while mask > 0 {
        if v + mask < w {
            cx.exchange(&mut [SendOp::new(real(v + mask), 0, buf)], &mut [])?;
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
        let mut sends: Vec<SendOp<'_>> = send_piece.map(|p| SendOp::new(next, p as u32, unsafe { view(base, bound(p), bound(p + 1)) })).into_iter().collect();
        let mut recvs: Vec<RecvOp<'_>> = recv_piece
            // SAFETY: as for the send: piece p of `buf`, disjoint from the piece sent.
            .map(|p| RecvOp { peer: prev, step: p as u32, sink: Sink::Copy(unsafe { view(base, bound(p), bound(p + 1)) }.into()) })
            .into_iter()
            .collect();
        if !sends.is_empty() || !recvs.is_empty() {
            cx.exchange(&mut sends, &mut recvs)?;
        }
    }
    Ok(())
}

/// Pipelined chain reduce for large buffers, the chain broadcast reversed: pieces move along
/// root − 1 → root − 2 → … → root; each rank reduces piece k into its copy as it arrives
/// while forwarding piece k − 1, so every link carries S once and the reduction overlaps
/// the transfer (a binomial tree sends S ⌈log2 W⌉ times into the root's link). The ranks between the tail and the root keep their
/// input: they combine it with what arrives into `work` (as long as `buf`; the others may
/// pass an empty one) and pass that on. Cost (pieces + W − 2)α + Sβ.
pub fn chain_reduce(cx: &mut Ctx<'_>, buf: &mut [u8], root: usize, piece: usize, work: &mut [u8]) -> Result<()> {
    let w = cx.world;
    let v = (cx.rank + w - root) % w;
    let (toward_root, from_tail) = ((cx.rank + w - 1) % w, (cx.rank + 1) % w);
    let (dtype, op) = (cx.dtype, cx.op);
    let (red, red_from) = (cx.combine(), cx.combine_from());
    let elem = dtype.size();
    let piece = piece.max(elem) / elem * elem;
    let n = buf.len().div_ceil(piece).max(1);
    let len = buf.len();
    let bound = |k: usize| (k * piece).min(len);
    let last = v == w - 1;
    let (acc, input): (&mut [u8], Option<&[u8]>) = if v == 0 || last { (buf, None) } else { (&mut work[..len], Some(buf)) };
    let base = acc.as_mut_ptr();
    // Step k: the tail sends piece k; every other rank receives piece k (reducing it into
    // its copy) and, unless it is the root, forwards piece k − 1.
    for k in 0..=n {
        let (send_piece, recv_piece) = if last { ((k < n).then_some(k), None) } else { ((v != 0 && k >= 1).then(|| k - 1), (k < n).then_some(k)) };
        // SAFETY: pieces k and k − 1 are disjoint ranges of `acc`.
        let mut sends: Vec<SendOp<'_>> =
            send_piece.map(|p| SendOp::new(toward_root, p as u32, unsafe { view(base, bound(p), bound(p + 1)) })).into_iter().collect();
        let mut recvs: Vec<RecvOp<'_>> = recv_piece
            .map(|p| {
                // SAFETY: as for the send: piece p of `acc`, disjoint from the piece sent.
                let dst = unsafe { view(base, bound(p), bound(p + 1)) }.into();
                let sink = match input {
                    Some(input) => Sink::ReduceFrom { dst, with: &input[bound(p)..bound(p + 1)], elem, reduce: &red_from },
                    None => Sink::Reduce { dst, elem, reduce: &red },
                };
                RecvOp { peer: from_tail, step: p as u32, sink }
            })
            .into_iter()
            .collect();
        if !sends.is_empty() || !recvs.is_empty() {
            cx.exchange(&mut sends, &mut recvs)?;
        }
    }
    if v == 0 {
        finish(dtype, op, acc, w);
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
    let red = cx.combine();
    let mut work = if v == 0 { Vec::new() } else { buf.to_vec() };
    let acc: &mut [u8] = if v == 0 { buf } else { &mut work };
    let mut mask = 1;
    while mask < w {
        if v & mask != 0 {
            cx.exchange(&mut [SendOp::new(real(v - mask), mask.trailing_zeros(), acc)], &mut [])?;
            return Ok(());
        }
        if v + mask < w {
            cx.exchange(
                &mut [],
                &mut [RecvOp { peer: real(v + mask), step: mask.trailing_zeros(), sink: Sink::Reduce { dst: acc.into(), elem: dtype.size(), reduce: &red } }],
            )?;
        }
        mask <<= 1;
    }
    finish(dtype, op, acc, w);
    Ok(())
}

/// Dissemination barrier: ⌈log2 W⌉ rounds of empty messages. Cost ⌈log2 W⌉α.
pub fn dissemination_barrier(cx: &mut Ctx<'_>) -> Result<()> {
    let (w, r) = (cx.world, cx.rank);
    let mut dist = 1;
    let mut step = 0;
    while dist < w {
        cx.exchange(&mut [SendOp::new((r + dist) % w, step, &[])], &mut [RecvOp { peer: (r + w - dist) % w, step, sink: Sink::Copy((&mut [][..]).into()) }])?;
        dist <<= 1;
        step += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Chunks tile their part exactly, and a forwarding send waits for a receive that
    /// brings all of its bytes, however the two sides are chunked.
    #[test]
    fn chunks_tile_parts_and_sends_wait_for_all_their_bytes() {
        for (count, w, elem) in [(0, 2, 4), (1, 3, 4), (7, 4, 2), (1003, 3, 4), (100003, 4, 8), (64, 2, 1)] {
            let bounds = part_bounds(count, w, elem);
            for part in 0..w {
                for c_out in [1, 2, 3, 7, 64] {
                    let mut at = bounds[part];
                    for k in 0..c_out {
                        let (lo, hi) = chunk_of(&bounds, part, k, c_out, elem);
                        assert!(lo == at && hi >= lo && (hi - lo) % elem == 0, "count {count} part {part} chunk {k}/{c_out}");
                        at = hi;
                        for c_in in [1, 2, 5, 64] {
                            let j = chunk_bringing(&bounds, part, hi, c_in, elem);
                            assert!(chunk_of(&bounds, part, j, c_in, elem).1 >= hi, "send {k}/{c_out} waits for {j}/{c_in} that ends before it");
                        }
                    }
                    assert_eq!(at, bounds[part + 1]);
                }
            }
        }
    }
}
