//! `gradwire bench ps`, `bench write` and `bench token-ring` (run under `gradwire launch`).

use gradwire::rma::{ApplyRule, RemoteMemory, PARAMS_AT};
use gradwire::{Communicator, ReduceOp, Region, Result};
use std::sync::Arc;
use std::time::Instant;

/// Point-to-point one-sided write bandwidth, rank 0 to rank 1, from rank 0's exposed (so
/// registered) memory into rank 1's: on verbs one RDMA WRITE per message, waited for, the
/// figure to set beside `ib_write_bw`. Prints a row per size (bytes, GB/s, MB/s).
pub fn write(comm: &Communicator, sizes: &[usize], iters: usize) -> Result<()> {
    if comm.size() < 2 {
        return Err(gradwire::Error::InvalidArgument("bench write needs at least 2 ranks".into()));
    }
    let max = sizes.iter().copied().max().unwrap_or(8).max(8);
    let win = comm.expose(Arc::new(Region::shared("bench-write", max)?))?;
    if comm.rank() == 0 {
        println!("# gradwire bench write: rank 0 writes into rank 1's window; links {:?}", comm.link_kinds()[1].map_or("self", |t| t.name()));
        println!("{:>12} {:>8} {:>12} {:>12}", "size(B)", "iters", "GB/s", "MB/s");
        let src = win.local().clone();
        for &size in sizes {
            let data = &src.as_slice()[..size];
            win.write(1, 0, data)?; // warm-up: first touch, first request on the queue pair
            let t = Instant::now();
            for _ in 0..iters {
                win.write(1, 0, data)?;
            }
            let gbs = (size * iters) as f64 / t.elapsed().as_secs_f64() / 1e9;
            println!("{size:>12} {iters:>8} {gbs:>12.3} {:>12.1}", gbs * 1000.0);
        }
    }
    comm.barrier()
}

/// Push/pull bandwidth of rank 1 (a worker) against the shard on rank 0, beside the raw
/// one-sided write/read bandwidth of the same transport, sizes and offset (the shard's
/// parameters' offset: memory alignment moves the kernel's copy speed). Pushes count as done
/// once flushed (applied by the shard). With `check`, the gradients are random integers
/// and the shard's final parameters must equal minus the sum of everything pushed, exactly.
/// Returns whether every check passed.
pub fn ps(comm: &Communicator, sizes: &[usize], iters: usize, check: bool) -> Result<bool> {
    if comm.size() < 2 {
        return Err(gradwire::Error::InvalidArgument("bench ps needs at least 2 ranks".into()));
    }
    let me = comm.rank();
    let seed = gradwire::check::job_seed(comm)?;
    let mut all_ok = true;
    if me == 0 {
        println!("# gradwire bench ps: shard on rank 0, rank 1 pushes and pulls; links {:?}", comm.link_kinds()[1].map_or("self", |t| t.name()));
        println!("{:>12} {:>12} {:>12} {:>8} {:>12} {:>12} {:>8}", "size(B)", "write GB/s", "push GB/s", "push %", "read GB/s", "pull GB/s", "pull %");
    }
    let max = sizes.iter().copied().max().unwrap_or(0);
    let win = comm.expose(Arc::new(Region::shared("bench-ps-raw", PARAMS_AT + max.max(8))?))?;
    for (round, &size) in (1u64..).zip(sizes) {
        let n = size / 4;

        let mut rm = RemoteMemory::new(comm, &[0], &vec![0f32; n], ApplyRule::Sum, 1.0)?;
        let mut row = [0f64; 5];
        if me == 1 {
            let data = vec![1u8; size];
            let mut back = vec![0u8; size];
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ size as u64);
            let grads: Vec<f32> = (0..n).map(|_| rng.random_range(-8i32..=8) as f32).collect();
            let mut pushes = 0u64;
            let mut params = vec![0f32; n];
            // Blocks of each kind take turns, so drift on a noisy machine hits all four alike.
            let block = 10.min(iters.max(1));
            let mut secs = [0f64; 4];
            let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
                let t = Instant::now();
                for _ in 0..block {
                    f()?;
                }
                Ok(t.elapsed().as_secs_f64())
            };
            for _ in 0..iters.div_ceil(block) {
                secs[0] += timed(&mut || win.write(0, PARAMS_AT, &data))?;
                secs[1] += timed(&mut || rm.push(&grads, 1))?;
                pushes += block as u64;
                // The last pushes of a block are complete only once flushed.
                let t = Instant::now();
                rm.flush()?;
                secs[1] += t.elapsed().as_secs_f64();
                secs[2] += timed(&mut || win.read(0, PARAMS_AT, &mut back))?;
                secs[3] += timed(&mut || rm.pull(&mut params))?;
            }
            let bytes = (size * block * iters.div_ceil(block)) as f64;
            row[..4].copy_from_slice(&secs.map(|s| bytes / s / 1e9));
            if check {
                // Pushes of integers below 2^24 in magnitude sum exactly in f32.
                rm.pull(&mut params)?;
                let wrong = params.iter().zip(&grads).filter(|(p, g)| **p != -(pushes as f32) * **g).count();
                row[4] = wrong as f64;
                println!(
                    "check: {size} B: {pushes} pushes of {n} values, shard holds minus their sum: {} of {n} elements differ ({})",
                    wrong,
                    if wrong == 0 { "conservation exact" } else { "VIOLATED" }
                );
            }
            win.fetch_add(0, 0, 1)?; // done: rank 0 may leave its nap
        } else if me == 0 {
            // Sleep rather than wait in a collective: a rank waiting there spins or yields on
            // the core the shard's server thread needs (ranks are pinned, one per core).
            while win.fetch_add(0, 0, 0)? < round {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        comm.allreduce(&mut row, ReduceOp::Sum)?;
        if me == 0 {
            println!(
                "{size:>12} {:>12.3} {:>12.3} {:>7.0}% {:>12.3} {:>12.3} {:>7.0}%",
                row[0],
                row[1],
                100.0 * row[1] / row[0],
                row[2],
                row[3],
                100.0 * row[3] / row[2]
            );
        }
        all_ok &= row[4] == 0.0;
        comm.barrier()?;
    }
    Ok(all_ok)
}

/// Mean time for the token to go once around all ranks, over `rounds` rounds.
pub fn token_ring(comm: &Communicator, rounds: usize) -> Result<()> {
    let mut rm = RemoteMemory::new(comm, &[0], &[0f32; 1], ApplyRule::Sum, 1.0)?;
    let t = Instant::now();
    for _ in 0..rounds {
        rm.wait_token()?;
        rm.take_token()?;
        rm.pass_token()?;
    }
    let per_round = t.elapsed().as_secs_f64() / rounds.max(1) as f64;
    comm.barrier()?;
    if comm.rank() == 0 {
        println!("# gradwire bench token-ring: {} ranks, links {:?}", comm.size(), comm.link_kinds().iter().flatten().map(|t| t.name()).collect::<Vec<_>>());
        println!("token round time: {:.1} us per round ({:.2} us per hand-off), {rounds} rounds", per_round * 1e6, per_round * 1e6 / comm.size() as f64);
    }
    Ok(())
}
