//! The two-sided verbs link: a byte stream on RDMA WRITE WITH IMMEDIATE.
//!
//! Each direction has a ring of `slots` fixed-size slots in the receiver's registered
//! memory. The sender copies up to one slot of stream bytes into the same slot of its own
//! registered staging ring and writes it across with the byte count as immediate data; the
//! immediate consumes one posted receive at the peer, so the receiver learns of the bytes
//! only once they have landed (RC delivers in order, so slots arrive in order). The
//! receiver returns freed slots as credits (SEND WITH IMMEDIATE, no data) a quarter ring at
//! a time, so a sender never overruns the ring and a receiver never runs out of posted
//! receives. Small slots go inline where the device allows.
//!
//! Each direction has its own queue pair, as NCCL's send and receive connections do: data
//! to the peer leaves on `data_qp`, whose receive queue takes the peer's credits; the
//! peer's data lands through `credit_qp`, which sends our credits back. A queue pair sends
//! in order, so a credit posted behind megabytes of our own outgoing data would wait for
//! all of it (on rxe at 35 MB/s, a 4 MiB backlog is 120 ms) while the peer's sender starves:
//! in an allreduce, where both directions are busy, that halved throughput once messages
//! outgrew the ring.
//!
//! Liveness: a dead peer's queue pair is destroyed with its process, so any request to it
//! ends in a retry-exceeded completion. While waiting, the link posts a zero-length RDMA
//! WRITE probe now and then to learn this even when it has nothing to send.

use super::{completion_error, sys, Cq, Domain, Endpoint, Mr, Qp, Wr};
use crate::bootstrap::StoreClient;
use crate::error::{Error, Result};
use crate::mem::Region;
use crate::transport::Link;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

const WR_DATA: u64 = 1;
const WR_CREDIT: u64 = 2;
const WR_PROBE: u64 = 3;
/// Receives posted on `credit_qp` (landed slots, hello, close) and on `data_qp` (credits).
const WR_RECV_DATA: u64 = 4;
const WR_CTRL: u64 = 5;
const WR_RECV_CREDIT: u64 = 6;

/// Control immediates (credits are small counts, far below these).
const IMM_HELLO: u32 = 0xFFFF_FFF0;
const IMM_CLOSE: u32 = 0xFFFF_FFF1;

/// Largest slot: big enough that a slot's fixed cost is small, small enough that a reduce
/// on receive starts while the rest of a chunk is still in flight.
const MAX_SLOT: usize = 128 << 10;
const PROBE_EVERY: Duration = Duration::from_millis(200);

/// A link to one peer over RDMA verbs.
pub struct VerbsLink {
    peer: usize,
    /// Our slots go out here; the peer's credits come in here.
    data_qp: Qp,
    /// The peer's slots land through here; our credits go out here.
    credit_qp: Qp,
    /// One completion queue for both queue pairs (work request ids tell them apart).
    cq: Arc<Cq>,
    /// The peer's `credit_qp` endpoint, with its receive ring.
    remote: Endpoint,
    // Registrations drop before the memory they cover.
    tx_mr: Mr,
    /// Registered for the peer's writes; never used locally after connect.
    _rx_mr: Mr,
    tx: Region,
    rx: Region,
    slots: usize,
    slot: usize,
    /// Slots sent so far; slots the peer still has free for us; requests in each send queue
    /// (both hold `sq_cap`).
    sent: u64,
    credits: usize,
    sq_busy: usize,
    credit_busy: usize,
    sq_cap: usize,
    /// Byte counts of slots that landed and are not yet read, oldest first.
    arrived: VecDeque<usize>,
    taken: u64,
    read_off: usize,
    /// Slots read but not yet returned to the sender as credits.
    freed: usize,
    probe_out: bool,
    last_probe: Instant,
    peer_hello: bool,
    peer_closed: bool,
    failed: Option<String>,
}

impl VerbsLink {
    fn fail(&mut self, e: std::io::Error) -> std::io::Error {
        let text = e.to_string();
        self.failed.get_or_insert(text);
        e
    }

