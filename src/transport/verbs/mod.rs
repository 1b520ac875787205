//! RDMA verbs transport (InfiniBand, RoCE, soft-RoCE `rxe`).
//!
//! libibverbs is opened at run time ([`sys`]), so gradwire builds without rdma-core and
//! starts on hosts without it; the transport is then unavailable, with the reason. The
//! small RAII types here own the verbs objects, with `Arc`s so that a child (queue pair,
//! registration) keeps its protection domain and context alive inside a long-lived
//! communicator.
//!
//! - [`device`]: device, port and GID choice, explained.
//! - [`link`]: the two-sided byte stream ([`crate::transport::Link`]) on RDMA WRITE WITH
//!   IMMEDIATE into a slotted ring at the peer, with credits returned by the receiver.
//! - One-sided write/read/fetch-add of windows: [`RmaPeer`].

pub(crate) mod connect;
pub mod device;
pub(crate) mod link;
mod rma_peer;

pub(crate) mod sys;

use crate::config::TransportChoice;
use crate::error::{Error, Result};
use crate::mem::Region;
use crate::transport::backend::{Backend, Setup};
use crate::transport::{Link, Transport};
pub use rma_peer::RmaPeer;
use std::ffi::CStr;
use std::sync::{Arc, Mutex, OnceLock};
use sys::Verbs;

/// What a queue pair and a registration allow: local writes, and remote write, read and
/// atomics (windows, rendezvous zones, the token ring).
const ACCESS: u32 = sys::IBV_ACCESS_LOCAL_WRITE | sys::IBV_ACCESS_REMOTE_WRITE | sys::IBV_ACCESS_REMOTE_READ | sys::IBV_ACCESS_REMOTE_ATOMIC;

/// The loaded libibverbs, or why verbs are unavailable.
pub fn library() -> Result<&'static Verbs> {
    sys::verbs().map_err(Error::Unsupported)
}

/// An open device context (closed on drop).
pub struct Context {
    raw: *mut sys::ibv_context,
    v: &'static Verbs,
    pub name: String,
}

// SAFETY: libibverbs contexts are thread-safe (verbs calls lock internally).
unsafe impl Send for Context {}
// SAFETY: as for Send.
unsafe impl Sync for Context {}

impl Context {
    /// The names of the devices libibverbs lists.
    pub fn names() -> Result<Vec<String>> {
        let v = library()?;
        let mut names = Vec::new();
        Self::each_device(v, |name, _| {
            names.push(name.to_string());
            false
        })?;
        Ok(names)
    }

    /// Opens the device called `name`.
    pub fn open(name: &str) -> Result<Context> {
        let v = library()?;
        let mut raw = std::ptr::null_mut();
        let mut listed = false;
        Self::each_device(v, |dn, dev| {
            if dn != name {
                return false;
            }
            listed = true;
            // SAFETY: dev is a listed device; the context outlives the list.
            raw = unsafe { (v.ibv_open_device)(dev) };
            true
        })?;
        if !listed {
            return Err(Error::Unsupported(format!("RDMA device {name} is not listed by libibverbs")));
        }
        if raw.is_null() {
            return Err(Error::Unsupported(format!("ibv_open_device({name}) failed: {}", std::io::Error::last_os_error())));
        }
        Ok(Context { raw, v, name: name.to_string() })
    }

    /// Calls `f(name, device)` for each listed device until it returns true.
    fn each_device(v: &Verbs, mut f: impl FnMut(&str, *mut sys::ibv_device) -> bool) -> Result<()> {
        let mut n = 0i32;
        // SAFETY: out-parameter for the count; the list is freed below.
        let list = unsafe { (v.ibv_get_device_list)(&mut n) };
        if list.is_null() {
            let e = std::io::Error::last_os_error();
            // ENOSYS: the kernel has no RDMA support at all (no ib_uverbs), so no devices.
            return if e.raw_os_error() == Some(libc::ENOSYS) { Ok(()) } else { Err(Error::io("ibv_get_device_list", e)) };
        }
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n entries of the list.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a listed device has a name that lives as long as the list.
            let name = unsafe { CStr::from_ptr((v.ibv_get_device_name)(dev)) }.to_string_lossy().into_owned();
            if f(&name, dev) {
                break;
            }
        }
        // SAFETY: list from ibv_get_device_list, not used after this.
        unsafe { (v.ibv_free_device_list)(list) };
        Ok(())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: opened by us; every child object holds an Arc to the Domain that owns us.
        unsafe { (self.v.ibv_close_device)(self.raw) };
    }
}

