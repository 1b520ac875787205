//! The communicator: one group of ranks with its links, progress engine and sequence
//! counter. Built from the environment (`Communicator::init`) or by splitting another.

use crate::bootstrap::{Bootstrap, StoreClient, Topology};
use crate::collective::algos::{dissemination_barrier, Ctx};
use crate::collective::shm::OneHost;
use crate::config::Config;
use crate::dtype::{DType, ReduceOp};
use crate::engine::{Engine, EngineState, Job, Work};
use crate::error::{config, Error, Result};
use crate::mem::Region;
use crate::transport::backend::{connect_links, Connected, Setup};
use crate::transport::frame::{CallHeader, OpKind};
use crate::transport::onesided::{RmaService, Window, WindowSetup};
use crate::transport::{Links, Transport};
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
    /// Transport used to reach each peer (`None`: this rank).
    link_kinds: Vec<Option<Transport>>,
    /// Global rank of each rank of this communicator.
    global_ranks: Vec<usize>,
    /// The one-host allreduce, when some peers share this host through shared memory.
    pub(crate) one_host: Option<Arc<OneHost>>,
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
        let abort = Arc::new(AtomicBool::new(false));
        let setup = store.as_deref().map(|store| Setup { prefix: &prefix, rank, size, store, secret: &secret, cfg: &cfg, deadline });
        let Connected { links, shm, shm_peers, verbs } = connect_links(&cfg, rank, size, &topology, setup.as_ref())?;
        let link_kinds = (0..size).map(|p| links[p].as_ref().map(|l| l.kind())).collect();
        let shm_all = shm.is_some() && shm_peers.len() + 1 == size;
        // Spinning only pays when every rank on this machine has a core of its own (ranks
        // in other network namespaces of this machine count: `launch --netns`).
        let (here, cpus) = (topology.ranks_on_machine(rank), crate::sys::cpus::host_cpus());
        let spin = if here > cpus { std::time::Duration::ZERO } else { cfg.spin };
        log::debug!("rank {rank}: {here} ranks on this host, {cpus} CPUs for them: spin {} us before yielding", spin.as_micros());
        let links = Links::new(rank, links, abort.clone(), spin);
        let one_host = shm.clone().map(|dom| Arc::new(OneHost::new(dom, shm_all, spin, cfg.shm_stores, cfg.shm_cma)));
        let state = EngineState::new(rank, size, links, shm, abort, global_ranks.clone()).with_store(store.clone(), &prefix);
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
            one_host,
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

    /// This rank's index in the communicator.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
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

    /// The transport used to reach each rank (`None` for this one).
    pub fn link_kinds(&self) -> &[Option<Transport>] {
        &self.link_kinds
    }

    /// The transports this rank's links use, each once, in order.
    pub fn transports_used(&self) -> Vec<Transport> {
        let mut used: Vec<Transport> = self.link_kinds.iter().flatten().copied().collect();
        used.sort();
        used.dedup();
        used
    }

    /// The settings it was made with (`GRADWIRE_*`).
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
        let shm_peer: Vec<bool> = self.link_kinds.iter().map(|k| *k == Some(Transport::Shm)).collect();
        let service = if self.link_kinds.contains(&Some(Transport::Tcp)) {
            let store = self.store.as_ref().ok_or_else(|| config("no rendezvous store"))?;
            if self.rma.get().is_none() {
                let svc = RmaService::start(store.local_ip()?, &self.secret, &format!("rma:{}", self.prefix), self.rank)?;
                let _ = self.rma.set(svc);
            }
            self.rma.get()
        } else {
            None
        };
        let verbs_peer: Vec<bool> = self.link_kinds.iter().map(|k| *k == Some(Transport::Verbs)).collect();
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

type VerbsDomain = Option<Arc<crate::transport::verbs::Domain>>;
