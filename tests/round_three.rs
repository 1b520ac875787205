//! Issue 59, round three of faults and bad input, from a C host (tests/c/round_three.c):
//! a hierarchical allreduce with mismatched counts, a peer lost over tcp with SIGPIPE at its
//! default disposition, and array counts whose bytes overflow.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn program() -> std::path::PathBuf {
    c_program("tests/c/round_three.c", "round-three-c")
}

/// Counts that differ by one element (the sharded form pads both to the same shard size, so
/// no step's header differs): every rank must fail with a mismatch naming both calls.
#[test]
fn hierarchical_count_mismatch_fails_on_every_rank() {
    let exe = program();
    for (n0, n) in [(65536, 65535), (1000, 999)] {
        let mut cmd = Command::new(bin());
        cmd.args(["launch", "-n", "4", "--"]).arg(&exe).args(["hier-mismatch", &n0.to_string(), &n.to_string()]).env("GRADWIRE_TIMEOUT_MS", "30000");
        let out = run_with_limit(cmd, Duration::from_secs(120));
        let t = text(&out);
        println!("{t}");
        assert!(out.status.success(), "{n0} against {n}:\n{t}");
        for r in 0..4 {
            let line = t.lines().find(|l| l.starts_with(&format!("rank {r}: mismatch:"))).unwrap_or_else(|| panic!("rank {r} reported no mismatch:\n{t}"));
            for c in [n0, n] {
                assert!(line.contains(&format!("count {c}")), "rank {r} does not name count {c}: {line}");
            }
        }
    }
}
