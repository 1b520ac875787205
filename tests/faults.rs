//! Fault handling on real processes: a killed rank, mismatched calls, a wrong job secret,
//! malformed environment. Each must end in a clear error naming the ranks involved, within
//! the deadline, and never a panic or a hang.

mod common;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

/// 4 MiB of private buffers: the one-host allreduce through cross-memory attach (where the
/// kernel allows it), where the kernel reads and writes the peers' buffers (the dead rank's
/// process is gone).
#[test]
fn killed_rank_shm() {
    killed_rank(3, 1, "shm", "4M", &LOCAL);
}

/// The same staged through shared memory.
#[test]
fn killed_rank_shm_staged() {
    killed_rank_with(3, 1, "shm", "4M", &[], &[("GRADWIRE_SHM_CMA", "0")], &LOCAL);
}

/// 16 MiB on `gradwire_alloc` buffers: the zero-copy one-host allreduce, where the ranks
/// work in each other's buffers (the dead rank's phase never comes).
#[test]
fn killed_rank_shm_zero_copy() {
    killed_rank_with(3, 2, "shm", "16M", &["--buffers", "shared"], &[], &LOCAL);
}

/// Every other collective's one-host forms: a rank killed in a loop of calls is named by
/// every survivor within the deadline, staged (private buffers: 64 KiB and 16 MiB) and in
/// the peers' mapped buffers (`gradwire_alloc`, 16 MiB); in broadcast and reduce also the
/// root.
#[test]
fn killed_rank_in_every_one_host_collective() {
    for coll in ["reduce_scatter", "allgather", "alltoall", "broadcast", "reduce", "barrier"] {
        for (buffers, size) in [("private", "64K"), ("private", "16M"), ("shared", "16M")] {
            for victim in if matches!(coll, "broadcast" | "reduce") { vec![0, 1] } else { vec![1] } {
                println!("{coll}, {buffers} buffers of {size}, rank {victim} killed");
                killed_rank_in(coll, 3, victim, "shm", size, &["--buffers", buffers], &[], &LOCAL);
            }
        }
    }
}

#[test]
fn killed_rank_tcp() {
    killed_rank(4, 2, "tcp", "4M", &LOCAL);
}

#[test]
fn killed_rank_tcp_small_messages() {
    killed_rank(3, 0, "tcp", "4K", &LOCAL);
}

const BASE: &[&str] = &["bench", "allreduce", "-b", "4K", "-e", "4K", "-n", "3", "-w", "1"];

