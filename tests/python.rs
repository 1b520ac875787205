//! The Python package (ctypes over the cdylib) under `gradwire launch`: NumPy buffers on
//! every collective, and — when torch is importable — PyTorch DDP with gradwire's comm hook
//! against the gloo backend's own allreduce.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn python_has(module: &str) -> bool {
    Command::new("python3").args(["-c", &format!("import {module}")]).output().map(|o| o.status.success()).unwrap_or(false)
}

fn run_py(n: usize, script: &str, env: &[(&str, &str)]) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let lib = cdylib_dir().join("libgradwire.so");
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", &n.to_string(), "--", "python3", &format!("{root}/python/tests/{script}")])
        .env("PYTHONPATH", format!("{root}/python"))
        .env("GRADWIRE_LIB", lib)
        .env("GLOO_SOCKET_IFNAME", "lo")
        .env("OMP_NUM_THREADS", "1");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run_with_limit(cmd, Duration::from_secs(300));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{script} with {n} ranks failed:\n{t}");
    t
}

#[test]
fn numpy_buffers() {
    if !python_has("numpy") {
        eprintln!("SKIP numpy_buffers: numpy is not importable (pip install numpy; .ci/run does)");
        return;
    }
    let t = run_py(4, "numpy_collectives.py", &[]);
    assert_eq!(t.matches(" failed").count(), 4, "{t}");
    assert!(!t.contains("FAIL"), "{t}");
    run_py(3, "numpy_collectives.py", &[("GRADWIRE_TRANSPORT", "tcp")]);
}

/// Every integer that crosses ctypes is range-checked in Python: out of range is a
/// ValueError, not a silently wrapped value (`broadcast(root=2**40)` used to broadcast from
/// root 0, `split(2**31)` to return None).
#[test]
fn integers_crossing_ctypes_are_range_checked() {
    if !python_has("numpy") {
        eprintln!("SKIP integers_crossing_ctypes_are_range_checked: numpy is not importable (pip install numpy; .ci/run does)");
        return;
    }
    let t = run_py(3, "bad_input.py", &[]);
    assert_eq!(t.matches("bad input: 30 passed, 0 failed").count(), 3, "{t}");
}

#[test]
fn torch_ddp_hook_matches_gloo() {
    if !python_has("torch") {
        eprintln!("SKIP torch_ddp_hook_matches_gloo: torch is not importable (about 1.9 GB; see benches/peers/install_torch.py)");
        return;
    }
    for n in [2, 4] {
        let t = run_py(n, "ddp_vs_gloo.py", &[]);
        assert_eq!(t.matches("ddp hook vs gloo: 1 passed, 0 failed").count(), n, "{t}");
    }
}
