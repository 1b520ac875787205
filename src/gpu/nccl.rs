//! One NCCL communicator over the ranks of a group (the node-local group), its calls
//! enqueued on the caller's CUDA stream as NCCL's own API does.

use crate::collective::exchange::Counts;
use crate::comm::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::error::{invalid, Error, Result};
use cudarc::driver::sys::CUstream;
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys::{self, ncclDataType_t as T, ncclRedOp_t as O};
use std::ffi::c_void;

/// NCCL's name for `dtype` (bool travels as bytes, as torch's NCCL backend sends it).
fn nccl_type(dtype: DType) -> T {
    match dtype {
        DType::F32 => T::ncclFloat32,
        DType::F64 => T::ncclFloat64,
        DType::F16 => T::ncclFloat16,
        DType::BF16 => T::ncclBfloat16,
        DType::I8 => T::ncclInt8,
        DType::U8 | DType::Bool => T::ncclUint8,
        DType::I32 => T::ncclInt32,
        DType::I64 => T::ncclInt64,
    }
}

/// NCCL's reduction for `op` on `dtype`: on bool, sum and max are "or", min and product
/// "and", as gradwire's host kernels define them.
fn nccl_op(op: ReduceOp, dtype: DType) -> Result<O> {
    op.check(dtype)?;
    Ok(match (op, dtype) {
        (ReduceOp::Sum | ReduceOp::Max, DType::Bool) => O::ncclMax,
        (ReduceOp::Min | ReduceOp::Product, DType::Bool) => O::ncclMin,
        (ReduceOp::Sum, _) => O::ncclSum,
        (ReduceOp::Avg, _) => O::ncclAvg,
        (ReduceOp::Min, _) => O::ncclMin,
        (ReduceOp::Max, _) => O::ncclMax,
        (ReduceOp::Product, _) => O::ncclProd,
    })
}

/// An NCCL failure in words: cudarc's error prints only "NcclError", so this adds the
/// result code, NCCL's text for it and NCCL's last message (what NCCL itself would log).
fn nccl_err(what: &str, e: nccl::NcclError) -> Error {
    let text = |p: *const std::ffi::c_char| {
        // SAFETY: NCCL returns null or a NUL-terminated string it owns and keeps (static
        // text, or its thread's last-error buffer), read here at once.
        (!p.is_null()).then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().trim().to_string())
    };
    // ncclGetLastError came with NCCL 2.13; cudarc's loader panics on a missing symbol.
    let has_last_error = nccl::get_nccl_version().is_ok_and(|v| v >= 21300);
    // SAFETY: both calls take a result code or a null communicator (the last error of
    // this thread) and only return a string; the second exists (checked above).
    let (meaning, last) = unsafe { (text(sys::ncclGetErrorString(e.0)), has_last_error.then(|| text(sys::ncclGetLastError(std::ptr::null_mut()))).flatten()) };
    let mut msg = format!("{what}: {:?}", e.0);
    for part in [meaning, last].into_iter().flatten().filter(|t| !t.is_empty()) {
        msg += &format!(": {part}");
    }
    Error::Unsupported(msg)
}

/// An NCCL communicator. Its calls only enqueue work on the stream passed; the caller
/// orders and waits. Not for concurrent use: the owner serialises calls.
pub(super) struct NcclGroup {
    comm: sys::ncclComm_t,
    rank: usize,
    size: usize,
    /// NCCL has `ncclAlltoAll` (from 2.28.3; cudarc's loader panics on a missing symbol).
    has_all_to_all: bool,
}

/// The first NCCL with `ncclAlltoAll`.
const NCCL_ALL_TO_ALL: i32 = 22803;

// SAFETY: an NCCL communicator may be used from any thread, one call at a time; the owner
// (`DeviceComm`) serialises its calls behind a lock.
unsafe impl Send for NcclGroup {}
// SAFETY: as above.
unsafe impl Sync for NcclGroup {}