/// One process's use of one device port: context, protection domain and the cache of
/// registered regions. Shared by every link and window of every communicator.
pub struct Domain {
    pub choice: device::Choice,
    pd: *mut sys::ibv_pd,
    ctx: Context,
    /// Regions registered for zero-copy, kept alive by the cache (so a cached key never
    /// outlives its memory). Re-registered only when a region at the same address grows.
    regs: Mutex<Vec<(Arc<Region>, Arc<Mr>)>>,
}

// SAFETY: the protection domain is used only through thread-safe verbs calls.
unsafe impl Send for Domain {}
// SAFETY: as for Send.
unsafe impl Sync for Domain {}

impl Drop for Domain {
    fn drop(&mut self) {
        self.regs.lock().unwrap_or_else(|p| p.into_inner()).clear();
        // SAFETY: every QP/CQ/MR holds an Arc<Domain>, so none is left.
        unsafe { (self.ctx.v.ibv_dealloc_pd)(self.pd) };
    }
}

/// What `gradwire info` says of verbs on this host: the devices, ports and GID tables,
/// and the choice the settings (`GRADWIRE_IB_*`) lead to; an error for an invalid setting.
/// `local` is the address of the interface the job's rendezvous goes through.
pub fn report(local: Option<std::net::IpAddr>) -> Result<String> {
    Ok(device::explain(local, &overrides()?))
}

/// The overrides from the environment.
pub fn overrides() -> Result<device::Overrides> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
    let num =
        |k: &str| -> Result<Option<u64>> { var(k).map(|v| v.trim().parse::<u64>().map_err(|_| Error::Config(format!("{k}={v:?}: not a number")))).transpose() };
    let port = num("GRADWIRE_IB_PORT")?;
    if port.is_some_and(|p| p == 0 || p > 255) {
        return Err(Error::Config(format!("GRADWIRE_IB_PORT={}: ports are numbered from 1", port.unwrap_or(0))));
    }
    let gid = num("GRADWIRE_GID_INDEX")?;
    if gid.is_some_and(|g| g > u32::MAX as u64) {
        return Err(Error::Config("GRADWIRE_GID_INDEX: too large".into()));
    }
    Ok(device::Overrides { dev: var("GRADWIRE_IB_DEV"), port: port.map(|p| p as u8), gid_index: gid.map(|g| g as u32) })
}

static DOMAIN: OnceLock<Mutex<Option<Arc<Domain>>>> = OnceLock::new();

impl Domain {
    /// The process's domain for the device chosen from `local_ip` and the overrides
    /// (opened once, then shared).
    pub fn get(local_ip: Option<std::net::IpAddr>) -> Result<Arc<Domain>> {
        let cell = DOMAIN.get_or_init(|| Mutex::new(None));
        let mut slot = cell.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = slot.as_ref() {
            return Ok(d.clone());
        }
        let choice = device::choose(&device::scan()?, local_ip, &overrides()?)?;
        log::info!("verbs: {}", choice.reason);
        let ctx = Context::open(&choice.dev)?;
        // SAFETY: open context.
        let pd = unsafe { (ctx.v.ibv_alloc_pd)(ctx.raw) };
        if pd.is_null() {
            return Err(Error::io(format!("ibv_alloc_pd({})", ctx.name), std::io::Error::last_os_error()));
        }
        let d = Arc::new(Domain { choice, pd, ctx, regs: Mutex::new(Vec::new()) });
        *slot = Some(d.clone());
        Ok(d)
    }

    /// Registers `len` bytes at `addr` for local use and remote write/read/atomics.
    ///
    /// # Safety
    /// The memory must stay mapped while the returned registration lives.
    pub unsafe fn register_raw(self: &Arc<Self>, addr: *mut u8, len: usize) -> Result<Mr> {
        // SAFETY: caller keeps the memory mapped; pd is ours.
        let mr = unsafe { (self.ctx.v.ibv_reg_mr)(self.pd, addr as *mut _, len.max(1), ACCESS as i32) };
        if mr.is_null() {
            return Err(register_error(len, std::io::Error::last_os_error()));
        }
        Ok(Mr { raw: mr, addr: addr as u64, len, _dom: self.clone() })
    }

