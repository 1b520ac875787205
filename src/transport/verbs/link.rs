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
//! Rendezvous: a payload of at least half a ring does not go through the ring. The receiver,
//! as soon as it starts waiting for the payload, grants a landing zone for all of it (up to
//! `GRADWIRE_IB_ZONE_BYTES` at a time): it writes the zone's address and key into a mailbox
//! beside the sender's staging ring and sends `IMM_GRANT`. A receiver that has no zone (the
//! setting is 0, or registering one failed) answers `IMM_NO_ZONE` and the payload goes
//! through the ring. The sender then writes the payload into the
//! zone in large chunks, reusing its staging memory as soon as a write completes locally.
//! A receiver that is late to read (a rank not scheduled in time) no longer stalls the
//! sender: with a ring, the sender waited for credits that only a running receiver returns.
//!
//! Liveness: a dead peer's queue pair is destroyed with its process, so any request to it
//! ends in a retry-exceeded completion. While waiting, the link posts a zero-length RDMA
//! WRITE probe now and then to learn this even when it has nothing to send.

use super::{completion_error, sys, Cq, Endpoint, Mr, Qp, Wr};
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
pub(super) const WR_RECV_DATA: u64 = 4;
const WR_CTRL: u64 = 5;
pub(super) const WR_RECV_CREDIT: u64 = 6;
const WR_ZONE: u64 = 7;
const WR_GRANT: u64 = 8;

/// Control immediates (credits are small counts, far below these).
const IMM_HELLO: u32 = 0xFFFF_FFF0;
const IMM_CLOSE: u32 = 0xFFFF_FFF1;
const IMM_GRANT: u32 = 0xFFFF_FFF2;
const IMM_NO_ZONE: u32 = 0xFFFF_FFF3;
/// Marks a write into the rendezvous zone; the low bits carry its byte count.
const ZONE_FLAG: u32 = 1 << 30;

/// Largest rendezvous write: large, because a zone has no slots to fill (on rxe, 2 MiB
/// writes beat 1 MiB and 4 MiB ones: 30.6-33.2 against 28.2-29.3 and 23.4-27.0 MB/s for a
/// 16 MiB allreduce), and half the staging ring, so one chunk fills while the other is out.
pub(super) const MAX_ZONE_CHUNK: usize = 2 << 20;
/// Room after the staging ring where the peer writes its grants (address, key, length).
pub(super) const MAILBOX: usize = 64;

/// Largest slot: big enough that a slot's fixed cost is small, small enough that a reduce
/// on receive starts while the rest of a chunk is still in flight.
pub(super) const MAX_SLOT: usize = 128 << 10;
const PROBE_EVERY: Duration = Duration::from_millis(200);

/// One stretch of received bytes, oldest first: a ring slot, or a write into the zone.
struct Landed {
    len: usize,
    /// Offset in the zone; `None` for a ring slot.
    zone_at: Option<usize>,
}

/// Where the receiver lets the sender write the next piece of a rendezvous payload.
struct Grant {
    addr: u64,
    rkey: u32,
    len: usize,
    used: usize,
}

/// Bytes of a grant in the mailbox: address, key, length (little-endian).
const GRANT_BYTES: usize = 16;

impl Grant {
    fn to_mail(&self) -> [u8; GRANT_BYTES] {
        let mut mail = [0u8; GRANT_BYTES];
        mail[..8].copy_from_slice(&self.addr.to_le_bytes());
        mail[8..12].copy_from_slice(&self.rkey.to_le_bytes());
        mail[12..16].copy_from_slice(&(self.len as u32).to_le_bytes());
        mail
    }

