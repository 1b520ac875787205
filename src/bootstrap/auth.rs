//! Mutual job-secret authentication for every TCP connection gradwire accepts (the
//! rendezvous store and the tcp transport's links), plus length-prefixed framing.
//!
//! Neither side sends the secret: each proves it holds it with an HMAC-SHA256 over a fresh
//! nonce chosen by the other side, so a recorded handshake is useless to replay.

use crate::error::{Error, Result};
use crate::sys::sock::NoSigpipe;
use hmac::{Hmac, Mac};
use rand::RngCore;
use sha2::Sha256;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"GRADWIR1";
const NONCE: usize = 16;
const MAC: usize = 32;
/// Largest control frame accepted (store values, link hellos): guards against garbage.
pub const MAX_FRAME: usize = 16 << 20;

fn mac(secret: &str, role: &[u8], nonce: &[u8], context: &[u8]) -> [u8; MAC] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    m.update(role);
    m.update(nonce);
    m.update(context);
    m.finalize().into_bytes().into()
}

fn verify(secret: &str, role: &[u8], nonce: &[u8], context: &[u8], tag: &[u8]) -> bool {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key length");
    m.update(role);
    m.update(nonce);
    m.update(context);
    m.verify_slice(tag).is_ok()
}

fn nonce() -> [u8; NONCE] {
    let mut n = [0u8; NONCE];
    rand::rng().fill_bytes(&mut n);
    n
}

fn io(what: &str, peer: &str) -> impl FnOnce(std::io::Error) -> Error {
    let what = format!("{what} with {peer}");
    move |e| Error::io(what, e)
}

/// Fills `buf` from `s` by `until` in all: a per-read timeout alone would let a client that
/// trickles a byte at a time hold the caller for as long as it likes.
pub fn read_exact_by(s: &mut TcpStream, buf: &mut [u8], until: Instant) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "too slow (deadline passed)"));
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Accepting side, done by `until`. `context` binds the handshake to a purpose (e.g. store
/// vs a link of a given communicator) so a proof for one cannot be replayed for another.
pub fn accept(s: &mut TcpStream, secret: &str, context: &[u8], until: Instant) -> Result<()> {
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let my_nonce = nonce();
    let mut hello = MAGIC.to_vec();
    hello.extend_from_slice(&my_nonce);
    s.set_write_timeout(Some(until.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)))).map_err(io("auth hello", &peer))?;
    NoSigpipe(&*s).write_all(&hello).map_err(io("auth hello", &peer))?;
    let mut reply = [0u8; MAC + NONCE];
    read_exact_by(s, &mut reply, until).map_err(io("auth reply", &peer))?;
    if !verify(secret, b"client", &my_nonce, context, &reply[..MAC]) {
        let _ = NoSigpipe(&*s).write_all(&[0]);
        return Err(Error::Auth(format!("refused connection from {peer}: it did not prove the job secret (GRADWIRE_JOB_SECRET differs?)")));
    }
    let mut ok = vec![1u8];
    ok.extend_from_slice(&mac(secret, b"server", &reply[MAC..], context));
    NoSigpipe(&*s).write_all(&ok).map_err(io("auth accept", &peer))?;
    s.set_write_timeout(None).map_err(io("auth accept", &peer))?;
    Ok(())
}

/// Connecting side of [`accept`].
pub fn connect(s: &mut TcpStream, secret: &str, context: &[u8]) -> Result<()> {
    let peer = s.peer_addr().map(|a| a.to_string()).unwrap_or_else(|_| "?".into());
    let mut hello = [0u8; 8 + NONCE];
    s.read_exact(&mut hello).map_err(io("auth hello", &peer))?;
    if &hello[..8] != MAGIC {
        return Err(Error::Protocol(format!("{peer} is not a gradwire endpoint (bad greeting)")));
    }
    let my_nonce = nonce();
    let mut reply = mac(secret, b"client", &hello[8..], context).to_vec();
    reply.extend_from_slice(&my_nonce);
    NoSigpipe(&*s).write_all(&reply).map_err(io("auth reply", &peer))?;
    let mut status = [0u8; 1];
    s.read_exact(&mut status).map_err(|_| Error::Auth(format!("{peer} refused our job secret (GRADWIRE_JOB_SECRET differs?)")))?;
    if status[0] != 1 {
        return Err(Error::Auth(format!("{peer} refused our job secret (GRADWIRE_JOB_SECRET differs?)")));
    }
    let mut proof = [0u8; MAC];
    s.read_exact(&mut proof).map_err(io("auth proof", &peer))?;
    if !verify(secret, b"server", &my_nonce, context, &proof) {
        return Err(Error::Auth(format!("{peer} could not prove the job secret; refusing to talk to it")));
    }
    Ok(())
}

