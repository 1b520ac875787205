//! The shared regions this process created, by address: how a buffer handed to a
//! collective is found to lie in one that peers can map.

use super::limits::page_size;
use std::collections::BTreeMap;

/// A shared region this process created, as a peer on this host maps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedRegion {
    /// Unique in this process for its lifetime: a new region that reuses a freed one's
    /// descriptor number gets a new id, so a peer never mistakes one for the other.
    pub id: u64,
    /// The memfd's descriptor number in this process (a peer opens `/proc/<pid>/fd/<fd>`).
    pub fd: i32,
    /// Length of the mapping in bytes (whole pages).
    pub len: usize,
    /// Made by [`Registration::new`] over the caller's memory, which the caller may unmap
    /// behind our back (freeing it without deregistering): checked before each use.
    pub(super) in_place: bool,
}

/// Where a buffer lies in a shared region of this process: all of it, or all but less
/// than a page at either end (a registered buffer that does not start or end on a page
/// boundary; see [`Registration`](super::Registration)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedCover {
    /// The region that holds the buffer.
    pub region: SharedRegion,
    /// Offset in the region of the buffer's first covered byte.
    pub offset: usize,
    /// Bytes at the buffer's start and end outside the region.
    pub head: usize,
    /// Bytes at the buffer's end outside the region.
    pub tail: usize,
}

/// Shared regions this process created, by start address.
static SHARED_REGIONS: std::sync::Mutex<BTreeMap<usize, SharedRegion>> = std::sync::Mutex::new(BTreeMap::new());
pub(super) static NEXT_SHARED_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

pub(super) fn shared_regions() -> std::sync::MutexGuard<'static, BTreeMap<usize, SharedRegion>> {
    SHARED_REGIONS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The shared region (made by [`Region::shared`](super::Region::shared), e.g. through `gradwire_alloc`) that holds
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

pub(super) fn shared_cover_at(start: usize, len: usize) -> Option<SharedCover> {
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
pub(super) fn still_mapped(base: usize, region: SharedRegion) -> bool {
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

pub(super) fn registered_name(id: u64) -> String {
    format!("gradwire-registered-{id}")
}

/// Removes a shared region from the registry and returns it, unless another one has taken
/// its address since (a stale registration removed by [`shared_cover`], then a new one
/// there).
pub(super) fn unlist(base: usize, id: u64) -> Option<SharedRegion> {
    let mut regions = shared_regions();
    regions.get(&base).is_some_and(|r| r.id == id).then(|| regions.remove(&base)).flatten()
}
