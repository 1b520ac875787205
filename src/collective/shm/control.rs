//! The one-host collectives' part of every rank's control page (the transport's segment
//! hands it out, `ShmDomain::collective_area`): the phase counter of the barriers, the call
//! header peers check, and where the current large allreduce's buffer lies; and the peers'
//! shared regions mapped here.

use crate::mem::Region;
use crate::sys::proc::process_gone;
use crate::transport::frame::HEADER_LEN;
use crate::transport::shm::{atomic_u64, ShmDomain, COLLECTIVE_AREA};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The phase counter of the one-host allreduce (its barriers).
const PHASE_AT: usize = 0;
/// The header of the call this rank is in (see `OneHost::announce`).
const CALL_AT: usize = 64;
/// How many times this rank has started writing its call header (odd while it writes): a
/// peer that reads the header while it changes would otherwise see half of each call.
const CALL_VERSION_AT: usize = CALL_AT + HEADER_LEN;
/// Which forms of the current large one-host call in the peers' buffers this rank can take
/// with every peer (`Reach`): bit 0, it mapped every peer's buffer; bit 1, it reached every
/// peer's buffer through cross-memory attach.
const REACH_AT: usize = 128;
/// The phase before which this rank writes nothing more into peers' buffers, set by a
/// large call in the peers' buffers that failed (a finished one says so by its phase
/// counter).
const WRITES_DONE_AT: usize = 192;
/// Where the buffer of the current large call lies in a shared region of ours
/// (`mem::shared_cover`): region id (0: it does not), descriptor, region length, the
/// offset in it of the buffer's first covered byte, and the bytes at the buffer's start
/// and end outside it (a registered buffer's partial pages), 8 bytes each.
const SHARED_AT: usize = 256;
/// The buffer's address in this process, for peers' cross-memory attach (0: this rank
/// cannot attach).
const ADDRESS_AT: usize = 304;
/// Shared regions of one peer kept mapped; its oldest goes first.
const MAX_PEER_MAPS: usize = 4;

const _: () = assert!(ADDRESS_AT + 8 <= COLLECTIVE_AREA && CALL_VERSION_AT + 8 <= REACH_AT && CALL_VERSION_AT % 8 == 0);

/// How a rank can reach every peer's buffer of the current large call.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Reach {
    /// It mapped every peer's buffer (all of them come from `gradwire_alloc`).
    pub(super) mapped: bool,
    /// It read every peer's buffer through cross-memory attach.
    pub(super) attach: bool,
}

/// A peer's shared region as this rank sees it.
struct PeerMap {
    peer: usize,
    /// The peer's region id and its descriptor there.
    id: u64,
    fd: u64,
    region: Region,
}

/// The collectives' view of the ranks' control pages on this host.
pub(super) struct Control {
    dom: Arc<ShmDomain>,
    /// Peers' shared regions mapped here, oldest first.
    peer_maps: Mutex<Vec<PeerMap>>,
}

impl Control {
    pub(super) fn new(dom: Arc<ShmDomain>) -> Self {
        Control { dom, peer_maps: Mutex::default() }
    }

    #[inline]
    fn area(&self, r: usize) -> *mut u8 {
        self.dom.collective_area(r)
    }

    /// Staging area of local rank `r` (peers read it directly in the one-host allreduce).
    #[inline]
    pub(super) fn stage(&self, r: usize) -> *mut u8 {
        self.dom.stage(r)
    }

    #[inline]
    pub(super) fn stage_len(&self) -> usize {
        self.dom.stage_len()
    }

    /// Why rank `r` is gone or aborted, if it is.
    pub(super) fn peer_gone(&self, r: usize) -> Option<String> {
        self.dom.peer_gone(r)
    }

    /// The reason rank `r` left in its page when it aborted (a shared-memory read only).
    pub(super) fn aborted_reason(&self, r: usize) -> Option<String> {
        self.dom.aborted_reason(r)
    }

