//! Reduce-scatter, allgather, broadcast, all-to-all and reduce in the peers' buffers (see
//! the module comment of `collective::shm`). Once the ranks have agreed how every rank
//! reaches every peer's buffer ([`agree_on_form`](super::peer_buffers::agree_on_form)),
//! each rank copies what it receives straight out of them into its receive buffer, once:
//! reduce-scatter reduces its part out of them block by block. They are mapped here where
//! all come from `gradwire_alloc` or are registered in place; private ones the kernel
//! copies through cross-memory attach. Two forms also write into a peer's buffer, so that
//! every rank shares the work: the broadcast's root writes its share into the receivers'
//! (they copy the rest), and the reduce's ranks write their reduced parts into the root's.
//! One more barrier ends the call: every rank has finished reading and writing (nobody gets
//! its buffer back while a peer may still read or write it; a rank that fails lets the
//! writers finish first). Each rank reads its peers in a different order (the one after it
//! first), so that no buffer has every reader at once.
//!
//! Private buffers take cross-memory attach or staging (`parts`), whichever rank 0 has
//! timed faster for the collective and size on this host (`OneHostState::part_forms`): the kernel
//! pins the peer's pages for every call, which on one host costs more than staging's second
//! copy at every size and on another less.

use super::peer_buffers::{attach_error, reduce_staged_ends, PEER_BLOCK};
use super::staged::{copy_out, streams_out};
use super::{PeerBlocks, ScatterParts, ShmCtx};
use crate::collective::reduce::{reduce_all, reduce_all_from};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::mem::page_size;
use crate::sys::cma::{fetch, put};
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// How the ranks agreed to reach each other's send buffers.
pub(super) enum PeerBuffers {
    /// Mapped here: every rank's buffer from `body.start` (ours null), and the bytes of
    /// every buffer that every rank maps; the rest (a registered buffer's partial first
    /// and last pages) every rank staged (see `peer_buffers::stage_ends`).
    Mapped { peers: Vec<*mut u8>, body: Range<usize> },
    /// Through cross-memory attach: every rank's process and buffer address.
    Attached(Vec<(u32, u64)>),
}

/// The peers' send buffers, as the ranks agreed to reach them.
pub(super) struct Sources<'s> {
    buffers: PeerBuffers,
    /// Bytes of every rank's send buffer (the same on all: the calls match).
    len: usize,
    /// Where blocks land that cannot be read in place: W−1 blocks of [`PEER_BLOCK`] (W for
    /// the reduce, whose own block is one).
    scratch: &'s mut Vec<u64>,
}

impl<'s> Sources<'s> {
    /// The peers' send buffers of `len` bytes, reached as agreed.
    pub(super) fn new(buffers: PeerBuffers, len: usize, scratch: &'s mut Vec<u64>) -> Self {
        Sources { buffers, len, scratch }
    }

    /// Copies bytes `from..from + dst.len()` of rank `p`'s send buffer into `dst`, with
    /// streaming stores if `streaming` (where we copy; the kernel copies attached bytes).
    /// A failed attach fails the call for every rank at once ([`abandon`]).
    fn read(&self, cx: &ShmCtx<'_>, p: usize, from: usize, dst: &mut [u8], streaming: bool) -> Result<()> {
        let (peers, body) = match &self.buffers {
            PeerBuffers::Mapped { peers, body } => (peers, body),
            PeerBuffers::Attached(peers) => {
                let (pid, addr) = peers[p];
                return fetch(pid, addr + from as u64, dst).map_err(|e| abandon(cx, attach_error(cx, p, pid, e)));
            }
        };
        let page = page_size();
        for (piece, at) in pieces(from..from + dst.len(), body, self.len, page) {
            let d = &mut dst[piece.start - from..piece.end - from];
            // SAFETY: `at` says where `piece` lies: in p's mapped buffer (which stays mapped
            // until the call's last barrier, and whose bytes we read nobody writes before
            // then but, in the reduce, we ourselves after reading them), or in the copy of
            // its first or last page p staged before the agreement's first barrier, which
            // stays until then too (see `peer_buffers::stage_ends`).
            let src = unsafe {
                match at {
                    Where::Body => peers[p].add(piece.start - body.start),
                    Where::FirstPage => cx.ctl.stage(p).add(piece.start),
                    Where::LastPage => cx.ctl.stage(p).add(page + piece.start - (self.len - page)),
                }
            };
            // SAFETY: as above; `d` is ours and overlaps no peer's memory.
            copy_out(d, unsafe { std::slice::from_raw_parts(src, d.len()) }, streaming);
        }
        Ok(())
    }

