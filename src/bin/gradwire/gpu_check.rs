//! `gradwire gpu-check`: the collectives on CUDA device memory ([`DeviceComm`]: NCCL inside
//! the node, the hierarchical path across nodes) against an independent reference on fresh
//! random data (small integers, so sums are exact in every dtype used), on a stream of the
//! check's own, under `gradwire launch` on a GPU machine; and the wrong kind of memory
//! refused at both kinds of entry point.

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use gradwire::gpu::DeviceComm;
use gradwire::{Communicator, Counts, DType, Error, ReduceOp, Result};
use half::bf16;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

fn inputs(seed: u64, rank: usize, n: usize, range: i32) -> Vec<f32> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (rank as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    (0..n).map(|_| rng.random_range(-range..range) as f32).collect()
}

fn ptr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    s.device_ptr(stream).0
}

/// One case's outcome, printed by rank 0 after every rank's count of wrong elements is
/// summed.
struct Tally<'a> {
    comm: &'a Communicator,
    passed: usize,
    failed: usize,
}

impl Tally<'_> {
    fn case(&mut self, name: &str, wrong: usize) -> Result<()> {
        let mut total = [wrong as f64];
        self.comm.allreduce(&mut total, ReduceOp::Sum)?;
        if self.comm.rank() == 0 {
            println!("  {name:<44} {}", if total[0] == 0.0 { "ok".to_string() } else { format!("FAILED: {} wrong", total[0]) });
        }
        if total[0] == 0.0 {
            self.passed += 1;
        } else {
            self.failed += 1;
        }
        Ok(())
    }
}

