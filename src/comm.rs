//! The communicator: one group of ranks with its links, progress engine and sequence
//! counter. Built from the environment (`Communicator::init`) or by splitting another.

use crate::bootstrap::{Bootstrap, StoreClient, Topology};
use crate::collective::algos::{dissemination_barrier, Ctx};
use crate::collective::exchange::P2pCounters;
use crate::collective::shm::OneHost;
use crate::collective::state::SharedState;
use crate::config::Config;
use crate::dtype::{DType, ReduceOp};
use crate::engine::{Engine, EngineState, Job, Work};
use crate::error::{config, Error, Result};
use crate::mem::Region;
use crate::transport::backend::{connect_links, Connected, Setup};
use crate::transport::frame::{CallHeader, OpKind};
use crate::transport::onesided::{RmaService, Window, WindowSetup, Windows};
use crate::transport::{Links, Transport};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The sequence number of the closing agreement's messages: never a collective's.
const SETUP_SEQ: u64 = u64::MAX - 1;

/// A group of ranks that run collectives together.
// Fields drop in order: the engine (whose state holds a store connection) and the windows
// before the rendezvous, whose bootstrap may own the store server, which on the way out
// waits for its clients' connections to close.
pub struct Communicator {
    rank: usize,
    size: usize,
    /// Host index of every rank of this communicator.
    topology: Topology,
    /// Global rank of each rank of this communicator.
    global_ranks: Vec<usize>,
    pub(crate) config: Config,
    /// Transport used to reach each peer (`None`: this rank).
    link_kinds: Vec<Option<Transport>>,
    engine: Engine,
    /// What the collectives keep between their calls.
    pub(crate) collectives: SharedState,
    windows: Windows,
    pub(crate) p2p: P2pCounters,
    pub(crate) rendezvous: Rendezvous,
}

/// Where a communicator meets its peers outside its links: the rendezvous store under the
/// communicator's key prefix, and the job secret that proves a connection is the job's.
pub(crate) struct Rendezvous {
    /// `None` for a group of one.
    pub(crate) store: Option<Arc<StoreClient>>,
    pub(crate) secret: String,
    pub(crate) prefix: String,
    /// Sub-communicators made so far (each gets a prefix of its own).
    pub(crate) splits: AtomicU64,
    /// What keeps the store (on rank 0) alive while any communicator of the job lives;
    /// dropped last (after `store`).
    pub(crate) bootstrap: Option<Arc<Bootstrap>>,
}

impl Rendezvous {
    /// A sub-communicator's: the same store (unless it is a group of one) and secret, its
    /// own prefix.
    pub(crate) fn child(&self, prefix: String, alone: bool) -> Rendezvous {
        let store = if alone { None } else { self.store.clone() };
        Rendezvous { store, secret: self.secret.clone(), prefix, splits: AtomicU64::new(0), bootstrap: self.bootstrap.clone() }
    }
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Communicator({}, rank {}/{})", self.rendezvous.prefix, self.rank, self.size)
    }
}

impl Communicator {
    /// Joins the job described by the environment (see `bootstrap::env`), connecting to
    /// every peer within `GRADWIRE_TIMEOUT_MS`.
    /// Under a launcher that names no rendezvous, rank 0's unique id travels through the
    /// launcher's own exchange (PMI-1, PMIx, or a job file in the shared home: see
    /// `bootstrap::launcher`) and no gradwire variable is needed.
    pub fn init() -> Result<Self> {
        crate::config::init_logging();
        let lookup = |k: &str| std::env::var(k).ok();
        let cfg = Config::from_env()?;
        // One deadline for the exchange and the joining after it.
        let deadline = Instant::now() + cfg.timeout;
        if let Some(shared) = crate::bootstrap::launcher::share_unique_id(&lookup, deadline)? {
            let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
            let comm = Self::from_unique_id_with_timeout(&shared.id, shared.world, shared.rank, Some(left));
            shared.done();
            return comm;
        }
        Self::with_env(crate::bootstrap::RankEnv::from_env()?, cfg)
    }

    /// Joins the group that `id` leads to as `rank` of `world` (the framework carried the id
    /// from the process that made it, as with `ncclCommInitRank`), settings from the
    /// environment. Neither MASTER_ADDR/MASTER_PORT nor GRADWIRE_JOB_SECRET is read.
    pub fn from_unique_id(id: &crate::bootstrap::unique_id::UniqueId, world: usize, rank: usize) -> Result<Self> {
        Self::from_unique_id_with_timeout(id, world, rank, None)
    }

    /// [`Communicator::from_unique_id`] with `timeout` (where given) as the deadline of
    /// every wait instead of `GRADWIRE_TIMEOUT_MS` (a framework's group timeout).
    pub fn from_unique_id_with_timeout(id: &crate::bootstrap::unique_id::UniqueId, world: usize, rank: usize, timeout: Option<Duration>) -> Result<Self> {
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
        let mut cfg = Config::from_env()?;
        if let Some(t) = timeout {
            cfg.timeout = t;
        }
        Self::with_env(env, cfg)
    }

