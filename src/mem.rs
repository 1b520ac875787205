//! Memory layer: page-aligned regions (anonymous, huge-page or memfd-shared) and
//! `GradBuffer`, one flat region cut into named, aligned slots with typed views.
//!
//! A framework writes gradients straight into a slot and hands the slot to a collective,
//! so nothing is copied between the framework's tensor and the wire except where an
//! algorithm must. Memory the framework allocated itself can be made shared in place
//! ([`Registration`]), so that it too needs no copy between ranks of a host.

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
    /// Made by [`Registration::new`] over the caller's memory, which the caller may unmap
    /// behind our back (freeing it without deregistering): checked before each use.
    in_place: bool,
}

/// Where a buffer lies in a shared region of this process: all of it, or all but less
/// than a page at either end (a registered buffer that does not start or end on a page
/// boundary; see [`Registration`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedCover {
    pub region: SharedRegion,
    /// Offset in the region of the buffer's first covered byte.
    pub offset: usize,
    /// Bytes at the buffer's start and end outside the region.
    pub head: usize,
    pub tail: usize,
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
    shared_cover(buf).filter(|c| c.head == 0 && c.tail == 0).map(|c| (c.region, c.offset))
}

/// The shared region that holds `buf`, all of it or all but less than a page at either end
/// (see [`SharedCover`]).
pub fn shared_cover(buf: &[u8]) -> Option<SharedCover> {
    shared_cover_at(buf.as_ptr() as usize, buf.len())
}

fn shared_cover_at(start: usize, len: usize) -> Option<SharedCover> {
    let end = start.checked_add(len)?;
    let mut regions = shared_regions();
    let (&base, &region) = regions.range(..end).next_back()?;
    let (first, last) = (start.max(base), end.min(base + region.len));
    let (head, tail) = (first - start, end.checked_sub(last)?);
    if first >= last || head >= page_size() || tail >= page_size() {
        return None;
    }
    if region.in_place && !still_mapped(base, region) {
        log::warn!(
            "the registered buffer at {base:#x} ({} bytes) is no longer mapped there (freed or unmapped without gradwire_deregister?): \
             it is treated as private memory from now on",
            region.len
        );
        regions.remove(&base);
        return None;
    }
    Some(SharedCover { region, offset: first - base, head, tail })
}

/// Whether `base..base + region.len` is still the one mapping of `region`'s memfd that
/// [`Registration::new`] made: the kernel names a mapping's file, and the name holds the
/// region's id. A few microseconds, once per large call.
fn still_mapped(base: usize, region: SharedRegion) -> bool {
    let link = format!("/proc/self/map_files/{base:x}-{:x}", base + region.len);
    match std::fs::read_link(&link) {
        Ok(target) => target.to_string_lossy().trim_end_matches(" (deleted)") == format!("/memfd:{}", registered_name(region.id)),
        // Not one mapping from base to its end any more.
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => {
            log::warn!("cannot check that {link} is still the registered buffer ({e})");
            false
        }
    }
}

fn registered_name(id: u64) -> String {
    format!("gradwire-registered-{id}")
}

