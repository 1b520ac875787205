//! One-host collectives through shared memory. The other collectives (reduce-scatter,
//! allgather, all-to-all, broadcast, reduce, barrier) share the allreduce's machinery:
//! its barriers and call checks, its staging areas ([`parts`]) and, from [`LARGE_MIN`]
//! bytes, its agreement on working in the peers' buffers ([`pull`]: each rank copies what
//! it receives straight out of them, and the broadcast's root and the reduce's ranks
//! write their share into them; mapped where every rank maps every peer's buffer, else
//! through cross-memory attach where rank 0 has timed that faster than staging).
//!
//! The allreduce comes in four forms chosen by size, by where the buffers live and by what
//! the kernel allows (see [`OneHost::allreduce`]):
//!
//! - small (at most [`SMALL_MAX`]): one barrier; every rank reduces every input itself;
//! - staged: per segment of the buffer (at most the staging size, about 1 MiB, so that
//!   the segments of all ranks stay in cache): (1) every rank copies the parts it does not
//!   own into its staging area; (2) rank r reduces part r of the peers' staging areas into
//!   its own buffer and copies the result into its staging area; (3) every rank copies the
//!   other finished parts from their owners' staging areas. Two barriers per segment and
//!   one more at the end of the call (part p always has slot p of a staging area, so the
//!   next segment's copy-in never touches what peers may still be copying out),
//!   made of per-rank phase counters (no shared contended line). What peers read is
//!   written with plain or streaming stores, whichever [`StoreChooser`] has timed faster;
//! - zero-copy (from [`LARGE_MIN`], when every rank's buffer comes from
//!   `gradwire_alloc` or is registered in place, and every rank maps every other's): rank
//!   r reduces part r straight out of the peers' buffers and writes it straight into them
//!   (a registered buffer's partial first and last pages, which stay private, every rank
//!   reduces itself from copies all ranks staged);
//! - cross-memory attach (from [`LARGE_MIN`], private buffers, when the kernel lets every
//!   rank read every peer's memory): the zero-copy form's pattern, with the kernel copying
//!   part r of every peer's buffer into a scratch and each finished block into the peers'
//!   buffers, once, where the staged form copies every byte in and out of shared memory.
//!
//! The small form reads its peers' staging after its only barrier, while they may have
//! returned already; so it has an area of its own at the end of the staging area, which
//! the staged form never writes.
//!
//! Files: this one holds the entry, the forms' shared waiting and failure handling, and
//! the layout of the staging area; [`control`] the collectives' part of every rank's control
//! page; [`small`], [`staged`] and [`peer_buffers`] the allreduce's forms; [`stores`] the
//! staged form's store tuner; [`parts`] the other collectives through the staging areas,
//! [`pull`] in the peers' buffers. The transport (`transport::shm`) owns the segments
//! and their rings.

mod control;
mod parts;
mod peer_buffers;
mod pull;
mod small;
mod staged;
mod stores;

pub use stores::StoreChooser;

use crate::config::StagedStores;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::transport::frame::{CallHeader, FrameHeader, FrameKind, HEADER_LEN};
use crate::transport::shm::ShmDomain;
use crate::transport::Backoff;
use control::Control;
use peer_buffers::{agree_on_form, shm_allreduce_in_peer_buffers, Agreed, Attach, PeerAccess};
use pull::{PeerBuffers, Sources};
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The one-host collectives of one communicator: the shared segments of the ranks on this
/// host, the collectives' part of their control pages, and what the forms learn between
/// calls. The communicator keeps it (`super::state`) for one call at a time.
pub(crate) struct OneHost {
    ctl: Control,
    /// True when the segments cover every rank of the communicator.
    all: bool,
    spin: Duration,
    state: OneHostState,
}

impl OneHost {
    /// The one-host collectives over `domain`; `all` when it holds every rank of the
    /// communicator. `stores` and `cross_memory_attach` come from `GRADWIRE_SHM_STORES`
    /// and `GRADWIRE_SHM_CMA`.
    pub(crate) fn new(domain: Arc<ShmDomain>, all: bool, spin: Duration, stores: StagedStores, cross_memory_attach: bool) -> Self {
        OneHost { ctl: Control::new(domain), all, spin, state: OneHostState::new(stores, cross_memory_attach) }
    }