    /// A registration of `region`, from the cache when it is already registered.
    pub fn register(self: &Arc<Self>, region: &Arc<Region>) -> Result<Arc<Mr>> {
        let mut regs = self.regs.lock().unwrap_or_else(|p| p.into_inner());
        let addr = region.as_ptr() as u64;
        if let Some((_, mr)) = regs.iter().find(|(r, mr)| Arc::ptr_eq(r, region) && mr.len >= region.len()) {
            return Ok(mr.clone());
        }
        regs.retain(|(r, mr)| !(Arc::ptr_eq(r, region) || mr.addr == addr));
        // SAFETY: the cache holds the Arc<Region>, so the memory outlives the registration.
        let mr = Arc::new(unsafe { self.register_raw(region.as_ptr(), region.len())? });
        regs.push((region.clone(), mr.clone()));
        Ok(mr)
    }

    /// The cached registration covering `[addr, addr+len)`, if any (zero-copy sends).
    pub fn lookup(&self, addr: *const u8, len: usize) -> Option<Arc<Mr>> {
        let a = addr as u64;
        let regs = self.regs.lock().unwrap_or_else(|p| p.into_inner());
        regs.iter().find(|(_, mr)| a >= mr.addr && a + len as u64 <= mr.addr + mr.len as u64).map(|(_, mr)| mr.clone())
    }

    /// A completion queue with room for `entries` completions.
    pub fn create_cq(self: &Arc<Self>, entries: usize) -> Result<Arc<Cq>> {
        // SAFETY: open context; no channel, no vector.
        let cq = unsafe { (self.ctx.v.ibv_create_cq)(self.ctx.raw, entries as i32, std::ptr::null_mut(), std::ptr::null_mut(), 0) };
        if cq.is_null() {
            return Err(Error::io(format!("ibv_create_cq({entries})"), std::io::Error::last_os_error()));
        }
        Ok(Arc::new(Cq { raw: cq, _dom: self.clone() }))
    }

    /// A reliable-connected queue pair on `cq`, in RESET state until [`Qp::connect`].
    pub fn create_qp(self: &Arc<Self>, cq: &Arc<Cq>, max_send: u32, max_recv: u32) -> Result<Qp> {
        let mut tries = [64u32, 0].into_iter();
        loop {
            let inline = tries.next().unwrap_or(0);
            let mut attr = sys::ibv_qp_init_attr {
                qp_context: std::ptr::null_mut(),
                send_cq: cq.raw,
                recv_cq: cq.raw,
                srq: std::ptr::null_mut(),
                cap: sys::ibv_qp_cap { max_send_wr: max_send, max_recv_wr: max_recv, max_send_sge: 1, max_recv_sge: 1, max_inline_data: inline },
                qp_type: sys::IBV_QPT_RC,
                sq_sig_all: 0,
            };
            // SAFETY: pd and cq are live; attr is a valid in/out parameter.
            let qp = unsafe { (self.ctx.v.ibv_create_qp)(self.pd, &mut attr) };
            if !qp.is_null() {
                return Ok(Qp { raw: qp, max_inline: attr.cap.max_inline_data as usize, dom: self.clone(), _cq: cq.clone() });
            }
            if inline == 0 {
                return Err(Error::io(format!("ibv_create_qp on {}", self.ctx.name), std::io::Error::last_os_error()));
            }
        }
    }
}

fn register_error(len: usize, e: std::io::Error) -> Error {
    let hint = match e.raw_os_error() {
        Some(libc::ENOMEM) | Some(libc::EPERM) | Some(libc::EAGAIN) => format!(
            ": pinning {len} bytes needs locked memory and RLIMIT_MEMLOCK is {}; raise it with `ulimit -l unlimited` (shell), LimitMEMLOCK=infinity \
             (systemd), `--ulimit memlock=-1` (docker) or memlock in /etc/security/limits.conf",
            crate::mem::memlock_text()
        ),
        _ => String::new(),
    };
    Error::Unsupported(format!("ibv_reg_mr of {len} bytes failed: {e}{hint}"))
}

/// A completion queue.
pub struct Cq {
    raw: *mut sys::ibv_cq,
    _dom: Arc<Domain>,
}

