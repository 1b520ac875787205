//! GPU layer (cargo feature `cuda`, on by default): NCCL inside a node through cudarc,
//! loaded at run time, so a build on a machine without CUDA works and reports "no GPU
//! support" cleanly instead of failing to link or panicking.
//!
//! cudarc panics when a library is missing and looks NCCL up as `libnccl.so` or
//! `libnccl.so.{13,12,11,10,9,1}` — not `libnccl.so.2`, NCCL's real soname (what the
//! `nvidia-nccl-cu13` wheel ships). [`unavailable`] checks first and explains;
//! [`nccl_link_dir`] makes a private `libnccl.so` link that `gradwire launch` puts on its
//! ranks' `LD_LIBRARY_PATH`.

use crate::comm::Communicator;
use crate::dtype::ReduceOp;
use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclOp};
use std::path::PathBuf;
use std::sync::Arc;

/// Where NCCL was looked for, and what was found.
#[derive(Debug)]
pub struct NcclSearch {
    /// cudarc can load it by one of its own names.
    pub loadable: bool,
    /// A `libnccl.so.2` found in a known folder.
    pub soname2: Option<PathBuf>,
    /// The folders searched for `libnccl.so.2`.
    pub searched: Vec<PathBuf>,
}

fn candidate_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("LD_LIBRARY_PATH").unwrap_or_default().split(':').filter(|s| !s.is_empty()).map(PathBuf::from).collect();
    for d in ["/usr/lib/x86_64-linux-gnu", "/usr/local/cuda/lib64", "/usr/local/lib", "/usr/lib64", "/usr/lib"] {
        dirs.push(PathBuf::from(d));
    }
    // pip's nvidia-nccl wheels: site-packages/nvidia/nccl/lib of the usual interpreters.
    let mut roots: Vec<PathBuf> = ["/usr/lib", "/usr/local/lib"].iter().map(PathBuf::from).collect();
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Ok(v) = std::env::var(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    if let Ok(home) = std::env::var("HOME") {
        roots.push(PathBuf::from(&home).join(".local/lib"));
        if let Ok(versions) = std::fs::read_dir(PathBuf::from(&home).join(".pyenv/versions")) {
            roots.extend(versions.flatten().map(|v| v.path().join("lib")));
        }
    }
    for root in roots {
        if let Ok(entries) = std::fs::read_dir(&root) {
            for e in entries.flatten().filter(|e| e.file_name().to_string_lossy().starts_with("python3")) {
                for pkgs in ["site-packages", "dist-packages"] {
                    dirs.push(e.path().join(pkgs).join("nvidia/nccl/lib"));
                }
            }
        }
    }
    dirs
}

/// Looks for NCCL the way cudarc will, and under its real soname.
pub fn nccl_search() -> NcclSearch {
    // SAFETY: only tries to dlopen candidate names; no symbol is called.
    let loadable = unsafe { cudarc::nccl::sys::is_culib_present() };
    let searched = candidate_dirs();
    let soname2 = searched.iter().map(|d| d.join("libnccl.so.2")).find(|p| p.exists());
    NcclSearch { loadable, soname2, searched }
}

/// A private folder holding `libnccl.so` → the `libnccl.so.2` found, for `LD_LIBRARY_PATH`
/// (which the loader reads only at process start, hence the launcher's part). `None` when
/// NCCL is loadable already or nowhere to be found.
pub fn nccl_link_dir() -> Option<PathBuf> {
    let s = nccl_search();
    let target = s.soname2.filter(|_| !s.loadable)?;
    let dir = std::env::temp_dir().join(format!("gradwire-nccl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).ok()?;
    let link = dir.join("libnccl.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&target, &link).ok()?;
    Some(dir)
}

/// Why GPUs cannot be used in this process, or `None` when they can.
pub fn unavailable() -> Option<String> {
    // SAFETY: only tries to dlopen candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Some(format!(
            "no CUDA driver library found; searched {:?} on the loader path (is the NVIDIA driver installed?)",
            cudarc::get_lib_name_candidates("cuda")
        ));
    }
    let s = nccl_search();
    if !s.loadable {
        let names = cudarc::get_lib_name_candidates("nccl");
        return Some(match s.soname2 {
            Some(p) => format!(
                "NCCL is at {} but it is loaded by the names {names:?}: put a `libnccl.so` link to it in a folder on LD_LIBRARY_PATH before the process starts (gradwire launch does this for its ranks)",
                p.display()
            ),
            None => format!("no NCCL library found; searched {names:?} on the loader path and libnccl.so.2 in {:?}", s.searched),
        });
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("the CUDA driver reports no GPU".into()),
        Err(e) => Some(format!("the CUDA driver cannot count devices: {e}")),
    }
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Avg => NcclOp::Avg,
        ReduceOp::Min => NcclOp::Min,
        ReduceOp::Max => NcclOp::Max,
        ReduceOp::Product => NcclOp::Prod,
    }
}