/// Removes a shared region from the registry and returns it, unless another one has taken
/// its address since (a stale registration removed by [`shared_cover`], then a new one
/// there).
fn unlist(base: usize, id: u64) -> Option<SharedRegion> {
    let mut regions = shared_regions();
    regions.get(&base).is_some_and(|r| r.id == id).then(|| regions.remove(&base)).flatten()
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

/// RAM plus swap of this host in bytes (0 if unknown).
pub fn host_memory() -> u64 {
    // SAFETY: a zeroed sysinfo is valid, and sysinfo writes only into it.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return 0;
    }
    (info.totalram as u64).saturating_add(info.totalswap as u64).saturating_mul(u64::from(info.mem_unit))
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

/// Memory the caller allocated (a framework's tensor, `malloc`), made shared in place so
/// that the ranks of a host reach it without a copy, as if it came from `gradwire_alloc`
/// (the C ABI's `gradwire_register`; the idea of `ncclCommRegister`, which registers a
/// buffer once for many collectives). The whole pages inside the buffer are copied into a
/// memfd, which is then mapped over them at the same address: the contents and the
/// address stay, the pages become shared. Less than a page at either end stays private
/// (it may hold other data, which another thread could write meanwhile); the one-host
/// allreduce has every rank reduce those few bytes itself, from copies all ranks stage.
/// Dropping it puts private pages back, with the contents of the moment.
///
/// The caller's side, as with `ncclCommRegister`: the buffer stays allocated until the
/// registration is dropped, and nothing else writes it while it is registered or dropped.
/// A buffer freed without that is noticed (the mapping is no longer the memfd's) and
/// treated as private from then on. A child forked meanwhile shares these pages instead of
/// getting a copy.
pub struct Registration {
    /// The whole pages inside the buffer, now the memfd's.
    start: usize,
    len: usize,
    id: u64,
    /// None once forgotten.
    file: Option<File>,
}

impl Registration {
    /// Makes the whole pages of `ptr..ptr + len` shared in place. Fails, changing nothing,
    /// when the buffer holds no whole page, overlaps shared memory of ours already, or
    /// lies in anything but private anonymous read-write memory (a file's, a shared or a
    /// huge-page mapping would lose what it is).
    ///
    /// # Safety
    /// `ptr..ptr + len` is memory of this process that the caller may read and write, and
    /// no other thread writes it during this call. It must not be pinned for a device's
    /// DMA (`ibv_reg_mr`, `cudaHostRegister`): the device would keep the old pages.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Result<Self> {
        let page = page_size();
        let (addr, end) = (ptr as usize, (ptr as usize).checked_add(len).ok_or_else(|| invalid("buffer wraps around the address space"))?);
        let (start, stop) = (addr.next_multiple_of(page), end / page * page);
        if stop <= start {
            return Err(invalid(format!("{len} bytes at {ptr:p} hold no whole page: nothing to register (a buffer this small gains nothing from it)")));
        }
        let n = stop - start;
        // Held through the copy: a registration is rare, and nobody may see the region
        // before its pages are in place.
        let mut regions = shared_regions();
        if let Some((&base, &r)) = regions.range(..stop).next_back() {
            if base + r.len > start {
                // A registration freed without deregistering, whose pages came back to the
                // caller: forget it.
                if !r.in_place || still_mapped(base, r) {
                    return Err(invalid(format!("{len} bytes at {ptr:p} overlap shared memory of gradwire's already (registered, or from gradwire_alloc)")));
                }
                regions.remove(&base);
            }
        }
        private_anonymous(start, stop).map_err(|why| invalid(format!("{len} bytes at {ptr:p}: {why}; only private anonymous memory can be registered")))?;
        let id = NEXT_SHARED_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let file = memfd(&registered_name(id), n)?;
        // Fill a mapping of the memfd elsewhere, then move it over the pages: the address
        // never goes unmapped, so other threads reading the buffer's neighbours never fault.
        let fresh = map_at_any(n, libc::MAP_SHARED, file.as_raw_fd())?;
        // SAFETY: both ranges are n bytes, mapped and disjoint; the caller lets us read ours.
        std::ptr::copy_nonoverlapping(start as *const u8, fresh, n);
        // SAFETY: `fresh` is our own mapping of n bytes; start..stop is the caller's memory.
        move_over(fresh, start, n, &file)?;
        regions.insert(start, SharedRegion { id, fd: file.as_raw_fd(), len: n, in_place: true });
        log::debug!("registered {len} bytes at {ptr:p}: {n} bytes shared in place from {start:#x} (region {id})");
        Ok(Registration { start, len: n, id, file: Some(file) })
    }

    /// Whether the buffer is still registered: not freed or unmapped without deregistering
    /// (after which its address may hold other memory, even a new registration).
    pub fn is_live(&self) -> bool {
        let region = shared_regions().get(&self.start).copied().filter(|r| r.id == self.id);
        region.is_some_and(|r| still_mapped(self.start, r))
    }

    /// The shared part: first address and length (whole pages).
    pub fn shared_range(&self) -> (usize, usize) {
        (self.start, self.len)
    }

    /// Ends the registration without giving private pages back: the pages stay this
    /// process's shared memory, contents kept (what `gradwire_finalize` does, which cannot
    /// know whether the buffer is still the caller's or was freed and now holds other
    /// objects that other threads write).
    pub fn forget(mut self) {
        unlist(self.start, self.id);
        drop(self.file.take());
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let Some(file) = self.file.take() else { return };
        // Out of the registry first, so that no allreduce takes the pages for shared ones
        // while they are being made private.
        let region = unlist(self.start, self.id);
        // Put private pages back only where our mapping still is: a buffer freed without
        // deregistering may be someone else's memory now.
        if region.is_some_and(|r| still_mapped(self.start, r)) {
            let restored = map_at_any(self.len, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1).and_then(|private| {
                // SAFETY: disjoint mappings of len bytes each; the caller writes nothing
                // meanwhile (the contract above).
                unsafe {
                    std::ptr::copy_nonoverlapping(self.start as *const u8, private, self.len);
                    move_over(private, self.start, self.len, &file)
                }
            });
            if let Err(e) = restored {
                log::error!("deregistering {:#x} ({} bytes): could not put private pages back ({e}); the buffer stays shared memory", self.start, self.len);
            }
        }
    }
}

