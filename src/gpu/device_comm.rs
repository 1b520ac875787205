//! The GPU communicator: collectives on CUDA device buffers, enqueued on the caller's
//! stream as NCCL's calls are. Inside one node it is NCCL alone. Across nodes the
//! allreduce is hierarchical: NCCL reduce-scatter inside the node, the 1/G shard
//! device-to-host into a pinned region, gradwire's allreduce across the nodes,
//! host-to-device, NCCL allgather; no other copy. Broadcast, reduce-scatter and allgather
//! across nodes go through the pinned region and gradwire's collective over every rank.
//!
//! A call returns once its work is enqueued; where a host step is needed it first waits
//! (with the communicator's deadline) for the stream to reach the data, so work the
//! caller queued earlier on that stream is ordered before it, and later work after it.

use super::memory::{driver_err, expect_device, Event, PinnedStaging};
use super::nccl::NcclGroup;
use crate::collective::{Collective, Request};
use crate::comm::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::{invalid, Error, Result};
use cudarc::driver::sys::{self as cu, CUresult, CUstream};
use cudarc::driver::CudaContext;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a rank keeps for its GPU collectives; one call at a time.
struct State {
    nccl: NcclGroup,
    /// The ranks of every node with this rank's local index.
    cross: Communicator,
    staging: Option<PinnedStaging>,
    /// Recorded after the last copy out of the staging region: it must have run before
    /// the region is written again (the next call may use another stream).
    staging_free: Event,
    /// Marks the point a host step waits for.
    reached: Event,
    /// One per chunk of a pipelined cross-node step: that chunk has reached the host.
    chunks: Vec<Event>,
    /// Set when a deadline passed and NCCL was aborted: every later call fails with it.
    broken: Option<String>,
}

/// Collectives on CUDA device memory over the ranks of a communicator (each rank one
/// device; several ranks of a node on distinct devices).
pub struct DeviceComm {
    ctx: Arc<CudaContext>,
    device: usize,
    rank: usize,
    world: usize,
    nodes: usize,
    /// Another rank of the job, named when a stream wait times out.
    peer: usize,
    timeout: Duration,
    state: Mutex<State>,
}

/// A host step's copy direction.
enum Copy {
    ToHost,
    ToDevice,
}

/// The point a host step waits for.
#[derive(Clone, Copy)]
enum Mark {
    Reached,
    StagingFree,
    Chunk(usize),
}

/// The cross-node step goes in chunks of this many bytes: while the host reduces one
/// across the nodes, the next is on its way to the host and the last on its way back (and
/// each host allreduce works on a cache-sized piece).
const PIPELINE_BYTES: usize = 4 << 20;

impl DeviceComm {
    /// Makes the NCCL communicator of this rank's node on CUDA device `device`, and the
    /// cross-node group (collective: every rank of `comm` calls it). Every node must hold
    /// the same number of ranks.
    pub fn new(comm: &Communicator, device: usize) -> Result<Self> {
        if let Some(why) = super::unavailable() {
            return Err(Error::Unsupported(why));
        }
        let g = crate::collective::hierarchical::same_ranks_per_node(comm, "GPU collectives")?;
        let devices = CudaContext::device_count().map_err(|e| Error::Unsupported(format!("cuDeviceGetCount: {e:?}")))?.max(0) as usize;
        if device >= devices {
            return Err(invalid(format!("CUDA device {device} does not exist: this process sees {devices} device(s) (CUDA_VISIBLE_DEVICES?)")));
        }
        let ctx = CudaContext::new(device).map_err(|e| Error::Unsupported(format!("CUDA device {device}: {e:?}")))?;
        bind(&ctx)?;
        let node = comm.split_node_local()?;
        let nccl = NcclGroup::new(&node)?;
        let cross = comm.split_cross_node()?;
        let peer = (0..comm.size()).find(|&r| r != comm.rank()).unwrap_or(comm.rank());
        let state = State { nccl, cross, staging: None, staging_free: Event::new()?, reached: Event::new()?, chunks: Vec::new(), broken: None };
        Ok(DeviceComm {
            ctx,
            device,
            rank: comm.rank(),
            world: comm.size(),
            nodes: comm.size() / g,
            peer,
            timeout: comm.config().timeout,
            state: Mutex::new(state),
        })
    }

    /// The CUDA device this rank's buffers live on.
    pub fn device(&self) -> usize {
        self.device
    }

    /// The CUDA context of that device (the device's primary context, the one PyTorch and
    /// the runtime API use).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Nodes in the job (1: NCCL alone).
    pub fn nodes(&self) -> usize {
        self.nodes
    }

    /// Ranks of this rank's node, the NCCL communicator's size.
    pub fn local_size(&self) -> usize {
        self.world / self.nodes
    }

