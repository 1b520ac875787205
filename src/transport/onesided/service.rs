//! The one-sided service for tcp peers: a thread on the target that applies their write,
//! read, fetch-add and accumulate requests to the exposed regions, and the requests' wire
//! format.

use super::{Accumulate, AccumulateError};
use crate::bootstrap::auth;
use crate::error::{Error, Result};
use crate::mem::Region;
use crate::sys::sock::NoSigpipe;
use std::collections::HashMap;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

pub(super) const OP_WRITE: u8 = 1;
pub(super) const OP_READ: u8 = 2;
pub(super) const OP_FADD: u8 = 3;
pub(super) const OP_ACCUMULATE: u8 = 4;
/// op, window id, offset, argument (length or addend), tag (accumulate only).
pub(super) const REQ_LEN: usize = 1 + 8 + 8 + 8 + 8;
/// Longest refusal reason sent back to a peer.
pub(super) const REASON_MAX: usize = 1024;

/// A region this rank exposes to tcp peers, and how it accepts accumulates.
#[derive(Clone)]
struct ExposedRegion {
    region: Arc<Region>,
    accumulate: Option<Arc<dyn Accumulate>>,
    timeout: Duration,
    /// Applies a fetch-add at an offset when the CPU may not (ranks on other hosts
    /// fetch-add there through the NIC); `None`: a CPU atomic.
    fetch_add: Option<FetchAdd>,
}

/// A fetch-add on a region that returns the old value (see [`ExposedRegion::fetch_add`]).
pub(super) type FetchAdd = Arc<dyn Fn(usize, u64) -> std::io::Result<u64> + Send + Sync>;

/// Regions this rank exposes to tcp peers, by window id.
type Exposed = Arc<RwLock<HashMap<u64, ExposedRegion>>>;

/// The tcp side's service: one thread accepting authenticated peers, one per connection.
pub struct RmaService {
    /// `ip:port` it listens on, as peers dial it (published with every window's handle).
    pub addr: String,
    exposed: Exposed,
    _listening: auth::Listening,
}

impl RmaService {
    /// Listens on `ip`, on a port the kernel picks, for peers that prove `secret` under
    /// `context`; `rank` names this rank in its log lines.
    pub fn start(ip: std::net::IpAddr, secret: &str, context: &str, rank: usize) -> Result<Self> {
        let listener = TcpListener::bind((ip, 0)).map_err(|e| Error::io("bind one-sided service", e))?;
        let addr = listener.local_addr().map_err(|e| Error::io("one-sided service address", e))?.to_string();
        let exposed: Exposed = Arc::default();
        let ex = exposed.clone();
        let listening = auth::serve_authenticated(listener, secret, context, &format!("rank {rank}: one-sided service"), move |s| serve(s, &ex))?;
        Ok(RmaService { addr, exposed, _listening: listening })
    }

    /// Serves window `id` from `region`; `accumulate` applies peers' accumulates (without
    /// one they are refused); `timeout` bounds the wait for an accumulate's payload;
    /// `fetch_add` applies fetch-adds instead of a CPU atomic.
    pub(super) fn expose(&self, id: u64, region: Arc<Region>, accumulate: Option<Arc<dyn Accumulate>>, timeout: Duration, fetch_add: Option<FetchAdd>) {
        self.exposed.write().unwrap_or_else(|p| p.into_inner()).insert(id, ExposedRegion { region, accumulate, timeout, fetch_add });
    }
}

/// Writes `head` then `body` with gathered writes: one segment for a small reply, and no
/// lone one-byte segment in front of a large one. Never SIGPIPE (a peer that went away is
/// an error of this connection only).
fn write_all_vectored(s: &mut TcpStream, mut head: &[u8], mut body: &[u8]) -> std::io::Result<()> {
    use std::io::{IoSlice, Write};
    while !head.is_empty() || !body.is_empty() {
        let n = NoSigpipe(&*s).write_vectored(&[IoSlice::new(head), IoSlice::new(body)])?;
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let from_head = n.min(head.len());
        head = &head[from_head..];
        body = &body[n - from_head..];
    }
    Ok(())
}

/// Refuses a request: status 0, then the reason (u16 length, UTF-8), so the peer's error
/// says why.
fn refuse(s: &mut TcpStream, why: &str) -> std::io::Result<()> {
    let mut why = why.as_bytes();
    why = &why[..why.len().min(REASON_MAX)];
    write_all_vectored(s, &[&[0u8][..], &(why.len() as u16).to_le_bytes()].concat(), why)
}

/// Skips `len` bytes of a refused request's payload.
fn skip(s: &mut TcpStream, len: u64) -> std::io::Result<()> {
    std::io::copy(&mut std::io::Read::take(&mut *s, len), &mut std::io::sink()).map(drop)
}

