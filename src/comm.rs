//! The communicator: one group of ranks with its links, progress engine and sequence
//! counter. Built from the environment (`Communicator::init`) or by splitting another.

use crate::bootstrap::{Bootstrap, StoreClient, Topology};
use crate::collective::algos::{dissemination_barrier, Ctx};
use crate::config::{Config, TransportChoice};
use crate::dtype::{DType, ReduceOp};
use crate::engine::{Engine, EngineState, Job, Work};
use crate::error::{config, Error, Result};
use crate::mem::Region;
use crate::transport::frame::{CallHeader, OpKind};
use crate::transport::onesided::{RmaService, Window, WindowSetup};
use crate::transport::shm::{ShmDomain, ShmLink};
use crate::transport::{tcp, LinkTable, Links};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// The sequence number of the closing agreement's messages: never a collective's.
const SETUP_SEQ: u64 = u64::MAX - 1;

/// A group of ranks that run collectives together.
pub struct Communicator {
    rank: usize,
    size: usize,
    /// Host index of every rank of this communicator.
    topology: Topology,
    pub(crate) config: Config,
    engine: Engine,
    splits: AtomicU64,
    pub(crate) store: Option<Arc<StoreClient>>,
    secret: String,
    pub(crate) prefix: String,
    /// Transport used to reach each peer ("self", "shm", "tcp", "verbs").
    link_kinds: Vec<&'static str>,
    /// Global rank of each rank of this communicator.
    global_ranks: Vec<usize>,
    /// Serves one-sided operations from tcp peers; started by the first `expose`.
    rma: std::sync::OnceLock<RmaService>,
    /// The RDMA device this communicator's verbs links (and windows) use.
    verbs: VerbsDomain,
    windows: AtomicU64,
    /// Per-peer message counters of point-to-point send/recv (their header sequence).
    pub(crate) p2p_sent: Vec<AtomicU64>,
    pub(crate) p2p_received: Vec<AtomicU64>,
    _bootstrap: Option<Arc<Bootstrap>>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator({}, rank {}/{})", self.prefix, self.rank, self.size)
    }
}

impl Communicator {
    /// Joins the job described by the environment (see `bootstrap::env`), connecting to
    /// every peer within `GRADWIRE_TIMEOUT_MS`.
    pub fn init() -> Result<Self> {
        crate::config::init_logging();
        Self::with_env(crate::bootstrap::RankEnv::from_env()?, Config::from_env()?)
    }

    /// Joins the group that `id` leads to as `rank` of `world` (the framework carried the id
    /// from the process that made it, as with `ncclCommInitRank`), settings from the
    /// environment. Neither MASTER_ADDR/MASTER_PORT nor GRADWIRE_JOB_SECRET is read.
    pub fn from_unique_id(id: &crate::bootstrap::unique_id::UniqueId, world: usize, rank: usize) -> Result<Self> {
        crate::config::init_logging();
        if world == 0 || rank >= world {
            return Err(config(format!("rank {rank} of a group of {world}: the rank must be in 0..{world}")));
        }
        let env = crate::bootstrap::RankEnv {
            rank,
            world,
            local_rank: None,
            local_world: None,
            master_addr: id.host.clone(),
            master_port: id.port,
            secret: id.secret.clone(),
            store_exists: true,
        };
        Self::with_env(env, Config::from_env()?)
    }

