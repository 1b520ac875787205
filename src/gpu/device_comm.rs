//! The GPU communicator: collectives on CUDA device buffers, enqueued on the caller's
//! stream as NCCL's calls are. Inside one node it is NCCL alone. Across nodes the
//! allreduce is hierarchical: NCCL reduce-scatter inside the node, the 1/G shard
//! device-to-host into a pinned region, gradwire's allreduce across the nodes,
//! host-to-device, NCCL allgather; no other copy. Broadcast, reduce, reduce-scatter,
//! allgather and all-to-all across nodes go through the pinned region and gradwire's
//! collective over every rank.
//! The pinned region is bounded: the cross-node steps go through it in chunks.
//!
//! A call returns once its work is enqueued; where a host step is needed it first waits
//! (with the communicator's deadline) for the stream to reach the data, so work the
//! caller queued earlier on that stream is ordered before it, and later work after it.
//! A call that fails after it has queued work stops the communicator: NCCL is aborted
//! (its node peers' kernels end instead of waiting for this rank) and every later call
//! fails with the first failure.

use super::memory::{cuda_err, driver_err, expect_device, Current, Event, PinnedStaging};
use super::nccl::NcclGroup;
use crate::collective::exchange::Counts;
use crate::collective::layout::{layout, Span};
use crate::collective::{Collective, Request};
use crate::comm::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::{invalid, Error, Result};
use cudarc::driver::sys::{self as cu, CUresult, CUstream};
use cudarc::driver::CudaContext;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// What a rank keeps for its GPU collectives; one call at a time.
struct State {
    nccl: NcclGroup,
    /// The ranks of every node with this rank's local index.
    cross: Communicator,
    staging: Option<PinnedStaging>,
    /// Recorded after the last copy out of the staging region: it must have run before
    /// the region is written again (the next call may use another stream), and before
    /// the region is freed.
    staging_free: Event,
    /// Marks the point a host step waits for.
    reached: Event,
    /// One per slot of the pipelined cross-node step: that slot's chunk is on the host.
    slots: Vec<Event>,
    /// The first failure after work was queued: every later call fails with it.
    broken: Option<String>,
}

/// Collectives on CUDA device memory over the ranks of a communicator (each rank one
/// device; several ranks of a node on distinct devices).
pub struct DeviceComm {
    // Dropped first (fields drop in order): its NCCL communicator, events and pinned
    // region go while the context still lives.
    state: Mutex<State>,
    ctx: Arc<CudaContext>,
    device: usize,
    rank: usize,
    world: usize,
    nodes: usize,
    /// Another rank of the job, named when a stream wait times out.
    peer: usize,
    timeout: Duration,
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
    Slot(usize),
}

/// The cross-node steps go in chunks of this many bytes: while the host reduces one across
/// the nodes, the next is on its way to the host and the last on its way back (and each
/// host collective works on a cache-sized piece).
const PIPELINE_BYTES: usize = 4 << 20;
/// Chunks of the allreduce's cross-node step in flight at once: the pinned region holds
/// this many (16 MiB), whatever the buffer's size.
const SLOTS: usize = 4;
/// Room the other cross-node steps take in the pinned region at most, whatever the buffer's
/// size and the number of ranks (a piece of every rank's block may share it).
const STAGING_BYTES: usize = SLOTS * PIPELINE_BYTES;

/// Elements of each block in one piece of a cross-node step whose room holds `per_piece`
/// blocks' pieces: at most [`PIPELINE_BYTES`] of a block and [`STAGING_BYTES`] in all (so a
/// job of many ranks cuts smaller pieces instead of pinning more), at least one element,
/// at most `count`.
fn piece_len(count: usize, per_piece: usize, elem: usize) -> usize {
    (PIPELINE_BYTES / elem).min(STAGING_BYTES / (elem * per_piece.max(1))).max(1).min(count)
}

