//! Collectives layer: allreduce, reduce-scatter, allgather, broadcast, reduce, barrier —
//! blocking and non-blocking, for every [`DType`] and sum/avg/min/max/product (avg on the
//! floating-point types), on any communicator (including ones made by `split`).
//!
//! Algorithm choice for allreduce (`GRADWIRE_ALGO=auto`): on one host with shared memory,
//! the shared-buffer reduction (`shm`); otherwise recursive doubling or the ring, whichever
//! the cost model ([`crate::cost`], the network's `GRADWIRE_NET_*`) predicts faster for the
//! size and the ranks (below `GRADWIRE_SMALL_BYTES`, where that is set). f16 and bf16 are reduced in f32 and
//! rounded once per element on every automatic path (the one-host forms read every copy;
//! over links, `algos::half_allreduce` and `algos::direct_reduce_scatter` bring every
//! copy of a part to one rank); an explicitly chosen ring, recursive doubling or halving-
//! doubling rounds at each of its steps.
//!
//! Reduce-scatter, allgather, all-to-all, broadcast, reduce and barrier on one host with
//! shared memory go through `shm`: large calls straight out of the peers' buffers where every
//! rank reaches them (`shm::pull`), others through the ranks' staging areas (`shm::parts`).
//! Elsewhere reduce-scatter and allgather take the ring (f16 and bf16 reduce-scatters:
//! every copy of a part straight to its owner), broadcast a binomial tree or a pipelined
//! chain, reduce a binomial tree or the chain reversed, all-to-all one exchange of every block
//! at once.

pub(crate) mod agree;
pub(crate) mod algos;
pub(crate) mod exchange;
pub(crate) mod hierarchical;
pub mod layout;
pub mod reduce;
pub(crate) mod shm;
mod split;
pub(crate) mod state;

use crate::comm::Communicator;
use crate::config::Algo;
use crate::dtype::{DType, Element, ReduceOp};
use crate::engine::{EngineState, Work};
use crate::error::{invalid, Result};
use crate::transport::frame::{CallHeader, OpKind};
use algos::Ctx;
use layout::{Layout, Span};
use shm::OneHostCall;
use state::CollectiveState;
use std::time::Instant;

/// A buffer address handed to the progress thread.
#[derive(Clone, Copy)]
struct Ptr(*mut u8);
// SAFETY: the submitter guarantees the memory stays valid and untouched until the Work
// completes (see `Communicator::start`).
unsafe impl Send for Ptr {}

/// Which collective a [`Request`] runs. (The wire format's `OpKind` also names
/// point-to-point messages, which run through calls of their own, as all-to-all with blocks
/// of different sizes does.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Collective {
    /// Every rank gets the reduction of every rank's buffer.
    Allreduce,
    /// Rank r gets the reduction of part r of every rank's buffer.
    ReduceScatter,
    /// Every rank gets every rank's part, in rank order.
    Allgather,
    /// Every rank gets the root's buffer.
    Broadcast,
    /// The root gets the reduction of every rank's buffer.
    Reduce,
    /// Returns once every rank has entered it.
    Barrier,
    /// Block p of every rank's buffer goes to rank p, into block r for rank r: every
    /// block `count` elements (MPI_Alltoall, torch's `all_to_all_single` without splits;
    /// blocks of other sizes: [`Communicator::start_alltoall`]).
    AllToAll,
}

impl Collective {
    /// Its name in messages, e.g. `reduce_scatter`.
    pub fn name(self) -> &'static str {
        OpKind::from(self).name()
    }
}

impl From<Collective> for OpKind {
    fn from(c: Collective) -> OpKind {
        match c {
            Collective::Allreduce => OpKind::Allreduce,
            Collective::ReduceScatter => OpKind::ReduceScatter,
            Collective::Allgather => OpKind::Allgather,
            Collective::Broadcast => OpKind::Broadcast,
            Collective::Reduce => OpKind::Reduce,
            Collective::Barrier => OpKind::Barrier,
            Collective::AllToAll => OpKind::AllToAll,
        }
    }
}