    /// Whether every rank of the communicator is on this host (the one-host forms apply).
    pub(crate) fn covers_all(&self) -> bool {
        self.all
    }

    /// Publishes the call this rank is in. Every collective does, whatever its algorithm:
    /// a peer waiting in a one-host allreduce reads it to report a mismatched call at once
    /// instead of at the deadline.
    pub(crate) fn announce(&self, call: &CallHeader) {
        self.ctl.set_call(&encode_call(call));
    }

    /// In-place allreduce of `buf` among all ranks (all on this host).
    pub(crate) fn allreduce(&mut self, call: &OneHostCall<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let cx = ShmCtx::new(&self.ctl, self.spin, call);
        shm_allreduce(&cx, &mut self.state, buf, dtype, op)
    }

    /// Reduce-scatter among all ranks (all on this host): `send` holds one part of
    /// `recv.len()` bytes per rank; each rank reduces its part out of the peers' buffers
    /// ([`pull`]) or through the staging areas ([`parts`]). In place (`send` None) `recv`
    /// is the whole input, and the result goes into this rank's part of it.
    pub(crate) fn reduce_scatter(&mut self, call: &OneHostCall<'_>, send: Option<&[u8]>, recv: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        let cx = ShmCtx::new(&self.ctl, self.spin, call);
        let st = &mut self.state;
        let (forms, stores) = (&mut st.part_forms.reduce_scatter, &mut st.part_stores.reduce_scatter);
        let run = |how: How<'_>, parts: ScatterParts<'_>| match how {
            How::Pulled(mut src) => pull::reduce_scatter(&cx, &mut src, parts, dtype, op),
            How::Staged(streaming) => parts::reduce_scatter(&cx, parts, dtype, op, streaming),
        };
        match send {
            Some(send) => {
                pulled_or_staged(&cx, &mut st.attach, forms, stores, send, send.len(), dtype, |how, send| run(how, ScatterParts::apart(send, recv, call.rank)))
            }
            None => {
                let size = recv.len();
                // The agreement reads the whole input where it lies; the form then writes our part.
                pulled_or_staged(&cx, &mut st.attach, forms, stores, recv, size, dtype, |how, whole| {
                    run(how, ScatterParts::in_place(whole, call.rank, call.world))
                })
            }
        }
    }

    /// Allgather among all ranks (all on this host) (see [`pull`] and [`parts`]). In place
    /// (`send` None) this rank's block of `recv` is its input, and peers read it there.
    pub(crate) fn allgather(&mut self, call: &OneHostCall<'_>, send: Option<&[u8]>, recv: &mut [u8]) -> Result<()> {
        let cx = ShmCtx::new(&self.ctl, self.spin, call);
        let st = &mut self.state;
        // What the call moves per rank is the whole output.
        let moved = recv.len();
        let (mine, peers) = PeerBlocks::around(recv, call.rank, moved / call.world);
        let (send, own) = match send {
            Some(send) => (send, Some(mine)),
            None => (&*mine, None),
        };
        pulled_or_staged(&cx, &mut st.attach, &mut st.part_forms.allgather, &mut st.part_stores.allgather, send, moved, DType::U8, |how, send| match how {
            How::Pulled(src) => pull::allgather(&cx, &src, send, own, peers),
            How::Staged(streaming) => parts::allgather(&cx, send, own, peers, streaming),
        })
    }

    /// All-to-all with equal blocks among all ranks (all on this host) (see [`pull`] and
    /// [`parts`]).
    pub(crate) fn alltoall(&mut self, call: &OneHostCall<'_>, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let cx = ShmCtx::new(&self.ctl, self.spin, call);
        let st = &mut self.state;
        pulled_or_staged(&cx, &mut st.attach, &mut st.part_forms.alltoall, &mut st.part_stores.alltoall, send, send.len(), DType::U8, |how, send| match how {
            How::Pulled(src) => pull::alltoall(&cx, &src, send, recv),
            How::Staged(streaming) => parts::alltoall(&cx, send, recv, streaming),
        })
    }