    /// Joins a job described by `env` with settings `cfg` (for embedding and tests; `init`
    /// reads both from the process environment).
    pub fn with_env(env: crate::bootstrap::RankEnv, cfg: Config) -> Result<Self> {
        let deadline = Instant::now() + cfg.timeout;
        let boot = Arc::new(Bootstrap::new(env, deadline)?);
        let (rank, size) = (boot.env.rank, boot.env.world);
        let topo = boot.topology.clone();
        let store = boot.store.clone();
        let secret = boot.env.secret.clone();
        let prefix = format!("w{}", boot.generation);
        let comm = Self::build(rank, size, topo, cfg, store, secret, prefix, deadline, Some(boot.clone()), (0..size).collect())?;
        // Before the closing barrier: after it a rank may exit, rank 0's store with it.
        boot.check_setup()?;
        comm.closing_agreement(deadline)?;
        Ok(comm)
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        rank: usize,
        size: usize,
        topology: Topology,
        cfg: Config,
        store: Option<Arc<StoreClient>>,
        secret: String,
        prefix: String,
        deadline: Instant,
        boot: Option<Arc<Bootstrap>>,
        global_ranks: Vec<usize>,
    ) -> Result<Self> {
        let local = topology.local_ranks(rank);
        if cfg.transport == TransportChoice::Shm && !topology.single_host() {
            let other = (0..size).find(|&r| !topology.same_host(rank, r)).unwrap_or(0);
            return Err(config(format!("GRADWIRE_TRANSPORT=shm, but rank {rank} and rank {other} are on different hosts (use auto or tcp)")));
        }
        let use_shm = !matches!(cfg.transport, TransportChoice::Tcp | TransportChoice::Verbs);
        let shm_peers: Vec<usize> = if use_shm { local.iter().copied().filter(|&p| p != rank).collect() } else { vec![] };
        let remote: Vec<usize> = (0..size).filter(|&p| p != rank && !shm_peers.contains(&p)).collect();
        let (verbs, verbs_peers) = verbs_peers(&prefix, rank, &cfg, &remote, store.as_deref(), deadline)?;
        let tcp_peers: Vec<usize> = remote.iter().copied().filter(|p| !verbs_peers.contains(p)).collect();
        let abort = Arc::new(AtomicBool::new(false));
        let (mut links, shm): (LinkTable, Option<Arc<ShmDomain>>) = match &store {
            None => ((0..size).map(|_| None).collect(), None),
            Some(store) => {
                let shm = if shm_peers.is_empty() { None } else { Some(ShmDomain::create(&prefix, rank, size, &local, &cfg, store, deadline)?) };
                let mut links = tcp::connect_all(&prefix, rank, size, &tcp_peers, store, &secret, deadline)?;
                if let Some(dom) = &verbs {
                    for (p, l) in crate::transport::verbs::link::connect_all(&prefix, rank, &verbs_peers, store, dom, &cfg, deadline)? {
                        links[p] = Some(l);
                    }
                }
                (links, shm)
            }
        };
        if let Some(dom) = &shm {
            for &p in &shm_peers {
                links[p] = Some(Box::new(ShmLink::new(dom.clone(), p)));
            }
        }
        let link_kinds = (0..size).map(|p| if p == rank { "self" } else { links[p].as_ref().map(|l| l.kind()).unwrap_or("none") }).collect();
        let shm_all = shm.is_some() && shm_peers.len() + 1 == size;
        // Spinning only pays when every rank on this machine has a core of its own (ranks
        // in other network namespaces of this machine count: `launch --netns`).
        let (here, cpus) = (topology.ranks_on_machine(rank), host_cpus());
        let spin = if here > cpus { std::time::Duration::ZERO } else { cfg.spin };
        log::debug!("rank {rank}: {here} ranks on this host, {cpus} CPUs for them: spin {} us before yielding", spin.as_micros());
        let links = Links::new(rank, links, abort.clone(), spin);
        let state = EngineState::new(rank, size, links, shm, shm_all, spin, abort, global_ranks.clone())
            .with_store(store.clone(), &prefix)
            .with_shm_allreduce(cfg.shm_stores, cfg.shm_cma);
        let engine = Engine::start(state, cfg.timeout, format!("gradwire-{prefix}-r{rank}"))?;
        let comm = Communicator {
            rank,
            size,
            topology,
            config: cfg,
            engine,
            splits: AtomicU64::new(0),
            store,
            secret,
            prefix,
            link_kinds,
            rma: std::sync::OnceLock::new(),
            verbs,
            global_ranks,
            windows: AtomicU64::new(0),
            p2p_sent: (0..size).map(|_| AtomicU64::new(0)).collect(),
            p2p_received: (0..size).map(|_| AtomicU64::new(0)).collect(),
            _bootstrap: boot,
        };
        Ok(comm)
    }