fn gpu_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Unsupported(format!("{what}: {e:?}"))
}

/// A host region registered (pinned) with CUDA: device copies to and from it run at full
/// DMA speed and without an extra bounce through a driver buffer. Registered once and
/// kept; replaced only when a larger one is needed.
struct PinnedStaging {
    region: Region,
}

impl PinnedStaging {
    fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self> {
        let region = Region::anonymous(bytes)?;
        ctx.bind_to_thread().map_err(|e| gpu_err("cuCtxSetCurrent", e))?;
        // SAFETY: the region is a live, page-aligned mapping of `len` bytes owned by us; it
        // is unregistered in Drop before the mapping goes away.
        let r = unsafe { cudarc::driver::sys::cuMemHostRegister_v2(region.as_ptr() as *mut _, region.len(), cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
            return Err(Error::Unsupported(format!("cuMemHostRegister of {} bytes failed: {r:?} (RLIMIT_MEMLOCK too small?)", region.len())));
        }
        Ok(PinnedStaging { region })
    }

    /// The first `n` elements of the region as `T`.
    fn slice<T: DeviceRepr>(&mut self, n: usize) -> &mut [T] {
        debug_assert!(n * std::mem::size_of::<T>() <= self.region.len());
        // SAFETY: page-aligned, large enough (checked by the caller's sizing), and every
        // bit pattern is a valid float; `&mut self` makes the borrow exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr() as *mut T, n) }
    }
}

impl Drop for PinnedStaging {
    fn drop(&mut self) {
        // SAFETY: registered in `new` and not yet unregistered.
        unsafe { cudarc::driver::sys::cuMemHostUnregister(self.region.as_ptr() as *mut _) };
    }
}

/// One NCCL communicator over the ranks of `group` (typically the node-local group made
/// by `split_node_local`), each rank on its own device or all on one device with one rank.
pub struct NcclGroup {
    comm: Comm,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    staging: std::sync::Mutex<Option<PinnedStaging>>,
}

impl NcclGroup {
    /// Creates the NCCL communicator: rank 0 makes the unique id and gradwire's own
    /// broadcast carries it to the others (the bootstrap store's path, authenticated).
    pub fn new(group: &Communicator, device: usize) -> Result<Self> {
        if let Some(why) = unavailable() {
            return Err(Error::Unsupported(why));
        }
        let ctx = CudaContext::new(device).map_err(|e| gpu_err(&format!("CUDA device {device}"), e))?;
        let stream = ctx.default_stream();
        let mut words = [0f64; 16];
        if group.rank() == 0 {
            let id = Id::new().map_err(|e| gpu_err("ncclGetUniqueId", e))?;
            for (w, chunk) in words.iter_mut().zip(id.internal().chunks(8)) {
                let mut b = [0u8; 8];
                for (x, c) in b.iter_mut().zip(chunk) {
                    *x = *c as u8;
                }
                *w = f64::from_bits(u64::from_le_bytes(b));
            }
        }
        // The broadcast copies bytes, so the id's bit patterns survive unchanged.
        group.broadcast(&mut words, 0)?;
        let mut internal = [0 as std::ffi::c_char; 128];
        for (chunk, w) in internal.chunks_mut(8).zip(words) {
            for (c, b) in chunk.iter_mut().zip(w.to_bits().to_le_bytes()) {
                *c = b as std::ffi::c_char;
            }
        }
        let comm = Comm::from_rank(stream.clone(), group.rank(), group.size(), Id::uninit(internal)).map_err(|e| gpu_err("ncclCommInitRank", e))?;
        Ok(NcclGroup { comm, stream, ctx, staging: std::sync::Mutex::new(None) })
    }

