//! Shared-memory transport for ranks on one host.
//!
//! Every rank owns one memfd segment: a control page (pid, abort flag and reason, the
//! one-host allreduce's phase counter and call header), one single-producer/single-consumer
//! byte ring per peer for messages *into* this rank, and a staging area that peers read
//! directly during the one-host allreduce. Peers map each other's segments through
//! `/proc/<pid>/fd/<fd>`, so nothing is left behind in /dev/shm when processes die.

use super::Link;
use crate::bootstrap::StoreClient;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::mem::{page_size, Region};
use crate::sys::proc::process_gone;
use std::io::IoSlice;
use std::os::fd::RawFd;
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
const RING_HEAD: usize = 0;
const RING_TAIL: usize = 64;
const RING_DATA: usize = 128;

/// Segment layout shared by all ranks of a communicator (same settings everywhere).
#[derive(Clone, Copy, Debug)]
struct Layout {
    world: usize,
    ring: usize,
    stage: usize,
}

impl Layout {
    fn ring_at(&self, from: usize) -> usize {
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
    layout: Layout,
    segs: Vec<Option<Region>>,
    pids: Vec<u32>,
    /// Local ranks (including this one), ascending.
    pub members: Vec<usize>,
}

// SAFETY: the regions are plain shared memory; all concurrent access goes through atomics
// or through ranges whose ownership the protocol hands over with acquire/release.
unsafe impl Sync for ShmDomain {}
unsafe impl Send for ShmDomain {}

pub(crate) fn atomic_u64(base: *mut u8, at: usize) -> &'static AtomicU64 {
    // SAFETY: `at` is 8-aligned inside a live mapping that outlives every use (the domain
    // is held by an Arc for as long as links or collectives use it).
    unsafe { &*(base.add(at) as *const AtomicU64) }
}

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
        Ok(Arc::new(ShmDomain { rank, layout, segs, pids, members: members.to_vec() }))
    }

    fn base(&self, r: usize) -> *mut u8 {
        self.segs[r].as_ref().map(|s| s.as_ptr()).unwrap_or(std::ptr::null_mut())
    }

    /// Staging area of local rank `r` (peers read it directly in the one-host allreduce).
    pub fn stage(&self, r: usize) -> *mut u8 {
        // SAFETY: stage_at + stage lies within the segment.
        unsafe { self.base(r).add(self.layout.stage_at()) }
    }

    pub fn stage_len(&self) -> usize {
        self.layout.stage
    }

    /// The part of local rank `r`'s control page that the one-host collectives own:
    /// [`COLLECTIVE_AREA`] bytes, 64-aligned, zeroed at creation.
    pub(crate) fn collective_area(&self, r: usize) -> *mut u8 {
        // SAFETY: COLLECTIVE_AT + COLLECTIVE_AREA is the end of the control page.
        unsafe { self.base(r).add(COLLECTIVE_AT) }
    }

    /// Local rank `r`'s process id.
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

/// A link to one local peer through two SPSC rings: ours for receiving, the peer's for sending.
pub struct ShmLink {
    domain: Arc<ShmDomain>,
    peer: usize,
    /// Ring (peer -> us) in our segment.
    rx: *mut u8,
    /// Ring (us -> peer) in the peer's segment.
    tx: *mut u8,
    cap: usize,
}

// SAFETY: the raw pointers point into mappings owned by `domain`, which the link keeps alive.
unsafe impl Send for ShmLink {}

impl ShmLink {
    pub fn new(domain: Arc<ShmDomain>, peer: usize) -> Self {
        let me = domain.rank;
        let l = domain.layout;
        // SAFETY: ring offsets lie within both segments (same layout everywhere).
        let rx = unsafe { domain.base(me).add(l.ring_at(peer)) };
        let tx = unsafe { domain.base(peer).add(l.ring_at(me)) };
        ShmLink { cap: l.ring, domain, peer, rx, tx }
    }

    /// Bytes in a ring from its counters, one of them (`peers`) written by the peer: a
    /// value no correct peer writes is an error, never a copy outside the ring.
    fn queued(&self, head: u64, tail: u64, peers: &str) -> std::io::Result<usize> {
        match head.checked_sub(tail) {
            Some(n) if n <= self.cap as u64 => Ok(n as usize),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("rank {}'s ring {peers} is corrupt (head {head}, tail {tail}, capacity {})", self.peer, self.cap),
            )),
        }
    }
}

