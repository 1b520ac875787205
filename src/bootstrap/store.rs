//! The rendezvous store: a small key-value server hosted by rank 0 at
//! `MASTER_ADDR:MASTER_PORT`, through which ranks exchange addresses, shared-memory
//! handles and (later) QP numbers and rkeys. Only peers proving the job secret get in.

use super::auth::{self, read_frame, write_frame};
use crate::error::{config, Error, Result};
use std::collections::HashMap;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

const CONTEXT: &str = "store";
const SET: u8 = b'S';
const GET: u8 = b'G';
const ADD: u8 = b'A';

/// How long a store whose job has failed outlives its communicator, waiting for the other
/// ranks to read the failure reasons and leave.
const LINGER_AFTER_FAILURE: Duration = Duration::from_secs(3);

/// The least a failed job's store stays up, for ranks still connecting.
const LINGER_AT_LEAST: Duration = Duration::from_millis(500);

/// The key segment under which ranks leave the reason they failed (see [`failure_key`]).
const FAILED: &str = "/failed/";

/// The store key under which the rank with `global_rank` of the communicator with key
/// prefix `prefix` leaves the reason it failed, for peers that only see it leave.
pub fn failure_key(prefix: &str, global_rank: usize) -> String {
    format!("{prefix}{FAILED}{global_rank}")
}

type Table = Arc<(Mutex<HashMap<String, Vec<u8>>>, Condvar)>;

/// The server half: accepts authenticated clients on a background thread each.
pub struct StoreServer {
    /// The address it listens on (with the port the kernel gave, if it was asked for 0).
    pub addr: std::net::SocketAddr,
    table: Table,
    /// Authenticated connections now open.
    clients: Arc<AtomicUsize>,
    /// Stops the listener when the store goes (so the port is free for a later job).
    _listening: auth::Listening,
    secret: String,
    /// Why it listens on every interface rather than where asked, if it does.
    pub fallback: Option<String>,
}

/// A port `p` such that `p .. p + count` can all be bound now on every address, picked at
/// random outside the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`).
///
/// Why not bind port 0 and reuse what it gave: that port lies inside the ephemeral range,
/// so until the rank binds it again any outgoing connection or `bind(0)` on the machine may
/// be handed it (gloo's pair sockets once took `MASTER_PORT + 1` that way). Outside the
/// range a port is only ever taken by a process that names it.
pub fn unused_ports(count: u16) -> Result<u16> {
    use rand::Rng;
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let mut ends = range.split_whitespace().map(|w| w.parse::<u32>().ok());
    let (ephemeral_start, ephemeral_end) = match (ends.next().flatten(), ends.next().flatten()) {
        (Some(s), Some(e)) if s <= e => (s, e),
        _ => (32768, 60999),
    };
    let count = u32::from(count.max(1));
    // First ports of a free run: below the range from 10000 (past the common services;
    // wide, so two jobs started at once seldom pick the same port); on a host whose range
    // leaves no room below, above it, short of the top 64 (benches' tcpring counts up from
    // its port); failing both, anywhere unprivileged.
    let below = (if ephemeral_start >= 20000 { 10000 } else { 1024 }, ephemeral_start.saturating_sub(count));
    let above = (ephemeral_end + 1, 65536u32.saturating_sub(count + 64));
    let (low, high) = [below, above].into_iter().find(|(lo, hi)| lo < hi).unwrap_or((1024, 65536 - count));
    let mut rng = rand::rng();
    for _ in 0..1000 {
        let first = rng.random_range(low..high) as u16;
        if (first..first + count as u16).all(|p| TcpListener::bind(("0.0.0.0", p)).is_ok()) {
            return Ok(first);
        }
    }
    let what = format!("find {count} consecutive free TCP ports outside the ephemeral range {ephemeral_start}-{ephemeral_end} (1000 tries)");
    Err(Error::io(what, std::io::ErrorKind::AddrInUse.into()))
}

/// Counts one open client connection while it lives.
struct Connected(Arc<AtomicUsize>);

impl Connected {
    fn new(clients: &Arc<AtomicUsize>) -> Self {
        clients.fetch_add(1, Ordering::AcqRel);
        Connected(clients.clone())
    }
}

