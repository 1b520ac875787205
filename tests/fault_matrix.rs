//! The fault matrix, through `gradwire launch` as a user runs it: each rank SIGKILLed and
//! SIGSTOPped at each phase (rendezvous, small and large one-host allreduce, tcp, the
//! token ring, a training run), and the launcher itself killed with SIGKILL or SIGTERM
//! with ranks wrapped in a shell. Each case checks the rank the launcher blames, how long
//! it takes to exit, and that nothing is left: no process of the job (which would hold
//! its memfds), nothing new in /dev/shm, no network namespace of its launcher.

mod common;
use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Every wait's deadline in these jobs.
const DEADLINE_MS: u64 = 3000;

/// A variable only this case's processes carry, so that leftovers can be found.
fn token() -> String {
    format!("{}-{}", std::process::id(), rand_u64())
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

/// Processes whose environment holds `GW_FAULT_TOKEN=<token>`, with their RANK if any.
fn job_processes(token: &str) -> Vec<(u32, Option<usize>)> {
    let needle = format!("GW_FAULT_TOKEN={token}");
    let mut found = vec![];
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(env) = std::fs::read(e.path().join("environ")) else { continue };
        let vars: Vec<String> = env.split(|&b| b == 0).map(|v| String::from_utf8_lossy(v).into_owned()).collect();
        if vars.contains(&needle) {
            let rank = vars.iter().find_map(|v| v.strip_prefix("RANK=")).and_then(|r| r.parse().ok());
            found.push((pid, rank));
        }
    }
    found
}

/// The pid of the gradwire process (not a shell around it) of rank `rank`.
fn rank_pid(token: &str, rank: usize) -> Option<u32> {
    job_processes(token).into_iter().filter(|&(_, r)| r == Some(rank)).map(|(p, _)| p).find(|&p| {
        let exe = std::fs::read_link(format!("/proc/{p}/exe")).map(|e| e.to_string_lossy().into_owned()).unwrap_or_default();
        exe.ends_with("/gradwire")
    })
}

fn dev_shm() -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir("/dev/shm").map(|d| d.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect()).unwrap_or_default();
    names.sort();
    names
}