/// Writes one length-prefixed frame (never raising SIGPIPE: the store's client and server
/// run inside C and Python hosts too, whose peer may be gone).
pub fn write_frame(s: &TcpStream, data: &[u8]) -> std::io::Result<()> {
    let len = u32::try_from(data.len()).map_err(|_| std::io::Error::other("frame too large"))?;
    let mut buf = Vec::with_capacity(4 + data.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(data);
    NoSigpipe(s).write_all(&buf)
}

/// Reads one length-prefixed frame of at most [`MAX_FRAME`] bytes.
pub fn read_frame(s: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("frame of {len} bytes exceeds {MAX_FRAME}")));
    }
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// Connects to `addr`, retrying refused connections until `deadline` (the listener may not
/// be up yet), then authenticates.
pub fn dial(addr: &str, secret: &str, context: &[u8], deadline: std::time::Instant, what: &str) -> Result<TcpStream> {
    use std::net::ToSocketAddrs;
    let mut last_err = None;
    loop {
        let targets: Vec<_> = match addr.to_socket_addrs() {
            Ok(t) => t.collect(),
            Err(e) => return Err(Error::io(format!("resolve {what} address {addr}"), e)),
        };
        for t in &targets {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break;
            }
            match TcpStream::connect_timeout(t, left.min(std::time::Duration::from_secs(2))) {
                Ok(mut s) => {
                    s.set_nodelay(true).ok();
                    s.set_read_timeout(Some(left.max(std::time::Duration::from_millis(100)))).ok();
                    match connect(&mut s, secret, context) {
                        Ok(()) => {
                            s.set_read_timeout(None).ok();
                            return Ok(s);
                        }
                        // Closed before the greeting: a listener going away (a store being
                        // replaced) or one turning connections away while full. Try again.
                        Err(Error::Io { source, .. }) if matches!(source.kind(), std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::UnexpectedEof) => {
                            last_err = Some(source)
                        }
                        Err(e) => return Err(e),
                    }
                }
                Err(e) => last_err = Some(e),
            }
        }
        if std::time::Instant::now() >= deadline {
            let e = last_err.unwrap_or_else(|| std::io::Error::other("no address"));
            return Err(Error::io(format!("connect to {what} at {addr} (deadline passed; is it running?)"), e));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Most connections that may be proving the job secret at once on one listener, so that
/// strangers cannot make a process spawn threads without bound. Past it, a new connection
/// cuts off the oldest unproven one if that has had [`STALE_HANDSHAKE`] (a rank's own
/// handshake takes milliseconds), else it is closed at once and a rank dialling retries:
/// either way a rank arriving after a crowd of silent connections still gets in.
pub const MAX_PENDING_HANDSHAKES: usize = 64;

/// How long an unproven connection is safe from being cut off for a newer one.
pub const STALE_HANDSHAKE: Duration = Duration::from_millis(500);

/// The handshakes in progress on one listener, oldest first.
#[derive(Default)]
pub struct Handshakes {
    pending: std::sync::Mutex<std::collections::VecDeque<(u64, Instant, TcpStream)>>,
    next: std::sync::atomic::AtomicU64,
}

impl Handshakes {
    /// Counts `s` in and returns the id to pass to [`Handshakes::done`] when its
    /// handshake ends; `None` (and `s` closed) when the table is full of fresh handshakes.
    pub fn admit(&self, s: &TcpStream) -> Option<u64> {
        let mut pending = self.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.len() >= MAX_PENDING_HANDSHAKES {
            let stale = pending.front().is_some_and(|(_, since, _)| since.elapsed() >= STALE_HANDSHAKE);
            if !stale {
                let _ = s.shutdown(std::net::Shutdown::Both);
                return None;
            }
            if let Some((_, _, oldest)) = pending.pop_front() {
                log::warn!(
                    "{MAX_PENDING_HANDSHAKES} connections are proving the job secret at once; cutting off the oldest, from {:?}",
                    oldest.peer_addr().ok()
                );
                let _ = oldest.shutdown(std::net::Shutdown::Both);
            }
        }
        let id = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(clone) = s.try_clone() {
            pending.push_back((id, Instant::now(), clone));
        }
        Some(id)
    }

    /// Counts out the handshake that [`Handshakes::admit`] returned `id` for (proven or failed).
    pub fn done(&self, id: u64) {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).retain(|(i, _, _)| *i != id);
    }
}

/// How long a connection has to prove the job secret.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

/// A listener served by [`serve_authenticated`]; dropping it stops accepting and returns
/// once the port is free. Connections already accepted are served on.
pub struct Listening {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    fd: std::os::fd::RawFd,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Listening {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        // Wakes the accept loop's poll at once. SAFETY: the accept thread owns the fd
        // until it is joined below, so it is still this listener's.
        unsafe { libc::shutdown(self.fd, libc::SHUT_RDWR) };
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How often an idle accept loop looks whether its [`Listening`] was dropped (a dropped
/// one also wakes it at once).
const ACCEPT_POLL: i32 = 100;

/// Serves `listener` on a background thread: every connection gets its own thread, must
/// prove the job secret (bound to `context`) within [`HANDSHAKE_DEADLINE`], and is then
/// handed to `serve`. Handshakes run concurrently, at most [`MAX_PENDING_HANDSHAKES`] at a
/// time (see [`Handshakes`]). Refused connections are logged with the peer's address.
pub fn serve_authenticated<F>(listener: std::net::TcpListener, secret: &str, context: &str, name: &str, serve: F) -> crate::error::Result<Listening>
where
    F: Fn(&mut TcpStream) -> std::io::Result<()> + Send + Sync + 'static,
{
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let serve = Arc::new(serve);
    let (secret, context, who) = (secret.to_string(), context.to_string(), name.to_string());
    let stop = Arc::new(AtomicBool::new(false));
    let stopped = stop.clone();
    let handshakes = Arc::new(Handshakes::default());
    // Non-blocking: a connection reset between poll and accept must not block the loop.
    listener.set_nonblocking(true).map_err(|e| Error::io(format!("{name}: nonblocking listener"), e))?;
    let fd = listener.as_raw_fd();
    let thread = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || loop {
            if stopped.load(Ordering::Acquire) {
                return;
            }
            let mut pfd = libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            if crate::sys::poll::poll(std::slice::from_mut(&mut pfd), ACCEPT_POLL) <= 0 || stopped.load(Ordering::Acquire) {
                continue;
            }
            let (mut s, peer) = match listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(_) => {
                    // Out of descriptors, say: retrying at once would only spin.
                    std::thread::sleep(Duration::from_millis(50));
                    continue;
                }
            };
            s.set_nonblocking(false).ok();
            let Some(id) = handshakes.admit(&s) else {
                super::refusals::warn(|| format!("{who}: {MAX_PENDING_HANDSHAKES} connections are proving the job secret at once; closed the one from {peer}"));
                continue;
            };
            let (serve, secret, context, who, in_handshake) = (serve.clone(), secret.clone(), context.clone(), who.clone(), handshakes.clone());
            let spawned = std::thread::Builder::new().name(format!("{who}-conn")).spawn(move || {
                s.set_nodelay(true).ok();
                let proven = accept(&mut s, &secret, context.as_bytes(), Instant::now() + HANDSHAKE_DEADLINE);
                in_handshake.done(id);
                if let Err(e) = proven {
                    super::refusals::warn(|| format!("{who}: {e} (from {peer})"));
                    return;
                }
                s.set_read_timeout(None).ok();
                if let Err(e) = serve(&mut s) {
                    log::debug!("{who}: client left: {e}");
                }
            });
            if spawned.is_err() {
                handshakes.done(id);
            }
        })
        .map_err(|e| Error::io(format!("spawn {name}"), e))?;
    Ok(Listening { stop, fd, thread: Some(thread) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client that trickles its handshake a byte at a time is cut off at the handshake's
    /// deadline, not after a per-read timeout for every byte.
    #[test]
    fn a_trickling_handshake_is_cut_off_at_its_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let trickler = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            for _ in 0..MAC + NONCE {
                if s.write_all(&[0]).is_err() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        let (mut s, _) = listener.accept().unwrap();
        let t = Instant::now();
        let e = accept(&mut s, "secret-123", b"ctx", Instant::now() + Duration::from_millis(400)).expect_err("an unfinished handshake must fail");
        assert!(t.elapsed() < Duration::from_millis(3000), "it took {:?} (the trickle lasts 4.8 s)", t.elapsed());
        assert!(e.to_string().contains("auth reply"), "{e}");
        drop(s);
        trickler.join().unwrap();
    }
}
