//! gradwire builds with cargo alone and starts on hosts without rdma-core: libibverbs is
//! opened at run time, and where it is missing the verbs transport says why while shm and
//! tcp work as before.

mod common;
use common::*;
use std::process::Command;

/// Libraries of rdma-core (and libnl, which libibverbs links) that must never be NEEDED.
const RDMA_CORE: [&str; 6] = ["libibverbs", "librdmacm", "libnl", "libmlx", "librxe", "libefa"];

fn needed(path: &std::path::Path) -> Vec<String> {
    let out = Command::new("readelf").arg("-d").arg(path).output().unwrap_or_else(|e| panic!("readelf (binutils) is needed for this test: {e}"));
    assert!(out.status.success(), "readelf -d {}: {}", path.display(), text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| l.split('[').nth(1).map(|s| s.trim_end_matches(']').to_string()))
        .collect()
}

#[test]
fn binary_and_library_need_no_rdma_core() {
    let lib = cdylib_dir().join("libgradwire.so");
    for file in [std::path::PathBuf::from(bin()), lib] {
        let libs = needed(&file);
        assert!(libs.iter().any(|l| l.starts_with("libc.so")), "{}: readelf found no NEEDED entries at all: {libs:?}", file.display());
        let bad: Vec<&String> = libs.iter().filter(|l| RDMA_CORE.iter().any(|r| l.starts_with(r))).collect();
        assert!(bad.is_empty(), "{} needs {bad:?} at load time (all NEEDED: {libs:?})", file.display());
    }
}

#[test]
fn no_build_dependency_runs_cmake_or_bindgen() {
    // The normal and build edges of the dependency graph: what `cargo build` compiles and runs.
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "--edges", "normal,build", "--prefix", "none", "--format", "{p}"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree");
    assert!(out.status.success(), "cargo tree failed: {}", text(&out));
    let tree = String::from_utf8_lossy(&out.stdout);
    assert!(tree.contains("libloading"), "unexpected cargo tree output:\n{tree}");
    let bad: Vec<&str> = tree.lines().filter(|l| ["cmake ", "bindgen ", "ibverbs", "cc ", "pkg-config "].iter().any(|c| l.starts_with(c))).collect();
    assert!(bad.is_empty(), "the default build compiles C or needs rdma-core: {bad:?}");
}

const MISSING: &str = "/nonexistent/libibverbs.so.1";

fn info_without_libibverbs() -> String {
    let out = Command::new(bin()).arg("info").env("GRADWIRE_IBVERBS_LIB", MISSING).output().unwrap();
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    t
}

#[test]
fn missing_libibverbs_is_explained_and_shm_tcp_still_work() {
    let t = info_without_libibverbs();
    let line = t.lines().find(|l| l.trim_start().starts_with("verbs")).unwrap_or_else(|| panic!("no verbs line in info:\n{t}"));
    assert!(line.contains("unavailable") && line.contains(&format!("GRADWIRE_IBVERBS_LIB={MISSING} not found")), "{line}");
    assert!(line.contains("install rdma-core's libibverbs1 and a provider package"), "{line}");
    assert!(t.contains("shm              available") && t.contains("tcp              available"), "{t}");

    // GRADWIRE_TRANSPORT=verbs: every rank fails with the reason, none hangs.
    let env = [("GRADWIRE_IBVERBS_LIB", MISSING), ("GRADWIRE_TIMEOUT_MS", "20000")];
    let out = launch(2, &[], &["check", "--collectives", "allreduce", "--counts", "7"], &[("GRADWIRE_TRANSPORT", "verbs"), env[0], env[1]]);
    let t = text(&out);
    assert!(!out.status.success(), "verbs without libibverbs succeeded:\n{t}");
    assert!(t.contains(&format!("GRADWIRE_IBVERBS_LIB={MISSING} not found")) && t.contains("libibverbs1"), "{t}");
    assert!(!t.contains("panicked"), "{t}");

    // The same 4 ranks on one host: shm, checked against the reference.
    let out = launch(4, &[], &["check", "--collectives", "allreduce", "--counts", "1,1003,65536", "--dtypes", "float32,bfloat16"], &env);
    let t = text(&out);
    assert!(out.status.success() && !t.contains("panicked"), "4-rank shm allreduce without libibverbs:\n{t}");
    assert!(t.contains(r#"links ["shm"]"#) && t.contains(" 0 failed"), "{t}");
}

#[test]
fn auto_falls_back_to_tcp_between_nodes_and_says_why() {
    if !can_netns("auto_falls_back_to_tcp_between_nodes_and_says_why") {
        return;
    }
    // Two "nodes" of two ranks: shm inside each, and between them `auto` would take verbs
    // but must log why it cannot and use tcp. The matrix checks every result.
    let env = [("GRADWIRE_IBVERBS_LIB", MISSING), ("GRADWIRE_LOG", "info"), ("GRADWIRE_TIMEOUT_MS", "20000")];
    let out = launch(
        4,
        &["--netns", "--ranks-per-node", "2"],
        &["check", "--collectives", "allreduce", "--counts", "1,1003,65536", "--dtypes", "float32,bfloat16"],
        &env,
    );
    let t = text(&out);
    assert!(out.status.success() && !t.contains("panicked"), "{t}");
    assert!(t.contains(" 0 failed"), "{t}");
    assert!(t.contains(r#""tcp""#) && t.contains(r#""shm""#), "links are not shm inside and tcp between nodes:\n{t}");
    for rank in 0..4 {
        let want = format!("rank {rank}: no verbs between hosts (unsupported: GRADWIRE_IBVERBS_LIB={MISSING} not found");
        assert!(t.contains(&want), "rank {rank} did not log the auto choice's reason:\n{t}");
    }
}