fn serve(s: &mut TcpStream, exposed: &Exposed) -> std::io::Result<()> {
    let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
    let mut req = [0u8; REQ_LEN];
    loop {
        s.read_exact(&mut req)?;
        let u = |i: usize| u64::from_le_bytes(req[i..i + 8].try_into().unwrap_or_default());
        let (op, win, off, arg, tag) = (req[0], u(1), u(9) as usize, u(17), u(25));
        let ex = exposed.read().unwrap_or_else(|p| p.into_inner()).get(&win).cloned().ok_or_else(|| bad(format!("unknown window {win}")))?;
        let region = &ex.region;
        let len = if op == OP_FADD { 8 } else { arg as usize };
        let payload = if matches!(op, OP_WRITE | OP_ACCUMULATE) { arg } else { 0 };
        // A refused request keeps the connection usable: its payload is skipped.
        if off.checked_add(len).is_none_or(|end| end > region.len()) || (op == OP_FADD && off % 8 != 0) {
            skip(s, payload)?;
            refuse(s, &format!("[{off}, {off}+{len}) is outside the {}-byte window or misaligned", region.len()))?;
            continue;
        }
        match op {
            OP_WRITE => {
                // SAFETY: bounds checked; the window's owner accepted that peers write
                // here (it exposed the region for exactly this). Straight from the
                // socket into place: no staging copy, no fresh pages per request.
                s.read_exact(unsafe { std::slice::from_raw_parts_mut(region.as_ptr().add(off), len) })?;
                write_all_vectored(s, &[1], &[])?;
            }
            OP_READ => {
                // SAFETY: bounds checked; reads of exposed memory.
                let data: &[u8] = unsafe { std::slice::from_raw_parts(region.as_ptr().add(off), len) };
                write_all_vectored(s, &[1], data)?;
            }
            OP_FADD => {
                let old = match &ex.fetch_add {
                    Some(through_nic) => match through_nic(off, arg) {
                        Ok(old) => old,
                        Err(e) => {
                            refuse(s, &format!("fetch-add through the NIC failed: {e}"))?;
                            continue;
                        }
                    },
                    // SAFETY: 8-aligned (checked) word inside the region; all accesses to
                    // it are atomic by protocol.
                    None => unsafe { &*(region.as_ptr().add(off) as *const AtomicU64) }.fetch_add(arg, Ordering::AcqRel),
                };
                write_all_vectored(s, &[1], &old.to_le_bytes())?;
            }
            OP_ACCUMULATE => {
                let Some(acc) = &ex.accumulate else {
                    skip(s, payload)?;
                    refuse(s, "this window takes no accumulates")?;
                    continue;
                };
                // A peer that stops (or trickles) half-way must not hold the owner's update
                // beyond the timeout.
                let until = std::time::Instant::now() + ex.timeout;
                let mut received = 0u64;
                let mut recv = |buf: &mut [u8]| {
                    if received + buf.len() as u64 > payload {
                        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "accumulate read past its payload"));
                    }
                    crate::bootstrap::auth::read_exact_by(s, buf, until)?;
                    received += buf.len() as u64;
                    Ok(())
                };
                let outcome = acc.accumulate(tag, off, len, &mut recv);
                s.set_read_timeout(None)?;
                match outcome {
                    Ok(()) if received == payload => write_all_vectored(s, &[1], &[])?,
                    Ok(()) => return Err(bad(format!("accumulate took {received} of its {payload} payload bytes"))),
                    Err(AccumulateError::Refused(why)) => {
                        skip(s, payload - received)?;
                        refuse(s, &why)?;
                    }
                    Err(AccumulateError::Io(e)) => return Err(e),
                }
            }
            _ => return Err(bad(format!("unknown one-sided op {op}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::Window;
    use super::*;
    use crate::test_support::panics_so_far;
    use proptest::prelude::*;
    use std::io::Write;
    use std::time::Instant;

    /// A request as a peer that proved the job secret might send anything: any op, the
    /// real window or another, offsets and lengths at and past the region's ends, and a
    /// payload shorter than announced.
    fn request() -> impl Strategy<Value = Vec<u8>> {
        let op = prop_oneof![Just(OP_WRITE), Just(OP_READ), Just(OP_FADD), Just(OP_ACCUMULATE), any::<u8>()];
        let window = prop_oneof![4 => Just(7u64), 1 => any::<u64>()];
        let edge = prop_oneof![0u64..4200, Just(u64::MAX), Just(u64::MAX - 7), Just(1 << 63), any::<u64>()];
        (op, window, edge.clone(), edge, any::<u64>(), proptest::collection::vec(any::<u8>(), 0..64)).prop_map(|(op, win, off, arg, tag, payload)| {
            let mut r = vec![op];
            for v in [win, off, arg, tag] {
                r.extend_from_slice(&v.to_le_bytes());
            }
            r.extend_from_slice(&payload);
            r
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

        /// Nothing a peer sends makes the service panic or stop serving the next
        /// connection (an announced length is never allocated: payloads go straight into
        /// the region, bounds checked, or are skipped).
        #[test]
        fn the_one_sided_service_survives_any_request(reqs in proptest::collection::vec(request(), 1..6)) {
            let panics = panics_so_far();
            let svc = RmaService::start("127.0.0.1".parse().unwrap(), "fuzz-secret", "rma:fuzz", 0).unwrap();
            let region = Arc::new(Region::anonymous(4096).unwrap());
            svc.expose(7, region.clone(), None, Duration::from_millis(200), None);
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut c = auth::dial(&svc.addr, "fuzz-secret", b"rma:fuzz", deadline, "service").unwrap();
            for r in &reqs {
                if c.write_all(r).is_err() {
                    break;
                }
            }
            drop(c);
            let mut c = auth::dial(&svc.addr, "fuzz-secret", b"rma:fuzz", deadline, "service").unwrap();
            c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let mut read = Window::request(OP_READ, 0, 8);
            read[1..9].copy_from_slice(&7u64.to_le_bytes());
            c.write_all(&read).unwrap();
            let mut reply = [0u8; 9];
            c.read_exact(&mut reply).unwrap();
            prop_assert_eq!(reply[0], 1, "a valid read after the fuzzed connection was refused");
            prop_assert_eq!(panics_so_far(), panics);
        }
    }
}