impl NcclGroup {
    /// Creates the communicator on the device current to this thread: rank 0 of `group`
    /// makes the unique id and gradwire's own broadcast carries it to the others (the
    /// bootstrap store's path, authenticated), as `ncclCommInitRank` expects.
    pub(super) fn new(group: &Communicator) -> Result<Self> {
        let mut id = [0u8; 128];
        if group.rank() == 0 {
            let made = nccl::get_uniqueid().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
            for (b, c) in id.iter_mut().zip(made.internal) {
                *b = c as u8;
            }
        }
        group.broadcast(&mut id, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (c, b) in internal.iter_mut().zip(id) {
            *c = b as std::ffi::c_char;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: writes one communicator handle; the id came from rank 0's ncclGetUniqueId.
        unsafe { nccl::comm_init_rank(&mut comm, group.size() as i32, sys::ncclUniqueId { internal }, group.rank() as i32) }
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        let has_all_to_all = nccl::get_nccl_version().is_ok_and(|v| v >= NCCL_ALL_TO_ALL);
        Ok(NcclGroup { comm, rank: group.rank(), size: group.size(), has_all_to_all })
    }

    /// This rank's index in the communicator.
    pub(super) fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub(super) fn size(&self) -> usize {
        self.size
    }

    /// Enqueues an allreduce of `count` elements.
    ///
    /// # Safety
    /// `send` and `recv` are device memory of this communicator's device, valid for
    /// `count` elements until `stream` has run the call; `stream` is a live stream of the
    /// current context.
    pub(super) unsafe fn all_reduce(&self, send: u64, recv: u64, count: usize, dtype: DType, op: ReduceOp, stream: CUstream) -> Result<()> {
        let o = nccl_op(op, dtype)?;
        // SAFETY: the caller's contract.
        unsafe { nccl::all_reduce(send as *const c_void, recv as *mut c_void, count, nccl_type(dtype), o, self.comm, stream as sys::cudaStream_t) }
            .map(drop)
            .map_err(|e| nccl_err("ncclAllReduce", e))
    }

    /// Enqueues a reduce-scatter: `send` holds size × `recvcount` elements.
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce`], for the sizes named.
    pub(super) unsafe fn reduce_scatter(&self, send: u64, recv: u64, recvcount: usize, dtype: DType, op: ReduceOp, stream: CUstream) -> Result<()> {
        let o = nccl_op(op, dtype)?;
        // SAFETY: the caller's contract.
        unsafe { nccl::reduce_scatter(send as *const c_void, recv as *mut c_void, recvcount, nccl_type(dtype), o, self.comm, stream as sys::cudaStream_t) }
            .map(drop)
            .map_err(|e| nccl_err("ncclReduceScatter", e))
    }

    /// Enqueues an allgather: `recv` holds size × `sendcount` elements.
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce`], for the sizes named.
    pub(super) unsafe fn all_gather(&self, send: u64, recv: u64, sendcount: usize, dtype: DType, stream: CUstream) -> Result<()> {
        // SAFETY: the caller's contract.
        unsafe { nccl::all_gather(send as *const c_void, recv as *mut c_void, sendcount, nccl_type(dtype), self.comm, stream as sys::cudaStream_t) }
            .map(drop)
            .map_err(|e| nccl_err("ncclAllGather", e))
    }

    /// Enqueues a reduce to `root` (whose `recv` gets the result; the others' `recv` is
    /// not written).
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce`]; `recv` need be valid on the root only.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn reduce(&self, send: u64, recv: u64, count: usize, dtype: DType, op: ReduceOp, root: usize, stream: CUstream) -> Result<()> {
        if root >= self.size {
            return Err(invalid(format!("root {root} is not a rank of this NCCL group (size {})", self.size)));
        }
        let o = nccl_op(op, dtype)?;
        // SAFETY: the caller's contract.
        unsafe { nccl::reduce(send as *const c_void, recv as *mut c_void, count, nccl_type(dtype), o, root as i32, self.comm, stream as sys::cudaStream_t) }
            .map(drop)
            .map_err(|e| nccl_err("ncclReduce", e))
    }

    /// Enqueues a broadcast from `root` (in place when `send == recv`).
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce`].
    pub(super) unsafe fn broadcast(&self, send: u64, recv: u64, count: usize, dtype: DType, root: usize, stream: CUstream) -> Result<()> {
        if root >= self.size {
            return Err(invalid(format!("root {root} is not a rank of this NCCL group (size {})", self.size)));
        }
        // SAFETY: the caller's contract.
        unsafe { nccl::broadcast(send as *const c_void, recv as *mut c_void, count, nccl_type(dtype), root as i32, self.comm, stream as sys::cudaStream_t) }
            .map(drop)
            .map_err(|e| nccl_err("ncclBroadcast", e))
    }

