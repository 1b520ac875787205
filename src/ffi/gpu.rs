//! The C ABI of the collectives on CUDA device memory: a GPU communicator made once from a
//! communicator and a device (`gradwire_gpu_comm_create`, as `ncclCommInitRank`), then
//! collectives enqueued on the caller's stream, as NCCL's are.

use super::{
    alltoall_counts, comm, dtype, gradwire_comm_t, gradwire_dtype_t, gradwire_op_t, guard, live_handle, out, put, redop, registry, root_of, take_handle,
    to_handle,
};
use crate::error::{invalid, Result};
use crate::gpu::DeviceComm;
use std::ffi::{c_int, c_void};
use std::sync::Arc;

/// Opaque GPU communicator handle (never dereferenced; its address is a registry id).
pub enum gradwire_gpu_comm {}
/// The GPU communicator handle type of ffi/gradwire.h.
pub type gradwire_gpu_comm_t = gradwire_gpu_comm;

/// The GPU communicator behind `p` with the communicator it was made from.
fn gpu(p: *const gradwire_gpu_comm_t, w: &str) -> Result<(Arc<DeviceComm>, Arc<crate::comm::Communicator>)> {
    let reg = registry();
    let (comm_id, g) = live_handle(&reg.gpus, p, w, "gpu communicator")?;
    let c = reg.comms.get(&comm_id).cloned().ok_or_else(|| invalid(format!("{w}: the GPU communicator's communicator is finalized")))?;
    Ok((g, c))
}

/// Makes the NCCL communicator of this rank's node on CUDA device `device`, and the
/// cross-node group (collective: every rank of `comm` calls it). Without a CUDA driver,
/// NCCL or the device, an error says what was searched.
///
/// # Safety
/// `gpu_out` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_gpu_comm_create(comm_p: *mut gradwire_comm_t, device: c_int, gpu_out: *mut *mut gradwire_gpu_comm_t) -> c_int {
    guard(|| {
        let w = "gradwire_gpu_comm_create";
        let (comm_id, c) = comm(comm_p, w)?;
        out(gpu_out, w, "gpu")?;
        let device = usize::try_from(device).map_err(|_| invalid(format!("{w}: device {device} is negative")))?;
        let g = DeviceComm::new(&c, device).map_err(|e| super::prefixed(e, w))?;
        let mut reg = registry();
        let id = reg.id();
        reg.gpus.insert(id, (comm_id, Arc::new(g)));
        drop(reg);
        put(gpu_out, to_handle(id), w, "gpu")
    })
}

/// Frees a GPU communicator (its communicator stays).
#[no_mangle]
pub extern "C" fn gradwire_gpu_comm_free(gpu_p: *mut gradwire_gpu_comm_t) -> c_int {
    guard(|| {
        let taken = take_handle(&mut registry().gpus, gpu_p, "gradwire_gpu_comm_free", "gpu communicator")?;
        drop(taken);
        Ok(())
    })
}

/// Allreduce of `count` elements of device memory, enqueued on `stream` (a `cudaStream_t`;
/// NULL: the legacy default stream); `sendbuf == recvbuf` is in place.
///
/// # Safety
/// The buffers must be device memory of the communicator's device, valid for `count`
/// elements until the stream has run the call; `stream` a live stream of that device.
#[no_mangle]
pub unsafe extern "C" fn gradwire_gpu_allreduce(
    gpu_p: *mut gradwire_gpu_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    stream: *mut c_void,
) -> c_int {
    guard(|| {
        let w = "gradwire_gpu_allreduce";
        let (g, c) = gpu(gpu_p, w)?;
        // SAFETY: the caller's contract; the pointers' kind and device are checked inside.
        unsafe { g.allreduce(&c, sendbuf as u64, recvbuf as u64, count, dtype(dt, w)?, redop(op, w)?, stream as _) }
    })
}