/// NCCL runs one rank per GPU: two ranks of a node on one device would fail inside
/// `ncclCommInitRank` with NCCL's bare "invalid usage". So the ranks of a node first show
/// each other the device they chose (its UUID: device indexes differ under
/// `CUDA_VISIBLE_DEVICES`), and every rank of the node refuses alike, naming the pair.
fn refuse_shared_device(comm: &Communicator, node: &Communicator, ctx: &CudaContext, device: usize) -> Result<()> {
    if node.size() == 1 {
        return Ok(());
    }
    // [UUID: 16][device index: 8][1 if this rank could read its UUID]
    const ENTRY: usize = 16 + 8 + 1;
    let uuid = ctx.uuid().map_err(|e| cuda_err(&format!("cuDeviceGetUuid of CUDA device {device}"), e));
    let mut mine = [0u8; ENTRY];
    if let Ok(u) = &uuid {
        for (b, &c) in mine.iter_mut().zip(&u.bytes) {
            *b = c as u8;
        }
        mine[24] = 1;
    }
    mine[16..24].copy_from_slice(&(device as u64).to_le_bytes());
    // Shown even when this rank failed, so that no rank of the node goes on into
    // ncclCommInitRank (which would wait for it without a deadline).
    let mut all = vec![0u8; ENTRY * node.size()];
    node.allgather(&mine, &mut all)?;
    uuid?;
    let entries: Vec<&[u8]> = all.chunks(ENTRY).collect();
    // The node group's ranks are the node's world ranks in order (split keyed by rank).
    let world_ranks = comm.topology().local_ranks(comm.rank());
    if let Some(i) = entries.iter().position(|e| e[24] == 0) {
        return Err(Error::Unsupported(format!(
            "GPU collectives: rank {} of this node could not read its GPU's UUID (it says why)",
            world_ranks.get(i).copied().unwrap_or(i)
        )));
    }
    for (i, a) in entries.iter().enumerate() {
        if let Some(j) = (i + 1..entries.len()).find(|&j| entries[j][..16] == a[..16]) {
            let index = |e: &[u8]| u64::from_le_bytes(e[16..24].try_into().expect("8 bytes"));
            let uuid: String = a[..16].iter().map(|b| format!("{b:02x}")).collect();
            return Err(Error::Unsupported(format!(
                "GPU collectives: ranks {} and {} of one node both chose the same GPU ({}, UUID {uuid}); \
                 NCCL needs a GPU of its own for each rank of a node. Give each rank its own device (the rank's index in \
                 its node, as `gradwire launch` and torchrun do, with at least {} GPUs visible), or, to test on one GPU, \
                 run each rank as a node of its own (GRADWIRE_HOST_ID=node$RANK)",
                world_ranks.get(i).copied().unwrap_or(i),
                world_ranks.get(j).copied().unwrap_or(j),
                match (index(a), index(entries[j])) {
                    (x, y) if x == y => format!("CUDA device {x} in both"),
                    (x, y) => format!("CUDA devices {x} and {y}"),
                },
                node.size()
            )));
        }
    }
    Ok(())
}

/// One call's hold on the communicator: its state, with the device's context current on
/// this thread until the call ends.
struct Call<'a> {
    st: MutexGuard<'a, State>,
    _current: Current,
}

impl std::ops::Deref for Call<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.st
    }
}

impl std::ops::DerefMut for Call<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.st
    }
}

impl DeviceComm {
    /// Makes the NCCL communicator of this rank's node on CUDA device `device`, and the
    /// cross-node group (collective: every rank of `comm` calls it). Every node must hold
    /// the same number of ranks.
    pub fn new(comm: &Communicator, device: usize) -> Result<Self> {
        if let Some(why) = super::unavailable() {
            return Err(Error::Unsupported(why));
        }
        let g = crate::collective::hierarchical::same_ranks_per_node(comm, "GPU collectives")?;
        let devices = CudaContext::device_count().map_err(|e| cuda_err("cuDeviceGetCount", e))?.max(0) as usize;
        if device >= devices {
            return Err(invalid(format!("CUDA device {device} does not exist: this process sees {devices} device(s) (CUDA_VISIBLE_DEVICES?)")));
        }
        let ctx = CudaContext::new(device).map_err(|e| cuda_err(&format!("CUDA device {device}"), e))?;
        let current = Current::make(&ctx)?;
        let node = comm.split_node_local()?;
        refuse_shared_device(comm, &node, &ctx, device)?;
        let nccl = NcclGroup::new(&node)?;
        let cross = comm.split_cross_node()?;
        let state = State { nccl, cross, staging: None, staging_free: Event::new()?, reached: Event::new()?, slots: Vec::new(), broken: None };
        drop(current);
        let peer = (0..comm.size()).find(|&r| r != comm.rank()).unwrap_or(comm.rank());
        Ok(DeviceComm {
            state: Mutex::new(state),
            ctx,
            device,
            rank: comm.rank(),
            world: comm.size(),
            nodes: comm.size() / g,
            peer,
            timeout: comm.config().timeout,
        })
    }

