//! Hierarchical allreduce over a node-local group and a cross-node group.
//!
//! Sharded (default): (1) reduce-scatter inside the node, so local rank l holds shard l of
//! the node's sum; (2) G concurrent cross-node allreduces, one per local index l over the
//! ranks holding shard l; (3) allgather inside the node. Every rank's link carries 1/G of
//! the cross-node traffic. Leader: reduce to local rank 0, allreduce among the leaders,
//! broadcast inside the node — fewer, larger cross-node messages. `gradwire bench
//! allreduce --hierarchical sharded|leader` measures both.
//!
//! Inside a node the groups use shared memory; between nodes, the links' transport (tcp or
//! verbs). GPU buffers take the same path with NCCL as the node-local step (see `gpu`).

use super::agree::agree_on;
use super::algos::Ctx;
use super::reduce::finish;
use super::Request;
use crate::collective::Collective;
use crate::comm::Communicator;
use crate::dtype::{DType, Element, ReduceOp};
use crate::engine::EngineState;
use crate::error::{config, invalid, Result};
use crate::transport::frame::{CallHeader, OpKind};
use std::time::Instant;

/// How the cross-node step is organised.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HierarchicalAlgo {
    /// Reduce-scatter in the node, one cross-node allreduce per shard, allgather in the node:
    /// every rank's link carries 1/G of the cross-node traffic (`sharded`, the default).
    Sharded = 0,
    /// Reduce to local rank 0, allreduce among those leaders, broadcast in the node: fewer,
    /// larger cross-node messages (`leader`).
    Leader = 1,
}

impl HierarchicalAlgo {
    /// Both, in the order of their codes (`as u64`).
    const ALL: [HierarchicalAlgo; 2] = [HierarchicalAlgo::Sharded, HierarchicalAlgo::Leader];

    /// Its name in messages and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sharded => "sharded",
            Self::Leader => "leader",
        }
    }
}

impl std::str::FromStr for HierarchicalAlgo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL.into_iter().find(|a| a.name() == s).ok_or_else(|| format!("unknown hierarchical algorithm {s:?} (sharded or leader)"))
    }
}

/// A hierarchical allreduce on raw buffers, as the C ABI hands them over.
#[derive(Clone, Copy, Debug)]
pub struct RawAllreduce {
    pub dtype: DType,
    pub op: ReduceOp,
    pub algo: HierarchicalAlgo,
    pub send: *const u8,
    /// Equal to `send` for in place.
    pub recv: *mut u8,
    /// Elements.
    pub count: usize,
}

// SAFETY: only addresses; whoever submits the call keeps the buffers valid and untouched
// until it has run (the contracts of `Hierarchy::run_raw` and `start_raw`).
unsafe impl Send for RawAllreduce {}

impl RawAllreduce {
    fn describe(&self) -> String {
        format!("hierarchical allreduce(count {}, {})", self.count, self.dtype.name())
    }

    /// Checks, over the links of the communicator the hierarchy was made from (`st`), that
    /// every rank passed the same count, dtype, reduce op and algorithm; the same mismatch
    /// error on every rank if not. The steps cannot tell: they carry only the padded shard
    /// size, so 65536 and 65535 elements on two ranks a node both make shards of 32768,
    /// and every rank would return success with the last element unreduced on some.
    fn agree(&self, st: &mut EngineState, deadline: Instant) -> Result<()> {
        if st.world == 1 {
            return Ok(());
        }
        let call = CallHeader { op: OpKind::Allreduce, dtype: self.dtype, redop: self.op, root: 0, count: self.count as u64, seq: st.next_seq() };
        let (rank, world) = (st.rank, st.world);
        let mut cx = Ctx { links: &mut st.links, call, deadline, rank, world, dtype: self.dtype, op: self.op };
        let mine = [self.count as u64, self.dtype as u64, self.op as u64, self.algo as u64];
        let named = |f: &[u64]| {
            let dtype = DType::from_u8(f[1] as u8).map_or("an unknown dtype", |d| d.name());
            let op = ReduceOp::from_u8(f[2] as u8).map_or("an unknown op", |o| o.name());
            let algo = HierarchicalAlgo::ALL.get(f[3] as usize).map_or("an unknown algorithm", |a| a.name());
            format!("hierarchical allreduce#{}(count {}, {dtype}, {op}, {algo})", call.seq, f[0])
        };
        agree_on(&mut cx, &["count", "dtype", "reduce op", "algorithm"], &mine, named)
    }
}

