//! Every collective x dtype x op x count, on real processes started by `gradwire launch`,
//! over shm, tcp on loopback, and tcp across network namespaces; compared by
//! `gradwire check` with an independent reference on fresh random data.
//!
//! Counts: 0, 1, a prime (7919), one not divisible by the world size (1003 — and 7919), and
//! 64 MiB (f32 sum allreduce with every algorithm and broadcast; the full dtype/op matrix at
//! 64 MiB would take minutes on a 2-core CI machine and exercises no extra code path:
//! segmenting and chunking are size-driven, not dtype-driven).

mod common;
use common::*;

fn check(n: usize, transport: &str, launch_args: &[&str], extra: &[&str]) {
    check_with_env(n, transport, launch_args, extra, &[])
}

fn check_with_env(n: usize, transport: &str, launch_args: &[&str], extra: &[&str], env: &[(&str, &str)]) {
    let mut args = vec!["check", "--transport", transport];
    args.extend_from_slice(extra);
    let out = launch(n, launch_args, &args, env);
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "check failed with {n} ranks over {transport}:\n{t}");
    assert!(t.contains(", 0 failed"), "no summary line:\n{t}");
    assert!(!t.contains("panicked"), "{t}");
}

macro_rules! matrix {
    ($($name:ident: $n:expr, $transport:expr;)*) => {$(
        #[test]
        fn $name() {
            check($n, $transport, &[], &[]);
        }
    )*};
}

matrix! {
    world1: 1, "auto";
    shm_world2: 2, "shm";
    shm_world3: 3, "shm";
    shm_world4: 4, "shm";
    shm_world8: 8, "shm";
    tcp_world2: 2, "tcp";
    tcp_world3: 3, "tcp";
    tcp_world4: 4, "tcp";
    tcp_world8: 8, "tcp";
}

const LARGE: &[&str] = &["--large", "64M", "--counts", "7919", "--collectives", "allreduce,broadcast,reduce", "--dtypes", "float32", "--ops", "sum"];

#[test]
fn shm_64mib() {
    check(4, "shm", &[], LARGE);
}

/// Allgather and all-to-all whose send and receive together outgrow the last-level cache
/// (64 MiB in all here, against this host's 32 MiB), and a broadcast whose buffer does,
/// write their output with streaming stores: staged (private buffers), whichever kind the
/// staging takes, and straight out of the peers' buffers (shared ones). An odd world gives
/// a middle rank, whose own block lies between its peers'.
#[test]
fn shm_outputs_beyond_the_cache() {
    let args = |buffers| {
        ["--buffers", buffers, "--large", "64M", "--counts", "7919", "--collectives", "allgather,alltoall,broadcast", "--dtypes", "float32", "--ops", "sum"]
    };
    for stores in ["plain", "streaming"] {
        check_with_env(3, "shm", &[], &args("private"), &[("GRADWIRE_SHM_STORES", stores)]);
    }
    check(3, "shm", &[], &args("shared"));
}

/// Without cross-memory attach (`GRADWIRE_SHM_CMA=0`, or a kernel that refuses it),
/// large one-host allreduces on private buffers go staged in segments of about 1 MiB:
/// every dtype and op, an odd world (uneven parts) and an odd count (parts not a whole
/// number of blocks, a last segment shorter than the others).
#[test]
fn shm_staged_segments_every_dtype_and_op() {
    let staged = ("GRADWIRE_SHM_CMA", "0");
    check_with_env(3, "shm", &[], &["--counts", "4500007", "--collectives", "allreduce"], &[staged]);
    // Both kinds of stores the staged form can write with (auto picks per call).
    for stores in ["plain", "streaming"] {
        let args = ["--counts", "4500007", "--collectives", "allreduce", "--dtypes", "float32,bfloat16", "--ops", "sum,avg"];
        check_with_env(2, "shm", &[], &args, &[("GRADWIRE_SHM_STORES", stores), staged]);
    }
}

