//! Issue 59, round three of faults and bad input, from a C host (tests/c/round_three.c):
//! a hierarchical allreduce with mismatched counts, a peer lost over tcp with SIGPIPE at its
//! default disposition, and array counts whose bytes overflow.

mod common;
use common::*;
use std::process::{Child, Command, Stdio};
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

/// A C host that leaves SIGPIPE at its default: the survivor's writes to the dead peer's
/// socket must fail as GRADWIRE_ERR_PEER_LOST, not kill it. Twelve rounds: the write that
/// would raise SIGPIPE comes at a different point of the transfer each time, and without
/// MSG_NOSIGNAL about one survivor in three died of it (11 of 30 runs), so all twelve
/// survive by chance less than once in 200.
#[test]
fn peer_lost_over_tcp_is_an_error_not_sigpipe() {
    let exe = program();
    for round in 0..12 {
        // Half the rounds kill rank 0, whose rendezvous store the survivor then asks for the
        // reason over a connection that is gone.
        let (victim_rank, survivor_rank) = if round % 2 == 0 { (1, 0) } else { (0, 1) };
        let port = free_port();
        let spawn = |rank: usize| -> Child {
            let mut cmd = Command::new(&exe);
            cmd.arg("peer-lost").stdout(Stdio::piped()).stderr(Stdio::piped());
            rank_env(&mut cmd, rank, 2, port, "round-three-secret");
            cmd.env("GRADWIRE_TRANSPORT", "tcp").env("GRADWIRE_TIMEOUT_MS", "10000").env("ROUND_THREE_VICTIM", victim_rank.to_string());
            cmd.spawn().expect("spawn a rank")
        };
        let (survivor, victim) = (spawn(survivor_rank), spawn(victim_rank));
        let victim = wait_with_limit(victim, Duration::from_secs(60));
        let out = wait_with_limit(survivor, Duration::from_secs(60));
        let t = text(&out);
        println!("round {round}: {t}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(victim.status.signal(), Some(libc::SIGKILL), "round {round}: the victim did not die as planned:\n{}", text(&victim));
        assert_ne!(out.status.signal(), Some(libc::SIGPIPE), "round {round}: the survivor died of SIGPIPE:\n{t}");
        assert!(out.status.success(), "round {round}: {:?}\n{t}", out.status);
        assert!(t.contains(&format!("rank {survivor_rank}: peer lost:")) && t.contains(&format!("rank {victim_rank}")), "round {round}: {t}");
    }
}

/// Array counts past PTRDIFF_MAX bytes (wrapping or not) are refused before any slice is
/// formed, on a communicator of two ranks that keeps working afterwards.
#[test]
fn overflowing_array_counts_are_refused() {
    let exe = program();
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", "2", "--"]).arg(&exe).arg("overflow").env("GRADWIRE_TIMEOUT_MS", "30000");
    let out = run_with_limit(cmd, Duration::from_secs(120));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{t}");
    assert_eq!(t.matches(": ok").count(), 2, "{t}");
}

/// Connections that fail the job-secret handshake in a loop are logged at a bounded rate
/// (one line per attempt came to 11,986 lines in 15 s): 300 strangers make one line.
#[test]
fn refused_connections_are_logged_at_a_bounded_rate() {
    use gradwire::bootstrap::{auth, StoreServer};
    use std::sync::Mutex;
    use std::time::Instant;
    struct Capture(Mutex<Vec<String>>);
    impl log::Log for Capture {
        fn enabled(&self, m: &log::Metadata) -> bool {
            m.level() <= log::Level::Warn
        }
        fn log(&self, r: &log::Record) {
            self.0.lock().unwrap().push(r.args().to_string());
        }
        fn flush(&self) {}
    }
    static CAPTURE: Capture = Capture(Mutex::new(Vec::new()));
    // nextest runs each test in a process of its own: this logger is the only one.
    log::set_logger(&CAPTURE).expect("a logger was already set");
    log::set_max_level(log::LevelFilter::Warn);
    let store = StoreServer::start("127.0.0.1:0", "the-right-secret").unwrap();
    let addr = store.addr.to_string();
    for _ in 0..300 {
        let stranger = auth::dial(&addr, "a-wrong-secret", b"store", Instant::now() + Duration::from_secs(5), "store");
        assert!(stranger.is_err(), "a wrong secret was admitted");
    }
    std::thread::sleep(Duration::from_millis(500)); // the server's threads log after the client's refusal
    let lines: Vec<String> = CAPTURE.0.lock().unwrap().iter().filter(|l| l.contains("did not prove the job secret")).cloned().collect();
    println!("{} lines: {lines:?}", lines.len());
    assert!(!lines.is_empty() && lines.len() <= 2, "300 refused connections logged {} lines", lines.len());
}
