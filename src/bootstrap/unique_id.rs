//! A communicator id that a framework carries to its members, as NCCL's `ncclUniqueId`:
//! one process makes it ([`UniqueId::create`] starts a rendezvous store on a free port of
//! this host, behind a fresh job secret), the framework hands its bytes to every member
//! (torch through its own store), and each member joins with its rank
//! ([`crate::Communicator::from_unique_id`]). Nothing comes from MASTER_PORT or
//! GRADWIRE_JOB_SECRET, so ids never clash with the framework's own rendezvous or with each
//! other, and a subgroup is made by its members alone.
//!
//! The store lives as long as the first communicator this process makes from the id (the
//! usual case: the group's rank 0 made it); if this process never joins, as long as the
//! process.

use super::store::StoreServer;
use crate::error::{invalid, Result};
use std::sync::{Arc, Mutex};

/// Bytes of an id in the C ABI (`GRADWIRE_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;
const MAGIC: &str = "gwid1";

/// Where the members rendezvous and the secret they present.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UniqueId {
    /// Address members dial to reach the store (see [`UniqueId::create`]).
    pub host: String,
    /// The store's TCP port.
    pub port: u16,
    /// The job secret members present (64 hex digits for a created id).
    pub secret: String,
}

/// Stores made for ids and not yet adopted by a communicator of this process, by the
/// address the id gives.
static ISSUED: Mutex<Vec<(String, Arc<StoreServer>)>> = Mutex::new(Vec::new());

