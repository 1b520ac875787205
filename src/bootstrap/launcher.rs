//! Ranks whose launcher names no rendezvous (no `MASTER_ADDR`, no `GRADWIRE_JOB_SECRET`):
//! rank 0 makes a unique id (a store of its own behind a fresh secret) and the launcher's
//! own exchange carries it to the others. In order: PMI-1 (`PMI_FD`: Hydra's `mpiexec`,
//! Slurm's `srun --mpi=pmi2`), PMIx (`PMIX_NAMESPACE`: Open MPI's `mpirun`, `srun
//! --mpi=pmix`), else a job file in the shared home (`srun` with no PMI).

use super::unique_id::UniqueId;
use super::{job_file, pmi, pmix, RankEnv};
use crate::error::Result;
use std::path::PathBuf;
use std::time::Instant;

/// Rank 0's id as this rank received it.
pub struct Shared {
    /// Rank 0's id.
    pub id: UniqueId,
    /// This process's rank, as the launcher gave it.
    pub rank: usize,
    /// The job's size.
    pub world: usize,
    /// A job file rank 0 wrote, to remove once the group has formed.
    job_file: Option<PathBuf>,
}

impl Shared {
    /// The group has formed (or failed to): nobody needs the job file any more.
    pub fn done(self) {
        if let Some(path) = self.job_file {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The id through the launcher's exchange, or None where the environment names a
/// rendezvous, the launcher offers no exchange, or the job has one rank.
pub fn share_unique_id(lookup: &dyn Fn(&str) -> Option<String>, deadline: Instant) -> Result<Option<Shared>> {
    if let Some(fd) = pmi::wanted(lookup)? {
        let (rank, world) = pmi::identity(lookup)?;
        if world == 1 {
            return Ok(None);
        }
        let id = pmi::share_unique_id(fd, rank, deadline)?;
        return Ok(Some(Shared { id, rank, world, job_file: None }));
    }
    if pmix::wanted(lookup) {
        let got = pmix::share_unique_id(deadline)?;
        return Ok(got.id.map(|id| Shared { id, rank: got.rank, world: got.world, job_file: None }));
    }
    if let Some(name) = job_file::wanted(lookup) {
        let (rank, world) = RankEnv::identity(lookup)?;
        if world == 1 {
            return Ok(None);
        }
        if rank == 0 {
            let id = UniqueId::create()?;
            let path = job_file::publish(lookup, &name, &id)?;
            return Ok(Some(Shared { id, rank, world, job_file: Some(path) }));
        }
        let id = job_file::read(lookup, &name, deadline)?;
        return Ok(Some(Shared { id, rank, world, job_file: None }));
    }
    Ok(None)
}
