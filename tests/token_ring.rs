//! Token ring and parameter-server shards on real processes over shm, tcp and across
//! network namespaces: conservation with randomised worker speeds and integer-valued
//! gradients (exact), token uniqueness at every take, no torn pulls, and the faults: a
//! killed token holder and a killed server shard are reported, naming the rank.

mod common;
use common::*;

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

#[test]
fn killed_token_holder_is_named() {
    killed_in_token_ring("shm", 1, true, &LOCAL);
    killed_in_token_ring("tcp", 2, true, &LOCAL);
}

#[test]
fn killed_server_shard_is_named_by_every_worker() {
    // Shards live on ranks 0 and 3; rank 3 dies.
    killed_in_token_ring("shm", 3, false, &LOCAL);
    killed_in_token_ring("tcp", 3, false, &LOCAL);
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
