//! The shared segments of the ranks on one host. Every rank owns one memfd segment: a
//! control page (pid, abort flag and reason, and an area the one-host collectives own), one
//! single-producer/single-consumer byte ring per peer for messages *into* this rank, and a staging area that peers read
//! directly during the one-host allreduce. Peers map each other's segments through
//! `/proc/<pid>/fd/<fd>`, so nothing is left behind in /dev/shm when processes die.

use crate::bootstrap::StoreClient;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::mem::{page_size, Region};
use crate::sys::proc::process_gone;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

const CONTROL: usize = 4096;
const PID_AT: usize = 0;
const ABORT_AT: usize = 64;
const REASON_LEN_AT: usize = 68;
const REASON_AT: usize = 72;
const REASON_MAX: usize = 1024;
/// Where the part of the control page that the one-host collectives own begins (see
/// `collective::shm::control`); it runs to the end of the page.
const COLLECTIVE_AT: usize = 1152;
/// Bytes of the collectives' part of a control page.
pub(crate) const COLLECTIVE_AREA: usize = CONTROL - COLLECTIVE_AT;
pub(super) const RING_HEAD: usize = 0;
pub(super) const RING_TAIL: usize = 64;
pub(super) const RING_DATA: usize = 128;

/// Segment layout shared by all ranks of a communicator (same settings everywhere).
#[derive(Clone, Copy, Debug)]
pub(super) struct Layout {
    world: usize,
    pub(super) ring: usize,
    stage: usize,
}

impl Layout {
    pub(super) fn ring_at(&self, from: usize) -> usize {
        CONTROL + from * (RING_DATA + self.ring)
    }
    fn stage_at(&self) -> usize {
        (CONTROL + self.world * (RING_DATA + self.ring)).next_multiple_of(page_size())
    }
    fn len(&self) -> usize {
        self.stage_at() + self.stage
    }
}

/// The segments of all ranks on this host that belong to one communicator.
pub struct ShmDomain {
    pub rank: usize,
    pub(super) layout: Layout,
    segs: Vec<Option<Region>>,
    pids: Vec<u32>,
}

// SAFETY: the regions are plain shared memory; all concurrent access goes through atomics
// or through ranges whose ownership the protocol hands over with acquire/release.
unsafe impl Sync for ShmDomain {}
// SAFETY: as for Sync.
unsafe impl Send for ShmDomain {}

#[inline]
pub(crate) fn atomic_u64(base: *mut u8, at: usize) -> &'static AtomicU64 {
    // SAFETY: `at` is 8-aligned inside a live mapping that outlives every use (the domain
    // is held by an Arc for as long as links or collectives use it).
    unsafe { &*(base.add(at) as *const AtomicU64) }
}

#[inline]
pub(crate) fn atomic_u32(base: *mut u8, at: usize) -> &'static AtomicU32 {
    // SAFETY: as for atomic_u64.
    unsafe { &*(base.add(at) as *const AtomicU32) }
}