/// The two groups of a hierarchical allreduce, made once (two `split`s) and reused.
pub struct Hierarchy {
    /// The ranks of this node.
    pub node: Communicator,
    /// The ranks of every node with this rank's local index.
    pub cross: Communicator,
    world: usize,
    /// The sharded variant's padded buffer and shard, kept between calls: fresh zeroed
    /// allocations cost a page fault per 4 KiB on every call.
    scratch: std::sync::Mutex<(Vec<u64>, Vec<u64>)>,
}

/// The ranks per node, the same on every node, or an error saying `what` needs that.
pub(crate) fn same_ranks_per_node(comm: &Communicator, what: &str) -> Result<usize> {
    let topo = comm.topology();
    let g = topo.local_ranks(comm.rank()).len();
    if let Some(r) = (0..comm.size()).find(|&r| topo.local_ranks(r).len() != g) {
        return Err(config(format!(
            "{what} needs the same number of ranks on every node: rank {} has {g} local ranks, rank {r} has {}",
            comm.rank(),
            topo.local_ranks(r).len()
        )));
    }
    Ok(g)
}

impl Hierarchy {
    /// Builds the groups. Every node must hold the same number of ranks (the sharded
    /// cross-node step pairs shard l of every node).
    pub fn new(comm: &Communicator) -> Result<Self> {
        same_ranks_per_node(comm, "hierarchical allreduce")?;
        let node = comm.split_node_local()?;
        let cross = comm.split_cross_node()?;
        Ok(Hierarchy { node, cross, world: comm.size(), scratch: Default::default() })
    }

    /// Nodes in the job.
    pub fn nodes(&self) -> usize {
        self.cross.size()
    }

