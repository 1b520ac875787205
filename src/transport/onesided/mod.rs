//! One-sided operations — write, read, fetch-add into a peer's registered region — on
//! every transport. On shm the peer's memfd region is mapped and accessed directly (CPU
//! atomics for fetch-add, unless ranks on other hosts reach it over RDMA: see
//! `NicAtomics`); on verbs they are RDMA WRITE, READ and atomic fetch-and-add on a queue
//! pair of the window's own; on tcp a service thread on the target applies requests, so the
//! target's application never takes part, as with RDMA. The remote-memory layer (token ring,
//! parameter-server shards) is built on this.
//!
//! Two operations exist for tcp's sake: [`Window::read_sequence`] sends several reads in one
//! round trip (the service answers them in order), and [`Window::accumulate`] hands a
//! payload to an [`Accumulate`] the region's owner registered, which applies it while it
//! arrives (what a smart NIC would do; on shm the caller works in place instead, and verbs
//! has only the NIC's own operations).
//!
//! Files: this one the [`Window`] and its dispatch per peer; `service` the tcp service
//! and its wire protocol; `verbs` the queue pairs of a window and the NIC's atomics.

mod service;
mod verbs;

pub use service::RmaService;

use service::{OP_ACCUMULATE, OP_FADD, OP_READ, OP_WRITE, REASON_MAX, REQ_LEN};
use verbs::{verbs_setup, NicAtomics};

use crate::bootstrap::{auth, StoreClient};
use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use crate::sys::sock::NoSigpipe;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The owner's side of [`Window::accumulate`] on tcp: applies a peer's payload to the
/// owner's memory while it arrives, so the bytes are touched once, in cache, by the thread
/// that receives them (a write into place followed by a separate pass would touch them
/// twice, and on another thread).
pub trait Accumulate: Send + Sync {
    /// Applies the `len`-byte payload of a request tagged `tag` at `off`. `recv` fills a
    /// buffer with the payload's next bytes (under the window's deadline). Refusing skips
    /// whatever of the payload was not received yet.
    fn accumulate(&self, tag: u64, off: usize, len: usize, recv: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>) -> std::result::Result<(), AccumulateError>;
}

/// Why an accumulate failed on the owner's side.
#[derive(Debug)]
pub enum AccumulateError {
    /// The owner refused it (told to the peer).
    Refused(String),
    /// The connection failed while receiving the payload.
    Io(std::io::Error),
}

impl From<std::io::Error> for AccumulateError {
    fn from(e: std::io::Error) -> Self {
        AccumulateError::Io(e)
    }
}

/// What a communicator keeps for the windows it exposes: their next id, the one-sided
/// service for tcp peers (started by the first window that has some), and the RDMA device
/// of its verbs links.
pub(crate) struct Windows {
    next_id: AtomicU64,
    service: std::sync::OnceLock<RmaService>,
    verbs: Option<Arc<crate::transport::verbs::Domain>>,
}

impl Windows {
    pub(crate) fn new(verbs: Option<Arc<crate::transport::verbs::Domain>>) -> Self {
        Windows { next_id: AtomicU64::new(0), service: std::sync::OnceLock::new(), verbs }
    }

    /// The next window's id (every rank counts its windows alike).
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The one-sided service, started by `start` the first time.
    pub(crate) fn service(&self, start: impl FnOnce() -> Result<RmaService>) -> Result<&RmaService> {
        if self.service.get().is_none() {
            let _ = self.service.set(start()?);
        }
        Ok(self.service.get().expect("set above"))
    }

    /// The RDMA device of the communicator's verbs links.
    pub(crate) fn verbs(&self) -> Option<&Arc<crate::transport::verbs::Domain>> {
        self.verbs.as_ref()
    }
}

/// How this rank reaches one peer's part of a window.
enum Target {
    Own,
    Mapped(Region),
    Remote(Mutex<TcpStream>),
    Verbs(Mutex<super::verbs::RmaPeer>),
}

