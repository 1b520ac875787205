//! Token ring and parameter-server shards on real processes over shm, tcp and across
//! network namespaces: conservation with randomised worker speeds and integer-valued
//! gradients (exact), token uniqueness at every take, no torn pulls, and the faults: a
//! killed token holder and a killed server shard are reported, naming the rank.

mod common;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

fn ring(n: usize, launch_args: &[&str], extra: &[&str], env: &[(&str, &str)]) -> String {
    let mut args = vec!["check", "--token-ring", "300"];
    args.extend_from_slice(extra);
    let out = launch(n, launch_args, &args, env);
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{t}");
    assert!(t.contains("conservation exact") && t.contains(" 0 torn pulls") && t.contains("1 passed, 0 failed"), "{t}");
    t
}

#[test]
fn dynamic_delay_shm() {
    ring(4, &[], &[], &[("GRADWIRE_TRANSPORT", "shm")]);
}

#[test]
fn dynamic_delay_tcp() {
    ring(4, &[], &[], &[("GRADWIRE_TRANSPORT", "tcp")]);
}

#[test]
fn fixed_cyclic_shm_and_tcp() {
    ring(3, &[], &["--cyclic"], &[("GRADWIRE_TRANSPORT", "shm")]);
    ring(3, &[], &["--cyclic"], &[("GRADWIRE_TRANSPORT", "tcp")]);
}

#[test]
fn across_namespaces() {
    if can_netns("token_ring across_namespaces") {
        ring(3, &["--netns"], &[], &[]);
        ring(4, &["--netns", "--ranks-per-node", "2"], &["--cyclic"], &[]);
    }
}

/// Rank `victim` SIGKILLs itself holding the token; every survivor must fail within the
/// 2 s deadline (plus start-up) naming it.
fn killed(transport: &str, victim: usize, cyclic: bool) {
    let kill = format!("{victim}:20");
    let mut args = vec!["check", "--token-ring", "1000", "--kill", &kill];
    if cyclic {
        args.push("--cyclic");
    }
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", "4", "--", bin()]).args(&args).env("GRADWIRE_TIMEOUT_MS", "2000").env("GRADWIRE_TRANSPORT", transport);
    let start = Instant::now();
    let out = run_with_limit(cmd, Duration::from_secs(60));
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success(), "{t}");
    assert!(t.contains(&format!("rank {victim} failed (killed by signal 9)")), "{t}");
    for r in (0..4).filter(|&r| r != victim) {
        let line = t.lines().find(|l| l.starts_with(&format!("rank {r}: gradwire check:"))).unwrap_or_else(|| panic!("rank {r} reported nothing:\n{t}"));
        assert!(line.contains(&format!("rank {victim}")), "rank {r} does not name rank {victim}: {line}");
    }
    assert!(!t.contains("panicked"), "{t}");
    assert!(start.elapsed() < Duration::from_secs(20), "{:?}", start.elapsed());
}

#[test]
fn killed_token_holder_is_named() {
    killed("shm", 1, true);
    killed("tcp", 2, true);
}

#[test]
fn killed_server_shard_is_named_by_every_worker() {
    // Shards live on ranks 0 and 3; rank 3 dies.
    killed("shm", 3, false);
    killed("tcp", 3, false);
}

#[test]
fn benches_run_and_check() {
    for t in ["shm", "tcp"] {
        let out = launch(2, &[], &["bench", "ps", "-b", "4K", "-e", "64K", "-f", "4", "-n", "5", "--transport", t], &[]);
        let txt = text(&out);
        assert!(out.status.success() && txt.contains("push GB/s") && txt.lines().filter(|l| l.trim_start().starts_with("65536")).count() == 1, "{txt}");
        let out = launch(3, &[], &["bench", "token-ring", "-n", "2", "--check", "--transport", t], &[]);
        let txt = text(&out);
        assert!(out.status.success() && txt.contains("token round time") && txt.contains("conservation exact"), "{txt}");
    }
}
