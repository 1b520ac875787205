//! Every tunable in one place: its environment variable, its default, and its parser.
//! The README's settings table is generated from [`SETTINGS`] by `gradwire info --settings`.

use crate::error::{config, Result};
use std::time::Duration;

/// One documented setting.
pub struct Setting {
    /// The environment variable's name.
    pub env: &'static str,
    /// The value used when the variable is unset or empty, as shown to users.
    pub default: &'static str,
    /// What the setting does and which values it accepts.
    pub help: &'static str,
}

/// All `GRADWIRE_*` settings (rank discovery variables are in `bootstrap`).
pub const SETTINGS: &[Setting] = &[
    Setting { env: "GRADWIRE_TIMEOUT_MS", default: "60000", help: "Deadline of every wait (collective, connect, store lookup), in ms: 1 to 604800000 (7 days)." },
    Setting { env: "GRADWIRE_TRANSPORT", default: "auto", help: "auto (shm inside a host; between hosts verbs when an RDMA port is up, else tcp), shm (error if ranks span hosts), tcp, or verbs (every peer, also inside a host)." },
    Setting {
        env: "GRADWIRE_ALGO",
        default: "auto",
        help: "Allreduce algorithm: auto, ring, rd (recursive doubling), hd (recursive halving then doubling) or shm (one-host shared-buffer reduction).",
    },
    Setting {
        env: "GRADWIRE_SMALL_BYTES",
        default: "262144",
        help: "Below this many bytes `auto` uses a binomial tree instead of a chain for broadcast and reduce over links; when set, also recursive doubling instead of the ring for allreduce over links (unset, the cost model chooses: GRADWIRE_NET_*).",
    },
    Setting {
        env: "GRADWIRE_NET_GBIT",
        default: "25",
        help: "The network's rate in Gbit/s, for the cost model's choice between ring and recursive doubling over links (`gradwire model --fit` fits it to your runs): 0.001 to 100000.",
    },
    Setting { env: "GRADWIRE_NET_ALPHA_US", default: "25", help: "The network's cost of one step (latency and per-message software cost), in microseconds, for the cost model: 0 to 1000000." },
    Setting { env: "GRADWIRE_NET_GAMMA_NS", default: "0.1", help: "Nanoseconds per byte a reduction costs where it waits for the data, for the cost model: 0 to 1000." },
    Setting {
        env: "GRADWIRE_RING_CHUNK_BYTES",
        default: "1048576",
        help: "Ring collectives move each part in chunks of about this size, each forwarded as soon as it has arrived (at most 64 per part).",
    },
    Setting { env: "GRADWIRE_SHM_RING_BYTES", default: "4194304", help: "Capacity of each shared-memory point-to-point ring." },
    Setting {
        env: "GRADWIRE_SHM_STAGE_BYTES",
        default: "1179776",
        help: "Per-rank shared staging area of the one-host allreduce: 131200 bytes for small calls, the rest for the segments larger buffers go through (1 MiB keeps every rank's segment in cache) and for copies of registered buffers' partial pages (2 pages).",
    },
    Setting {
        env: "GRADWIRE_SHM_STORES",
        default: "auto",
        help: "How the one-host staged collectives write what peers read: plain or streaming (non-temporal) stores; auto times both per collective and size class and keeps the faster. (Not their output: the one-host allgather and all-to-all, staged or not, write theirs with streaming stores whenever send and receive together outgrow the last-level cache, a broadcast whenever its buffer alone does.)",
    },
    Setting {
        env: "GRADWIRE_SHM_CMA",
        default: "1",
        help: "1: one-host allreduces of private buffers from 256 KiB reach the peers' buffers through cross-memory attach (process_vm_readv/writev: one copy) where the kernel allows it, else they stage; reduce-scatter, allgather, all-to-all, broadcast and reduce of private buffers from 256 KiB reach them that way or stage, whichever rank 0 has timed faster for that collective and size (the others follow it) (GRADWIRE_LOG=debug shows each choice); 0: always stage.",
    },
    Setting {
        env: "GRADWIRE_SPIN_US",
        default: "50",
        help: "How long a waiting rank spins before it yields and then sleeps (at most 1000000 us); 0 wherever this host's ranks outnumber the CPUs its control group lets them use.",
    },
    Setting {
        env: "GRADWIRE_IBVERBS_LIB",
        default: "libibverbs.so.1, then libibverbs.so",
        help: "The libibverbs that the verbs transport opens at run time (a path or a name on the loader path); without one, verbs are unavailable and gradwire says why.",
    },
    Setting {
        env: "GRADWIRE_PMIX_LIB",
        default: "libpmix.so.2, then libpmix.so",
        help: "The libpmix opened under a PMIx launcher (Open MPI's mpirun, srun --mpi=pmix) that names no rendezvous, to pass rank 0's address through the launcher (a path or a name on the loader path).",
    },
    Setting { env: "GRADWIRE_IB_DEV", default: "(automatic)", help: "RDMA device to use (see `gradwire info` for the list and the automatic choice)." },
    Setting { env: "GRADWIRE_IB_PORT", default: "(first ACTIVE port)", help: "RDMA port number on that device." },
    Setting {
        env: "GRADWIRE_GID_INDEX",
        default: "(automatic)",
        help: "GID table index; automatic: the RoCE v2 IPv4-mapped GID on the bootstrap address's subnet.",
    },
    Setting { env: "GRADWIRE_IB_RING_BYTES", default: "4194304", help: "Per-peer, per-direction receive ring of the verbs transport (registered memory)." },
    Setting {
        env: "GRADWIRE_IB_ZONE_BYTES",
        default: "67108864",
        help: "Largest verbs rendezvous landing zone per peer (registered on first use; larger payloads arrive piece by piece). 0: every payload goes through the ring.",
    },
    Setting { env: "GRADWIRE_HUGEPAGES", default: "0", help: "1: back regions with huge pages when the host has them (falls back with a logged reason)." },
    Setting { env: "GRADWIRE_HOST_ID", default: "hostname + boot id + network namespace", help: "Override of the host identity that decides which ranks share memory." },
    Setting {
        env: "GRADWIRE_JOB_SECRET",
        default: "(set by gradwire launch)",
        help: "Shared secret every rank must prove to the rendezvous store and to peers.",
    },
    Setting { env: "GRADWIRE_LOG", default: "warn", help: "Log filter (error, warn, info, debug, trace)." },
];

