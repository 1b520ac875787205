//! Memory layer: page-aligned regions (anonymous, huge-page or memfd-shared) and
//! `GradBuffer`, one flat region cut into named, aligned slots with typed views.
//!
//! A framework writes gradients straight into a slot and hands the slot to a collective,
//! so nothing is copied between the framework's tensor and the wire except where an
//! algorithm must.

use crate::dtype::{DType, Element};
use crate::error::{invalid, Error, Result};
use memmap2::{MmapMut, MmapOptions};
use std::collections::BTreeMap;
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

/// A shared region this process created, as a peer on this host maps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedRegion {
    /// Unique in this process for its lifetime: a new region that reuses a freed one's
    /// descriptor number gets a new id, so a peer never mistakes one for the other.
    pub id: u64,
    pub fd: i32,
    pub len: usize,
}

/// Shared regions this process created, by start address.
static SHARED_REGIONS: std::sync::Mutex<BTreeMap<usize, SharedRegion>> = std::sync::Mutex::new(BTreeMap::new());
static NEXT_SHARED_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

fn shared_regions() -> std::sync::MutexGuard<'static, BTreeMap<usize, SharedRegion>> {
    SHARED_REGIONS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared region (made by [`Region::shared`], e.g. through `gradwire_alloc`) that holds
/// all of `buf`, and `buf`'s offset in it: peers on this host can map it and reach `buf`
/// without a copy.
pub fn shared_region_of(buf: &[u8]) -> Option<(SharedRegion, usize)> {
    shared_region_at(buf.as_ptr() as usize, buf.len())
}

fn shared_region_at(start: usize, len: usize) -> Option<(SharedRegion, usize)> {
    let regions = shared_regions();
    let (&base, region) = regions.range(..=start).next_back()?;
    let offset = start - base;
    (offset.checked_add(len)? <= region.len).then_some((*region, offset))
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

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
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
        let len = len.max(1).next_multiple_of(page_size());
        let cname = std::ffi::CString::new(name).map_err(|_| invalid("region name contains NUL"))?;
        // SAFETY: cname is a valid NUL-terminated string; flags are valid.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::io("memfd_create", std::io::Error::last_os_error()));
        }
        // SAFETY: fd was just returned by memfd_create and is owned by nobody else.
        let file = unsafe { File::from_raw_fd(fd) };
        file.set_len(len as u64).map_err(|e| Error::io(format!("ftruncate memfd to {len}"), e))?;
        // SAFETY: the memfd is ours; peers that map it agree (by protocol) on who writes where.
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file) }.map_err(|e| Error::io("mmap memfd", e))?;
        let id = NEXT_SHARED_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        shared_regions().insert(map.as_ptr() as usize, SharedRegion { id, fd: file.as_raw_fd(), len });
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
        // SAFETY: shared mapping of a peer's memfd; concurrent access is coordinated by the
        // shm transport's protocol (atomics with acquire/release ordering).
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file) }.map_err(|e| Error::io(format!("mmap {path}"), e))?;
        Ok(Region { map, kind: RegionKind::Shared, file: Some(file), registered: false })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

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

    pub fn as_slice(&self) -> &[u8] {
        &self.map
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map
    }
}

/// A named slot inside a [`GradBuffer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    pub offset: usize,
    pub count: usize,
    pub dtype: DType,
}

impl Slot {
    pub fn bytes(&self) -> usize {
        self.count * self.dtype.size()
    }
}

/// One flat region cut into named, aligned tensor slots. Collectives can run on the whole
/// buffer (a "bucket") or on one slot; the framework writes into the slots in place.
pub struct GradBuffer {
    region: Region,
    slots: BTreeMap<String, Slot>,
    used: usize,
}

/// Alignment of every slot: a cache line, so vector kernels and NIC DMA start aligned.
pub const SLOT_ALIGN: usize = 64;

impl GradBuffer {
    /// Lays out `slots` (name, element count, dtype) in order, each aligned to
    /// [`SLOT_ALIGN`], in a region of the given kind.
    pub fn new(kind: RegionKind, slots: &[(&str, usize, DType)]) -> Result<Self> {
        let mut layout = BTreeMap::new();
        let mut off = 0usize;
        for &(name, count, dtype) in slots {
            let bytes = count.checked_mul(dtype.size()).ok_or_else(|| invalid(format!("slot {name}: size overflows")))?;
            if layout.insert(name.to_string(), Slot { offset: off, count, dtype }).is_some() {
                return Err(invalid(format!("slot {name} declared twice")));
            }
            off = off.checked_add(bytes).and_then(|o| o.checked_next_multiple_of(SLOT_ALIGN)).ok_or_else(|| invalid("buffer size overflows"))?;
        }
        let region = match kind {
            RegionKind::Anonymous => Region::anonymous(off)?,
            RegionKind::HugePages => Region::huge(off)?,
            RegionKind::Shared => Region::shared("gradwire-gradbuffer", off)?,
        };
        Ok(GradBuffer { region, slots: layout, used: off })
    }