    /// [`DeviceComm::new`] on the device of this rank's index in its node, modulo the
    /// devices this process sees (what `gradwire launch` and torchrun give each rank).
    pub fn on_local_device(comm: &Communicator) -> Result<Self> {
        // Before counting devices: cudarc panics where it finds no driver to ask.
        if let Some(why) = super::unavailable() {
            return Err(Error::Unsupported(why));
        }
        let index = comm.topology().local_ranks(comm.rank()).iter().position(|&r| r == comm.rank()).unwrap_or(0);
        let devices = CudaContext::device_count().unwrap_or(1).max(1) as usize;
        Self::new(comm, index % devices)
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

    /// The call's one check, as every entry point makes it ([`Request::check`]: root, op
    /// against dtype, sizes, buffers present and laid out as the overlap rule allows), on
    /// device addresses; returns the send and receive bytes.
    fn checked(&self, req: Request, send: u64, recv: u64, w: &str) -> Result<(usize, usize)> {
        req.check(self.rank, self.world, send as *const u8, recv as *const u8).map(|(s, r, _)| (s, r)).map_err(|e| prefixed(e, w))
    }

    /// An error when a call's buffers (device address, bytes) lie as no call of `op` takes
    /// them (the rule of every entry point, [`layout`]).
    fn laid_out(&self, op: Collective, send: (u64, usize), recv: (u64, usize), w: &str) -> Result<()> {
        let span = |(at, len): (u64, usize)| Span { at: at as usize, len };
        layout(op, self.rank, span(send), span(recv)).map(drop).map_err(|e| prefixed(e, w))
    }

    /// Begins a call, after checking that `world` is the communicator this one was made
    /// from and that each buffer (pointer, name, bytes) is memory of this device that
    /// holds its bytes.
    fn enter(&self, world: &Communicator, buffers: &[(u64, &str, usize)], w: &str) -> Result<Call<'_>> {
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
            return Err(Error::Aborted {
                rank: self.rank,
                peer: self.rank,
                reason: format!("{w}: this GPU communicator stopped after an earlier failure: {why}"),
            });
        }
        let call = Call { st, _current: Current::make(&self.ctx)? };
        for (i, &(p, name, bytes)) in buffers.iter().enumerate() {
            // In place: the same pointer needs no second question to the driver.
            if bytes > 0 && buffers[..i].iter().all(|&(q, _, b)| q != p || b < bytes) {
                expect_device(p as *const u8, bytes, self.device, w, name)?;
            }
        }
        Ok(call)
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
        let (bytes, _) = self.checked(Request::new(Collective::Allreduce, dtype, op, count), send, recv, w)?;
        let mut st = self.enter(world, &[(send, "sendbuf", bytes), (recv, "recvbuf", bytes)], w)?;
        if count == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract: both buffers hold `count` elements on this device.
            return unsafe { st.nccl.all_reduce(send, recv, count, dtype, op, stream) };
        }
        let es = dtype.size() as u64;
        let g = st.nccl.size();
        let i = st.nccl.rank();
        let body = |st: &mut State| -> Result<()> {
            if count % g == 0 {
                // Reduce-scatter into this rank's own part of `recv`: with send == recv that
                // is NCCL's in-place form, and the allgather from it is too.
                let shard = count / g;
                let mine = recv + i as u64 * shard as u64 * es;
                // SAFETY: `mine`, this rank's shard, lies inside `recv`; the caller's contract covers both.
                unsafe { st.nccl.reduce_scatter(send, mine, shard, dtype, op, stream) }?;
                // SAFETY: the shard lies inside `recv`.
                unsafe { self.across(st, mine, shard, dtype, op, stream, w) }?;
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
                unsafe { self.across(st, recv + lo as u64 * es, hi - lo, dtype, op, stream, w) }?;
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
        };
        let r = body(&mut st);
        self.settle(&mut st, r, stream)
    }

    /// The cross-node step of the allreduce: `n` elements at `at` to the host, allreduced
    /// over the cross-node group, and back, pipelined in chunks of [`PIPELINE_BYTES`]
    /// through [`SLOTS`] slots of the pinned region (every rank of the group cuts the same
    /// `n` the same way).
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for `n` elements at `at`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn across(&self, st: &mut State, at: u64, n: usize, dtype: DType, op: ReduceOp, stream: CUstream, w: &str) -> Result<()> {
        let es = dtype.size();
        let per = (PIPELINE_BYTES / es).max(1);
        let parts: Vec<(usize, usize)> = (0..n).step_by(per).map(|lo| (lo, (lo + per).min(n))).collect();
        let slots = parts.len().min(SLOTS);
        let host = self.staging(st, slots * per * es, w)?;
        while st.slots.len() < slots {
            st.slots.push(Event::new()?);
        }
        let slot = |k: usize| -> *mut u8 {
            // SAFETY: slot k % slots lies inside the staging region (slots × per elements).
            unsafe { host.add(k % slots * per * es) }
        };
        // Queues chunk k's copy to the host, into its slot. A slot is written again only
        // after the copy back of its last chunk, which is queued before on the one stream.
        let fetch = |st: &State, k: usize| -> Result<()> {
            let (lo, hi) = parts[k];
            // SAFETY: chunk k of the caller's buffer and its slot, (hi - lo) elements each.
            unsafe { self.copy(Copy::ToHost, at + (lo * es) as u64, slot(k), (hi - lo) * es, stream) }?;
            st.slots[k % slots].record(stream)
        };
        for k in 0..slots {
            fetch(st, k)?;
        }
        for (k, &(lo, hi)) in parts.iter().enumerate() {
            self.wait(st, Mark::Slot(k % slots), &format!("{w}: the device-to-host copy"))?;
            // SAFETY: chunk k has arrived in its slot (its event passed); nothing else uses
            // the slot until its copy back is queued below.
            unsafe { st.cross.run(Request::new(Collective::Allreduce, dtype, op, hi - lo), slot(k), slot(k)) }.map_err(|e| prefixed(e, w))?;
            // SAFETY: as above.
            unsafe { self.copy(Copy::ToDevice, at + (lo * es) as u64, slot(k), (hi - lo) * es, stream) }?;
            if k + slots < parts.len() {
                fetch(st, k + slots)?;
            }
        }
        Ok(())
    }

    /// Broadcast of `count` elements in `buf` from world rank `root`.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for `buf`.
    pub unsafe fn broadcast(&self, world: &Communicator, buf: u64, count: usize, dtype: DType, root: usize, stream: CUstream) -> Result<()> {
        let w = "gradwire_gpu_broadcast";
        let (bytes, _) = self.checked(Request { root, ..Request::new(Collective::Broadcast, dtype, ReduceOp::Sum, count) }, buf, buf, w)?;
        let mut st = self.enter(world, &[(buf, "buf", bytes)], w)?;
        if count == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract; one node, so NCCL's ranks are the world's.
            return unsafe { st.nccl.broadcast(buf, buf, count, dtype, root, stream) };
        }
        let mine = self.rank == root;
        let r = self.in_pieces(&mut st, count, 1, dtype, stream, w, |st, host, lo, len| {
            let at = buf + (lo * dtype.size()) as u64;
            if mine {
                // SAFETY: chunk [lo, lo + len) of `buf` (the caller's contract) into the region.
                unsafe { self.fetch_now(st, at, host, len * dtype.size(), stream, w) }?;
            }
            // SAFETY: the region holds the chunk; the root's copy has arrived in it.
            unsafe { world.run(Request { root, ..Request::new(Collective::Broadcast, dtype, ReduceOp::Sum, len) }, host, host) }.map_err(|e| prefixed(e, w))?;
            if !mine {
                // SAFETY: as above, back into `buf`.
                unsafe { self.copy(Copy::ToDevice, at, host, len * dtype.size(), stream) }?;
            }
            Ok(())
        });
        self.settle(&mut st, r, stream)
    }

    /// Reduce of `count` elements of `send` over every rank into `recv` of world rank
    /// `root` (`send == recv`: in place); the other ranks' `recv` is not written, as
    /// `ncclReduce`'s. Inside one node NCCL's reduce; across nodes, piece by piece through
    /// the pinned region and gradwire's reduce over every rank.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`]; `recv` need be valid on the root only.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reduce(
        &self,
        world: &Communicator,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
        stream: CUstream,
    ) -> Result<()> {
        let w = "gradwire_gpu_reduce";
        let mine = self.rank == root;
        // Off the root the receive buffer is not used (as ncclReduce's): checked as in place.
        let (bytes, _) = self.checked(Request { root, ..Request::new(Collective::Reduce, dtype, op, count) }, send, if mine { recv } else { send }, w)?;
        let mut st = self.enter(world, &[(send, "sendbuf", bytes), (recv, "recvbuf", if mine { bytes } else { 0 })], w)?;
        if count == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract; one node, so NCCL's ranks are the world's.
            return unsafe { st.nccl.reduce(send, recv, count, dtype, op, root, stream) };
        }
        let es = dtype.size();
        let r = self.in_pieces(&mut st, count, 1, dtype, stream, w, |st, host, lo, len| {
            // SAFETY: chunk [lo, lo + len) of `send` (the caller's contract) into the region.
            unsafe { self.fetch_now(st, send + (lo * es) as u64, host, len * es, stream, w) }?;
            // SAFETY: the region holds the chunk; gradwire's reduce runs in place there.
            unsafe { world.run(Request { root, ..Request::new(Collective::Reduce, dtype, op, len) }, host, host) }.map_err(|e| prefixed(e, w))?;
            if mine {
                // SAFETY: the reduced chunk back into `recv` (valid on the root).
                unsafe { self.copy(Copy::ToDevice, recv + (lo * es) as u64, host, len * es, stream) }?;
            }
            Ok(())
        });
        self.settle(&mut st, r, stream)
    }

    /// Reduce-scatter: `send` holds size × `recvcount` elements; `recv` gets this rank's
    /// reduced block.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for the sizes named; the buffers are disjoint or in
    /// NCCL's in-place layout (this rank's block of the larger one: each piece of it is
    /// read before it is written).
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
        let (whole, part) = self.checked(Request::new(Collective::ReduceScatter, dtype, op, recvcount), send, recv, w)?;
        let mut st = self.enter(world, &[(send, "sendbuf", whole), (recv, "recvbuf", part)], w)?;
        if recvcount == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract.
            return unsafe { st.nccl.reduce_scatter(send, recv, recvcount, dtype, op, stream) };
        }
        let (es, wn) = (dtype.size(), self.world);
        // Per piece of the blocks: [the result: len][every rank's block's piece: W × len].
        let r = self.in_pieces(&mut st, recvcount, wn + 1, dtype, stream, w, |st, host, lo, len| {
            // SAFETY: the region holds (W + 1) × len elements from `host`.
            let input = unsafe { host.add(len * es) };
            for b in 0..wn {
                // SAFETY: piece [lo, lo + len) of block b of `send` into slot b of the input.
                unsafe { self.copy(Copy::ToHost, send + ((b * recvcount + lo) * es) as u64, input.add(b * len * es), len * es, stream) }?;
            }
            self.arrived(st, stream, w)?;
            // SAFETY: the input has arrived; the result area lies before it.
            unsafe { world.run(Request::new(Collective::ReduceScatter, dtype, op, len), input, host) }.map_err(|e| prefixed(e, w))?;
            // SAFETY: piece [lo, lo + len) of `recv`.
            unsafe { self.copy(Copy::ToDevice, recv + (lo * es) as u64, host, len * es, stream) }
        });
        self.settle(&mut st, r, stream)
    }

    /// Allgather: `recv` holds size × `sendcount` elements, rank r's block at r.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for the sizes named; the buffers are disjoint or in
    /// NCCL's in-place layout (this rank's block of the larger one: each piece of it is
    /// read before it is written).
    pub unsafe fn allgather(&self, world: &Communicator, send: u64, recv: u64, sendcount: usize, dtype: DType, stream: CUstream) -> Result<()> {
        let w = "gradwire_gpu_allgather";
        let (part, whole) = self.checked(Request::new(Collective::Allgather, dtype, ReduceOp::Sum, sendcount), send, recv, w)?;
        let mut st = self.enter(world, &[(send, "sendbuf", part), (recv, "recvbuf", whole)], w)?;
        if sendcount == 0 {
            return Ok(());
        }
        if self.nodes == 1 {
            // SAFETY: the caller's contract.
            return unsafe { st.nccl.all_gather(send, recv, sendcount, dtype, stream) };
        }
        let (es, wn) = (dtype.size(), self.world);
        // Per piece of the blocks: [every rank's piece: W × len][this rank's piece: len].
        let r = self.in_pieces(&mut st, sendcount, wn + 1, dtype, stream, w, |st, host, lo, len| {
            // SAFETY: the region holds (W + 1) × len elements from `host`.
            let own = unsafe { host.add(wn * len * es) };
            // SAFETY: piece [lo, lo + len) of `send` into the last slot.
            unsafe { self.fetch_now(st, send + (lo * es) as u64, own, len * es, stream, w) }?;
            // SAFETY: this rank's piece has arrived; the result area lies before it.
            unsafe { world.run(Request::new(Collective::Allgather, dtype, ReduceOp::Sum, len), own, host) }.map_err(|e| prefixed(e, w))?;
            for b in 0..wn {
                // SAFETY: rank b's piece into piece [lo, lo + len) of block b of `recv`.
                unsafe { self.copy(Copy::ToDevice, recv + ((b * sendcount + lo) * es) as u64, host.add(b * len * es), len * es, stream) }?;
            }
            Ok(())
        });
        self.settle(&mut st, r, stream)
    }

    /// All-to-all: block b of `send` goes to rank b, and rank b's block for this rank lands
    /// in block b of `recv`: what mixture-of-experts layers exchange tokens with. Blocks of
    /// `count` elements each (`counts` None: the equal-block collective, which every rank
    /// must then call so) or of `counts` (blocks back to back; every pair agrees on its
    /// count). Inside one node NCCL's grouped sends and receives; across nodes, piece by
    /// piece through the pinned region and gradwire's all-to-all over every rank.
    ///
    /// # Safety
    /// As [`DeviceComm::allreduce`], for the sizes named; the buffers do not overlap.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn alltoall(
        &self,
        world: &Communicator,
        send: u64,
        recv: u64,
        counts: Option<&Counts>,
        count: usize,
        dtype: DType,
        stream: CUstream,
    ) -> Result<()> {
        let w = "gradwire_gpu_alltoall";
        let wn = self.world;
        let uniform;
        let blocks = match counts {
            Some(c) => c,
            None => {
                byte_len(count, wn, dtype, w)?;
                uniform = Counts::uniform(count, wn);
                &uniform
            }
        };
        let (sb, rb) = blocks.bytes(dtype, wn).map_err(|e| prefixed(e, w))?;
        if blocks.send[self.rank] != blocks.recv[self.rank] {
            return Err(invalid(format!("{w}: rank {} sends {} elements to itself but expects {}", self.rank, blocks.send[self.rank], blocks.recv[self.rank])));
        }
        self.laid_out(Collective::AllToAll, (send, sb), (recv, rb), w)?;
        let mut st = self.enter(world, &[(send, "sendbuf", sb), (recv, "recvbuf", rb)], w)?;
        if self.nodes == 1 {
            // SAFETY: the caller's contract; one node, so NCCL's ranks are the world's.
            return unsafe { st.nccl.all_to_all(send, recv, blocks, counts.is_none(), dtype, stream) };
        }
        let es = dtype.size();
        // Where each block starts, in elements.
        let starts = |v: &[usize]| -> Vec<usize> { v.iter().scan(0, |at, &n| Some(std::mem::replace(at, *at + n))).collect() };
        let (send_at, recv_at) = (starts(&blocks.send), starts(&blocks.recv));
        // Every rank must cut the same pieces: the equal-block call knows the largest block;
        // with counts the ranks agree on it (one small allreduce).
        let largest = match counts {
            None => count,
            Some(c) => {
                let mut m = [c.send.iter().chain(&c.recv).copied().max().unwrap_or(0) as i64];
                world.allreduce(&mut m, ReduceOp::Max).map_err(|e| prefixed(e, w))?;
                m[0] as usize
            }
        };
        if largest == 0 {
            return Ok(());
        }
        // Per piece: [every block's piece to send][every block's piece received], each
        // piece at most `len` elements of its block, packed.
        let r = self.in_pieces(&mut st, largest, 2 * wn, dtype, stream, w, |st, host, lo, len| {
            let piece = |v: &[usize]| -> Vec<usize> { v.iter().map(|&n| n.saturating_sub(lo).min(len)).collect() };
            let (sn, rn) = (piece(&blocks.send), piece(&blocks.recv));
            // SAFETY: the region holds 2W × len elements from `host`.
            let got = unsafe { host.add(wn * len * es) };
            let mut packed = 0;
            for b in (0..wn).filter(|&b| sn[b] > 0) {
                let from = send + ((send_at[b] + lo) * es) as u64;
                // SAFETY: this piece of block b of `send`, into the packed pieces to send.
                unsafe { self.copy(Copy::ToHost, from, host.add(packed * es), sn[b] * es, stream) }?;
                packed += sn[b];
            }
            self.arrived(st, stream, w)?;
            let result = match counts {
                // SAFETY: the pieces to send have arrived; the received ones go after them.
                None => unsafe { world.run(Request::new(Collective::AllToAll, dtype, ReduceOp::Sum, len), host, got) },
                // SAFETY: as above, with the pieces' counts (each within its half of the room).
                Some(_) => unsafe { world.run_alltoall(dtype, Counts { send: sn, recv: rn.clone() }, host, got) },
            };
            result.map_err(|e| prefixed(e, w))?;
            let mut packed = 0;
            for b in (0..wn).filter(|&b| rn[b] > 0) {
                let to = recv + ((recv_at[b] + lo) * es) as u64;
                // SAFETY: rank b's piece into this piece of block b of `recv`.
                unsafe { self.copy(Copy::ToDevice, to, got.add(packed * es), rn[b] * es, stream) }?;
                packed += rn[b];
            }
            Ok(())
        });
        self.settle(&mut st, r, stream)
    }

    /// Runs `piece(state, host, lo, len)` for the pieces [lo, lo + len) of `count`
    /// elements, each through the pinned region (`per_piece` × len elements of room), one
    /// after another: a piece writes the region only once the copies out of it that the
    /// last piece queued have run. The layout of a piece's room is the closure's.
    #[allow(clippy::too_many_arguments)]
    fn in_pieces(
        &self,
        st: &mut State,
        count: usize,
        per_piece: usize,
        dtype: DType,
        stream: CUstream,
        w: &str,
        mut piece: impl FnMut(&mut State, *mut u8, usize, usize) -> Result<()>,
    ) -> Result<()> {
        let per = piece_len(count, per_piece, dtype.size());
        let host = self.staging(st, per * per_piece * dtype.size(), w)?;
        for lo in (0..count).step_by(per) {
            if lo > 0 {
                st.staging_free.record(stream)?;
                self.wait(st, Mark::StagingFree, &format!("{w}: the copy out of the staging region"))?;
            }
            piece(st, host, lo, per.min(count - lo))?;
        }
        Ok(())
    }

    /// Ends a call that may have queued work: on success the staging region is marked free
    /// after the call's copies; on failure too (so that freeing it waits for them), and the
    /// communicator stops: NCCL is aborted, so node peers waiting for this rank's part end.
    fn settle(&self, st: &mut State, r: Result<()>, stream: CUstream) -> Result<()> {
        let marked = st.staging_free.record(stream);
        match r.and(marked) {
            Ok(()) => Ok(()),
            Err(e) => {
                if st.broken.is_none() {
                    st.broken = Some(e.to_string());
                    st.nccl.abort();
                }
                Err(e)
            }
        }
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

    /// Copies `bytes` at `at` to `host` and waits (with the deadline) until they are there.
    ///
    /// # Safety
    /// `at` is device memory of this device valid for `bytes`; `host` a part of the
    /// staging region as long.
    unsafe fn fetch_now(&self, st: &mut State, at: u64, host: *mut u8, bytes: usize, stream: CUstream, w: &str) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { self.copy(Copy::ToHost, at, host, bytes, stream) }?;
        self.arrived(st, stream, w)
    }

    /// Waits (with the deadline) until the stream has run what is queued on it so far.
    fn arrived(&self, st: &mut State, stream: CUstream, w: &str) -> Result<()> {
        st.reached.record(stream)?;
        self.wait(st, Mark::Reached, &format!("{w}: the device-to-host copy"))
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

    /// Waits for `mark` with the deadline (the failure, if any, stops the communicator
    /// when the call settles).
    fn wait(&self, st: &State, mark: Mark, what: &str) -> Result<()> {
        let ev = match mark {
            Mark::Reached => &st.reached,
            Mark::StagingFree => &st.staging_free,
            Mark::Slot(k) => &st.slots[k],
        };
        ev.wait(self.timeout, self.rank, self.peer, what)
    }
}

