//! Bootstrap layer: rank identity from the environment, the authenticated rendezvous
//! store, and the host topology (which ranks share memory).

pub mod auth;
pub mod env;
pub mod interfaces;
pub mod job_file;
pub mod launcher;
pub mod pmi;
pub mod pmix;
pub mod refusals;
pub mod store;
pub mod unique_id;

pub use env::RankEnv;
pub use store::{StoreClient, StoreServer};

use crate::error::{config, Error, Result};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

    /// Number of distinct hosts (0 for an empty topology).
    pub fn hosts(&self) -> usize {
        self.host_of.iter().max().map_or(0, |m| m + 1)
    }

    /// Ranks on the same host as `rank`, ascending.
    pub fn local_ranks(&self, rank: usize) -> Vec<usize> {
        (0..self.host_of.len()).filter(|&r| self.host_of[r] == self.host_of[rank]).collect()
    }

    /// Whether ranks `a` and `b` are on one host (and so can share memory).
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
    /// This rank's identity and rendezvous point.
    pub env: RankEnv,
    /// Client of the job's rendezvous store (`None` for a job of one rank, which needs none).
    pub store: Option<Arc<StoreClient>>,
    /// Which ranks share a host.
    pub topology: Topology,
    /// This rank's how-manieth communicator of the job in this process (0 for the first):
    /// every rendezvous key and handshake of the communicator carries it, so two
    /// communicators of one job never read each other's entries.
    pub generation: u64,
    _server: Option<Arc<StoreServer>>,
}

/// Communicators made so far in this process, per job (rendezvous address) and rank: ranks
/// of one job may be threads of one process (tests, benches), each counting its own.
static GENERATIONS: Mutex<Vec<(RankOfJob, u64)>> = Mutex::new(Vec::new());

/// A rank of a job: rendezvous address, port, rank and secret (a unique id's store may get
/// a port an earlier id's store had).
type RankOfJob = (String, u16, usize, String);

/// The generation of the next communicator of `env`'s rank of its job in this process.
fn next_generation(env: &RankEnv) -> u64 {
    let key = (env.master_addr.clone(), env.master_port, env.rank, env.secret.clone());
    let mut all = GENERATIONS.lock().unwrap_or_else(|p| p.into_inner());
    match all.iter_mut().find(|(k, _)| *k == key) {
        Some((_, n)) => {
            *n += 1;
            *n
        }
        None => {
            all.push((key, 0));
            0
        }
    }
}

/// How often a rank waiting for the others looks whether one of them has failed setup.
const FAILURE_POLL: Duration = Duration::from_millis(200);

/// The store key under which the first rank to find setup impossible leaves the reason (a
/// failure key: rank 0's store stays up a while for the others to read it).
fn setup_failed_key(generation: u64) -> String {
    store::failure_key(&format!("g{generation}"), usize::MAX)
}

/// What each rank says of itself at rendezvous: world size, process and host identity.
struct Joined {
    world: usize,
    pid: u32,
    host: String,
}

impl Joined {
    fn encode(&self) -> Vec<u8> {
        format!("{} {} {}", self.world, self.pid, self.host).into_bytes()
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let s = std::str::from_utf8(b).ok()?;
        let mut it = s.splitn(3, ' ');
        Some(Joined { world: it.next()?.parse().ok()?, pid: it.next()?.parse().ok()?, host: it.next()?.to_string() })
    }
}

impl Bootstrap {
    /// Reads the environment, starts (rank 0) or joins the rendezvous store, and learns the
    /// topology. Fails within `deadline` if some rank never shows up, naming it.
    pub fn from_env(deadline: Instant) -> Result<Self> {
        let env = RankEnv::from_env()?;
        Self::new(env, deadline)
    }