/// A collective call, in bytes.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    /// The collective.
    pub op: Collective,
    /// Element type of the buffers.
    pub dtype: DType,
    /// Reduction, for allreduce, reduce-scatter and reduce.
    pub redop: ReduceOp,
    /// Elements per rank as the C/MPI conventions count them: the buffer for allreduce,
    /// broadcast and reduce; the receive part for reduce-scatter; the send part for
    /// allgather; one block (to or from one rank) for all-to-all.
    pub count: usize,
    /// Root rank of broadcast and reduce.
    pub root: usize,
    /// Allreduce override; `None` follows `GRADWIRE_ALGO`.
    pub algo: Option<Algo>,
}

impl Request {
    /// A request of `count` elements, root 0, algorithm from the settings.
    pub fn new(op: Collective, dtype: DType, redop: ReduceOp, count: usize) -> Self {
        Request { op, dtype, redop, count, root: 0, algo: None }
    }

    /// Checks this request with its buffers on `rank` of `size` ranks, as every entry
    /// point does, once (the one check of a call: root, reduction, sizes, buffers present
    /// and laid out as [`layout::layout`] allows); returns the send and receive bytes and
    /// the buffers' layout.
    pub fn check(&self, rank: usize, size: usize, send: *const u8, recv: *const u8) -> Result<(usize, usize, Layout)> {
        if matches!(self.op, Collective::Broadcast | Collective::Reduce) && self.root >= size {
            return Err(invalid(format!("root {} is not a rank of this communicator (size {size})", self.root)));
        }
        if matches!(self.op, Collective::Allreduce | Collective::ReduceScatter | Collective::Reduce) {
            self.redop.check(self.dtype)?;
        }
        let (slen, rlen) = self.lengths(size)?;
        if slen > 0 && send.is_null() {
            return Err(invalid("sendbuf is NULL"));
        }
        if rlen > 0 && recv.is_null() {
            return Err(invalid("recvbuf is NULL"));
        }
        Ok((slen, rlen, layout::layout(self.op, rank, Span::of(send, slen), Span::of(recv, rlen))?))
    }

    /// (send bytes, receive bytes) this request reads and writes on a world of `w` ranks.
    pub fn lengths(&self, w: usize) -> Result<(usize, usize)> {
        let b = self.count.checked_mul(self.dtype.size()).ok_or_else(|| invalid(format!("count {} overflows", self.count)))?;
        // Only the collectives with a block per rank have a buffer of W blocks: an allreduce
        // of a count whose W-fold overflows is refused for its own size, not for that.
        let per_rank = matches!(self.op, Collective::ReduceScatter | Collective::Allgather | Collective::AllToAll);
        let wb = if per_rank { b.checked_mul(w).ok_or_else(|| invalid(format!("count {} x {w} ranks overflows", self.count)))? } else { b };
        // No buffer is larger than isize::MAX bytes: a longer slice is undefined behaviour.
        if wb > isize::MAX as usize {
            return Err(invalid(format!("count {} makes a buffer of {wb} bytes, more than any buffer can hold", self.count)));
        }
        Ok(match self.op {
            Collective::ReduceScatter => (wb, b),
            Collective::Allgather => (b, wb),
            Collective::AllToAll => (wb, wb),
            Collective::Barrier => (0, 0),
            _ => (b, b),
        })
    }
}

/// Runs an in-place allgather or reduce-scatter (NCCL's layouts) on the whole buffer with
/// no separate input, so that no two views of the same bytes are alive. The allgather's
/// forms read this rank's block where it lies and write only the others (FSDP and ZeRO
/// gather parameters this way); the reduce-scatter's reduce into it (Megatron's
/// distributed optimizer reduce-scatters this way; on one host in place, over the links
/// through a block kept between calls). Through a copy of the block in a fresh buffer they
/// took 1.3-2.8x the out-of-place time (2 ranks, 1-64 MiB). A call that fails may leave
/// the reduce-scatter's block partly reduced, as an out-of-place one leaves its output.
///
/// # Safety
/// As for [`Communicator::start`]: `send` readable for `slen` and `recv` writable for
/// `rlen` bytes, in the [`Layout::Block`] layout.
#[allow(clippy::too_many_arguments)]
unsafe fn run_in_place_block(
    st: &mut EngineState,
    kept: &mut CollectiveState,
    deadline: Instant,
    call: CallHeader,
    req: Request,
    algo: Algo,
    tune: Sizes,
    send: *mut u8,
    slen: usize,
    recv: *mut u8,
    rlen: usize,
) -> Result<()> {
    let whole = match req.op {
        // SAFETY: `recv` is writable for `rlen` bytes and holds `send`, this rank's block
        // (the caller's contract): the only view of them.
        Collective::Allgather => unsafe { std::slice::from_raw_parts_mut(recv, rlen) },
        // SAFETY: `send` is readable and writable for `slen` bytes (the caller's contract
        // for an in-place reduce-scatter, see `start`) and holds `recv`: the only view.
        Collective::ReduceScatter => unsafe { std::slice::from_raw_parts_mut(send, slen) },
        op => unreachable!("only an allgather or a reduce-scatter has a block layout, not {}", op.name()),
    };
    run(st, kept, deadline, call, req, algo, tune, None, whole)
}