/// From 256 KiB, one-host allreduces on private buffers reach the peers' buffers through
/// cross-memory attach: every dtype and op at 2 and 3 ranks (uneven parts, parts that are
/// not a whole number of blocks; 65537 elements straddle the threshold, which 2-byte
/// dtypes stay below), and at 4 ranks on 2 cores the 4- and 8-byte dtypes; the log shows
/// that every rank took that form (or, where the kernel refuses it, staged).
#[test]
fn shm_cross_memory_attach_every_dtype_and_op() {
    let allowed = cross_memory_attach_allowed("shm_cross_memory_attach_every_dtype_and_op");
    for (n, counts) in [(3, "1000003,65537"), (2, "1000003"), (4, "70001")] {
        let args = ["check", "--transport", "shm", "--counts", counts, "--collectives", "allreduce"];
        let out = launch(n, &[], &args, &[("GRADWIRE_LOG", "debug")]);
        let t = text(&out);
        assert!(out.status.success() && t.contains(", 0 failed") && !t.contains("panicked"), "{t}");
        every_rank_logged(&t, n, if allowed { "through cross-memory attach" } else { "refused" });
        assert!(!t.contains("zero-copy"), "private buffers are not mapped:\n{t}");
    }
}

/// Reduce-scatter, allgather, all-to-all, broadcast and reduce of private buffers from 256
/// KiB time cross-memory attach against staging and keep the faster: rank 0 decides for all
/// (the others follow it), so every rank takes attach in the first tries (the log shows it)
/// and rank 0 says which it keeps; where the kernel refuses it, every rank says so and
/// stages. The check after the timed calls finds no wrong element (every call of both
/// forms is checked in `tests/engine.rs`, `shm_private_buffers_attached_or_staged_all_match`).
#[test]
fn shm_other_collectives_time_attach_against_staging_and_say_so() {
    let allowed = cross_memory_attach_allowed("shm_other_collectives_time_attach_against_staging_and_say_so");
    for coll in ["reduce_scatter", "allgather", "alltoall", "broadcast", "reduce"] {
        let args = ["bench", coll, "-b", "1M", "-e", "1M", "-n", "10", "-w", "0", "--transport", "shm", "--check"];
        let out = launch(3, &[], &args, &[("GRADWIRE_LOG", "debug")]);
        let t = text(&out);
        assert!(out.status.success() && !t.contains("panicked"), "{coll}: {t}");
        // The table's one row (1 MiB, less what does not divide into 3 parts).
        let row = t.lines().find(|l| l.trim_start().starts_with("10485")).unwrap_or_else(|| panic!("{coll}: no 1 MiB row:\n{t}"));
        assert_eq!(row.split_whitespace().last(), Some("0"), "{coll}: wrong elements:\n{t}");
        if allowed {
            every_rank_logged(&t, 3, "through cross-memory attach");
            assert!(t.lines().any(|l| l.contains("rank 0: ") && l.contains("(private buffers): ")), "{coll}: rank 0 never said which form it keeps:\n{t}");
            assert!(!t.lines().any(|l| !l.contains("rank 0: ") && l.contains("(private buffers): ")), "{coll}: only rank 0 decides:\n{t}");
        } else {
            every_rank_logged(&t, 3, "refused");
        }
    }
}

/// An 8 KiB staging area, no cross-memory attach: segments of 6 KiB (33 to 130 per call of
/// 100003 elements) and a short last one. The staged form has no barrier after its copy-out, so a rank starts its
/// next segment while a slower peer may still copy out of the last one; with more ranks
/// than cores that happens all the time. (`check` syncs the ranks between calls; calls
/// back to back: `tests/engine.rs`, `shm_allreduces_back_to_back_all_match`.)
#[test]
fn shm_staged_tiny_segments_back_to_back() {
    for n in [3, 4] {
        check_with_env(
            n,
            "shm",
            &[],
            &["--counts", "1,7919,100003", "--collectives", "allreduce"],
            &[("GRADWIRE_SHM_STAGE_BYTES", "8192"), ("GRADWIRE_SHM_CMA", "0")],
        );
    }
}