impl ShmDomain {
    /// Creates this rank's segment, publishes it, and maps every other local member's.
    pub fn create(prefix: &str, rank: usize, world: usize, members: &[usize], cfg: &Config, store: &StoreClient, deadline: Instant) -> Result<Arc<Self>> {
        let started = Instant::now();
        let layout = Layout { world, ring: cfg.shm_ring_bytes, stage: cfg.shm_stage_bytes };
        let own = Region::shared(&format!("gradwire-{rank}"), layout.len())?;
        let pid = std::process::id();
        atomic_u32(own.as_ptr(), PID_AT).store(pid, Ordering::Release);
        let fd = own.shared_fd().ok_or_else(|| Error::Protocol("shared region without fd".into()))?;
        store.set(&format!("{prefix}/shm/{rank}"), format!("{pid} {fd} {}", layout.len()).as_bytes())?;
        let mut segs: Vec<Option<Region>> = (0..world).map(|_| None).collect();
        let mut pids = vec![0u32; world];
        for &p in members {
            if p == rank {
                continue;
            }
            let v = store.get(&format!("{prefix}/shm/{p}"), deadline)?.ok_or_else(|| Error::Timeout {
                rank,
                peer: p,
                op: "shared-memory setup (peer never published its segment)".into(),
                waited_ms: started.elapsed().as_millis() as u64,
            })?;
            let text = String::from_utf8_lossy(&v).into_owned();
            let f: Vec<u64> = text.split(' ').filter_map(|x| x.parse().ok()).collect();
            let [ppid, pfd, plen] = f[..] else {
                return Err(Error::Protocol(format!("rank {p} published a malformed segment handle {text:?}")));
            };
            if plen as usize != layout.len() {
                return Err(Error::Config(format!(
                    "rank {p} uses a shared segment of {plen} bytes, this rank {}: GRADWIRE_SHM_* settings differ between ranks",
                    layout.len()
                )));
            }
            segs[p] = Some(Region::open_shared(ppid as u32, pfd as i32, plen as usize)?);
            pids[p] = ppid as u32;
        }
        pids[rank] = pid;
        segs[rank] = Some(own);
        Ok(Arc::new(ShmDomain { rank, layout, segs, pids }))
    }

    #[inline]
    pub(super) fn base(&self, r: usize) -> *mut u8 {
        self.segs[r].as_ref().map(|s| s.as_ptr()).unwrap_or(std::ptr::null_mut())
    }

    /// Staging area of local rank `r` (peers read it directly in the one-host allreduce).
    #[inline]
    pub fn stage(&self, r: usize) -> *mut u8 {
        // SAFETY: stage_at + stage lies within the segment.
        unsafe { self.base(r).add(self.layout.stage_at()) }
    }

    #[inline]
    pub fn stage_len(&self) -> usize {
        self.layout.stage
    }

    /// The part of local rank `r`'s control page that the one-host collectives own:
    /// [`COLLECTIVE_AREA`] bytes, 64-aligned, zeroed at creation.
    #[inline]
    pub(crate) fn collective_area(&self, r: usize) -> *mut u8 {
        // SAFETY: COLLECTIVE_AT + COLLECTIVE_AREA is the end of the control page.
        unsafe { self.base(r).add(COLLECTIVE_AT) }
    }

    /// Local rank `r`'s process id.
    #[inline]
    pub(crate) fn pid(&self, r: usize) -> u32 {
        self.pids[r]
    }

    /// Why rank `r` is gone or aborted, if it is.
    pub fn peer_gone(&self, r: usize) -> Option<String> {
        // A peer writes its reason before it exits: if it exited between our two reads, the
        // second look at the flag still finds the reason.
        self.aborted_reason(r).or_else(|| process_gone(self.pids[r]).map(|gone| self.aborted_reason(r).unwrap_or(gone)))
    }

    /// The reason rank `r` left in its page when it aborted (a shared-memory read only).
    pub fn aborted_reason(&self, r: usize) -> Option<String> {
        let base = self.base(r);
        if atomic_u32(base, ABORT_AT).load(Ordering::Acquire) != 0 {
            let len = (atomic_u32(base, REASON_LEN_AT).load(Ordering::Relaxed) as usize).min(REASON_MAX);
            // SAFETY: reason bytes were written before the Release store of the flag.
            let bytes = unsafe { std::slice::from_raw_parts(base.add(REASON_AT), len) };
            return Some(format!("it aborted: {}", String::from_utf8_lossy(bytes)));
        }
        None
    }

    /// Marks this rank aborted with a reason every peer can read.
    pub fn set_aborted(&self, reason: &str) {
        let base = self.base(self.rank);
        let flag = atomic_u32(base, ABORT_AT);
        if flag.load(Ordering::Acquire) != 0 {
            return;
        }
        let b = reason.as_bytes();
        let n = b.len().min(REASON_MAX);
        // SAFETY: our own control page; published by the Release store below.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), base.add(REASON_AT), n) };
        atomic_u32(base, REASON_LEN_AT).store(n as u32, Ordering::Relaxed);
        flag.store(1, Ordering::Release);
    }
}
