//! The launcher's own key-value exchange (PMI-1's wire protocol over the socket a Hydra
//! `mpiexec`, or another PMI server, hands each rank in `PMI_FD`): how ranks started by
//! such a launcher, with no gradwire variable exported, find each other. Rank 0 makes a
//! unique id and puts it; every rank passes the launcher's barrier; the others get it. The
//! id carries a fresh job secret, so only processes of this job (those the launcher gave
//! this socket) learn it.
//!
//! Used only where the environment names no rendezvous (no `MASTER_ADDR` or
//! `GRADWIRE_JOB_SECRET`): explicit variables win. A process that has called `MPI_Init`
//! shares its PMI connection with the MPI library; such an application makes its
//! communicator from a unique id it broadcasts itself (`gradwire_get_unique_id` and
//! `MPI_Bcast`), as NCCL applications do.

use super::unique_id::UniqueId;
use crate::error::{config, Error, Result};
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::time::Instant;

/// The key rank 0's id is put under, followed by the number of communicators this process
/// made through PMI before (every rank makes them in the same order).
const KEY: &str = "gradwire-unique-id";

static EXCHANGES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A PMI-1 connection, if the environment asks for one: `PMI_FD` is set and neither a
/// rendezvous address nor a job secret is.
pub fn wanted(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Option<i32>> {
    let set = |k: &str| lookup(k).is_some_and(|v| !v.trim().is_empty());
    let Some(fd) = lookup("PMI_FD").filter(|v| !v.trim().is_empty()) else { return Ok(None) };
    if ["GRADWIRE_MASTER_ADDR", "MASTER_ADDR", "GRADWIRE_JOB_SECRET"].iter().any(|k| set(k)) {
        return Ok(None);
    }
    let fd = fd.trim().parse::<i32>().ok().filter(|&f| f >= 0).ok_or_else(|| config(format!("PMI_FD={fd:?} is not a file descriptor number")))?;
    Ok(Some(fd))
}

/// Rank and world size as the PMI server gave them (`PMI_RANK`, `PMI_SIZE`): under Hydra
/// inside a Slurm allocation the batch step's `SLURM_PROCID` is there too, and is not this
/// rank's.
pub fn identity(lookup: &dyn Fn(&str) -> Option<String>) -> Result<(usize, usize)> {
    let only = |k: &str| if k == "PMI_RANK" || k == "PMI_SIZE" { lookup(k) } else { None };
    super::RankEnv::identity(&only)
}

/// Hands rank 0's unique id to every rank through the launcher's PMI server on `fd`,
/// within `deadline`, and tells the server this process is done with PMI (Hydra kills a
/// job one of whose ranks closes its connection without saying so).
pub fn share_unique_id(fd: i32, rank: usize, deadline: Instant) -> Result<UniqueId> {
    let own = crate::sys::sock::dup_inherited_socket(fd).map_err(|e| config(format!("PMI_FD={fd}: {e} (the launcher's PMI connection)")))?;
    let mut pmi = Pmi { stream: std::fs::File::from(own), deadline, pending: Vec::new() };
    let key = format!("{KEY}-{}", EXCHANGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed));
    let init = pmi.call("cmd=init pmi_version=1 pmi_subversion=1", "response_to_init")?;
    if field(&init, "pmi_version") != Some("1") {
        return Err(pmi.refused("init", &init));
    }
    let kvs = pmi.call("cmd=get_my_kvsname", "my_kvsname")?;
    let kvs = field(&kvs, "kvsname").ok_or_else(|| pmi.refused("get_my_kvsname", &kvs))?.to_string();
    let mine = if rank == 0 {
        let id = UniqueId::create()?;
        let hex = id.to_hex()?;
        let put = pmi.call(&format!("cmd=put kvsname={kvs} key={key} value={hex}"), "put_result")?;
        if field(&put, "rc") != Some("0") {
            return Err(pmi.refused("put", &put));
        }
        Some(id)
    } else {
        None
    };
    pmi.call("cmd=barrier_in", "barrier_out")?;
    let id = match mine {
        Some(id) => id,
        None => {
            let got = pmi.call(&format!("cmd=get kvsname={kvs} key={key}"), "get_result")?;
            let hex = field(&got, "value").filter(|_| field(&got, "rc") == Some("0")).ok_or_else(|| pmi.refused("get", &got))?;
            UniqueId::from_hex(hex).map_err(|e| Error::Protocol(format!("PMI: the value under {key}: {e}")))?
        }
    };
    pmi.call("cmd=finalize", "finalize_ack")?;
    // The launcher's connection stays open for anyone else; ours closes here.
    Ok(id)
}

