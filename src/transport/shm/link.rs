//! A link to one local peer: two single-producer/single-consumer byte rings, ours for
//! receiving, the peer's for sending.

use super::segment::{atomic_u64, ShmDomain, RING_DATA, RING_HEAD, RING_TAIL};
use crate::transport::{Link, Transport};
use std::io::IoSlice;
use std::os::fd::RawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;

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
        // SAFETY: as for `rx`.
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
    fn kind(&self) -> Transport {
        Transport::Shm
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
    use crate::bootstrap::StoreClient;
    use crate::config::Config;
    use std::time::Duration;
    use std::time::Instant;

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
