//! One peer's queue pair for one-sided operations of a window: RDMA WRITE, READ and atomic
//! fetch-and-add, each waited for, through a registered bounce buffer where the caller's
//! memory is not registered.

use super::{completion_error, sys, Cq, Domain, Endpoint, Mr, Qp, Wr};
use crate::error::Result;
use crate::mem::Region;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One-sided access to one peer's exposed region: its own queue pair and completion
/// queue, and a registered bounce buffer for caller memory that is not registered.
pub struct RmaPeer {
    qp: Qp,
    cq: Arc<Cq>,
    remote: Endpoint,
    // Deregistered before the memory is unmapped (fields drop in order).
    bounce_mr: Mr,
    bounce: Region,
    next_id: std::sync::atomic::AtomicU64,
    /// A request that outlived its call's deadline (0: none): the device may still use the
    /// bounce buffer for it, so the next call first waits for its completion.
    unfinished: std::sync::atomic::AtomicU64,
}

const BOUNCE_BYTES: usize = 1 << 20;

impl RmaPeer {
    /// Creates the queue pair (connected later with [`RmaPeer::connect`]).
    pub fn create(dom: &Arc<Domain>) -> Result<(Qp, Arc<Cq>)> {
        let cq = dom.create_cq(64)?;
        let qp = dom.create_qp(&cq, 16, 1)?;
        Ok((qp, cq))
    }

    pub fn connect(dom: &Arc<Domain>, qp: Qp, cq: Arc<Cq>, local_psn: u32, remote: Endpoint) -> Result<RmaPeer> {
        qp.connect(local_psn, &remote)?;
        let region = Region::anonymous(BOUNCE_BYTES)?;
        // SAFETY: the region lives in the same struct and outlives the registration.
        let mr = unsafe { dom.register_raw(region.as_ptr(), region.len())? };
        Ok(RmaPeer { qp, cq, remote, bounce_mr: mr, bounce: region, next_id: 1.into(), unfinished: 0.into() })
    }

    pub fn remote_len(&self) -> usize {
        self.remote.len as usize
    }

    /// The peer's process id when it runs on this host.
    pub fn local_pid(&self) -> Option<u32> {
        self.remote.local_pid()
    }

    /// Posts `wr` and waits for its completion until `deadline`.
    ///
    /// # Safety
    /// As for [`Qp::post`], except that a request that does not complete by `deadline` is
    /// waited for by the next call (see [`RmaPeer::settle`]): memory that stays valid while
    /// this `RmaPeer` lives (the bounce buffer) is safe to name even then.
    unsafe fn run(&self, wr: Wr<'_>, what: &str, deadline: Instant) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        self.settle(what, deadline)?;
        let id = self.next_id.fetch_add(1, Relaxed);
        // SAFETY: this function's contract.
        unsafe { self.qp.post(id, wr)? };
        self.wait_for(id, what, deadline).unwrap_or_else(|never_completed| {
            self.unfinished.store(id, Relaxed);
            Err(never_completed)
        })
    }

    /// Waits for a request an earlier call gave up on: until it completes, the device may
    /// still read or write the bounce buffer. Every operation settles before it touches
    /// the bounce buffer.
    fn settle(&self, what: &str, deadline: Instant) -> std::io::Result<()> {
        use std::sync::atomic::Ordering::Relaxed;
        let earlier = self.unfinished.load(Relaxed);
        if earlier != 0 {
            // Its own outcome was reported by the call that gave up on it.
            let _ = self.wait_for(earlier, what, deadline).map_err(|e| {
                std::io::Error::new(e.kind(), format!("RDMA {what}: an earlier request to this peer never completed ({e}); its buffer is still the device's"))
            })?;
            self.unfinished.store(0, Relaxed);
        }
        Ok(())
    }