/// Whether every page of `start..stop` is private anonymous read-write memory (the heap,
/// `malloc`'s or a framework's own mappings), from `/proc/self/maps`; else why not.
fn private_anonymous(start: usize, stop: usize) -> std::result::Result<(), String> {
    let maps = std::fs::read_to_string("/proc/self/maps").map_err(|e| format!("cannot read /proc/self/maps ({e})"))?;
    let mut covered = start;
    for line in maps.lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms), Some(_), Some(_), Some(inode)) = (f.next(), f.next(), f.next(), f.next(), f.next()) else { continue };
        let path = f.collect::<Vec<_>>().join(" ");
        let Some((lo, hi)) = range.split_once('-').and_then(|(a, b)| Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))) else {
            continue;
        };
        if hi <= start || lo >= stop {
            continue;
        }
        if lo > covered {
            return Err(format!("{covered:#x}..{lo:#x} is not mapped"));
        }
        if !perms.starts_with("rw") || !perms.ends_with('p') || inode != "0" || !(path.is_empty() || path == "[heap]") {
            return Err(format!("it lies in a mapping {perms} {path:?} (inode {inode})"));
        }
        covered = hi;
    }
    if covered < stop {
        return Err(format!("{covered:#x}..{stop:#x} is not mapped"));
    }
    Ok(())
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration").field("start", &format_args!("{:#x}", self.start)).field("len", &self.len).field("id", &self.id).finish()
    }
}

/// The seals every gradwire memfd carries: its size is fixed, so no process that can open
/// it (the same user's) can shrink it under the ranks that map it (a SIGBUS in every rank)
/// or grow it.
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A memfd of `len` bytes named `name`, readable and writable by its owner only, its size
/// sealed.
fn memfd(name: &str, len: usize) -> Result<File> {
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
fn map_at_any(len: usize, flags: libc::c_int, fd: libc::c_int) -> Result<*mut u8> {
    // SAFETY: no address is given, so nothing existing is replaced.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(Error::io(format!("mmap {len} bytes"), std::io::Error::last_os_error()));
    }
    Ok(p.cast())
}