    fn from_mail(mail: &[u8; GRANT_BYTES]) -> Grant {
        let addr = u64::from_le_bytes(mail[..8].try_into().expect("8 bytes"));
        let rkey = u32::from_le_bytes(mail[8..12].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(mail[12..16].try_into().expect("4 bytes")) as usize;
        Grant { addr, rkey, len, used: 0 }
    }
}

/// The receiver's landing zone, registered once and grown when a larger piece is granted.
struct Zone {
    // The registration drops before the memory it covers.
    mr: Mr,
    region: Region,
}

/// A link to one peer over RDMA verbs.
pub struct VerbsLink {
    pub(super) peer: usize,
    /// Our slots go out here; the peer's credits come in here.
    data_qp: Qp,
    /// The peer's slots land through here; our credits go out here.
    credit_qp: Qp,
    /// One completion queue for both queue pairs (work request ids tell them apart).
    cq: Arc<Cq>,
    /// The peer's `credit_qp` endpoint, with its receive ring.
    remote: Endpoint,
    /// The peer's mailbox (beside its staging ring), where our grants go.
    remote_mailbox: (u64, u32),
    // Registrations drop before the memory they cover.
    tx_mr: Mr,
    /// Registered for the peer's writes (and our grants, which leave from its mailbox).
    rx_mr: Mr,
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
    /// Stretches that landed and are not yet read, oldest first; how many are ring slots.
    arrived: VecDeque<Landed>,
    ring_unread: usize,
    taken: u64,
    read_off: usize,
    /// Slots read but not yet returned to the sender as credits.
    freed: usize,
    probe_out: bool,
    last_probe: Instant,
    peer_hello: bool,
    peer_closed: bool,
    failed: Option<String>,
    /// Rendezvous, sending: payload bytes still to send, the piece granted, and writes in
    /// flight from the staging ring (zone chunks or ring slots: they share its memory).
    send_left: usize,
    grant: Option<Grant>,
    /// The peer answered our next payload with `IMM_NO_ZONE` before we began it.
    no_zone_ahead: bool,
    zone_chunk: usize,
    zone_busy: usize,
    zone_posted: u64,
    ring_busy: usize,
    rendezvous_from: usize,
    /// Rendezvous, receiving: payload bytes not yet granted, the piece granted and how much
    /// of it has landed and been read; a grant waiting for room in the send queue.
    zone: Option<Zone>,
    /// Largest zone (0: none, or registering one failed: payloads come through the ring).
    zone_max: usize,
    recv_left: usize,
    piece: usize,
    piece_landed: usize,
    piece_read: usize,
    grant_due: bool,
}

/// A connected pair of queue pairs and rings, as `connect::connect_all` made them.
pub(super) struct NewLink {
    pub(super) peer: usize,
    pub(super) data_qp: Qp,
    pub(super) credit_qp: Qp,
    pub(super) cq: Arc<Cq>,
    pub(super) remote: Endpoint,
    pub(super) remote_mailbox: (u64, u32),
    pub(super) tx_mr: Mr,
    pub(super) rx_mr: Mr,
    pub(super) tx: Region,
    pub(super) rx: Region,
    pub(super) slots: usize,
    pub(super) slot: usize,
    pub(super) depth: usize,
    pub(super) rendezvous_from: usize,
    pub(super) zone_bytes: usize,
    pub(super) zone_chunk: usize,
}

impl VerbsLink {
    /// A link over a new connection, before its hello.
    pub(super) fn new(n: NewLink) -> Self {
        VerbsLink {
            peer: n.peer,
            data_qp: n.data_qp,
            credit_qp: n.credit_qp,
            cq: n.cq,
            remote: n.remote,
            remote_mailbox: n.remote_mailbox,
            tx_mr: n.tx_mr,
            rx_mr: n.rx_mr,
            tx: n.tx,
            rx: n.rx,
            slots: n.slots,
            slot: n.slot,
            sent: 0,
            credits: n.slots,
            sq_busy: 0,
            credit_busy: 0,
            sq_cap: n.depth,
            arrived: VecDeque::new(),
            ring_unread: 0,
            taken: 0,
            read_off: 0,
            freed: 0,
            probe_out: false,
            last_probe: Instant::now(),
            peer_hello: false,
            peer_closed: false,
            failed: None,
            send_left: 0,
            grant: None,
            no_zone_ahead: false,
            zone_chunk: n.zone_chunk,
            zone_busy: 0,
            zone_posted: 0,
            ring_busy: 0,
            rendezvous_from: n.rendezvous_from,
            zone: None,
            zone_max: n.zone_bytes,
            recv_left: 0,
            piece: 0,
            piece_landed: 0,
            piece_read: 0,
            grant_due: false,
        }
    }
}

impl VerbsLink {
    fn fail(&mut self, e: std::io::Error) -> std::io::Error {
        let text = e.to_string();
        self.failed.get_or_insert(text);
        e
    }

