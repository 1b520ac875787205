//! Which memory a pointer is (host, a device's, managed), the pinned host region the
//! device data crosses nodes through, and waiting for a stream with a deadline.

use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use cudarc::driver::sys::{self as cu, CUresult};
use cudarc::driver::CudaContext;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Where a pointer's memory lives, as the CUDA driver sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemoryKind {
    /// Host memory: plain, pinned or registered.
    Host,
    /// Memory of the CUDA device with this ordinal (`cudaMalloc`, torch's CUDA tensors).
    Device(usize),
    /// Managed (unified) memory, usable from the host and the devices.
    Managed,
}

pub(super) fn driver_err(what: &str, r: CUresult) -> Error {
    Error::Unsupported(format!("{what}: {r:?}"))
}

/// A failed cudarc driver call, named.
pub(super) fn cuda_err(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Unsupported(format!("{what}: {e:?}"))
}

impl From<cudarc::driver::DriverError> for Error {
    fn from(e: cudarc::driver::DriverError) -> Self {
        cuda_err("CUDA", e)
    }
}

/// `ctx` current on this thread until dropped, then whatever was current before (possibly
/// none): a framework's thread keeps its own current device across gradwire's calls.
pub(super) struct Current {
    previous: cu::CUcontext,
}

impl Current {
    pub(super) fn make(ctx: &Arc<CudaContext>) -> Result<Self> {
        let mut previous = std::ptr::null_mut();
        // SAFETY: writes one context handle (null when none is current); on failure it
        // stays null.
        unsafe { cu::cuCtxGetCurrent(&mut previous) };
        let current = Current { previous };
        ctx.bind_to_thread().map_err(|e| cuda_err("cuCtxSetCurrent", e))?;
        Ok(current)
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        // SAFETY: puts back the context that was current when this was made.
        unsafe { cu::cuCtxSetCurrent(self.previous) };
    }
}

fn check(r: CUresult, what: &str) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(driver_err(what, r))
    }
}

/// Whether the CUDA driver library is already loaded in this process. Only a process that
/// loaded it can hold device pointers, so host entry points ask the driver about a
/// pointer only then, and a CPU-only process never loads CUDA for the check. Once seen
/// loaded it stays so; not seen, the question is asked again at most every 10 ms (it
/// takes the loader's lock), so a library loaded later is noticed that soon.
fn cuda_in_process() -> bool {
    static SEEN: AtomicBool = AtomicBool::new(false);
    static NEXT_PROBE_NS: AtomicU64 = AtomicU64::new(0);
    static START: OnceLock<Instant> = OnceLock::new();
    if SEEN.load(Ordering::Relaxed) {
        return true;
    }
    let now = START.get_or_init(Instant::now).elapsed().as_nanos() as u64;
    if now < NEXT_PROBE_NS.load(Ordering::Relaxed) {
        return false;
    }
    // SAFETY: RTLD_NOLOAD only looks the name up among the loaded objects (their file
    // names and sonames: cudarc's `libcuda.so` carries the soname `libcuda.so.1`); a handle
    // found is released at once (the library stays, as others hold it).
    let loaded = unsafe {
        let h = libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD);
        if !h.is_null() {
            libc::dlclose(h);
        }
        !h.is_null()
    };
    // cudarc opens the driver by its own list of names: one must load (it panics if none).
    // SAFETY: only dlopens candidate names.
    if loaded && unsafe { cu::is_culib_present() } {
        SEEN.store(true, Ordering::Relaxed);
        return true;
    }
    NEXT_PROBE_NS.store(now + 10_000_000, Ordering::Relaxed);
    false
}

/// What the driver says of `ptr`: (memory type, device ordinal, managed, the allocation's
/// start and size); `None` for memory it does not know or when CUDA is not in use here.
fn attributes(ptr: *const u8) -> Option<(u32, usize, bool, u64, usize)> {
    if ptr.is_null() || !cuda_in_process() {
        return None;
    }
    // One driver call for every attribute (this runs on every collective's buffers).
    use cu::CUpointer_attribute::{
        CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL as ORDINAL, CU_POINTER_ATTRIBUTE_IS_MANAGED as MANAGED, CU_POINTER_ATTRIBUTE_MEMORY_TYPE as TYPE,
        CU_POINTER_ATTRIBUTE_RANGE_SIZE as SIZE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR as START,
    };
    let mut attrs = [TYPE, ORDINAL, MANAGED, START, SIZE];
    let (mut kind, mut ordinal, mut managed, mut start, mut size) = (0u32, 0i32, 0u32, 0u64, 0usize);
    let mut out: [*mut std::ffi::c_void; 5] = [
        &mut kind as *mut u32 as *mut _,
        &mut ordinal as *mut i32 as *mut _,
        &mut managed as *mut u32 as *mut _,
        &mut start as *mut u64 as *mut _,
        &mut size as *mut usize as *mut _,
    ];
    // SAFETY: one output slot of the attribute's size per attribute; a pointer the driver
    // does not know comes back as memory type 0, not as a fault.
    let r = unsafe { cu::cuPointerGetAttributes(5, attrs.as_mut_ptr(), out.as_mut_ptr(), ptr as cu::CUdeviceptr) };
    (r == CUresult::CUDA_SUCCESS && kind != 0).then_some((kind, ordinal.max(0) as usize, managed == 1, start, size))
}

