//! The job file: where a launcher gives ranks their identity but runs no key-value
//! exchange (Slurm's `srun --mpi=none`, the default of many clusters), rank 0 writes its
//! unique id to a file only its user can read, in the home directory the job's nodes
//! share, and the other ranks read it there, as ssh keys are kept. The file's name comes
//! from the launcher's job and step ids, which every rank of the step sees alike; rank 0
//! removes it once the group has formed.

use super::unique_id::UniqueId;
use crate::error::{config, Error, Result};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

static EXCHANGES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The job file's name for this step and communicator, if the launcher names a job step
/// and the environment names no rendezvous: Slurm's cluster, job and step ids, then the
/// number of communicators this process made through a job file before.
pub fn wanted(lookup: &dyn Fn(&str) -> Option<String>) -> Option<String> {
    let get = |k: &str| lookup(k).map(|v| v.trim().to_string()).filter(|v| !v.is_empty());
    if ["GRADWIRE_MASTER_ADDR", "MASTER_ADDR", "GRADWIRE_JOB_SECRET"].iter().any(|k| get(k).is_some()) {
        return None;
    }
    let job = get("SLURM_JOB_ID")?;
    let step = get("SLURM_STEP_ID")?;
    let cluster = get("SLURM_CLUSTER_NAME").unwrap_or_default();
    let safe = |s: &str| s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if !safe(&job) || !safe(&step) || !safe(&cluster) {
        return None;
    }
    Some(format!("slurm-{cluster}-{job}.{step}-{}", EXCHANGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)))
}

/// The directory job files live in: `$HOME/.gradwire/jobs`.
fn directory(lookup: &dyn Fn(&str) -> Option<String>) -> Result<PathBuf> {
    let home = lookup("HOME").filter(|h| !h.trim().is_empty()).ok_or_else(|| config(no_rendezvous("HOME is not set")))?;
    Ok(Path::new(&home).join(".gradwire").join("jobs"))
}

/// What a rank is told when no exchange can carry the id.
fn no_rendezvous(why: &str) -> String {
    format!("{why}: the ranks cannot pass rank 0's address through a job file; export MASTER_ADDR (rank 0's host), MASTER_PORT and GRADWIRE_JOB_SECRET in the job script, or start the ranks with a PMI launcher (srun --mpi=pmi2, mpirun)")
}

/// A file or directory only this user can use: owned by the effective user, no access
/// for group or others (what ssh asks of a private key).
fn private(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if meta.uid() != me || meta.mode() & 0o077 != 0 {
        return Err(config(format!(
            "{} is owned by uid {} with mode {:o}: a job file and its directory must be the user's own (uid {me}) with no access for group or others (chmod go= {})",
            path.display(),
            meta.uid(),
            meta.mode() & 0o7777,
            path.display()
        )));
    }
    Ok(())
}

/// Rank 0 writes `id` under `name`; it returns the file's path (to remove once the group
/// has formed).
pub fn publish(lookup: &dyn Fn(&str) -> Option<String>, name: &str, id: &UniqueId) -> Result<PathBuf> {
    let dir = directory(lookup)?;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&dir).map_err(|e| Error::io(format!("job file directory {}", dir.display()), e))?;
    let meta = std::fs::metadata(&dir).map_err(|e| Error::io(format!("job file directory {}", dir.display()), e))?;
    private(&dir, &meta)?;
    let path = dir.join(name);
    let partial = dir.join(format!(".{name}.{}", std::process::id()));
    let write = || -> std::io::Result<()> {
        let _ = std::fs::remove_file(&partial);
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&partial)?;
        std::io::Write::write_all(&mut f, format!("{}\n", id.to_hex().map_err(std::io::Error::other)?).as_bytes())?;
        f.sync_all()?;
        // Readers see the whole file or none.
        std::fs::rename(&partial, &path)
    };
    write().map_err(|e| {
        let _ = std::fs::remove_file(&partial);
        Error::io(format!("job file {}", path.display()), e)
    })?;
    Ok(path)
}

/// Every other rank reads rank 0's id under `name`, waiting for the file until `deadline`.
pub fn read(lookup: &dyn Fn(&str) -> Option<String>, name: &str, deadline: Instant) -> Result<UniqueId> {
    let dir = directory(lookup)?;
    let path = dir.join(name);
    let started = Instant::now();
    let mut pause = Duration::from_millis(5);
    loop {
        match std::fs::metadata(&path) {
            Ok(meta) => {
                private(&path, &meta)?;
                let text = std::fs::read_to_string(&path).map_err(|e| Error::io(format!("job file {}", path.display()), e))?;
                return UniqueId::from_hex(&text).map_err(|e| Error::Protocol(format!("job file {}: {e}", path.display())));
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("job file {}", path.display()), e)),
        }
        if Instant::now() >= deadline {
            return Err(Error::Protocol(format!(
                "timed out after {} ms waiting for rank 0's job file {} ({})",
                started.elapsed().as_millis(),
                path.display(),
                no_rendezvous("rank 0 has not written it: it has not started, or this home directory is not the one rank 0's node sees")
            )));
        }
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
        pause = (pause * 2).min(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn only_for_a_job_step_with_no_rendezvous_named() {
        let name = wanted(&env(&[("SLURM_JOB_ID", "42"), ("SLURM_STEP_ID", "3"), ("SLURM_CLUSTER_NAME", "c1")])).unwrap();
        assert!(name.starts_with("slurm-c1-42.3-"), "{name}");
        assert!(wanted(&env(&[("SLURM_JOB_ID", "42")])).is_none());
        assert!(wanted(&env(&[("SLURM_JOB_ID", "42"), ("SLURM_STEP_ID", "3"), ("MASTER_ADDR", "h")])).is_none());
        assert!(wanted(&env(&[("SLURM_JOB_ID", "../x"), ("SLURM_STEP_ID", "3")])).is_none());
    }

    #[test]
    fn written_privately_read_back_and_refused_when_others_can_read_it() {
        let home = std::env::temp_dir().join(format!("gw-job-file-{}", std::process::id()));
        let home_s = home.to_string_lossy().to_string();
        let lookup = env(&[("HOME", &home_s)]);
        let id = UniqueId { host: "10.0.0.7".into(), port: 41234, secret: "ab".repeat(32) };
        let path = publish(&lookup, "t-1", &id).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(path.parent().unwrap()).unwrap().mode() & 0o777, 0o700);
        assert_eq!(read(&lookup, "t-1", Instant::now()).unwrap(), id);
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
        let e = read(&lookup, "t-1", Instant::now()).unwrap_err().to_string();
        assert!(e.contains("no access for group or others"), "{e}");
        let e = read(&lookup, "t-2", Instant::now() + Duration::from_millis(50)).unwrap_err().to_string();
        assert!(e.contains("timed out") && e.contains("MASTER_ADDR"), "{e}");
        std::fs::remove_dir_all(&home).unwrap();
    }
}