fn with(extra: &[&'static str]) -> Vec<&'static str> {
    BASE.iter().chain(extra).copied().collect()
}

#[test]
fn mismatched_count() {
    for t in ["shm", "tcp"] {
        mismatch(t, BASE, &["bench", "allreduce", "-b", "8K", "-e", "8K", "-n", "3", "-w", "1"], &["count 1024", "count 2048"]);
    }
}

/// The one-host allreduce takes a different form by size (one barrier; staged; from 256 KiB
/// the agreement on a form that works in the peers' buffers, which then stages or not):
/// ranks that disagree on the size run different forms and must still name both calls.
#[test]
fn mismatched_count_across_shm_forms() {
    let bench = |size: &'static str| vec!["bench", "allreduce", "-b", size, "-e", size, "-n", "3", "-w", "1"];
    mismatch("shm", BASE, &bench("128K"), &["count 1024", "count 32768"]);
    mismatch("shm", BASE, &bench("256K"), &["count 1024", "count 65536"]);
    mismatch("shm", &bench("128K"), &bench("16M"), &["count 32768", "count 4194304"]);
    mismatch("shm", &bench("256K"), &bench("16M"), &["count 65536", "count 4194304"]);
}

#[test]
fn mismatched_dtype() {
    for t in ["shm", "tcp"] {
        mismatch(t, BASE, &with(&["-d", "float64"]), &["float32", "float64"]);
    }
}

#[test]
fn mismatched_op() {
    for t in ["shm", "tcp"] {
        mismatch(t, BASE, &with(&["-o", "max"]), &["sum", "max"]);
    }
}

#[test]
fn mismatched_order() {
    for t in ["shm", "tcp"] {
        mismatch(t, BASE, &["bench", "broadcast", "-b", "4K", "-e", "4K", "-n", "3", "-w", "1"], &["allreduce#0", "broadcast#0"]);
    }
}

/// Ranks that disagree on the root of a broadcast or reduce: every rank fails, naming
/// both roots, at every size (they used to return success with different data; a root
/// only sends, so it never read a header, and at 16 MiB it was a timeout). Over links the
/// rooted collectives first agree on the call; on one host they check every rank's
/// published call instead.
#[test]
fn mismatched_root() {
    for t in ["shm", "tcp"] {
        for coll in ["broadcast", "reduce"] {
            for size in ["4K", "16M"] {
                let call = |root| vec!["bench", coll, "-b", size, "-e", size, "-n", "3", "-w", "1", "-r", root];
                let expect: &[&str] = if t == "tcp" { &["root 0", "root 1", "disagree on the root"] } else { &["root 0)", "root 1)"] };
                mismatch(t, &call("0"), &call("1"), expect);
            }
        }
    }
}

/// A root that disagrees with the others on the count, where the root only sends.
#[test]
fn mismatched_count_at_the_root() {
    for t in ["shm", "tcp"] {
        for (mine, theirs) in [("4K", "8K"), ("128K", "16M")] {
            let call = |size| vec!["bench", "broadcast", "-b", size, "-e", size, "-n", "3", "-w", "1", "-r", "1"];
            let counts = [format!("count {}", bytes(mine) / 4), format!("count {}", bytes(theirs) / 4)];
            let mut expect = vec![counts[0].as_str(), counts[1].as_str()];
            if t == "tcp" {
                expect.push("disagree on the count");
            }
            mismatch(t, &call(mine), &call(theirs), &expect);
        }
    }
}

/// The collectives that split their buffers, on one host: ranks that disagree on the
/// collective, or on its count across the staged and the mapped form, each fail fast
/// naming both calls (mapped: `gradwire_alloc` buffers, where the large calls work in the
/// peers' buffers).
#[test]
fn mismatched_one_host_collectives() {
    let call =
        |coll: &'static str, size: &'static str, buffers: &'static str| vec!["bench", coll, "-b", size, "-e", size, "-n", "3", "-w", "1", "--buffers", buffers];
    for buffers in ["private", "shared"] {
        for (a, b) in [("reduce_scatter", "allgather"), ("allgather", "alltoall"), ("alltoall", "broadcast"), ("reduce", "broadcast"), ("barrier", "allgather")]
        {
            for size in ["96K", "16M"] {
                mismatch("shm", &call(a, size, buffers), &call(b, size, buffers), &[&format!("{a}#0"), &format!("{b}#0")]);
            }
        }
        for coll in ["reduce_scatter", "allgather", "alltoall"] {
            mismatch("shm", &call(coll, "96K", buffers), &call(coll, "16M", buffers), &[&format!("{coll}#0(count ")]);
        }
    }
}

/// "4K" -> 4096.
fn bytes(size: &str) -> usize {
    let (n, unit) = size.split_at(size.len() - 1);
    n.parse::<usize>().unwrap() << if unit == "K" { 10 } else { 20 }
}

/// Ranks that cut ring parts into different chunks send the same call in different
/// messages: each rank fails fast, and the error points at the setting.
#[test]
fn ranks_with_different_ring_chunks_fail_fast() {
    let port = free_port();
    let args = ["bench", "allreduce", "-b", "1M", "-e", "1M", "-n", "3", "-w", "1", "--transport", "tcp"];
    let start = Instant::now();
    let ranks: Vec<_> = (0..2)
        .map(|r| {
            let chunk = if r == 0 { "65536" } else { "131072" };
            spawn_rank(r, 2, port, "fault-test-secret", &[("GRADWIRE_TIMEOUT_MS", "30000"), ("GRADWIRE_RING_CHUNK_BYTES", chunk)], &args)
        })
        .collect();
    let outs: Vec<_> = ranks.into_iter().map(|c| wait_with_limit(c, Duration::from_secs(60))).collect();
    let all: String = outs.iter().map(text).collect();
    println!("{all}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}: waited for the deadline", start.elapsed());
    assert!(outs.iter().all(|o| !o.status.success()), "{all}");
    assert!(all.contains("GRADWIRE_RING_CHUNK_BYTES"), "{all}");
    assert!(!all.contains("panicked"), "{all}");
}

#[test]
fn wrong_job_secret_is_refused() {
    let port = free_port();
    let env = [("GRADWIRE_TIMEOUT_MS", "3000")];
    let args = ["check", "--counts", "1"];
    let good = spawn_rank(0, 2, port, "the-right-secret", &env, &args);
    std::thread::sleep(Duration::from_millis(300));
    let bad = spawn_rank(1, 2, port, "a-wrong-secret!", &env, &args);
    let bad = wait_with_limit(bad, Duration::from_secs(30));
    let good = wait_with_limit(good, Duration::from_secs(30));
    let (tb, tg) = (text(&bad), text(&good));
    println!("impostor: {tb}\nrank 0: {tg}");
    assert!(!bad.status.success() && tb.contains("job secret"), "impostor not told why:\n{tb}");
    assert!(tg.contains("refused connection"), "rank 0 did not log the refusal:\n{tg}");
    assert!(!good.status.success() && tg.contains("rank 1"), "rank 0 should time out naming rank 1:\n{tg}");
    assert!(!(tb + &tg).contains("panicked"));
}

/// Rank 0 whose rendezvous port is already in use says so, names the variables that choose
/// the port, and does not wait for its deadline.
#[test]
fn taken_rendezvous_port_is_explained() {
    let port = free_port();
    let _squatter = std::net::TcpListener::bind(("0.0.0.0", port)).unwrap();
    let start = Instant::now();
    let out =
        wait_with_limit(spawn_rank(0, 2, port, "fault-test-secret", &[("GRADWIRE_TIMEOUT_MS", "30000")], &["check", "--counts", "1"]), Duration::from_secs(60));
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success(), "{t}");
    assert!(t.contains(&format!("127.0.0.1:{port}")) && t.contains("port taken") && t.contains("GRADWIRE_MASTER_PORT"), "{t}");
    assert!(start.elapsed() < Duration::from_secs(20), "took {:?}: waited for the deadline", start.elapsed());
    assert!(!t.contains("panicked"), "{t}");
}

#[test]
fn malformed_or_missing_environment() {
    let cases: &[(&[(&str, &str)], &str)] = &[
        (&[], "no rank found"),
        (&[("RANK", "zero"), ("WORLD_SIZE", "2")], "RANK=\"zero\""),
        (&[("RANK", "2"), ("WORLD_SIZE", "2")], "not below"),
        (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1234"), ("GRADWIRE_JOB_SECRET", "0123456789")], "MASTER_ADDR"),
        (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "70000"), ("GRADWIRE_JOB_SECRET", "0123456789")], "MASTER_PORT"),
        (&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1234")], "GRADWIRE_JOB_SECRET"),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_TIMEOUT_MS", "soon")], "GRADWIRE_TIMEOUT_MS"),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_TIMEOUT_MS", "18446744073709551615")],
            "GRADWIRE_TIMEOUT_MS=18446744073709551615: must be between 1 and",
        ),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_TIMEOUT_MS", "0")], "GRADWIRE_TIMEOUT_MS=0: must be between 1 and"),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_SPIN_US", "18446744073709551615")], "GRADWIRE_SPIN_US=18446744073709551615: must be at most"),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_TRANSPORT", "carrier-pigeon")], "GRADWIRE_TRANSPORT"),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_SHM_RING_BYTES", "1000")], "GRADWIRE_SHM_RING_BYTES"),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_RING_CHUNK_BYTES", "8")], "GRADWIRE_RING_CHUNK_BYTES"),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_SHM_STORES", "fast")], "GRADWIRE_SHM_STORES: unknown store kind \"fast\""),
        (&[("RANK", "0"), ("WORLD_SIZE", "1"), ("GRADWIRE_SHM_CMA", "maybe")], "GRADWIRE_SHM_CMA=\"maybe\": expected 0 or 1"),
        (&[("RANK", "1"), ("WORLD_SIZE", "2"), ("OMPI_COMM_WORLD_RANK", "0")], "contradicts"),
    ];
    for (env, expect) in cases {
        let mut cmd = Command::new(bin());
        cmd.args(["check", "--counts", "1"]);
        for k in [
            "RANK",
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "GRADWIRE_JOB_SECRET",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "PMI_RANK",
            "PMI_SIZE",
        ] {
            cmd.env_remove(k);
        }
        for (k, v) in env.iter() {
            cmd.env(k, v);
        }
        let out = run_with_limit(cmd, Duration::from_secs(30));
        let t = text(&out);
        assert!(!out.status.success(), "{env:?} should fail:\n{t}");
        assert!(t.contains(expect), "{env:?}: expected {expect:?} in:\n{t}");
        assert!(!t.contains("panicked"), "{env:?}:\n{t}");
    }
}

