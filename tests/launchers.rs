//! Ranks started by a cluster's own launcher find each other with no gradwire variable
//! (`bootstrap::launcher`), for the C ABI's `gradwire bench` and for Python's
//! `gradwire.Comm()`: Hydra's `mpiexec` (MPICH's launcher, from `pip install mpich`: PMI-1)
//! and Open MPI's `mpirun` (Debian's: PMIx) across network-namespace nodes; Slurm's `srun`
//! on a one-node cluster the test starts (Debian's slurmctld and slurmd), with PMI
//! (`--mpi=pmi2`) and without (`--mpi=none`: the job file in the shared home).

mod common;
use common::*;
use std::process::Command;
use std::time::Duration;

fn runs(program: &str, version_flag: &str) -> bool {
    Command::new(program).arg(version_flag).output().map(|o| o.status.success()).unwrap_or(false)
}

/// Asserts that each of `world` ranks printed `line(rank)`.
fn every_rank_printed(t: &str, world: usize, line: impl Fn(usize) -> String) {
    for r in 0..world {
        assert!(t.contains(&line(r)), "rank {r} did not finish:\n{t}");
    }
}

/// Whether Hydra's mpiexec is here, as tests/launchers/mpi_netns.sh looks for it.
fn has_hydra() -> bool {
    ["mpiexec", "mpiexec.hydra"].iter().any(|m| Command::new(m).arg("--version").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("HYDRA")))
}

/// `gradwire launch --netns` only makes the nodes; tests/launchers/mpi_netns.sh drops
/// everything it exports and runs `launcher` (hydra or openmpi) with `per_node` ranks on
/// each node's address.
fn under_mpi(launcher: &str, nodes: usize, per_node: usize, program: &[&str]) -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let mut cmd = Command::new(bin());
    cmd.args(["launch", "-n", &nodes.to_string(), "--netns", "--bind", "none", "--timeout", "300", "--"])
        .arg(format!("{root}/tests/launchers/mpi_netns.sh"))
        .arg(launcher)
        .arg(per_node.to_string())
        .args(program)
        .env("PYTHONPATH", format!("{root}/python"))
        .env("GRADWIRE_LIB", cdylib_dir().join("libgradwire.so"))
        // The job's ranks must see no gradwire variable but the library's location.
        .env_remove("GRADWIRE_TEST_REQUIRE");
    let out = run_with_limit(cmd, Duration::from_secs(400));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "the job under {launcher} failed:\n{t}");
    t
}

#[test]
fn hydra_mpiexec_across_nodes_needs_no_gradwire_variable() {
    if !can_netns("hydra_mpiexec_across_nodes_needs_no_gradwire_variable") {
        return;
    }
    if !has_hydra() {
        skip("hydra_mpiexec_across_nodes_needs_no_gradwire_variable", "no mpiexec (pip install mpich)");
        return;
    }
    // The C ABI's communicator (gradwire_comm_init), checked against a reference.
    let t = under_mpi("hydra", 2, 2, &[bin(), "bench", "allreduce", "--check", "-b", "4K", "-e", "1M", "-n", "3"]);
    assert!(t.contains("1048576"), "no 1 MiB row:\n{t}");
    // Python's Comm(): 4 ranks, gradwire's nodes the namespaces Hydra placed them in.
    let t = under_mpi("hydra", 2, 2, &["python3", &format!("{}/python/tests/launcher_comm.py", env!("CARGO_MANIFEST_DIR")), "--per-node", "2"]);
    every_rank_printed(&t, 4, |r| format!("launcher comm: ok (rank {r} of 4)"));
}

#[test]
fn openmpi_mpirun_across_nodes_needs_no_gradwire_variable() {
    if !can_netns("openmpi_mpirun_across_nodes_needs_no_gradwire_variable") {
        return;
    }
    if !runs("mpiexec.openmpi", "--version") {
        skip("openmpi_mpirun_across_nodes_needs_no_gradwire_variable", "no Open MPI (Debian: openmpi-bin)");
        return;
    }
    let t = under_mpi("openmpi", 2, 2, &[bin(), "bench", "allreduce", "--check", "-b", "4K", "-e", "1M", "-n", "3"]);
    assert!(t.contains("1048576"), "no 1 MiB row:\n{t}");
    let t = under_mpi("openmpi", 2, 2, &["python3", &format!("{}/python/tests/launcher_comm.py", env!("CARGO_MANIFEST_DIR")), "--per-node", "2"]);
    every_rank_printed(&t, 4, |r| format!("launcher comm: ok (rank {r} of 4)"));
}

/// A program that runs on MPI itself (ffi/examples/mpi_unique_id.c, built with Open MPI's
/// compiler wrapper) broadcasts rank 0's unique id with `MPI_Bcast` and checks gradwire's
/// allreduce against `MPI_Allreduce`, across namespace nodes under Open MPI's `mpirun`.
#[test]
fn an_mpi_program_broadcasts_the_unique_id_itself() {
    if !can_netns("an_mpi_program_broadcasts_the_unique_id_itself") {
        return;
    }
    if !runs("mpicc.openmpi", "--version") {
        skip("an_mpi_program_broadcasts_the_unique_id_itself", "no Open MPI compiler (Debian: libopenmpi-dev)");
        return;
    }
    let exe = c_program_with("mpicc.openmpi", "ffi/examples/mpi_unique_id.c", "mpi-unique-id-c-example");
    let t = under_mpi("openmpi", 2, 2, &[exe.to_str().unwrap()]);
    every_rank_printed(&t, 4, |r| format!("rank {r} of 4: ok"));
}

