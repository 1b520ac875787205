//! Finding CUDA and NCCL at run time. cudarc panics when a library is missing and looks
//! NCCL up as `libnccl.so` or `libnccl.so.{13,12,11,10,9,1}` — not `libnccl.so.2`, NCCL's
//! real soname (what the `nvidia-nccl-cu13` wheel ships). [`unavailable`] checks first and
//! explains; [`nccl_link_dir`] makes a private `libnccl.so` link that `gradwire launch`
//! puts on its ranks' `LD_LIBRARY_PATH`.

use cudarc::driver::CudaContext;
use std::path::PathBuf;

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
    // An interpreter on PATH whose environment was never activated (VIRTUAL_ENV unset, as
    // in a container's /opt/<env>/bin on PATH) keeps its wheels under <prefix>/lib too.
    for dir in std::env::var("PATH").unwrap_or_default().split(':').filter(|d| std::path::Path::new(d).join("python3").exists()) {
        if let Some(prefix) = std::path::Path::new(dir).parent() {
            roots.push(prefix.join("lib"));
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

/// What `gradwire info` says of usable GPUs: the CUDA version the driver supports, NCCL's
/// version, and each device's name and memory. Call only when [`unavailable`] is `None`.
pub fn describe() -> Vec<String> {
    use cudarc::driver::sys as cu;
    let mut lines = Vec::new();
    let mut driver = 0;
    // SAFETY: the driver is loadable (the caller checked); writes one int.
    if unsafe { cu::cuDriverGetVersion(&mut driver) } == cu::CUresult::CUDA_SUCCESS {
        lines.push(format!("CUDA driver supports CUDA {}.{}", driver / 1000, driver % 1000 / 10));
    }
    match cudarc::nccl::result::get_nccl_version() {
        // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
        Ok(v) => lines.push(format!("NCCL {}.{}.{}", v / 10000, v % 10000 / 100, v % 100)),
        Err(e) => lines.push(format!("NCCL version unknown: {e:?}")),
    }
    let count = CudaContext::device_count().unwrap_or(0);
    for ordinal in 0..count {
        let (mut dev, mut name, mut bytes) = (0, [0 as std::ffi::c_char; 128], 0usize);
        // SAFETY: cuDeviceGetCount succeeded, so the driver is initialised; each call writes
        // into its own out-parameter (the name NUL-terminated within its 128 bytes).
        let ok = unsafe {
            cu::cuDeviceGet(&mut dev, ordinal) == cu::CUresult::CUDA_SUCCESS
                && cu::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev) == cu::CUresult::CUDA_SUCCESS
                && cu::cuDeviceTotalMem_v2(&mut bytes, dev) == cu::CUresult::CUDA_SUCCESS
        };
        if ok {
            // SAFETY: NUL-terminated by the driver within the buffer.
            let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy();
            lines.push(format!("device {ordinal}: {name}, {} MiB", bytes >> 20));
        }
    }
    lines
}
