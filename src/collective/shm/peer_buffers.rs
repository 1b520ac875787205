//! The forms that work in the peers' buffers (see the module comment of
//! `collective::shm`): the ranks' agreement on one, zero-copy through mapped buffers, and
//! cross-memory attach for private ones.

use super::control::Reach;
use super::ShmCtx;
use crate::collective::reduce::reduce_all;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::mem::page_size;
use crate::sys::cma::{fetch, put};
use crate::sys::proc::process_gone;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Bytes of a part reduced and then written to the peers at a time: the block is still in
/// L2 when it is written (and 256 KiB timed fastest for cross-memory attach among 64 KiB
/// to 4 MiB blocks).
pub(super) const PEER_BLOCK: usize = 256 << 10;

/// What the ranks agreed on for a large call.
pub(super) enum Agreed {
    /// Every rank mapped every peer's buffer, all but its registered buffer's partial pages
    /// (see [`crate::mem::Registration`]): the bytes of every buffer that all can reach,
    /// and where they start in the peers' buffers (ours null).
    Mapped {
        peers: Vec<*mut u8>,
        body: Range<usize>,
    },
    /// Every rank reached every peer's buffer through cross-memory attach: each rank's
    /// process and buffer address.
    Attach(Vec<(u32, u64)>),
    Staged {
        someone_cannot_attach: bool,
    },
}

/// The large forms' agreement: every rank publishes where its buffer lies, and its
/// address unless it cannot attach (barrier base+1). Unless every buffer is shared or
/// every rank can attach, that is all: staged. Otherwise each rank maps every peer's buffer
/// if all are shared, reads a few bytes of every peer's buffer through cross-memory
/// attach, and says what worked (barrier base+2). Every rank then takes the first form
/// that worked for all: zero-copy, cross-memory attach, staged. A rank that does not
/// `want_attach` this call (rank 0, whose timing says staging is faster) publishes no
/// address.
pub(super) fn agree_on_form(cx: &ShmCtx<'_>, attach: &mut Attach, want_attach: bool, buf: &[u8], elem: usize) -> Result<Agreed> {
    let (w, me) = (cx.world, cx.rank);
    let base = cx.ctl.phase(me).load(Ordering::Relaxed);
    // The phase before which a rank that fails here writes nothing into peers' buffers.
    let done = base + 3;
    // A failing rank that never said it could reach its peers tells those that did (and
    // wait for writers) that it will not write.
    let never_wrote = |e: Error| {
        cx.ctl.set_writes_done(done);
        e
    };
    cx.ctl.publish_buffer(buf, attach.enabled && want_attach);
    let ends_staged = cx.ctl.buffer_is_shared(me) && stage_ends(cx, buf);
    cx.advance(base + 1);
    cx.wait_all(base + 1).and_then(|()| cx.check_calls()).map_err(never_wrote)?;
    let all_shared = (0..w).all(|p| cx.ctl.buffer_is_shared(p));
    let all_can_attach = (0..w).all(|p| cx.ctl.peer_address(p).1 != 0);
    if !all_shared && !all_can_attach {
        return Ok(Agreed::Staged { someone_cannot_attach: true });
    }
    // What every rank's region holds: all but the largest uncovered start and end, in
    // whole elements.
    let (head, tail) = (0..w).map(|p| cx.ctl.uncovered(p)).fold((0, 0), |(h, t), (hp, tp)| (h.max(hp), t.max(tp)));
    let body = head.next_multiple_of(elem)..buf.len().saturating_sub(tail.next_multiple_of(elem));
    // Ranks with the same settings all staged their ends (all buffers are shared); one that
    // did not and needs them says so at barrier base+2 (no mapped reach), and nobody maps.
    let ends_fit = body.start <= page_size() && buf.len() - body.end <= page_size() && (body.len() == buf.len() || ends_staged);
    let peers: Option<Vec<*mut u8>> = if all_shared && ends_fit && body.len() >= buf.len() / 2 {
        (0..w).map(|p| if p == me { Some(std::ptr::null_mut()) } else { cx.ctl.peer_buffer(p, body.start, body.len()) }).collect()
    } else {
        None
    };
    let reach = Reach { mapped: peers.is_some(), attach: all_can_attach && attach.reaches_all(cx) };
    cx.ctl.set_reach(reach);
    cx.advance(base + 2);
    // A peer that failed after announcing its reach (it may be a step behind us) has set
    // its abort flag; going on would write into a buffer it is about to hand back.
    let all = cx.wait_all(base + 2).and_then(|()| {
        (0..w).filter(|&p| p != me).try_for_each(|p| cx.check_peer(p, Duration::ZERO))?;
        let reaches: Vec<Reach> = (0..w).map(|p| cx.ctl.reach(p)).collect();
        Ok((reaches.iter().all(|r| r.mapped), reaches.iter().all(|r| r.attach)))
    });
    match (all, peers) {
        (Ok((true, _)), Some(peers)) => {
            log::debug!("rank {me}: {} zero-copy in the peers' buffers ({} of {} bytes)", cx.call, body.len(), buf.len());
            Ok(Agreed::Mapped { peers, body })
        }
        (Ok((_, true)), _) => {
            log::debug!("rank {me}: {} through cross-memory attach", cx.call);
            Ok(Agreed::Attach((0..w).map(|p| cx.ctl.peer_address(p)).collect()))
        }
        (Ok(_), _) => Ok(Agreed::Staged { someone_cannot_attach: !all_can_attach }),
        // Peers that saw us reach them may be writing into our buffer already.
        (Err(e), _) if reach != Reach::default() => Err(cx.fail_in_peer_buffers(e, done)),
        (Err(e), _) => Err(never_wrote(e)),
    }
}