/// Waits until no process of the job is left, at most `limit`.
fn assert_nothing_left(token: &str, limit: Duration, what: &str) {
    let start = Instant::now();
    loop {
        let left = job_processes(token);
        if left.is_empty() {
            return;
        }
        if start.elapsed() > limit {
            let names: Vec<String> = left
                .iter()
                .map(|(p, r)| format!("{p} rank {r:?} {}", std::fs::read_to_string(format!("/proc/{p}/cmdline")).unwrap_or_default().replace('\0', " ")))
                .collect();
            panic!("{what}: processes of the job left {limit:?} after: {names:#?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn launcher(token: &str, n: usize, launch_args: &[&str], cmd: &[&str], env: &[(&str, &str)]) -> Child {
    let mut c = Command::new(bin());
    c.arg("launch").arg("-n").arg(n.to_string()).args(launch_args).arg("--").args(cmd);
    c.env("GW_FAULT_TOKEN", token).env("GRADWIRE_TIMEOUT_MS", DEADLINE_MS.to_string());
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn the launcher")
}

/// Waits until the job has `n` gradwire ranks running.
fn wait_for_ranks(token: &str, n: usize) {
    let start = Instant::now();
    while (0..n).any(|r| rank_pid(token, r).is_none()) {
        assert!(start.elapsed() < Duration::from_secs(20), "the ranks never all started: {:?}", job_processes(token));
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Kill,
    Stop,
}

/// One phase of a job: what each rank runs, and its environment.
struct Phase {
    name: &'static str,
    args: Vec<&'static str>,
    env: Vec<(&'static str, &'static str)>,
}

fn phases() -> Vec<Phase> {
    let long = |size: &'static str| vec!["bench", "allreduce", "-b", size, "-e", size, "-n", "100000000", "-w", "1"];
    vec![
        Phase { name: "small shm allreduce", args: long("4K"), env: vec![("GRADWIRE_TRANSPORT", "shm")] },
        Phase { name: "large shm allreduce", args: long("16M"), env: vec![("GRADWIRE_TRANSPORT", "shm")] },
        Phase { name: "tcp allreduce", args: long("1M"), env: vec![("GRADWIRE_TRANSPORT", "tcp")] },
        Phase { name: "token ring", args: vec!["check", "--token-ring", "100000000"], env: vec![] },
        Phase { name: "training run", args: vec!["train", "--strategy", "ssgd", "--epochs", "100000"], env: vec![] },
    ]
}

/// Runs a 3-rank job of `phase`, lets it settle, hits rank `victim` with `fault`, and
/// checks the launcher blames it, exits in time, and leaves nothing behind.
fn hit_rank(phase: &Phase, victim: usize, fault: Fault) {
    let n = 3;
    let what = format!("{fault:?} of rank {victim} in the {}", phase.name);
    let token = token();
    let shm_before = dev_shm();
    let mut cmd = vec![bin()];
    cmd.extend(phase.args.iter().copied());
    let job = launcher(&token, n, &[], &cmd, &phase.env);
    wait_for_ranks(&token, n);
    // Past the rendezvous (which has its own case) into the phase, also on a loaded machine.
    std::thread::sleep(Duration::from_millis(1200));
    let pid = rank_pid(&token, victim).unwrap_or_else(|| panic!("{what}: rank {victim} is gone before the fault"));
    let sig = if fault == Fault::Kill { libc::SIGKILL } else { libc::SIGSTOP };
    // SAFETY: signalling a process of this test's job.
    unsafe { libc::kill(pid as i32, sig) };
    let hit = Instant::now();
    let out = wait_with_limit(job, Duration::from_secs(60));
    let took = hit.elapsed();
    let t = text(&out);
    println!("{what}: launcher exited after {took:?}:\n{t}");
    assert!(!out.status.success(), "{what}: the launcher reported success:\n{t}");
    let blamed = match fault {
        Fault::Kill => format!("rank {victim} failed (killed by signal 9)"),
        Fault::Stop => format!("rank {victim} failed (stopped"),
    };
    assert!(t.contains(&blamed), "{what}: the launcher does not say {blamed:?}:\n{t}");
    assert!(!t.contains("panicked"), "{what}:\n{t}");
    // A killed rank is seen at once; a stopped one when its peers reach their deadline,
    // which in the one-host allreduce may come twice: a peer that may still write into a
    // survivor's buffer is given a second deadline before the buffer is let go.
    let deadlines = if fault == Fault::Kill { 1 } else { 2 };
    let bound = Duration::from_millis(DEADLINE_MS) * deadlines + Duration::from_secs(3);
    assert!(took < bound, "{what}: the launcher took {took:?} to exit (bound {bound:?})");
    assert_nothing_left(&token, Duration::from_millis(500), &what);
    assert_eq!(dev_shm(), shm_before, "{what}: /dev/shm changed");
}

/// A rank that dies or stops before it joins the rendezvous.
fn hit_at_rendezvous(victim: usize, fault: Fault) {
    let n = 3;
    let what = format!("{fault:?} of rank {victim} at the rendezvous");
    let token = token();
    let sig = if fault == Fault::Kill { "KILL" } else { "STOP" };
    let script = format!("if [ \"$RANK\" = {victim} ]; then kill -{sig} $$; fi; exec {} bench allreduce -b 4K -e 4K -n 10", bin());
    let start = Instant::now();
    let out = wait_with_limit(launcher(&token, n, &[], &["sh", "-c", &script], &[]), Duration::from_secs(60));
    let t = text(&out);
    println!("{what}: {:?}\n{t}", start.elapsed());
    let blamed = if fault == Fault::Kill { format!("rank {victim} failed (killed by signal 9)") } else { format!("rank {victim} failed (stopped") };
    assert!(t.contains(&blamed), "{what}: the launcher does not say {blamed:?}:\n{t}");
    let bound = Duration::from_millis(DEADLINE_MS) + Duration::from_secs(4);
    assert!(start.elapsed() < bound, "{what}: took {:?}", start.elapsed());
    assert_nothing_left(&token, Duration::from_millis(500), &what);
}

#[test]
fn each_rank_killed_or_stopped_at_the_rendezvous() {
    for victim in 0..3 {
        for fault in [Fault::Kill, Fault::Stop] {
            hit_at_rendezvous(victim, fault);
        }
    }
}

fn matrix_for(phase_name: &str) {
    let phase = phases().into_iter().find(|p| p.name == phase_name).expect("phase");
    for victim in 0..3 {
        for fault in [Fault::Kill, Fault::Stop] {
            hit_rank(&phase, victim, fault);
        }
    }
}

#[test]
fn each_rank_killed_or_stopped_in_a_small_shm_allreduce() {
    matrix_for("small shm allreduce");
}

#[test]
fn each_rank_killed_or_stopped_in_a_large_shm_allreduce() {
    matrix_for("large shm allreduce");
}

/// A stopped rank in the other collectives' one-host forms, staged (private buffers) and in
/// the peers' mapped buffers (`gradwire_alloc`): its peers reach their deadline and the
/// launcher names it (killed ranks: `faults::killed_rank_in_every_one_host_collective`).
#[test]
fn a_rank_stopped_in_every_one_host_collective() {
    for coll in ["reduce_scatter", "allgather", "alltoall", "broadcast"] {
        for buffers in ["private", "shared"] {
            let args = vec!["bench", coll, "-b", "16M", "-e", "16M", "-n", "100000000", "-w", "1", "--buffers", buffers];
            let phase = Phase { name: "one-host collective", args, env: vec![("GRADWIRE_TRANSPORT", "shm")] };
            println!("{coll}, {buffers} buffers");
            hit_rank(&phase, 1, Fault::Stop);
        }
    }
}

#[test]
fn each_rank_killed_or_stopped_in_a_tcp_allreduce() {
    matrix_for("tcp allreduce");
}

#[test]
fn each_rank_killed_or_stopped_in_the_token_ring() {
    matrix_for("token ring");
}

#[test]
fn each_rank_killed_or_stopped_in_a_training_run() {
    matrix_for("training run");
}

/// The launcher SIGKILLed (the OOM killer, `timeout -s KILL`): its ranks, shell-wrapped,
/// and everything they started go with it; with `--netns`, so do its namespaces.
#[test]
fn a_killed_launcher_takes_its_ranks_with_it() {
    let mut cases: Vec<Vec<&str>> = vec![vec![]];
    if can_netns("a killed launcher's namespaces") {
        cases.push(vec!["--netns"]);
    }
    for launch_args in cases {
        let token = token();
        let script = format!("{} bench allreduce -b 4K -e 4K -n 100000000 -w 1; true", bin());
        let mut job = launcher(&token, 3, &launch_args, &["bash", "-c", &script], &[]);
        wait_for_ranks(&token, 3);
        let launcher_pid = job.id();
        job.kill().unwrap();
        let _ = job.wait();
        assert_nothing_left(&token, Duration::from_secs(4), &format!("launcher {launch_args:?} SIGKILLed"));
        if !launch_args.is_empty() {
            let start = Instant::now();
            loop {
                let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
                let ours: Vec<String> =
                    String::from_utf8_lossy(&ns.stdout).lines().filter(|l| l.starts_with(&format!("gw{launcher_pid}n"))).map(String::from).collect();
                if ours.is_empty() {
                    break;
                }
                assert!(start.elapsed() < Duration::from_secs(5), "namespaces of the killed launcher left: {ours:?}");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// SIGTERM to the launcher, and its own --timeout: ranks wrapped in a shell stop with
/// everything they started (only the direct child used to be signalled).
#[test]
fn a_stopped_launcher_stops_shell_wrapped_ranks() {
    for by_timeout in [false, true] {
        let token = token();
        // The rank's shell waits for a background child: both must go.
        let script = format!("sleep 300 & {} bench allreduce -b 4K -e 4K -n 100000000 -w 1; wait", bin());
        let launch_args: &[&str] = if by_timeout { &["--timeout", "5"] } else { &[] };
        let job = launcher(&token, 3, launch_args, &["bash", "-c", &script], &[]);
        wait_for_ranks(&token, 3);
        if !by_timeout {
            // SAFETY: signalling our own child.
            unsafe { libc::kill(job.id() as i32, libc::SIGTERM) };
        }
        let out = wait_with_limit(job, Duration::from_secs(60));
        let t = text(&out);
        assert_eq!(out.status.code(), Some(if by_timeout { 124 } else { 128 + libc::SIGTERM }), "{t}");
        assert_nothing_left(&token, Duration::from_millis(300), if by_timeout { "launcher --timeout" } else { "launcher SIGTERMed" });
    }
}