/// A window: every rank's exposed region, reachable by one-sided operations.
pub struct Window {
    id: u64,
    rank: usize,
    own: Arc<Region>,
    targets: Vec<Target>,
    lens: Vec<usize>,
    /// Process ids of the peers mapped through shared memory (their liveness is not
    /// visible through a connection).
    pids: Vec<Option<u32>>,
    /// Per peer: when its process was last seen alive (ms since `born`), so that an access
    /// to a dead peer's mapped region fails naming it (its memory stays mapped and would
    /// answer for ever) at the cost of one look at /proc per peer per [`LIVENESS_EVERY`].
    seen_alive: Vec<AtomicU64>,
    born: Instant,
    timeout: Duration,
    /// This rank's atomics on regions it maps, through the NIC, when other ranks reach
    /// those regions through the NIC (see [`NicAtomics`]).
    nic_atomics: Option<NicAtomics>,
}

/// How often an access to a mapped peer's region looks whether the peer is still alive.
pub const LIVENESS_EVERY: Duration = Duration::from_millis(20);

/// What a window needs from its communicator to connect.
pub struct WindowSetup<'a> {
    /// The communicator's key prefix: scopes the window's store keys and the services' handshake.
    pub prefix: &'a str,
    /// The window's number in its communicator (the same on every rank: windows are made in order).
    pub id: u64,
    /// This rank's number in the communicator.
    pub rank: usize,
    /// Number of ranks in the communicator.
    pub world: usize,
    /// Per peer: reach it through shared memory (same host) or tcp.
    pub shm_peer: &'a [bool],
    /// Per peer: reach it through RDMA on this domain (takes precedence over tcp).
    pub verbs: Option<(&'a std::sync::Arc<super::verbs::Domain>, &'a [bool])>,
    /// The rendezvous store the ranks publish their window handles in (`None`: a job of one rank).
    pub store: Option<&'a StoreClient>,
    /// This rank's one-sided service, serving the region to tcp peers (`None`: it has none).
    pub service: Option<&'a RmaService>,
    /// The job secret to prove when dialling peers' services.
    pub secret: &'a str,
    /// Deadline of the setup and of each later request.
    pub timeout: Duration,
    /// How tcp peers' accumulates are applied to this rank's region (refused without).
    pub accumulate: Option<Arc<dyn Accumulate>>,
}

impl WindowSetup<'_> {
    /// What `peer` published under `key` during this window's setup; a timeout names the
    /// peer and what it never did.
    fn published_by(&self, store: &StoreClient, key: &str, peer: usize, never: &str, deadline: Instant) -> Result<Vec<u8>> {
        store.get(key, deadline)?.ok_or_else(|| Error::Timeout {
            rank: self.rank,
            peer,
            op: format!("window {} setup (rank {peer} {never})", self.id),
            waited_ms: self.timeout.as_millis() as u64,
        })
    }
}

impl Window {
    /// Exposes `region` and connects to every peer's (collective: every rank calls it).
    pub fn create(w: WindowSetup<'_>, region: Arc<Region>) -> Result<Window> {
        let deadline = Instant::now() + w.timeout;
        let fd = region.shared_fd().unwrap_or(-1);
        if w.shm_peer.iter().any(|&s| s) && fd < 0 {
            return Err(invalid("a window shared with ranks on this host needs a shared region (Region::shared / RegionKind::Shared)"));
        }
        if let Some(svc) = w.service {
            svc.expose(w.id, region.clone(), w.accumulate.clone(), w.timeout, None);
        }
        let key = |r: usize| format!("{}/win{}/{r}", w.prefix, w.id);
        let svc_addr = w.service.map(|s| s.addr.clone()).unwrap_or_default();
        let mut targets = Vec::with_capacity(w.world);
        let mut lens = vec![0; w.world];
        let mut pids = vec![None; w.world];
        if let Some(store) = w.store {
            store.set(&key(w.rank), format!("{} {fd} {} {svc_addr}", std::process::id(), region.len()).as_bytes())?;
        }
        let (mut verbs, nic_atomics) = verbs_setup(&w, &region, deadline)?;
        for (p, peer_len) in lens.iter_mut().enumerate() {
            if let Some(peer) = verbs[p].take() {
                *peer_len = peer.remote_len();
                pids[p] = peer.local_pid();
                targets.push(Target::Verbs(Mutex::new(peer)));
                continue;
            }
            if p == w.rank {
                targets.push(Target::Own);
                *peer_len = region.len();
                continue;
            }
            let store = w.store.ok_or_else(|| invalid("no rendezvous store"))?;
            let v = w.published_by(store, &key(p), p, "never exposed its region", deadline)?;
            let text = String::from_utf8_lossy(&v).into_owned();
            let f: Vec<&str> = text.split(' ').collect();
            let (Some(pid), Some(pfd), Some(len), Some(addr)) = (
                f.first().and_then(|x| x.parse::<u32>().ok()),
                f.get(1).and_then(|x| x.parse::<i32>().ok()),
                f.get(2).and_then(|x| x.parse::<usize>().ok()),
                f.get(3),
            ) else {
                return Err(Error::Protocol(format!("rank {p} published a malformed window handle {text:?}")));
            };
            *peer_len = len;
            targets.push(if w.shm_peer[p] {
                pids[p] = Some(pid);
                Target::Mapped(Region::open_shared(pid, pfd, len)?)
            } else {
                let s = auth::dial(addr, w.secret, format!("rma:{}", w.prefix).as_bytes(), deadline, &format!("rank {p}'s one-sided service"))?;
                s.set_read_timeout(Some(w.timeout)).ok();
                s.set_write_timeout(Some(w.timeout)).ok();
                Target::Remote(Mutex::new(s))
            });
        }
        Ok(Window {
            id: w.id,
            rank: w.rank,
            own: region,
            targets,
            lens,
            seen_alive: (0..w.world).map(|_| AtomicU64::new(0)).collect(),
            born: Instant::now(),
            pids,
            timeout: w.timeout,
            nic_atomics,
        })
    }