/// Cross-memory attach (`process_vm_readv`/`process_vm_writev`): the kernel copies
/// between this process's memory and a peer's, once, where staging copies every byte into
/// shared memory and out again (benches/peers/cma_probe.c times both; the report is
/// docs/benchmarks.md).
pub(super) struct Attach {
    /// `GRADWIRE_SHM_CMA`; cleared for good when the kernel refuses (permissions do not
    /// come back within a job).
    pub(super) enabled: bool,
    /// Where peers' blocks land to be reduced: W−1 blocks (the reduce adds its own).
    pub(super) scratch: Vec<u64>,
}

impl Attach {
    /// Whether a byte of every peer's published buffer can be read from here.
    fn reaches_all(&mut self, cx: &ShmCtx<'_>) -> bool {
        let mut probe = [0u8; 1];
        for p in (0..cx.world).filter(|&p| p != cx.rank) {
            let (pid, addr) = cx.ctl.peer_address(p);
            if let Err(e) = fetch(pid, addr, &mut probe) {
                if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES | libc::ENOSYS)) {
                    self.enabled = false;
                    log::info!(
                        "rank {}: cross-memory attach to rank {p} (pid {pid}) refused ({e}): large allreduces of private buffers stage through shared memory \
                         (with Yama ptrace_scope 1 a process may read only its descendants; GRADWIRE_SHM_CMA=0 silences this)",
                        cx.rank
                    );
                } else {
                    log::debug!("rank {}: cross-memory attach to rank {p} (pid {pid}) failed ({e}); this allreduce stages", cx.rank);
                }
                return false;
            }
        }
        true
    }
}

/// How a rank reaches its peers' buffers in a call that works in them.
pub(super) enum PeerAccess<'s> {
    /// Mapped here (zero-copy): every rank's buffer, ours null.
    Mapped(Vec<*mut u8>),
    /// Through cross-memory attach: every rank's process and buffer address, and where
    /// fetched blocks land.
    Attach { peers: Vec<(u32, u64)>, scratch: &'s mut Vec<u64> },
}