fn raw(env: &str) -> Option<String> {
    std::env::var(env).ok().filter(|v| !v.trim().is_empty())
}

/// Parses an unsigned integer setting, with a clear error naming the variable.
pub fn env_u64(env: &str, default: u64) -> Result<u64> {
    match raw(env) {
        None => Ok(default),
        Some(v) => parse_size(&v).map_err(|e| config(format!("{env}={v:?}: {e}"))),
    }
}

/// Parses a boolean setting (0/1/true/false/yes/no).
pub fn env_bool(env: &str, default: bool) -> Result<bool> {
    match raw(env).map(|v| v.to_ascii_lowercase()) {
        None => Ok(default),
        Some(v) if ["1", "true", "yes", "on"].contains(&v.as_str()) => Ok(true),
        Some(v) if ["0", "false", "no", "off"].contains(&v.as_str()) => Ok(false),
        Some(v) => Err(config(format!("{env}={v:?}: expected 0 or 1"))),
    }
}

/// Parses a decimal setting within [lo, hi], with a clear error naming the variable.
pub fn env_f64(env: &str, default: f64, lo: f64, hi: f64) -> Result<f64> {
    match raw(env) {
        None => Ok(default),
        Some(v) => match v.trim().parse::<f64>() {
            Ok(x) if (lo..=hi).contains(&x) => Ok(x),
            _ => Err(config(format!("{env}={v:?}: expected a number from {lo} to {hi}"))),
        },
    }
}

/// The network's cost-model parameters, unless `GRADWIRE_SMALL_BYTES` fixes the allreduce's
/// threshold (their defaults: a 25 Gbit/s Ethernet with TCP).
fn network_link() -> Result<Option<crate::cost::Link>> {
    let gbit = env_f64("GRADWIRE_NET_GBIT", 25.0, 0.001, 100_000.0)?;
    let alpha_us = env_f64("GRADWIRE_NET_ALPHA_US", 25.0, 0.0, 1e6)?;
    let gamma_ns = env_f64("GRADWIRE_NET_GAMMA_NS", 0.1, 0.0, 1000.0)?;
    Ok(raw("GRADWIRE_SMALL_BYTES").is_none().then(|| crate::cost::Link::of_rate(gbit, alpha_us * 1e-6, gamma_ns * 1e-9)))
}

/// Reads a string setting.
pub fn env_str(env: &str) -> Option<String> {
    raw(env)
}

/// Parses `123`, `4K`, `16M`, `1G` (binary multiples) into a number.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (digits, mult) = match s.chars().last() {
        Some('k' | 'K') => (&s[..s.len() - 1], 1u64 << 10),
        Some('m' | 'M') => (&s[..s.len() - 1], 1 << 20),
        Some('g' | 'G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let n: u64 = digits.parse().map_err(|_| format!("not a number: {s:?}"))?;
    n.checked_mul(mult).ok_or_else(|| format!("too large: {s:?}"))
}