    /// Broadcast of the root's `buf` among all ranks (all on this host) (see [`pull`] and
    /// [`parts`]).
    pub(crate) fn broadcast(&mut self, call: &OneHostCall<'_>, buf: &mut [u8], root: usize) -> Result<()> {
        let cx = ShmCtx::new(&self.ctl, self.spin, call);
        let st = &mut self.state;
        // The agreement publishes the buffer; the form then writes into it.
        let len = buf.len();
        pulled_or_staged(&cx, &mut st.attach, &mut st.part_forms.broadcast, &mut st.part_stores.broadcast, buf, len, DType::U8, |how, buf| match how {
            How::Pulled(src) => pull::broadcast(&cx, &src, buf, root),
            How::Staged(streaming) => parts::broadcast(&cx, buf, root, streaming),
        })
    }

    /// Reduce to `root` among all ranks (all on this host) (see [`pull`] and [`parts`]); the
    /// others' `buf` stay as they are.
    pub(crate) fn reduce(&mut self, call: &OneHostCall<'_>, buf: &mut [u8], root: usize, dtype: DType, op: ReduceOp) -> Result<()> {
        let cx = ShmCtx::new(&self.ctl, self.spin, call);
        let st = &mut self.state;
        let len = buf.len();
        pulled_or_staged(&cx, &mut st.attach, &mut st.part_forms.reduce, &mut st.part_stores.reduce, buf, len, dtype, |how, buf| match how {
            How::Pulled(mut src) => pull::reduce(&cx, &mut src, buf, root, dtype, op),
            How::Staged(streaming) => parts::reduce(&cx, buf, root, dtype, op, streaming),
        })
    }

    /// Barrier among all ranks (all on this host): two phases, the calls checked between
    /// them (after one, a peer may already have announced its next call).
    pub(crate) fn barrier(&self, call: &OneHostCall<'_>) -> Result<()> {
        let cx = ShmCtx::new(&self.ctl, self.spin, call);
        let base = self.ctl.phase(cx.rank).load(Ordering::Relaxed);
        cx.advance(base + 1);
        cx.wait_all(base + 1)?;
        cx.check_calls()?;
        cx.advance(base + 2);
        cx.wait_all(base + 2)
    }
}

/// Runs a collective through the staging areas with the stores `stores` picks for its size
/// and dtype, and tells it how long the call took.
fn staged_stores(stores: &mut StoreChooser, len: usize, dtype: DType, run: impl FnOnce(bool) -> Result<()>) -> Result<()> {
    let streaming = stores.choose(len, dtype);
    let started = Instant::now();
    run(streaming)?;
    if let Some(flip) = stores.record(len, dtype, streaming, started.elapsed()) {
        log::debug!("staged collective of {flip}");
    }
    Ok(())
}

/// How a one-host collective other than the allreduce runs: in the peers' buffers, or
/// through the staging areas with plain (false) or streaming stores.
enum How<'s> {
    Pulled(Sources<'s>),
    Staged(bool),
}