    /// Waits until request `id` completes, and gives its status; `Err` when it has not
    /// completed by `deadline` or its peer is gone (completions of other requests are of
    /// earlier calls that already failed).
    fn wait_for(&self, id: u64, what: &str, deadline: Instant) -> std::result::Result<std::io::Result<()>, std::io::Error> {
        let mut wc = [sys::ibv_wc::default(); 4];
        let mut naps = 0u32;
        loop {
            for c in self.cq.poll(&mut wc)? {
                if c.wr_id != id {
                    continue;
                }
                if !c.is_ok() {
                    return Ok(Err(completion_error(c, what, self.qp.domain())));
                }
                return Ok(Ok(()));
            }
            if Instant::now() >= deadline {
                return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("RDMA {what}: no completion before the deadline")));
            }
            // A dead peer on this host is seen through /proc long before transport retries.
            if naps % 1000 == 999 {
                if let Some(why) = self.local_pid().and_then(crate::sys::proc::process_gone) {
                    return Err(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, format!("RDMA {what}: {why}")));
                }
            }
            naps += 1;
            if naps > 200 {
                std::thread::sleep(Duration::from_micros(20));
            } else {
                std::hint::spin_loop();
            }
        }
    }

    /// RDMA WRITE of `data` at `off` of the peer's region; complete at the peer on return.
    pub fn write(&self, off: usize, data: &[u8], deadline: Instant) -> std::io::Result<()> {
        let dom = self.qp.domain();
        if let Some(mr) = dom.lookup(data.as_ptr(), data.len()) {
            let wr = Wr::Write { local: Some((data, mr.lkey())), remote_addr: self.remote.addr + off as u64, rkey: self.remote.rkey, imm: None };
            // SAFETY: `data` lies in registration `mr` and is borrowed until the write
            // completes, or until it fails at the deadline: then the device may still read
            // it, and what lands at the peer is undefined (the write has failed), but the
            // registration keeps any read it makes inside mapped memory.
            return unsafe { self.run(wr, "write", deadline) };
        }
        self.settle("write", deadline)?;
        for (i, chunk) in data.chunks(BOUNCE_BYTES).enumerate() {
            // SAFETY: the bounce buffer is ours and no request on it is pending (settled
            // above, and each chunk's write completed before the next).
            let bounce = unsafe { std::slice::from_raw_parts_mut(self.bounce.as_ptr(), chunk.len()) };
            bounce.copy_from_slice(chunk);
            let wr = Wr::Write {
                local: Some((bounce, self.bounce_mr.lkey())),
                remote_addr: self.remote.addr + (off + i * BOUNCE_BYTES) as u64,
                rkey: self.remote.rkey,
                imm: None,
            };
            // SAFETY: the bounce buffer lives as long as this RmaPeer, in its registration.
            unsafe { self.run(wr, "write", deadline)? };
        }
        Ok(())
    }

    /// RDMA READ of `buf.len()` bytes at `off` of the peer's region.
    pub fn read(&self, off: usize, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
        self.settle("read", deadline)?;
        for (i, chunk) in buf.chunks_mut(BOUNCE_BYTES).enumerate() {
            let wr = Wr::Read {
                local: (self.bounce.as_ptr(), chunk.len(), self.bounce_mr.lkey()),
                remote_addr: self.remote.addr + (off + i * BOUNCE_BYTES) as u64,
                rkey: self.remote.rkey,
            };
            // SAFETY: as for the bounce buffer in `write`.
            unsafe { self.run(wr, "read", deadline)? };
            // SAFETY: the read completed into our bounce buffer.
            chunk.copy_from_slice(unsafe { std::slice::from_raw_parts(self.bounce.as_ptr(), chunk.len()) });
        }
        Ok(())
    }

    /// Atomic fetch-and-add on the u64 at `off` (8-aligned); returns the old value.
    pub fn fetch_add(&self, off: usize, add: u64, deadline: Instant) -> std::io::Result<u64> {
        self.settle("fetch-add", deadline)?;
        let wr = Wr::FetchAdd { local: (self.bounce.as_ptr(), self.bounce_mr.lkey()), remote_addr: self.remote.addr + off as u64, rkey: self.remote.rkey, add };
        // SAFETY: as for the bounce buffer in `write`.
        unsafe { self.run(wr, "fetch-add", deadline)? };
        let mut old = [0u8; 8];
        // SAFETY: the atomic completed into the first 8 bytes of the bounce buffer.
        old.copy_from_slice(unsafe { std::slice::from_raw_parts(self.bounce.as_ptr(), 8) });
        // Atomics return the remote word in host order on the responder's host.
        Ok(u64::from_ne_bytes(old))
    }
}