    /// Takes the state for one call, with the device current, after checking that `world`
    /// is the communicator this one was made from.
    fn enter(&self, world: &Communicator, w: &str) -> Result<std::sync::MutexGuard<'_, State>> {
        if world.rank() != self.rank || world.size() != self.world {
            return Err(invalid(format!(
                "{w}: called with rank {} of {} but the GPU communicator was made by rank {} of {}",
                world.rank(),
                world.size(),
                self.rank,
                self.world
            )));
        }
        let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(why) = &st.broken {
            return Err(Error::Unsupported(format!("{w}: this GPU communicator stopped after an earlier failure: {why}")));
        }
        bind(&self.ctx)?;
        Ok(st)
    }

    fn check_device(&self, ptrs: &[(u64, &str)], bytes: usize, w: &str) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        for (i, &(p, name)) in ptrs.iter().enumerate() {
            if p == 0 {
                return Err(invalid(format!("{w}: {name} is NULL")));
            }
            // In place: the same pointer needs no second question to the driver.
            if ptrs[..i].iter().all(|&(q, _)| q != p) {
                expect_device(p as *const u8, self.device, w, name)?;
            }
        }
        Ok(())
    }

    /// Allreduce of `count` elements from `send` into `recv` (the same pointer: in place)
    /// over every rank of `world`.
    ///
    /// # Safety
    /// `send` and `recv` are device allocations valid for `count` elements of `dtype`
    /// until the stream has run the call; `stream` is a stream of this device (NULL: the
    /// legacy default stream); `world` is the communicator this one was made from.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn allreduce(&self, world: &Communicator, send: u64, recv: u64, count: usize, dtype: DType, op: ReduceOp, stream: CUstream) -> Result<()> {
        let w = "gradwire_gpu_allreduce";
        op.check(dtype).map_err(|e| prefixed(e, w))?;
        self.check_device(&[(send, "sendbuf"), (recv, "recvbuf")], count * dtype.size(), w)?;
        let mut st = self.enter(world, w)?;
        if count == 0 {
            return Ok(());
        }
        let es = dtype.size() as u64;
        let g = st.nccl.size();
        if self.nodes == 1 {
            // SAFETY: the caller's contract: both buffers hold `count` elements on this device.
            return unsafe { st.nccl.all_reduce(send, recv, count, dtype, op, stream) };
        }
        let i = st.nccl.rank();
        if count % g == 0 {
            // Reduce-scatter into this rank's own part of `recv`: with send == recv that is
            // NCCL's in-place form, and the allgather from it is too.
            let shard = count / g;
            let mine = recv + i as u64 * shard as u64 * es;
            // SAFETY: `mine`, this rank's shard, lies inside `recv`; the caller's contract covers both.
            unsafe { st.nccl.reduce_scatter(send, mine, shard, dtype, op, stream) }?;
            // SAFETY: the shard lies inside `recv`.
            unsafe { self.across(&mut st, mine, shard, dtype, op, stream, w) }?;
            // SAFETY: `mine` inside `recv` (NCCL's in-place allgather).
            unsafe { st.nccl.all_gather(mine, recv, shard, dtype, stream) }
        } else {
            // Uneven: the node's allreduce, each rank carries its part across, then every
            // part is broadcast from its owner inside the node.
            // SAFETY: the caller's contract: both buffers hold `count` elements on this device.
            unsafe { st.nccl.all_reduce(send, recv, count, dtype, op, stream) }?;
            let part = |j: usize| (count * j / g, count * (j + 1) / g);
            let (lo, hi) = part(i);
            // SAFETY: part i lies inside `recv`.
            unsafe { self.across(&mut st, recv + lo as u64 * es, hi - lo, dtype, op, stream, w) }?;
            let nccl = &st.nccl;
            nccl.grouped(|| {
                (0..g).try_for_each(|j| {
                    let (lo, hi) = part(j);
                    let at = recv + lo as u64 * es;
                    // SAFETY: part j lies inside `recv`.
                    unsafe { nccl.broadcast(at, at, hi - lo, dtype, j, stream) }
                })
            })
        }
    }

    /// The cross-node step of the allreduce: `n` elements at `at` to the host, allreduced
    /// over the cross-node group, and back, pipelined in chunks of [`PIPELINE_BYTES`]
    /// (every rank of the group cuts the same `n` the same way).
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for `n` elements at `at`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn across(&self, st: &mut State, at: u64, n: usize, dtype: DType, op: ReduceOp, stream: CUstream, w: &str) -> Result<()> {
        let es = dtype.size();
        let per = (PIPELINE_BYTES / es).max(1);
        let parts: Vec<(usize, usize)> = (0..n).step_by(per).map(|lo| (lo, (lo + per).min(n))).collect();
        let host = self.staging(st, n * es, w)?;
        while st.chunks.len() < parts.len() {
            st.chunks.push(Event::new()?);
        }
        // Every chunk's copy to the host queued at once: they run back to back on the
        // stream while the host works through the chunks that have arrived.
        for (k, &(lo, hi)) in parts.iter().enumerate() {
            // SAFETY: chunk k of the staging region (n elements long) and of the caller's
            // buffer; the region is not touched again until the chunk's event has passed.
            unsafe { self.copy(Copy::ToHost, at + (lo * es) as u64, host.add(lo * es), (hi - lo) * es, stream) }?;
            st.chunks[k].record(stream)?;
        }
        for (k, &(lo, hi)) in parts.iter().enumerate() {
            self.wait(st, Mark::Chunk(k), &format!("{w}: the device-to-host copy"))?;
            // SAFETY: inside the staging region, n elements long.
            let part = unsafe { host.add(lo * es) };
            // SAFETY: chunk k has arrived in the staging region (its event passed); nothing
            // else uses that part until its copy back is queued below.
            unsafe { st.cross.run(Request::new(Collective::Allreduce, dtype, op, hi - lo), part, part) }.map_err(|e| prefixed(e, w))?;
            // SAFETY: as above; the copy back runs after every copy to the host (one stream).
            unsafe { self.copy(Copy::ToDevice, at + (lo * es) as u64, part, (hi - lo) * es, stream) }?;
        }
        st.staging_free.record(stream)
    }

    /// Broadcast of `count` elements in `buf` from world rank `root`.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for `buf`.
    pub unsafe fn broadcast(&self, world: &Communicator, buf: u64, count: usize, dtype: DType, root: usize, stream: CUstream) -> Result<()> {
        let w = "gradwire_gpu_broadcast";
        if root >= self.world {
            return Err(invalid(format!("{w}: root {root} is not a rank (the communicator has {} ranks)", self.world)));
        }
        self.check_device(&[(buf, "buf")], count * dtype.size(), w)?;
        let mut st = self.enter(world, w)?;
        if count == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract; one node, so NCCL's ranks are the world's.
            return unsafe { st.nccl.broadcast(buf, buf, count, dtype, root, stream) };
        }
        let bytes = count * dtype.size();
        let host = if self.rank == root {
            // SAFETY: `buf` holds `bytes` (the caller's contract).
            unsafe { self.to_host(&mut st, buf, bytes, 0, stream, w) }?
        } else {
            self.staging(&mut st, bytes, w)?
        };
        // SAFETY: the staging region holds `bytes`; the root's copy has arrived in it.
        unsafe { world.run(Request { root, ..Request::new(Collective::Broadcast, dtype, ReduceOp::Sum, count) }, host, host) }.map_err(|e| prefixed(e, w))?;
        if self.rank != root {
            // SAFETY: `buf` holds `bytes` (the caller's contract); so does the staging region.
            unsafe { self.copy(Copy::ToDevice, buf, host, bytes, stream) }?;
        }
        st.staging_free.record(stream)
    }

    /// Reduce-scatter: `send` holds size × `recvcount` elements; `recv` gets this rank's
    /// reduced block.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for the sizes named; the buffers do not overlap.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce_scatter(
        &self,
        world: &Communicator,
        send: u64,
        recv: u64,
        recvcount: usize,
        dtype: DType,
        op: ReduceOp,
        stream: CUstream,
    ) -> Result<()> {
        let w = "gradwire_gpu_reduce_scatter";
        op.check(dtype).map_err(|e| prefixed(e, w))?;
        self.check_device(&[(send, "sendbuf"), (recv, "recvbuf")], recvcount * dtype.size(), w)?;
        let mut st = self.enter(world, w)?;
        if recvcount == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract.
            return unsafe { st.nccl.reduce_scatter(send, recv, recvcount, dtype, op, stream) };
        }
        let part = recvcount * dtype.size();
        // The input after room for the result.
        // SAFETY: `send` holds size × `part` bytes (the caller's contract).
        let input = unsafe { self.to_host(&mut st, send, part * self.world, part, stream, w) }?;
        // SAFETY: `to_host` put the input `part` bytes into the region; the two areas do
        // not overlap.
        let out = unsafe { input.sub(part) };
        // SAFETY: inside the staging region, which holds `part` bytes before the input.
        unsafe { world.run(Request::new(Collective::ReduceScatter, dtype, op, recvcount), input, out) }.map_err(|e| prefixed(e, w))?;
        // SAFETY: `recv` holds `part` bytes (the caller's contract); so does `out`.
        unsafe { self.copy(Copy::ToDevice, recv, out, part, stream) }?;
        st.staging_free.record(stream)
    }

    /// Allgather: `recv` holds size × `sendcount` elements, rank r's block at r.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for the sizes named; the buffers do not overlap.
    pub unsafe fn allgather(&self, world: &Communicator, send: u64, recv: u64, sendcount: usize, dtype: DType, stream: CUstream) -> Result<()> {
        let w = "gradwire_gpu_allgather";
        self.check_device(&[(send, "sendbuf"), (recv, "recvbuf")], sendcount * dtype.size(), w)?;
        let mut st = self.enter(world, w)?;
        if sendcount == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract.
            return unsafe { st.nccl.all_gather(send, recv, sendcount, dtype, stream) };
        }
        let part = sendcount * dtype.size();
        // This rank's block after room for the whole result.
        // SAFETY: `send` holds `part` bytes (the caller's contract).
        let host = unsafe { self.to_host(&mut st, send, part, part * self.world, stream, w) }?;
        // SAFETY: inside the staging region, which holds the result area before the block.
        let out = unsafe { host.sub(part * self.world) };
        // SAFETY: the region holds the result area then the block; they do not overlap.
        unsafe { world.run(Request::new(Collective::Allgather, dtype, ReduceOp::Sum, sendcount), host, out) }.map_err(|e| prefixed(e, w))?;
        // SAFETY: `recv` holds size × `part` bytes (the caller's contract); so does `out`.
        unsafe { self.copy(Copy::ToDevice, recv, out, part * self.world, stream) }?;
        st.staging_free.record(stream)
    }

    /// The staging region, at least `bytes` long, once the copies out of it queued by
    /// earlier calls have run.
    fn staging(&self, st: &mut State, bytes: usize, w: &str) -> Result<*mut u8> {
        self.wait(st, Mark::StagingFree, &format!("{w}: an earlier call's copy out of the staging region"))?;
        if st.staging.as_ref().is_none_or(|s| s.len() < bytes) {
            st.staging = None; // unregister the smaller one first
            st.staging = Some(PinnedStaging::new(&self.ctx, bytes.next_power_of_two())?);
        }
        st.staging.as_ref().map(|s| s.as_ptr()).ok_or_else(|| invalid("no staging region"))
    }

    /// Copies `bytes` at `at` into the staging region at offset `offset` (once the stream
    /// has reached them) and returns the start of the copy on the host.
    ///
    /// # Safety
    /// `at` is device memory of this device valid for `bytes`.
    unsafe fn to_host(&self, st: &mut State, at: u64, bytes: usize, offset: usize, stream: CUstream, w: &str) -> Result<*mut u8> {
        let base = self.staging(st, offset + bytes, w)?;
        // SAFETY: the region holds offset + bytes; `at` is the caller's device buffer.
        let host = unsafe { base.add(offset) };
        // SAFETY: `at` holds `bytes` (the caller's contract), `host` the region's part.
        unsafe { self.copy(Copy::ToHost, at, host, bytes, stream) }?;
        st.reached.record(stream)?;
        self.wait(st, Mark::Reached, &format!("{w}: the device-to-host copy"))?;
        Ok(host)
    }

    /// Enqueues one copy between `dev` and the pinned `host` on `stream`.
    ///
    /// # Safety
    /// Both ranges are valid for `bytes` until the stream has run the copy.
    unsafe fn copy(&self, dir: Copy, dev: u64, host: *mut u8, bytes: usize, stream: CUstream) -> Result<()> {
        let (r, what) = match dir {
            // SAFETY: the caller's contract.
            Copy::ToHost => (unsafe { cu::cuMemcpyDtoHAsync_v2(host as *mut _, dev, bytes, stream) }, "cuMemcpyDtoHAsync"),
            // SAFETY: the caller's contract.
            Copy::ToDevice => (unsafe { cu::cuMemcpyHtoDAsync_v2(dev, host as *const _, bytes, stream) }, "cuMemcpyHtoDAsync"),
        };
        if r == CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(driver_err(what, r))
        }
    }

    /// Waits for `mark` with the deadline; past it NCCL is aborted (its kernels may wait
    /// for a dead peer forever) and this communicator stops.
    fn wait(&self, st: &mut State, mark: Mark, what: &str) -> Result<()> {
        let ev = match mark {
            Mark::Reached => &st.reached,
            Mark::StagingFree => &st.staging_free,
            Mark::Chunk(k) => &st.chunks[k],
        };
        let r = ev.wait(self.timeout, self.rank, self.peer, what);
        if let Err(e) = &r {
            st.broken = Some(e.to_string());
            st.nccl.abort();
        }
        r
    }
}

fn bind(ctx: &Arc<CudaContext>) -> Result<()> {
    ctx.bind_to_thread().map_err(|e| Error::Unsupported(format!("cuCtxSetCurrent: {e:?}")))
}

fn prefixed(e: Error, w: &str) -> Error {
    match e {
        Error::InvalidArgument(m) if !m.starts_with(w) => invalid(format!("{w}: {m}")),
        e => e,
    }
}
