//! Registration: memory the caller allocated, made shared in place.

use super::limits::page_size;
use super::region::{map_at_any, memfd};
use super::registry::{registered_name, shared_regions, still_mapped, unlist, SharedRegion, NEXT_SHARED_ID};
use crate::error::{invalid, Error, Result};
use std::fs::File;
use std::os::fd::AsRawFd;

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
        unsafe { std::ptr::copy_nonoverlapping(start as *const u8, fresh, n) };
        // SAFETY: `fresh` is our own mapping of n bytes; start..stop is the caller's memory.
        unsafe { move_over(fresh, start, n, &file)? };
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

/// Moves our mapping at `from` over `to..to + len`, replacing what was mapped there in one
/// step; `from` is unmapped, also when it fails. `memfd` holds what `to` must hold
/// whichever way it goes (the copy being registered, or the registered pages): where the
/// move fails, possibly after the kernel unmapped `to`, it is mapped there instead, so
/// that the buffer's contents are never lost.
///
/// # Safety
/// `from` is a mapping of ours of `len` bytes; `to..to + len` may be replaced.
unsafe fn move_over(from: *mut u8, to: usize, len: usize, memfd: &File) -> Result<()> {
    // SAFETY: the caller's contract: `from` is ours, `to..to + len` may be replaced.
    let moved = unsafe { libc::mremap(from.cast(), len, len, libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED, to as *mut libc::c_void) };
    if moved != libc::MAP_FAILED {
        return Ok(());
    }
    let e = std::io::Error::last_os_error();
    // SAFETY: `from` is ours (the caller's contract) and nothing refers to it any more.
    unsafe { libc::munmap(from.cast(), len) };
    // SAFETY: `to..to + len` may be replaced (the caller's contract).
    let back =
        unsafe { libc::mmap(to as *mut libc::c_void, len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_FIXED, memfd.as_raw_fd(), 0) };
    let what = if back == libc::MAP_FAILED { "and mapping the memfd there failed too: the buffer is lost" } else { "the memfd is mapped there" };
    Err(Error::io(format!("mremap {len} bytes over {to:#x} ({what})"), e))
}