/// The kind of memory at `ptr`. Anything the driver does not know (plain `malloc`, a
/// process without CUDA, CUDA not initialised) is host memory.
pub fn memory_kind(ptr: *const u8) -> MemoryKind {
    match attributes(ptr) {
        Some((_, _, true, _, _)) => MemoryKind::Managed,
        Some((kind, ordinal, _, _, _)) if kind == cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 => MemoryKind::Device(ordinal),
        _ => MemoryKind::Host,
    }
}

/// An error when `ptr`, passed as `name` to the host entry point `w`, is device memory.
pub fn expect_host(ptr: *const u8, w: &str, name: &str) -> Result<()> {
    match memory_kind(ptr) {
        MemoryKind::Device(d) => Err(invalid(format!(
            "{w}: {name} {ptr:p} is memory of CUDA device {d}; {w} takes host memory (device buffers go through gradwire_gpu_* on a gradwire_gpu_comm_t)"
        ))),
        _ => Ok(()),
    }
}

/// An error unless `ptr`, passed as `name` to `w`, is memory of CUDA device `device` (or
/// managed memory) whose allocation holds `bytes` from `ptr` on.
pub fn expect_device(ptr: *const u8, bytes: usize, device: usize, w: &str, name: &str) -> Result<()> {
    if ptr.is_null() {
        return Err(invalid(format!("{w}: {name} is NULL")));
    }
    let host = || invalid(format!("{w}: {name} {ptr:p} is host memory; {w} takes CUDA device memory (host buffers go through the plain gradwire_* calls)"));
    let (kind, ordinal, managed, start, size) = attributes(ptr).ok_or_else(host)?;
    if !managed && kind != cu::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
        return Err(host());
    }
    if !managed && ordinal != device {
        return Err(invalid(format!("{w}: {name} {ptr:p} is memory of CUDA device {ordinal}, but this GPU communicator is on device {device}")));
    }
    let end = (ptr as u64).checked_add(bytes as u64);
    if size > 0 && end.is_none_or(|e| e > start.saturating_add(size as u64)) {
        return Err(invalid(format!(
            "{w}: {name} {ptr:p} holds {} bytes to the end of its allocation, but the call needs {bytes}",
            (start + size as u64).saturating_sub(ptr as u64)
        )));
    }
    Ok(())
}

/// A host region registered (pinned) with CUDA: device copies to and from it run at full
/// DMA speed and without an extra bounce through a driver buffer. Registered once and
/// kept; replaced only when a larger one is needed.
pub(super) struct PinnedStaging {
    region: Region,
}

impl PinnedStaging {
    pub(super) fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let region = Region::anonymous(bytes)?;
        let _current = Current::make(ctx)?;
        // SAFETY: the region is a live, page-aligned mapping of `len` bytes owned by us; it
        // is unregistered in Drop before the mapping goes away.
        let r = unsafe { cu::cuMemHostRegister_v2(region.as_ptr() as *mut _, region.len(), cu::CU_MEMHOSTREGISTER_PORTABLE) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(Error::Unsupported(format!("cuMemHostRegister of {} bytes failed: {r:?} (RLIMIT_MEMLOCK too small?)", region.len())));
        }
        Ok(PinnedStaging { region })
    }

    pub(super) fn len(&self) -> usize {
        self.region.len()
    }

    pub(super) fn as_ptr(&self) -> *mut u8 {
        self.region.as_ptr()
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        // SAFETY: registered in `new` and not yet unregistered.
        unsafe { cu::cuMemHostUnregister(self.region.as_ptr() as *mut _) };
    }
}

/// A CUDA event (timing disabled: it only marks a point in a stream).
pub(super) struct Event(cu::CUevent);

// SAFETY: a CUevent is a driver handle usable from any thread of the process.
unsafe impl Send for Event {}
// SAFETY: as above; the driver synchronises its own use of it.
unsafe impl Sync for Event {}