    /// Drains the completion queue: landed slots, credits, control words, finished sends.
    pub(super) fn progress(&mut self) -> std::io::Result<()> {
        if let Some(f) = &self.failed {
            return Err(std::io::Error::other(f.clone()));
        }
        let mut wcs = [sys::ibv_wc::default(); 32];
        loop {
            let cq = self.cq.clone();
            let done = cq.poll(&mut wcs)?;
            for wc in done {
                let kind = wc.wr_id;
                if !wc.is_ok() {
                    let op = match kind {
                        WR_DATA => "write with immediate",
                        WR_ZONE => "rendezvous write",
                        WR_GRANT => "rendezvous grant",
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
                        let imm = wc.imm().map(u32::from_be).unwrap_or(0);
                        if wc.opcode == sys::IBV_WC_RECV_RDMA_WITH_IMM {
                            let r = if imm & ZONE_FLAG != 0 { self.landed_in_zone((imm & !ZONE_FLAG) as usize) } else { self.landed_in_ring(imm as usize) };
                            if let Err(e) = r {
                                return Err(self.fail(e));
                            }
                        } else {
                            match imm {
                                IMM_HELLO => self.peer_hello = true,
                                IMM_CLOSE => self.peer_closed = true,
                                IMM_GRANT => {
                                    if let Err(e) = self.take_grant() {
                                        return Err(self.fail(e));
                                    }
                                }
                                // The rest of the payload (or the next one) goes through the ring.
                                IMM_NO_ZONE if self.send_left > 0 => self.send_left = 0,
                                IMM_NO_ZONE => self.no_zone_ahead = true,
                                n => self.credits += n as usize,
                            }
                        }
                    }
                    WR_PROBE => {
                        self.probe_out = false;
                        self.sq_busy -= 1;
                    }
                    WR_CREDIT | WR_GRANT => self.credit_busy -= 1,
                    WR_ZONE => {
                        self.zone_busy -= 1;
                        self.sq_busy -= 1;
                    }
                    WR_DATA => {
                        self.ring_busy -= 1;
                        self.sq_busy -= 1;
                    }
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
        self.credit_qp.send_imm(WR_CREDIT, self.freed as u32)?;
        self.credit_busy += 1;
        self.freed = 0;
        Ok(())
    }

    /// The mailbox after the ring in `region` (the staging or the receive region).
    fn mailbox(&self, region: &Region) -> *mut u8 {
        // SAFETY: both regions hold the ring plus MAILBOX bytes.
        unsafe { region.as_ptr().add(self.slots * self.slot) }
    }

    fn protocol(&self, what: String) -> std::io::Error {
        std::io::Error::other(format!("protocol: rank {} {what}", self.peer))
    }

    fn landed_in_ring(&mut self, len: usize) -> std::io::Result<()> {
        if len > self.slot || self.ring_unread >= self.slots {
            return Err(self.protocol(format!("wrote {len} bytes into a {}-byte slot of a full ring", self.slot)));
        }
        self.ring_unread += 1;
        self.arrived.push_back(Landed { len, zone_at: None });
        Ok(())
    }

    fn landed_in_zone(&mut self, len: usize) -> std::io::Result<()> {
        if self.piece_landed + len > self.piece {
            return Err(self.protocol(format!("wrote {len} bytes at {} of a {}-byte landing zone", self.piece_landed, self.piece)));
        }
        self.arrived.push_back(Landed { len, zone_at: Some(self.piece_landed) });
        self.piece_landed += len;
        Ok(())
    }

    /// The peer granted us room for the next piece of our payload: its description is in
    /// our mailbox (the write that put it there arrived before this notice).
    fn take_grant(&mut self) -> std::io::Result<()> {
        if self.grant.is_some() {
            return Err(self.protocol("granted a landing zone while the previous one was unused".into()));
        }
        // SAFETY: the mailbox holds GRANT_BYTES inside the staging region, which outlives the link.
        let mail = unsafe { &*(self.mailbox(&self.tx) as *const [u8; GRANT_BYTES]) };
        self.grant = Some(Grant::from_mail(mail));
        Ok(())
    }

    /// Receiver: grants the next piece of the expected payload once the previous piece is
    /// read and the send queue has room for the mailbox write and its notice.
    fn flush_grant(&mut self) -> std::io::Result<()> {
        if !self.grant_due || self.credit_busy + 2 > self.sq_cap {
            return Ok(());
        }
        self.grant_due = false;
        let piece = self.recv_left.min(self.zone_max);
        if let Err(why) = self.ensure_zone(piece) {
            log::warn!("verbs: no rendezvous landing zone for rank {}: {why}; large payloads from it come through the ring", self.peer);
            self.zone_max = 0;
        }
        if self.zone_max == 0 {
            self.credit_qp.send_imm(WR_CREDIT, IMM_NO_ZONE)?;
            self.credit_busy += 1;
            self.recv_left = 0;
            self.piece = 0;
            self.piece_read = 0;
            return Ok(());
        }
        let zone = self.zone.as_ref().expect("zone just made");
        let mail = Grant { addr: zone.region.as_ptr() as u64, rkey: zone.mr.rkey(), len: piece, used: 0 }.to_mail();
        // The description goes out from our own mailbox (after the receive ring), which is
        // rewritten only for the next grant: after the peer has used this one.
        // SAFETY: the mailbox holds GRANT_BYTES inside the registered receive region.
        let src = unsafe {
            let p = self.mailbox(&self.rx);
            std::ptr::copy_nonoverlapping(mail.as_ptr(), p, GRANT_BYTES);
            std::slice::from_raw_parts(p, GRANT_BYTES)
        };
        let (remote_addr, rkey) = self.remote_mailbox;
        let wr = Wr::Write { local: Some((src, self.rx_mr.lkey())), remote_addr, rkey, imm: None };
        // SAFETY: the mailbox lies in the receive region's registration, which lives with
        // the link, and is not rewritten before the peer has used this grant (see above);
        // the peer's mailbox is registered for our writes for the link's life.
        unsafe { self.credit_qp.post(WR_GRANT, wr)? };
        self.credit_busy += 1;
        self.credit_qp.send_imm(WR_CREDIT, IMM_GRANT)?;
        self.credit_busy += 1;
        self.recv_left -= piece;
        self.piece = piece;
        self.piece_landed = 0;
        self.piece_read = 0;
        Ok(())
    }

    /// A registered zone of at least `len` bytes (kept, and only replaced by a larger one).
    fn ensure_zone(&mut self, len: usize) -> Result<()> {
        if len == 0 || self.zone.as_ref().is_some_and(|z| z.region.len() >= len) {
            return Ok(());
        }
        // Drop the old registration before mapping the larger zone.
        self.zone = None;
        let region = Region::anonymous(len)?;
        // SAFETY: the zone keeps the region next to (and longer than) its registration.
        let mr = unsafe { self.data_qp.domain().register_raw(region.as_ptr(), region.len())? };
        self.zone = Some(Zone { mr, region });
        Ok(())
    }

    /// `n` more bytes of the front stretch are read. A finished ring slot becomes a credit;
    /// a finished zone piece makes room for the next grant.
    fn consume(&mut self, n: usize) -> std::io::Result<()> {
        let front = self.arrived.front().expect("a landed stretch is being read");
        let (len, in_zone) = (front.len, front.zone_at.is_some());
        self.read_off += n;
        if self.read_off < len {
            return Ok(());
        }
        self.arrived.pop_front();
        self.read_off = 0;
        if in_zone {
            self.piece_read += len;
            if self.piece_read == self.piece && self.recv_left > 0 {
                self.grant_due = true;
                self.flush_grant()?;
            }
            return Ok(());
        }
        self.ring_unread -= 1;
        self.taken += 1;
        self.freed += 1;
        // A quarter ring at a time, or at once when we have caught up (the sender may be
        // waiting for exactly these slots).
        if self.freed >= (self.slots / 4).max(1) || self.ring_unread == 0 {
            self.return_credits()?;
        }
        Ok(())
    }

    /// Sender: writes payload bytes into the granted zone, a chunk per staging piece whose
    /// previous write has completed.
    fn write_to_zone(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        let Some(unused) = self.grant.as_ref().map(|g| g.len - g.used) else {
            return Ok(0);
        };
        if unused > self.send_left {
            let e = self.protocol(format!("granted {unused} bytes of landing zone for the {} bytes left of our payload (mismatched calls?)", self.send_left));
            return Err(self.fail(e));
        }
        // Ring slots in flight still read the staging memory the chunks use.
        if self.ring_busy > 0 {
            return Ok(0);
        }
        let g = self.grant.as_mut().expect("a grant, checked above");
        let chunks = self.slots * self.slot / self.zone_chunk;
        let have: usize = bufs.iter().map(|b| b.len()).sum();
        let mut n = 0;
        while n < have && g.used < g.len && self.zone_busy < chunks && self.sq_busy < self.sq_cap {
            let take = self.zone_chunk.min(g.len - g.used).min(have - n);
            let at = (self.zone_posted % chunks as u64) as usize * self.zone_chunk;
            // SAFETY: the staging region holds `chunks` chunks; this one's last write has
            // completed (zone_busy < chunks and completions arrive in order).
            let dst = unsafe { std::slice::from_raw_parts_mut(self.tx.as_ptr().add(at), take) };
            gather(bufs, n, dst);
            let wr = Wr::Write { local: Some((dst, self.tx_mr.lkey())), remote_addr: g.addr + g.used as u64, rkey: g.rkey, imm: Some(ZONE_FLAG | take as u32) };
            // SAFETY: `dst` lies in the staging registration, which lives with the link, and
            // is not written again before this write completes (zone_busy counts it); the
            // peer granted its zone for our writes until it has read the payload.
            if let Err(e) = unsafe { self.data_qp.post(WR_ZONE, wr) } {
                return Err(self.fail(e));
            }
            g.used += take;
            n += take;
            self.send_left -= take;
            self.zone_busy += 1;
            self.sq_busy += 1;
            self.zone_posted += 1;
        }
        if g.used == g.len {
            self.grant = None;
        }
        Ok(n)
    }

    fn slot_ptr(region: &Region, slot: usize, index: u64, slots: usize) -> *mut u8 {
        // SAFETY: index % slots < slots, and the region holds slots * slot bytes.
        unsafe { region.as_ptr().add((index % slots as u64) as usize * slot) }
    }
}

impl Link for VerbsLink {
    fn kind(&self) -> crate::transport::Transport {
        crate::transport::Transport::Verbs
    }

    fn rendezvous_from(&self) -> Option<usize> {
        Some(self.rendezvous_from)
    }

    fn expect_payload(&mut self, len: usize) -> std::io::Result<()> {
        if self.recv_left > 0 || self.piece_read < self.piece {
            return Err(self.protocol("payload expected while the previous one is unfinished".into()));
        }
        self.recv_left = len;
        self.grant_due = len > 0;
        self.flush_grant()
    }

    fn begin_payload(&mut self, len: usize) {
        // Refused ahead of time: the payload goes through the ring.
        self.send_left = if std::mem::take(&mut self.no_zone_ahead) { 0 } else { len };
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        self.progress()?;
        if self.peer_closed {
            return Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "peer closed the link"));
        }
        if self.send_left > 0 {
            return self.write_to_zone(bufs);
        }
        if self.credits == 0 || self.sq_busy >= self.sq_cap || self.zone_busy > 0 {
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
        // SAFETY: `data` lies in the staging registration, which lives with the link, and
        // its slot is not written again before the peer returns its credit (after the write
        // landed); the peer's ring is registered for our writes for the link's life.
        if let Err(e) = unsafe { self.data_qp.post(WR_DATA, wr) } {
            return Err(self.fail(e));
        }
        self.sent += 1;
        self.credits -= 1;
        self.sq_busy += 1;
        self.ring_busy += 1;
        Ok(n)
    }

    fn try_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let max = buf.len();
        self.try_read_in_place(max, &mut |bytes: &[u8]| buf[..bytes.len()].copy_from_slice(bytes)).unwrap_or(Ok(0))
    }

    fn try_read_in_place(&mut self, max: usize, f: &mut dyn FnMut(&[u8])) -> Option<std::io::Result<usize>> {
        if let Err(e) = self.progress().and_then(|_| self.flush_grant()) {
            return Some(Err(e));
        }
        let Some(front) = self.arrived.front() else {
            if self.peer_closed {
                return Some(Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "peer closed the link")));
            }
            return Some(Ok(0));
        };
        let n = max.min(front.len - self.read_off);
        let src = match (front.zone_at, &self.zone) {
            // SAFETY: the piece lies inside the zone, which was granted for it.
            (Some(at), Some(zone)) => unsafe { zone.region.as_ptr().add(at) },
            _ => Self::slot_ptr(&self.rx, self.slot, self.taken, self.slots),
        };
        // SAFETY: the stretch holds `len` landed bytes, and the sender does not write there
        // again before we return its credit (ring) or grant the zone anew (below).
        f(unsafe { std::slice::from_raw_parts(src.add(self.read_off), n) });
        Some(self.consume(n).map(|_| n))
    }

