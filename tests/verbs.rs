//! The verbs transport on a real RDMA device.
//!
//! `device_*` tests need an ACTIVE RDMA port. Where this host has one (natively, or because
//! this binary runs inside the rxe VM) they run for real; elsewhere they print why they
//! skip. The `rxe_vm_*` tests are the host side: on a host without RDMA they boot the
//! project's soft-RoCE guest (tests/rxe/run-in-vm.sh) and run this very binary's `device_*`
//! tests inside it, one guest with several ranks and two guests as two nodes.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// An ACTIVE RDMA port on this host, e.g. "rxe0/1".
fn active_port() -> Option<String> {
    for dev in std::fs::read_dir("/sys/class/infiniband").ok()?.flatten() {
        for port in std::fs::read_dir(dev.path().join("ports")).ok()?.flatten() {
            let state = std::fs::read_to_string(port.path().join("state")).unwrap_or_default();
            if state.contains("ACTIVE") {
                return Some(format!("{}/{}", dev.file_name().to_string_lossy(), port.file_name().to_string_lossy()));
            }
        }
    }
    None
}

fn device_or_skip(test: &str) -> bool {
    if active_port().is_some() {
        return true;
    }
    println!("skipped {test}: no ACTIVE RDMA port on this host (the rxe_vm_* tests run it inside the soft-RoCE VM)");
    false
}

/// Faults inside a TCG guest: everything is several times slower than on the host.
const VM: FaultTiming = FaultTiming { settle: Duration::from_secs(6), deadline_ms: 5000, report_within: Duration::from_secs(20) };

fn ok(out: &std::process::Output, what: &str) -> String {
    let t = text(out);
    assert!(out.status.success(), "{what} failed:\n{t}");
    assert!(!t.contains("panicked"), "{t}");
    t
}