/// Moves our mapping at `from` over `to..to + len`, replacing what was mapped there in one
/// step; `from` is unmapped, also when it fails. `memfd` holds what `to` must hold
/// whichever way it goes (the copy being registered, or the registered pages): where the
/// move fails, possibly after the kernel unmapped `to`, it is mapped there instead, so
/// that the buffer's contents are never lost.
///
/// # Safety
/// `from` is a mapping of ours of `len` bytes; `to..to + len` may be replaced.
unsafe fn move_over(from: *mut u8, to: usize, len: usize, memfd: &File) -> Result<()> {
    let moved = libc::mremap(from.cast(), len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, to as *mut libc::c_void);
    if moved != libc::MAP_FAILED {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    libc::munmap(from.cast(), len);
    let back = libc::mmap(to as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED, memfd.as_raw_fd(), 0);
    let what = if back == libc::MAP_FAILED { "and mapping the memfd there failed too: the buffer is lost" } else { "the memfd is mapped there" };
    Err(Error::io(format!("mremap {len} bytes over {to:#x} ({what})"), e))
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

    /// A shared region is the owner's alone (0600) and its size is sealed: nobody can shrink
    /// it under the ranks that map it (an ftruncate used to kill every rank with SIGBUS),
    /// and a peer refuses to map a file that is not sealed so.
    #[test]
    fn shared_regions_are_private_to_their_user_and_cannot_shrink() {
        use std::os::unix::fs::PermissionsExt;
        let r = Region::shared("t", 8192).unwrap();
        let path = format!("/proc/{}/fd/{}", std::process::id(), r.shared_fd().unwrap());
        let tamper = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        assert_eq!(tamper.metadata().unwrap().permissions().mode() & 0o777, 0o600);
        let shrink = tamper.set_len(0).unwrap_err();
        assert_eq!(shrink.raw_os_error(), Some(libc::EPERM), "{shrink}");
        assert!(tamper.set_len(1 << 20).is_err(), "growing must be refused too");
        assert_eq!(tamper.metadata().unwrap().len(), 8192);
        // A plain memfd (no seals) offered as a peer region.
        // SAFETY: a valid name and flags.
        let fd = unsafe { libc::memfd_create(c"plain".as_ptr(), libc::MFD_CLOEXEC) };
        // SAFETY: the fd was just made and is owned by nobody else.
        let plain = unsafe { File::from_raw_fd(fd) };
        plain.set_len(8192).unwrap();
        let e = Region::open_shared(std::process::id(), fd, 8192).expect_err("an unsealed file must be refused").to_string();
        assert!(e.contains("not a size-sealed gradwire memfd"), "{e}");
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
        assert!(shared_cover_at(all.as_ptr() as usize + page_size(), all.len()).is_none(), "a buffer running a page past the region's end");
        let (id, ptr) = (found.id, all.as_ptr());
        drop(r);
        let again = Region::shared("t", page_size()).unwrap();
        if let Some((r2, _)) = shared_region_of(again.as_slice()) {
            assert_ne!(r2.id, id, "a new region gets a new id even at the old address ({ptr:p})");
        }
    }

    /// A buffer that starts and ends inside pages, its data not zero (a `Vec`, as a
    /// framework's tensor would be).
    fn unaligned_buffer(pages: usize) -> (Vec<u8>, std::ops::Range<usize>) {
        let p = page_size();
        let mut v: Vec<u8> = (0..(pages + 2) * p).map(|i| (i * 7 % 251) as u8).collect();
        let skip = p - (v.as_ptr() as usize % p) + 100;
        let range = skip..skip + pages * p - 300;
        v[range.start - 1] = 1;
        (v, range)
    }

    #[test]
    fn registration_shares_the_whole_pages_in_place_and_gives_them_back() {
        let (mut v, range) = unaligned_buffer(5);
        let before = v.clone();
        let buf = &mut v[range.clone()];
        let (ptr, len) = (buf.as_mut_ptr(), buf.len());
        // SAFETY: the Vec's memory, which nothing else touches during the test.
        let reg = unsafe { Registration::new(ptr, len) }.unwrap();
        assert_eq!(v, before, "registering keeps every byte, in the buffer and around it");
        let cover = shared_cover(&v[range.clone()]).expect("a registered buffer is covered");
        let (start, n) = reg.shared_range();
        assert_eq!((cover.head, cover.tail, cover.offset), (start - (v.as_ptr() as usize + range.start), v.as_ptr() as usize + range.end - start - n, 0));
        assert!(cover.head < page_size() && cover.tail < page_size() && n == 3 * page_size(), "{cover:?}, {n}");
        assert!(shared_region_of(&v[range.clone()]).is_none(), "the ends are not in the region");
        // A peer maps the memfd and sees and changes what the buffer holds.
        let mut peer = Region::open_shared(std::process::id(), cover.region.fd, cover.region.len).unwrap();
        let at = start - v.as_ptr() as usize;
        assert_eq!(&peer.as_slice()[..64], &v[at..at + 64]);
        peer.as_mut_slice()[10] ^= 0xff;
        assert_eq!(v[at + 10], before[at + 10] ^ 0xff, "the buffer is the shared pages");
        drop(reg);
        assert!(shared_cover(&v[range.clone()]).is_none(), "deregistered");
        assert_eq!(v[at + 10], before[at + 10] ^ 0xff, "deregistering keeps the contents");
        peer.as_mut_slice()[11] ^= 0xff;
        assert_eq!(v[at + 11], before[at + 11], "the pages are private again");
    }

    #[test]
    fn registration_refuses_small_and_overlapping_buffers() {
        let (mut v, range) = unaligned_buffer(5);
        let p = page_size();
        let buf = v[range.clone()].as_mut_ptr();
        // SAFETY (all): the Vec's memory, which nothing else touches during the test.
        let small = unsafe { Registration::new(buf, p) }.unwrap_err().to_string();
        assert!(small.contains("no whole page"), "{small}");
        let reg = unsafe { Registration::new(buf, range.len()) }.unwrap();
        let twice = unsafe { Registration::new(buf.add(p), range.len() - p) }.unwrap_err().to_string();
        assert!(twice.contains("overlap"), "{twice}");
        drop(reg);
        drop(unsafe { Registration::new(buf, range.len()) }.expect("free again after deregistering"));
    }

    #[test]
    fn a_registered_buffer_freed_without_deregistering_is_private_from_then_on() {
        let n = 8 * page_size();
        let region = Region::anonymous(n).unwrap();
        // SAFETY: our own mapping, which nothing else touches.
        let reg = unsafe { Registration::new(region.as_ptr(), n) }.unwrap();
        let (start, len) = reg.shared_range();
        assert!(shared_cover_at(start, len).is_some());
        drop(region);
        // Someone else's memory comes to lie there: another memfd's, so that we can see
        // whether that mapping stays.
        let other = memfd("someone-else", n).unwrap();
        // SAFETY: MAP_FIXED_NOREPLACE replaces nothing (start..start+n was just unmapped).
        let at = unsafe {
            libc::mmap(start as *mut libc::c_void, n, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED_NOREPLACE, other.as_raw_fd(), 0)
        };
        assert_eq!(at as usize, start, "the range was taken meanwhile");
        // SAFETY (all writes and reads below): start..start+n is that mapping.
        unsafe { *(start as *mut u8) = 0xab };
        drop(reg);
        // SAFETY: a second mapping of our own memfd.
        let mut view = unsafe { MmapOptions::new().len(n).map_mut(&other) }.unwrap();
        view[1] = 0xcd;
        assert_eq!(unsafe { (*(start as *const u8), *((start + 1) as *const u8)) }, (0xab, 0xcd), "deregistering replaced someone else's mapping");
        assert!(shared_cover_at(start, len).is_none(), "the mapping is not ours: not shared any more");
        // SAFETY: our mapping at start.
        unsafe { libc::munmap(start as *mut libc::c_void, n) };
    }

    #[test]
    fn only_private_anonymous_memory_is_registered() {
        let n = 4 * page_size();
        let file = memfd("a-file", n).unwrap();
        // SAFETY (all): mappings of our own memfd, which nothing else touches.
        let mut shared = unsafe { MmapOptions::new().len(n).map_mut(&file) }.unwrap();
        let mut private = unsafe { MmapOptions::new().len(n).map_copy(&file) }.unwrap();
        for map in [&mut shared, &mut private] {
            let e = unsafe { Registration::new(map.as_mut_ptr(), n) }.unwrap_err().to_string();
            assert!(e.contains("only private anonymous memory") && e.contains("memfd:a-file"), "{e}");
        }
        let alloc = Region::shared("t", n).unwrap();
        let e = unsafe { Registration::new(alloc.as_ptr(), n) }.unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
    }

    #[test]
    fn huge_falls_back() {
        let r = Region::huge(4096).unwrap();
        assert!(r.len() >= 4096);
    }
}