impl Event {
    pub(super) fn new() -> Result<Self> {
        let mut ev = std::ptr::null_mut();
        // SAFETY: writes one event handle.
        check(unsafe { cu::cuEventCreate(&mut ev, cu::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32) }, "cuEventCreate")?;
        Ok(Event(ev))
    }

    /// Marks the point `stream` has reached in its queue.
    pub(super) fn record(&self, stream: cu::CUstream) -> Result<()> {
        // SAFETY: a live event; the caller passes a stream of the current context.
        check(unsafe { cu::cuEventRecord(self.0, stream) }, "cuEventRecord")
    }

    /// Waits until the stream has passed the recorded point, or `limit` has gone by: a
    /// kernel stuck on a dead peer is an error naming `rank`, `peer` (the peer it most
    /// likely waits for) and `what`, never a hang.
    pub(super) fn wait(&self, limit: Duration, rank: usize, peer: usize, what: &str) -> Result<()> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            // SAFETY: a live event.
            match unsafe { cu::cuEventQuery(self.0) } {
                CUresult::CUDA_SUCCESS => return Ok(()),
                CUresult::CUDA_ERROR_NOT_READY => {}
                r => return Err(driver_err(what, r)),
            }
            if start.elapsed() > limit {
                return Err(Error::Timeout { rank, peer, op: format!("{what} (the GPU stream did not get past it)"), waited_ms: limit.as_millis() as u64 });
            }
            spins += 1;
            if spins > 1000 {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe { cu::cuEventDestroy_v2(self.0) };
    }
}

/// Copy bandwidth between device memory and the staging region gradwire crosses nodes
/// through (anonymous memory registered with `cuMemHostRegister`), against the same copies
/// from `cuMemAllocHost` memory (what `cudaMemcpy` from pinned memory measures): GB/s of
/// (staging to host, staging to device, pinned to host, pinned to device), best of `reps`.
pub fn staging_bandwidth(device: usize, bytes: usize, reps: usize) -> Result<[f64; 4]> {
    if let Some(why) = super::unavailable() {
        return Err(Error::Unsupported(why));
    }
    let ctx = CudaContext::new(device).map_err(|e| cuda_err(&format!("CUDA device {device}"), e))?;
    let _current = Current::make(&ctx)?;
    let stream = ctx.new_stream().map_err(|e| cuda_err("cuStreamCreate", e))?;
    let dev = stream.alloc_zeros::<u8>(bytes).map_err(|e| cuda_err("cuMemAlloc", e))?;
    let (dptr, _) = cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
    let staging = PinnedStaging::new(&ctx, bytes)?;
    let mut pinned: *mut std::ffi::c_void = std::ptr::null_mut();
    // SAFETY: writes one pointer to `bytes` of page-locked memory, freed below.
    check(unsafe { cu::cuMemAllocHost_v2(&mut pinned, bytes) }, "cuMemAllocHost")?;
    let s = stream.cu_stream();
    let time = |to_host: bool, host: *mut u8| -> Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..reps.max(1) {
            let t = Instant::now();
            // SAFETY: both ranges hold `bytes` and outlive the synchronisation below.
            let r = unsafe {
                if to_host {
                    cu::cuMemcpyDtoHAsync_v2(host as *mut _, dptr, bytes, s)
                } else {
                    cu::cuMemcpyHtoDAsync_v2(dptr, host as *const _, bytes, s)
                }
            };
            check(r, "cuMemcpyAsync")?;
            stream.synchronize().map_err(|e| cuda_err("cuStreamSynchronize", e))?;
            best = best.min(t.elapsed().as_secs_f64());
        }
        Ok(bytes as f64 / best / 1e9)
    };
    let out = (|| Ok([time(true, staging.as_ptr())?, time(false, staging.as_ptr())?, time(true, pinned as *mut u8)?, time(false, pinned as *mut u8)?]))();
    // SAFETY: allocated above; no copy is in flight (each was synchronised).
    unsafe { cu::cuMemFreeHost(pinned) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Host memory passes the host check and fails the device check with a message naming
    /// the entry point, the argument and what to use instead, with or without CUDA here.
    #[test]
    fn host_memory_is_told_apart() {
        let v = vec![1f32; 64];
        let p = v.as_ptr() as *const u8;
        assert_eq!(memory_kind(p), MemoryKind::Host);
        expect_host(p, "gradwire_allreduce", "sendbuf").unwrap();
        let e = expect_device(p, 256, 0, "gradwire_gpu_allreduce", "recvbuf").unwrap_err().to_string();
        assert!(e.contains("gradwire_gpu_allreduce: recvbuf") && e.contains("is host memory") && e.contains("plain gradwire_* calls"), "{e}");
        assert_eq!(memory_kind(std::ptr::null()), MemoryKind::Host);
    }
}