    /// Allreduce of `buf` across all ranks of the parent communicator.
    pub fn allreduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, algo: HierarchicalAlgo) -> Result<()> {
        // SAFETY: a float slice viewed as its bytes, exclusively borrowed for the call.
        let bytes = unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr() as *mut u8, std::mem::size_of_val(buf)) };
        self.allreduce_bytes(T::DTYPE, bytes, op, algo)
    }

    /// [`Hierarchy::allreduce`] on raw bytes of `dtype` elements.
    pub fn allreduce_bytes(&self, dtype: DType, buf: &mut [u8], op: ReduceOp, algo: HierarchicalAlgo) -> Result<()> {
        op.check(dtype)?;
        let es = dtype.size();
        if buf.len() % es != 0 {
            return Err(invalid(format!("hierarchical allreduce: {} bytes is not a whole number of {}", buf.len(), dtype.name())));
        }
        let n = buf.len() / es;
        // Avg is a sum divided once by the world size at the end, so the node and
        // cross-node steps cannot round it twice.
        let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        let p = buf.as_mut_ptr();
        match algo {
            HierarchicalAlgo::Leader => {
                let at_root = |op| Request { root: 0, ..Request::new(op, dtype, inner, n) };
                // SAFETY: `buf` is exclusively borrowed and each run() completes before the next.
                unsafe {
                    self.node.run(at_root(Collective::Reduce), p, p)?;
                    if self.node.rank() == 0 {
                        self.cross.run(Request::new(Collective::Allreduce, dtype, inner, n), p, p)?;
                    }
                    self.node.run(at_root(Collective::Broadcast), p, p)?;
                }
            }
            HierarchicalAlgo::Sharded => {
                let g = self.node.size();
                let shard = n.div_ceil(g);
                // Reduce-scatter needs g equal parts: the tail is padded; padded elements
                // are combined like the others and never copied back. u64 storage keeps
                // every dtype aligned.
                let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
                let (padded, mine) = &mut *scratch;
                for (v, bytes) in [(&mut *padded, shard * g * es), (&mut *mine, shard * es)] {
                    if v.len() * 8 < bytes {
                        v.resize(bytes.div_ceil(8), 0);
                    }
                }
                let (pp, mp) = (padded.as_mut_ptr() as *mut u8, mine.as_mut_ptr() as *mut u8);
                // SAFETY: both vectors hold at least the bytes each request reads or writes,
                // and each run() completes before the next.
                unsafe {
                    std::ptr::copy_nonoverlapping(p, pp, buf.len());
                    self.node.run(Request::new(Collective::ReduceScatter, dtype, inner, shard), pp, mp)?;
                    self.cross.run(Request::new(Collective::Allreduce, dtype, inner, shard), mp, mp)?;
                    self.node.run(Request::new(Collective::Allgather, dtype, inner, shard), mp, pp)?;
                    std::ptr::copy_nonoverlapping(pp, p, buf.len());
                }
            }
        }
        finish(dtype, op, buf, self.world);
        Ok(())
    }

    /// Hierarchical allreduce on the raw buffers of `call` (for the C ABI).
    ///
    /// # Safety
    /// `call.send` must be readable and `call.recv` writable for `call.count` elements of
    /// `call.dtype`, valid and touched by no one else during the call; they are equal (in
    /// place) or do not overlap.
    pub unsafe fn allreduce_raw(&self, call: RawAllreduce) -> Result<()> {
        let RawAllreduce { dtype, op, algo, send, recv, count } = call;
        let bytes =
            count.checked_mul(dtype.size()).filter(|b| *b <= isize::MAX as usize).ok_or_else(|| invalid(format!("count {count} overflows a buffer")))?;
        if bytes == 0 {
            return Ok(());
        }
        if !std::ptr::eq(send, recv) {
            // SAFETY: both valid for `bytes` and disjoint (the contract).
            unsafe { std::ptr::copy_nonoverlapping(send, recv, bytes) };
        }
        // SAFETY: writable for `bytes`, exclusively ours during the call (the contract).
        self.allreduce_bytes(dtype, unsafe { std::slice::from_raw_parts_mut(recv, bytes) }, op, algo)
    }

    /// [`Hierarchy::allreduce_raw`] as a job of `parent`'s progress thread (the
    /// communicator this hierarchy was made from), so that it is ordered with `parent`'s
    /// other calls on every rank alike; its node and cross-node steps run on their own
    /// groups.
    ///
    /// # Safety
    /// As for [`Hierarchy::allreduce_raw`], until the job has run.
    unsafe fn job(self: &std::sync::Arc<Self>, parent: &Communicator, call: RawAllreduce) -> Result<crate::engine::Job> {
        if parent.size() != self.world {
            return Err(invalid(format!("hierarchical allreduce: called on a communicator of {} ranks, made for {}", parent.size(), self.world)));
        }
        crate::collective::Request::new(crate::collective::Collective::Allreduce, call.dtype, call.op, call.count).check(
            parent.rank(),
            parent.size(),
            call.send,
            call.recv,
        )?;
        let me = self.clone();
        Ok(Box::new(move |state, deadline| {
            let call = call;
            call.agree(state, deadline)?;
            // SAFETY: the contract of `job`, which holds until this job has run.
            unsafe { me.allreduce_raw(call) }
        }))
    }

    /// Runs [`Hierarchy::allreduce_raw`] in order with `parent`'s other calls (after its
    /// queued non-blocking ones; on this thread when none is queued).
    ///
    /// # Safety
    /// As for [`Hierarchy::allreduce_raw`].
    pub unsafe fn run_raw(self: &std::sync::Arc<Self>, parent: &Communicator, call: RawAllreduce) -> Result<()> {
        // SAFETY: forwarded contract; the job has run when run_blocking returns.
        let job = unsafe { self.job(parent, call)? };
        parent.run_blocking(|| call.describe(), job)
    }

    /// Starts [`Hierarchy::allreduce_raw`] in order with `parent`'s other calls and returns
    /// at once.
    ///
    /// # Safety
    /// As for [`Hierarchy::allreduce_raw`], until the returned work has completed.
    pub unsafe fn start_raw(self: &std::sync::Arc<Self>, parent: &Communicator, call: RawAllreduce) -> Result<crate::engine::Work> {
        // SAFETY: forwarded contract, until the work completes.
        let job = unsafe { self.job(parent, call)? };
        Ok(parent.submit(call.describe(), job))
    }

    /// Starts a cross-node allreduce of `buf` among the ranks with this local index and
    /// returns at once: it progresses on the cross-node group's own engine while this
    /// thread runs node-local work (DASO's delayed global parameter sync).
    pub fn start_cross<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Result<crate::collective::Pending<Vec<T>>> {
        self.cross.iallreduce(buf, op)
    }
}