impl Communicator {
    /// Starts a collective on raw buffers and returns at once.
    ///
    /// # Safety
    /// `send` must be readable for the request's send length and `recv` writable for its
    /// receive length (see [`Request::lengths`]); both must stay valid, `recv` must not be
    /// read or written by anyone else and `send` not written (the collectives read it
    /// where it lies, as the call runs), until the returned `Work` has completed. `send`
    /// may equal `recv` (in place) for allreduce, broadcast and reduce; in place as NCCL
    /// defines it, an allgather's `send` may be this rank's block of `recv` and a
    /// reduce-scatter's `recv` this rank's block of `send` (then `send` must be writable
    /// too, a pointer that may write the whole buffer: the result is reduced into it).
    pub unsafe fn start(&self, req: Request, send: *const u8, recv: *mut u8) -> Result<Work> {
        let job = self.job(req, send, recv)?;
        Ok(self.submit(describe(&req), job))
    }

    /// Runs a collective on raw buffers to completion (on this thread when nothing is
    /// queued ahead of it).
    ///
    /// # Safety
    /// As for [`Communicator::start`], until this call returns.
    pub unsafe fn run(&self, req: Request, send: *const u8, recv: *mut u8) -> Result<()> {
        let job = self.job(req, send, recv)?;
        self.run_blocking(|| describe(&req), job)
    }

