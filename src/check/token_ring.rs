//! The token ring and parameter shards: conservation of what the workers pushed.

use super::job_seed;
use crate::{Communicator, ReduceOp, Result};
use rand::{Rng, SeedableRng};
use std::time::Duration;

/// The token ring and parameter-server shards under load: every rank computes `steps`
/// integer-valued gradients at its own randomised speed (unbalanced: rank r sleeps up to
/// (1 + r mod 3) × 300 µs per step) and pushes by the dynamic-delay policy (whenever the
/// token passes, everything accumulated) or the fixed cyclic one (one gradient per turn,
/// waiting for it); a quarter of the steps also pull outside the rank's turn, racing the
/// holder's pushes. Checked: one token holder at every take; every pull sees each shard
/// consistent (a push is a constant vector, so a torn update would show mixed values);
/// and conservation, exactly: applied + still accumulated = computed. `kill = (rank, step)`
/// SIGKILLs that rank when it first takes the token at or after that step (fault tests).
pub fn token_ring(comm: &Communicator, steps: usize, cyclic: bool, kill: Option<(usize, usize)>) -> Result<bool> {
    use crate::rma::{ApplyRule, RemoteMemory};
    let (w, me) = (comm.size(), comm.rank());
    let seed = job_seed(comm)?;
    // Large enough that a push takes a while to apply (over tcp: to arrive), so that pulls
    // outside the turn do meet pushes half-way; small in fault runs, so that the victim
    // reaches its fatal step while the others still pass the token.
    let n = if kill.is_some() { 1000 } else { 1 << 16 };
    let servers: Vec<usize> = if w > 1 { vec![0, w - 1] } else { vec![0] };
    let mut rm = RemoteMemory::new(comm, &servers, &vec![0f32; n], ApplyRule::Sum, 1.0)?;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (me as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let (mut acc, mut count) = (vec![0f32; n], 0u64);
    let mut computed = vec![0f64; n];
    let mut params = vec![0f32; n];
    let (mut pushes, mut torn) = (0u64, 0usize);
    let bounds: Vec<usize> = (0..=servers.len()).map(|i| n * i / servers.len()).collect();
    // A push is a constant vector per shard: mixed values in a shard mean a torn pull.
    let torn_shards = |p: &[f32]| (0..servers.len()).filter(|&i| p[bounds[i]..bounds[i + 1]].windows(2).any(|w| w[0] != w[1])).count();
    let (mut side, mut side_torn) = (vec![0f32; n], 0usize);
    let mut turn = |rm: &mut RemoteMemory, acc: &mut Vec<f32>, count: &mut u64, step: usize| -> Result<()> {
        rm.take_token()?;
        if kill.is_some_and(|(r, s)| r == me && step >= s) {
            // SAFETY: raising a signal on ourselves has no memory-safety preconditions.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        if *count > 0 {
            rm.push(acc, *count)?;
            acc.iter_mut().for_each(|a| *a = 0.0);
            *count = 0;
            pushes += 1;
        }
        rm.pull(&mut params)?;
        torn += torn_shards(&params);
        rm.pass_token()
    };
    for step in 0..steps {
        let g = rng.random_range(-3i32..=3) as f32;
        acc.iter_mut().for_each(|a| *a += g);
        computed.iter_mut().for_each(|c| *c += g as f64);
        count += 1;
        std::thread::sleep(Duration::from_micros(rng.random_range(0..300) * (1 + me as u64 % 3)));
        // Pulls outside our turn race with the holder's pushes: the seqlock must hold. Not
        // in fault runs: there they would reach survivors that already exited because of
        // the death (and, with rank 0, the store that holds their reasons), and the report
        // under test is of the death itself.
        if kill.is_none() && rng.random_ratio(1, 4) {
            rm.pull(&mut side)?;
            side_torn += torn_shards(&side);
        }
        if cyclic {
            rm.wait_token()?;
            turn(&mut rm, &mut acc, &mut count, step)?;
        } else if rm.poll_token()? {
            turn(&mut rm, &mut acc, &mut count, step)?;
        }
    }
    // Keep the token moving until every rank has finished computing.
    let done = comm.ibarrier()?;
    while !done.test() {
        if rm.poll_token()? {
            turn(&mut rm, &mut acc, &mut count, usize::MAX)?;
        }
        std::thread::yield_now();
    }
    done.wait()?;
    rm.flush()?;
    comm.barrier()?;
    // Conservation: shards hold −Σ applied (lr 1, start 0); ranks hold their residuals.
    rm.pull(&mut params)?;
    let mut totals: Vec<f64> = computed.iter().zip(&acc).map(|(c, a)| c - *a as f64).collect();
    comm.allreduce(&mut totals, ReduceOp::Sum)?;
    let applied: Vec<f64> = params.iter().map(|p| -*p as f64).collect();
    let lost = totals.iter().zip(&applied).filter(|(t, a)| t != a).count();
    // Every remote read happens before the last collectives: after them a server rank may
    // already be gone.
    let applied_pushes: u64 = (0..servers.len()).map(|i| rm.applied(i)).sum::<Result<u64>>()?;
    let mut stats = [pushes as f64, (torn + side_torn) as f64, lost as f64];
    comm.allreduce(&mut stats, ReduceOp::Sum)?;
    comm.barrier()?;
    let ok = stats[1] == 0.0 && stats[2] == 0.0 && applied_pushes == stats[0] as u64 * servers.len() as u64;
    if me == 0 {
        println!(
            "token-ring ({}): {steps} steps x {w} ranks, {} pushes ({:.1} minibatches each), {} shard updates applied, {} torn pulls, conservation {} (first element: computed − still accumulated = {}, applied = {}): {} passed, {} failed",
            if cyclic { "fixed cyclic" } else { "dynamic delay" },
            stats[0],
            (steps * w) as f64 / stats[0].max(1.0),
            applied_pushes,
            stats[1],
            if stats[2] == 0.0 { "exact" } else { "VIOLATED" },
            totals[0] + 0.0,
            applied[0],
            if ok { 1 } else { 0 },
            if ok { 0 } else { 1 }
        );
    }
    Ok(ok)
}