    /// Writes `data` at byte `at` of rank `p`'s buffer (inside [`Self::writable`]), with
    /// streaming stores if `streaming` (where we copy). A failed attach fails the call for
    /// every rank at once ([`abandon`]).
    fn write(&self, cx: &ShmCtx<'_>, p: usize, at: usize, data: &[u8], streaming: bool) -> Result<()> {
        match &self.buffers {
            PeerBuffers::Attached(peers) => {
                let (pid, addr) = peers[p];
                put(pid, addr + at as u64, data).map_err(|e| abandon(cx, attach_error(cx, p, pid, e)))
            }
            PeerBuffers::Mapped { peers, body } => {
                assert!(body.start <= at && at + data.len() <= body.end, "a write into a peer's buffer outside the bytes every rank maps");
                // SAFETY: inside p's mapped buffer (asserted), which stays mapped until the
                // call's last barrier; the caller's form gives these bytes to us alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(peers[p].add(at - body.start), data.len()) };
                copy_out(dst, data, streaming);
                Ok(())
            }
        }
    }

    /// The bytes of every rank's buffer that a peer may write: all of them through
    /// cross-memory attach, those every rank maps when mapped.
    fn writable(&self) -> Range<usize> {
        match &self.buffers {
            PeerBuffers::Attached(_) => 0..self.len,
            PeerBuffers::Mapped { body, .. } => body.clone(),
        }
    }

    /// Bytes `from..from + len` of every peer's send buffer, the next rank first
    /// ([`peers_from_next`]): in place where every rank maps them, else copied into the
    /// peer's own [`PEER_BLOCK`] of `blocks` (W−1 of them).
    fn peer_blocks<'a>(&'a self, cx: &ShmCtx<'_>, from: usize, len: usize, blocks: &'a mut [u8]) -> Result<Vec<&'a [u8]>> {
        peers_from_next(cx).zip(blocks.chunks_mut(PEER_BLOCK)).map(|(p, block)| self.view(cx, p, from, &mut block[..len])).collect()
    }

    /// Bytes `from..from + block.len()` of rank `p`'s send buffer: in place where every
    /// rank maps it, else copied into `block`.
    fn view<'a>(&'a self, cx: &ShmCtx<'_>, p: usize, from: usize, block: &'a mut [u8]) -> Result<&'a [u8]> {
        if let PeerBuffers::Mapped { peers, body } = &self.buffers {
            if body.start <= from && from + block.len() <= body.end {
                // SAFETY: inside p's mapped buffer, which stays mapped until the call's last
                // barrier; nobody writes these bytes before then but, in the reduce, we
                // ourselves once done with this view.
                return Ok(unsafe { std::slice::from_raw_parts(peers[p].add(from - body.start), block.len()) });
            }
        }
        self.read(cx, p, from, block, false)?;
        Ok(block)
    }
}

/// Where a piece of a peer's buffer can be read from in the zero-copy form.
#[derive(Debug, PartialEq)]
enum Where {
    Body,
    FirstPage,
    LastPage,
}

/// Splits `range` of a buffer of `len` bytes into the pieces before, in and after `body`
/// (the part every rank maps; the rest lies in the buffer's first or last page).
fn pieces(range: Range<usize>, body: &Range<usize>, len: usize, page: usize) -> impl Iterator<Item = (Range<usize>, Where)> {
    debug_assert!(body.start <= page && len - body.end <= page);
    let clip = |r: Range<usize>| range.start.max(r.start)..range.end.min(r.end);
    [(clip(0..body.start), Where::FirstPage), (clip(body.clone()), Where::Body), (clip(body.end..len), Where::LastPage)]
        .into_iter()
        .filter(|(r, _)| r.start < r.end)
}

/// The peers in the order this rank reads them: the next rank first.
fn peers_from_next(cx: &ShmCtx<'_>) -> impl Iterator<Item = usize> {
    let (w, me) = (cx.world, cx.rank);
    (1..w).map(move |i| (me + i) % w)
}