impl Drop for Connected {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

fn taken(bind: &str) -> String {
    format!("bind rendezvous store on {bind} (port taken? it is GRADWIRE_MASTER_PORT, else MASTER_PORT; the Python Comm beside torch.distributed takes MASTER_PORT + 1)")
}

/// Stores this process hosts, by listening address: a later communicator of the same job
/// (same `MASTER_ADDR:MASTER_PORT`) shares the live one instead of failing to bind.
static HOSTED: Mutex<Vec<(String, std::sync::Weak<StoreServer>)>> = Mutex::new(Vec::new());

impl StoreServer {
    /// Listens on `bind` (e.g. `0.0.0.0:29500`) until dropped.
    pub fn start(bind: &str, secret: &str) -> Result<Self> {
        let listener = TcpListener::bind(bind).map_err(|e| Error::io(taken(bind), e))?;
        Self::serve_on(listener, secret)
    }

    fn serve_on(listener: TcpListener, secret: &str) -> Result<Self> {
        let addr = listener.local_addr().map_err(|e| Error::io("store address", e))?;
        let table: Table = Arc::new((Mutex::new(HashMap::new()), Condvar::new()));
        let clients = Arc::new(AtomicUsize::new(0));
        let (served, counted) = (table.clone(), clients.clone());
        let stop = auth::serve_authenticated(listener, secret, CONTEXT, "rendezvous store", move |s| {
            let _open = Connected::new(&counted);
            serve(s, &served)
        })?;
        Ok(StoreServer { addr, table, clients, _listening: stop, secret: secret.to_string(), fallback: None })
    }

    /// The store for rank 0 at `host:port`: the one this process already hosts there (a
    /// second communicator of the same job), else a new one. Binds where asked; only when
    /// `host` is not an address of this machine (a NAT, a name resolving elsewhere) does it
    /// listen on every interface, and it says so.
    pub fn shared(host: &str, port: u16, secret: &str) -> Result<Arc<Self>> {
        let wanted = format!("{host}:{port}");
        let mut hosted = HOSTED.lock().unwrap_or_else(|p| p.into_inner());
        hosted.retain(|(_, w)| w.strong_count() > 0);
        if let Some(live) = hosted.iter().find(|(a, _)| *a == wanted).and_then(|(_, w)| w.upgrade()) {
            if live.secret != secret {
                return Err(config(format!("this process already hosts a rendezvous store on {wanted} for a job with another GRADWIRE_JOB_SECRET")));
            }
            return Ok(live);
        }
        let server = match TcpListener::bind(&wanted) {
            Ok(l) => Self::serve_on(l, secret)?,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => return Err(Error::io(taken(&wanted), e)),
            Err(e) => {
                let any = format!("0.0.0.0:{port}");
                let mut s = Self::start(&any, secret)?;
                let why = format!("MASTER_ADDR={host} is not an address of this machine (rank 0's): binding {wanted} failed ({e}); the rendezvous store listens on every interface ({any}) instead");
                log::warn!("{why}");
                s.fallback = Some(why);
                s
            }
        };
        let server = Arc::new(server);
        hosted.push((wanted, Arc::downgrade(&server)));
        Ok(server)
    }

    /// A store on a free port of `host` (an address of this machine) for a unique id (see
    /// [`super::unique_id`]), registered like [`StoreServer::shared`]'s.
    pub fn ephemeral(host: &str, secret: &str) -> Result<Arc<Self>> {
        let listener = TcpListener::bind((host, 0)).map_err(|e| Error::io(format!("bind a rendezvous store on {host} for a unique id"), e))?;
        let server = Arc::new(Self::serve_on(listener, secret)?);
        let mut hosted = HOSTED.lock().unwrap_or_else(|p| p.into_inner());
        hosted.retain(|(_, w)| w.strong_count() > 0);
        hosted.push((format!("{host}:{}", server.addr.port()), Arc::downgrade(&server)));
        Ok(server)
    }