    /// Joins a job described by `env` with settings `cfg` (for embedding and tests; `init`
    /// reads both from the process environment).
    pub fn with_env(env: crate::bootstrap::RankEnv, cfg: Config) -> Result<Self> {
        let deadline = Instant::now() + cfg.timeout;
        let boot = Arc::new(Bootstrap::new(env, deadline)?);
        let (rank, size) = (boot.env.rank, boot.env.world);
        let topo = boot.topology.clone();
        let rendezvous = Rendezvous {
            store: boot.store.clone(),
            secret: boot.env.secret.clone(),
            prefix: format!("w{}", boot.generation),
            splits: AtomicU64::new(0),
            bootstrap: Some(boot.clone()),
        };
        let comm = Self::build(rank, size, topo, cfg, rendezvous, deadline, (0..size).collect())?;
        // Before the closing barrier: after it a rank may exit, rank 0's store with it.
        boot.check_setup()?;
        comm.closing_agreement(deadline)?;
        Ok(comm)
    }

    /// Connects this rank to its peers (`topology`'s ranks) and starts its engine.
    pub(crate) fn build(
        rank: usize,
        size: usize,
        topology: Topology,
        cfg: Config,
        rendezvous: Rendezvous,
        deadline: Instant,
        global_ranks: Vec<usize>,
    ) -> Result<Self> {
        let (store, secret, prefix) = (&rendezvous.store, &rendezvous.secret, &rendezvous.prefix);
        let abort = Arc::new(AtomicBool::new(false));
        let setup = store.as_deref().map(|store| Setup { prefix, rank, size, store, secret, cfg: &cfg, deadline });
        let Connected { links, shm, shm_reaches_all, verbs } = connect_links(&cfg, rank, size, &topology, setup.as_ref())?;
        let link_kinds = (0..size).map(|p| links[p].as_ref().map(|l| l.kind())).collect();
        // Spinning only pays when every rank on this machine has a core of its own (ranks
        // in other network namespaces of this machine count: `launch --netns`).
        let (here, cpus) = (topology.ranks_on_machine(rank), crate::sys::cpus::host_cpus());
        let spin = if here > cpus { Duration::ZERO } else { cfg.spin };
        log::debug!("rank {rank}: {here} ranks on this host, {cpus} CPUs for them: spin {} us before yielding", spin.as_micros());
        let links = Links::new(rank, links, abort.clone(), spin);
        let one_host = shm.clone().map(|dom| OneHost::new(dom, shm_reaches_all, spin, cfg.shm_stores, cfg.shm_cma));
        let state = EngineState::new(rank, size, links, shm, abort, global_ranks.clone()).with_store(store.clone(), prefix);
        let engine = Engine::start(state, cfg.timeout, format!("gradwire-{prefix}-r{rank}"))?;
        Ok(Communicator {
            rank,
            size,
            topology,
            global_ranks,
            config: cfg,
            link_kinds,
            engine,
            collectives: SharedState::new(one_host),
            windows: Windows::new(verbs),
            p2p: P2pCounters::default(),
            rendezvous,
        })
    }

    /// The last step of setup: returns once every rank has finished its own, so that a
    /// rank may exit as soon as init returns without a peer still opening its shared
    /// memory or asking its store (rank 0) for something. A barrier over the new links
    /// (proving them too), outside the collectives' sequence numbers.
    pub(crate) fn closing_agreement(&self, deadline: Instant) -> Result<()> {
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
        let id = self.windows.next_id();
        let shm_peer: Vec<bool> = self.link_kinds.iter().map(|k| *k == Some(Transport::Shm)).collect();
        let rdv = &self.rendezvous;
        let service = if self.link_kinds.contains(&Some(Transport::Tcp)) {
            let store = rdv.store.as_ref().ok_or_else(|| config("no rendezvous store"))?;
            Some(self.windows.service(|| RmaService::start(store.local_ip()?, &rdv.secret, &format!("rma:{}", rdv.prefix), self.rank))?)
        } else {
            None
        };
        let verbs_peer: Vec<bool> = self.link_kinds.iter().map(|k| *k == Some(Transport::Verbs)).collect();
        let w = WindowSetup {
            verbs: self.windows.verbs().map(|d| (d, verbs_peer.as_slice())),
            prefix: &rdv.prefix,
            id,
            rank: self.rank,
            world: self.size,
            shm_peer: &shm_peer,
            store: rdv.store.as_deref(),
            service,
            secret: &rdv.secret,
            timeout: self.config.timeout,
            accumulate,
        };
        Window::create(w, region)
    }
}
