//! `gradwire launch`: starts N local ranks with the torchrun variables and a fresh job
//! secret; optionally one "node" per network namespace on a bridge with tbf-shaped links.
//! Forwards SIGINT/SIGTERM; when a rank fails it stops the others and names the rank;
//! removes every namespace and link it made, also on failure.

use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

pub struct LaunchArgs {
    pub nprocs: usize,
    pub netns: bool,
    pub ranks_per_node: usize,
    pub link_gbit: Option<f64>,
    pub timeout: Option<Duration>,
    /// Pin each rank to one CPU when there are at least as many CPUs as ranks.
    pub bind: bool,
    pub cmd: Vec<String>,
}

/// The CPUs this launcher may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is valid, and sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return vec![];
    }
    // SAFETY: CPU_ISSET reads the set filled above.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

/// Pins the calling (child) process to `cpu` before it executes the rank. Like mpirun's
/// default: ranks that share memory must not end up time-sharing one core while another
/// idles — measured here, two unbound ranks that settle on one core halve the shm
/// allreduce's bandwidth (8.4 to 1.8 GB/s at 4 MiB).
fn bind_to(cmd: &mut Command, cpu: usize) {
    use std::os::unix::process::CommandExt;
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

fn install_handlers() {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Namespaces, veths and the bridge of one `--netns` launch; removed on drop.
struct Netns {
    bridge: String,
    namespaces: Vec<String>,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip").args(args).output().map_err(|e| format!("cannot run `ip` (install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

impl Netns {
    fn create(nodes: usize, link_gbit: Option<f64>) -> Result<Self, String> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err("--netns needs root (network namespaces, veth pairs, tc)".into());
        }
        let id = std::process::id();
        let mut me = Netns { bridge: format!("gwb{id}"), namespaces: vec![] };
        // Names hold our pid, so any already there were left by a launcher that was killed
        // (no cleanup) and had this pid before us: remove them rather than fail on them.
        for i in 0..nodes {
            let _ = ip(&["link", "del", &format!("gw{id}h{i}")]);
            let _ = ip(&["netns", "del", &format!("gw{id}n{i}")]);
        }
        let _ = ip(&["link", "del", &me.bridge]);
        ip(&["link", "add", &me.bridge, "type", "bridge"])?;
        ip(&["link", "set", &me.bridge, "up"])?;
        for i in 0..nodes {
            let ns = format!("gw{id}n{i}");
            ip(&["netns", "add", &ns])?;
            me.namespaces.push(ns.clone());
            let (host_end, ns_end) = (format!("gw{id}h{i}"), format!("gw{id}p{i}"));
            ip(&["link", "add", &host_end, "type", "veth", "peer", "name", &ns_end])?;
            ip(&["link", "set", &host_end, "master", &me.bridge])?;
            ip(&["link", "set", &host_end, "up"])?;
            ip(&["link", "set", &ns_end, "netns", &ns])?;
            ip(&["-n", &ns, "link", "set", &ns_end, "name", "eth0"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", node_addr(i)), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            if let Some(g) = link_gbit {
                // Each node's egress is shaped, so every byte crossing the "network" is.
                // The bucket must hold at least one GSO packet (64 KiB) and ~4 ms of traffic.
                let rate_bytes = g * 1e9 / 8.0;
                let burst = ((rate_bytes * 0.004) as u64).max(256 << 10);
                let out = Command::new("tc")
                    .args([
                        "-n",
                        &ns,
                        "qdisc",
                        "add",
                        "dev",
                        "eth0",
                        "root",
                        "tbf",
                        "rate",
                        &format!("{}mbit", (g * 1000.0).round() as u64),
                        "burst",
                        &burst.to_string(),
                        "latency",
                        "50ms",
                    ])
                    .output()
                    .map_err(|e| format!("cannot run `tc`: {e}"))?;
                if !out.status.success() {
                    return Err(format!("tc tbf on {ns} failed: {}", String::from_utf8_lossy(&out.stderr).trim()));
                }
            }
        }
        Ok(me)
    }
}

fn node_addr(i: usize) -> String {
    format!("10.77.{}.{}", (i + 1) / 250, (i + 1) % 250 + 1)
}

impl Drop for Netns {
    fn drop(&mut self) {
        let id = std::process::id();
        for (i, ns) in self.namespaces.iter().enumerate() {
            // Deleting the namespace frees its veth end only asynchronously: remove our end
            // now so nothing is left when we exit.
            let _ = ip(&["link", "del", &format!("gw{id}h{i}")]);
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("gradwire launch: cleanup: {e}");
            }
        }
        let _ = ip(&["link", "del", &self.bridge]);
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("exit status {c}"),
        (None, Some(s)) => format!("killed by signal {s}"),
        _ => "unknown status".into(),
    }
}

fn stop_all(children: &mut [Option<Child>], sig: i32) {
    for c in children.iter().flatten() {
        // SAFETY: sending a signal to our own child's pid.
        unsafe { libc::kill(c.id() as i32, sig) };
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline && children.iter_mut().flatten().any(|c| matches!(c.try_wait(), Ok(None))) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for c in children.iter_mut().flatten() {
        if matches!(c.try_wait(), Ok(None)) {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs the job; returns the launcher's exit code.
pub fn run(a: &LaunchArgs) -> i32 {
    if a.cmd.is_empty() {
        eprintln!("gradwire launch: no command given (usage: gradwire launch -n N -- CMD ARGS...)");
        return 2;
    }
    if a.nprocs == 0 || a.ranks_per_node == 0 || a.nprocs % a.ranks_per_node != 0 {
        eprintln!("gradwire launch: -n {} must be a positive multiple of --ranks-per-node {}", a.nprocs, a.ranks_per_node);
        return 2;
    }
    install_handlers();
    let nodes = if a.netns { a.nprocs / a.ranks_per_node } else { 1 };
    let per_node = if a.netns { a.ranks_per_node } else { a.nprocs };
    let netns = if a.netns {
        match Netns::create(nodes, a.link_gbit) {
            Ok(n) => Some(n),
            Err(e) => {
                eprintln!("gradwire launch: {e}");
                return 1;
            }
        }
    } else {
        if a.link_gbit.is_some() {
            eprintln!("gradwire launch: --link-gbit needs --netns (there is no link to shape on loopback)");
            return 2;
        }
        None
    };
    let master = if a.netns { node_addr(0) } else { "127.0.0.1".to_string() };
    // NCCL installed only as libnccl.so.2 (pip wheels) is invisible to cudarc's loader:
    // give the ranks a private libnccl.so link on LD_LIBRARY_PATH.
    #[cfg(feature = "cuda")]
    let nccl_dir = gradwire::gpu::nccl_link_dir();
    #[cfg(not(feature = "cuda"))]
    let nccl_dir: Option<std::path::PathBuf> = None;
    let ld_path = nccl_dir.as_ref().map(|d| match std::env::var("LD_LIBRARY_PATH") {
        Ok(old) if !old.is_empty() => format!("{}:{old}", d.display()),
        _ => d.display().to_string(),
    });
    // MASTER_PORT for the store, and the next port for gradwire's own store when the
    // ranks run torch.distributed, whose store takes MASTER_PORT (python/gradwire).
    let port = match gradwire::bootstrap::store::unused_ports(2) {
        Ok(p) => p.to_string(),
        Err(e) => {
            eprintln!("gradwire launch: {e}");
            return 1;
        }
    };
    let secret = format!("{:032x}", rand::random::<u128>());
    // All ranks run on this machine's CPUs, namespaces or not: bind only when each gets
    // a CPU of its own (oversubscribed ranks are better left to the scheduler).
    let cpus = allowed_cpus();
    let binding = a.bind && !cpus.is_empty() && a.nprocs <= cpus.len();
    let mut children: Vec<Option<Child>> = Vec::new();
    for r in 0..a.nprocs {
        let mut cmd = match &netns {
            Some(n) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &n.namespaces[r / per_node]]).args(&a.cmd);
                c
            }
            None => {
                let mut c = Command::new(&a.cmd[0]);
                c.args(&a.cmd[1..]);
                c
            }
        };
        cmd.env("RANK", r.to_string())
            .env("WORLD_SIZE", a.nprocs.to_string())
            .env("LOCAL_RANK", (r % per_node).to_string())
            .env("LOCAL_WORLD_SIZE", per_node.to_string())
            .env("GROUP_RANK", (r / per_node).to_string())
            .env("MASTER_ADDR", &master)
            .env("MASTER_PORT", &port)
            .env("GRADWIRE_JOB_SECRET", &secret);
        if let Some(p) = &ld_path {
            cmd.env("LD_LIBRARY_PATH", p);
        }
        if let Some(&cpu) = cpus.get(r).filter(|_| binding) {
            bind_to(&mut cmd, cpu);
        }
        match cmd.spawn() {
            Ok(c) => children.push(Some(c)),
            Err(e) => {
                eprintln!("gradwire launch: cannot start rank {r} ({}): {e}", a.cmd[0]);
                stop_all(&mut children, libc::SIGTERM);
                return 1;
            }
        }
    }
    let start = Instant::now();
    let mut failed: Option<(usize, String)> = None;
    let mut code = 0;
    loop {
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            eprintln!("gradwire launch: got signal {sig}; stopping all ranks");
            stop_all(&mut children, sig);
            code = 128 + sig;
            break;
        }
        if let Some(t) = a.timeout {
            if start.elapsed() > t {
                let running: Vec<usize> =
                    children.iter_mut().enumerate().filter_map(|(r, c)| c.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None))).then_some(r)).collect();
                eprintln!("gradwire launch: timed out after {} s; ranks still running: {running:?}; stopping them", t.as_secs());
                stop_all(&mut children, libc::SIGTERM);
                code = 124;
                break;
            }
        }
        let mut all_done = true;
        // Ranks that ended in this poll. When several fail at once, one killed by a signal
        // is the likelier root cause than one that exited with an error after seeing it.
        let mut ended: Vec<(usize, ExitStatus)> = vec![];
        for (r, slot) in children.iter_mut().enumerate() {
            let Some(c) = slot else { continue };
            match c.try_wait() {
                Ok(Some(st)) => {
                    *slot = None;
                    ended.push((r, st));
                }
                Ok(None) => all_done = false,
                Err(e) => {
                    eprintln!("gradwire launch: waiting for rank {r}: {e}");
                    *slot = None;
                }
            }
        }
        if failed.is_none() {
            use std::os::unix::process::ExitStatusExt;
            let culprit = ended.iter().find(|(_, st)| st.signal().is_some()).or_else(|| ended.iter().find(|(_, st)| !st.success()));
            if let Some((r, st)) = culprit {
                failed = Some((*r, describe(*st)));
                code = st.code().filter(|&c| c != 0).unwrap_or(1);
            }
        }
        if let Some((r, why)) = &failed {
            if children.iter().any(|c| c.is_some()) {
                eprintln!("gradwire launch: rank {r} failed ({why}); stopping the other ranks");
                // Give the survivors a moment to report their own view of the failure.
                let grace = Instant::now() + Duration::from_secs(10);
                while Instant::now() < grace && children.iter_mut().flatten().any(|c| matches!(c.try_wait(), Ok(None))) {
                    std::thread::sleep(Duration::from_millis(20));
                }
                stop_all(&mut children, libc::SIGTERM);
            } else {
                eprintln!("gradwire launch: rank {r} failed ({why})");
            }
            break;
        }
        if all_done {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(netns);
    if let Some(d) = nccl_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    code
}