pub fn run(comm: &Communicator, hierarchical: bool) -> Result<bool> {
    let seed = gradwire::check::job_seed(comm)?;
    let dc = DeviceComm::on_local_device(comm)?;
    if hierarchical && dc.nodes() < 2 {
        return Err(gradwire::Error::Config(
            "gpu-check --hierarchical: every rank is on one node, so the cross-node path would not run (give the ranks distinct GRADWIRE_HOST_ID)".into(),
        ));
    }
    // A stream of our own, not the default one: the calls must order on the stream given.
    let stream = dc.context().new_stream()?;
    let s = stream.cu_stream();
    let (w, me) = (comm.size(), comm.rank());
    let all = |n: usize, range: i32| -> Vec<Vec<f32>> { (0..w).map(|r| inputs(seed, r, n, range)).collect() };
    let mut t = Tally { comm, passed: 0, failed: 0 };
    if me == 0 {
        println!("gpu-check: {w} ranks on {} node(s), NCCL groups of {}, device {}", dc.nodes(), dc.local_size(), dc.device());
    }

    // Allreduce, out of place and in place, with a count that does not split evenly.
    for (name, n, in_place) in [("allreduce f32 sum, 1 Mi elements", 1 << 20, false), ("allreduce f32 sum in place, 3 Mi + 3 elements", (3 << 20) + 3, true)] {
        let x = all(n, 1000);
        let send = stream.clone_htod(&x[me])?;
        let recv = if in_place { None } else { Some(stream.alloc_zeros::<f32>(n)?) };
        let (sp, rp) = (ptr(&send, &stream), recv.as_ref().map_or(ptr(&send, &stream), |r| ptr(r, &stream)));
        // SAFETY: both are device allocations of n f32 on this device, alive until the
        // stream is read back below.
        unsafe { dc.allreduce(comm, sp, rp, n, DType::F32, ReduceOp::Sum, s) }?;
        let got = stream.clone_dtoh(recv.as_ref().unwrap_or(&send))?;
        t.case(name, (0..n).filter(|&i| got[i] != x.iter().map(|v| v[i]).sum::<f32>()).count())?;
    }

    // Average: every rank's input is the same multiple of its rank, so the mean is exact.
    let n = 4096;
    let mine: Vec<f32> = (0..n).map(|i| (i % 7) as f32 * (me as f32 + 1.0) * 4.0).collect();
    let buf = stream.clone_htod(&mine)?;
    // SAFETY: as above.
    unsafe { dc.allreduce(comm, ptr(&buf, &stream), ptr(&buf, &stream), n, DType::F32, ReduceOp::Avg, s) }?;
    let got = stream.clone_dtoh(&buf)?;
    let mean = |i: usize| (i % 7) as f32 * 4.0 * (w as f32 + 1.0) / 2.0;
    t.case("allreduce f32 avg", (0..n).filter(|&i| (got[i] - mean(i)).abs() > 1e-4 * mean(i).abs().max(1.0)).count())?;

    // bfloat16: small integers, whose sums bfloat16 holds exactly.
    let x = all(n, 4);
    let bits: Vec<u16> = x[me].iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
    let send = stream.clone_htod(&bits)?;
    let recv = stream.alloc_zeros::<u16>(n)?;
    // SAFETY: as above.
    unsafe { dc.allreduce(comm, ptr(&send, &stream), ptr(&recv, &stream), n, DType::BF16, ReduceOp::Sum, s) }?;
    let got: Vec<f32> = stream.clone_dtoh(&recv)?.into_iter().map(|b| bf16::from_bits(b).to_f32()).collect();
    t.case("allreduce bf16 sum", (0..n).filter(|&i| got[i] != x.iter().map(|v| v[i]).sum::<f32>()).count())?;

    // Broadcast from the last rank.
    let n = 1 << 18;
    let x = all(n, 1000);
    let root = w - 1;
    let buf = stream.clone_htod(&x[me])?;
    // SAFETY: as above.
    unsafe { dc.broadcast(comm, ptr(&buf, &stream), n, DType::F32, root, s) }?;
    let got = stream.clone_dtoh(&buf)?;
    t.case("broadcast f32 from the last rank", (0..n).filter(|&i| got[i] != x[root][i]).count())?;

    // Reduce to rank 1 (mod W), out of place: the others' output is not written.
    let root = 1 % w;
    let x = all(n, 1000);
    let send = stream.clone_htod(&x[me])?;
    let recv = stream.clone_htod(&vec![7f32; n])?;
    // SAFETY: both hold n elements on this device.
    unsafe { dc.reduce(comm, ptr(&send, &stream), ptr(&recv, &stream), n, DType::F32, ReduceOp::Sum, root, s) }?;
    let got = stream.clone_dtoh(&recv)?;
    let want = |i: usize| if me == root { x.iter().map(|v| v[i]).sum::<f32>() } else { 7.0 };
    t.case("reduce f32 sum to rank 1, others untouched", (0..n).filter(|&i| got[i] != want(i)).count())?;

    // Reduce-scatter and allgather.
    let m = 1 << 16;
    let x = all(m * w, 1000);
    let send = stream.clone_htod(&x[me])?;
    let recv = stream.alloc_zeros::<f32>(m)?;
    // SAFETY: send holds w × m elements, recv m.
    unsafe { dc.reduce_scatter(comm, ptr(&send, &stream), ptr(&recv, &stream), m, DType::F32, ReduceOp::Max, s) }?;
    let got = stream.clone_dtoh(&recv)?;
    let want = |i: usize| x.iter().map(|v| v[me * m + i]).fold(f32::MIN, f32::max);
    t.case("reduce-scatter f32 max", (0..m).filter(|&i| got[i] != want(i)).count())?;
    let send = stream.clone_htod(&x[me][..m])?;
    let recv = stream.alloc_zeros::<f32>(m * w)?;
    // SAFETY: send holds m elements, recv w × m.
    unsafe { dc.allgather(comm, ptr(&send, &stream), ptr(&recv, &stream), m, DType::F32, s) }?;
    let got = stream.clone_dtoh(&recv)?;
    t.case("allgather f32", (0..m * w).filter(|&i| got[i] != x[i / m][i % m]).count())?;

    // The same in place, as NCCL lays them out: this rank's block of the larger buffer.
    let es = std::mem::size_of::<f32>() as u64;
    let whole = stream.clone_htod(&x[me])?;
    let own = ptr(&whole, &stream) + (me * m) as u64 * es;
    // SAFETY: `whole` holds w × m elements; `own` is this rank's block of it.
    unsafe { dc.reduce_scatter(comm, ptr(&whole, &stream), own, m, DType::F32, ReduceOp::Sum, s) }?;
    let got = stream.clone_dtoh(&whole)?;
    let want = |i: usize| if i / m == me { x.iter().map(|v| v[i]).sum::<f32>() } else { x[me][i] };
    t.case("reduce-scatter f32 sum in place", (0..m * w).filter(|&i| got[i] != want(i)).count())?;
    let mut mine = vec![0f32; m * w];
    mine[me * m..(me + 1) * m].copy_from_slice(&x[me][..m]);
    let whole = stream.clone_htod(&mine)?;
    let own = ptr(&whole, &stream) + (me * m) as u64 * es;
    // SAFETY: as above.
    unsafe { dc.allgather(comm, own, ptr(&whole, &stream), m, DType::F32, s) }?;
    let got = stream.clone_dtoh(&whole)?;
    t.case("allgather f32 in place", (0..m * w).filter(|&i| got[i] != x[i / m][i % m]).count())?;

    // All-to-all: equal blocks (more than one piece on the cross-node path), then uneven
    // blocks, some empty and some larger than a piece, as mixture-of-experts layers send.
    let m = (1 << 20) + 5;
    let x = all(m * w, 1000);
    let send = stream.clone_htod(&x[me])?;
    let recv = stream.alloc_zeros::<f32>(m * w)?;
    // SAFETY: both hold w × m elements and do not overlap.
    unsafe { dc.alltoall(comm, ptr(&send, &stream), ptr(&recv, &stream), None, m, DType::F32, s) }?;
    let got = stream.clone_dtoh(&recv)?;
    t.case("alltoall f32, equal blocks of 1 Mi + 5", (0..m * w).filter(|&i| got[i] != x[i / m][me * m + i % m]).count())?;
    let count = |from: usize, to: usize| match (from + 2 * to) % 4 {
        0 => 0,
        1 => (1 << 20) + 77,
        k => 1000 * k + from + to,
    };
    let counts = Counts { send: (0..w).map(|b| count(me, b)).collect(), recv: (0..w).map(|b| count(b, me)).collect() };
    let x: Vec<Vec<f32>> = (0..w).map(|r| inputs(seed ^ 0xA11, r, (0..w).map(|b| count(r, b)).sum(), 1000)).collect();
    let want: Vec<f32> = (0..w).flat_map(|b| x[b][(0..me).map(|k| count(b, k)).sum::<usize>()..][..count(b, me)].to_vec()).collect();
    // One element more than the counts read: no allocation is empty.
    let send = stream.clone_htod(&[&x[me][..], &[0.0]].concat())?;
    let recv = stream.alloc_zeros::<f32>(want.len() + 1)?;
    // SAFETY: each holds its counts' elements (or more) and they do not overlap.
    unsafe { dc.alltoall(comm, ptr(&send, &stream), ptr(&recv, &stream), Some(&counts), 0, DType::F32, s) }?;
    let got = stream.clone_dtoh(&recv)?;
    t.case("alltoall f32, uneven blocks", (0..want.len()).filter(|&i| got[i] != want[i]).count())?;

    // The wrong kind of memory: a host buffer to a device call, a device buffer to a host
    // one. Each must be a clear error, not a fault.
    let host = [0f32; 16];
    // SAFETY: refused before any access (the point of the case).
    let e = unsafe { dc.allreduce(comm, host.as_ptr() as u64, host.as_ptr() as u64, 16, DType::F32, ReduceOp::Sum, s) };
    let host_refused = matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("host memory"));
    let dev = stream.alloc_zeros::<f32>(16)?;
    let e = gradwire::gpu::expect_host(ptr(&dev, &stream) as *const u8, "gradwire_allreduce", "sendbuf");
    let dev_refused = matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("CUDA device"));
    // A count past the end of the device allocation: refused before NCCL reads beyond it.
    // SAFETY: refused before any access.
    let e = unsafe { dc.allreduce(comm, ptr(&dev, &stream), ptr(&dev, &stream), 1 << 20, DType::F32, ReduceOp::Sum, s) };
    let short_refused = matches!(&e, Err(Error::InvalidArgument(m)) if m.contains("to the end of its allocation"));
    t.case("wrong memory kinds and short buffers refused", usize::from(!host_refused) + usize::from(!dev_refused) + usize::from(!short_refused))?;

    if me == 0 {
        println!("gpu-check: {} passed, {} failed", t.passed, t.failed);
    }
    Ok(t.failed == 0)
}