    /// The last step of setup: returns once every rank has finished its own, so that a
    /// rank may exit as soon as init returns without a peer still opening its shared
    /// memory or asking its store (rank 0) for something. A barrier over the new links
    /// (proving them too), outside the collectives' sequence numbers.
    fn closing_agreement(&self, deadline: Instant) -> Result<()> {
        if self.size == 1 {
            return Ok(());
        }
        let job = Box::new(move |st: &mut EngineState, _: Instant| {
            let call = CallHeader { op: OpKind::Barrier, dtype: DType::F32, redop: ReduceOp::Sum, root: 0, count: 0, seq: SETUP_SEQ };
            let (rank, world) = (st.rank, st.world);
            let mut cx = Ctx { links: &mut st.links, call, deadline, rank, world, dtype: DType::F32, op: ReduceOp::Sum };
            dissemination_barrier(&mut cx).map_err(|e| match e {
                Error::Timeout { rank, peer, waited_ms, .. } => {
                    Error::Timeout { rank, peer, op: "communicator setup (waiting for every rank to finish it)".into(), waited_ms }
                }
                Error::PeerLost { rank, peer, cause, .. } => Error::PeerLost { rank, peer, op: "communicator setup".into(), cause },
                other => other,
            })
        });
        self.run_blocking(|| "communicator setup".into(), job)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Which ranks of this communicator share a host.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The job-wide rank of each rank of this communicator.
    pub fn global_ranks(&self) -> &[usize] {
        &self.global_ranks
    }

    /// The transport used to reach each rank ("self", "shm", "tcp" or "verbs").
    pub fn link_kinds(&self) -> &[&'static str] {
        &self.link_kinds
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Fails the running operation and every later one on every rank that talks to us;
    /// wakes all waiters with an error.
    pub fn abort(&self) {
        self.engine.abort.store(true, Ordering::Release);
    }

    pub(crate) fn submit(&self, what: String, job: Job) -> Work {
        self.engine.submit(what, job)
    }

    pub(crate) fn run_blocking(&self, what: impl FnOnce() -> String, job: Job) -> Result<()> {
        self.engine.run_blocking(what, job)
    }

    /// Splits into sub-communicators by `color` (ranks with equal colour form one group,
    /// ordered by `key`, then by rank). A negative colour joins no group (`None`). Every
    /// rank must call it, in the same order relative to other collectives.
    pub fn split(&self, color: i32, key: i32) -> Result<Option<Communicator>> {
        let n = self.splits.fetch_add(1, Ordering::Relaxed);
        let mine = [color as f64, key as f64];
        let mut all = vec![0f64; 2 * self.size];
        self.allgather(&mine, &mut all)?;
        if color < 0 {
            return Ok(None);
        }
        let mut members: Vec<(i32, usize)> = (0..self.size).filter(|&r| all[2 * r] as i32 == color).map(|r| (all[2 * r + 1] as i32, r)).collect();
        members.sort();
        let ranks: Vec<usize> = members.iter().map(|m| m.1).collect();
        let new_rank = ranks.iter().position(|&r| r == self.rank).unwrap_or(0);
        let topo = self.topology.subset(&ranks);
        let prefix = format!("{}/s{n}c{color}", self.prefix);
        let deadline = Instant::now() + self.config.timeout;
        let store = if ranks.len() > 1 { self.store.clone() } else { None };
        let global = ranks.iter().map(|&r| self.global_ranks[r]).collect();
        let sub = Self::build(new_rank, ranks.len(), topo, self.config.clone(), store, self.secret.clone(), prefix, deadline, self._bootstrap.clone(), global)?;
        sub.closing_agreement(deadline)?;
        Ok(Some(sub))
    }

    /// Exposes `region` for one-sided write/read/fetch-add by every rank and connects to
    /// every rank's exposed region. Collective: every rank calls it, in the same order.
    /// Ranks on this host map the region directly, so it must be `Region::shared` when the
    /// communicator has local peers.
    pub fn expose(&self, region: Arc<Region>) -> Result<Window> {
        self.expose_with(region, None)
    }

    /// [`Communicator::expose`], with `accumulate` applying what tcp peers send through
    /// [`Window::accumulate`] to `region`.
    pub fn expose_with(&self, region: Arc<Region>, accumulate: Option<Arc<dyn crate::transport::onesided::Accumulate>>) -> Result<Window> {
        let id = self.windows.fetch_add(1, Ordering::Relaxed);
        let shm_peer: Vec<bool> = self.link_kinds.iter().map(|k| *k == "shm").collect();
        let service = if self.link_kinds.contains(&"tcp") {
            let store = self.store.as_ref().ok_or_else(|| config("no rendezvous store"))?;
            if self.rma.get().is_none() {
                let svc = RmaService::start(store.local_ip()?, &self.secret, &format!("rma:{}", self.prefix), self.rank)?;
                let _ = self.rma.set(svc);
            }
            self.rma.get()
        } else {
            None
        };
        let verbs_peer: Vec<bool> = self.link_kinds.iter().map(|k| *k == "verbs").collect();
        let w = WindowSetup {
            verbs: self.verbs.as_ref().map(|d| (d, verbs_peer.as_slice())),
            prefix: &self.prefix,
            id,
            rank: self.rank,
            world: self.size,
            shm_peer: &shm_peer,
            store: self.store.as_deref(),
            service,
            secret: &self.secret,
            timeout: self.config.timeout,
            accumulate,
        };
        Window::create(w, region)
    }

    /// The ranks of this rank's host, as a communicator (the intra-node group).
    pub fn split_node_local(&self) -> Result<Communicator> {
        let host = self.topology.host_of[self.rank] as i32;
        self.split(host, self.rank as i32)?.ok_or_else(|| config("node-local split produced no group"))
    }

    /// One rank per host with the same local index (the cross-node group of that index).
    pub fn split_cross_node(&self) -> Result<Communicator> {
        let local_index = self.topology.local_ranks(self.rank).iter().position(|&r| r == self.rank).unwrap_or(0) as i32;
        self.split(local_index, self.rank as i32)?.ok_or_else(|| config("cross-node split produced no group"))
    }
}

/// The verbs domain (when used) and the peers reached over verbs: with `verbs` all remote
/// peers; with `auto` the peers where both ends have a usable RDMA port (each rank
/// publishes whether it has one, so both ends of a pair agree).
fn verbs_peers(prefix: &str, rank: usize, cfg: &Config, remote: &[usize], store: Option<&StoreClient>, deadline: Instant) -> Result<(VerbsDomain, Vec<usize>)> {
    use crate::transport::verbs::Domain;
    let Some(store) = store.filter(|_| !remote.is_empty()) else { return Ok((None, vec![])) };
    let ip = store.local_ip().ok();
    match cfg.transport {
        TransportChoice::Verbs => Ok((Some(Domain::get(ip)?), remote.to_vec())),
        TransportChoice::Auto => {
            let dom = match Domain::get(ip) {
                Ok(d) => Some(d),
                Err(e) => {
                    // RDMA hardware the kernel knows but gradwire cannot use is worth a
                    // warning; a host without any is the ordinary TCP case.
                    if crate::transport::verbs::device::kernel_devices().is_empty() {
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
            Ok((dom.filter(|_| !peers.is_empty()), peers))
        }
        _ => Ok((None, vec![])),
    }
}

type VerbsDomain = Option<Arc<crate::transport::verbs::Domain>>;

/// CPUs this job's ranks can use: the CPUs online, fewer when the control group the
/// process runs in (a container, a batch scheduler's job) confines it to a cpuset or caps
/// it with a CPU quota. Not `available_parallelism`, which counts only this process's
/// affinity: a launcher that pins each rank to its own core would make every rank see one
/// CPU and give up spinning exactly where spinning pays (2 pinned ranks on 2 cores: the
/// 4 KiB shm allreduce spent half its time in sched_yield). Pinning changes the affinity,
/// never the control group. Assumed: the ranks of a host share one control group (a
/// container, a job step). A scheduler that puts every rank in a cgroup of its own with one
/// CPU makes each see 1 CPU, and they stop spinning although each has its core: small
/// calls get slower, never wrong.
pub fn host_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    let online = if n > 0 { n as usize } else { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) };
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    cgroup_cpu_limit(&own, |path| std::fs::read_to_string(path).ok()).map_or(online, |limit| limit.clamp(1, online))
}

/// The CPU limit of the control groups in `own` (the text of /proc/self/cgroup): the
/// smaller of the effective cpuset's size and the CPU quota rounded up, from cgroup v1's
/// `cpuset` and `cpu` controllers or else from cgroup v2. A parent's quota caps its
/// children, so every ancestor's counts; a container that mounts its own group at the root
/// (its path in `own` missing there) is read at the root. `read` returns a file's text.
fn cgroup_cpu_limit(own: &str, read: impl Fn(&str) -> Option<String>) -> Option<usize> {
    let groups: Vec<(&str, &str)> = own
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            f.next()?;
            Some((f.next()?, f.next()?))
        })
        .collect();
    // The group's directory under `top` and every ancestor up to `top`, innermost first.
    let dirs = |controller: &str, top: &str| -> Vec<String> {
        let Some(&(_, path)) = groups.iter().find(|(c, _)| if controller.is_empty() { c.is_empty() } else { c.split(',').any(|c| c == controller) }) else {
            return vec![];
        };
        let mut rel = path.trim().trim_end_matches('/').to_string();
        let mut v = vec![format!("{top}{rel}")];
        while let Some(i) = rel.rfind('/') {
            rel.truncate(i);
            v.push(format!("{top}{rel}"));
        }
        v
    };
    let cpuset = |dirs: &[String], file: &str| dirs.iter().find_map(|d| read(&format!("{d}/{file}"))).and_then(|t| cpu_list_len(&t));
    let mut limits = vec![];
    let v1_cpuset = dirs("cpuset", "/sys/fs/cgroup/cpuset");
    limits.extend(cpuset(&v1_cpuset, "cpuset.effective_cpus"));
    for d in dirs("cpu", "/sys/fs/cgroup/cpu") {
        let number = |f: &str| read(&format!("{d}/{f}")).and_then(|t| t.trim().parse::<i64>().ok());
        if let (Some(q), Some(p)) = (number("cpu.cfs_quota_us"), number("cpu.cfs_period_us")) {
            limits.extend(quota_cpus(q, p));
        }
    }
    // v2 only where no v1 controller answered: a hybrid host mounts v2 without them.
    if v1_cpuset.is_empty() && limits.is_empty() {
        let v2 = dirs("", "/sys/fs/cgroup");
        limits.extend(cpuset(&v2, "cpuset.cpus.effective"));
        for d in &v2 {
            let max = read(&format!("{d}/cpu.max")).unwrap_or_default();
            let mut f = max.split_whitespace().map(str::parse::<i64>);
            if let (Some(Ok(q)), Some(Ok(p))) = (f.next(), f.next()) {
                limits.extend(quota_cpus(q, p));
            }
        }
    }
    limits.into_iter().min()
}

/// CPUs a quota of `quota` µs per `period` µs allows, rounded up; none for "no limit"
/// (a negative quota in v1; "max" does not parse in v2).
fn quota_cpus(quota: i64, period: i64) -> Option<usize> {
    (quota > 0 && period > 0).then(|| (quota as u64).div_ceil(period as u64) as usize)
}

/// How many CPUs a kernel CPU list names ("0-3,8,10-11" is 7); none if it does not parse
/// or is empty.
fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0;
    for range in list.trim().split(',').filter(|r| !r.is_empty()) {
        let (lo, hi) = range.split_once('-').unwrap_or((range, range));
        let (lo, hi): (usize, usize) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
        n = hi.checked_sub(lo).and_then(|d| d.checked_add(1)).and_then(|k| k.checked_add(n))?;
    }
    (n > 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn limit(own: &str, files: &[(&str, &str)]) -> Option<usize> {
        let files: HashMap<&str, &str> = files.iter().copied().collect();
        cgroup_cpu_limit(own, |p| files.get(p).map(|t| t.to_string()))
    }

    #[test]
    fn cpu_lists_and_quotas() {
        assert_eq!(cpu_list_len("0-3,8,10-11\n"), Some(7));
        assert_eq!(cpu_list_len("5"), Some(1));
        assert_eq!(cpu_list_len(""), None);
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(cpu_list_len("a-b"), None);
        assert_eq!(cpu_list_len("0-18446744073709551615"), None);
        assert_eq!(quota_cpus(150_000, 100_000), Some(2));
        assert_eq!(quota_cpus(-1, 100_000), None);
        assert_eq!(quota_cpus(100_000, 0), None);
    }

    #[test]
    fn cgroup_v1_cpuset_and_an_ancestors_quota() {
        let own = "9:name=systemd:/\n3:cpuset:/job\n1:cpu,cpuacct:/job/step\n0::/\n";
        let files = [
            ("/sys/fs/cgroup/cpuset/job/cpuset.effective_cpus", "0-5\n"),
            ("/sys/fs/cgroup/cpu/job/step/cpu.cfs_quota_us", "-1\n"),
            ("/sys/fs/cgroup/cpu/job/step/cpu.cfs_period_us", "100000\n"),
            ("/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us", "250000\n"),
            ("/sys/fs/cgroup/cpu/job/cpu.cfs_period_us", "100000\n"),
        ];
        assert_eq!(limit(own, &files), Some(3));
        assert_eq!(limit(own, &files[..1]), Some(6));
        assert_eq!(limit(own, &[]), None);
    }

    #[test]
    fn cgroup_v1_container_that_mounts_its_group_at_the_root() {
        // The host's path is not under the container's mount: the root is its group.
        let own = "3:cpuset:/docker/abc\n";
        assert_eq!(limit(own, &[("/sys/fs/cgroup/cpuset/cpuset.effective_cpus", "2-3")]), Some(2));
    }

    #[test]
    fn cgroup_v2_cpuset_and_cpu_max() {
        let own = "0::/user.slice/job\n";
        let files = [
            ("/sys/fs/cgroup/user.slice/job/cpuset.cpus.effective", "0-7"),
            ("/sys/fs/cgroup/user.slice/job/cpu.max", "max 100000"),
            ("/sys/fs/cgroup/user.slice/cpu.max", "400000 100000"),
        ];
        assert_eq!(limit(own, &files), Some(4));
        assert_eq!(limit(own, &files[..2]), Some(8));
        assert_eq!(limit("0::/\n", &[("/sys/fs/cgroup/cpuset.cpus.effective", "0")]), Some(1));
    }
}