/// Ends a call that read the peers' buffers: every rank has finished reading. First, what
/// we read must still have been the peers' send buffers: a peer that gave up on us (we
/// were stopped past its deadline) has set its abort flag before its caller got the buffer
/// back, and we may have read what the caller wrote since; a peer cannot have left this
/// call otherwise, so a flag now is this call's. A rank that fails here says so at once
/// (its abort flag), so that peers waiting here fail too.
fn finish(cx: &ShmCtx<'_>) -> Result<()> {
    let done = cx.ctl.phase(cx.rank).load(Ordering::Relaxed) + 1;
    // Our reads of their buffers come before the flags' loads.
    std::sync::atomic::fence(Ordering::Acquire);
    (0..cx.world).filter(|&p| p != cx.rank).try_for_each(|p| cx.check_peer(p, Duration::ZERO))?;
    cx.advance(done);
    cx.wait_all(done).map_err(|e| abandon(cx, e))
}

/// [`finish`] for a form where peers also write into our buffer: a rank that fails here
/// lets the writers finish before its caller gets the buffer back.
fn finish_written(cx: &ShmCtx<'_>, done: u64) -> Result<()> {
    finish(cx).map_err(|e| cx.fail_in_peer_buffers(e, done))
}

/// A rank that fails while peers may still read its buffer says so at once (its abort
/// flag): their reads are then known to be void, and those waiting for it fail too.
fn abandon(cx: &ShmCtx<'_>, e: Error) -> Error {
    let done = cx.ctl.phase(cx.rank).load(Ordering::Relaxed) + 1;
    cx.ctl.set_writes_done(done);
    cx.ctl.set_aborted(&e.to_string());
    e
}

/// Allgather: every peer's `send` (n bytes) into its block of the output, and ours into
/// `own` unless in place (`own` None: `send` is our block of the output).
pub(super) fn allgather(cx: &ShmCtx<'_>, src: &Sources<'_>, send: &[u8], own: Option<&mut [u8]>, mut peers: PeerBlocks<'_>) -> Result<()> {
    let n = send.len();
    let streaming = streams_out(n * cx.world + own.as_ref().map_or(0, |_| n));
    if let Some(own) = own {
        copy_out(own, send, streaming);
    }
    for p in peers_from_next(cx) {
        src.read(cx, p, 0, peers.of(p), streaming)?;
    }
    finish(cx)
}

/// All-to-all: block `me` of every peer's `send` into block p of `recv` (blocks of
/// `recv.len() / W` bytes).
pub(super) fn alltoall(cx: &ShmCtx<'_>, src: &Sources<'_>, send: &[u8], recv: &mut [u8]) -> Result<()> {
    let (me, n, streaming) = (cx.rank, recv.len() / cx.world, streams_out(send.len() + recv.len()));
    copy_out(&mut recv[me * n..][..n], &send[me * n..][..n], streaming);
    for p in peers_from_next(cx) {
        src.read(cx, p, me * n, &mut recv[p * n..][..n], streaming)?;
    }
    finish(cx)
}

/// Broadcast: the root and the other ranks share the copying. Each receiver copies the
/// root's buffer into its own but for the root's share, its last 1/W (of the bytes peers
/// may write), which the root writes into every receiver's buffer meanwhile; so every rank
/// copies (W−1)/W of the buffer, where receivers alone would copy all of it while the
/// root's core idles.
pub(super) fn broadcast(cx: &ShmCtx<'_>, src: &Sources<'_>, buf: &mut [u8], root: usize) -> Result<()> {
    let done = cx.ctl.phase(cx.rank).load(Ordering::Relaxed) + 1;
    let streaming = streams_out(buf.len());
    let share = root_share(buf.len(), cx.world, src.writable());
    if cx.rank == root {
        for b in share.clone().step_by(PEER_BLOCK) {
            let block = &buf[b..(b + PEER_BLOCK).min(share.end)];
            // A receiver that failed hands its buffer back once we have stopped writing (or
            // a grace has passed): stop writing into anyone's. Nobody writes into ours, so
            // we fail at once.
            peers_from_next(cx).try_for_each(|p| cx.check_peer(p, Duration::ZERO)).map_err(|e| abandon(cx, e))?;
            for p in peers_from_next(cx) {
                src.write(cx, p, b, block, streaming)?;
            }
        }
        return finish(cx);
    }
    // The root writes `share` of our buffer: we keep it until the root has stopped.
    let (head, tail) = buf.split_at_mut(share.start);
    let tail = &mut tail[share.len()..];
    src.read(cx, root, 0, head, streaming).and_then(|()| src.read(cx, root, share.end, tail, streaming)).map_err(|e| cx.fail_in_peer_buffers(e, done))?;
    finish_written(cx, done)
}