    fn holds_a_failure(&self) -> bool {
        self.table.0.lock().unwrap_or_else(|p| p.into_inner()).keys().any(|k| k.contains(FAILED))
    }
}

impl Drop for StoreServer {
    /// When some rank has left a failure reason, the host of the store (rank 0) may be about
    /// to exit first; its peers would then lose the store with the reason in it and could
    /// only report "lost rank 0", not the rank whose death started it. So it waits, at most
    /// 3 s, until every other client has gone, and at least half a second for a rank
    /// that is still starting (a setup failure comes before all have connected).
    fn drop(&mut self) {
        if !self.holds_a_failure() {
            return;
        }
        let started = Instant::now();
        let until = started + LINGER_AFTER_FAILURE;
        while (self.clients.load(Ordering::Acquire) > 0 || started.elapsed() < LINGER_AT_LEAST) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        log::debug!("rendezvous store: closing with {} clients still connected", self.clients.load(Ordering::Acquire));
    }
}

fn serve(s: &mut TcpStream, table: &Table) -> std::io::Result<()> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, m.to_string());
    loop {
        let req = read_frame(s)?;
        let (&cmd, rest) = req.split_first().ok_or_else(|| bad("empty request"))?;
        let (key, arg) = split_key(rest).ok_or_else(|| bad("malformed request"))?;
        let (lock, cv) = &**table;
        match cmd {
            SET => {
                lock.lock().unwrap_or_else(|p| p.into_inner()).insert(key, arg.to_vec());
                cv.notify_all();
                write_frame(s, b"K")?;
            }
            GET => {
                // No client holds a server thread longer than any deadline may be.
                let wait = u64::from_le_bytes(arg.try_into().map_err(|_| bad("bad timeout"))?).min(crate::config::MAX_TIMEOUT_MS);
                let deadline = Instant::now() + Duration::from_millis(wait);
                let mut map = lock.lock().unwrap_or_else(|p| p.into_inner());
                let reply = loop {
                    if let Some(v) = map.get(&key) {
                        let mut r = b"V".to_vec();
                        r.extend_from_slice(v);
                        break r;
                    }
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break b"N".to_vec();
                    }
                    map = cv.wait_timeout(map, left).unwrap_or_else(|p| p.into_inner()).0;
                };
                drop(map);
                write_frame(s, &reply)?;
            }
            ADD => {
                let delta = i64::from_le_bytes(arg.try_into().map_err(|_| bad("bad delta"))?);
                let mut map = lock.lock().unwrap_or_else(|p| p.into_inner());
                let cur = map.get(&key).and_then(|v| v.as_slice().try_into().ok()).map(i64::from_le_bytes).unwrap_or(0);
                let new = cur.wrapping_add(delta);
                map.insert(key, new.to_le_bytes().to_vec());
                drop(map);
                cv.notify_all();
                let mut r = b"V".to_vec();
                r.extend_from_slice(&new.to_le_bytes());
                write_frame(s, &r)?;
            }
            _ => return Err(bad("unknown command")),
        }
    }
}

fn split_key(b: &[u8]) -> Option<(String, &[u8])> {
    let len = u32::from_le_bytes(b.get(..4)?.try_into().ok()?) as usize;
    let end = len.checked_add(4)?;
    let key = std::str::from_utf8(b.get(4..end)?).ok()?.to_string();
    Some((key, &b[end..]))
}

fn request(cmd: u8, key: &str, arg: &[u8]) -> Vec<u8> {
    let mut r = vec![cmd];
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(key.as_bytes());
    r.extend_from_slice(arg);
    r
}

/// A connection to the store. Cheap to share (`Arc`); requests are serialised.
pub struct StoreClient {
    conn: Mutex<TcpStream>,
    addr: String,
}

impl StoreClient {
    /// Connects (retrying until `deadline` while rank 0 starts) and authenticates.
    pub fn connect(addr: &str, secret: &str, deadline: Instant) -> Result<Self> {
        let s = auth::dial(addr, secret, CONTEXT.as_bytes(), deadline, "rendezvous store")?;
        Ok(StoreClient { conn: Mutex::new(s), addr: addr.to_string() })
    }