/// Runs a one-host collective other than the allreduce that moves `size` bytes per rank,
/// `buf` being this rank's send buffer (handed on to `run`: a broadcast, a reduce or an
/// in-place reduce-scatter then writes it).
/// From [`LARGE_MIN`] bytes the ranks agree on how they reach each other's `buf`
/// ([`agree_on_form`]): mapped where all come from `gradwire_alloc` or are registered in
/// place; else, for private buffers, through cross-memory attach where rank 0's `forms`
/// has timed it faster than staging for this collective and size and the kernel lets every
/// rank attach; else staged, with the stores `stores` has timed faster. One rank decides
/// for all: ranks that each chose for themselves fell out of step (attach needs them all,
/// so one rank's probe of it staged and left its chooser a call apart from the others')
/// and then never tried attach together again, staging at more than twice its time.
#[allow(clippy::too_many_arguments)] // the collective's own state, split so each part can be borrowed
fn pulled_or_staged<B: Deref<Target = [u8]>>(
    cx: &ShmCtx<'_>,
    attach: &mut Attach,
    forms: &mut StoreChooser,
    stores: &mut StoreChooser,
    buf: B,
    size: usize,
    dtype: DType,
    run: impl FnOnce(How<'_>, B) -> Result<()>,
) -> Result<()> {
    if size < LARGE_MIN || cx.world == 1 {
        return staged_stores(stores, size, dtype, |streaming| run(How::Staged(streaming), buf));
    }
    let leader = cx.rank == 0;
    let timed = leader && attach.enabled;
    let want_attach = attach.enabled && (!leader || forms.choose(size, dtype));
    let started = Instant::now();
    let len = buf.len();
    let attached = match agree_on_form(cx, attach, want_attach, &buf, dtype.size())? {
        Agreed::Mapped { peers, body } => {
            stores.ran_another_form(size, dtype);
            return run(How::Pulled(Sources::new(PeerBuffers::Mapped { peers, body }, len, &mut attach.scratch)), buf);
        }
        Agreed::Attach(peers) => {
            run(How::Pulled(Sources::new(PeerBuffers::Attached(peers), len, &mut attach.scratch)), buf)?;
            stores.ran_another_form(size, dtype);
            true
        }
        Agreed::Staged { .. } => {
            staged_stores(stores, size, dtype, |streaming| run(How::Staged(streaming), buf))?;
            false
        }
    };
    // A rank that can no longer attach (the kernel refused) stages from now on, untimed.
    if timed && attach.enabled {
        if let Some(flip) = forms.record(size, dtype, attached, started.elapsed()) {
            log::debug!("rank {}: {} (private buffers): {flip}", cx.rank, cx.call);
        }
    }
    Ok(())
}

/// From `state.agree_from` bytes, the ranks agree on reaching each other's allreduce
/// buffer ([`agree_on_form`]); `None` when the call stages.
fn agree_large(cx: &ShmCtx<'_>, state: &mut OneHostState, buf: &[u8], elem: usize) -> Result<Option<Agreed>> {
    if buf.len() < state.agree_from {
        return Ok(None);
    }
    match agree_on_form(cx, &mut state.attach, true, buf, elem)? {
        Agreed::Staged { someone_cannot_attach } => {
            if someone_cannot_attach && state.agree_from < ZERO_COPY_MIN {
                state.agree_from = ZERO_COPY_MIN;
                log::debug!("rank {}: not every rank can attach; only calls from {ZERO_COPY_MIN} bytes look for mapped buffers from now on", cx.rank);
            }
            Ok(None)
        }
        agreed => Ok(Some(agreed)),
    }
}

/// One collective call as the one-host forms see it.
pub(crate) struct OneHostCall<'a> {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) call: CallHeader,
    pub(crate) deadline: Instant,
    /// The communicator's abort flag.
    pub(crate) abort: &'a AtomicBool,
}

/// An allgather's output split around this rank's block, which the call does not write:
/// it holds our part already (in place) or the call copies it there once. The peers'
/// blocks are what the forms fill.
struct PeerBlocks<'a> {
    before: &'a mut [u8],
    after: &'a mut [u8],
    me: usize,
    n: usize,
}

impl<'a> PeerBlocks<'a> {
    /// `recv` (W blocks of `n` bytes) as our block and the peers'.
    fn around(recv: &'a mut [u8], me: usize, n: usize) -> (&'a mut [u8], Self) {
        debug_assert!(n == 0 || recv.len() % n == 0 && me < recv.len() / n);
        let (before, rest) = recv.split_at_mut(me * n);
        let (mine, after) = rest.split_at_mut(n);
        (mine, PeerBlocks { before, after, me, n })
    }

    /// Rank `p`'s block (`p` is not us).
    fn of(&mut self, p: usize) -> &mut [u8] {
        debug_assert_ne!(p, self.me);
        match p < self.me {
            true => &mut self.before[p * self.n..][..self.n],
            false => &mut self.after[(p - self.me - 1) * self.n..][..self.n],
        }
    }
}

/// A reduce-scatter's input (W parts of `out.len()` bytes) as the peers' parts and ours,
/// and where the result goes: a separate buffer, or our part itself (in place, where
/// `own` is None). Peers read the other parts (through the staging areas or where they
/// lie); only this rank reads and writes its own.
struct ScatterParts<'a> {
    peers: PeerParts<'a>,
    own: Option<&'a [u8]>,
    out: &'a mut [u8],
}