    /// Why `peer` is gone, for peers whose death no connection reports (shared memory, and
    /// verbs peers on this host).
    pub fn peer_gone(&self, peer: usize) -> Option<String> {
        self.pids.get(peer).copied().flatten().and_then(crate::sys::proc::process_gone)
    }

    /// This rank's number in the window's communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the window.
    pub fn size(&self) -> usize {
        self.targets.len()
    }

    /// Bytes rank `peer` exposed.
    pub fn len_of(&self, peer: usize) -> usize {
        self.lens.get(peer).copied().unwrap_or(0)
    }

    /// This rank's own exposed region.
    pub fn local(&self) -> &Arc<Region> {
        &self.own
    }

    fn check(&self, peer: usize, off: usize, len: usize, what: &str) -> Result<()> {
        if peer >= self.targets.len() {
            return Err(invalid(format!("{what}: rank {peer} is not in this window")));
        }
        if off.checked_add(len).is_none_or(|e| e > self.lens[peer]) {
            return Err(invalid(format!("{what}: [{off}, {off}+{len}) is outside rank {peer}'s {} bytes", self.lens[peer])));
        }
        self.alive(peer, what)
    }

    /// Fails naming `peer` when its process, whose region is mapped here, has exited
    /// (looked at once per [`LIVENESS_EVERY`] per peer).
    pub(crate) fn alive(&self, peer: usize, what: &str) -> Result<()> {
        if self.pids.get(peer).copied().flatten().is_none() {
            return Ok(());
        }
        let now = self.born.elapsed().as_millis() as u64;
        let seen = &self.seen_alive[peer];
        if now.saturating_sub(seen.load(Ordering::Relaxed)) < LIVENESS_EVERY.as_millis() as u64 {
            return Ok(());
        }
        match self.peer_gone(peer) {
            Some(cause) => Err(Error::PeerLost { rank: self.rank, peer, op: what.into(), cause }),
            None => {
                seen.store(now, Ordering::Relaxed);
                Ok(())
            }
        }
    }

    /// Where `peer`'s region is mapped into this process (this rank, and peers on shared
    /// memory), for callers that work on it in place; `None` for peers behind a network.
    /// All access through it must follow the owner's protocol for that memory.
    pub fn mapped(&self, peer: usize) -> Option<*mut u8> {
        self.targets.get(peer).and_then(|_| self.base(peer))
    }

    /// Whether every rank's region is mapped into this process (then so is ours into theirs).
    pub fn all_mapped(&self) -> bool {
        (0..self.targets.len()).all(|p| self.base(p).is_some())
    }

    fn base(&self, peer: usize) -> Option<*mut u8> {
        match &self.targets[peer] {
            Target::Own => Some(self.own.as_ptr()),
            Target::Mapped(r) => Some(r.as_ptr()),
            _ => None,
        }
    }

