//! How TCP links are set up: lower ranks listen, higher ranks dial, every connection proves
//! the job secret.

use super::link::TcpLink;
use crate::bootstrap::{auth, StoreClient};
use crate::error::{Error, Result};
use crate::sys::sock::NoSigpipe;
use crate::transport::{Link, LinkTable};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

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
        let s = auth::dial(&peer_addr, secret, context.as_bytes(), deadline, &format!("rank {p}"))?;
        NoSigpipe(&s).write_all(&(rank as u32).to_le_bytes()).map_err(|e| Error::io(format!("hello to rank {p}"), e))?;
        links[p] = Some(finish(s)?);
    }
    let mut expected: Vec<usize> = peers.iter().copied().filter(|&p| p > rank).collect();
    listener.set_nonblocking(true).map_err(|e| Error::io("listener nonblocking", e))?;
    // Every handshake runs on its own thread with its own deadline, so a connection that
    // stays silent (or a crowd of them) cannot delay or break the ranks' own.
    let (proven_tx, proven) = crossbeam_channel::unbounded::<(usize, TcpStream, std::net::SocketAddr)>();
    let handshakes = Arc::new(auth::Handshakes::default());
    while !expected.is_empty() {
        if Instant::now() >= deadline {
            return Err(Error::Timeout {
                rank,
                peer: expected[0],
                op: "tcp connect (peer never dialled in)".into(),
                waited_ms: started.elapsed().as_millis() as u64,
            });
        }
        let mut busy = false;
        match listener.accept() {
            Ok((mut s, from)) => {
                busy = true;
                let Some(id) = handshakes.admit(&s) else {
                    crate::bootstrap::refusals::warn(|| {
                        format!(
                            "rank {rank}: tcp transport: {} connections are proving the job secret at once; closed the one from {from}",
                            auth::MAX_PENDING_HANDSHAKES
                        )
                    });
                    continue;
                };
                let (secret, context, tx, in_handshake) = (secret.to_string(), context.clone(), proven_tx.clone(), handshakes.clone());
                let until = deadline.min(Instant::now() + auth::HANDSHAKE_DEADLINE);
                let spawned = std::thread::Builder::new().name(format!("gradwire-r{rank}-handshake")).spawn(move || {
                    s.set_nonblocking(false).ok();
                    let hello = auth::accept(&mut s, &secret, context.as_bytes(), until).and_then(|()| {
                        let mut hello = [0u8; 4];
                        auth::read_exact_by(&mut s, &mut hello, until).map_err(|e| Error::io(format!("hello from {from}"), e))?;
                        Ok(u32::from_le_bytes(hello) as usize)
                    });
                    in_handshake.done(id);
                    match hello {
                        Ok(p) => {
                            let _ = tx.send((p, s, from));
                        }
                        Err(e) => crate::bootstrap::refusals::warn(|| format!("rank {rank}: tcp transport: {e}; connection dropped")),
                    }
                });
                if let Err(e) = spawned {
                    handshakes.done(id);
                    log::warn!("rank {rank}: tcp transport: no thread for the handshake with {from}: {e}");
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(Error::io("accept tcp link", e)),
        }
        while let Ok((p, s, from)) = proven.try_recv() {
            busy = true;
            match expected.iter().position(|&e| e == p) {
                Some(i) => {
                    expected.swap_remove(i);
                    links[p] = Some(finish(s)?);
                }
                None => log::warn!("rank {rank}: unexpected hello from rank {p} at {from}; dropped"),
            }
        }
        if !busy {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    Ok(links)
}

fn finish(s: TcpStream) -> Result<Box<dyn Link>> {
    s.set_nodelay(true).ok();
    s.set_read_timeout(None).ok();
    // Socket buffers stay with the kernel's autotuning. Fixed 4 MiB buffers were slower:
    // data waits longer between the sender's copy in and the receiver's copy out and
    // leaves the cache.
    s.set_nonblocking(true).map_err(|e| Error::io("set tcp link nonblocking", e))?;
    Ok(Box::new(TcpLink { stream: s }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bootstrap::StoreServer;

    /// Connections that never prove the job secret do not delay the ranks' own: each
    /// handshake runs on its own with its own deadline (one silent connection used to hold
    /// setup for 5 s, two made it fail).
    #[test]
    fn silent_strangers_cannot_stall_setup() {
        let store = StoreServer::start("127.0.0.1:0", "secret-123").unwrap();
        let addr = store.addr.to_string();
        let deadline = Instant::now() + Duration::from_secs(8);
        let client = || StoreClient::connect(&addr, "secret-123", deadline).unwrap();
        let (c0, c1, spy) = (client(), client(), client());
        let started = Instant::now();
        let rank0 = std::thread::spawn(move || connect_all("t", 0, 2, &[1], &c0, "secret-123", deadline).map(|l| l[1].is_some()));
        let at = String::from_utf8(spy.get("t/tcp/0", deadline).unwrap().unwrap()).unwrap();
        let strangers: Vec<TcpStream> = (0..3).map(|_| TcpStream::connect(&at).unwrap()).collect();
        std::thread::sleep(Duration::from_millis(100));
        let rank1 = connect_all("t", 1, 2, &[0], &c1, "secret-123", deadline).unwrap();
        assert!(rank1[0].is_some());
        assert!(rank0.join().unwrap().unwrap());
        assert!(started.elapsed() < Duration::from_secs(3), "setup took {:?} beside {} silent connections", started.elapsed(), strangers.len());
    }
}