    pub fn slot(&self, name: &str) -> Result<&Slot> {
        self.slots.get(name).ok_or_else(|| invalid(format!("no slot named {name:?}")))
    }

    pub fn slots(&self) -> impl Iterator<Item = (&str, &Slot)> {
        self.slots.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Bytes covered by the slots (the bucket a whole-buffer collective moves).
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    /// Typed read view of a slot.
    pub fn view<T: Element>(&self, name: &str) -> Result<&[T]> {
        let s = self.checked::<T>(name)?;
        // SAFETY: offset is SLOT_ALIGN-aligned inside the page-aligned region, the range
        // lies inside the region, and every bit pattern is a valid float.
        Ok(unsafe { std::slice::from_raw_parts(self.region.as_ptr().add(s.offset) as *const T, s.count) })
    }

    /// Typed write view of a slot: where the framework puts its gradient.
    pub fn view_mut<T: Element>(&mut self, name: &str) -> Result<&mut [T]> {
        let s = self.checked::<T>(name)?;
        // SAFETY: as in `view`, and `&mut self` makes the borrow exclusive.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(s.offset) as *mut T, s.count) })
    }

    fn checked<T: Element>(&self, name: &str) -> Result<Slot> {
        let s = self.slot(name)?.clone();
        if s.dtype != T::DTYPE {
            return Err(invalid(format!("slot {name:?} holds {}, not {}", s.dtype.name(), T::DTYPE.name())));
        }
        Ok(s)
    }
}

/// `RLIMIT_MEMLOCK` (soft, hard): how much memory this process may pin, which RDMA
/// registration needs.
fn memlock() -> Option<(libc::rlim_t, libc::rlim_t)> {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: r is a valid rlimit out-parameter.
    (unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } == 0).then_some((r.rlim_cur, r.rlim_max))
}

/// `RLIMIT_MEMLOCK` as "soft X, hard Y".
pub fn memlock_text() -> String {
    let f = |v: libc::rlim_t| if v == libc::RLIM_INFINITY { "unlimited".to_string() } else { format!("{} KiB", v / 1024) };
    memlock().map_or_else(|| "unknown".into(), |(soft, hard)| format!("soft {}, hard {}", f(soft), f(hard)))
}

/// True when the soft `RLIMIT_MEMLOCK` is below `bytes`.
pub fn memlock_below(bytes: u64) -> bool {
    memlock().is_some_and(|(soft, _)| soft != libc::RLIM_INFINITY && soft < bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_aligned_and_disjoint() {
        let mut g = GradBuffer::new(RegionKind::Anonymous, &[("w", 3, DType::F32), ("b", 5, DType::F64), ("h", 7, DType::F16)]).unwrap();
        for (_, s) in g.slots() {
            assert_eq!(s.offset % SLOT_ALIGN, 0);
        }
        g.view_mut::<f32>("w").unwrap().copy_from_slice(&[1.0, 2.0, 3.0]);
        g.view_mut::<f64>("b").unwrap().fill(7.5);
        assert_eq!(g.view::<f32>("w").unwrap(), &[1.0, 2.0, 3.0]);
        assert!(g.view::<f64>("w").is_err(), "dtype mismatch must be refused");
        assert!(g.view::<f32>("nope").is_err());
    }

    #[test]
    fn shared_region_is_visible_through_proc() {
        let mut r = Region::shared("t", 8192).unwrap();
        r.as_mut_slice()[100] = 42;
        let peer = Region::open_shared(std::process::id(), r.shared_fd().unwrap(), 8192).unwrap();
        assert_eq!(peer.as_slice()[100], 42);
    }

    #[test]
    fn shared_regions_are_found_by_address_until_dropped() {
        let r = Region::shared("t", 3 * page_size()).unwrap();
        let all = r.as_slice();
        let (found, off) = shared_region_of(&all[100..5000]).expect("inside a shared region");
        assert_eq!((off, found.len, Some(found.fd)), (100, r.len(), r.shared_fd()));
        assert_eq!(shared_region_of(all).map(|(_, off)| off), Some(0));
        let anon = Region::anonymous(4096).unwrap();
        assert!(shared_region_of(anon.as_slice()).is_none(), "private memory is not shared");
        assert!(shared_region_at(all.as_ptr() as usize + 4096, all.len()).is_none(), "a buffer running past the region's end");
        let (id, ptr) = (found.id, all.as_ptr());
        drop(r);
        let again = Region::shared("t", page_size()).unwrap();
        if let Some((r2, _)) = shared_region_of(again.as_slice()) {
            assert_ne!(r2.id, id, "a new region gets a new id even at the old address ({ptr:p})");
        }
    }

    #[test]
    fn huge_falls_back() {
        let r = Region::huge(4096).unwrap();
        assert!(r.len() >= 4096);
    }
}
