//! The GPU path. Without a CUDA driver, NCCL or a device these tests check that gradwire
//! says so clearly (no panic, from Rust and through the C ABI) and skip the device work
//! with the reason; on a GPU machine they run NCCL for real: every collective on device
//! memory, from Rust and from C, on one node and across two "nodes" sharing the GPU (a
//! one-rank NCCL communicator each, joined by gradwire's tcp/shm).
#![cfg(feature = "cuda")]

mod common;
use common::*;

#[test]
fn missing_gpu_is_explained_not_a_panic() {
    match gradwire::gpu::unavailable() {
        Some(why) => {
            eprintln!("SKIP GPU device tests: {why}");
            assert!(
                why.contains("searched") || why.contains("no GPU") || why.contains("NCCL is at") || why.contains("cannot count"),
                "unhelpful reason: {why}"
            );
            // The same reason comes back as an error, not a panic, from the NCCL entry point.
            std::env::set_var("RANK", "0");
            std::env::set_var("WORLD_SIZE", "1");
            let comm = gradwire::Communicator::init().unwrap();
            let err = gradwire::gpu::DeviceComm::new(&comm, 0).err().expect("no GPU here, so this must fail");
            assert!(matches!(err, gradwire::Error::Unsupported(_)), "{err}");
            let err = gradwire::gpu::DeviceComm::on_local_device(&comm).err().expect("no GPU here, so this must fail");
            assert!(matches!(err, gradwire::Error::Unsupported(_)), "{err}");
            // And from the commands, on every rank (they once counted devices first, which
            // panics inside cudarc where there is no driver).
            for cmd in ["gpu-check", "gpu-bench"] {
                let out = launch(2, &[], &[cmd], &[]);
                let t = text(&out);
                assert!(!out.status.success() && !t.contains("panicked"), "{cmd}: {t}");
                for rank in 0..2 {
                    assert!(t.contains(&format!("rank {rank}: gradwire {cmd}: unsupported: ")), "{cmd}, rank {rank}: {t}");
                }
            }
        }
        None => eprintln!("GPU available: the device tests below run for real"),
    }
}

#[test]
fn nccl_collectives_on_device_memory() {
    if let Some(why) = gradwire::gpu::unavailable() {
        eprintln!("SKIP nccl_collectives_on_device_memory: {why}");
        return;
    }
    let out = launch(1, &[], &["gpu-check"], &[]);
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{t}");
}

/// NCCL runs one rank per GPU: two ranks of one node left with one visible GPU are refused
/// on both ranks, naming the pair and the way out, instead of failing inside
/// `ncclCommInitRank` with NCCL's bare "invalid usage".
#[test]
fn two_ranks_of_a_node_on_one_gpu_are_refused_with_the_reason() {
    if let Some(why) = gradwire::gpu::unavailable() {
        eprintln!("SKIP two_ranks_of_a_node_on_one_gpu_are_refused_with_the_reason: {why}");
        return;
    }
    let out = launch(2, &[], &["gpu-check"], &[("CUDA_VISIBLE_DEVICES", "0")]);
    let t = text(&out);
    println!("{t}");
    assert!(!out.status.success(), "two ranks on one GPU must fail:\n{t}");
    for rank in 0..2 {
        let line = t.lines().find(|l| l.contains(&format!("rank {rank}")) && l.contains("ranks 0 and 1 of one node both chose the same GPU"));
        assert!(line.is_some_and(|l| l.contains("GRADWIRE_HOST_ID")), "rank {rank} must name the pair and the way out:\n{t}");
    }
}

#[test]
fn hierarchical_allreduce_two_processes_sharing_the_gpu() {
    if let Some(why) = gradwire::gpu::unavailable() {
        eprintln!("SKIP hierarchical_allreduce_two_processes_sharing_the_gpu: {why}");
        return;
    }
    // Each process is its own "node" (distinct host ids), so NCCL sees one rank per
    // communicator and the cross-node step is gradwire's.
    let script = format!("GRADWIRE_HOST_ID=node$RANK exec {} gpu-check --hierarchical", bin());
    let mut cmd = std::process::Command::new(bin());
    cmd.args(["launch", "-n", "2", "--", "sh", "-c", &script]);
    let out = run_with_limit(cmd, std::time::Duration::from_secs(300));
    let t = text(&out);
    println!("{t}");
    assert!(out.status.success(), "{t}");
}

/// The C example (ffi/examples/gpu.c): without a GPU every rank gets
/// GRADWIRE_ERR_UNSUPPORTED with gradwire's reason from `gradwire_gpu_comm_create`; with
/// one, every collective on device memory is checked on one node and across two.
#[test]
fn c_example_on_device_memory() {
    let exe = c_program("ffi/examples/gpu.c", "gpu-c-example");
    let exe = exe.display().to_string();
    let runs: Vec<(usize, String)> = match gradwire::gpu::unavailable() {
        Some(_) => vec![(2, exe.clone())],
        None => vec![(1, exe.clone()), (2, format!("GRADWIRE_HOST_ID=node$RANK exec {exe}"))],
    };
    for (n, script) in runs {
        let mut cmd = std::process::Command::new(bin());
        cmd.args(["launch", "-n", &n.to_string(), "--", "sh", "-c", &script]);
        let out = run_with_limit(cmd, std::time::Duration::from_secs(300));
        let t = text(&out);
        println!("{t}");
        assert!(out.status.success(), "{t}");
        match gradwire::gpu::unavailable() {
            Some(why) => {
                assert_eq!(t.matches("SKIP: no GPU here: ").count(), n, "{t}");
                assert!(t.contains(why.split(';').next().unwrap_or(&why)), "the C caller should see gradwire's reason ({why}): {t}");
            }
            None => assert_eq!(t.matches(": 0 wrong elements").count(), n, "{t}"),
        }
    }
}