    /// As [`Bootstrap::from_env`], with an identity given by the caller: rank 0 (unless a unique
    /// id's store runs already) hosts the store, every rank publishes its host identity and reads
    /// everyone else's. Fails within `deadline`, naming a missing rank, a rank started twice, or
    /// ranks that disagree on the world size.
    pub fn new(env: RankEnv, deadline: Instant) -> Result<Self> {
        let started = Instant::now();
        if env.world == 1 {
            if env.store_exists {
                drop(unique_id::adopt(&env.master_addr, env.master_port)); // nobody will dial it
            }
            return Ok(Bootstrap { env, store: None, topology: Topology::single_rank(), generation: 0, _server: None });
        }
        let addr = format!("{}:{}", env.master_addr, env.master_port);
        // A unique id's store is up already: the communicator of the process that made it
        // adopts it once setup has succeeded (until then the id keeps it, for a retry).
        // Otherwise rank 0 hosts the store.
        let mut server = if !env.store_exists && env.rank == 0 { host_store(&env, &addr)? } else { None };
        let store = Arc::new(StoreClient::connect(&addr, &env.secret, deadline)?);
        // Counted only once the store answers: a rank that fails before it must not be a
        // generation ahead of the others when it tries again.
        let generation = next_generation(&env);
        let me = Joined { world: env.world, pid: std::process::id(), host: host_id() };
        let failed_key = setup_failed_key(generation);
        // Tells every rank why setup cannot work, and fails with the same reason here.
        let fail = |why: String| -> Error {
            let _ = store.set_within(&failed_key, why.as_bytes(), Duration::from_secs(1));
            config(why)
        };
        // A rank number taken twice: two processes were started with the same RANK (and some
        // rank is missing). The second to come says so, and every rank fails with it.
        let key = |r: usize| format!("g{generation}/rank/{r}");
        if store.add(&format!("g{generation}/joined/{}", env.rank), 1)? > 1 {
            let first = store.get(&key(env.rank), Instant::now() + Duration::from_secs(1))?.and_then(|b| Joined::decode(&b));
            let who = first.map(|j| format!(" (pid {} on {})", j.pid, j.host)).unwrap_or_default();
            return Err(fail(format!(
                "two processes were started with rank {}: pid {} on {} and another one{who}; every rank needs its own RANK from 0 to WORLD_SIZE-1",
                env.rank, me.pid, me.host
            )));
        }
        store.set(&key(env.rank), &me.encode())?;
        let mut ids = Vec::with_capacity(env.world);
        for r in 0..env.world {
            let entry = loop {
                let slice = deadline.min(Instant::now() + FAILURE_POLL);
                if let Some(v) = store.get(&key(r), slice)? {
                    break v;
                }
                setup_not_failed(&store, generation, env.rank)?;
                if Instant::now() >= deadline {
                    return Err(Error::Timeout {
                        rank: env.rank,
                        peer: r,
                        op: format!(
                            "bootstrap (rank never joined the rendezvous store; this is communicator #{} of this rank in this process, and every rank must make its communicators in the same order)",
                            generation + 1
                        ),
                        waited_ms: started.elapsed().as_millis() as u64,
                    });
                }
            };
            let theirs = Joined::decode(&entry).ok_or_else(|| Error::Protocol(format!("rendezvous entry of rank {r} is malformed")))?;
            if theirs.world != env.world {
                return Err(fail(format!(
                    "the ranks disagree on the world size: rank {r} (pid {}) has WORLD_SIZE={}, rank {} (pid {}) has WORLD_SIZE={}",
                    theirs.pid, theirs.world, env.rank, me.pid, env.world
                )));
            }
            ids.push(theirs.host);
        }
        // A rank that found what this one could not (a rank beyond our world size with
        // another one) may have said so after we read every entry we need.
        setup_not_failed(&store, generation, env.rank)?;
        let topology = Topology::from_host_ids(&ids);
        let local = topology.local_ranks(env.rank);
        if let Some(lr) = env.local_rank {
            let computed = local.iter().position(|&r| r == env.rank).unwrap_or(0);
            if lr != computed {
                log::info!("launcher says local rank {lr}, host identity gives {computed}; using the host identity");
            }
        }
        if env.store_exists {
            server = unique_id::adopt(&env.master_addr, env.master_port);
        }
        Ok(Bootstrap { env, store: Some(store), topology, generation, _server: server })
    }

    /// Fails if some rank has found the job's setup impossible (see [`Bootstrap::new`]):
    /// asked once more when the communicator is otherwise complete.
    pub fn check_setup(&self) -> Result<()> {
        match &self.store {
            Some(store) => setup_not_failed(store, self.generation, self.env.rank),
            None => Ok(()),
        }
    }
}

/// Fails with the reason some rank left under [`setup_failed_key`], if any.
fn setup_not_failed(store: &StoreClient, generation: u64, rank: usize) -> Result<()> {
    match store.get(&setup_failed_key(generation), Instant::now())? {
        Some(why) => Err(config(format!("rank {rank}: setup failed: {}", String::from_utf8_lossy(&why)))),
        None => Ok(()),
    }
}

/// Rank 0's store: the one it hosts already, a new one, or — when the port is taken by a
/// store that accepts this job's secret — none: then another process was started as rank
/// 0 too, and the duplicate check that follows fails every rank with that reason instead
/// of this one failing alone.
fn host_store(env: &RankEnv, addr: &str) -> Result<Option<Arc<StoreServer>>> {
    match StoreServer::shared(&env.master_addr, env.master_port, &env.secret) {
        Ok(s) => Ok(Some(s)),
        Err(Error::Io { what, source }) if source.kind() == std::io::ErrorKind::AddrInUse => {
            match StoreClient::connect(addr, &env.secret, Instant::now() + Duration::from_secs(1)) {
                Ok(_) => Ok(None),
                Err(_) => Err(Error::Io { what, source }),
            }
        }
        Err(e) => Err(e),
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
