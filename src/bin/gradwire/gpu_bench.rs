//! `gradwire gpu-bench`: the GPU path's figures, under `gradwire launch` on a GPU machine.
//! Per size: the allreduce on device memory (NCCL inside the node; across nodes the
//! hierarchical path through pinned memory) beside gradwire's host allreduce of the same
//! bytes in the same run, then the same for the all-to-all; then the staging copies (the
//! registered region the hierarchical path crosses through) against the same copies from
//! `cuMemAllocHost` memory.

use gradwire::gpu::{staging_bandwidth, DeviceComm};
use gradwire::{Communicator, DType, ReduceOp, Result};
use std::time::Instant;

/// Mean seconds per call of `call` after 3 warm-up calls, the ranks starting together;
/// `sync` waits for the device's work.
fn per_call(comm: &Communicator, iters: usize, mut call: impl FnMut() -> Result<()>, sync: impl Fn() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        call()?;
    }
    sync()?;
    comm.barrier()?;
    let t = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    sync()?;
    Ok(t.elapsed().as_secs_f64() / iters as f64)
}

pub fn run(comm: &Communicator, sizes: &[usize], iters: usize) -> Result<bool> {
    let dc = DeviceComm::on_local_device(comm)?;
    let stream = dc.context().new_stream()?;
    let lead = comm.rank() == 0;
    let w = comm.size();
    let sync = || stream.synchronize().map_err(gradwire::Error::from);
    for all_to_all in [false, true] {
        if lead {
            let what = if all_to_all { "all-to-all (bytes: each rank's buffer)" } else { "allreduce, float32 sum" };
            println!("# gpu-bench: {w} ranks on {} node(s), NCCL groups of {}, {what}, {iters} iterations", dc.nodes(), dc.local_size());
            println!("{:>12} {:>12} {:>12} {:>12} {:>12}", "bytes", "gpu_us", "gpu_algbw", "host_us", "host_algbw");
        }
        for &bytes in sizes {
            // Whole blocks of at least one element for every rank's all-to-all.
            let n = (bytes / 4 / w).max(1) * w;
            let dev = stream.alloc_zeros::<f32>(n)?;
            let out = stream.alloc_zeros::<f32>(n)?;
            let (p, _) = cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
            let (q, _) = cudarc::driver::DevicePtr::device_ptr(&out, &stream);
            let s = stream.cu_stream();
            let mut host = vec![0f32; n];
            let mut host_out = vec![0f32; n];
            let (gpu_s, host_s) = if all_to_all {
                // SAFETY: `dev` and `out` hold n f32 on this device and outlive the synchronisation.
                let gpu = per_call(comm, iters, || unsafe { dc.alltoall(comm, p, q, None, n / w, DType::F32, s) }, sync)?;
                (gpu, per_call(comm, iters, || comm.alltoall(&host, &mut host_out), || Ok(()))?)
            } else {
                // SAFETY: `dev` holds n f32 on this device and outlives the synchronisation.
                let gpu = per_call(comm, iters, || unsafe { dc.allreduce(comm, p, p, n, DType::F32, ReduceOp::Sum, s) }, sync)?;
                (gpu, per_call(comm, iters, || comm.allreduce(&mut host, ReduceOp::Sum), || Ok(()))?)
            };
            if lead {
                let b = n * 4;
                println!("{b:>12} {:>12.1} {:>12.2} {:>12.1} {:>12.2}", gpu_s * 1e6, b as f64 / gpu_s / 1e9, host_s * 1e6, b as f64 / host_s / 1e9);
            }
        }
    }
    if lead {
        println!("# staging copies, GB/s (best of 5): gradwire's registered region against cuMemAllocHost memory");
        println!("{:>12} {:>10} {:>10} {:>10} {:>10} {:>8}", "bytes", "stage_d2h", "stage_h2d", "pinned_d2h", "pinned_h2d", "ratio");
        for &bytes in sizes {
            let [sd, sh, pd, ph] = staging_bandwidth(dc.device(), bytes, 5)?;
            println!("{bytes:>12} {sd:>10.2} {sh:>10.2} {pd:>10.2} {ph:>10.2} {:>8.3}", (sd / pd).min(sh / ph));
        }
    }
    comm.barrier()?;
    Ok(true)
}
