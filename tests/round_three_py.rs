//! Issue 59 ("fault and bad input, round three") at the Python boundary: the torch
//! backend's C++ build cache.

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn python_has(module: &str) -> bool {
    Command::new("python3").args(["-c", &format!("import {module}")]).output().map(|o| o.status.success()).unwrap_or(false)
}

/// A library planted where the torch backend looks for its C++ build never loads: not in
/// the predictable temporary path a relative XDG_CACHE_HOME (or no home at all) led to,
/// not one owned by another user in the user's own cache, not from a cache folder others
/// can write, and not the user's own file swapped in after the build (its SHA-256 differs
/// from the one recorded then). Each time init_process_group fails with an error that says
/// why (python/tests/round_three_cache.py).
#[test]
fn torch_build_cache_loads_only_the_users_own_build() {
    if !python_has("torch") {
        skip("torch_build_cache_loads_only_the_users_own_build", "torch is not importable");
        return;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("torch_build_cache_loads_only_the_users_own_build", "planting files as another user (nobody) needs root");
        return;
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let mut cmd = Command::new("python3");
    cmd.arg(format!("{root}/python/tests/round_three_cache.py"))
        .env("PYTHONPATH", format!("{root}/python"))
        .env("GRADWIRE_LIB", cdylib_dir().join("libgradwire.so"))
        .env("OMP_NUM_THREADS", "1");
    let out = run_with_limit(cmd, Duration::from_secs(900));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{t}");
    for case in ["fallback", "no-home", "open", "swapped"] {
        assert!(t.contains(&format!("cache: ok {case} (")), "case {case}:\n{t}");
    }
}