impl UniqueId {
    /// Starts a rendezvous store on a free port and returns the id that leads to it. The
    /// address members dial: GRADWIRE_MASTER_ADDR or MASTER_ADDR when it is this host's
    /// (the address the framework already reaches it by); when it is another host's (a
    /// subgroup whose first rank is not on the master's node), this host's address on the
    /// route towards it; else this host's first non-loopback IPv4 address, else loopback.
    pub fn create() -> Result<UniqueId> {
        let host = advertised_host();
        let secret: String = (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect();
        let server = StoreServer::ephemeral(&host, &secret)?;
        let id = UniqueId { host, port: server.addr.port(), secret };
        ISSUED.lock().unwrap_or_else(|p| p.into_inner()).push((format!("{}:{}", id.host, id.port), server));
        Ok(id)
    }

    /// The id as the C ABI's fixed-size bytes: `gwid1 HOST PORT SECRET`, NUL-padded.
    pub fn to_bytes(&self) -> Result<[u8; UNIQUE_ID_BYTES]> {
        let text = format!("{MAGIC} {} {} {}", self.host, self.port, self.secret);
        if text.len() >= UNIQUE_ID_BYTES {
            return Err(invalid(format!("rendezvous address {:?} is too long for a unique id", self.host)));
        }
        let mut out = [0u8; UNIQUE_ID_BYTES];
        out[..text.len()].copy_from_slice(text.as_bytes());
        Ok(out)
    }

    /// The id's bytes as hex digits: what launchers' key-value exchanges carry (PMI-1's
    /// values hold no spaces).
    pub fn to_hex(&self) -> Result<String> {
        Ok(self.to_bytes()?.iter().map(|b| format!("{b:02x}")).collect())
    }

    /// Parses text made by [`UniqueId::to_hex`]; anything else is a clear error.
    pub fn from_hex(hex: &str) -> Result<UniqueId> {
        let hex = hex.trim();
        let bytes: Option<Vec<u8>> = (0..hex.len()).step_by(2).map(|i| hex.get(i..i + 2).and_then(|h| u8::from_str_radix(h, 16).ok())).collect();
        match bytes {
            Some(b) if b.len() == UNIQUE_ID_BYTES => UniqueId::from_bytes(&b),
            _ => Err(invalid(format!("not a gradwire unique id in hex ({} characters, not {})", hex.len(), 2 * UNIQUE_ID_BYTES))),
        }
    }

    /// Parses bytes made by [`UniqueId::to_bytes`]; anything else is a clear error.
    pub fn from_bytes(b: &[u8]) -> Result<UniqueId> {
        let bad = |why: &str| invalid(format!("not a gradwire unique id ({why}): pass the bytes gradwire_get_unique_id wrote, unchanged"));
        if b.len() != UNIQUE_ID_BYTES {
            return Err(bad(&format!("{} bytes, not {UNIQUE_ID_BYTES}", b.len())));
        }
        let end = b.iter().position(|&c| c == 0).ok_or_else(|| bad("no terminating NUL"))?;
        if b[end..].iter().any(|&c| c != 0) {
            return Err(bad("bytes after the terminating NUL"));
        }
        let text = std::str::from_utf8(&b[..end]).map_err(|_| bad("not text"))?;
        let f: Vec<&str> = text.split(' ').collect();
        match f.as_slice() {
            [MAGIC, host, port, secret] if !host.is_empty() && secret.len() == 64 && secret.bytes().all(|c| c.is_ascii_hexdigit()) => {
                let port = port.parse::<u16>().ok().filter(|&p| p > 0).ok_or_else(|| bad("bad port"))?;
                Ok(UniqueId { host: host.to_string(), port, secret: secret.to_string() })
            }
            _ => Err(bad("malformed")),
        }
    }
}

/// The store this process made for the id at `host:port`, handed to the communicator that
/// joins with it (so the store lives as long as that communicator), if this process made it.
pub(crate) fn adopt(host: &str, port: u16) -> Option<Arc<StoreServer>> {
    let mut issued = ISSUED.lock().unwrap_or_else(|p| p.into_inner());
    let at = issued.iter().position(|(a, _)| *a == format!("{host}:{port}"))?;
    Some(issued.swap_remove(at).1)
}

fn advertised_host() -> String {
    let master = crate::config::env_str("GRADWIRE_MASTER_ADDR").or_else(|| crate::config::env_str("MASTER_ADDR"));
    if let Some(m) = master {
        if std::net::TcpListener::bind((m.as_str(), 0)).is_ok() {
            return m;
        }
        // Connecting a UDP socket only picks the route: nothing is sent.
        let towards = std::net::UdpSocket::bind(("0.0.0.0", 0)).and_then(|s| s.connect((m.as_str(), 9)).and_then(|_| s.local_addr()));
        if let Ok(a) = towards {
            if !a.ip().is_unspecified() {
                return a.ip().to_string();
            }
        }
    }
    default_host()
}

/// This host's first non-loopback IPv4 address of an interface that is up, else loopback.
fn default_host() -> String {
    super::interfaces::ipv4_interfaces().into_iter().find(|i| i.up && !i.loopback).map_or_else(|| "127.0.0.1".into(), |i| i.addr.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_anything_else() {
        let id = UniqueId { host: "10.0.0.7".into(), port: 41234, secret: "ab".repeat(32) };
        assert_eq!(UniqueId::from_bytes(&id.to_bytes().unwrap()).unwrap(), id);
        let good = id.to_bytes().unwrap();
        let mut cases: Vec<Vec<u8>> = vec![vec![0; UNIQUE_ID_BYTES], vec![b'x'; UNIQUE_ID_BYTES], good[..64].to_vec()];
        let mut trailing = good;
        trailing[UNIQUE_ID_BYTES - 1] = b'z';
        cases.push(trailing.to_vec());
        for text in ["gwid1 h 0 ".to_string() + &"ab".repeat(32), "gwid1 h 80 short".into(), "gwid2 h 80 ".to_string() + &"ab".repeat(32)] {
            let mut b = vec![0u8; UNIQUE_ID_BYTES];
            b[..text.len()].copy_from_slice(text.as_bytes());
            cases.push(b);
        }
        for c in cases {
            let e = UniqueId::from_bytes(&c).unwrap_err().to_string();
            assert!(e.contains("not a gradwire unique id"), "{e}");
        }
        assert_eq!(UniqueId::from_hex(&id.to_hex().unwrap()).unwrap(), id);
        for bad in ["", "zz", &id.to_hex().unwrap()[2..]] {
            assert!(UniqueId::from_hex(bad).unwrap_err().to_string().contains("not a gradwire unique id"));
        }
        let long = UniqueId { host: "h".repeat(100), ..id };
        assert!(long.to_bytes().is_err());
    }

    #[test]
    fn creating_starts_a_store_that_the_id_leads_to() {
        let id = UniqueId::create().unwrap();
        let back = UniqueId::from_bytes(&id.to_bytes().unwrap()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let client = super::super::StoreClient::connect(&format!("{}:{}", back.host, back.port), &back.secret, deadline).unwrap();
        client.set("k", b"v").unwrap();
        assert!(adopt(&back.host, back.port).is_some());
        assert!(adopt(&back.host, back.port).is_none(), "adopted twice");
    }
}
