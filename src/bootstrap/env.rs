//! Who am I: rank, world size and rendezvous address from the launcher's environment
//! (gradwire/torchrun, Open MPI, Slurm). A missing, malformed or contradictory variable is
//! an error that names it.

use crate::error::{config, Result};

/// Rank identity and rendezvous point, as given by the launcher.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankEnv {
    /// This process's rank, below `world` (`GRADWIRE_RANK`, `RANK`, `OMPI_COMM_WORLD_RANK`, `PMI_RANK` or `SLURM_PROCID`).
    pub rank: usize,
    /// Number of ranks in the job, 1 to [`MAX_WORLD`] (`GRADWIRE_WORLD_SIZE`, `WORLD_SIZE`, `OMPI_COMM_WORLD_SIZE`, ...).
    pub world: usize,
    /// Local rank as the launcher stated it (gradwire recomputes it from host identity and
    /// checks the two agree).
    pub local_rank: Option<usize>,
    /// Ranks on this host as the launcher stated it (`None`: not given).
    pub local_world: Option<usize>,
    /// Host of rank 0's rendezvous store (`GRADWIRE_MASTER_ADDR`, else `MASTER_ADDR`; `127.0.0.1` for a single rank).
    pub master_addr: String,
    /// Port of that store (`GRADWIRE_MASTER_PORT`, else `MASTER_PORT`; 0 for a single rank that was given none).
    pub master_port: u16,
    /// Job secret every rank proves (`GRADWIRE_JOB_SECRET`, at least 8 characters; may be empty for a single rank).
    pub secret: String,
    /// The rendezvous store runs already (a unique id's): no rank hosts one.
    pub store_exists: bool,
}

