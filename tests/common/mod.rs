//! Helpers for tests that start real gradwire processes.
#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_gradwire")
}

/// Runs a command to completion, killing it after `limit` (a hung test fails, never hangs).
pub fn run_with_limit(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    wait_with_limit(child, limit)
}

pub fn wait_with_limit(mut child: Child, limit: Duration) -> Output {
    let start = Instant::now();
    loop {
        if let Ok(Some(_)) = child.try_wait() {
            return child.wait_with_output().expect("collect output");
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!("command exceeded {limit:?}\nstdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `gradwire launch -n N [extra launch args] -- gradwire ARGS`.
pub fn launch(n: usize, launch_args: &[&str], args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin());
    cmd.arg("launch").arg("-n").arg(n.to_string()).args(launch_args).arg("--").arg(bin()).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    run_with_limit(cmd, Duration::from_secs(300))
}

pub fn text(o: &Output) -> String {
    format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
}

/// Root with `ip netns` available; otherwise prints why the test is skipped.
pub fn can_netns(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc_geteuid() } == 0;
    let ip = Command::new("ip").arg("netns").arg("list").output().map(|o| o.status.success()).unwrap_or(false);
    if !(root && ip) {
        eprintln!("SKIP {test}: needs root and iproute2 for network namespaces (root={root}, ip netns works={ip})");
    }
    root && ip
}

extern "C" {
    #[link_name = "geteuid"]
    fn libc_geteuid() -> u32;
}

/// Environment for one rank started directly (without the launcher).
pub fn rank_env(cmd: &mut Command, rank: usize, world: usize, port: u16, secret: &str) {
    cmd.env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("GRADWIRE_JOB_SECRET", secret);
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The folder holding an up-to-date `libgradwire.so` (the cdylib). `cargo nextest` builds
/// the library only as an rlib for the tests, so the tests that link the shared library
/// (C example, Python) build it here — a no-op when it is fresh.
pub fn cdylib_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::path::Path::new(bin()).parent().expect("target dir").to_path_buf();
        let mut cmd = Command::new(option_env!("CARGO").unwrap_or("cargo"));
        cmd.args(["build", "--lib", "--manifest-path", concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")]);
        if dir.ends_with("release") {
            cmd.arg("--release");
        }
        let out = cmd.output().expect("run cargo build --lib");
        assert!(out.status.success(), "cargo build --lib failed:\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(dir.join("libgradwire.so").exists(), "no libgradwire.so in {}", dir.display());
        dir
    })
    .clone()
}
