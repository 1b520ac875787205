//! `gradwire launch`: starts N local ranks with the torchrun variables and a fresh job
//! secret; optionally one "node" per network namespace on a bridge with tbf-shaped links.
//! Forwards SIGINT/SIGTERM; when a rank fails it stops the others and names the rank;
//! removes every namespace and link it made, also on failure.
//!
//! Every rank runs in a process group of its own, so a signal reaches a rank's descendants
//! too (`-- bash -c "..."`); ranks are reaped only at the very end, so no group id can be
//! reused by another process while the launcher may signal it. Ranks die with the launcher
//! even when it is SIGKILLed: each gets a parent-death signal, and a guard process
//! (`gradwire launch-guard`, in a session of its own) that the launcher feeds the groups
//! and namespaces through a pipe stops every group and removes the namespaces when that
//! pipe closes without a "done". Ranks read end-of-file, not the terminal.

/// One write per line: the ranks write to the same stderr, and a line written in pieces
/// (as `eprintln!` writes its arguments) interleaves with theirs.
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write;
        let _ = std::io::stderr().write_all(format!("{}\n", format_args!($($t)*)).as_bytes());
    }};
}

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
/// idles (two unbound ranks that settle on one core lose most of the shm allreduce's
/// bandwidth).
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
        sweep_stale_netns();
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
        remove_netns(std::process::id(), self.namespaces.len());
    }
}

/// Removes the namespaces, veths and bridge that the launcher with pid `id` made for
/// `nodes` nodes.
fn remove_netns(id: u32, nodes: usize) {
    for i in 0..nodes {
        // Deleting the namespace frees its veth end only asynchronously: remove our end
        // now so nothing is left when we exit.
        let _ = ip(&["link", "del", &format!("gw{id}h{i}")]);
        if let Err(e) = ip(&["netns", "del", &format!("gw{id}n{i}")]) {
            say!("gradwire launch: cleanup: {e}");
        }
    }
    let _ = ip(&["link", "del", &format!("gwb{id}")]);
}

/// Removes what launchers that are gone left behind (killed before they or their guard
/// could clean up): namespaces `gw<pid>n<i>` whose pid is no running process.
fn sweep_stale_netns() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else { return };
    let mut stale: Vec<(u32, usize)> = vec![];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some((pid, node)) = name.strip_prefix("gw").and_then(|r| r.split_once('n')) else { continue };
        let (Ok(pid), Ok(node)) = (pid.parse::<u32>(), node.parse::<usize>()) else { continue };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            match stale.iter_mut().find(|(p, _)| *p == pid) {
                Some((_, n)) => *n = (*n).max(node + 1),
                None => stale.push((pid, node + 1)),
            }
        }
    }
    for (pid, nodes) in stale {
        say!("gradwire launch: removing {nodes} network namespace(s) left by launcher {pid}, which is gone");
        remove_netns(pid, nodes);
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

/// Sends `sig` to every process of a rank's group (the rank and all it started), and
/// SIGCONT after it, so that a stopped rank can act on it.
fn signal_group(pgid: u32, sig: i32) {
    // SAFETY: kill with a negative pid signals that process group; no memory is involved.
    unsafe {
        libc::kill(-(pgid as i32), sig);
        if sig != libc::SIGKILL && sig != libc::SIGCONT {
            libc::kill(-(pgid as i32), libc::SIGCONT);
        }
    }
}

/// What is left of each process group: whether any member is alive (not a zombie), and
/// whether any is stopped (SIGSTOP, SIGTSTP, SIGTTIN from reading the terminal, a
/// debugger). One pass over /proc for all groups.
#[derive(Clone, Copy, Default)]
struct GroupState {
    live: bool,
    stopped: bool,
}

fn scan_groups() -> std::collections::HashMap<u32, GroupState> {
    let mut groups: std::collections::HashMap<u32, GroupState> = Default::default();
    let Ok(dir) = std::fs::read_dir("/proc") else { return groups };
    for e in dir.flatten() {
        let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else { continue };
        // pid (comm) state ppid pgrp ...: comm may hold spaces, so parse after the last ')'.
        let mut fields = stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace()).into_iter().flatten();
        let state = fields.next().unwrap_or("");
        let Some(pgrp) = fields.nth(1).and_then(|p| p.parse::<u32>().ok()) else { continue };
        let g = groups.entry(pgrp).or_default();
        g.live |= !matches!(state, "Z" | "X");
        g.stopped |= matches!(state, "T" | "t");
    }
    groups
}