    /// Marks this rank aborted with a reason every peer can read.
    pub(super) fn set_aborted(&self, reason: &str) {
        self.dom.set_aborted(reason)
    }

    /// Publishes where this rank's buffer of the current large call lies: in a shared
    /// region of ours (`gradwire_alloc`), so that peers can map it, or not; and, when this
    /// rank can attach, its address in this process, for peers' cross-memory attach (0:
    /// it cannot).
    pub(super) fn publish_buffer(&self, buf: &[u8], can_attach: bool) {
        let base = self.area(self.dom.rank);
        let shared = crate::mem::shared_cover(buf)
            .map_or([0; 6], |c| [c.region.id, c.region.fd as u64, c.region.len as u64, c.offset as u64, c.head as u64, c.tail as u64]);
        for (i, v) in shared.into_iter().enumerate() {
            atomic_u64(base, SHARED_AT + 8 * i).store(v, Ordering::Relaxed);
        }
        atomic_u64(base, ADDRESS_AT).store(if can_attach { buf.as_ptr() as u64 } else { 0 }, Ordering::Relaxed);
    }

    /// Local rank `r`'s process and the address of its published buffer there, 0 if it
    /// cannot attach (read after its phase announcement).
    pub(super) fn peer_address(&self, r: usize) -> (u32, u64) {
        (self.dom.pid(r), atomic_u64(self.area(r), ADDRESS_AT).load(Ordering::Relaxed))
    }

    /// Whether local rank `r` published a buffer in a shared region (read after its phase
    /// announcement).
    pub(super) fn buffer_is_shared(&self, r: usize) -> bool {
        self.published_cover(r)[0] != 0
    }

    /// What local rank `r` published at `SHARED_AT` (read after its phase announcement).
    fn published_cover(&self, r: usize) -> [u64; 6] {
        std::array::from_fn(|i| atomic_u64(self.area(r), SHARED_AT + 8 * i).load(Ordering::Relaxed))
    }

    /// Bytes at the start and end of local rank `r`'s published buffer that lie outside its
    /// shared region (read after its phase announcement).
    pub(super) fn uncovered(&self, r: usize) -> (usize, usize) {
        let [.., head, tail] = self.published_cover(r);
        (head as usize, tail as usize)
    }

    /// Publishes how this rank can reach every peer's buffer (before a phase announcement).
    pub(super) fn set_reach(&self, reach: Reach) {
        let bits = reach.mapped as u64 | (reach.attach as u64) << 1;
        atomic_u64(self.area(self.dom.rank), REACH_AT).store(bits, Ordering::Relaxed);
    }

    /// How local rank `r` can reach every peer's buffer (read after its phase announcement).
    pub(super) fn reach(&self, r: usize) -> Reach {
        let bits = atomic_u64(self.area(r), REACH_AT).load(Ordering::Relaxed);
        Reach { mapped: bits & 1 != 0, attach: bits & 2 != 0 }
    }

    /// Announces that this rank writes nothing more into peers' buffers before `phase`.
    pub(super) fn set_writes_done(&self, phase: u64) {
        atomic_u64(self.area(self.dom.rank), WRITES_DONE_AT).store(phase, Ordering::Release);
    }

    /// Whether local rank `r` writes nothing more into peers' buffers before `phase`: it
    /// reached it, said so, or exited. (Its abort flag is no answer: another thread of its
    /// process may set that while its collective is still writing.)
    pub(super) fn writes_done(&self, r: usize, phase: u64) -> bool {
        let base = self.area(r);
        atomic_u64(base, PHASE_AT).load(Ordering::Acquire) >= phase
            || atomic_u64(base, WRITES_DONE_AT).load(Ordering::Acquire) >= phase
            || process_gone(self.dom.pid(r)).is_some()
    }

