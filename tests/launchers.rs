//! Ranks started by a cluster's own launcher find each other with no gradwire variable.
//! Hydra's `mpiexec` (MPICH's launcher, from `pip install mpich`) across network-namespace
//! nodes: gradwire's communicator forms through Hydra's PMI server (`bootstrap::pmi`), for
//! the C ABI's `gradwire bench` and for Python's `gradwire.Comm()`.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn has_mpiexec() -> bool {
    Command::new("mpiexec").arg("--version").output().map(|o| o.status.success()).unwrap_or(false)
}

/// `gradwire launch --netns` only makes the nodes; tests/launchers/hydra_netns.sh drops
/// everything it exports and runs `mpiexec` with 2 ranks on each node's address.
fn under_hydra(nodes: usize, per_node: usize, program: &[&str]) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", &nodes.to_string(), "--netns", "--bind", "none", "--timeout", "300", "--"])
        .arg(format!("{root}/tests/launchers/hydra_netns.sh"))
        .arg(per_node.to_string())
        .args(program)
        .env("PYTHONPATH", format!("{root}/python"))
        .env("GRADWIRE_LIB", cdylib_dir().join("libgradwire.so"));
    let out = run_with_limit(cmd, Duration::from_secs(400));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "the job under mpiexec failed:\n{t}");
    t
}

#[test]
fn hydra_mpiexec_across_nodes_needs_no_gradwire_variable() {
    if !can_netns("hydra_mpiexec_across_nodes_needs_no_gradwire_variable") {
        return;
    }
    if !has_mpiexec() {
        eprintln!("SKIP hydra_mpiexec_across_nodes_needs_no_gradwire_variable: no mpiexec (pip install mpich)");
        return;
    }
    // The C ABI's communicator (gradwire_comm_init), checked against a reference.
    let t = under_hydra(2, 2, &[bin(), "bench", "allreduce", "--check", "-b", "4K", "-e", "1M", "-n", "3"]);
    assert!(t.contains("1048576"), "no 1 MiB row:\n{t}");
    // Python's Comm(): 4 ranks, gradwire's nodes the namespaces Hydra placed them in.
    let t = under_hydra(2, 2, &["python3", &format!("{}/python/tests/launcher_comm.py", env!("CARGO_MANIFEST_DIR")), "--per-node", "2"]);
    for r in 0..4 {
        assert!(t.contains(&format!("launcher comm: ok (rank {r} of 4)")), "rank {r} did not finish:\n{t}");
    }
}