/// The peers' parts of a reduce-scatter's input: those before ours and those after.
#[derive(Clone, Copy)]
struct PeerParts<'a> {
    before: &'a [u8],
    after: &'a [u8],
    me: usize,
    n: usize,
}

impl<'a> ScatterParts<'a> {
    fn apart(send: &'a [u8], recv: &'a mut [u8], me: usize) -> Self {
        let n = recv.len();
        debug_assert!(n == 0 || send.len() % n == 0 && me < send.len() / n);
        let (before, rest) = send.split_at(me * n);
        let (own, after) = rest.split_at(n);
        ScatterParts { peers: PeerParts { before, after, me, n }, own: Some(own), out: recv }
    }

    fn in_place(whole: &'a mut [u8], me: usize, world: usize) -> Self {
        let n = whole.len() / world;
        let (before, rest) = whole.split_at_mut(me * n);
        let (out, after) = rest.split_at_mut(n);
        ScatterParts { peers: PeerParts { before, after, me, n }, own: None, out }
    }
}

impl<'a> PeerParts<'a> {
    /// Rank `p`'s part (`p` is not us).
    fn of(&self, p: usize) -> &'a [u8] {
        debug_assert_ne!(p, self.me);
        match p < self.me {
            true => &self.before[p * self.n..][..self.n],
            false => &self.after[(p - self.me - 1) * self.n..][..self.n],
        }
    }
}

/// Waits shorter than this do not look for a dead peer in /proc (see `check_peer`).
const PROC_CHECK_AFTER: Duration = Duration::from_micros(100);

/// What a form needs of one call: the control pages, who we are, the call, its deadline.
struct ShmCtx<'a> {
    ctl: &'a Control,
    rank: usize,
    world: usize,
    call: CallHeader,
    deadline: Instant,
    abort: &'a AtomicBool,
    spin: Duration,
}

impl<'a> ShmCtx<'a> {
    fn new(ctl: &'a Control, spin: Duration, c: &OneHostCall<'a>) -> Self {
        ShmCtx { ctl, rank: c.rank, world: c.world, call: c.call, deadline: c.deadline, abort: c.abort, spin }
    }

    /// Waits until every other rank's phase counter reaches `target`.
    fn wait_all(&self, target: u64) -> Result<()> {
        let backoff = Backoff::new(self.spin);
        (0..self.world).filter(|&p| p != self.rank).try_for_each(|p| self.wait_on(p, target, &backoff))
    }

    /// Waits until rank `p`'s phase counter reaches `target`.
    fn wait_for(&self, p: usize, target: u64) -> Result<()> {
        self.wait_on(p, target, &Backoff::new(self.spin))
    }

    fn wait_on(&self, p: usize, target: u64, backoff: &Backoff) -> Result<()> {
        let ph = self.ctl.phase(p);
        let mut iter = 0u64;
        while ph.load(Ordering::Acquire) < target {
            iter += 1;
            if iter % 64 == 0 {
                if let Err(e) = self.check_peer(p, backoff.idle()) {
                    // The peer may have reached the phase, then exited, after our load.
                    if ph.load(Ordering::Acquire) >= target {
                        break;
                    }
                    return Err(e);
                }
            }
            backoff.pause();
        }
        Ok(())
    }

    /// Checks every rank's published call against ours (every rank must be in this call).
    fn check_calls(&self) -> Result<()> {
        (0..self.world).try_for_each(|p| self.check_call_of(p))
    }

