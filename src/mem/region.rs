//! Page-aligned regions: anonymous, huge-page or memfd-shared, and the memfds behind them.

use super::limits::{host_memory, page_size};
use super::registry::{shared_regions, SharedRegion, NEXT_SHARED_ID};
use crate::error::{invalid, Error, Result};
use memmap2::{MmapMut, MmapOptions};
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd};

/// How a region's pages are provided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RegionKind {
    /// Private anonymous memory.
    Anonymous,
    /// Private anonymous memory on 2 MiB huge pages.
    HugePages,
    /// A memfd that other processes on this host can map (`/proc/<pid>/fd/<fd>`).
    Shared,
}

/// A page-aligned memory region. Its contents may be shared with peers or devices, so
/// access goes through raw pointers or through `&mut self`.
pub struct Region {
    map: MmapMut,
    kind: RegionKind,
    file: Option<File>,
    /// A shared region this process created: it is in [`shared_region_of`]'s registry
    /// until dropped.
    registered: bool,
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.registered {
            shared_regions().remove(&(self.as_ptr() as usize));
        }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region").field("len", &self.len()).field("kind", &self.kind).finish()
    }
}

impl Region {
    /// Private anonymous region of at least `len` bytes (rounded up to a page; zeroed).
    pub fn anonymous(len: usize) -> Result<Self> {
        let len = len.max(1).next_multiple_of(page_size());
        let map = MmapOptions::new().len(len).map_anon().map_err(|e| Error::io(format!("mmap {len} bytes"), e))?;
        Ok(Region { map, kind: RegionKind::Anonymous, file: None, registered: false })
    }

    /// Huge-page region; falls back to normal pages with a logged reason when the host has
    /// no free huge pages.
    pub fn huge(len: usize) -> Result<Self> {
        const HUGE: usize = 2 << 20;
        let huge_len = len.max(1).next_multiple_of(HUGE);
        match MmapOptions::new().len(huge_len).huge(Some(21)).map_anon() {
            Ok(map) => Ok(Region { map, kind: RegionKind::HugePages, file: None, registered: false }),
            Err(e) => {
                log::info!(
                    "huge pages unavailable for {huge_len} bytes ({e}); using normal pages \
                     (reserve some with: echo N > /proc/sys/vm/nr_hugepages)"
                );
                Self::anonymous(len)
            }
        }
    }

    /// A memfd-backed region that other processes of this host can map with
    /// [`Region::open_shared`].
    pub fn shared(name: &str, len: usize) -> Result<Self> {
        let memory = host_memory();
        if memory > 0 && len as u64 > memory {
            // The memfd would be created sparse and the first touch past memory would kill
            // the process (SIGBUS or the OOM killer) instead of failing here.
            return Err(invalid(format!("{len} bytes of shared memory is more than this host has ({memory} bytes of RAM and swap)")));
        }
        let len = len.max(1).next_multiple_of(page_size());
        let file = memfd(name, len)?;
        // SAFETY: the memfd is ours; peers that map it agree (by protocol) on who writes where.
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file) }.map_err(|e| Error::io("mmap memfd", e))?;
        let id = NEXT_SHARED_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        shared_regions().insert(map.as_ptr() as usize, SharedRegion { id, fd: file.as_raw_fd(), len, in_place: false });
        Ok(Region { map, kind: RegionKind::Shared, file: Some(file), registered: true })
    }

    /// Maps a peer's shared region, given the peer's pid and the region's fd in that process.
    pub fn open_shared(pid: u32, fd: i32, len: usize) -> Result<Self> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).map_err(|e| Error::io(format!("open peer region {path}"), e))?;
        let actual = file.metadata().map_err(|e| Error::io(format!("stat {path}"), e))?.len() as usize;
        if actual < len {
            return Err(Error::Protocol(format!("peer region {path} has {actual} bytes, expected {len}")));
        }
        // Mapping a file anyone may shrink would let them kill this rank with SIGBUS.
        if !size_sealed(&file) {
            return Err(Error::Protocol(format!("peer region {path} is not a size-sealed gradwire memfd; refusing to map it")));
        }
        // SAFETY: shared mapping of a peer's memfd; concurrent access is coordinated by the
        // shm transport's protocol (atomics with acquire/release ordering).
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file) }.map_err(|e| Error::io(format!("mmap {path}"), e))?;
        Ok(Region { map, kind: RegionKind::Shared, file: Some(file), registered: false })
    }

    /// Length in bytes (the requested size rounded up to a page, or a huge page).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the region has no bytes (never true for one this module made: they are at least a page).
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// How the pages are provided: `Anonymous` for a huge-page request that fell back.
    pub fn kind(&self) -> RegionKind {
        self.kind
    }

    /// The memfd of a shared region (what a peer needs, with our pid, to map it).
    pub fn shared_fd(&self) -> Option<i32> {
        self.file.as_ref().map(|f| f.as_raw_fd())
    }

    /// Base address. Writes through it must follow the protocol of whoever shares the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.as_ptr() as *mut u8
    }

    /// The whole region as bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    /// The whole region as mutable bytes.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// The seals every gradwire memfd carries: its size is fixed, so no process that can open
/// it (the same user's) can shrink it under the ranks that map it (a SIGBUS in every rank)
/// or grow it.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A memfd of `len` bytes named `name`, readable and writable by its owner only, its size
/// sealed.
pub(super) fn memfd(name: &str, len: usize) -> Result<File> {
    let cname = std::ffi::CString::new(name).map_err(|_| invalid("region name contains NUL"))?;
    // SAFETY: cname is a valid NUL-terminated string; flags are valid.
    let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
    let file = unsafe { File::from_raw_fd(fd) };
    // A memfd is created 0777: only its owner's processes are peers.
    file.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o600)).map_err(|e| Error::io("chmod memfd 0600", e))?;
    file.set_len(len as u64).map_err(|e| Error::io(format!("ftruncate memfd to {len}"), e))?;
    // SAFETY: F_ADD_SEALS on our own memfd.
    if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, SIZE_SEALS) } != 0 {
        return Err(Error::io("seal memfd's size", std::io::Error::last_os_error()));
    }
    Ok(file)
}

/// Whether `file` is a memfd whose size is sealed (one gradwire made).
fn size_sealed(file: &File) -> bool {
    // SAFETY: F_GET_SEALS only reads the seals of a descriptor we own.
    let seals = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) };
    seals >= 0 && seals & (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW) == libc::F_SEAL_SHRINK | libc::F_SEAL_GROW
}

/// A fresh read-write mapping of `len` bytes wherever the kernel puts it.
pub(super) fn map_at_any(len: usize, flags: libc::c_int, fd: libc::c_int) -> Result<*mut u8> {
    // SAFETY: no address is given, so nothing existing is replaced.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::io(format!("mmap {len} bytes"), std::io::Error::last_os_error()));
    }
    Ok(p.cast())
}
