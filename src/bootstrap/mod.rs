//! Bootstrap layer: rank identity from the environment, the authenticated rendezvous
//! store, and the host topology (which ranks share memory).

pub mod auth;
pub mod env;
pub mod store;

pub use env::RankEnv;
pub use store::{StoreClient, StoreServer};

use crate::error::{Error, Result};
use std::sync::Arc;
use std::time::Instant;

/// Which ranks share a host (memory; hosts numbered in order of their lowest rank), and
/// how many ranks of the whole job share each rank's machine (cores: namespaces of one
/// machine are different hosts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    /// Host index of every rank.
    pub host_of: Vec<usize>,
    /// Ranks of the job on every rank's machine (kept by sub-communicators: their ranks
    /// still share the cores with the others).
    pub machine_load: Vec<usize>,
}

/// Numbers distinct keys in order of first appearance.
fn number_distinct<T: PartialEq>(keys: impl Iterator<Item = T>) -> Vec<usize> {
    let mut seen: Vec<T> = Vec::new();
    keys.map(|k| match seen.iter().position(|s| *s == k) {
        Some(i) => i,
        None => {
            seen.push(k);
            seen.len() - 1
        }
    })
    .collect()
}

/// The machine part of a host identity made by [`host_id`]: without its network namespace.
fn machine_of(host_id: &str) -> &str {
    match host_id.rsplit_once('/') {
        Some((machine, netns)) if netns.starts_with("net:[") => machine,
        _ => host_id,
    }
}

impl Topology {
    /// Groups ranks by host identity string (see [`host_id`]).
    pub fn from_host_ids(ids: &[String]) -> Self {
        let machine_of = number_distinct(ids.iter().map(|s| machine_of(s)));
        let machine_load = machine_of.iter().map(|m| machine_of.iter().filter(|&x| x == m).count()).collect();
        Topology { host_of: number_distinct(ids.iter().map(|s| s.as_str())), machine_load }
    }

    /// A job of one rank.
    pub fn single_rank() -> Self {
        Topology { host_of: vec![0], machine_load: vec![1] }
    }

    /// The topology of the ranks `ranks` (a sub-communicator): hosts renumbered from 0,
    /// machine loads kept.
    pub fn subset(&self, ranks: &[usize]) -> Self {
        Topology { host_of: number_distinct(ranks.iter().map(|&r| self.host_of[r])), machine_load: ranks.iter().map(|&r| self.machine_load[r]).collect() }
    }

    /// How many ranks of the job share `rank`'s machine (and so its cores).
    pub fn ranks_on_machine(&self, rank: usize) -> usize {
        self.machine_load[rank]
    }

    pub fn hosts(&self) -> usize {
        self.host_of.iter().max().map_or(0, |m| m + 1)
    }

    /// Ranks on the same host as `rank`, ascending.
    pub fn local_ranks(&self, rank: usize) -> Vec<usize> {
        (0..self.host_of.len()).filter(|&r| self.host_of[r] == self.host_of[rank]).collect()
    }

    pub fn same_host(&self, a: usize, b: usize) -> bool {
        self.host_of[a] == self.host_of[b]
    }

    /// True when every rank is on one host.
    pub fn single_host(&self) -> bool {
        self.hosts() <= 1
    }
}

/// This host's identity: `GRADWIRE_HOST_ID`, else hostname, boot id and network namespace (ranks in
/// different namespaces are different "nodes", as in `gradwire launch --netns`).
pub fn host_id() -> String {
    if let Some(id) = crate::config::env_str("GRADWIRE_HOST_ID") {
        return id;
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_else(|_| "localhost".into());
    let netns = std::fs::read_link("/proc/self/ns/net").map(|p| p.display().to_string()).unwrap_or_default();
    // The boot id tells apart machines (or VMs) that share a hostname: the initial network
    // namespace has the same inode number on every Linux kernel.
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().chars().take(8).collect::<String>()).unwrap_or_default();
    format!("{host}/{boot}/{netns}")
}