/// How long stopped ranks get to exit before SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(3);

/// Stops every rank and everything it started: `sig` to each rank's process group, then
/// SIGKILL to the groups with members left after `grace`. The launcher reaps the ranks
/// only at the end of the launch (see [`exit_status`]), so no group id can have been
/// handed to another process meanwhile.
fn stop_all(groups: &[u32], sig: i32, grace: Duration) {
    for &g in groups {
        signal_group(g, sig);
    }
    let deadline = Instant::now() + grace;
    while Instant::now() < deadline {
        let now = scan_groups();
        if !groups.iter().any(|g| now.get(g).is_some_and(|s| s.live)) {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for &g in groups {
        signal_group(g, libc::SIGKILL);
    }
}

/// A rank's exit status once it has ended, leaving it unreaped (a zombie keeps its pid,
/// and so its process group's id, from being reused while the launcher may still signal
/// that group).
fn exit_status(c: &Child) -> Option<ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    // SAFETY: a zeroed siginfo_t is valid; waitid writes at most one into it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: waitid on our own child, without reaping it (WNOWAIT).
    let r = unsafe { libc::waitid(libc::P_PID, c.id(), &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) };
    // SAFETY: si_pid and si_status are set for the SIGCHLD-style siginfo waitid returns.
    let (pid, status) = unsafe { (info.si_pid(), info.si_status()) };
    if r != 0 || pid == 0 {
        return None;
    }
    Some(match info.si_code {
        libc::CLD_EXITED => ExitStatus::from_raw((status & 0xff) << 8),
        libc::CLD_DUMPED => ExitStatus::from_raw(status | 0x80),
        _ => ExitStatus::from_raw(status),
    })
}

/// Makes the (child) process a process group of its own and has the kernel kill it when
/// the launcher dies, however it dies.
fn own_group_dying_with(cmd: &mut Command, launcher: libc::pid_t) {
    use std::os::unix::process::CommandExt;
    cmd.process_group(0);
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died before the line above: nobody would signal us.
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

/// The launcher's guard: a process of its own that the launcher tells, through a pipe, the
/// rank groups and namespaces it makes. When the pipe closes without "done" the launcher
/// died without cleaning up (SIGKILL, the OOM killer), and the guard does it.
struct Guard {
    pipe: Option<std::process::ChildStdin>,
    process: Child,
}

impl Guard {
    fn start() -> Result<Self, String> {
        use std::os::unix::process::CommandExt;
        let exe = std::env::current_exe().map_err(|e| format!("cannot find this program to start its guard: {e}"))?;
        let mut cmd = Command::new(exe);
        cmd.arg("launch-guard").stdin(std::process::Stdio::piped());
        // SAFETY: setsid is async-signal-safe. A session of its own: no terminal hang-up or
        // signal to the launcher's process group reaches the guard.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut process = cmd.spawn().map_err(|e| format!("cannot start the launch guard: {e}"))?;
        Ok(Guard { pipe: process.stdin.take(), process })
    }

    fn tell(&mut self, line: &str) {
        use std::io::Write;
        if let Some(p) = &mut self.pipe {
            let _ = writeln!(p, "{line}");
        }
    }

    /// The launcher cleaned up itself: the guard may go.
    fn done(mut self) {
        self.tell("done");
        drop(self.pipe.take());
        let _ = self.process.wait();
    }
}

/// `gradwire launch-guard`: reads `group PGID`, `netns PID NODES` and `done` lines until
/// its input closes; without `done`, stops every group (SIGTERM, then SIGKILL after 2 s)
/// and removes the namespaces. Returns the exit code.
pub fn guard() -> i32 {
    use std::io::BufRead;
    // The terminal's Ctrl-C or a hang-up is the launcher's to handle; the guard waits.
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: ignoring a signal involves no handler code.
        unsafe { libc::signal(sig, libc::SIG_IGN) };
    }
    let (mut groups, mut netns, mut done) = (Vec::<u32>::new(), None::<(u32, usize)>, false);
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["group", g] => groups.extend(g.parse::<u32>().ok()),
            ["netns", id, n] => netns = id.parse().ok().zip(n.parse().ok()),
            ["done"] => done = true,
            _ => {}
        }
    }
    if done {
        return 0;
    }
    let now = scan_groups();
    let alive: Vec<u32> = groups.into_iter().filter(|g| now.get(g).is_some_and(|s| s.live)).collect();
    if !alive.is_empty() {
        say!("gradwire launch: the launcher died; stopping its {} rank(s) and everything they started", alive.len());
    }
    stop_all(&alive, libc::SIGTERM, Duration::from_secs(2));
    if let Some((id, nodes)) = netns {
        remove_netns(id, nodes);
    }
    0
}