/// Broadcast of `count` elements of device memory from rank `root`, enqueued on `stream`.
///
/// # Safety
/// As `gradwire_gpu_allreduce`, for `buf`.
#[no_mangle]
pub unsafe extern "C" fn gradwire_gpu_broadcast(
    gpu_p: *mut gradwire_gpu_comm_t,
    buf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    root: c_int,
    stream: *mut c_void,
) -> c_int {
    guard(|| {
        let w = "gradwire_gpu_broadcast";
        let (g, c) = gpu(gpu_p, w)?;
        // SAFETY: the caller's contract; the pointer's kind and device are checked inside.
        unsafe { g.broadcast(&c, buf as u64, count, dtype(dt, w)?, root_of(root, w)?, stream as _) }
    })
}

/// Reduce of device memory to rank `root`, whose `recvbuf` gets the result (the others'
/// is not written; `sendbuf == recvbuf` is in place), as `ncclReduce`.
///
/// # Safety
/// As `gradwire_gpu_allreduce`; `recvbuf` need be valid on the root only.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gradwire_gpu_reduce(
    gpu_p: *mut gradwire_gpu_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    root: c_int,
    stream: *mut c_void,
) -> c_int {
    guard(|| {
        let w = "gradwire_gpu_reduce";
        let (g, c) = gpu(gpu_p, w)?;
        // SAFETY: the caller's contract; the pointers' kind and device are checked inside.
        unsafe { g.reduce(&c, sendbuf as u64, recvbuf as u64, count, dtype(dt, w)?, redop(op, w)?, root_of(root, w)?, stream as _) }
    })
}

/// Reduce-scatter of device memory: `sendbuf` holds size × `recvcount` elements.
///
/// # Safety
/// As `gradwire_gpu_allreduce`, for the sizes named; the buffers must not overlap.
#[no_mangle]
pub unsafe extern "C" fn gradwire_gpu_reduce_scatter(
    gpu_p: *mut gradwire_gpu_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    stream: *mut c_void,
) -> c_int {
    guard(|| {
        let w = "gradwire_gpu_reduce_scatter";
        let (g, c) = gpu(gpu_p, w)?;
        let d = dtype(dt, w)?;
        // SAFETY: the caller's contract; the pointers' kind, device and layout are checked inside.
        unsafe { g.reduce_scatter(&c, sendbuf as u64, recvbuf as u64, recvcount, d, redop(op, w)?, stream as _) }
    })
}

/// Allgather of device memory: `recvbuf` holds size × `sendcount` elements.
///
/// # Safety
/// As `gradwire_gpu_allreduce`, for the sizes named; the buffers must not overlap.
#[no_mangle]
pub unsafe extern "C" fn gradwire_gpu_allgather(
    gpu_p: *mut gradwire_gpu_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dt: gradwire_dtype_t,
    stream: *mut c_void,
) -> c_int {
    guard(|| {
        let w = "gradwire_gpu_allgather";
        let (g, c) = gpu(gpu_p, w)?;
        let d = dtype(dt, w)?;
        // SAFETY: the caller's contract; the pointers' kind, device and layout are checked inside.
        unsafe { g.allgather(&c, sendbuf as u64, recvbuf as u64, sendcount, d, stream as _) }
    })
}

/// All-to-all of device memory: block b of `sendbuf` goes to rank b, and rank b's block
/// for this rank lands in block b of `recvbuf`; blocks of `count` elements (both count
/// arrays NULL) or of `sendcounts`/`recvcounts` (one entry per rank, blocks back to back),
/// as `gradwire_alltoall`.
///
/// # Safety
/// As `gradwire_gpu_allreduce`, for the sizes named; the count arrays NULL or of one entry
/// per rank; the buffers must not overlap.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gradwire_gpu_alltoall(
    gpu_p: *mut gradwire_gpu_comm_t,
    sendbuf: *const c_void,
    sendcounts: *const usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    count: usize,
    dt: gradwire_dtype_t,
    stream: *mut c_void,
) -> c_int {
    guard(|| {
        let w = "gradwire_gpu_alltoall";
        let (g, c) = gpu(gpu_p, w)?;
        let d = dtype(dt, w)?;
        let counts = (!sendcounts.is_null() || !recvcounts.is_null()).then(|| alltoall_counts(&c, count, sendcounts, recvcounts, w)).transpose()?;
        // SAFETY: the caller's contract; the pointers' kind, device and overlap are checked inside.
        unsafe { g.alltoall(&c, sendbuf as u64, recvbuf as u64, counts.as_ref(), count, d, stream as _) }
    })
}