    /// Validates a request and packages it for the engine.
    fn job(&self, req: Request, send: *const u8, recv: *mut u8) -> Result<crate::engine::Job> {
        let (slen, rlen, layout) = req.check(self.rank(), self.size(), send, recv)?;
        let block = layout == Layout::Block;
        let tune = Sizes { small: self.config.small_bytes, ring_chunk: self.config.ring_chunk_bytes, network: self.config.network };
        let default_algo = self.config.algo;
        let (s, r) = (Ptr(send as *mut u8), Ptr(recv));
        let kept = self.collectives.clone();
        let job = Box::new(move |st: &mut EngineState, deadline: Instant| {
            let (s, r) = (s, r);
            let kept = &mut *kept.lock();
            // Sequence numbers are given at execution, in the order operations run.
            let call = CallHeader { op: req.op.into(), dtype: req.dtype, redop: req.redop, root: req.root as u32, count: req.count as u64, seq: st.next_seq() };
            if block {
                // SAFETY: as below; `layout` found the block layout.
                return unsafe { run_in_place_block(st, kept, deadline, call, req, req.algo.unwrap_or(default_algo), tune, s.0, slen, r.0, rlen) };
            }
            // In place, the receive buffer is the only view of the bytes: a shared view of
            // them beside the mutable one would break Rust's aliasing rules.
            // SAFETY: lengths and validity are the caller's contract (see `start`).
            let sbuf: Option<&[u8]> = match slen {
                0 => Some(&[]),
                _ if std::ptr::eq(s.0, r.0) => None,
                // SAFETY: lengths and validity are the caller's contract (see `start`).
                _ => Some(unsafe { std::slice::from_raw_parts(s.0, slen) }),
            };
            // SAFETY: as for `sbuf`.
            let rbuf: &mut [u8] = if rlen == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(r.0, rlen) } };
            run(st, kept, deadline, call, req, req.algo.unwrap_or(default_algo), tune, sbuf, rbuf)
        });
        Ok(job)
    }

    /// Allreduce in place.
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.allreduce_with(buf, op, None)
    }

    /// Allreduce in place with an explicit algorithm (`None`: automatic).
    pub fn allreduce_with<T: Element>(&self, buf: &mut [T], op: ReduceOp, algo: Option<Algo>) -> Result<()> {
        let req = Request { algo, ..Request::new(Collective::Allreduce, T::DTYPE, op, buf.len()) };
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: `buf` is exclusively borrowed until run() returns, which is after the
        // engine is done with it.
        unsafe { self.run(req, p, p) }
    }

    /// Reduce-scatter: `send` holds `size * recv.len()` elements; rank r receives the
    /// reduction of part r.
    pub fn reduce_scatter<T: Element>(&self, send: &[T], recv: &mut [T], op: ReduceOp) -> Result<()> {
        if send.len() != recv.len() * self.size() {
            return Err(invalid(format!("reduce_scatter: send has {} elements, expected {} x {}", send.len(), recv.len(), self.size())));
        }
        let req = Request::new(Collective::ReduceScatter, T::DTYPE, op, recv.len());
        // SAFETY: borrows outlive wait().
        unsafe { self.run(req, send.as_ptr() as *const u8, recv.as_mut_ptr() as *mut u8) }
    }

    /// Allgather: `recv` holds `size * send.len()` elements, part r from rank r.
    pub fn allgather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        if recv.len() != send.len() * self.size() {
            return Err(invalid(format!("allgather: recv has {} elements, expected {} x {}", recv.len(), send.len(), self.size())));
        }
        let req = Request::new(Collective::Allgather, T::DTYPE, ReduceOp::Sum, send.len());
        // SAFETY: borrows outlive wait().
        unsafe { self.run(req, send.as_ptr() as *const u8, recv.as_mut_ptr() as *mut u8) }
    }

    /// Allgather in place (NCCL's and MPI_IN_PLACE's layout): `buf` holds `size` blocks,
    /// this rank's block is its contribution; afterwards block r is rank r's.
    pub fn allgather_in_place<T: Element>(&self, buf: &mut [T]) -> Result<()> {
        let block = self.blocks_of(buf.len(), "allgather_in_place")?;
        let req = Request::new(Collective::Allgather, T::DTYPE, ReduceOp::Sum, block);
        let p = buf.as_mut_ptr();
        // SAFETY: `buf` is exclusively borrowed until run() returns; the send block lies
        // inside it, at this rank's index.
        unsafe { self.run(req, p.add(self.rank() * block) as *const u8, p as *mut u8) }
    }

    /// Reduce-scatter in place (NCCL's and MPI_IN_PLACE's layout): `buf` holds `size`
    /// blocks; afterwards this rank's block holds the reduction of every rank's block of
    /// that index (the other blocks are left as they were).
    pub fn reduce_scatter_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        let block = self.blocks_of(buf.len(), "reduce_scatter_in_place")?;
        let req = Request::new(Collective::ReduceScatter, T::DTYPE, op, block);
        let p = buf.as_mut_ptr();
        // SAFETY: as for allgather_in_place; the receive block is this rank's.
        unsafe { self.run(req, p as *const u8, p.add(self.rank() * block) as *mut u8) }
    }

    /// The block length of a buffer of `size` equal blocks.
    fn blocks_of(&self, len: usize, what: &str) -> Result<usize> {
        if len % self.size() != 0 {
            return Err(invalid(format!("{what}: {len} elements do not split into {} equal blocks", self.size())));
        }
        Ok(len / self.size())
    }

    /// All-to-all with equal blocks: `send` and `recv` hold `size` blocks of the same
    /// length; block p of `send` goes to rank p, block p of `recv` comes from rank p.
    pub fn alltoall<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<()> {
        if send.len() != recv.len() || send.len() % self.size() != 0 {
            return Err(invalid(format!(
                "alltoall: send and recv must hold the same number of elements, a multiple of {}; they hold {} and {}",
                self.size(),
                send.len(),
                recv.len()
            )));
        }
        let req = Request::new(Collective::AllToAll, T::DTYPE, ReduceOp::Sum, send.len() / self.size());
        // SAFETY: borrows outlive wait().
        unsafe { self.run(req, send.as_ptr() as *const u8, recv.as_mut_ptr() as *mut u8) }
    }

    /// Broadcast `buf` from `root` to every rank.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        let req = Request { root, ..Request::new(Collective::Broadcast, T::DTYPE, ReduceOp::Sum, buf.len()) };
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: borrow outlives wait().
        unsafe { self.run(req, p, p) }
    }

    /// Reduce to `root` in place; other ranks' buffers are left unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], root: usize, op: ReduceOp) -> Result<()> {
        let req = Request { root, ..Request::new(Collective::Reduce, T::DTYPE, op, buf.len()) };
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: borrow outlives wait().
        unsafe { self.run(req, p, p) }
    }

    /// Returns once every rank has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        let req = Request::new(Collective::Barrier, DType::F32, ReduceOp::Sum, 0);
        // SAFETY: no buffers.
        unsafe { self.run(req, std::ptr::null(), std::ptr::null_mut()) }
    }

    /// Non-blocking allreduce of an owned vector; `Pending::wait` gives it back reduced.
    pub fn iallreduce<T: Element>(&self, mut buf: Vec<T>, op: ReduceOp) -> Result<Pending<Vec<T>>> {
        let req = Request::new(Collective::Allreduce, T::DTYPE, op, buf.len());
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: the vector's heap block does not move while `Pending` owns it, and
        // `Pending` waits for completion before handing it back or dropping it.
        let work = unsafe { self.start(req, p, p)? };
        Ok(Pending { work: Some(work), value: Some(buf) })
    }

    /// Non-blocking broadcast of an owned vector.
    pub fn ibroadcast<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Result<Pending<Vec<T>>> {
        let req = Request { root, ..Request::new(Collective::Broadcast, T::DTYPE, ReduceOp::Sum, buf.len()) };
        let p = buf.as_mut_ptr() as *mut u8;
        // SAFETY: as in iallreduce.
        let work = unsafe { self.start(req, p, p)? };
        Ok(Pending { work: Some(work), value: Some(buf) })
    }

    /// Sends `data` to `peer` with `tag`. Point-to-point messages are matched by (peer, tag),
    /// in order within a tag (as in MPI and torch): the receiver's `recv` of that tag from
    /// us must name the same count and dtype, or both get a mismatch error.
    pub fn send<T: Element>(&self, data: &[T], peer: usize, tag: u32) -> Result<()> {
        // SAFETY: `data` is borrowed for the whole call.
        unsafe { self.send_raw(data.as_ptr() as *const u8, data.len(), T::DTYPE, peer, tag) }
    }

    /// Receives the oldest message from `peer` with `tag` into `buf` (see [`Communicator::send`]).
    pub fn recv<T: Element>(&self, buf: &mut [T], peer: usize, tag: u32) -> Result<()> {
        // SAFETY: `buf` is exclusively borrowed for the whole call.
        unsafe { self.recv_raw(buf.as_mut_ptr() as *mut u8, buf.len(), T::DTYPE, peer, tag) }
    }

    /// Non-blocking barrier.
    pub fn ibarrier(&self) -> Result<Work> {
        let req = Request::new(Collective::Barrier, DType::F32, ReduceOp::Sum, 0);
        // SAFETY: no buffers.
        unsafe { self.start(req, std::ptr::null(), std::ptr::null_mut()) }
    }
}