    fn poll_fd(&self) -> Option<RawFd> {
        None
    }

    fn peer_gone(&mut self) -> Option<String> {
        if let Err(e) = self.progress() {
            return Some(e.to_string());
        }
        if let Some(why) = self.remote.local_pid().and_then(crate::sys::proc::process_gone) {
            return Some(why);
        }
        // Credits (and a grant) held back while the sender may be waiting for them.
        let held_back = if self.arrived.is_empty() { self.return_credits() } else { Ok(()) };
        if let Err(e) = held_back.and_then(|_| self.flush_grant()) {
            return Some(self.fail(e).to_string());
        }
        if !self.probe_out && self.last_probe.elapsed() >= PROBE_EVERY && self.sq_busy < self.sq_cap {
            let wr = Wr::Write { local: None, remote_addr: self.remote.addr, rkey: self.remote.rkey, imm: None };
            // SAFETY: a write of no bytes: it names no local memory and touches none of the
            // peer's.
            if let Err(e) = unsafe { self.data_qp.post(WR_PROBE, wr) } {
                return Some(self.fail(e).to_string());
            }
            self.probe_out = true;
            self.sq_busy += 1;
            self.last_probe = Instant::now();
        }
        None
    }

    fn shutdown(&mut self) {
        if self.failed.is_some() || self.sq_busy >= self.sq_cap || self.data_qp.send_imm(WR_CTRL, IMM_CLOSE).is_err() {
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

pub(super) fn lost(rank: usize, peer: usize, cause: String) -> Error {
    Error::PeerLost { rank, peer, op: "verbs connect".into(), cause }
}

/// Sends a hello to every peer and waits for theirs.
pub(super) fn hello(rank: usize, links: &mut [VerbsLink], deadline: Instant, started: Instant) -> Result<()> {
    for l in links.iter_mut() {
        l.data_qp.send_imm(WR_CTRL, IMM_HELLO).map_err(|e| lost(rank, l.peer, format!("hello: {e}")))?;
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

/// Copies `dst.len()` bytes of the concatenation of `bufs`, starting `skip` bytes in.
fn gather(bufs: &[IoSlice<'_>], mut skip: usize, dst: &mut [u8]) {
    let mut filled = 0;
    for b in bufs {
        if skip >= b.len() {
            skip -= b.len();
            continue;
        }
        let take = (b.len() - skip).min(dst.len() - filled);
        dst[filled..filled + take].copy_from_slice(&b[skip..skip + take]);
        filled += take;
        skip = 0;
        if filled == dst.len() {
            return;
        }
    }
}