    /// Drains the completion queue: landed slots, credits, control words, finished sends.
    fn progress(&mut self) -> std::io::Result<()> {
        if let Some(f) = &self.failed {
            return Err(std::io::Error::other(f.clone()));
        }
        let mut wcs = [sys::ibv_wc::default(); 32];
        loop {
            let cq = self.cq.clone();
            let done = cq.poll(&mut wcs)?;
            for wc in done {
                let kind = wc.wr_id();
                if !wc.is_valid() {
                    let op = match kind {
                        WR_DATA => "write with immediate",
                        WR_CREDIT => "credit send",
                        WR_PROBE => "liveness probe",
                        WR_CTRL => "control send",
                        _ => "receive",
                    };
                    let e = completion_error(wc, op, self.data_qp.domain());
                    return Err(self.fail(e));
                }
                match kind {
                    WR_RECV_DATA | WR_RECV_CREDIT => {
                        let qp = if kind == WR_RECV_DATA { &self.credit_qp } else { &self.data_qp };
                        let r = qp.post_recv(kind);
                        if let Err(e) = r {
                            return Err(self.fail(e));
                        }
                        let imm = wc.imm_data().map(u32::from_be).unwrap_or(0);
                        if wc.opcode() == sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                            if imm as usize > self.slot || self.arrived.len() >= self.slots {
                                let e = std::io::Error::other(format!(
                                    "protocol: rank {} wrote {imm} bytes into a {}-byte slot of a full ring",
                                    self.peer, self.slot
                                ));
                                return Err(self.fail(e));
                            }
                            self.arrived.push_back(imm as usize);
                        } else {
                            match imm {
                                IMM_HELLO => self.peer_hello = true,
                                IMM_CLOSE => self.peer_closed = true,
                                n => self.credits += n as usize,
                            }
                        }
                    }
                    WR_PROBE => {
                        self.probe_out = false;
                        self.sq_busy -= 1;
                    }
                    WR_CREDIT => self.credit_busy -= 1,
                    _ => self.sq_busy -= 1,
                }
            }
            if done.len() < wcs.len() {
                return Ok(());
            }
        }
    }

    fn return_credits(&mut self) -> std::io::Result<()> {
        if self.freed == 0 || self.credit_busy >= self.sq_cap {
            return Ok(());
        }
        self.credit_qp.post(WR_CREDIT, Wr::SendImm(self.freed as u32))?;
        self.credit_busy += 1;
        self.freed = 0;
        Ok(())
    }

    /// `n` more bytes of the front slot (of `len`) are read; a finished slot becomes a credit.
    fn consume(&mut self, n: usize, len: usize) -> std::io::Result<()> {
        self.read_off += n;
        if self.read_off == len {
            self.arrived.pop_front();
            self.taken += 1;
            self.read_off = 0;
            self.freed += 1;
            // A quarter ring at a time, or at once when we have caught up (the sender may be
            // waiting for exactly these slots).
            if self.freed >= (self.slots / 4).max(1) || self.arrived.is_empty() {
                self.return_credits()?;
            }
        }
        Ok(())
    }

    fn slot_ptr(region: &Region, slot: usize, index: u64, slots: usize) -> *mut u8 {
        // SAFETY: index % slots < slots, and the region holds slots * slot bytes.
        unsafe { region.as_ptr().add((index % slots as u64) as usize * slot) }
    }
}

