//! `gradwire gpu-bench`: the GPU path's figures, under `gradwire launch` on a GPU machine.
//! Per size: the allreduce on device memory (NCCL inside the node; across nodes the
//! hierarchical path through pinned memory) beside gradwire's host allreduce of the same
//! bytes in the same run; then the staging copies (the registered region the hierarchical
//! path crosses through) against the same copies from `cuMemAllocHost` memory.

use gradwire::gpu::{staging_bandwidth, DeviceComm};
use gradwire::{Communicator, DType, ReduceOp, Result};
use std::time::Instant;

pub fn run(comm: &Communicator, sizes: &[usize], iters: usize) -> Result<bool> {
    let dc = DeviceComm::on_local_device(comm)?;
    let stream = dc.context().new_stream()?;
    let lead = comm.rank() == 0;
    if lead {
        println!("# gpu-bench: {} ranks on {} node(s), NCCL groups of {}, float32 sum, {iters} iterations", comm.size(), dc.nodes(), dc.local_size());
        println!("{:>12} {:>12} {:>12} {:>12} {:>12}", "bytes", "gpu_us", "gpu_algbw", "host_us", "host_algbw");
    }
    for &bytes in sizes {
        let n = bytes / 4;
        let dev = stream.alloc_zeros::<f32>(n)?;
        let (p, _) = cudarc::driver::DevicePtr::device_ptr(&dev, &stream);
        let call = || {
            // SAFETY: `dev` holds n f32 on this device and outlives the synchronisation.
            unsafe { dc.allreduce(comm, p, p, n, DType::F32, ReduceOp::Sum, stream.cu_stream()) }
        };
        for _ in 0..3 {
            call()?;
        }
        stream.synchronize()?;
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            call()?;
        }
        stream.synchronize()?;
        let gpu_s = t.elapsed().as_secs_f64() / iters as f64;
        let mut host = vec![0f32; n];
        for _ in 0..3 {
            comm.allreduce(&mut host, ReduceOp::Sum)?;
        }
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..iters {
            comm.allreduce(&mut host, ReduceOp::Sum)?;
        }
        let host_s = t.elapsed().as_secs_f64() / iters as f64;
        if lead {
            println!("{bytes:>12} {:>12.1} {:>12.2} {:>12.1} {:>12.2}", gpu_s * 1e6, bytes as f64 / gpu_s / 1e9, host_s * 1e6, bytes as f64 / host_s / 1e9);
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