    /// Checks rank `p`'s published call against ours (`p` must be in this call).
    fn check_call_of(&self, p: usize) -> Result<()> {
        // A rank in this call has written its header: it reads as one call.
        let bytes = self.ctl.call_of(p).ok_or_else(|| Error::Protocol(format!("rank {p}'s shared call header kept changing during {}", self.call)))?;
        let h = FrameHeader::decode(&bytes).map_err(|e| Error::Protocol(format!("rank {p}'s shared call header: {e}")))?;
        if h.call != self.call {
            return Err(Error::Mismatch { rank: self.rank, mine: self.call.to_string(), peer: p, theirs: h.call.to_string() });
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
        let gone = if waited >= PROC_CHECK_AFTER { self.ctl.peer_gone(p) } else { self.ctl.aborted_reason(p) };
        if let Some(why) = gone {
            return Err(Error::PeerLost { rank: self.rank, peer: p, op: self.call.to_string(), cause: why });
        }
        // A peer that started a different call with the same sequence number will never
        // reach our phase: report the mismatch now instead of at the deadline.
        if let Some(Ok(h)) = self.ctl.call_of(p).map(|bytes| FrameHeader::decode(&bytes)) {
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
        self.ctl.phase(self.rank).store(to, Ordering::Release);
    }

    /// A call in the peers' buffers (zero-copy or cross-memory attach) failed after peers
    /// may have started writing into our buffer: the caller must not get it back before
    /// they write no more. We say that we write no more (so that a peer doing the same does
    /// not wait for us) and fail the communicator now rather than after returning (peers
    /// waiting for our phase fail at once, and stop writing into our buffer).
    fn fail_in_peer_buffers(&self, e: Error, done: u64) -> Error {
        self.ctl.set_writes_done(done);
        self.ctl.set_aborted(&e.to_string());
        self.let_writers_finish(done);
        e
    }

    /// After a failed call in the peers' buffers: waits until no peer writes into our buffer
    /// any more before phase `done` (see `ShmDomain::writes_done`). A peer never waits for
    /// us on the way there, so this ends; the bound is for a peer that is frozen (it checks
    /// our abort flag before each block it writes, so at most one block may still land).
    fn let_writers_finish(&self, done: u64) {
        let until = Instant::now() + WRITERS_GRACE;
        for p in (0..self.world).filter(|&p| p != self.rank) {
            while !self.ctl.writes_done(p, done) {
                if Instant::now() >= until {
                    log::error!(
                        "rank {}: rank {p} neither finished nor failed its part of {} within {WRITERS_GRACE:?}; it may still write one block into this buffer",
                        self.rank,
                        self.call
                    );
                    return;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

/// Longest a failed call in the peers' buffers waits for peers still writing into its
/// buffer.
const WRITERS_GRACE: Duration = Duration::from_secs(2);

/// Encodes a call for publication in the shared control page.
fn encode_call(call: &CallHeader) -> [u8; HEADER_LEN] {
    FrameHeader { kind: FrameKind::Data, call: *call, step: 0, len: 0 }.encode()
}

/// What the one-host forms keep between calls (mostly the allreduce's; the pulling
/// reduce-scatter and reduce borrow the scratch).
struct OneHostState {
    /// What the staged form has learned about this host's stores.
    stores: StoreChooser,
    /// The same for the other staged collectives (each writes its own pattern).
    part_stores: PartStores,
    /// Staging or cross-memory attach for their private buffers, by timing (see
    /// [`pulled_or_staged`]).
    part_forms: PartStores,
    /// Cross-memory attach for private buffers.
    attach: Attach,
    /// Size from which the ranks agree on a large form: [`LARGE_MIN`], or
    /// [`ZERO_COPY_MIN`] once some rank cannot attach (every rank learns it in the same
    /// call, from the same published addresses).
    agree_from: usize,
}

/// A chooser per collective other than the allreduce (of stores, or of forms).
struct PartStores {
    reduce_scatter: StoreChooser,
    allgather: StoreChooser,
    alltoall: StoreChooser,
    broadcast: StoreChooser,
    reduce: StoreChooser,
}

impl PartStores {
    fn new(chooser: impl Fn() -> StoreChooser) -> Self {
        PartStores { reduce_scatter: chooser(), allgather: chooser(), alltoall: chooser(), broadcast: chooser(), reduce: chooser() }
    }
}

impl Default for OneHostState {
    fn default() -> Self {
        OneHostState::new(StagedStores::Auto, true)
    }
}

impl OneHostState {
    fn new(stores: StagedStores, cross_memory_attach: bool) -> Self {
        let attach = Attach { enabled: cross_memory_attach, scratch: Vec::new() };
        OneHostState {
            stores: StoreChooser::new(stores),
            part_stores: PartStores::new(|| StoreChooser::new(stores)),
            part_forms: PartStores::new(|| StoreChooser::forms(cross_memory_attach)),
            attach,
            agree_from: LARGE_MIN,
        }
    }
}

/// In-place allreduce of `buf` among all ranks of the domain (all on this host), in the
/// form its size calls for. Every rank picks the same: the sizes match (checked), and
/// which large form runs is agreed in its first one or two barriers.
fn shm_allreduce(cx: &ShmCtx<'_>, state: &mut OneHostState, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    if buf.len() <= cx.small_capacity() && buf.len() * cx.world <= SMALL_READ_MAX {
        return small::shm_allreduce_small(cx, buf, dtype, op);
    }
    if let Some(agreed) = agree_large(cx, state, buf, dtype.size())? {
        let access = match agreed {
            Agreed::Mapped { peers, body } => (PeerAccess::Mapped(peers), body),
            Agreed::Attach(peers) => (PeerAccess::Attach { peers, scratch: &mut state.attach.scratch }, 0..buf.len()),
            Agreed::Staged { .. } => unreachable!("agree_large gives no staged agreement"),
        };
        return shm_allreduce_in_peer_buffers(cx, buf, access.1, dtype, op, access.0);
    }
    let stores = &mut state.stores;
    let streaming = stores.choose(buf.len(), dtype);
    let took = staged::shm_allreduce_staged(cx, buf, dtype, op, streaming)?;
    if let Some(flip) = stores.record(buf.len(), dtype, streaming, took) {
        log::debug!("rank {}: the staged allreduce of {flip}", cx.rank);
    }
    Ok(())
}

/// Largest buffer for the one-barrier small form.
pub const SMALL_MAX: usize = 64 << 10;

/// The small form has every rank read every input (W·S bytes); beyond this the staged
/// form, where each rank reduces 1/W of them, wins (at 4 ranks from about 32-64 KiB; at 2
/// ranks the two are even at 64 KiB).
const SMALL_READ_MAX: usize = 128 << 10;

/// Room for the call header in front of each half of the small form's area (a cache line).
const SMALL_HEADER: usize = 64;

impl ShmCtx<'_> {
    /// Bytes of each of the small form's two halves: a call header and the data (the
    /// area is at most a quarter of the staging area; whole cache lines).
    fn small_half(&self) -> usize {
        (self.ctl.stage_len() / 8).min(SMALL_HEADER + SMALL_MAX) / 64 * 64
    }

    /// Largest buffer the small form takes.
    fn small_capacity(&self) -> usize {
        self.small_half().saturating_sub(SMALL_HEADER)
    }

    /// Bytes of the staging area the staged form uses: all but the small form's area.
    fn staged_capacity(&self) -> usize {
        self.ctl.stage_len() - 2 * self.small_half()
    }

    /// Bytes of one rank's slot of the staged area (each segment of a staged form gives
    /// part p slot p): whole cache lines where there is room, and always a multiple of
    /// every element size.
    fn slot_len(&self) -> Result<usize> {
        let slot = match self.staged_capacity() / self.world {
            n if n >= 64 => n / 64 * 64,
            n => n / 8 * 8,
        };
        if slot == 0 {
            return Err(Error::InvalidArgument(format!("GRADWIRE_SHM_STAGE_BYTES={} leaves no staging room for {} ranks", self.ctl.stage_len(), self.world)));
        }
        Ok(slot)
    }
}

/// Reduction block of the staged forms: every source's block is combined into the
/// destination block while it is still in L1/L2.
const BLOCK: usize = 32 << 10;

/// From this size on, the ranks agree on a form that works in the peers' buffers: buffers
/// that every rank maps take the zero-copy form, private ones cross-memory attach where
/// the kernel lets every rank reach every peer. Agreeing costs a call that stages anyway
/// one barrier, a large share of the call below 256 KiB and a small one above, where
/// mapped buffers and cross-memory attach both beat staging.
pub const LARGE_MIN: usize = 256 << 10;

/// Where some rank cannot attach, only calls from this size agree (on zero-copy or not):
/// the agreement's barrier costs a call that stages more at smaller sizes than mapped
/// buffers gain there.
pub const ZERO_COPY_MIN: usize = 4 << 20;