impl Link for VerbsLink {
    fn kind(&self) -> &'static str {
        "verbs"
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.progress()?;
        if self.peer_closed {
            return Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "peer closed the link"));
        }
        if self.credits == 0 || self.sq_busy >= self.sq_cap {
            return Ok(0);
        }
        let dst = Self::slot_ptr(&self.tx, self.slot, self.sent, self.slots);
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(self.slot - n);
            // SAFETY: dst has `slot` bytes; n + take <= slot; the staging slot is free (its
            // credit came back, so the previous write from it has landed).
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), dst.add(n), take) };
            n += take;
            if n == self.slot {
                break;
            }
        }
        if n == 0 {
            return Ok(0);
        }
        // SAFETY: the n bytes just written.
        let data = unsafe { std::slice::from_raw_parts(dst, n) };
        let at = (self.sent % self.slots as u64) as usize * self.slot;
        let wr = Wr::Write { local: Some((data, self.tx_mr.lkey())), remote_addr: self.remote.addr + at as u64, rkey: self.remote.rkey, imm: Some(n as u32) };
        if let Err(e) = self.data_qp.post(WR_DATA, wr) {
            return Err(self.fail(e));
        }
        self.sent += 1;
        self.credits -= 1;
        self.sq_busy += 1;
        Ok(n)
    }

    fn try_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let max = buf.len();
        self.try_read_in_place(max, &mut |bytes: &[u8]| buf[..bytes.len()].copy_from_slice(bytes)).unwrap_or(Ok(0))
    }

    fn try_read_in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Option<std::io::Result<usize>> {
        if let Err(e) = self.progress() {
            return Some(Err(e));
        }
        let Some(&len) = self.arrived.front() else {
            if self.peer_closed {
                return Some(Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "peer closed the link")));
            }
            return Some(Ok(0));
        };
        let n = max.min(len - self.read_off);
        let src = Self::slot_ptr(&self.rx, self.slot, self.taken, self.slots);
        // SAFETY: the slot holds `len` landed bytes and the sender does not reuse it before
        // we return its credit below.
        f(unsafe { std::slice::from_raw_parts(src.add(self.read_off), n) });
        Some(self.consume(n, len).map(|_| n))
    }

    fn poll_fd(&self) -> Option<RawFd> {
        None
    }

    fn peer_gone(&mut self) -> Option<String> {
        if let Err(e) = self.progress() {
            return Some(e.to_string());
        }
        if let Some(why) = self.remote.local_pid().and_then(crate::transport::shm::process_gone) {
            return Some(why);
        }
        // Credits held back while the sender may be waiting for them.
        if self.arrived.is_empty() && self.return_credits().is_err() {
            return self.failed.clone();
        }
        if !self.probe_out && self.last_probe.elapsed() >= PROBE_EVERY && self.sq_busy < self.sq_cap {
            let wr = Wr::Write { local: None, remote_addr: self.remote.addr, rkey: self.remote.rkey, imm: None };
            if let Err(e) = self.data_qp.post(WR_PROBE, wr) {
                return Some(self.fail(e).to_string());
            }
            self.probe_out = true;
            self.sq_busy += 1;
            self.last_probe = Instant::now();
        }
        None
    }

    fn shutdown(&mut self) {
        if self.failed.is_some() || self.sq_busy >= self.sq_cap || self.data_qp.post(WR_CTRL, Wr::SendImm(IMM_CLOSE)).is_err() {
            return;
        }
        self.sq_busy += 1;
        // Let the close word leave before the queue pair is destroyed.
        let until = Instant::now() + Duration::from_millis(100);
        while self.sq_busy > 0 && Instant::now() < until && self.progress().is_ok() {
            std::thread::yield_now();
        }
        self.failed = Some("link shut down".into());
    }
}

fn lost(rank: usize, peer: usize, cause: String) -> Error {
    Error::PeerLost { rank, peer, op: "verbs connect".into(), cause }
}