// SAFETY: polled by one thread at a time (each owner keeps its CQ to itself).
unsafe impl Send for Cq {}
// SAFETY: as for Send.
unsafe impl Sync for Cq {}

impl Cq {
    /// Takes up to `out.len()` completions; never blocks.
    pub fn poll<'a>(&self, out: &'a mut [sys::ibv_wc]) -> std::io::Result<&'a [sys::ibv_wc]> {
        // SAFETY: the CQ is live and `out` has room for its length.
        let n = unsafe { sys::poll_cq(self.raw, out.len() as i32, out.as_mut_ptr()) };
        if n < 0 {
            return Err(std::io::Error::other(format!("ibv_poll_cq failed: {}", std::io::Error::from_raw_os_error(-n))));
        }
        Ok(&out[..n as usize])
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: every QP on this CQ holds an Arc to it and is gone.
        unsafe { (self._dom.ctx.v.ibv_destroy_cq)(self.raw) };
    }
}

/// A registered memory region.
pub struct Mr {
    raw: *mut sys::ibv_mr,
    pub addr: u64,
    pub len: usize,
    _dom: Arc<Domain>,
}

// SAFETY: keys are plain numbers; deregistration happens once, on drop.
unsafe impl Send for Mr {}
// SAFETY: as for Send.
unsafe impl Sync for Mr {}

impl Mr {
    pub fn lkey(&self) -> u32 {
        // SAFETY: live registration.
        unsafe { (*self.raw).lkey }
    }
    pub fn rkey(&self) -> u32 {
        // SAFETY: live registration.
        unsafe { (*self.raw).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered by us.
        unsafe { (self._dom.ctx.v.ibv_dereg_mr)(self.raw) };
    }
}

/// What a peer needs to connect a queue pair to ours and to write into our memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub qpn: u32,
    pub psn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    /// Address and key of the memory the peer may access (ring or window).
    pub addr: u64,
    pub rkey: u32,
    pub len: u64,
    /// The owner's process id and a hash of its host identity: a peer on the same host is
    /// watched through /proc, faster and surer than waiting for transport retries.
    pub pid: u32,
    pub host: u64,
}

/// A hash of this host's identity (see [`crate::bootstrap::host_id`]).
pub fn host_hash() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    crate::bootstrap::host_id().hash(&mut h);
    h.finish()
}

impl Endpoint {
    /// The peer's process id when it runs on this host.
    pub fn local_pid(&self) -> Option<u32> {
        (self.host == host_hash()).then_some(self.pid)
    }

    pub fn encode(&self) -> String {
        let gid: String = self.gid.iter().map(|b| format!("{b:02x}")).collect();
        format!("{} {} {} {gid} {} {} {} {} {}", self.qpn, self.psn, self.lid, self.addr, self.rkey, self.len, self.pid, self.host)
    }

    pub fn decode(s: &str) -> std::result::Result<Endpoint, String> {
        let f: Vec<&str> = s.split(' ').collect();
        if f.len() != 9 || f[3].len() != 32 {
            return Err(format!("malformed verbs endpoint {s:?}"));
        }
        let n = |i: usize| f[i].parse::<u64>().map_err(|_| format!("malformed verbs endpoint field {:?}", f[i]));
        let mut gid = [0u8; 16];
        for (i, g) in gid.iter_mut().enumerate() {
            *g = u8::from_str_radix(&f[3][2 * i..2 * i + 2], 16).map_err(|_| format!("malformed GID in {s:?}"))?;
        }
        let (qpn, psn, lid) = (n(0)?, n(1)?, n(2)?);
        let (rkey, pid) = (n(5)?, n(7)?);
        if qpn >= 1 << 24 || psn >= 1 << 24 || lid > u16::MAX as u64 || rkey > u32::MAX as u64 || pid > u32::MAX as u64 {
            return Err(format!("verbs endpoint out of range: {s:?}"));
        }
        Ok(Endpoint { qpn: qpn as u32, psn: psn as u32, lid: lid as u16, gid, addr: n(4)?, rkey: rkey as u32, len: n(6)?, pid: pid as u32, host: n(8)? })
    }
}

/// ACK timeout exponent: 4.096 µs · 2^16 ≈ 270 ms per try, 7 tries: a dead or unreachable
/// peer fails a pending work request in about 2 s, well inside the default deadline.
const ACK_TIMEOUT: u8 = 16;
const RETRY_COUNT: u8 = 7;