/// The staged form times both kinds of stores and says which it keeps, on every rank,
/// while the results stay right (`--check` after the timed calls).
#[test]
fn shm_staged_form_chooses_its_stores_and_says_so() {
    let out = launch(
        3,
        &[],
        &["bench", "allreduce", "-b", "2M", "-e", "2M", "-n", "8", "-w", "2", "--transport", "shm", "--check"],
        &[("GRADWIRE_LOG", "debug"), ("GRADWIRE_SHM_CMA", "0")],
    );
    let t = text(&out);
    assert!(out.status.success() && !t.contains("panicked"), "{t}");
    for rank in 0..3 {
        let chose = |l: &&str| l.contains(&format!("rank {rank}: the staged allreduce of 2097152 bytes of float32 now uses")) && l.contains("ns/B");
        assert!(
            t.lines().any(|l| chose(&l)),
            "rank {rank} never said which stores it keeps:
{t}"
        );
    }
}

/// Where the kernel refuses cross-memory attach (here a seccomp filter, as in a container;
/// Yama refuses it the same way), every rank says so once, the call stages, and from then
/// on the ranks agree on a form only from 4 MiB (a 4.4 MB call stages after that
/// agreement's first barrier); every result stays right.
#[test]
fn shm_cross_memory_attach_refused_stages() {
    let root = env!("CARGO_MANIFEST_DIR");
    let deny = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("deny-cross-memory-attach");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = std::process::Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&deny)
        .arg(format!("{root}/tests/c/deny_cross_memory_attach.c"))
        .output()
        .expect("run the C compiler");
    assert!(built.status.success(), "tests/c/deny_cross_memory_attach.c does not compile:\n{}", text(&built));
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["launch", "-n", "3", "--"]).arg(&deny).arg(bin()).env("GRADWIRE_LOG", "debug");
    cmd.args(["check", "--transport", "shm", "--counts", "70001,1100000", "--collectives", "allreduce", "--dtypes", "float32", "--ops", "sum,max"]);
    let out = run_with_limit(cmd, std::time::Duration::from_secs(300));
    let t = text(&out);
    assert!(out.status.success() && t.contains(", 0 failed") && !t.contains("panicked"), "{t}");
    every_rank_logged(&t, 3, "refused (Operation not permitted");
    every_rank_logged(&t, 3, "only calls from 4194304 bytes look for mapped buffers");
    assert!(!t.contains("through cross-memory attach"), "no rank may attach where the kernel refuses:\n{t}");
    assert_eq!(t.matches("refused (Operation not permitted").count(), 3, "each rank says it once:\n{t}");
}

/// Reduce-scatter, allgather, all-to-all, broadcast, reduce and barrier on one host, every
/// dtype and op, with every kind of buffer, against the reference: staged below 256 KiB
/// and wherever a buffer is private; from 256 KiB straight out of the peers' mapped
/// buffers where all are shared or registered (registered ones with their partial pages
/// from the staged copies), which every rank says for each collective.
#[test]
fn shm_every_collective_every_buffer_kind() {
    for buffers in ["private", "shared", "registered", "mixed"] {
        let args = [
            "check",
            "--transport",
            "shm",
            "--buffers",
            buffers,
            "--counts",
            "1,70001,300007",
            "--collectives",
            "reduce_scatter,allgather,alltoall,broadcast,reduce,barrier",
        ];
        let out = launch(3, &[], &args, &[("GRADWIRE_LOG", "debug")]);
        let t = text(&out);
        assert!(out.status.success() && t.contains(", 0 failed") && !t.contains("panicked"), "{buffers}:\n{t}");
        if matches!(buffers, "shared" | "registered") {
            for coll in ["reduce_scatter#", "allgather#", "alltoall#", "broadcast#", "reduce#"] {
                let said = |r: usize| t.lines().any(|l| l.contains(&format!("rank {r}: {coll}")) && l.contains("zero-copy in the peers' buffers"));
                assert!((0..3).all(said), "{buffers}: not every rank ran {coll} in the peers' buffers:\n{t}");
            }
        } else {
            assert!(!t.contains("zero-copy"), "{buffers}: private buffers are never mapped:\n{t}");
        }
    }
}

