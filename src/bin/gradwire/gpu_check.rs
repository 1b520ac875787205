//! `gradwire gpu-check`: NCCL on device memory against an independent reference on fresh
//! random data (integer-valued, so sums are exact), run under `gradwire launch` on a GPU
//! machine. `--hierarchical` adds the GPU hierarchical allreduce (NCCL inside the node,
//! gradwire across nodes).

use gradwire::gpu::NcclGroup;
use gradwire::{Communicator, ReduceOp, Result};
use rand::{Rng, SeedableRng};

fn inputs(seed: u64, rank: usize, n: usize) -> Vec<f32> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..n).map(|_| rng.random_range(-1000i32..1000) as f32).collect()
}

pub fn run(comm: &Communicator, hierarchical: bool) -> Result<bool> {
    let seed = gradwire::check::job_seed(comm)?;
    let node = comm.split_node_local()?;
    let devices = cudarc::driver::CudaContext::device_count().unwrap_or(1).max(1) as usize;
    let nccl = NcclGroup::new(&node, node.rank() % devices)?;
    let stream = nccl.context().default_stream();
    let n = 1 << 20;
    let mut wrong = 0usize;
    let gpu = |e: cudarc::driver::DriverError| gradwire::Error::Unsupported(format!("CUDA: {e:?}"));

    // NCCL allreduce over the node's ranks.
    let mine = inputs(seed, comm.rank(), n);
    let mut dev = stream.clone_htod(&mine).map_err(gpu)?;
    nccl.allreduce(&mut dev, ReduceOp::Sum)?;
    let got = stream.clone_dtoh(&dev).map_err(gpu)?;
    let members = comm.topology().local_ranks(comm.rank());
    let node_inputs: Vec<Vec<f32>> = members.iter().map(|&r| inputs(seed, r, n)).collect();
    wrong += (0..n).filter(|&i| got[i] != node_inputs.iter().map(|v| v[i]).sum::<f32>()).count();

    // NCCL broadcast from the node's last rank.
    let root = nccl.size() - 1;
    let mut dev = stream.clone_htod(&mine).map_err(gpu)?;
    nccl.broadcast(&mut dev, root)?;
    let got = stream.clone_dtoh(&dev).map_err(gpu)?;
    wrong += (0..n).filter(|&i| got[i] != node_inputs[root][i]).count();

    if hierarchical {
        let cross = comm.split_cross_node()?;
        let mut dev = stream.clone_htod(&mine).map_err(gpu)?;
        nccl.hierarchical_allreduce(&cross, &mut dev, ReduceOp::Sum)?;
        let got = stream.clone_dtoh(&dev).map_err(gpu)?;
        let all: Vec<Vec<f32>> = (0..comm.size()).map(|r| inputs(seed, r, n)).collect();
        wrong += (0..n).filter(|&i| got[i] != all.iter().map(|v| v[i]).sum::<f32>()).count();
    }
    let mut total = [wrong as f64];
    comm.allreduce(&mut total, ReduceOp::Sum)?;
    if comm.rank() == 0 {
        let cases = if hierarchical { 3 } else { 2 };
        let failed = if total[0] > 0.0 { cases } else { 0 };
        println!("gpu-check: {} ranks, NCCL groups of {}, {} wrong elements: {} passed, {failed} failed", comm.size(), nccl.size(), total[0], cases - failed);
    }
    Ok(total[0] == 0.0)
}
