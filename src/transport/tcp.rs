//! TCP transport: one authenticated, non-blocking stream per peer pair, vectored writes,
//! Nagle off. Works on loopback, across network namespaces and across hosts.

use super::{Link, LinkTable};
use crate::bootstrap::{auth, StoreClient};
use crate::error::{Error, Result};
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// A link to one peer over TCP.
pub struct TcpLink {
    stream: TcpStream,
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted)
}

impl Link for TcpLink {
    fn kind(&self) -> &'static str {
        "tcp"
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match self.stream.write_vectored(bufs) {
            Ok(n) => Ok(n),
            Err(e) if would_block(&e) => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn try_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        match self.stream.read(buf) {
            Ok(0) => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "peer closed the connection")),
            Ok(n) => Ok(n),
            Err(e) if would_block(&e) => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.stream.as_raw_fd())
    }

    fn shutdown(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

/// Connects this rank to every peer in `peers` (global ranks of this communicator that
/// need a TCP link). Lower ranks listen, higher ranks dial; every connection proves the job
/// secret bound to `prefix`, so a stray or hostile connection is refused and logged.
pub fn connect_all(prefix: &str, rank: usize, world: usize, peers: &[usize], store: &StoreClient, secret: &str, deadline: Instant) -> Result<LinkTable> {
    let started = Instant::now();
    let mut links: LinkTable = (0..world).map(|_| None).collect();
    if peers.is_empty() {
        return Ok(links);
    }
    let ip = store.local_ip()?;
    let listener = TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("bind tcp transport on {ip}"), e))?;
    let addr = listener.local_addr().map_err(|e| Error::io("tcp listener address", e))?;
    store.set(&format!("{prefix}/tcp/{rank}"), addr.to_string().as_bytes())?;
    let context = format!("link:{prefix}");

    for &p in peers.iter().filter(|&&p| p < rank) {
        let peer_addr = store.get(&format!("{prefix}/tcp/{p}"), deadline)?.ok_or_else(|| Error::Timeout {
            rank,
            peer: p,
            op: "tcp connect (peer never published its address)".into(),
            waited_ms: started.elapsed().as_millis() as u64,
        })?;
        let peer_addr = String::from_utf8_lossy(&peer_addr).into_owned();
        let mut s = auth::dial(&peer_addr, secret, context.as_bytes(), deadline, &format!("rank {p}"))?;
        s.write_all(&(rank as u32).to_le_bytes()).map_err(|e| Error::io(format!("hello to rank {p}"), e))?;
        links[p] = Some(finish(s)?);
    }
    let mut expected: Vec<usize> = peers.iter().copied().filter(|&p| p > rank).collect();
    listener.set_nonblocking(true).map_err(|e| Error::io("listener nonblocking", e))?;
    while !expected.is_empty() {
        // Checked on every pass: a stream of connections that never authenticate must not
        // keep us past it.
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                rank,
                peer: expected[0],
                op: "tcp connect (peer never dialled in)".into(),
                waited_ms: started.elapsed().as_millis() as u64,
            });
        }
        match listener.accept() {
            Ok((mut s, from)) => {
                s.set_nonblocking(false).ok();
                // The handshake and hello, all of it within 5 s and the deadline.
                let until = deadline.min(Instant::now() + Duration::from_secs(5));
                if let Err(e) = auth::accept(&mut s, secret, context.as_bytes(), until) {
                    log::warn!("rank {rank}: tcp transport: {e}");
                    continue;
                }
                let mut hello = [0u8; 4];
                if auth::read_exact_by(&mut s, &mut hello, until).is_err() {
                    log::warn!("rank {rank}: connection from {from} sent no hello; dropped");
                    continue;
                }
                let p = u32::from_le_bytes(hello) as usize;
                match expected.iter().position(|&e| e == p) {
                    Some(i) => {
                        expected.swap_remove(i);
                        links[p] = Some(finish(s)?);
                    }
                    None => log::warn!("rank {rank}: unexpected hello from rank {p} at {from}; dropped"),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(2)),
            Err(e) => return Err(Error::io("accept tcp link", e)),
        }
    }
    Ok(links)
}

fn finish(s: TcpStream) -> Result<Box<dyn Link>> {
    s.set_nodelay(true).ok();
    s.set_read_timeout(None).ok();
    // Socket buffers stay with the kernel's autotuning. Fixed 4 MiB buffers were slower:
    // data waits longer between the sender's copy in and the receiver's copy out and
    // leaves the cache (interleaved runs: 4 ranks on loopback 0.90-0.94 against
    // 1.06-1.07 GB/s busbw, 4 namespaces at 10 Gbit/s 0.63-0.64 against 0.72).
    s.set_nonblocking(true).map_err(|e| Error::io("set tcp link nonblocking", e))?;
    Ok(Box::new(TcpLink { stream: s }))
}