/// Buffers from gradwire's allocator (`gradwire_alloc`): from 256 KiB the one-host
/// allreduce maps the peers' buffers and works in them (zero-copy), every dtype and op;
/// the log shows every rank mapped every peer. Mixed (shared on even ranks only): the
/// ranks agree on cross-memory attach instead (where the kernel allows it), and nobody
/// maps anything.
#[test]
fn shm_shared_buffers() {
    let shared = ["check", "--transport", "shm", "--buffers", "shared", "--counts", "4500007,1003", "--collectives", "allreduce"];
    let out = launch(3, &[], &shared, &[("GRADWIRE_LOG", "debug")]);
    let t = text(&out);
    assert!(out.status.success() && t.contains(", 0 failed"), "{t}");
    for (rank, peer) in [(0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1)] {
        assert!(t.contains(&format!("rank {rank}: mapped rank {peer}'s shared buffer")), "rank {rank} never mapped rank {peer}'s buffer:\n{t}");
    }
    every_rank_logged(&t, 3, "zero-copy in the peers' buffers");
    let mixed = [
        "check",
        "--transport",
        "shm",
        "--buffers",
        "mixed",
        "--counts",
        "4500007",
        "--collectives",
        "allreduce",
        "--dtypes",
        "float32,float16",
        "--ops",
        "sum,avg",
    ];
    let out = launch(4, &[], &mixed, &[("GRADWIRE_LOG", "debug")]);
    let t = text(&out);
    assert!(out.status.success() && t.contains(", 0 failed"), "{t}");
    assert!(!t.contains("mapped rank") && !t.contains("zero-copy"), "with a private buffer among them nobody maps anything:\n{t}");
    if cross_memory_attach_allowed("shm_shared_buffers") {
        every_rank_logged(&t, 4, "through cross-memory attach");
    }
}

/// Private buffers registered in place (`gradwire_register`), each rank's starting a
/// different way into a page: from 256 KiB the one-host allreduce works in the peers'
/// buffers as with `gradwire_alloc` ones, all but the partial pages at the ends, which
/// every rank reduces from copies all ranks staged; elements of 2, 4 and 8 bytes, against
/// the reference. With a staging area too small for those copies, no zero-copy.
#[test]
fn shm_registered_buffers() {
    let args = [
        "check",
        "--transport",
        "shm",
        "--buffers",
        "registered",
        "--counts",
        "4500007,1003",
        "--collectives",
        "allreduce",
        "--dtypes",
        "float32,float64,float16",
        "--ops",
        "sum,avg,max",
    ];
    let out = launch(3, &[], &args, &[("GRADWIRE_LOG", "debug")]);
    let t = text(&out);
    assert!(out.status.success() && t.contains(", 0 failed"), "{t}");
    every_rank_logged(&t, 3, "zero-copy in the peers' buffers (");
    // 4500007 elements of 2 bytes: all but the partial pages.
    assert!(t.contains("of 9000014 bytes)") && !t.contains("(9000014 of 9000014 bytes)"), "the partial pages were not left out of the zero-copy body:\n{t}");
    every_rank_logged(&t, 3, "outside the shared pages reduced from the staged copies");
    // A staging area without room for two pages per rank: the other forms take over.
    let small = [&args[..9], &["--dtypes", "float16", "--ops", "sum"]].concat();
    let out = launch(3, &[], &small, &[("GRADWIRE_LOG", "debug"), ("GRADWIRE_SHM_STAGE_BYTES", "8192")]);
    let t = text(&out);
    assert!(out.status.success() && t.contains(", 0 failed"), "{t}");
    assert!(!t.contains("zero-copy"), "no room to stage the ends, yet zero-copy:\n{t}");
}

#[test]
fn tcp_64mib() {
    check(3, "tcp", &[], LARGE);
}

/// Ring collectives cut every part into chunks that move on their own (forwarded as soon as
/// they arrive). Tiny chunks make every count of the matrix span many chunks, up to the cap
/// of 64 per part, with parts of uneven length and chunks of a few elements.
#[test]
fn ring_in_tiny_chunks() {
    let env = [("GRADWIRE_RING_CHUNK_BYTES", "64")];
    let counts = ["--counts", "1,3,1003,7919,100003"];
    check_with_env(3, "tcp", &[], &counts, &env);
    check_with_env(4, "tcp", &[], &counts, &env);
    // Ring over shared-memory links (the check runs every allreduce algorithm).
    check_with_env(2, "shm", &[], &counts, &env);
}

#[test]
fn netns_world3_tcp() {
    if can_netns("netns_world3_tcp") {
        check(3, "auto", &["--netns"], &[]);
    }
}

