//! The seam between a communicator and its transports: which transport reaches which peer,
//! and each transport's backend connecting its share of the links. A transport lives in a
//! folder of its own (`shm/`, `tcp/`, `verbs/`: the backend in `mod.rs`, its [`Link`] in
//! `link.rs`, how links are set up beside them); a new one implements [`Backend`] there,
//! adds a [`Transport`] variant, and gets its peers in [`connect_links`].

use super::shm::ShmBackend;
use super::tcp::TcpBackend;
use super::{Link, LinkTable, Transport};
use crate::bootstrap::{StoreClient, Topology};
use crate::config::{Config, TransportChoice};
use crate::error::{config, Result};
use crate::transport::shm::ShmDomain;
use crate::transport::verbs::Domain as VerbsDomain;
use std::sync::Arc;
use std::time::Instant;

/// What every backend needs to connect one communicator's links.
pub(crate) struct Setup<'a> {
    /// The communicator's key prefix in the rendezvous store.
    pub(crate) prefix: &'a str,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) store: &'a StoreClient,
    pub(crate) secret: &'a str,
    pub(crate) cfg: &'a Config,
    pub(crate) deadline: Instant,
}

/// A transport as a communicator sees it.
pub(crate) trait Backend {
    /// The transport its links run over.
    fn transport(&self) -> Transport;
    /// Connects one link to each of `peers` (each of them connects to us at the same time).
    fn connect(&self, setup: &Setup<'_>, peers: &[usize]) -> Result<Vec<(usize, Box<dyn Link>)>>;
}

/// A new communicator's links, and the backends' state its collectives and windows use.
pub(crate) struct Connected {
    pub(crate) links: LinkTable,
    /// The segments of the ranks on this host, when some peers are reached through them.
    pub(crate) shm: Option<Arc<ShmDomain>>,
    /// Whether shared memory reaches every peer (the one-host collectives apply).
    pub(crate) shm_reaches_all: bool,
    /// The RDMA device, when some peers are reached over verbs.
    pub(crate) verbs: Option<Arc<VerbsDomain>>,
}

/// Connects this rank to every peer: shared memory to the ranks of this host (unless
/// `GRADWIRE_TRANSPORT` says tcp or verbs), verbs to remote peers where both ends can use
/// it (see `verbs::choose_peers`), tcp to the rest. `setup` is `None` for a group of one
/// (it has no store).
pub(crate) fn connect_links(cfg: &Config, rank: usize, size: usize, topology: &Topology, setup: Option<&Setup<'_>>) -> Result<Connected> {
    if cfg.transport == TransportChoice::Shm && !topology.single_host() {
        let other = (0..size).find(|&r| !topology.same_host(rank, r)).unwrap_or(0);
        return Err(config(format!("GRADWIRE_TRANSPORT=shm, but rank {rank} and rank {other} are on different hosts (use auto or tcp)")));
    }
    let Some(s) = setup else {
        return Ok(Connected { links: (0..size).map(|_| None).collect(), shm: None, shm_reaches_all: false, verbs: None });
    };
    let local = topology.local_ranks(rank);
    let use_shm = !matches!(s.cfg.transport, TransportChoice::Tcp | TransportChoice::Verbs);
    let shm_peers: Vec<usize> = if use_shm { local.iter().copied().filter(|&p| p != rank).collect() } else { vec![] };
    let remote: Vec<usize> = (0..size).filter(|&p| p != rank && !shm_peers.contains(&p)).collect();
    let (verbs, verbs_peers) = super::verbs::choose_peers(s, &remote)?;
    let tcp_peers: Vec<usize> = remote.iter().copied().filter(|p| !verbs_peers.contains(p)).collect();
    let shm = if shm_peers.is_empty() { None } else { Some(ShmBackend::create(s, &local)?) };
    // The order every rank connects in: shared memory, tcp, verbs.
    let mut plan: Vec<(&dyn Backend, &[usize])> = Vec::new();
    if let Some(b) = &shm {
        plan.push((b, &shm_peers));
    }
    plan.push((&TcpBackend, &tcp_peers));
    if let Some(b) = &verbs {
        plan.push((b, &verbs_peers));
    }
    let mut links: LinkTable = (0..size).map(|_| None).collect();
    for (backend, peers) in plan {
        if !peers.is_empty() {
            log::debug!("rank {rank}: connecting {} peer(s) over {}", peers.len(), backend.transport());
        }
        for (p, link) in backend.connect(s, peers)? {
            links[p] = Some(link);
        }
    }
    let shm_reaches_all = shm.is_some() && shm_peers.len() + 1 == size;
    Ok(Connected { links, shm: shm.map(|b| b.domain), shm_reaches_all, verbs: verbs.map(|b| b.domain) })
}