/// Which point-to-point transport to use between ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory inside a host; between hosts verbs when an RDMA port is up, else TCP.
    Auto,
    /// Shared memory only: an error if the ranks span hosts.
    Shm,
    /// TCP sockets to every peer.
    Tcp,
    /// RDMA verbs to every peer, also inside a host.
    Verbs,
}

impl std::str::FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "tcp" => Ok(Self::Tcp),
            "verbs" => Ok(Self::Verbs),
            other => Err(format!("unknown transport {other:?} (expected auto, shm, tcp or verbs)")),
        }
    }
}

/// Allreduce algorithm selection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algo {
    /// Shared-buffer reduction when all ranks share a host, else recursive doubling below
    /// `small_bytes` and the ring above.
    Auto,
    /// Ring reduce-scatter then allgather (`ring`).
    Ring,
    /// Recursive doubling (`rd`).
    RecursiveDoubling,
    /// Recursive halving then doubling (`hd`).
    HalvingDoubling,
    /// One-host shared-buffer reduction (`shm`).
    SharedMemory,
}

impl std::str::FromStr for Algo {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "ring" => Ok(Self::Ring),
            "rd" => Ok(Self::RecursiveDoubling),
            "hd" => Ok(Self::HalvingDoubling),
            "shm" => Ok(Self::SharedMemory),
            other => Err(format!("unknown algorithm {other:?} (expected auto, ring, rd, hd or shm)")),
        }
    }
}

/// How the one-host staged allreduce writes what its peers read (`GRADWIRE_SHM_STORES`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum StagedStores {
    /// Time both kinds and keep the faster, per size class, looking again now and then.
    #[default]
    Auto,
    /// Ordinary stores: the lines stay in the writer's cache until a peer fetches them.
    Plain,
    /// Non-temporal stores: the lines go to memory.
    Streaming,
}

impl std::str::FromStr for StagedStores {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "plain" => Ok(Self::Plain),
            "streaming" => Ok(Self::Streaming),
            other => Err(format!("unknown store kind {other:?} (expected auto, plain or streaming)")),
        }
    }
}

fn env_parse<T: std::str::FromStr<Err = String>>(env: &str, default: T) -> Result<T> {
    match raw(env) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|e| config(format!("{env}: {e}"))),
    }
}

/// Longest deadline accepted: a wait must end (a larger value once meant a stalled peer was
/// never detected, and `now + timeout` can overflow).
pub const MAX_TIMEOUT_MS: u64 = 7 * 24 * 3600 * 1000;

/// Longest spin before a waiting rank yields.
pub const MAX_SPIN_US: u64 = 1_000_000;

/// The settings a communicator runs with, read once from the environment.
#[derive(Clone, Debug)]
pub struct Config {
    /// Deadline of every wait (`GRADWIRE_TIMEOUT_MS`, 1 ms to [`MAX_TIMEOUT_MS`]; default 60 s).
    pub timeout: Duration,
    /// Point-to-point transport (`GRADWIRE_TRANSPORT`).
    pub transport: TransportChoice,
    /// Allreduce algorithm (`GRADWIRE_ALGO`).
    pub algo: Algo,
    /// Size in bytes below which `auto` prefers latency-bound algorithms (`GRADWIRE_SMALL_BYTES`).
    pub small_bytes: usize,
    /// The network's parameters the automatic allreduce choice over links asks the cost
    /// model with (`GRADWIRE_NET_GBIT`, `GRADWIRE_NET_ALPHA_US`, `GRADWIRE_NET_GAMMA_NS`);
    /// `None` when `GRADWIRE_SMALL_BYTES` is set, which then fixes the threshold.
    pub network: Option<crate::cost::Link>,
    /// Chunk size in bytes of the ring collectives' pipelining (`GRADWIRE_RING_CHUNK_BYTES`, 16 B to 4 GiB).
    pub ring_chunk_bytes: usize,
    /// Capacity in bytes of each shared-memory point-to-point ring (`GRADWIRE_SHM_RING_BYTES`, power of two, 4 KiB to 1 GiB).
    pub shm_ring_bytes: usize,
    /// Per-rank staging area in bytes of the one-host allreduce (`GRADWIRE_SHM_STAGE_BYTES`, 4 KiB to 4 GiB).
    pub shm_stage_bytes: usize,
    /// Store kind of the one-host staged allreduce (`GRADWIRE_SHM_STORES`).
    pub shm_stores: StagedStores,
    /// Whether one-host allreduces may use cross-memory attach (`GRADWIRE_SHM_CMA`).
    pub shm_cma: bool,
    /// How long a waiting rank spins before it yields (`GRADWIRE_SPIN_US`, at most [`MAX_SPIN_US`]).
    pub spin: Duration,
    /// Whether regions ask for huge pages (`GRADWIRE_HUGEPAGES`).
    pub hugepages: bool,
    /// Per-peer, per-direction verbs receive ring in bytes (`GRADWIRE_IB_RING_BYTES`, power of two, 64 KiB to 1 GiB).
    pub ib_ring_bytes: usize,
    /// Largest verbs rendezvous landing zone per peer in bytes (`GRADWIRE_IB_ZONE_BYTES`; 0: no rendezvous).
    pub ib_zone_bytes: usize,
}