/// One-host allreduce in the peers' buffers, after [`agree_on_form`]: rank r reduces part
/// r of every buffer block by block into its own buffer, reading the peers' blocks where
/// they are mapped or having the kernel fetch them into a scratch (cross-memory attach),
/// and writes each finished block, still in cache, into every peer's buffer, directly or
/// through the kernel. Bytes moved per rank: S read (its part of every buffer), S written
/// (its part of every buffer), plus the kernel's copy of both halves when attached. Only
/// rank r touches part r of any buffer, so nothing it writes is read by anyone else. One
/// more barrier: all parts reduced and written (nobody reads or writes our buffer any
/// more).
pub(super) fn shm_allreduce_in_peer_buffers(
    cx: &ShmCtx<'_>,
    whole: &mut [u8],
    body: Range<usize>,
    dtype: DType,
    op: ReduceOp,
    mut access: PeerAccess<'_>,
) -> Result<()> {
    let buf = &mut whole[body.clone()];
    let (w, me) = (cx.world, cx.rank);
    let done = cx.ctl.phase(me).load(Ordering::Relaxed) + 1;
    let elem = dtype.size();
    let bounds = crate::collective::algos::part_bounds(buf.len() / elem, w, elem);
    let others = || (0..w).filter(move |&p| p != me);
    let (lo, hi) = (bounds[me], bounds[me + 1]);
    let attach_failed = |p: usize, pid: u32, e: std::io::Error| cx.fail_in_peer_buffers(attach_error(cx, p, pid, e), done);
    for b in (lo..hi).step_by(PEER_BLOCK) {
        let len = (b + PEER_BLOCK).min(hi) - b;
        match &mut access {
            PeerAccess::Mapped(peers) => {
                // SAFETY: bytes b..b+len of every peer's buffer (part `me`, inside its
                // `buf.len()` bytes), which only we touch until the last barrier; the
                // mappings outlive this call.
                let theirs = others().map(|p| unsafe { std::slice::from_raw_parts(peers[p].add(b), len) });
                reduce_all(dtype, op, w, &mut buf[b..b + len], theirs);
            }
            PeerAccess::Attach { peers, scratch } => {
                // Grown, never shrunk: the pulled reduce borrows the same scratch for W blocks.
                let blocks = crate::transport::scratch_bytes(scratch, (w - 1) * PEER_BLOCK);
                for (block, p) in blocks.chunks_mut(PEER_BLOCK).zip(others()) {
                    let (pid, addr) = peers[p];
                    fetch(pid, addr + b as u64, &mut block[..len]).map_err(|e| attach_failed(p, pid, e))?;
                }
                reduce_all(dtype, op, w, &mut buf[b..b + len], blocks.chunks(PEER_BLOCK).map(|c| &c[..len]));
            }
        }
        // A peer that failed hands its buffer back once we have stopped writing or a grace
        // has passed: stop writing into anyone's.
        others().try_for_each(|p| cx.check_peer(p, Duration::ZERO)).map_err(|e| cx.fail_in_peer_buffers(e, done))?;
        for p in others() {
            match &access {
                // SAFETY: as above.
                PeerAccess::Mapped(peers) => unsafe { std::ptr::copy_nonoverlapping(buf[b..].as_ptr(), peers[p].add(b), len) },
                PeerAccess::Attach { peers, .. } => {
                    let (pid, addr) = peers[p];
                    put(pid, addr + b as u64, &buf[b..b + len]).map_err(|e| attach_failed(p, pid, e))?;
                }
            }
        }
    }
    if body.len() < whole.len() {
        reduce_staged_ends(cx, whole, body, dtype, op);
    }
    cx.advance(done);
    cx.wait_all(done).map_err(|e| cx.fail_in_peer_buffers(e, done))
}