    fn lost(&self, peer: usize, what: &str, e: std::io::Error) -> Error {
        let cause = if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) {
            format!("no answer within {} ms", self.timeout.as_millis())
        } else {
            format!("{e} (process exited or was killed?)")
        };
        Error::PeerLost { rank: self.rank, peer, op: what.into(), cause }
    }

    fn remote(&self, peer: usize, req: &[u8], payload: &[u8], reply: &mut [u8], what: &str) -> Result<()> {
        let Target::Remote(conn) = &self.targets[peer] else {
            return Err(invalid("not a remote peer"));
        };
        let mut s = conn.lock().unwrap_or_else(|p| p.into_inner());
        // Header and payload as two writes: copying a large payload behind the header
        // would cost a pass over it; a small one rides in the header's segment.
        let sent = if payload.len() <= 4096 {
            let mut msg = req.to_vec();
            msg.extend_from_slice(payload);
            NoSigpipe(&*s).write_all(&msg)
        } else {
            NoSigpipe(&*s).write_all(req).and_then(|_| NoSigpipe(&*s).write_all(payload))
        };
        let r = sent.map_err(Err).and_then(|_| self.reply(&mut s, peer, reply, what));
        if let Err(Err(_)) = &r {
            // A connection that failed mid-request (say a reply later than our timeout) is
            // out of step: a later request must not read this one's reply as its own.
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
        r.map_err(|e| e.unwrap_or_else(|e| self.lost(peer, what, e)))
    }

    /// Reads one reply: the status byte, then `reply`'s bytes or the refusal's reason. Outer
    /// error: the connection failed; inner: the peer refused (the connection stays usable).
    fn reply(&self, s: &mut TcpStream, peer: usize, reply: &mut [u8], what: &str) -> std::result::Result<(), std::result::Result<Error, std::io::Error>> {
        let mut status = [0u8; 1];
        s.read_exact(&mut status).map_err(Err)?;
        if status[0] != 1 {
            let mut n = [0u8; 2];
            s.read_exact(&mut n).map_err(Err)?;
            // Read all of it (the stream stays in step), show at most REASON_MAX bytes.
            let mut why = vec![0u8; usize::from(u16::from_le_bytes(n))];
            s.read_exact(&mut why).map_err(Err)?;
            why.truncate(REASON_MAX);
            return Err(Ok(Error::Protocol(format!("rank {}: rank {peer} refused {what}: {}", self.rank, String::from_utf8_lossy(&why)))));
        }
        s.read_exact(reply).map_err(Err)
    }

    fn request(op: u8, off: usize, arg: u64) -> [u8; REQ_LEN] {
        let mut r = [0u8; REQ_LEN];
        r[0] = op;
        r[9..17].copy_from_slice(&(off as u64).to_le_bytes());
        r[17..25].copy_from_slice(&arg.to_le_bytes());
        r
    }

    /// Whether [`Window::accumulate`] reaches `peer`: peers behind tcp, whose one-sided
    /// service applies it. Mapped peers are worked on in place, and verbs peers have only
    /// the NIC's operations.
    pub fn accumulates(&self, peer: usize) -> bool {
        matches!(self.targets.get(peer), Some(Target::Remote(_)))
    }

    /// Sends `data` to be applied at `off` in `peer`'s region by the [`Accumulate`] its
    /// owner exposed the window with, which also gets `tag`; complete (applied) on return.
    /// Only for peers where [`Window::accumulates`] holds.
    pub fn accumulate(&self, peer: usize, off: usize, data: &[u8], tag: u64) -> Result<()> {
        self.check(peer, off, data.len(), "one-sided accumulate")?;
        if !self.accumulates(peer) {
            return Err(invalid(format!("one-sided accumulate: rank {peer} is not reached through a one-sided service")));
        }
        let mut req = self.with_id(Self::request(OP_ACCUMULATE, off, data.len() as u64));
        req[25..33].copy_from_slice(&tag.to_le_bytes());
        self.remote(peer, &req, data, &mut [], "one-sided accumulate")
    }

    fn with_id(&self, mut r: [u8; REQ_LEN]) -> [u8; REQ_LEN] {
        r[1..9].copy_from_slice(&self.id.to_le_bytes());
        r
    }

    /// Writes `data` at `off` in `peer`'s region; complete (visible there) on return.
    pub fn write(&self, peer: usize, off: usize, data: &[u8]) -> Result<()> {
        self.check(peer, off, data.len(), "one-sided write")?;
        if let Some(r) = self.on_verbs(peer, "one-sided write", false, |rma, deadline| rma.write(off, data, deadline)) {
            return r;
        }
        match self.base(peer) {
            // SAFETY: bounds checked; the owner exposed the region for peer writes.
            Some(b) => unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), b.add(off), data.len()) },
            None => self.remote(peer, &self.with_id(Self::request(OP_WRITE, off, data.len() as u64)), data, &mut [], "one-sided write")?,
        }
        std::sync::atomic::fence(Ordering::Release);
        Ok(())
    }

    /// Reads `buf.len()` bytes at `off` from `peer`'s region.
    pub fn read(&self, peer: usize, off: usize, buf: &mut [u8]) -> Result<()> {
        self.check(peer, off, buf.len(), "one-sided read")?;
        if let Some(r) = self.on_verbs(peer, "one-sided read", false, |rma, deadline| rma.read(off, buf, deadline)) {
            return r;
        }
        std::sync::atomic::fence(Ordering::Acquire);
        match self.base(peer) {
            // SAFETY: bounds checked.
            Some(b) => unsafe { std::ptr::copy_nonoverlapping(b.add(off), buf.as_mut_ptr(), buf.len()) },
            None => self.remote(peer, &self.with_id(Self::request(OP_READ, off, buf.len() as u64)), &[], buf, "one-sided read")?,
        }
        Ok(())
    }

    /// Reads several ranges of `peer`'s region in order, each finished on the peer before
    /// the next begins (so a seqlock's version, data, version can be read this way), in one
    /// round trip on tcp: the requests go out together and the service answers them in turn.
    pub fn read_sequence(&self, peer: usize, reads: &mut [(usize, &mut [u8])]) -> Result<()> {
        for (off, buf) in reads.iter() {
            self.check(peer, *off, buf.len(), "one-sided read")?;
        }
        let Target::Remote(conn) = &self.targets[peer] else {
            return reads.iter_mut().try_for_each(|(off, buf)| self.read(peer, *off, buf));
        };
        let what = "one-sided read";
        let requests: Vec<u8> = reads.iter().flat_map(|(off, buf)| self.with_id(Self::request(OP_READ, *off, buf.len() as u64))).collect();
        let mut s = conn.lock().unwrap_or_else(|p| p.into_inner());
        NoSigpipe(&*s).write_all(&requests).map_err(|e| self.lost(peer, what, e))?;
        // Every reply is taken off the connection, even after a refusal, so that it stays
        // in step; the first refusal is the error.
        let mut refused = None;
        for (_, buf) in reads.iter_mut() {
            match self.reply(&mut s, peer, buf, what) {
                Ok(()) => {}
                Err(Ok(e)) => refused = refused.or(Some(e)),
                Err(Err(e)) => return Err(self.lost(peer, what, e)),
            }
        }
        refused.map_or(Ok(()), Err)
    }

    /// Atomically adds `value` to the u64 at `off` (8-aligned) in `peer`'s region and
    /// returns the previous value.
    pub fn fetch_add(&self, peer: usize, off: usize, value: u64) -> Result<u64> {
        self.check(peer, off, 8, "one-sided fetch-add")?;
        if off % 8 != 0 {
            return Err(invalid(format!("one-sided fetch-add: offset {off} is not 8-aligned")));
        }
        if let Some(r) = self.on_verbs(peer, "one-sided fetch-add", true, |rma, deadline| rma.fetch_add(off, value, deadline)) {
            return r;
        }
        match self.base(peer) {
            // SAFETY: aligned word inside the mapping; every access to it is atomic.
            Some(b) => Ok(unsafe { &*(b.add(off) as *const AtomicU64) }.fetch_add(value, Ordering::AcqRel)),
            None => {
                let mut old = [0u8; 8];
                self.remote(peer, &self.with_id(Self::request(OP_FADD, off, value)), &[], &mut old, "one-sided fetch-add")?;
                Ok(u64::from_le_bytes(old))
            }
        }
    }
}