/// A non-blocking operation that owns its buffers until it completes.
pub struct Pending<V> {
    work: Option<Work>,
    value: Option<V>,
}

impl<V> Pending<V> {
    /// Whether the operation has finished.
    pub fn test(&self) -> bool {
        self.work.as_ref().is_none_or(|w| w.test())
    }

    /// Waits for completion and returns the buffers.
    pub fn wait(mut self) -> Result<V> {
        if let Some(w) = self.work.take() {
            w.wait()?;
        }
        Ok(self.value.take().expect("value present until wait"))
    }
}

impl<V> Drop for Pending<V> {
    fn drop(&mut self) {
        // The engine may still be writing into the buffers: wait before they are freed.
        if let Some(w) = self.work.take() {
            let _ = w.wait();
        }
    }
}

/// What an algorithm choice needs (from [`crate::config::Config`]).
#[derive(Clone, Copy)]
struct Sizes {
    small: usize,
    ring_chunk: usize,
    /// The network's cost-model parameters (None: `small` decides the allreduce too).
    network: Option<crate::cost::Link>,
}

impl Sizes {
    /// Whether the automatic allreduce over links takes recursive doubling for `bytes` on
    /// `world` ranks: the cost model's choice, or the fixed threshold where one is set.
    fn latency_bound(&self, bytes: usize, world: usize) -> bool {
        match &self.network {
            Some(link) => crate::cost::choose_over_links(bytes as f64, world, link).0 == crate::cost::Algorithm::RecursiveDoubling,
            None => bytes < self.small,
        }
    }
}