/// Connects this rank to every peer in `peers` over verbs: one RC queue pair and one ring
/// per direction per peer; endpoints (QP numbers, GID, ring address and key) go through the
/// rendezvous store. Before returning, every pair exchanges a hello over the new queue
/// pairs, so an unreachable peer (wrong GID, wrong port) fails here, named, and not in the
/// first collective.
pub fn connect_all(
    prefix: &str,
    rank: usize,
    peers: &[usize],
    store: &StoreClient,
    dom: &Arc<Domain>,
    ring_bytes: usize,
    deadline: Instant,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    let started = Instant::now();
    if peers.is_empty() {
        return Ok(vec![]);
    }
    let slot = MAX_SLOT.min(ring_bytes / 4);
    let slots = ring_bytes / slot;
    // Each queue holds a whole ring of slots (or of credits) plus control words.
    let depth = slots + 16;
    struct Pending {
        peer: usize,
        data_qp: Qp,
        credit_qp: Qp,
        cq: Arc<Cq>,
        tx: Region,
        rx: Region,
        tx_mr: Mr,
        rx_mr: Mr,
        psn: (u32, u32),
    }
    let mut pending = Vec::new();
    let mut made = Vec::new();
    for &p in peers {
        let cq = dom.create_cq(4 * depth)?;
        let data_qp = dom.create_qp(&cq, depth as u32, depth as u32)?;
        let credit_qp = dom.create_qp(&cq, depth as u32, depth as u32)?;
        let tx = Region::anonymous(ring_bytes)?;
        let rx = Region::anonymous(ring_bytes)?;
        // SAFETY: both regions live in the link next to (and longer than) their registrations.
        let (tx_mr, rx_mr) = unsafe { (dom.register_raw(tx.as_ptr(), tx.len())?, dom.register_raw(rx.as_ptr(), rx.len())?) };
        let psn = (rand::random::<u32>() & 0xFF_FFFF, rand::random::<u32>() & 0xFF_FFFF);
        store.set(&format!("{prefix}/ib/{rank}>{p}/data"), data_qp.endpoint(psn.0, None).encode().as_bytes())?;
        store.set(&format!("{prefix}/ib/{rank}>{p}/credit"), credit_qp.endpoint(psn.1, Some(&rx_mr)).encode().as_bytes())?;
        pending.push(Pending { peer: p, data_qp, credit_qp, cq, tx, rx, tx_mr, rx_mr, psn });
    }
    for pd in pending {
        let p = pd.peer;
        let fetch = |which: &str| -> Result<Endpoint> {
            let v = store.get(&format!("{prefix}/ib/{p}>{rank}/{which}"), deadline)?.ok_or_else(|| Error::Timeout {
                rank,
                peer: p,
                op: format!("verbs connect (peer never published its {which} queue pair)"),
                waited_ms: started.elapsed().as_millis() as u64,
            })?;
            Endpoint::decode(&String::from_utf8_lossy(&v)).map_err(|e| Error::Protocol(format!("rank {p}: {e}")))
        };
        let (remote_data, remote) = (fetch("data")?, fetch("credit")?);
        if remote.len < ring_bytes as u64 {
            return Err(Error::Config(format!(
                "rank {p} has a {}-byte verbs ring, rank {rank} {ring_bytes}: set GRADWIRE_IB_RING_BYTES alike on every rank",
                remote.len
            )));
        }
        // Our data queue pair talks to the peer's credit queue pair, and the other way round.
        pd.data_qp.connect(pd.psn.0, &remote).map_err(|e| lost(rank, p, e.to_string()))?;
        pd.credit_qp.connect(pd.psn.1, &remote_data).map_err(|e| lost(rank, p, e.to_string()))?;
        for _ in 0..depth {
            pd.credit_qp.post_recv(WR_RECV_DATA).map_err(|e| Error::io(format!("post receive for rank {p}"), e))?;
            pd.data_qp.post_recv(WR_RECV_CREDIT).map_err(|e| Error::io(format!("post receive for rank {p}"), e))?;
        }
        made.push(VerbsLink {
            peer: p,
            data_qp: pd.data_qp,
            credit_qp: pd.credit_qp,
            cq: pd.cq,
            remote,
            tx_mr: pd.tx_mr,
            _rx_mr: pd.rx_mr,
            tx: pd.tx,
            rx: pd.rx,
            slots,
            slot,
            sent: 0,
            credits: slots,
            sq_busy: 0,
            credit_busy: 0,
            sq_cap: depth,
            arrived: VecDeque::new(),
            taken: 0,
            read_off: 0,
            freed: 0,
            probe_out: false,
            last_probe: Instant::now(),
            peer_hello: false,
            peer_closed: false,
            failed: None,
        });
    }
    // Every queue pair of ours is ready to receive; wait until the peers' are too, so a
    // hello never meets a queue pair that is not listening yet.
    store.set(&format!("{prefix}/ib/ready/{rank}"), b"1")?;
    for &p in peers {
        store.get(&format!("{prefix}/ib/ready/{p}"), deadline)?.ok_or_else(|| Error::Timeout {
            rank,
            peer: p,
            op: "verbs connect (peer never became ready)".into(),
            waited_ms: started.elapsed().as_millis() as u64,
        })?;
    }
    hello(rank, &mut made, deadline, started)?;
    Ok(made.into_iter().map(|l| (l.peer, Box::new(l) as Box<dyn Link>)).collect())
}

/// Sends a hello to every peer and waits for theirs.
fn hello(rank: usize, links: &mut [VerbsLink], deadline: Instant, started: Instant) -> Result<()> {
    for l in links.iter_mut() {
        l.data_qp.post(WR_CTRL, Wr::SendImm(IMM_HELLO)).map_err(|e| lost(rank, l.peer, format!("hello: {e}")))?;
        l.sq_busy += 1;
    }
    loop {
        let mut all = true;
        for l in links.iter_mut() {
            l.progress().map_err(|e| lost(rank, l.peer, format!("no hello exchanged: {e}")))?;
            all &= l.peer_hello && l.sq_busy == 0;
        }
        if all {
            return Ok(());
        }
        if Instant::now() >= deadline {
            let p = links.iter().find(|l| !l.peer_hello).map_or(rank, |l| l.peer);
            return Err(Error::Timeout { rank, peer: p, op: "verbs connect (hello)".into(), waited_ms: started.elapsed().as_millis() as u64 });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