    /// Bytes `from..from + len` of local rank `r`'s published buffer (counted from its start,
    /// and lying in its shared region) mapped into this process, when we can map that
    /// region (read after its phase announcement). The mapping stays until the peer
    /// publishes another region under the same descriptor (it closed this one) or
    /// `MAX_PEER_MAPS` newer ones of the same peer push it out
    /// (so looking up another peer never unmaps what an earlier lookup returned).
    pub(super) fn peer_buffer(&self, r: usize, from: usize, len: usize) -> Option<*mut u8> {
        let [id, fd, region_len, covered_at, head, _] = self.published_cover(r);
        let off = (from as u64).checked_sub(head).and_then(|skip| covered_at.checked_add(skip));
        let off = off.filter(|o| id != 0 && o.checked_add(len as u64).is_some_and(|end| end <= region_len))?;
        let mut maps = self.peer_maps.lock().unwrap_or_else(|e| e.into_inner());
        let at = match maps.iter().position(|m| m.peer == r && m.id == id) {
            // Most recently used last: eviction takes the peer's least recently used.
            Some(i) => {
                let hit = maps.remove(i);
                maps.push(hit);
                maps.len() - 1
            }
            None => {
                maps.retain(|m| !(m.peer == r && m.fd == fd));
                let of_peer: Vec<usize> = (0..maps.len()).filter(|&i| maps[i].peer == r).collect();
                if of_peer.len() >= MAX_PEER_MAPS {
                    maps.remove(of_peer[0]);
                }
                // A failure is not kept: it may be passing (a descriptor limit), and the
                // next call tries again.
                let region = Region::open_shared(self.dom.pid(r), fd as i32, region_len as usize)
                    .inspect_err(|e| {
                        log::info!("rank {}: cannot map rank {r}'s shared buffer ({e}); this allreduce stages through shared memory", self.dom.rank)
                    })
                    .ok()?;
                log::debug!("rank {}: mapped rank {r}'s shared buffer (region {id}, {region_len} bytes)", self.dom.rank);
                maps.push(PeerMap { peer: r, id, fd, region });
                maps.len() - 1
            }
        };
        // SAFETY: off + len lies inside the mapping (checked above; open_shared checked the
        // region's length), which lives until it leaves `peer_maps`, after this call.
        Some(unsafe { maps[at].region.as_ptr().add(off as usize) })
    }

    /// The one-host allreduce's phase counter of rank `r`.
    #[inline]
    pub(super) fn phase(&self, r: usize) -> &AtomicU64 {
        atomic_u64(self.area(r), PHASE_AT)
    }

    /// Publishes this rank's current call header (read by peers to detect mismatches).
    pub(super) fn set_call(&self, header: &[u8; HEADER_LEN]) {
        let version = atomic_u64(self.area(self.dom.rank), CALL_VERSION_AT);
        let v = version.load(Ordering::Relaxed);
        version.store(v + 1, Ordering::Relaxed);
        // The odd version is visible before any byte of the new header.
        std::sync::atomic::fence(Ordering::Release);
        // SAFETY: CALL_AT..+HEADER_LEN lies in our own control page; peers read it only
        // through `call_of`, which discards a read that overlapped this write.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), self.area(self.dom.rank).add(CALL_AT), header.len()) };
        version.store(v + 2, Ordering::Release);
    }

    /// Reads rank `r`'s published call header; `None` while `r` is writing it (a read that
    /// overlapped the write is discarded, never half of one call and half of another).
    pub(super) fn call_of(&self, r: usize) -> Option<[u8; HEADER_LEN]> {
        let version = atomic_u64(self.area(r), CALL_VERSION_AT);
        for _ in 0..64 {
            let before = version.load(Ordering::Acquire);
            if before % 2 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let mut h = [0u8; HEADER_LEN];
            // SAFETY: reads our peer's control page (mapped for the domain's life); a
            // concurrent write only makes the read useless, which the version tells.
            unsafe { std::ptr::copy_nonoverlapping(self.area(r).add(CALL_AT), h.as_mut_ptr(), h.len()) };
            // The header's bytes are read before the version is read again.
            std::sync::atomic::fence(Ordering::Acquire);
            if version.load(Ordering::Relaxed) == before {
                return Some(h);
            }
        }
        None
    }
}