/// A reliable-connected queue pair.
pub struct Qp {
    raw: *mut sys::ibv_qp,
    pub max_inline: usize,
    dom: Arc<Domain>,
    _cq: Arc<Cq>,
}

// SAFETY: posting is thread-safe in libibverbs; each owner posts from one thread.
unsafe impl Send for Qp {}
// SAFETY: as for Send.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by us.
        unsafe { (self.dom.ctx.v.ibv_destroy_qp)(self.raw) };
    }
}

/// A work request to post.
pub enum Wr<'a> {
    /// RDMA WRITE WITH IMMEDIATE (or plain WRITE when `imm` is `None`) of `local` to
    /// `remote_addr`.
    Write { local: Option<(&'a [u8], u32)>, remote_addr: u64, rkey: u32, imm: Option<u32> },
    /// SEND WITH IMMEDIATE of no data (credits and control words).
    SendImm(u32),
    /// RDMA READ of `len` bytes at `remote_addr` into `local` (lkey).
    Read { local: (*mut u8, usize, u32), remote_addr: u64, rkey: u32 },
    /// Atomic fetch-and-add of `add` at `remote_addr`; the old value lands at `local`.
    FetchAdd { local: (*mut u8, u32), remote_addr: u64, rkey: u32, add: u64 },
}

impl Qp {
    pub fn qpn(&self) -> u32 {
        // SAFETY: live QP.
        unsafe { (*self.raw).qp_num }
    }

    /// This side's endpoint for memory `mr` (or none).
    pub fn endpoint(&self, psn: u32, mr: Option<&Mr>) -> Endpoint {
        let c = &self.dom.choice;
        Endpoint {
            qpn: self.qpn(),
            psn,
            lid: c.lid,
            gid: c.gid.raw,
            addr: mr.map_or(0, |m| m.addr),
            rkey: mr.map_or(0, |m| m.rkey()),
            len: mr.map_or(0, |m| m.len as u64),
            pid: std::process::id(),
            host: host_hash(),
        }
    }

    fn modify(&self, attr: &mut sys::ibv_qp_attr, mask: i32, what: &str) -> Result<()> {
        // SAFETY: live QP; attr valid for the call.
        let rc = unsafe { (self.dom.ctx.v.ibv_modify_qp)(self.raw, attr, mask) };
        if rc != 0 {
            let c = &self.dom.choice;
            return Err(Error::io(
                format!("ibv_modify_qp to {what} on {} port {} (GID {} {})", c.dev, c.port, c.gid.index, c.gid),
                std::io::Error::from_raw_os_error(rc),
            ));
        }
        Ok(())
    }

    /// RESET → INIT → RTR → RTS towards `remote`.
    pub fn connect(&self, local_psn: u32, remote: &Endpoint) -> Result<()> {
        use sys::*;
        let c = &self.dom.choice;
        let mut a = ibv_qp_attr { qp_state: IBV_QPS_INIT, pkey_index: 0, port_num: c.port, qp_access_flags: ACCESS, ..Default::default() };
        self.modify(&mut a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT")?;
        let mtu = match c.mtu {
            4096.. => IBV_MTU_4096,
            2048.. => IBV_MTU_2048,
            1024.. => IBV_MTU_1024,
            512.. => IBV_MTU_512,
            _ => IBV_MTU_256,
        };
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTR,
            path_mtu: mtu,
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ..Default::default()
        };
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.port_num = c.port;
        if c.ethernet || remote.gid != [0; 16] {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.sgid_index = c.gid.index as u8;
        }
        self.modify(
            &mut a,
            IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER,
            "RTR",
        )?;
        let mut a = ibv_qp_attr {
            qp_state: IBV_QPS_RTS,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_COUNT,
            rnr_retry: 7,
            sq_psn: local_psn,
            max_rd_atomic: 16,
            ..Default::default()
        };
        self.modify(&mut a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC, "RTS")
    }

    /// Posts one signaled work request.
    ///
    /// # Safety
    /// The device reads and writes the memory a request names after this call returns, until
    /// its completion is polled from the queue pair's completion queue (or the queue pair is
    /// destroyed). Until then: a write's `local` bytes must stay valid and unchanged (inline
    /// ones excepted: they are copied at the call); a read's or fetch-and-add's `local`
    /// memory must stay valid and be neither read nor written by anyone else. Local memory
    /// must lie in the registration whose key the request carries, and `remote_addr`/`rkey`
    /// must name memory the peer registered for this access. (A send with an immediate and
    /// no data names no memory: [`Qp::send_imm`] posts it safely.)
    pub unsafe fn post(&self, wr_id: u64, wr: Wr<'_>) -> std::io::Result<()> {
        use sys::*;
        let mut sge = ibv_sge::default();
        let mut w = ibv_send_wr { wr_id, send_flags: IBV_SEND_SIGNALED, ..Default::default() };
        match wr {
            Wr::Write { local, remote_addr, rkey, imm } => {
                w.opcode = if imm.is_some() { IBV_WR_RDMA_WRITE_WITH_IMM } else { IBV_WR_RDMA_WRITE };
                if let Some(imm) = imm {
                    w.imm_data = imm.to_be();
                }
                if let Some((data, lkey)) = local {
                    sge = ibv_sge { addr: data.as_ptr() as u64, length: data.len() as u32, lkey };
                    w.num_sge = (!data.is_empty()) as i32;
                    if !data.is_empty() && data.len() <= self.max_inline {
                        w.send_flags |= IBV_SEND_INLINE;
                    }
                }
                w.wr.rdma = ibv_send_wr_rdma { remote_addr, rkey };
            }
            Wr::SendImm(imm) => {
                w.opcode = IBV_WR_SEND_WITH_IMM;
                w.imm_data = imm.to_be();
            }
            Wr::Read { local: (ptr, len, lkey), remote_addr, rkey } => {
                w.opcode = IBV_WR_RDMA_READ;
                sge = ibv_sge { addr: ptr as u64, length: len as u32, lkey };
                w.num_sge = 1;
                w.wr.rdma = ibv_send_wr_rdma { remote_addr, rkey };
            }
            Wr::FetchAdd { local: (ptr, lkey), remote_addr, rkey, add } => {
                w.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
                sge = ibv_sge { addr: ptr as u64, length: 8, lkey };
                w.num_sge = 1;
                w.wr.atomic = ibv_send_wr_atomic { remote_addr, compare_add: add, swap: 0, rkey };
            }
        }
        w.sg_list = &mut sge;
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; the WR and its SGE live for the call; the memory they name is
        // registered (or inline) and outlives the request: this function's contract.
        let rc = unsafe { post_send(self.raw, &mut w, &mut bad) };
        if rc != 0 {
            let e = std::io::Error::from_raw_os_error(rc);
            return Err(std::io::Error::new(e.kind(), format!("ibv_post_send on queue pair {}: {e}", self.qpn())));
        }
        Ok(())
    }

    /// Posts a SEND WITH IMMEDIATE of no data (credits and control words).
    pub fn send_imm(&self, wr_id: u64, imm: u32) -> std::io::Result<()> {
        // SAFETY: the request names no memory, local or remote.
        unsafe { self.post(wr_id, Wr::SendImm(imm)) }
    }

    /// Posts one receive without buffers (it only catches an immediate).
    pub fn post_recv(&self, wr_id: u64) -> std::io::Result<()> {
        let mut w = sys::ibv_recv_wr { wr_id, next: std::ptr::null_mut(), sg_list: std::ptr::null_mut(), num_sge: 0 };
        let mut bad = std::ptr::null_mut();
        // SAFETY: live QP; a receive with no scatter entries.
        let rc = unsafe { sys::post_recv(self.raw, &mut w, &mut bad) };
        if rc != 0 {
            let e = std::io::Error::from_raw_os_error(rc);
            return Err(std::io::Error::new(e.kind(), format!("ibv_post_recv on queue pair {}: {e}", self.qpn())));
        }
        Ok(())
    }

    pub fn domain(&self) -> &Arc<Domain> {
        &self.dom
    }
}

/// Decodes a failed completion: status name and number, vendor error, and what usually
/// causes it.
pub fn completion_error(wc: &sys::ibv_wc, op: &str, dom: &Domain) -> std::io::Error {
    let (status, vendor) = (wc.status, wc.vendor_err);
    // SAFETY: ibv_wc_status_str returns a static string for any value.
    let name = unsafe { CStr::from_ptr((dom.ctx.v.ibv_wc_status_str)(status)) }.to_string_lossy().into_owned();
    let c = &dom.choice;
    let hint = match status {
        sys::IBV_WC_RETRY_EXC_ERR => format!(
            ": the peer did not acknowledge — its process is gone, or it is unreachable from {} port {} with local GID {} {} ({}); \
             a wrong GID index (GRADWIRE_GID_INDEX) shows up exactly like this",
            c.dev,
            c.port,
            c.gid.index,
            c.gid,
            c.gid.kind.name()
        ),
        sys::IBV_WC_WR_FLUSH_ERR => ": flushed because the queue pair had already failed".to_string(),
        sys::IBV_WC_REM_ACCESS_ERR => {
            ": the peer refused access — its process exited (taking its registrations along) or the region is smaller than the request".to_string()
        }
        _ => String::new(),
    };
    std::io::Error::other(format!("RDMA {op} failed: {name} (status {status}, vendor error {vendor:#x}){hint}"))
}

/// A random 24-bit packet sequence number to start a queue pair with.
pub fn fresh_psn() -> u32 {
    rand::random::<u32>() & 0xFF_FFFF
}

/// The verbs backend of one communicator: the RDMA device its links and windows use.
pub(crate) struct VerbsBackend {
    pub(crate) domain: Arc<Domain>,
}

impl Backend for VerbsBackend {
    fn transport(&self) -> Transport {
        Transport::Verbs
    }

    fn connect(&self, s: &Setup<'_>, peers: &[usize]) -> Result<Vec<(usize, Box<dyn Link>)>> {
        connect::connect_all(s.prefix, s.rank, peers, s.store, &self.domain, s.cfg, s.deadline)
    }
}

/// The verbs domain (when used) and the peers reached over verbs: with `verbs` all remote
/// peers; with `auto` the peers where both ends have a usable RDMA port (each rank
/// publishes whether it has one, so both ends of a pair agree).
pub(crate) fn choose_peers(s: &Setup<'_>, remote: &[usize]) -> Result<(Option<VerbsBackend>, Vec<usize>)> {
    if remote.is_empty() {
        return Ok((None, vec![]));
    }
    let (prefix, rank, store, deadline) = (s.prefix, s.rank, s.store, s.deadline);
    let ip = store.local_ip().ok();
    match s.cfg.transport {
        TransportChoice::Verbs => Ok((Some(VerbsBackend { domain: Domain::get(ip)? }), remote.to_vec())),
        TransportChoice::Auto => {
            let dom = match Domain::get(ip) {
                Ok(d) => Some(d),
                Err(e) => {
                    // RDMA hardware the kernel knows but gradwire cannot use is worth a
                    // warning; a host without any is the ordinary TCP case.
                    if device::kernel_devices().is_empty() {
                        log::info!("rank {rank}: no verbs between hosts ({e}); using tcp");
                    } else {
                        log::warn!("rank {rank}: the kernel has RDMA devices but verbs are unusable ({e}); using tcp");
                    }
                    None
                }
            };
            store.set(&format!("{prefix}/ib-up/{rank}"), if dom.is_some() { b"1" } else { b"0" })?;
            let mut peers = Vec::new();
            for &p in remote {
                let theirs = store.get(&format!("{prefix}/ib-up/{p}"), deadline)?;
                if dom.is_some() && theirs.as_deref() == Some(b"1") {
                    peers.push(p);
                }
            }
            Ok((dom.filter(|_| !peers.is_empty()).map(|domain| VerbsBackend { domain }), peers))
        }
        _ => Ok((None, vec![])),
    }
}

#[cfg(test)]
mod tests {
    use super::Endpoint;

    #[test]
    fn endpoint_round_trips_and_rejects_garbage() {
        let e = Endpoint {
            qpn: 0x11,
            psn: 0xABCDE,
            lid: 0,
            gid: [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 2, 15],
            addr: 0x7f00_1234_5000,
            rkey: 0x1234,
            len: 4 << 20,
            pid: 77,
            host: u64::MAX,
        };
        assert_eq!(Endpoint::decode(&e.encode()), Ok(e));
        for bad in
            ["", "1 2 3", "1 2 3 zz 4 5 6", "16777216 0 0 00000000000000000000ffff0a00020f 0 0 0 1 2", "1 2 3 00000000000000000000ffff0a00020f x 5 6 1 2"]
        {
            assert!(Endpoint::decode(bad).is_err(), "{bad:?} accepted");
        }
    }
}