#[test]
fn netns_world4_two_per_node_shm_and_tcp() {
    if can_netns("netns_world4_two_per_node_shm_and_tcp") {
        check(4, "auto", &["--netns", "--ranks-per-node", "2"], &[]);
    }
}

#[test]
fn netns_world8_shaped() {
    if can_netns("netns_world8_shaped") {
        check(8, "auto", &["--netns", "--link-gbit", "10"], &["--counts", "0,1,7919,8003"]);
    }
}

#[test]
fn netns_64mib() {
    if can_netns("netns_64mib") {
        check(3, "auto", &["--netns"], LARGE);
    }
}

#[test]
fn sub_communicators_from_split() {
    // Node-local and cross-node groups on 2 namespaces x 2 ranks, checked with the same
    // reference through `gradwire check --split`.
    if can_netns("sub_communicators_from_split") {
        check(4, "auto", &["--netns", "--ranks-per-node", "2"], &["--split", "--counts", "1,7919"]);
    }
    check(4, "auto", &[], &["--split", "--counts", "1,7919"]);
}

/// A control group that confines the job to one CPU (as a container's cpuset does) makes
/// two ranks on a host of several CPUs wait by yielding instead of spinning, and the
/// collectives stay correct. Real cgroup v1 cpuset (or v2 with the cpuset controller);
/// skipped where neither can be created (not root, or no such hierarchy).
#[test]
fn ranks_confined_to_one_cpu_by_a_cpuset_do_not_spin() {
    let name = format!("gradwire-test-{}", std::process::id());
    let v1 = std::path::Path::new("/sys/fs/cgroup/cpuset");
    let v2_has_cpuset = std::fs::read_to_string("/sys/fs/cgroup/cgroup.subtree_control").is_ok_and(|t| t.split_whitespace().any(|c| c == "cpuset"));
    let (dir, cpus_file) = if v1.join("cpuset.cpus").exists() {
        (v1.join(&name), "cpuset.cpus")
    } else if v2_has_cpuset {
        (std::path::Path::new("/sys/fs/cgroup").join(&name), "cpuset.cpus")
    } else {
        skip("ranks_confined_to_one_cpu_by_a_cpuset_do_not_spin", "no writable cpuset hierarchy");
        return;
    };
    let made = std::fs::create_dir(&dir).and_then(|()| std::fs::write(dir.join(cpus_file), "0")).and_then(|()| {
        if dir.join("cpuset.mems").exists() {
            std::fs::write(dir.join("cpuset.mems"), "0")
        } else {
            Ok(())
        }
    });
    if let Err(e) = made {
        let _ = std::fs::remove_dir(&dir);
        skip("ranks_confined_to_one_cpu_by_a_cpuset_do_not_spin", &format!("cannot make cgroup {}: {e}", dir.display()));
        return;
    }
    // The shell joins the group, then becomes the launcher: everything it starts is inside.
    let procs = dir.join(if dir.join("tasks").exists() { "tasks" } else { "cgroup.procs" });
    let confined = |args: &str| {
        let mut cmd = std::process::Command::new("sh");
        cmd.arg("-c").arg(format!("echo $$ > {} && exec {} {args}", procs.display(), bin())).env("GRADWIRE_LOG", "debug");
        run_with_limit(cmd, std::time::Duration::from_secs(120))
    };
    let info = confined("info");
    let check = confined(&format!("launch -n 2 -- {} check --transport shm --collectives allreduce,broadcast --dtypes float32 --counts 1,7919,300000", bin()));
    // Whatever a killed run left in the group goes too, so that the group can be removed.
    for pid in std::fs::read_to_string(&procs).unwrap_or_default().split_whitespace() {
        let _ = std::process::Command::new("kill").args(["-9", pid]).status();
    }
    let gone = (0..50).any(|_| {
        let removed = std::fs::remove_dir(&dir).is_ok();
        if !removed {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        removed
    });
    assert!(gone, "could not remove cgroup {}", dir.display());
    let (ti, tc) = (text(&info), text(&check));
    assert!(info.status.success() && ti.contains("cpus               1 "), "{ti}");
    assert!(check.status.success(), "{tc}");
    for r in 0..2 {
        assert!(tc.contains(&format!("rank {r}: 2 ranks on this host, 1 CPUs for them: spin 0 us")), "rank {r} did not give up spinning:\n{tc}");
    }
}