#[test]
fn launcher_names_the_failed_rank_and_cleans_up() {
    // Rank 2 exits with status 3 at once; the launcher must stop the others and say so.
    let script = "if [ \"$RANK\" = 2 ]; then exit 3; fi; exec sleep 30";
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", "3", "--", "sh", "-c", script]);
    let start = Instant::now();
    let out = run_with_limit(cmd, Duration::from_secs(60));
    let t = text(&out);
    assert_eq!(out.status.code(), Some(3), "{t}");
    assert!(t.contains("rank 2 failed (exit status 3)"), "{t}");
    assert!(start.elapsed() < Duration::from_secs(25), "launcher waited for the sleepers");
    if can_netns("launcher netns cleanup") {
        let mut cmd = Command::new(bin());
        cmd.args(["launch", "-n", "2", "--netns", "--", "sh", "-c", "exit 5"]);
        let out = run_with_limit(cmd, Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(5), "{}", text(&out));
        let ns = Command::new("ip").args(["netns", "list"]).output().unwrap();
        let pid_marker = "gw";
        let left: Vec<String> = String::from_utf8_lossy(&ns.stdout).lines().filter(|l| l.starts_with(pid_marker)).map(String::from).collect();
        // Other tests may run namespaced jobs concurrently: only ours must be gone, and ours
        // are named after the launcher's pid, which has exited — so none of these may be
        // ours unless cleanup failed. We check the launcher printed no cleanup error.
        assert!(!text(&out).contains("cleanup"), "cleanup failed: {} (namespaces now: {left:?})", text(&out));

        // A launcher killed with SIGKILL leaves its namespaces behind, named after its pid; a
        // later launcher given the same pid (`exec` keeps the shell's) removes them and runs.
        let script = format!("ip netns add gw$$n0 && ip link add gwb$$ type bridge && exec {} launch -n 2 --netns -- sh -c 'exit 6'", bin());
        let mut cmd = Command::new("sh");
        cmd.args(["-c", &script]);
        let out = run_with_limit(cmd, Duration::from_secs(60));
        assert_eq!(out.status.code(), Some(6), "a launcher stopped at the names a killed one left: {}", text(&out));
        assert!(!text(&out).contains("cleanup"), "{}", text(&out));
    }
}