impl Config {
    /// Reads every `GRADWIRE_*` tunable; a malformed value is an error naming the variable.
    pub fn from_env() -> Result<Self> {
        let timeout_ms = env_u64("GRADWIRE_TIMEOUT_MS", 60_000)?;
        if !(1..=MAX_TIMEOUT_MS).contains(&timeout_ms) {
            return Err(config(format!("GRADWIRE_TIMEOUT_MS={timeout_ms}: must be between 1 and {MAX_TIMEOUT_MS} (7 days)")));
        }
        let spin_us = env_u64("GRADWIRE_SPIN_US", 50)?;
        if spin_us > MAX_SPIN_US {
            return Err(config(format!("GRADWIRE_SPIN_US={spin_us}: must be at most {MAX_SPIN_US} (1 s)")));
        }
        let ring = env_u64("GRADWIRE_SHM_RING_BYTES", 4 << 20)? as usize;
        if !(4096..=(1 << 30)).contains(&ring) || !ring.is_power_of_two() {
            return Err(config(format!("GRADWIRE_SHM_RING_BYTES={ring}: must be a power of two between 4K and 1G")));
        }
        let stage = env_u64("GRADWIRE_SHM_STAGE_BYTES", 1179776)? as usize;
        if !(4096..=(1 << 32)).contains(&stage) {
            return Err(config(format!("GRADWIRE_SHM_STAGE_BYTES={stage}: must be between 4K and 4G")));
        }
        let ib_ring = env_u64("GRADWIRE_IB_RING_BYTES", 4 << 20)? as usize;
        if !(64 << 10..=1 << 30).contains(&ib_ring) || !ib_ring.is_power_of_two() {
            return Err(config(format!("GRADWIRE_IB_RING_BYTES={ib_ring}: must be a power of two between 64K and 1G")));
        }
        let ib_zone = env_u64("GRADWIRE_IB_ZONE_BYTES", 64 << 20)? as usize;
        if ib_zone != 0 && !(64 << 10..=1 << 32).contains(&ib_zone) {
            return Err(config(format!("GRADWIRE_IB_ZONE_BYTES={ib_zone}: must be 0 (no rendezvous) or between 64K and 4G")));
        }
        let ring_chunk = env_u64("GRADWIRE_RING_CHUNK_BYTES", 1 << 20)? as usize;
        if !(16..=1 << 32).contains(&ring_chunk) {
            return Err(config(format!("GRADWIRE_RING_CHUNK_BYTES={ring_chunk}: must be between 16 and 4G")));
        }
        Ok(Config {
            ring_chunk_bytes: ring_chunk,
            ib_ring_bytes: ib_ring,
            ib_zone_bytes: ib_zone,
            timeout: Duration::from_millis(timeout_ms),
            transport: env_parse("GRADWIRE_TRANSPORT", TransportChoice::Auto)?,
            algo: env_parse("GRADWIRE_ALGO", Algo::Auto)?,
            small_bytes: env_u64("GRADWIRE_SMALL_BYTES", 256 << 10)? as usize,
            network: network_link()?,
            shm_ring_bytes: ring,
            shm_stage_bytes: stage,
            shm_stores: env_parse("GRADWIRE_SHM_STORES", StagedStores::Auto)?,
            shm_cma: env_bool("GRADWIRE_SHM_CMA", true)?,
            spin: Duration::from_micros(spin_us),
            hugepages: env_bool("GRADWIRE_HUGEPAGES", false)?,
        })
    }
}

/// Initialises logging from `GRADWIRE_LOG` once (later calls do nothing).
pub fn init_logging() {
    let filter = raw("GRADWIRE_LOG").unwrap_or_else(|| "warn".into());
    let _ = env_logger::Builder::new().parse_filters(&filter).format_target(false).try_init();
}