/// The error of a failed cross-memory attach to rank `p` (process `pid`), by its cause: the
/// peer's process is gone (the kernel says so, or it exits while we copy, which can also
/// show as a bad address; its own reason when it aborted first), or some peer is gone or gave up (a bad address: the buffer went
/// back to its caller; the peer's reason names the first failure), else the kernel's error.
pub(super) fn attach_error(cx: &ShmCtx<'_>, p: usize, pid: u32, e: std::io::Error) -> Error {
    let me = cx.rank;
    let lost = |cause| Error::PeerLost { rank: me, peer: p, op: cx.call.to_string(), cause };
    if e.raw_os_error() == Some(libc::ESRCH) || process_gone(pid).is_some() {
        // A peer that failed first left its reason in its page before it exited: that
        // names the first failure, where "exited" would blame the messenger.
        return lost(cx.ctl.peer_gone(p).unwrap_or_else(|| format!("process {pid} exited")));
    }
    let peers = (0..cx.world).filter(|&q| q != me);
    peers
        .map(|q| cx.check_peer(q, super::PROC_CHECK_AFTER))
        .find_map(|r| r.err())
        .unwrap_or_else(|| Error::io(format!("rank {me}: cross-memory attach to rank {p}'s buffer (pid {pid}) in {}", cx.call), e))
}

/// Copies the first and last page of `buf` to the start of our staging area (before the
/// agreement's first barrier), where peers read them if the zero-copy form leaves them out
/// (see [`reduce_staged_ends`]); false where the staging area has no room for them. Nobody
/// reads that part of it now: the forms that read it (staged, and this one) end with a
/// barrier after the last read, and the small form's area lies past `staged_capacity()`.
fn stage_ends(cx: &ShmCtx<'_>, buf: &[u8]) -> bool {
    let page = page_size();
    if cx.staged_capacity() < 2 * page || buf.len() < 2 * page {
        return false;
    }
    // SAFETY: two pages at the start of our own staging area, which fit (checked).
    unsafe {
        std::ptr::copy_nonoverlapping(buf.as_ptr(), cx.ctl.stage(cx.rank), page);
        std::ptr::copy_nonoverlapping(buf[buf.len() - page..].as_ptr(), cx.ctl.stage(cx.rank).add(page), page);
    }
    true
}

/// The bytes of a registered buffer outside `body` (its partial first and last pages, less
/// than a page each, which no peer maps): every rank reduces them itself from the copies
/// all ranks staged (see [`stage_ends`]), in rank order, so that all get bit-identical
/// results, before the zero-copy form's last barrier (after it, a rank's staging area may
/// be written again).
pub(super) fn reduce_staged_ends(cx: &ShmCtx<'_>, buf: &mut [u8], body: Range<usize>, dtype: DType, op: ReduceOp) {
    let (page, w) = (page_size(), cx.world);
    let (head, tail) = (body.start, buf.len() - body.end);
    // Where each end lies in a staging area: the head at its start, the tail at the end of
    // the second page.
    for (range, staged_at) in [(0..head, 0), (body.end..buf.len(), 2 * page - tail)] {
        if range.is_empty() {
            continue;
        }
        // SAFETY: every rank staged two pages before barrier base+1 (we are past it) and
        // writes them again only after the last barrier of this call.
        let staged = |p: usize| unsafe { std::slice::from_raw_parts(cx.ctl.stage(p).add(staged_at), range.len()) };
        // A u64 scratch keeps every dtype's elements aligned.
        let mut scratch = vec![0u64; range.len().div_ceil(8)];
        let acc = &mut crate::transport::bytemuck_bytes(&mut scratch)[..range.len()];
        acc.copy_from_slice(staged(0));
        reduce_all(dtype, op, w, acc, (1..w).map(staged));
        buf[range].copy_from_slice(acc);
    }
    log::debug!("rank {}: {}: the {} bytes outside the shared pages reduced from the staged copies", cx.rank, cx.call, head + tail);
}