    /// Enqueues an all-to-all: block p of `send` (`counts.send[p]` elements, blocks back to
    /// back) goes to rank p, and rank p's block for this rank lands in block p of `recv`
    /// (`counts.recv[p]`). The equal-block call (`equal_call`: every rank makes it so) is
    /// NCCL's `ncclAlltoAll` where NCCL has it, as torch calls it; otherwise one group of
    /// sends and receives, which is how NCCL's all-to-all was written before. Which one is
    /// chosen by the call, never by one rank's counts: a rank whose uneven call happens to
    /// hold equal counts must still meet its peers' sends and receives. Empty blocks are
    /// not sent (both ends skip them alike).
    ///
    /// # Safety
    /// As [`NcclGroup::all_reduce`], with the counts' elements in each buffer, which do not
    /// overlap; the counts have one entry per rank of this group (all equal when
    /// `equal_call`).
    pub(super) unsafe fn all_to_all(&self, send: u64, recv: u64, counts: &Counts, equal_call: bool, dtype: DType, stream: CUstream) -> Result<()> {
        let (t, es) = (nccl_type(dtype), dtype.size() as u64);
        let s = stream as sys::cudaStream_t;
        if equal_call && counts.send[0] == 0 {
            return Ok(());
        }
        if equal_call && self.has_all_to_all {
            // SAFETY: the caller's contract; the symbol exists (the version was checked).
            return unsafe { sys::ncclAlltoAll(send as *const c_void, recv as *mut c_void, counts.send[0], t, self.comm, s) }
                .result()
                .map(drop)
                .map_err(|e| nccl_err("ncclAlltoAll", e));
        }
        self.grouped(|| {
            let (mut sat, mut rat) = (send, recv);
            for p in 0..self.size {
                let (sn, rn) = (counts.send[p], counts.recv[p]);
                if sn > 0 {
                    // SAFETY: block p lies inside `send` (the caller's contract).
                    unsafe { nccl::send(sat as *const c_void, sn, t, p as i32, self.comm, s) }.map_err(|e| nccl_err("ncclSend", e))?;
                }
                if rn > 0 {
                    // SAFETY: block p lies inside `recv` (the caller's contract).
                    unsafe { nccl::recv(rat as *mut c_void, rn, t, p as i32, self.comm, s) }.map_err(|e| nccl_err("ncclRecv", e))?;
                }
                sat += sn as u64 * es;
                rat += rn as u64 * es;
            }
            Ok(())
        })
    }

    /// Runs `f`'s calls as one NCCL group (fused, so that several broadcasts with
    /// different roots cannot deadlock each other).
    pub(super) fn grouped(&self, f: impl FnOnce() -> Result<()>) -> Result<()> {
        nccl::group_start().map_err(|e| nccl_err("ncclGroupStart", e))?;
        let r = f();
        let end = nccl::group_end().map(drop).map_err(|e| nccl_err("ncclGroupEnd", e));
        r.and(end)
    }

    /// Makes every call of this communicator return and its kernels end (after a timeout:
    /// a peer is gone and NCCL would wait for it forever).
    pub(super) fn abort(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator, aborted once, then forgotten.
            let _ = unsafe { nccl::comm_abort(self.comm) };
            self.comm = std::ptr::null_mut();
        }
    }
}

impl Drop for NcclGroup {
    fn drop(&mut self) {
        if !self.comm.is_null() {
            // SAFETY: a live communicator, destroyed once.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// NCCL's failures reach the caller in words, not as cudarc's bare "NcclError".
    #[test]
    fn nccl_errors_say_what_nccl_says() {
        if let Some(why) = crate::gpu::unavailable() {
            eprintln!("SKIP nccl_errors_say_what_nccl_says: {why}");
            return;
        }
        let msg = nccl_err("ncclCommInitRank", nccl::NcclError(sys::ncclResult_t::ncclInvalidUsage)).to_string();
        assert!(msg.contains("ncclCommInitRank: ncclInvalidUsage: invalid usage"), "{msg}");
    }
}