/// Runs the job; returns the launcher's exit code.
pub fn run(a: &LaunchArgs) -> i32 {
    if a.cmd.is_empty() {
        say!("gradwire launch: no command given (usage: gradwire launch -n N -- CMD ARGS...)");
        return 2;
    }
    if a.nprocs == 0 || a.ranks_per_node == 0 || a.nprocs % a.ranks_per_node != 0 {
        say!("gradwire launch: -n {} must be a positive multiple of --ranks-per-node {}", a.nprocs, a.ranks_per_node);
        return 2;
    }
    install_handlers();
    let mut guard = match Guard::start() {
        Ok(g) => g,
        Err(e) => {
            say!("gradwire launch: {e}");
            return 1;
        }
    };
    let code = launch_guarded(a, &mut guard);
    guard.done();
    code
}

/// [`run`] once the guard is up: everything it makes, it tells the guard first.
fn launch_guarded(a: &LaunchArgs, guard: &mut Guard) -> i32 {
    let nodes = if a.netns { a.nprocs / a.ranks_per_node } else { 1 };
    let per_node = if a.netns { a.ranks_per_node } else { a.nprocs };
    let netns = if a.netns {
        guard.tell(&format!("netns {} {nodes}", std::process::id()));
        match Netns::create(nodes, a.link_gbit) {
            Ok(n) => Some(n),
            Err(e) => {
                say!("gradwire launch: {e}");
                return 1;
            }
        }
    } else {
        if a.link_gbit.is_some() {
            say!("gradwire launch: --link-gbit needs --netns (there is no link to shape on loopback)");
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
            say!("gradwire launch: {e}");
            return 1;
        }
    };
    let secret = format!("{:032x}", rand::random::<u128>());
    // All ranks run on this machine's CPUs, namespaces or not: bind only when each gets
    // a CPU of its own (oversubscribed ranks are better left to the scheduler).
    let cpus = allowed_cpus();
    let binding = a.bind && !cpus.is_empty() && a.nprocs <= cpus.len();
    // SAFETY: getpid and isatty have no preconditions.
    let (launcher, stdin_is_terminal) = unsafe { (libc::getpid(), libc::isatty(0) == 1) };
    let mut children: Vec<Option<Child>> = Vec::new();
    let mut groups: Vec<u32> = Vec::new();
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
        own_group_dying_with(&mut cmd, launcher);
        if stdin_is_terminal {
            // In a process group of its own a rank reading the terminal would be stopped
            // (SIGTTIN) and hang the job: it reads end-of-file instead, as all ranks but
            // rank 0 do under mpirun.
            cmd.stdin(std::process::Stdio::null());
        }
        if let Some(&cpu) = cpus.get(r).filter(|_| binding) {
            bind_to(&mut cmd, cpu);
        }
        match cmd.spawn() {
            Ok(c) => {
                guard.tell(&format!("group {}", c.id()));
                groups.push(c.id());
                children.push(Some(c));
            }
            Err(e) => {
                say!("gradwire launch: cannot start rank {r} ({}): {e}", a.cmd[0]);
                stop_all(&groups, libc::SIGTERM, STOP_GRACE);
                children.iter_mut().flatten().for_each(|c| drop(c.wait()));
                return 1;
            }
        }
    }
    let start = Instant::now();
    let mut code = 0;
    // Ranks that have ended, with their status, in the order they were seen to end; and
    // those processes, reaped only at the end (see `exit_status`).
    let mut ended: Vec<(usize, ExitStatus)> = vec![];
    let mut unreaped: Vec<Child> = vec![];
    loop {
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            say!("gradwire launch: got signal {sig}; stopping all ranks");
            stop_all(&groups, sig, STOP_GRACE);
            code = 128 + sig;
            break;
        }
        if let Some(t) = a.timeout {
            if start.elapsed() > t {
                note_ended(&mut children, &mut ended, &mut unreaped);
                let running: Vec<usize> = (0..children.len()).filter(|&r| children[r].is_some()).collect();
                say!("gradwire launch: timed out after {} s; ranks still running: {running:?}; stopping them", t.as_secs());
                stop_all(&groups, libc::SIGTERM, STOP_GRACE);
                code = 124;
                break;
            }
        }
        note_ended(&mut children, &mut ended, &mut unreaped);
        if ended.iter().any(|(_, st)| !st.success()) {
            // The first failure seen is often not the cause: a rank killed by a signal ends
            // only after its memory is torn down, by which time its peers may have noticed
            // and exited with an error. Let the statuses settle before blaming.
            let settle = Instant::now() + Duration::from_millis(300);
            while Instant::now() < settle && children.iter().any(|c| c.is_some()) {
                std::thread::sleep(Duration::from_millis(10));
                note_ended(&mut children, &mut ended, &mut unreaped);
            }
            let stopped = |children: &[Option<Child>]| {
                let now = scan_groups();
                (0..children.len()).map(|r| children[r].is_some() && now.get(&groups[r]).is_some_and(|s| s.stopped)).collect::<Vec<bool>>()
            };
            let (r, why) = culprit(&ended, &stopped(&children));
            code = ended.iter().find(|(e, _)| *e == r).and_then(|(_, st)| st.code()).filter(|&c| c != 0).unwrap_or(1);
            if children.iter().any(|c| c.is_some()) {
                say!("gradwire launch: rank {r} failed ({why}); stopping the other ranks");
                // A stopped rank will never report, and its open connections keep its peers
                // (rank 0's store among them) waiting for it to leave: it goes first.
                for (r, _) in stopped(&children).iter().enumerate().filter(|(_, &s)| s) {
                    signal_group(groups[r], libc::SIGKILL);
                }
                // Give the survivors a moment to report their own view of the failure; a
                // stopped rank will not, so it is not waited for.
                let grace = Instant::now() + Duration::from_secs(10);
                while Instant::now() < grace {
                    let stopped_now = stopped(&children);
                    if !(0..children.len()).any(|r| children[r].is_some() && !stopped_now[r]) {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                    note_ended(&mut children, &mut ended, &mut unreaped);
                }
                stop_all(&groups, libc::SIGTERM, STOP_GRACE);
            } else {
                say!("gradwire launch: rank {r} failed ({why})");
            }
            break;
        }
        if children.iter().all(|c| c.is_none()) {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Whatever a rank started and left behind (a shell's background job) goes with the job;
    // only then are the ranks reaped, freeing their group ids.
    stop_all(&groups, libc::SIGTERM, STOP_GRACE);
    for c in children.iter_mut().flatten().chain(unreaped.iter_mut()) {
        let _ = c.wait();
    }
    drop(netns);
    if let Some(d) = nccl_dir {
        let _ = std::fs::remove_dir_all(d);
    }
    code
}

/// Moves the ranks that have ended into `ended` (their processes, unreaped, into
/// `unreaped`).
fn note_ended(children: &mut [Option<Child>], ended: &mut Vec<(usize, ExitStatus)>, unreaped: &mut Vec<Child>) {
    for (r, slot) in children.iter_mut().enumerate() {
        let Some(st) = slot.as_ref().and_then(exit_status) else { continue };
        ended.push((r, st));
        unreaped.extend(slot.take());
    }
}

/// The rank to blame and why: one killed by a signal, else one that is stopped (its peers
/// time out waiting for it and exit with an error), else the first that failed.
fn culprit(ended: &[(usize, ExitStatus)], stopped: &[bool]) -> (usize, String) {
    use std::os::unix::process::ExitStatusExt;
    if let Some((r, st)) = ended.iter().find(|(_, st)| st.signal().is_some()) {
        return (*r, describe(*st));
    }
    if let Some(r) = stopped.iter().position(|&s| s) {
        return (r, "stopped and not answering: SIGSTOP, or SIGTTIN from reading the terminal?".into());
    }
    let (r, st) = ended.iter().find(|(_, st)| !st.success()).copied().unwrap_or((0, ExitStatus::from_raw(256)));
    (r, describe(st))
}