impl Drop for DeviceComm {
    /// The pinned region is released only once the copies out of it have run; if they do
    /// not within the deadline (a stuck stream), it is left mapped rather than freed under
    /// a copy that may still write into it.
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        let current = Current::make(&self.ctx);
        if current.is_err() || st.staging_free.wait(self.timeout, self.rank, self.peer, "freeing the GPU communicator").is_err() {
            std::mem::forget(st.staging.take());
            st.nccl.abort();
        }
        drop(st.staging.take()); // unregistered while the device's context is current
    }
}

/// The bytes of `count` × `blocks` elements of `dtype`, or an error if they overflow what a
/// buffer can hold.
pub(crate) fn byte_len(count: usize, blocks: usize, dtype: DType, w: &str) -> Result<usize> {
    count.checked_mul(blocks).and_then(|n| n.checked_mul(dtype.size())).filter(|&b| b <= isize::MAX as usize).ok_or_else(|| {
        invalid(format!("{w}: {count} elements{} of {} overflow a buffer", if blocks > 1 { format!(" x {blocks} ranks") } else { String::new() }, dtype.name()))
    })
}

fn prefixed(e: Error, w: &str) -> Error {
    match e {
        Error::InvalidArgument(m) if !m.starts_with(w) => invalid(format!("{w}: {m}")),
        e => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces keep the pinned region bounded whatever the world size, and are unchanged
    /// (a whole 4 MiB of a block) where the room allows it.
    #[test]
    fn pieces_bound_the_pinned_region() {
        for elem in [1, 2, 4, 8] {
            for per_piece in 1..600 {
                for count in [1, 3, 4097, 1 << 30] {
                    let len = piece_len(count, per_piece, elem);
                    assert!(len >= 1 && len <= count && len * elem <= PIPELINE_BYTES, "{elem} {per_piece} {count}: {len}");
                    assert!(len * per_piece * elem <= STAGING_BYTES.max(per_piece * elem), "{elem} {per_piece} {count}: {len}");
                }
            }
        }
        assert_eq!(piece_len(1 << 30, 3, 4), PIPELINE_BYTES / 4, "2 ranks' reduce-scatter: whole 4 MiB pieces");
        assert_eq!(piece_len(1 << 30, 2 * 256, 4), STAGING_BYTES / (4 * 512), "256 ranks' all-to-all: 32 KiB pieces");
    }
}