/// `srun -n 4` on a one-node Slurm cluster (tests/launchers/slurm_single_host.sh), with a
/// PMI server (`--mpi=pmi2`, which speaks PMI-1 too), with PMIx (`--mpi=pmix`: Slurm's
/// plugin loads libpmix through libpmix-dev's link) and with none (`--mpi=none`, the
/// default of many clusters: rank 0's id goes through a 0600 job file in `$HOME`, here a
/// fresh directory, which holds no job file afterwards); then a Heat DASO script
/// (python/examples/heat_daso.py) under plain `srun`.
#[test]
fn slurm_srun_needs_no_gradwire_variable() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        skip("slurm_srun_needs_no_gradwire_variable", "slurmd starts tasks as their user and needs root");
        return;
    }
    if !runs("slurmd", "-V") || !runs("slurmctld", "-V") {
        skip("slurm_srun_needs_no_gradwire_variable", "no Slurm (Debian: slurmctld slurmd slurm-client)");
        return;
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let home = std::env::temp_dir().join(format!("gw-slurm-home-{}", std::process::id()));
    std::fs::create_dir_all(&home).unwrap();
    let comm = format!("{root}/python/tests/launcher_comm.py");
    let script = format!(
        "set -e; for mpi in pmi2 pmix none; do echo \"== --mpi=$mpi\"; srun --mpi=$mpi -n 4 python3 {comm} --per-node 4; \
         srun --mpi=$mpi -n 4 {bench} bench allreduce --check -b 4K -e 256K -n 2 | tail -n 1; done; \
         echo '== Heat'; srun -n 4 python3 {root}/python/examples/heat_daso.py",
        bench = bin()
    );
    let mut cmd = Command::new(format!("{root}/tests/launchers/slurm_single_host.sh"));
    cmd.args(["4", "bash", "-c", &script])
        .env("HOME", &home)
        .env("PYTHONPATH", format!("{root}/python"))
        .env("GRADWIRE_LIB", cdylib_dir().join("libgradwire.so"));
    for k in ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GRADWIRE_JOB_SECRET", "GRADWIRE_TEST_REQUIRE", "SLURM_CONF"] {
        cmd.env_remove(k);
    }
    let out = run_with_limit(cmd, Duration::from_secs(300));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "the jobs under srun failed:\n{t}");
    for (mpi, part) in t.split("== --mpi=").skip(1).map(|p| (p.lines().next().unwrap_or(""), p)) {
        for r in 0..4 {
            assert!(part.contains(&format!("launcher comm: ok (rank {r} of 4)")), "--mpi={mpi}: rank {r} did not finish:\n{t}");
        }
        assert!(part.contains("262144"), "--mpi={mpi}: no 256 KiB row from gradwire bench:\n{t}");
    }
    assert_eq!(t.matches("== --mpi=").count(), 3, "{t}");
    // A Heat DASO script as Heat's users start it: every rank ends with the same parameters.
    let finals: Vec<&str> = t.lines().filter_map(|l| l.split_once(": final test acc").map(|(_, rest)| rest)).collect();
    assert!(finals.len() == 4 && finals.iter().all(|f| *f == finals[0]), "the Heat DASO ranks disagree or did not finish:\n{t}");
    let left: Vec<_> = std::fs::read_dir(home.join(".gradwire/jobs")).map(|d| d.flatten().map(|e| e.file_name()).collect()).unwrap_or_default();
    assert!(left.is_empty(), "job files left behind: {left:?}");
    std::fs::remove_dir_all(&home).unwrap();
}

/// Where every test must run (`GRADWIRE_TEST_REQUIRE=all`, as `.ci/run` sets it) a test whose
/// dependency is missing fails instead of passing as a skip: the Slurm test, run by this
/// binary with a `PATH` that has no Slurm, skips without the variable and fails with it.
#[test]
fn a_test_lacking_its_dependency_fails_where_every_test_must_run() {
    let run = |require: bool| {
        let mut cmd = Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "slurm_srun_needs_no_gradwire_variable", "--nocapture"]).env("PATH", "/nonexistent");
        if require {
            cmd.env("GRADWIRE_TEST_REQUIRE", "all");
        } else {
            cmd.env_remove("GRADWIRE_TEST_REQUIRE");
        }
        run_with_limit(cmd, Duration::from_secs(60))
    };
    let (skipped, failed) = (run(false), run(true));
    let (ts, tf) = (text(&skipped), text(&failed));
    assert!(skipped.status.success() && ts.contains("SKIP slurm_srun_needs_no_gradwire_variable"), "without the variable the test skips:\n{ts}");
    assert!(
        !failed.status.success() && tf.contains("slurm_srun_needs_no_gradwire_variable cannot run here") && tf.contains("GRADWIRE_TEST_REQUIRE=all"),
        "with it the test fails:\n{tf}"
    );
}