/// Runs one collective on the progress thread; `send` is `None` in place.
#[allow(clippy::too_many_arguments)]
fn run(
    st: &mut EngineState,
    kept: &mut CollectiveState,
    deadline: Instant,
    call: CallHeader,
    req: Request,
    algo: Algo,
    tune: Sizes,
    send: Option<&[u8]>,
    recv: &mut [u8],
) -> Result<()> {
    let (rank, world) = (st.rank, st.world);
    let one_host = kept.one_host.as_mut();
    if let Some(one_host) = &one_host {
        one_host.announce(&call);
    }
    let mut on_one_host = one_host.filter(|h| h.covers_all());
    let host_call = OneHostCall { rank, world, call, deadline, abort: &st.abort };
    let scratch = &mut kept.scratch;
    let mut cx = Ctx { links: &mut st.links, call, deadline, rank, world, dtype: req.dtype, op: req.redop };
    // A rank that only sends in a rooted tree never reads a header: every rooted
    // collective over the links first agrees on its arguments (see `agree`). The one-host
    // forms check every rank's call in their first barrier.
    let rooted_over_links = matches!(req.op, Collective::Broadcast | Collective::Reduce) && on_one_host.is_none();
    if world > 1 && rooted_over_links {
        agree::agree_on_call(&mut cx)?;
    }
    match req.op {
        Collective::Allreduce => {
            if world == 1 {
                if let Some(send) = send {
                    recv.copy_from_slice(send);
                }
                return Ok(());
            }
            let half = algo == Algo::Auto && on_one_host.is_none() && matches!(req.dtype, DType::F16 | DType::BF16);
            let algo = match algo {
                Algo::Auto if on_one_host.is_some() => Algo::SharedMemory,
                Algo::Auto if tune.latency_bound(recv.len(), world) => Algo::RecursiveDoubling,
                Algo::Auto => Algo::Ring,
                Algo::SharedMemory if on_one_host.is_none() => {
                    return Err(invalid("GRADWIRE_ALGO=shm needs every rank on one host with the shm transport"));
                }
                a => a,
            };
            // The ring reads an out-of-place input where it lies; the others start from a copy.
            let ring = algo == Algo::Ring && !half;
            if let (Some(send), false) = (send, ring) {
                recv.copy_from_slice(send);
            }
            if half {
                return algos::half_allreduce(&mut cx, recv, tune.small, tune.ring_chunk);
            }
            match algo {
                Algo::SharedMemory => {
                    let one_host = on_one_host.as_mut().ok_or_else(|| invalid("no shared memory"))?;
                    one_host.allreduce(&host_call, recv, req.dtype, req.redop)
                }
                Algo::RecursiveDoubling => algos::recursive_doubling_allreduce(&mut cx, recv),
                Algo::HalvingDoubling => algos::halving_doubling_allreduce(&mut cx, recv),
                _ => algos::ring_allreduce(&mut cx, recv, send, tune.ring_chunk),
            }
        }
        Collective::AllToAll => {
            let send = send.ok_or_else(|| invalid("alltoall cannot run in place"))?;
            if let Some(one_host) = &mut on_one_host {
                return one_host.alltoall(&host_call, send, recv);
            }
            let bounds: Vec<usize> = (0..=world).map(|i| i * recv.len() / world).collect();
            exchange::alltoall_over_links(cx.links, &call, send, recv, &bounds, &bounds, rank, deadline)
        }
        Collective::ReduceScatter => {
            // In place (`send` None, see `run_in_place_block`) `recv` is the whole input and
            // the result goes into this rank's block of it.
            if let Some(one_host) = &mut on_one_host {
                return one_host.reduce_scatter(&host_call, send, recv, req.dtype, req.redop);
            }
            match send {
                Some(send) if world == 1 => {
                    recv.copy_from_slice(send);
                    Ok(())
                }
                Some(send) => reduce_scatter_over_links(&mut cx, scratch, send, recv, tune),
                None if world == 1 => Ok(()),
                None => {
                    // Over the links, through a block kept between calls (a fresh one per
                    // call faulted in every page again), copied into place at the end.
                    let n = recv.len() / world;
                    let block = crate::transport::scratch_bytes(&mut kept.in_place_block, n);
                    reduce_scatter_over_links(&mut cx, scratch, recv, block, tune)?;
                    recv[rank * n..][..n].copy_from_slice(block);
                    Ok(())
                }
            }
        }
        Collective::Allgather => {
            // In place (`send` None, see `run_in_place_block`) this rank's block of `recv`
            // is its input, read where it lies.
            if let Some(one_host) = &mut on_one_host {
                return one_host.allgather(&host_call, send, recv);
            }
            let block = recv.len() / world;
            let bounds: Vec<usize> = (0..=world).map(|i| i * block).collect();
            algos::ring_allgather(&mut cx, recv, send, &bounds, 0, tune.ring_chunk)
        }
        Collective::Broadcast => {
            if world == 1 {
                Ok(())
            } else if let Some(one_host) = &mut on_one_host {
                one_host.broadcast(&host_call, recv, req.root)
            } else if recv.len() < tune.small {
                algos::binomial_broadcast(&mut cx, recv, req.root)
            } else {
                let piece = (recv.len() / 8).clamp(64 << 10, 1 << 20);
                algos::chain_broadcast(&mut cx, recv, req.root, piece)
            }
        }
        Collective::Reduce => {
            if let Some(send) = send {
                recv.copy_from_slice(send);
            }
            match &mut on_one_host {
                Some(one_host) if world > 1 => one_host.reduce(&host_call, recv, req.root, req.dtype, req.redop),
                _ if world == 1 || recv.len() < tune.small => algos::binomial_reduce(&mut cx, recv, req.root),
                _ => {
                    // Only the ranks between the chain's tail and the root reduce in a copy.
                    let v = (rank + world - req.root) % world;
                    let needs = if v == 0 || v == world - 1 { 0 } else { recv.len() };
                    let work = crate::transport::scratch_bytes(scratch, needs);
                    let piece = (recv.len() / 8).clamp(64 << 10, 1 << 20);
                    algos::chain_reduce(&mut cx, recv, req.root, piece, work)
                }
            }
        }
        Collective::Barrier => match &on_one_host {
            Some(one_host) if world > 1 => one_host.barrier(&host_call),
            _ => algos::dissemination_barrier(&mut cx),
        },
    }
}

