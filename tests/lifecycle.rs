//! Communicator setup and teardown on real processes: init is complete on every rank when
//! it returns, two communicators of one job never cross-talk, and ranks started with a
//! duplicate RANK or disagreeing WORLD_SIZE all fail, naming the real disagreement.

mod common;
use common::*;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

fn lifecycle() -> &'static std::path::Path {
    static EXE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| c_program("tests/c/lifecycle.c", "lifecycle-c-test"))
}

fn launch_lifecycle(n: usize, mode: &str, transport: &str) -> Output {
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", &n.to_string(), "--"]).arg(lifecycle()).arg(mode).env("GRADWIRE_TRANSPORT", transport).env("GRADWIRE_TIMEOUT_MS", "20000");
    run_with_limit(cmd, Duration::from_secs(60))
}

use std::process::Output;

/// `gradwire_init` then `gradwire_finalize` and exit at once, with no collective between:
/// every rank must succeed (a rank used to exit while its peers still opened its shared
/// memory or asked its store: 60-100 % of runs failed).
#[test]
fn init_then_exit_at_once_succeeds_on_every_rank() {
    for round in 0..5 {
        for (n, transport) in [(2, "shm"), (4, "shm"), (8, "shm"), (3, "tcp"), (4, "auto")] {
            let out = launch_lifecycle(n, "exit", transport);
            let t = text(&out);
            assert!(out.status.success(), "round {round}, {n} ranks on {transport}:\n{t}");
            assert_eq!(t.matches(": ok").count(), n, "round {round}, {n} ranks on {transport}:\n{t}");
        }
    }
}

/// A second communicator while the first is alive: both work on every rank, each
/// reducing its own data (the second used to join the first one's rendezvous on every
/// rank but rank 0, and complete collectives against its peers).
#[test]
fn two_communicators_in_one_job_do_not_cross_talk() {
    for (n, transport) in [(2, "shm"), (4, "shm"), (3, "tcp")] {
        let out = launch_lifecycle(n, "two", transport);
        let t = text(&out);
        assert!(out.status.success(), "{n} ranks on {transport}:\n{t}");
        assert_eq!(t.matches(": ok").count(), n, "{t}");
    }
}

fn spawn_ranks(ranks: &[(usize, usize)], port: u16) -> Vec<Child> {
    let env = [("GRADWIRE_TIMEOUT_MS", "20000")];
    ranks
        .iter()
        .map(|&(rank, world)| spawn_rank(rank, world, port, "lifecycle-secret", &env, &["bench", "allreduce", "-b", "4K", "-e", "4K", "-n", "2", "-w", "1"]))
        .collect()
}

/// Every rank fails, well before the deadline, and the output says `expect`.
fn all_fail_fast(children: Vec<Child>, expect: &str) {
    let start = Instant::now();
    let outs: Vec<_> = children.into_iter().map(|c| wait_with_limit(c, Duration::from_secs(60))).collect();
    let all: String = outs.iter().map(text).collect();
    println!("{all}");
    assert!(start.elapsed() < Duration::from_secs(10), "took {:?}: waited for the 20 s deadline", start.elapsed());
    for (i, o) in outs.iter().enumerate() {
        assert!(!o.status.success(), "process {i} succeeded:\n{all}");
        assert!(text(o).contains(expect), "process {i} does not say {expect:?}:\n{all}");
    }
    assert!(!all.contains("panicked"), "{all}");
}

/// Two processes with RANK=1 (none with 2): every process fails, naming the duplicate
/// (they used to run and report success). Two with RANK=0 too: the second finds the port
/// taken by a store that knows the job's secret, and fails every rank the same way rather
/// than alone.
#[test]
fn a_duplicate_rank_fails_every_rank() {
    all_fail_fast(spawn_ranks(&[(0, 3), (1, 3), (1, 3)], free_port()), "two processes were started with rank 1");
    all_fail_fast(spawn_ranks(&[(0, 3), (0, 3), (1, 3)], free_port()), "two processes were started with rank 0");
}

/// Ranks that disagree on WORLD_SIZE are told so (it used to read "GRADWIRE_SHM_*
/// settings differ").
#[test]
fn disagreeing_world_sizes_are_named() {
    all_fail_fast(spawn_ranks(&[(0, 3), (1, 3), (2, 4), (3, 4)], free_port()), "disagree on the world size");
}
