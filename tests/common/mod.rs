//! Helpers for tests that start real gradwire processes.
#![allow(dead_code)]

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The gradwire executable under test; `GRADWIRE_TEST_BIN` points elsewhere when the test
/// binary runs where cargo's path does not exist (inside the rxe VM).
pub fn bin() -> &'static str {
    static BIN: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    BIN.get_or_init(|| std::env::var("GRADWIRE_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_gradwire").to_string()))
}

/// Runs a command to completion, killing it after `limit` (a hung test fails, never hangs).
pub fn run_with_limit(mut cmd: Command, limit: Duration) -> Output {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().expect("spawn");
    wait_with_limit(child, limit)
}

pub fn wait_with_limit(mut child: Child, limit: Duration) -> Output {
    // Both pipes are read while the child runs: one that writes more than a pipe holds
    // would otherwise block on us, and what it wrote before a kill would be lost.
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        if let Ok(Some(status)) = child.try_wait() {
            break status;
        }
        if start.elapsed() > limit {
            timed_out = true;
            // SIGTERM first, so a script's clean-up (the rxe harness stops its VMs) runs and
            // its children let go of our pipes; SIGKILL if it is still there 10 s later.
            // SAFETY: kill has no memory preconditions; the pid is our child, not yet reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let grace = Instant::now();
            while grace.elapsed() < Duration::from_secs(10) && matches!(child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            break child.wait().expect("wait for the killed child");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // The pipes close once everything the child started has gone too; a straggler that
    // still holds them after 5 s is not waited for.
    let collect = |(reader, bytes): Drained| {
        let until = Instant::now() + Duration::from_secs(5);
        while !reader.as_ref().is_none_or(|r| r.is_finished()) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(20));
        }
        std::mem::take(&mut *bytes.lock().unwrap())
    };
    let out = Output { status, stdout: collect(stdout), stderr: collect(stderr) };
    if timed_out {
        panic!("command exceeded {limit:?}\nstdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    out
}

type Drained = (Option<std::thread::JoinHandle<()>>, std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

/// Reads `pipe` to its end on a thread of its own, into the returned buffer.
fn drain(pipe: Option<impl std::io::Read + Send + 'static>) -> Drained {
    let bytes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = bytes.clone();
    let reader = pipe.map(|mut pipe| {
        std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            loop {
                match pipe.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => sink.lock().unwrap().extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                }
            }
        })
    });
    (reader, bytes)
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

/// A test that cannot run here (a missing tool, package or privilege) says why and passes,
/// except where `GRADWIRE_TEST_REQUIRE=all` asks every test to run (`.ci/run` sets it, and
/// installs what the tests need): there the missing dependency fails the test. GPU tests
/// and the verbs device tests on a host without RDMA (they run inside the soft-RoCE VM)
/// skip either way.
pub fn skip(test: &str, why: &str) {
    if std::env::var("GRADWIRE_TEST_REQUIRE").is_ok_and(|v| v == "all") {
        panic!("{test} cannot run here: {why} (GRADWIRE_TEST_REQUIRE=all: every test must run; .ci/run installs what they need)");
    }
    eprintln!("SKIP {test}: {why}");
}

/// Root with `ip netns` available; otherwise [`skip`]s saying why.
pub fn can_netns(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let ip = Command::new("ip").arg("netns").arg("list").output().map(|o| o.status.success()).unwrap_or(false);
    if !(root && ip) {
        skip(test, &format!("needs root and iproute2 for network namespaces (root={root}, ip netns works={ip})"));
    }
    root && ip
}

/// Whether the kernel lets sibling processes of this user read each other's memory
/// (cross-memory attach): no Yama, Yama `ptrace_scope` 0, or `ptrace_scope` 1-2 with
/// CAP_SYS_PTRACE. Where it does not, gradwire stages instead, and tests of that form say
/// so and accept staging.
pub fn cross_memory_attach_allowed(test: &str) -> bool {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope").ok().and_then(|s| s.trim().parse::<u32>().ok());
    // CAP_SYS_PTRACE is capability 19 of the effective set.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let cap_eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()).unwrap_or(0);
    let sys_ptrace = cap_eff & (1 << 19) != 0;
    let allowed = match scope {
        None | Some(0) => true,
        Some(1 | 2) => sys_ptrace,
        Some(_) => false,
    };
    if !allowed {
        eprintln!("NOTE {test}: Yama ptrace_scope {scope:?} without CAP_SYS_PTRACE: cross-memory attach is refused here, so the staged form is accepted");
    }
    allowed
}

/// Asserts that every one of `ranks` ranks logged a line containing `what` (its lines start
/// with "rank R: ").
pub fn every_rank_logged(t: &str, ranks: usize, what: &str) {
    for rank in 0..ranks {
        let said = |l: &&str| l.contains(&format!("rank {rank}: ")) && l.contains(what);
        assert!(t.lines().any(|l| said(&l)), "rank {rank} of {ranks} never logged {what:?}:\n{t}");
    }
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
    gradwire::bootstrap::store::unused_ports(1).unwrap()
}

/// The folder holding an up-to-date `libgradwire.so` (the cdylib). `cargo nextest` builds
/// it but leaves it among the dependencies, so the tests that link the shared library
/// (C example, Python) ask cargo for it here — a no-op when it is fresh.
pub fn cdylib_dir() -> std::path::PathBuf {
    static DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::path::Path::new(bin()).parent().expect("target dir").to_path_buf();
        // All targets, as the test command builds them: `--lib` alone resolves dependency
        // features without the dev-dependencies and rebuilds the library and part of its
        // dependencies (minutes on 2 cores, inside the first test that asks).
        let mut cmd = Command::new(option_env!("CARGO").unwrap_or("cargo"));
        cmd.args(["build", "--all-targets", "--manifest-path", concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")]);
        if dir.ends_with("release") {
            cmd.arg("--release");
        }
        let out = cmd.output().expect("run cargo build --all-targets");
        assert!(out.status.success(), "cargo build --all-targets failed:\n{}", String::from_utf8_lossy(&out.stderr));
        assert!(dir.join("libgradwire.so").exists(), "no libgradwire.so in {}", dir.display());
        dir
    })
    .clone()
}

/// Compiles the C program `src` (a path under the repository) against `ffi/gradwire.h`
/// and the cdylib, to `name` beside the library, and returns its path.
pub fn c_program(src: &str, name: &str) -> std::path::PathBuf {
    c_program_with(&std::env::var("CC").unwrap_or_else(|_| "cc".into()), src, name)
}

/// [`c_program`] with the C compiler `cc` (an MPI compiler wrapper, say).
pub fn c_program_with(cc: &str, src: &str, name: &str) -> std::path::PathBuf {
    let dir = cdylib_dir();
    let root = env!("CARGO_MANIFEST_DIR");
    let exe = dir.join(name);
    // Built under a name of this process's and renamed: another test binary may be running
    // the program while this one builds it.
    let building = dir.join(format!("{name}.{}", std::process::id()));
    let out = Command::new(cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(format!("{root}/ffi"))
        .arg(format!("{root}/{src}"))
        .arg("-L")
        .arg(&dir)
        .arg("-lgradwire")
        .arg("-ldl") // the GPU example opens the CUDA driver itself
        .arg("-lm")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .arg("-o")
        .arg(&building)
        .output()
        .expect("run the C compiler");
    assert!(out.status.success(), "{src} does not compile:\n{}", text(&out));
    std::fs::rename(&building, &exe).expect("rename the built program");
    exe
}

/// How long a killed-rank test lets ranks settle, the deadline it sets, and how soon each
/// survivor must have reported (deadline plus process start/exit slack).
pub struct FaultTiming {
    pub settle: Duration,
    pub deadline_ms: u64,
    pub report_within: Duration,
}

/// On this host.
pub const LOCAL: FaultTiming = FaultTiming { settle: Duration::from_millis(1500), deadline_ms: 2000, report_within: Duration::from_secs(6) };

pub fn spawn_rank(rank: usize, world: usize, port: u16, secret: &str, env: &[(&str, &str)], args: &[&str]) -> Child {
    let mut cmd = Command::new(bin());
    cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
    rank_env(&mut cmd, rank, world, port, secret);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("spawn rank")
}

/// Starts `world` ranks running long allreduces, SIGKILLs `victim` once they are running,
/// and checks every survivor fails within the deadline (plus process start/exit slack)
/// with an error naming the victim.
pub fn killed_rank(world: usize, victim: usize, transport: &str, bytes: &str, t: &FaultTiming) {
    killed_rank_with(world, victim, transport, bytes, &[], &[], t)
}

/// [`killed_rank`] with more arguments for `gradwire bench`.
pub fn killed_rank_with(world: usize, victim: usize, transport: &str, bytes: &str, extra: &[&str], extra_env: &[(&str, &str)], t: &FaultTiming) {
    killed_rank_in("allreduce", world, victim, transport, bytes, extra, extra_env, t)
}

/// [`killed_rank_with`] in a loop of `collective` instead of allreduce.
#[allow(clippy::too_many_arguments)]
pub fn killed_rank_in(
    collective: &str,
    world: usize,
    victim: usize,
    transport: &str,
    bytes: &str,
    extra: &[&str],
    extra_env: &[(&str, &str)],
    t: &FaultTiming,
) {
    let port = free_port();
    let deadline = t.deadline_ms.to_string();
    let env = [&[("GRADWIRE_TIMEOUT_MS", deadline.as_str()), ("GRADWIRE_TRANSPORT", transport)], extra_env].concat();
    let args = [&["bench", collective, "-b", bytes, "-e", bytes, "-n", "1000000", "-w", "1"], extra].concat();
    let mut ranks: Vec<Child> = (0..world).map(|r| spawn_rank(r, world, port, "fault-test-secret", &env, &args)).collect();
    // Let them connect and get into the allreduce loop.
    std::thread::sleep(t.settle);
    for (r, c) in ranks.iter_mut().enumerate() {
        assert!(c.try_wait().unwrap().is_none(), "rank {r} exited before the kill");
    }
    ranks[victim].kill().unwrap();
    let killed_at = Instant::now();
    let _ = ranks[victim].wait();
    // Every survivor's report first, then the checks: a survivor that names another
    // survivor is explained by that one's report.
    let reports: Vec<_> = ranks
        .into_iter()
        .enumerate()
        .filter(|(r, _)| *r != victim)
        .map(|(r, c)| {
            let out = wait_with_limit(c, t.report_within * 5);
            let elapsed = killed_at.elapsed();
            println!("survivor {r} after {elapsed:?} ({}): {}", out.status, text(&out));
            (r, out, elapsed)
        })
        .collect();
    for (r, out, elapsed) in reports {
        let out_text = text(&out);
        assert!(!out.status.success(), "rank {r} should fail after rank {victim} died:\n{out_text}");
        assert!(out_text.contains(&format!("rank {victim}")), "rank {r}'s error does not name rank {victim}:\n{out_text}");
        assert!(!out_text.contains("panicked"), "{out_text}");
        assert!(elapsed < t.report_within, "rank {r} took {elapsed:?} to report the dead rank (deadline {} ms)", t.deadline_ms);
    }
}

/// Rank 1 runs `odd` while the others run `even`: every rank must fail fast with a
/// mismatch error that names both calls.
pub fn mismatch(transport: &str, even: &[&str], odd: &[&str], expect: &[&str]) {
    mismatch_with_env(transport, &[], even, odd, expect)
}

/// [`mismatch`] with more environment for every rank.
pub fn mismatch_with_env(transport: &str, extra_env: &[(&str, &str)], even: &[&str], odd: &[&str], expect: &[&str]) {
    let world = 3;
    let port = free_port();
    let mut env = vec![("GRADWIRE_TIMEOUT_MS", "30000"), ("GRADWIRE_TRANSPORT", transport)];
    env.extend_from_slice(extra_env);
    let start = Instant::now();
    let ranks: Vec<Child> = (0..world).map(|r| spawn_rank(r, world, port, "fault-test-secret", &env, if r == 1 { odd } else { even })).collect();
    let outs: Vec<_> = ranks.into_iter().map(|c| wait_with_limit(c, Duration::from_secs(60))).collect();
    let elapsed = start.elapsed();
    let all: String = outs.iter().map(text).collect();
    println!("{all}");
    assert!(elapsed < Duration::from_secs(20), "mismatch took {elapsed:?}: it waited for the 30 s deadline instead of detecting it");
    for (r, o) in outs.iter().enumerate() {
        assert!(!o.status.success(), "rank {r} succeeded despite a mismatched call:\n{all}");
    }
    assert!(all.contains("mismatch"), "no mismatch reported:\n{all}");
    for e in expect {
        assert!(all.contains(e), "expected {e:?} in:\n{all}");
    }
    assert!(!all.contains("panicked"), "{all}");
}

/// Rank `victim` SIGKILLs itself holding the token; every survivor must fail within the
/// deadline (plus start-up) naming it.
pub fn killed_in_token_ring(transport: &str, victim: usize, cyclic: bool, t: &FaultTiming) {
    let kill = format!("{victim}:20");
    let mut args = vec!["check", "--token-ring", "1000", "--kill", &kill];
    if cyclic {
        args.push("--cyclic");
    }
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", "4", "--", bin()]).args(&args).env("GRADWIRE_TIMEOUT_MS", t.deadline_ms.to_string()).env("GRADWIRE_TRANSPORT", transport);
    let start = Instant::now();
    let out = run_with_limit(cmd, Duration::from_secs(60));
    let all = text(&out);
    println!("{all}");
    assert!(!out.status.success(), "{all}");
    assert!(all.contains(&format!("rank {victim} failed (killed by signal 9)")), "{all}");
    for r in (0..4).filter(|&r| r != victim) {
        let line = all.lines().find(|l| l.starts_with(&format!("rank {r}: gradwire check:"))).unwrap_or_else(|| panic!("rank {r} reported nothing:\n{all}"));
        assert!(line.contains(&format!("rank {victim}")), "rank {r} does not name rank {victim}: {line}");
    }
    assert!(!all.contains("panicked"), "{all}");
    assert!(start.elapsed() < t.report_within * 3, "{:?}", start.elapsed());
}