impl Link for ShmLink {
    fn kind(&self) -> &'static str {
        "shm"
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        let head_a = atomic_u64(self.tx, RING_HEAD);
        let head = head_a.load(Ordering::Relaxed);
        let tail = atomic_u64(self.tx, RING_TAIL).load(Ordering::Acquire);
        let mut free = self.cap - self.queued(head, tail, "tail")?;
        let mut pos = head;
        for b in bufs {
            if free == 0 {
                break;
            }
            let n = b.len().min(free);
            let at = (pos as usize) & (self.cap - 1);
            let first = n.min(self.cap - at);
            // SAFETY: [at, at+first) and [0, n-first) lie inside the ring's data area, and
            // the consumer does not read them until our Release store of head.
            unsafe {
                std::ptr::copy_nonoverlapping(b.as_ptr(), self.tx.add(RING_DATA + at), first);
                std::ptr::copy_nonoverlapping(b.as_ptr().add(first), self.tx.add(RING_DATA), n - first);
            }
            pos += n as u64;
            free -= n;
        }
        head_a.store(pos, Ordering::Release);
        Ok((pos - head) as usize)
    }

    fn try_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let tail_a = atomic_u64(self.rx, RING_TAIL);
        let tail = tail_a.load(Ordering::Relaxed);
        let head = atomic_u64(self.rx, RING_HEAD).load(Ordering::Acquire);
        let n = self.queued(head, tail, "head")?.min(buf.len());
        if n == 0 {
            return Ok(0);
        }
        let at = (tail as usize) & (self.cap - 1);
        let first = n.min(self.cap - at);
        // SAFETY: the producer published these bytes with its Release store of head and will
        // not overwrite them until our Release store of tail.
        unsafe {
            std::ptr::copy_nonoverlapping(self.rx.add(RING_DATA + at), buf.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.rx.add(RING_DATA), buf.as_mut_ptr().add(first), n - first);
        }
        tail_a.store(tail + n as u64, Ordering::Release);
        Ok(n)
    }

    fn poll_fd(&self) -> Option<RawFd> {
        None
    }

    fn peer_gone(&mut self) -> Option<String> {
        self.domain.peer_gone(self.peer)
    }

    fn notify_abort(&mut self, reason: &str) -> bool {
        self.domain.set_aborted(reason);
        true
    }

    fn shutdown(&mut self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::store::StoreServer;
    use std::time::Duration;

    /// Two ranks of one process share a domain; ring counters that no correct peer writes
    /// (head behind tail, more queued than the ring holds) fail the read or write that sees
    /// them, naming the peer, instead of copying outside the ring.
    #[test]
    fn corrupt_ring_counters_are_errors_not_copies() {
        let srv = StoreServer::start("127.0.0.1:0", "s").unwrap();
        let addr = srv.addr.to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        let domains: Vec<Arc<ShmDomain>> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..2)
                .map(|r| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        let store = StoreClient::connect(&addr, "s", deadline).unwrap();
                        ShmDomain::create("ringtest", r, 2, &[0, 1], &Config::from_env().unwrap(), &store, deadline).unwrap()
                    })
                })
                .collect();
            ranks.into_iter().map(|t| t.join().unwrap()).collect()
        });
        let (mut to_1, mut from_0) = (ShmLink::new(domains[0].clone(), 1), ShmLink::new(domains[1].clone(), 0));
        assert_eq!(to_1.try_write(&[IoSlice::new(b"hello")]).unwrap(), 5);
        let mut got = [0u8; 8];
        assert_eq!(from_0.try_read(&mut got).unwrap(), 5);
        assert_eq!(&got[..5], b"hello");

        let (cap, head) = (from_0.cap as u64, atomic_u64(from_0.rx, RING_HEAD));
        for bad in [2, 5 + cap + 1] {
            head.store(bad, Ordering::Release);
            let e = from_0.try_read(&mut got).expect_err("a corrupt head must fail the read");
            assert!(e.kind() == std::io::ErrorKind::InvalidData && e.to_string().contains("rank 0's ring head is corrupt"), "{e}");
        }
        atomic_u64(to_1.tx, RING_TAIL).store(u64::MAX, Ordering::Release);
        let e = to_1.try_write(&[IoSlice::new(b"x")]).expect_err("a corrupt tail must fail the write");
        assert!(e.to_string().contains("rank 1's ring tail is corrupt"), "{e}");
    }
}