/// The value of `name` in a PMI-1 reply (`cmd=... name=value ...`).
fn field<'a>(reply: &'a str, name: &str) -> Option<&'a str> {
    reply.split_whitespace().find_map(|kv| kv.strip_prefix(name).and_then(|r| r.strip_prefix('=')))
}

struct Pmi {
    /// Our own descriptor of the launcher's connection.
    stream: std::fs::File,
    deadline: Instant,
    /// Bytes read past the last reply's newline.
    pending: Vec<u8>,
}

impl Pmi {
    /// Sends one command and reads its reply, which must be `cmd=<want> ...`.
    fn call(&mut self, command: &str, want: &str) -> Result<String> {
        let what = command.split_whitespace().next().unwrap_or(command).trim_start_matches("cmd=").to_string();
        crate::sys::sock::NoSigpipe(&self.stream).write_all(format!("{command}\n").as_bytes()).map_err(|e| Error::io(format!("PMI {what}"), e))?;
        let reply = loop {
            if let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.pending.drain(..=end).collect();
                break String::from_utf8_lossy(&line).trim().to_string();
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            let mut fds = [libc::pollfd { fd: self.stream.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
            let ready = if left.is_zero() { 0 } else { crate::sys::poll::poll(&mut fds, left.as_millis().clamp(1, i32::MAX as u128) as i32) };
            if ready < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() == std::io::ErrorKind::Interrupted {
                    continue; // a signal: wait again, for what is left
                }
                return Err(Error::io(format!("PMI {what}: poll"), e));
            }
            if ready == 0 {
                return Err(Error::Protocol(format!("PMI: timed out waiting for the launcher to answer {what} (a rank of the job is missing or stuck)")));
            }
            let mut buf = [0u8; 4096];
            match self.stream.read(&mut buf) {
                Ok(0) => return Err(Error::Protocol(format!("PMI: the launcher closed the connection during {what}"))),
                Ok(n) => self.pending.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(format!("PMI {what}"), e)),
            }
        };
        if field(&reply, "cmd") != Some(want) {
            return Err(self.refused(&what, &reply));
        }
        Ok(reply)
    }

    fn refused(&self, what: &str, reply: &str) -> Error {
        Error::Protocol(format!("PMI: the launcher answered {what} with {reply:?}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn wanted_in(pairs: &[(&str, &str)]) -> Result<Option<i32>> {
        let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        wanted(&move |k| m.get(k).cloned())
    }

    #[test]
    fn pmi_only_where_no_rendezvous_is_named() {
        assert_eq!(wanted_in(&[("PMI_FD", "6"), ("PMI_RANK", "1")]).unwrap(), Some(6));
        assert_eq!(wanted_in(&[("PMI_RANK", "1")]).unwrap(), None);
        assert_eq!(wanted_in(&[("PMI_FD", "6"), ("MASTER_ADDR", "h")]).unwrap(), None);
        assert_eq!(wanted_in(&[("PMI_FD", "6"), ("GRADWIRE_JOB_SECRET", "0123456789")]).unwrap(), None);
        let err = wanted_in(&[("PMI_FD", "six")]).unwrap_err().to_string();
        assert!(err.contains("PMI_FD=\"six\""), "{err}");
    }

    #[test]
    fn the_pmi_server_s_rank_wins_over_an_enclosing_slurm_step() {
        let m: HashMap<&str, &str> = [("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")].into_iter().collect();
        assert_eq!(identity(&|k| m.get(k).map(|v| v.to_string())).unwrap(), (2, 4));
    }

    #[test]
    fn reply_fields() {
        let r = "cmd=get_result rc=0 msg=success value=abc=d";
        assert_eq!(field(r, "cmd"), Some("get_result"));
        assert_eq!(field(r, "value"), Some("abc=d"));
        assert_eq!(field(r, "val"), None);
    }

    #[test]
    fn a_descriptor_that_is_not_a_socket_is_refused() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let err = share_unique_id(file.as_raw_fd(), 1, Instant::now()).unwrap_err().to_string();
        assert!(err.contains("not a socket"), "{err}");
    }
}