/// The bytes of a broadcast of `len` bytes among `w` ranks that the root writes into the
/// receivers' buffers: the last 1/W of those it may write, from a multiple of 64 bytes.
fn root_share(len: usize, w: usize, writable: Range<usize>) -> Range<usize> {
    let start = (len - len / w).next_multiple_of(64).max(writable.start);
    let end = writable.end.min(len);
    start.min(end)..end
}

/// Reduce-scatter: part `me` of every peer's input reduced with ours into the output
/// (ours, in place), block by block (each block of every peer read in place where
/// mapped, else fetched into the scratch).
pub(super) fn reduce_scatter(cx: &ShmCtx<'_>, src: &mut Sources<'_>, parts: ScatterParts<'_>, dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, me, n) = (cx.world, cx.rank, parts.out.len());
    let (own, out) = (parts.own, parts.out);
    let mut scratch = std::mem::take(src.scratch);
    for b in (0..n).step_by(PEER_BLOCK) {
        let len = PEER_BLOCK.min(n - b);
        match src.peer_blocks(cx, me * n + b, len, crate::transport::scratch_bytes(&mut scratch, (w - 1) * PEER_BLOCK)) {
            Ok(theirs) => match own {
                // Our part is the first operand, read where it lies: copying it into the
                // output first was a pass more over memory.
                Some(own) => reduce_all_from(dtype, op, w, &mut out[b..b + len], &own[b..b + len], theirs),
                None => reduce_all(dtype, op, w, &mut out[b..b + len], theirs),
            },
            Err(e) => {
                *src.scratch = scratch;
                return Err(e);
            }
        }
    }
    *src.scratch = scratch;
    finish(cx)
}

/// Reduce to `root`: rank r reduces part r of every rank's buffer (of the bytes peers may
/// write) block by block, each peer's block read in place where mapped, else fetched into
/// the scratch, and writes the finished block into the root's buffer (the root reduces its
/// part in place), so that every rank reduces 1/W and only the root's buffer changes. The
/// bytes outside those (a registered buffer's partial pages) the root reduces itself from
/// the copies every rank staged.
pub(super) fn reduce(cx: &ShmCtx<'_>, src: &mut Sources<'_>, buf: &mut [u8], root: usize, dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let done = cx.ctl.phase(me).load(Ordering::Relaxed) + 1;
    let body = src.writable();
    let bounds = crate::collective::algos::part_bounds(body.len() / dtype.size(), w, dtype.size());
    let mine = body.start + bounds[me]..body.start + bounds[me + 1];
    let mut scratch = std::mem::take(src.scratch);
    let reduced = (|| {
        for b in mine.clone().step_by(PEER_BLOCK) {
            let len = PEER_BLOCK.min(mine.end - b);
            let (acc, blocks) = crate::transport::scratch_bytes(&mut scratch, w * PEER_BLOCK).split_at_mut(PEER_BLOCK);
            let theirs = src.peer_blocks(cx, b, len, blocks)?;
            if me == root {
                reduce_all(dtype, op, w, &mut buf[b..b + len], theirs);
                continue;
            }
            let acc = &mut acc[..len];
            reduce_all_from(dtype, op, w, acc, &buf[b..b + len], theirs);
            // A root that failed hands its buffer back once we have stopped writing (or a
            // grace has passed): stop writing into it.
            cx.check_peer(root, Duration::ZERO)?;
            src.write(cx, root, b, acc, false)?;
        }
        Ok(())
    })();
    *src.scratch = scratch;
    if me != root {
        // Nobody writes into our buffer: we fail at once.
        reduced.map_err(|e| abandon(cx, e))?;
        return finish(cx);
    }
    reduced.map_err(|e| cx.fail_in_peer_buffers(e, done))?;
    if body.len() < buf.len() {
        reduce_staged_ends(cx, buf, body, dtype, op);
    }
    finish_written(cx, done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_split_a_range_at_the_mapped_body() {
        let body = 100..8000;
        let got: Vec<_> = pieces(50..8050, &body, 8092, 4096).collect();
        assert_eq!(got, vec![(50..100, Where::FirstPage), (100..8000, Where::Body), (8000..8050, Where::LastPage)]);
        let inside: Vec<_> = pieces(200..300, &body, 8092, 4096).collect();
        assert_eq!(inside, vec![(200..300, Where::Body)]);
        assert_eq!(pieces(0..0, &body, 8092, 4096).count(), 0);
    }
}