/// Reduce-scatter over the links: `send` holds W parts of `recv.len()` bytes. A pipelined
/// ring, reading `send` where it lies; f16 and bf16 straight to each part's owner, which
/// rounds once (see `algos::direct_reduce_scatter`).
fn reduce_scatter_over_links(cx: &mut Ctx<'_>, scratch: &mut Vec<u64>, send: &[u8], recv: &mut [u8], tune: Sizes) -> Result<()> {
    let bounds: Vec<usize> = (0..=cx.world).map(|i| i * recv.len()).collect();
    let work = crate::transport::scratch_bytes(scratch, send.len());
    if matches!(cx.dtype, DType::F16 | DType::BF16) {
        work.copy_from_slice(send);
        algos::direct_reduce_scatter(cx, work, &bounds)?;
        recv.copy_from_slice(&work[bounds[cx.rank]..bounds[cx.rank + 1]]);
        return Ok(());
    }
    algos::ring_reduce_scatter(cx, work, send, recv, &bounds, tune.ring_chunk)
}

/// How a queued collective is named in messages, e.g. `allreduce(count 1024, float32)`.
fn describe(req: &Request) -> String {
    format!("{}(count {}, {})", req.op.name(), req.count, req.dtype.name())
}

#[cfg(test)]
mod tests {
    use super::Sizes;
    use crate::cost::{choose_over_links, Algorithm, Link};

    #[test]
    fn the_automatic_allreduce_asks_the_cost_model_unless_a_threshold_is_set() {
        let link = Link::of_rate(25.0, 25e-6, 0.1e-9);
        let by_model = Sizes { small: 256 << 10, ring_chunk: 1 << 20, network: Some(link) };
        for world in [2, 3, 8, 64] {
            for bytes in [4096usize, 256 << 10, 1 << 20, 64 << 20] {
                let model = choose_over_links(bytes as f64, world, &link).0 == Algorithm::RecursiveDoubling;
                assert_eq!(by_model.latency_bound(bytes, world), model, "{bytes} B on {world} ranks");
            }
        }
        // The model's crossover grows with the ranks: at 64 ranks 1 MiB is still latency-bound.
        assert!(by_model.latency_bound(1 << 20, 64) && !by_model.latency_bound(1 << 20, 2));
        let fixed = Sizes { network: None, ..by_model };
        assert!(fixed.latency_bound((256 << 10) - 1, 64) && !fixed.latency_bound(256 << 10, 64));
    }
}