    /// The local address of our store connection: an address of this host that the other
    /// ranks can reach, used as the tcp transport's listening address.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        let c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        c.local_addr().map(|a| a.ip()).map_err(|e| Error::io("store local address", e))
    }

    fn call(&self, req: &[u8], timeout: Duration) -> Result<Vec<u8>> {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        c.set_read_timeout(Some(timeout + Duration::from_secs(1))).ok();
        write_frame(&c, req).and_then(|_| read_frame(&mut *c)).map_err(|e| {
            // Out of step now (a late reply would answer the next request): close it, so
            // that later calls fail too instead of reading someone else's answer.
            let _ = c.shutdown(std::net::Shutdown::Both);
            Error::io(format!("rendezvous store at {} (did rank 0 exit?)", self.addr), e)
        })
    }

    /// Stores `value` under `key`, replacing any earlier value; gives up after about 10 s.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.set_within(key, value, Duration::from_secs(10))
    }

    /// `set` that gives up after about `timeout` (plus the socket's grace) when the store
    /// does not answer.
    pub fn set_within(&self, key: &str, value: &[u8], timeout: Duration) -> Result<()> {
        let r = self.call(&request(SET, key, value), timeout)?;
        if r != b"K" {
            return Err(Error::Protocol("store: unexpected reply to set".into()));
        }
        Ok(())
    }

    /// Waits until `key` exists, at most until `deadline`; `what` describes who should have
    /// set it, for the timeout message.
    pub fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let r = self.call(&request(GET, key, &(wait.as_millis() as u64).to_le_bytes()), wait)?;
        match r.split_first() {
            Some((b'V', v)) => Ok(Some(v.to_vec())),
            Some((b'N', _)) => Ok(None),
            _ => Err(Error::Protocol("store: unexpected reply to get".into())),
        }
    }

    /// Atomically adds `delta` to a counter and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let r = self.call(&request(ADD, key, &delta.to_le_bytes()), Duration::from_secs(10))?;
        match r.split_first() {
            Some((b'V', v)) if v.len() == 8 => Ok(i64::from_le_bytes(v.try_into().unwrap_or_default())),
            _ => Err(Error::Protocol("store: unexpected reply to add".into())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::panics_so_far;
    use proptest::prelude::*;
    use std::io::Write;

    #[test]
    fn unused_ports_lie_outside_the_ephemeral_range_and_can_be_bound() {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
        let ends: Vec<u16> = range.split_whitespace().map(|w| w.parse().unwrap()).collect();
        for _ in 0..50 {
            let first = unused_ports(3).unwrap();
            assert!(first >= 1024 && (first + 3 <= ends[0] || first > ends[1]), "{first}..{} meets the ephemeral range {range}", first + 3);
            let held: Vec<_> = (first..first + 3).map(|p| TcpListener::bind(("0.0.0.0", p)).unwrap()).collect();
            // While held, a fresh pick never returns any of them.
            let other = unused_ports(3).unwrap();
            assert!(other + 3 <= first || other >= first + 3, "{other} overlaps the held {first}..{}", first + 3);
            drop(held);
        }
    }

    /// Rank 0 binds MASTER_ADDR itself; where that is not an address of this machine it
    /// listens on every interface and says why (it used to do so silently). A second
    /// communicator of the job shares the live store; once that is gone the port is free.
    #[test]
    fn the_store_binds_where_asked_or_says_why_not() {
        let port = unused_ports(1).unwrap();
        let here = StoreServer::shared("127.0.0.1", port, "secret-123").unwrap();
        assert_eq!(here.addr.to_string(), format!("127.0.0.1:{port}"));
        assert!(here.fallback.is_none());
        let again = StoreServer::shared("127.0.0.1", port, "secret-123").unwrap();
        assert!(Arc::ptr_eq(&here, &again), "a second communicator must share the live store");
        let other_job = StoreServer::shared("127.0.0.1", port, "another-secret").err().expect("another job's secret must be refused");
        assert!(other_job.to_string().contains("another GRADWIRE_JOB_SECRET"), "{other_job}");
        drop((here, again));
        // The listener goes with the store.
        let rebind = Instant::now();
        while TcpListener::bind(("127.0.0.1", port)).is_err() {
            assert!(rebind.elapsed() < Duration::from_secs(2), "port {port} still taken after the store went");
            std::thread::sleep(Duration::from_millis(20));
        }
        // 192.0.2.1 (TEST-NET-1) is no address of this machine; binding sends nothing. Where
        // the kernel lets anyone bind addresses it does not have, there is no fallback.
        if std::fs::read_to_string("/proc/sys/net/ipv4/ip_nonlocal_bind").is_ok_and(|v| v.trim() == "1") {
            eprintln!("SKIP the fallback half: net.ipv4.ip_nonlocal_bind=1 lets any address be bound");
            return;
        }
        let port = unused_ports(1).unwrap();
        let elsewhere = StoreServer::shared("192.0.2.1", port, "secret-123").unwrap();
        assert_eq!(elsewhere.addr.to_string(), format!("0.0.0.0:{port}"));
        let why = elsewhere.fallback.clone().unwrap_or_default();
        assert!(why.contains("MASTER_ADDR=192.0.2.1 is not an address of this machine") && why.contains("every interface"), "{why}");
    }

    /// The process's threads, from the kernel.
    fn threads() -> usize {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        status.lines().find_map(|l| l.strip_prefix("Threads:")).unwrap().trim().parse().unwrap()
    }

    /// Silent connections by the hundred cost a bounded number of threads, and the ranks
    /// still get in (2000 of them used to spawn 1425 threads).
    #[test]
    fn silent_connections_are_bounded() {
        let srv = StoreServer::start("127.0.0.1:0", "secret-123").unwrap();
        let before = threads();
        let silent: Vec<TcpStream> = (0..400).filter_map(|_| TcpStream::connect(srv.addr).ok()).collect();
        std::thread::sleep(Duration::from_millis(500));
        let during = threads();
        let c = StoreClient::connect(&srv.addr.to_string(), "secret-123", Instant::now() + Duration::from_secs(5));
        let c = c.expect("a rank must still get in");
        c.set("k", b"v").unwrap();
        assert!(during <= before + auth::MAX_PENDING_HANDSHAKES + 8, "{} silent connections made {} threads", silent.len(), during - before);
        drop(silent);
    }

    #[test]
    fn set_get_add_and_refusal() {
        let srv = StoreServer::start("127.0.0.1:0", "secret-123").unwrap();
        let addr = srv.addr.to_string();
        let dl = Instant::now() + Duration::from_secs(5);
        let c = StoreClient::connect(&addr, "secret-123", dl).unwrap();
        c.set("a", b"hello").unwrap();
        assert_eq!(c.get("a", dl).unwrap().unwrap(), b"hello");
        assert_eq!(c.get("missing", Instant::now() + Duration::from_millis(50)).unwrap(), None);
        assert_eq!(c.add("n", 3).unwrap(), 3);
        assert_eq!(c.add("n", -1).unwrap(), 2);
        let err = StoreClient::connect(&addr, "wrong-secret", dl).err().expect("wrong secret must be refused");
        assert!(matches!(err, Error::Auth(_)), "{err}");
    }

    #[test]
    fn get_waits_for_a_later_set() {
        let srv = StoreServer::start("127.0.0.1:0", "secret-123").unwrap();
        let addr = srv.addr.to_string();
        let dl = Instant::now() + Duration::from_secs(5);
        let c2 = StoreClient::connect(&addr, "secret-123", dl).unwrap();
        let t = std::thread::spawn(move || c2.get("late", Instant::now() + Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(100));
        StoreClient::connect(&addr, "secret-123", dl).unwrap().set("late", b"x").unwrap();
        assert_eq!(t.join().unwrap().unwrap(), b"x");
    }

    /// The host of a store holding a failure reason keeps it up until the other ranks have
    /// read it and left, and no longer than its bound; without a failure it goes at once.
    #[test]
    fn a_failed_jobs_store_waits_for_its_readers_within_a_bound() {
        let dl = Instant::now() + Duration::from_secs(5);
        let clean = StoreServer::start("127.0.0.1:0", "s").unwrap();
        let _reader = StoreClient::connect(&clean.addr.to_string(), "s", dl).unwrap();
        let t = Instant::now();
        drop(clean);
        assert!(t.elapsed() < LINGER_AFTER_FAILURE / 2, "a store without failures lingered {:?}", t.elapsed());

        for reader_leaves in [true, false] {
            let srv = StoreServer::start("127.0.0.1:0", "s").unwrap();
            let addr = srv.addr.to_string();
            let reader = StoreClient::connect(&addr, "s", dl).unwrap();
            StoreClient::connect(&addr, "s", dl).unwrap().set(&failure_key("job", 3), b"lost rank 1").unwrap();
            let t = Instant::now();
            let closing = std::thread::spawn(move || drop(srv));
            std::thread::sleep(Duration::from_millis(300));
            assert!(!closing.is_finished(), "the store closed before its reader left");
            assert_eq!(reader.get(&failure_key("job", 3), dl).unwrap().unwrap(), b"lost rank 1");
            if reader_leaves {
                drop(reader);
                closing.join().unwrap();
                assert!(t.elapsed() < LINGER_AFTER_FAILURE, "it waited {:?} after its last reader left", t.elapsed());
            } else {
                closing.join().unwrap();
                let waited = t.elapsed();
                assert!(waited >= LINGER_AFTER_FAILURE && waited < LINGER_AFTER_FAILURE * 2, "waited {waited:?}");
            }
        }
    }

    /// A reply that arrives after the client gave up must not answer its next request: the
    /// connection is closed, and later calls fail instead.
    #[test]
    fn a_late_reply_is_never_read_as_the_next_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let slow_store = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            auth::accept(&mut s, "s", CONTEXT.as_bytes(), Instant::now() + Duration::from_secs(5)).unwrap();
            while read_frame(&mut s).is_ok() {
                // Well after the client's 1 s grace, even when its thread runs late.
                std::thread::sleep(Duration::from_millis(3000));
                if write_frame(&s, b"Vstale").is_err() {
                    break;
                }
            }
        });
        let c = StoreClient::connect(&addr, "s", Instant::now() + Duration::from_secs(5)).unwrap();
        // No wait asked for: the client gives up after its 1 s grace, before the reply.
        assert!(c.get("first", Instant::now()).is_err());
        let second = c.get("second", Instant::now() + Duration::from_secs(3));
        assert!(second.is_err(), "the second get read the first one's late reply: {second:?}");
        drop(c);
        slow_store.join().unwrap();
    }

    /// A store request: a known or unknown command, then either a key and an argument that a
    /// command of that kind could carry (a set's value, a get's timeout, an add's delta: any
    /// 8 bytes), or a key length that lies and anything after it.
    fn store_request() -> impl Strategy<Value = Vec<u8>> {
        let cmd = prop_oneof![Just(b'S'), Just(b'G'), Just(b'A'), any::<u8>()];
        let arg = prop_oneof![any::<u64>().prop_map(|v| v.to_le_bytes().to_vec()), proptest::collection::vec(any::<u8>(), 0..16)];
        let honest = (proptest::collection::vec(any::<u8>(), 0..8), arg).prop_map(|(key, arg)| {
            let mut r = (key.len() as u32).to_le_bytes().to_vec();
            r.extend_from_slice(&key);
            r.extend_from_slice(&arg);
            r
        });
        let lying = (any::<u32>(), proptest::collection::vec(any::<u8>(), 0..40)).prop_map(|(len, rest)| {
            let mut r = len.to_le_bytes().to_vec();
            r.extend_from_slice(&rest);
            r
        });
        (cmd, prop_oneof![3 => honest, 1 => lying, 1 => proptest::collection::vec(any::<u8>(), 0..3)]).prop_map(|(cmd, body)| {
            let mut r = vec![cmd];
            r.extend_from_slice(&body);
            r
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, failure_persistence: None, ..ProptestConfig::default() })]

        /// An authenticated client that sends anything (frames that lie about their length,
        /// unknown commands, bad keys, any timeout) never makes the store panic or stop
        /// serving others; a frame over the limit is refused before it is allocated.
        #[test]
        fn the_store_survives_any_authenticated_request(reqs in proptest::collection::vec(store_request(), 1..6), lie in any::<Option<u32>>()) {
            let panics = panics_so_far();
            let srv = StoreServer::start("127.0.0.1:0", "fuzz-secret").unwrap();
            let addr = srv.addr.to_string();
            let deadline = Instant::now() + Duration::from_secs(5);
            let mut raw = auth::dial(&addr, "fuzz-secret", b"store", deadline, "store").unwrap();
            raw.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
            for r in &reqs {
                // A GET may wait as long as it asked (bounded by the store): do not wait for it.
                if raw.write_all(&(r.len() as u32).to_le_bytes()).and_then(|_| raw.write_all(r)).is_err() {
                    break;
                }
            }
            if let Some(len) = lie {
                // A frame header announcing up to 4 GiB, and then nothing.
                let _ = raw.write_all(&len.to_le_bytes());
            }
            drop(raw);
            let c = StoreClient::connect(&addr, "fuzz-secret", deadline).unwrap();
            c.set("after", b"still serving").unwrap();
            prop_assert_eq!(c.get("after", deadline).unwrap().unwrap(), b"still serving".to_vec());
            prop_assert_eq!(panics_so_far(), panics);
        }
    }
}