/// A value and the variable it came from.
type Named = (&'static str, String);

/// One source of a value, if any.
type Found = Option<Named>;

/// Looks a variable up through a getter (so tests can pass their own environment).
fn get(lookup: &dyn Fn(&str) -> Option<String>, name: &'static str) -> Found {
    lookup(name).filter(|v| !v.trim().is_empty()).map(|v| (name, v.trim().to_string()))
}

/// Picks the first present variable among `names`; errors if two present ones disagree.
fn agreeing(lookup: &dyn Fn(&str) -> Option<String>, names: &[&'static str]) -> Result<Found> {
    let mut first: Found = None;
    for &n in names {
        if let Some((name, v)) = get(lookup, n) {
            match &first {
                None => first = Some((name, v)),
                Some((fname, fv)) if *fv != v => {
                    return Err(config(format!("{fname}={fv} contradicts {name}={v}")));
                }
                _ => {}
            }
        }
    }
    Ok(first)
}

fn number(found: &(&'static str, String)) -> Result<usize> {
    found.1.parse::<usize>().map_err(|_| config(format!("{}={:?} is not a non-negative integer", found.0, found.1)))
}

const RANK_VARS: &[&str] = &["GRADWIRE_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"];
const WORLD_VARS: &[&str] = &["GRADWIRE_WORLD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"];
const LOCAL_RANK_VARS: &[&str] = &["GRADWIRE_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID"];
const LOCAL_WORLD_VARS: &[&str] = &["GRADWIRE_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"];

/// Most ranks in a job: far beyond any real job, low enough that per-rank tables built
/// from the world size before anyone checks it stay small.
pub const MAX_WORLD: usize = 1 << 20;

impl RankEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Rank and world size alone, as the launcher's variables give them (checked as
    /// [`RankEnv::from_lookup`] checks them).
    pub fn identity(lookup: &dyn Fn(&str) -> Option<String>) -> Result<(usize, usize)> {
        let (rank, world) = Self::rank_and_world(lookup)?;
        Ok((number(&rank)?, number(&world)?))
    }

    /// The rank's and the world size's variable and text, checked.
    fn rank_and_world(lookup: &dyn Fn(&str) -> Option<String>) -> Result<(Named, Named)> {
        let rank = agreeing(lookup, RANK_VARS)?
            .ok_or_else(|| config("no rank found: set RANK and WORLD_SIZE (torchrun), run under mpirun or srun, or start with `gradwire launch`"))?;
        let world = agreeing(lookup, WORLD_VARS)?.ok_or_else(|| config(format!("{} is set but no world size (WORLD_SIZE or equivalent)", rank.0)))?;
        let (r, w) = (number(&rank)?, number(&world)?);
        if w == 0 {
            return Err(config(format!("{}=0: world size must be at least 1", world.0)));
        }
        if w > MAX_WORLD {
            return Err(config(format!("{}={w}: more ranks than gradwire supports ({MAX_WORLD})", world.0)));
        }
        if r >= w {
            return Err(config(format!("{}={r} is not below {}={w}", rank.0, world.0)));
        }
        Ok((rank, world))
    }

    /// Reads rank identity through `lookup` (a variable name to its value).
    pub fn from_lookup(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let (rank, world) = Self::rank_and_world(lookup)?;
        let (r, w) = (number(&rank)?, number(&world)?);
        let local_rank = agreeing(lookup, LOCAL_RANK_VARS)?.map(|f| number(&f)).transpose()?;
        let local_world = agreeing(lookup, LOCAL_WORLD_VARS)?.map(|f| number(&f)).transpose()?;
        if let (Some(lr), Some(lw)) = (local_rank, local_world) {
            if lr >= lw {
                return Err(config(format!("local rank {lr} is not below local world size {lw}")));
            }
        }
        // GRADWIRE_MASTER_* override MASTER_* (rather than contradict them) so gradwire's
        // store can run beside torch.distributed's, which owns MASTER_PORT.
        let addr = get(lookup, "GRADWIRE_MASTER_ADDR").or_else(|| get(lookup, "MASTER_ADDR"));
        let port = get(lookup, "GRADWIRE_MASTER_PORT").or_else(|| get(lookup, "MASTER_PORT"));
        let secret = get(lookup, "GRADWIRE_JOB_SECRET");
        let (master_addr, master_port, secret) = if w == 1 {
            // A single rank needs no rendezvous; take what is given, if anything (a port
            // given must still be one).
            let port = port.map(|p| p.1.parse::<u16>().map_err(|_| config(format!("{}={:?} is not a TCP port (0-65535)", p.0, p.1)))).transpose()?.unwrap_or(0);
            (addr.map(|a| a.1).unwrap_or_else(|| "127.0.0.1".into()), port, secret.map(|s| s.1).unwrap_or_default())
        } else {
            let addr = addr.ok_or_else(|| {
                config("MASTER_ADDR is not set (the address of rank 0's rendezvous store): export MASTER_ADDR, MASTER_PORT and GRADWIRE_JOB_SECRET, start the ranks with `gradwire launch`, torchrun or a launcher with its own exchange (Hydra's mpiexec, Open MPI's mpirun, srun), or make the communicator from a unique id")
            })?;
            let port = port.ok_or_else(|| config("MASTER_PORT is not set (the port of rank 0's rendezvous store)"))?;
            let p = port.1.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(|| config(format!("{}={:?} is not a TCP port (1-65535)", port.0, port.1)))?;
            let secret = secret.ok_or_else(|| {
                config("GRADWIRE_JOB_SECRET is not set: every rank must present the same job secret (gradwire launch sets one; otherwise export the same random string on all ranks)")
            })?;
            if secret.1.len() < 8 {
                return Err(config("GRADWIRE_JOB_SECRET must be at least 8 characters"));
            }
            (addr.1, p, secret.1)
        };
        Ok(RankEnv { rank: r, world: w, local_rank, local_world, master_addr, master_port, secret, store_exists: false })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<RankEnv> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        RankEnv::from_lookup(&move |k| m.get(k).cloned())
    }

    const BASE: &[(&str, &str)] = &[("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("GRADWIRE_JOB_SECRET", "0123456789abcdef")];

    fn with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        BASE.iter().copied().chain(extra.iter().copied()).collect()
    }

    #[test]
    fn torchrun_mpi_and_slurm() {
        let e = env(&with(&[("RANK", "2"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2")])).unwrap();
        assert_eq!((e.rank, e.world, e.local_rank), (2, 4, Some(0)));
        let e = env(&with(&[("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "3")])).unwrap();
        assert_eq!((e.rank, e.world), (1, 3));
        let e = env(&with(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1")])).unwrap();
        assert_eq!((e.rank, e.world, e.local_rank), (5, 8, Some(1)));
    }

    #[test]
    fn errors_name_the_variable() {
        let err = env(&with(&[])).unwrap_err().to_string();
        assert!(err.contains("RANK"), "{err}");
        let err = env(&with(&[("RANK", "x"), ("WORLD_SIZE", "4")])).unwrap_err().to_string();
        assert!(err.contains("RANK=\"x\""), "{err}");
        let err = env(&with(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err().to_string();
        assert!(err.contains("not below"), "{err}");
        let err = env(&with(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("OMPI_COMM_WORLD_RANK", "2")])).unwrap_err().to_string();
        assert!(err.contains("RANK=1 contradicts OMPI_COMM_WORLD_RANK=2"), "{err}");
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).unwrap_err().to_string();
        assert!(err.contains("MASTER_ADDR"), "{err}");
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "99999")]).unwrap_err().to_string();
        assert!(err.contains("MASTER_PORT"), "{err}");
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "5")]).unwrap_err().to_string();
        assert!(err.contains("GRADWIRE_JOB_SECRET"), "{err}");
        let err = env(&with(&[("RANK", "0"), ("WORLD_SIZE", "0")])).unwrap_err().to_string();
        assert!(err.contains("at least 1"), "{err}");
        let err = env(&with(&[("RANK", "0"), ("WORLD_SIZE", "1000000000000")])).unwrap_err().to_string();
        assert!(err.contains("WORLD_SIZE=1000000000000: more ranks than"), "{err}");
        let err = env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "http")]).unwrap_err().to_string();
        assert!(err.contains("MASTER_PORT=\"http\" is not a TCP port"), "{err}");
    }

    #[test]
    fn gradwire_master_port_overrides() {
        let e = env(&with(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("GRADWIRE_MASTER_PORT", "29501")])).unwrap();
        assert_eq!(e.master_port, 29501);
    }

    #[test]
    fn single_rank_needs_no_rendezvous() {
        let e = env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!(e.world, 1);
    }
}
