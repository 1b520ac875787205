//! Hierarchical allreduce (node-local shm + cross-node tcp) across network namespaces, the
//! non-blocking cross-node allreduce overlapping node-local work, and the fault tests of
//! the foundation on this path. Needs root for namespaces; otherwise skips with a reason
//! (the one-host variants still run).

mod common;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

fn check(n: usize, launch: &[&str], args: &[&str], env: &[(&str, &str)]) -> String {
    let out = common::launch(n, launch, args, env);
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{args:?} with {n} ranks {launch:?}:\n{t}");
    assert!(t.contains(" 0 failed"), "{t}");
    assert!(!t.contains("panicked"), "{t}");
    t
}

#[test]
fn every_dtype_and_op_two_nodes_of_two() {
    if can_netns("every_dtype_and_op_two_nodes_of_two") {
        check(4, &["--netns", "--ranks-per-node", "2"], &["check", "--hierarchical"], &[]);
    }
}

#[test]
fn three_nodes_of_two_with_16mib() {
    if can_netns("three_nodes_of_two_with_16mib") {
        check(
            6,
            &["--netns", "--ranks-per-node", "2"],
            &["check", "--hierarchical", "--counts", "1,7919", "--large", "16M", "--dtypes", "float32,bfloat16"],
            &[],
        );
    }
}

#[test]
fn one_host_degenerates_to_node_local() {
    check(3, &[], &["check", "--hierarchical", "--counts", "0,1,7919", "--dtypes", "float32,float16"], &[]);
}

#[test]
fn cross_node_iallreduce_overlaps_node_local_allreduce() {
    // A deadlock between the two groups would hit the 5 s deadline and fail the run.
    let env = [("GRADWIRE_TIMEOUT_MS", "5000")];
    if can_netns("cross_node_iallreduce_overlaps_node_local_allreduce") {
        check(6, &["--netns", "--ranks-per-node", "2"], &["check", "--overlap", "300"], &env);
    }
    check(4, &[], &["check", "--overlap", "300"], &env);
}

#[test]
fn killed_rank_is_named_by_every_survivor() {
    if !can_netns("killed_rank_is_named_by_every_survivor") {
        return;
    }
    // Rank 3 (node 1, local rank 1) is SIGKILLed while everyone loops over hierarchical
    // allreduces; survivors must name global rank 3, within the 2 s deadline.
    let script =
        format!("if [ \"$RANK\" = 3 ]; then (sleep 2; kill -9 $$) & fi; exec {} bench allreduce --hierarchical sharded -b 1M -e 1M -n 1000000 -w 1", bin());
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", "4", "--netns", "--ranks-per-node", "2", "--", "sh", "-c", &script]).env("GRADWIRE_TIMEOUT_MS", "2000");
    let start = Instant::now();
    let out = run_with_limit(cmd, Duration::from_secs(60));
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("rank 3 failed (killed by signal 9)"), "{t}");
    for r in [0, 1, 2] {
        let line = t.lines().find(|l| l.starts_with(&format!("rank {r}: gradwire bench:"))).unwrap_or_else(|| panic!("rank {r} reported nothing:\n{t}"));
        assert!(line.contains("rank 3"), "rank {r} does not name rank 3: {line}");
    }
    assert!(!t.contains("panicked"), "{t}");
    // 2 s to die, 2 s deadline, namespace setup and teardown: well under 20 s unless a
    // survivor waited for the launcher's grace period instead of failing on its own.
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
}

#[test]
fn mismatched_count_is_reported() {
    if !can_netns("mismatched_count_is_reported") {
        return;
    }
    let script = format!("if [ \"$RANK\" = 2 ]; then B=8K; else B=4K; fi; exec {} bench allreduce --hierarchical sharded -b $B -e $B -n 3 -w 1", bin());
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", "4", "--netns", "--ranks-per-node", "2", "--", "sh", "-c", &script]).env("GRADWIRE_TIMEOUT_MS", "30000");
    let start = Instant::now();
    let out = run_with_limit(cmd, Duration::from_secs(60));
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success(), "{t}");
    assert!(t.contains("mismatch") && t.contains("rank 2"), "{t}");
    assert!(start.elapsed() < Duration::from_secs(20), "waited for the deadline: {:?}", start.elapsed());
}