#[test]
fn device_every_collective_dtype_op_at_2_and_4_ranks() {
    if !device_or_skip("device_every_collective_dtype_op_at_2_and_4_ranks") {
        return;
    }
    for n in [2, 4] {
        let large: &[&str] = if n == 2 { &["--large", "8M"] } else { &[] };
        let args: Vec<&str> = ["check", "--transport", "verbs"].iter().chain(large).copied().collect();
        let t = ok(&launch(n, &[], &args, &[]), &format!("{n}-rank verbs matrix"));
        println!("{t}");
        assert!(t.contains(r#"links ["verbs"]"#), "not over verbs:\n{t}");
        assert!(t.contains(" 0 failed"), "{t}");
    }
}

#[test]
fn device_sub_communicators_and_windows() {
    if !device_or_skip("device_sub_communicators_and_windows") {
        return;
    }
    let split = ["check", "--transport", "verbs", "--split", "--dtypes", "float32,bfloat16", "--counts", "1,1003"];
    let t = ok(&launch(4, &[], &split, &[]), "split over verbs");
    assert!(t.contains(" 0 failed"), "{t}");
    // The token ring and parameter-server shards: RDMA fetch-add, write and read.
    let t = ok(&launch(3, &[], &["check", "--transport", "verbs", "--token-ring", "30"], &[]), "token ring over verbs");
    println!("{t}");
    assert!(t.contains("conservation exact"), "{t}");
}

#[test]
fn device_killed_rank_is_named() {
    if !device_or_skip("device_killed_rank_is_named") {
        return;
    }
    killed_rank(3, 1, "verbs", "4M", &VM);
    killed_rank(3, 0, "verbs", "4K", &VM);
}

#[test]
fn device_killed_token_holder_and_server_shard_are_named() {
    if !device_or_skip("device_killed_token_holder_and_server_shard_are_named") {
        return;
    }
    killed_in_token_ring("verbs", 1, true, &VM);
    killed_in_token_ring("verbs", 3, false, &VM);
}

#[test]
fn device_mismatched_calls_fail_on_every_rank() {
    if !device_or_skip("device_mismatched_calls_fail_on_every_rank") {
        return;
    }
    let base = ["bench", "allreduce", "-b", "4K", "-e", "4K", "-n", "3", "-w", "1"];
    mismatch("verbs", &base, &["bench", "allreduce", "-b", "8K", "-e", "8K", "-n", "3", "-w", "1"], &["count 1024", "count 2048"]);
    mismatch("verbs", &base, &["bench", "broadcast", "-b", "4K", "-e", "4K", "-n", "3", "-w", "1"], &["allreduce#0", "broadcast#0"]);
}

/// A 64 KiB ring sends every payload of 32 KiB or more by rendezvous; a 1 MiB zone grants
/// anything larger piece by piece: every collective and algorithm, larger counts and an 8
/// MiB run go that way. With no zone (`GRADWIRE_IB_ZONE_BYTES=0`) every receiver refuses
/// and those payloads fall back to the ring. Which path a payload takes depends on its
/// size alone, so elements of each size (1, 2, 4 and 8 bytes) and two operations stand for
/// the whole dtype and op matrix, which `device_every_collective_dtype_op_at_2_and_4_ranks`
/// runs over the same transport.
#[test]
fn device_rendezvous_with_a_small_ring() {
    if !device_or_skip("device_rendezvous_with_a_small_ring") {
        return;
    }
    let small_ring = [("GRADWIRE_IB_RING_BYTES", "65536"), ("GRADWIRE_IB_ZONE_BYTES", "1048576")];
    let no_zone = [("GRADWIRE_IB_RING_BYTES", "65536"), ("GRADWIRE_IB_ZONE_BYTES", "0")];
    // Ring chunks of about 33 KB around the 32 KiB rendezvous threshold: a pipelined ring
    // whose chunks take both paths, one after the other, on the same link.
    let mixed_chunks = [("GRADWIRE_IB_RING_BYTES", "65536"), ("GRADWIRE_IB_ZONE_BYTES", "1048576"), ("GRADWIRE_RING_CHUNK_BYTES", "33000")];
    for (n, env) in [(2, &small_ring[..]), (4, &small_ring[..]), (2, &no_zone[..]), (4, &mixed_chunks[..])] {
        let large: &[&str] = if n == 2 { &["--large", "8M"] } else { &[] };
        let matrix = ["check", "--transport", "verbs", "--counts", "0,1,7919,100003", "--dtypes", "int8,bfloat16,float32,float64", "--ops", "sum,max"];
        let args: Vec<&str> = matrix.iter().chain(large).copied().collect();
        let t = ok(&launch(n, &[], &args, env), &format!("{n}-rank verbs matrix with {env:?}"));
        println!("{t}");
        assert!(t.contains(r#"links ["verbs"]"#) && t.contains(" 0 failed"), "{t}");
    }
    // Mismatched sizes where both payloads go by rendezvous, and where only one side's does.
    let bench = |bytes: &'static str| ["bench", "allreduce", "-b", bytes, "-e", bytes, "-n", "3", "-w", "1"];
    mismatch_with_env("verbs", &small_ring, &bench("1M"), &bench("2M"), &["count 262144", "count 524288"]);
    mismatch_with_env("verbs", &small_ring, &bench("96K"), &bench("48K"), &["count 24576", "count 12288"]);
}

#[test]
fn device_info_explains_the_gid_choice_and_a_wrong_gid_is_refused() {
    if !device_or_skip("device_info_explains_the_gid_choice_and_a_wrong_gid_is_refused") {
        return;
    }
    let out = Command::new(bin()).arg("info").output().unwrap();
    let t = ok(&out, "gradwire info");
    println!("{t}");
    let choice = t.lines().find(|l| l.contains("verbs choice")).unwrap_or_else(|| panic!("no verbs choice in:\n{t}"));
    assert!(choice.contains("::ffff:") && choice.contains("IPv4-mapped"), "did not pick the IPv4-mapped GID: {choice}");
    assert!(t.contains("gid[0]") && t.contains("RoCE v2") && t.contains("MTU"), "{t}");
    // A GID index the port does not have: every rank says which variable and which GIDs exist.
    let out = launch(2, &[], &["check", "--transport", "verbs", "--counts", "1"], &[("GRADWIRE_GID_INDEX", "9")]);
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success(), "a wrong GID index was accepted:\n{t}");
    assert!(t.contains("GRADWIRE_GID_INDEX=9") && t.contains("empty or out of range") && t.contains("::ffff:"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
}

/// Runs in each of two guests: one rank per guest, where `auto` must pick verbs between
/// them; then two ranks per guest, shared memory inside a guest and verbs between them.
/// There a rank's window is reached through the NIC by the other guest and mapped by its
/// neighbour, whose fetch-adds must then go through the NIC too (the one-sided check counts
/// every add; the token ring passes its token across both kinds of link).
#[test]
fn device_two_nodes() {
    if std::env::var("RXE_NODES").as_deref() != Ok("2") {
        println!("skipped device_two_nodes: needs the two-guest harness (rxe_vm_two_guests)");
        return;
    }
    let node: usize = std::env::var("RXE_NODE").unwrap().parse().unwrap();
    let rank_cmd = |rank: usize, world: usize, port: &str, args: &[&str]| {
        let mut cmd = Command::new(bin());
        cmd.args(args).env("GRADWIRE_RANK", rank.to_string()).env("GRADWIRE_WORLD_SIZE", world.to_string());
        cmd.env("GRADWIRE_MASTER_ADDR", "10.0.3.1").env("GRADWIRE_MASTER_PORT", port).env("GRADWIRE_JOB_SECRET", "two-guest-test-secret");
        cmd
    };
    let t = ok(&run_with_limit(rank_cmd(node, 2, "29500", &["check", "--counts", "1,7919,1003", "--large", "4M"]), Duration::from_secs(400)), "two-node check");
    println!("{t}");
    if node == 0 {
        assert!(t.contains(r#"2 host(s), links ["verbs"]"#) && t.contains(" 0 failed"), "{t}");
    }
    let two_per_node = |port: &str, args: &[&str], what: &str| -> Vec<String> {
        // Both ranks' pipes are drained at once: a rank blocked on a full pipe would stall its peer.
        let outputs: Vec<_> = std::thread::scope(|s| {
            let waits: Vec<_> = (0..2)
                .map(|i| {
                    let mut cmd = rank_cmd(2 * node + i, 4, port, args);
                    cmd.env("GRADWIRE_LOG", "debug");
                    s.spawn(move || run_with_limit(cmd, Duration::from_secs(400)))
                })
                .collect();
            waits.into_iter().map(|h| h.join().expect("a rank's waiter panicked")).collect()
        });
        outputs.iter().map(|out| ok(out, what)).collect()
    };
    let small = ["check", "--collectives", "allreduce,broadcast", "--counts", "1003", "--dtypes", "float32", "--ops", "sum"];
    let t = two_per_node("29501", &small, "check at two ranks per node");
    println!("{}", t.concat());
    if node == 0 {
        assert!(t[0].contains(r#"4 ranks on 2 host(s), links ["shm", "verbs"]"#) && t[0].contains(" 0 failed"), "{}", t[0]);
    }
    for (i, t) in t.iter().enumerate() {
        let (me, neighbour) = (2 * node + i, 2 * node + 1 - i);
        let (a, b) = (me.min(neighbour), me.max(neighbour));
        let line = format!("rank {me}: window 0: fetch-adds on the regions of ranks [{a}, {b}] (mapped here) go through the NIC");
        assert!(t.contains(&line), "rank {me} did not say that its atomics on mapped regions go through the NIC:\n{t}");
    }
    let t = two_per_node("29502", &["check", "--token-ring", "20"], "token ring at two ranks per node");
    println!("{}", t.concat());
    if node == 0 {
        assert!(t[0].contains("conservation exact"), "{}", t[0]);
    }
}

// ---------------------------------------------------------------- host side: the VM

fn harness() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/rxe/run-in-vm.sh")
}

/// Whether a VM test runs here: not on a host with an RDMA port (the device_* tests ran
/// natively there); where the harness cannot run, [`skip`] says why.
fn vm_runs(test: &str) -> bool {
    if active_port().is_some() {
        println!("skipped {test}: this host has an RDMA device; the device_* tests ran natively");
        return false;
    }
    let why = match Command::new(harness()).arg("--check").output() {
        Ok(o) if o.status.success() => return true,
        Ok(o) => text(&o).trim().to_string(),
        Err(e) => format!("cannot run {}: {e}", harness().display()),
    };
    skip(test, &why);
    false
}

/// Stripped copies of this test binary and of gradwire (a smaller guest payload).
fn payload() -> (PathBuf, PathBuf) {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rxe-payload");
    std::fs::create_dir_all(&dir).unwrap();
    let copy = |from: &Path, name: &str| {
        // Written under a name of this process's, then renamed over the payload: another VM
        // test copying the payload into its guest meanwhile keeps reading a whole file.
        let (to, partial) = (dir.join(name), dir.join(format!("{name}.{}", std::process::id())));
        let stripped = Command::new("strip").arg("-o").arg(&partial).arg(from).status().is_ok_and(|s| s.success());
        if !stripped {
            std::fs::copy(from, &partial).unwrap();
        }
        std::fs::rename(&partial, &to).unwrap();
        to
    };
    (copy(&std::env::current_exe().unwrap(), "verbs-tests"), copy(Path::new(bin()), "gradwire"))
}

fn in_vm(nodes: usize, filter: &[&str]) {
    let (tests, gradwire) = payload();
    let mut cmd = Command::new(harness());
    cmd.args(["--nodes", &nodes.to_string(), "-t", "1500", "-f"]).arg(&gradwire).args(["-e", "GRADWIRE_TEST_BIN=gradwire", "--"]).arg(&tests);
    cmd.args(filter).args(["--test-threads", "1", "--nocapture"]);
    let out = run_with_limit(cmd, Duration::from_secs(1600));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "tests inside the rxe VM failed (status {:?})", out.status.code());
    assert!(!t.contains("skipped device_"), "a device test skipped inside the VM:\n{t}");
    assert!(t.contains("test result: ok"), "{t}");
}

#[test]
fn rxe_vm_one_guest() {
    if !vm_runs("rxe_vm_one_guest") {
        return;
    }
    in_vm(1, &["device_", "--skip", "device_two_nodes"]);
}

#[test]
fn rxe_vm_two_guests() {
    if !vm_runs("rxe_vm_two_guests") {
        return;
    }
    in_vm(2, &["device_two_nodes", "--exact"]);
}

/// A guest that ends without its program's exit status must not leave its peer waiting out
/// the VM limit (a TCG guest once hung in its boot and was only killed after ~1000 s): the
/// harness stops the peer and says which node ended first.
#[test]
fn rxe_vm_a_guest_that_fails_to_start_stops_its_peer() {
    if !vm_runs("rxe_vm_a_guest_that_fails_to_start_stops_its_peer") {
        return;
    }
    let mut cmd = Command::new(harness());
    cmd.args(["--nodes", "2", "-t", "900", "--", "ibv_devinfo"]).env("GRADWIRE_RXE_FAIL_NODE", "1");
    // The image may still be built or downloaded first; the messages show the stop.
    let out = run_with_limit(cmd, Duration::from_secs(900));
    let t = text(&out);
    println!("{t}");
    assert_eq!(out.status.code(), Some(125), "a setup failure is status 125:\n{t}");
    assert!(t.contains("node1 ended without its program's exit status: stopping node0"), "{t}");
    assert!(t.contains("node0: stopped, its peer ended first"), "{t}");
    assert!(t.contains("node1: setup failed"), "{t}");
}