/// Everything a communicator needs from the launcher: identity, store, topology.
pub struct Bootstrap {
    pub env: RankEnv,
    pub store: Option<Arc<StoreClient>>,
    pub topology: Topology,
    _server: Option<StoreServer>,
}

impl Bootstrap {
    /// Reads the environment, starts (rank 0) or joins the rendezvous store, and learns the
    /// topology. Fails within `deadline` if some rank never shows up, naming it.
    pub fn from_env(deadline: Instant) -> Result<Self> {
        let env = RankEnv::from_env()?;
        Self::new(env, deadline)
    }

    pub fn new(env: RankEnv, deadline: Instant) -> Result<Self> {
        let started = Instant::now();
        if env.world == 1 {
            return Ok(Bootstrap { env, store: None, topology: Topology::single_rank(), _server: None });
        }
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        let server = if env.rank == 0 {
            let specific = StoreServer::start(&addr, &env.secret);
            Some(match specific {
                Ok(s) => s,
                // MASTER_ADDR may name this host by an address we cannot bind (a NAT or a
                // hostname resolving elsewhere): listen on every interface instead.
                Err(_) => StoreServer::start(&format!("0.0.0.0:{}", env.master_port), &env.secret)?,
            })
        } else {
            None
        };
        let store = Arc::new(StoreClient::connect(&addr, &env.secret, deadline)?);
        store.set(&format!("host/{}", env.rank), host_id().as_bytes())?;
        let mut ids = Vec::with_capacity(env.world);
        for r in 0..env.world {
            let v = store.get(&format!("host/{r}"), deadline)?.ok_or_else(|| Error::Timeout {
                rank: env.rank,
                peer: r,
                op: "bootstrap (rank never joined the rendezvous store)".into(),
                waited_ms: started.elapsed().as_millis() as u64,
            })?;
            ids.push(String::from_utf8_lossy(&v).into_owned());
        }
        let topology = Topology::from_host_ids(&ids);
        let local = topology.local_ranks(env.rank);
        if let Some(lr) = env.local_rank {
            let computed = local.iter().position(|&r| r == env.rank).unwrap_or(0);
            if lr != computed {
                log::info!("launcher says local rank {lr}, host identity gives {computed}; using the host identity");
            }
        }
        Ok(Bootstrap { env, store: Some(store), topology, _server: server })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_groups_by_host() {
        let ids: Vec<String> = ["a", "b", "a", "c", "b"].iter().map(|s| s.to_string()).collect();
        let t = Topology::from_host_ids(&ids);
        assert_eq!(t.host_of, vec![0, 1, 0, 2, 1]);
        assert_eq!(t.hosts(), 3);
        assert_eq!(t.local_ranks(4), vec![1, 4]);
        assert!(!t.single_host());
    }

    #[test]
    fn namespaces_of_one_machine_share_its_cores() {
        let ids: Vec<String> = ["m/b1/net:[41]", "m/b1/net:[42]", "m/b2/net:[41]", "m/b1/net:[41]", "custom/id"].iter().map(|s| s.to_string()).collect();
        let t = Topology::from_host_ids(&ids);
        assert_eq!(t.host_of, vec![0, 1, 2, 0, 3]);
        assert_eq!(t.machine_load, vec![3, 3, 1, 3, 1]);
        assert_eq!(t.ranks_on_machine(1), 3);
        assert_eq!(t.ranks_on_machine(2), 1);
        assert_eq!(t.ranks_on_machine(4), 1);
        // A sub-communicator renumbers hosts from 0; its ranks still share their machines
        // with the rest of the job.
        let sub = t.subset(&[2, 4, 1]);
        assert_eq!((sub.host_of, sub.machine_load), (vec![0, 1, 2], vec![1, 1, 3]));
        assert!(t.subset(&[1]).single_host());
        assert_eq!(t.subset(&[1]).ranks_on_machine(0), 3);
    }
}