    /// The CUDA context of this rank's device, for allocating the buffers passed in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// This rank's index in the NCCL communicator (the same as in `group`).
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// Number of ranks in the NCCL communicator.
    pub fn size(&self) -> usize {
        self.comm.world_size()
    }

    fn sync(&self, what: &str) -> Result<()> {
        self.stream.synchronize().map_err(|e| gpu_err(what, e))
    }

    /// Allreduce of a device buffer in place; returns when the result is in `buf`.
    pub fn allreduce<T: NcclType>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        self.comm.all_reduce_in_place(buf, &nccl_op(op)).map_err(|e| gpu_err("ncclAllReduce", e))?;
        self.sync("ncclAllReduce")
    }

    /// Broadcast of a device buffer from `root`, in place.
    pub fn broadcast<T: NcclType>(&self, buf: &mut CudaSlice<T>, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(invalid(format!("root {root} is not a rank of this NCCL group (size {})", self.size())));
        }
        self.comm.broadcast_in_place(buf, root as i32).map_err(|e| gpu_err("ncclBroadcast", e))?;
        self.sync("ncclBroadcast")
    }

    /// Reduce-scatter: `send` holds size × `recv.len()` elements.
    pub fn reduce_scatter<T: NcclType>(&self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        if send.len() != recv.len() * self.size() {
            return Err(invalid(format!("reduce_scatter: send has {} elements, expected {} x {}", send.len(), recv.len(), self.size())));
        }
        self.comm.reduce_scatter(send, recv, &nccl_op(op)).map_err(|e| gpu_err("ncclReduceScatter", e))?;
        self.sync("ncclReduceScatter")
    }

    /// Allgather: `recv` holds size × `send.len()` elements.
    pub fn allgather<T: NcclType>(&self, send: &CudaSlice<T>, recv: &mut CudaSlice<T>) -> Result<()> {
        if recv.len() != send.len() * self.size() {
            return Err(invalid(format!("allgather: recv has {} elements, expected {} x {}", recv.len(), send.len(), self.size())));
        }
        self.comm.all_gather(send, recv).map_err(|e| gpu_err("ncclAllGather", e))?;
        self.sync("ncclAllGather")
    }

    /// Hierarchical allreduce of a device buffer: NCCL reduce-scatter inside the node, the
    /// shard through pinned host memory to gradwire's cross-node allreduce (`cross`: the
    /// ranks of every node with this local index), back to the device, NCCL allgather. The
    /// only copies are device-to-host and host-to-device of the 1/G shard.
    pub fn hierarchical_allreduce<T>(&self, cross: &Communicator, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()>
    where
        T: NcclType + DeviceRepr + ValidAsZeroBits + crate::dtype::Element,
    {
        let g = self.size();
        if buf.len() % g != 0 {
            return Err(invalid(format!("hierarchical allreduce on the GPU: {} elements do not split into {g} equal shards", buf.len())));
        }
        let inner = if op == ReduceOp::Avg { ReduceOp::Sum } else { op };
        let shard_len = buf.len() / g;
        let mut shard = self.stream.alloc_zeros::<T>(shard_len).map_err(|e| gpu_err("cuMemAlloc", e))?;
        self.reduce_scatter(buf, &mut shard, inner)?;
        let bytes = shard_len * std::mem::size_of::<T>();
        let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
        if staging.as_ref().is_none_or(|s| s.region.len() < bytes) {
            *staging = None; // unregister the smaller one first
            *staging = Some(PinnedStaging::new(&self.ctx, bytes)?);
        }
        let host = staging.as_mut().map(|s| s.slice::<T>(shard_len)).ok_or_else(|| invalid("no staging region"))?;
        self.stream.memcpy_dtoh(&shard, &mut *host).map_err(|e| gpu_err("device to host copy", e))?;
        self.sync("device to host copy")?;
        cross.allreduce(host, inner)?;
        if op == ReduceOp::Avg {
            let w = (g * cross.size()) as f64;
            host.iter_mut().for_each(|x| *x = T::from_f64(x.to_f64() / w));
        }
        self.stream.memcpy_htod(&*host, &mut shard).map_err(|e| gpu_err("host to device copy", e))?;
        drop(staging);
        self.allgather(&shard, buf)
    }
}
