//! Non-blocking collectives overlapped with each other.

use crate::{Communicator, Hierarchy, ReduceOp, Result};

/// The non-blocking cross-node allreduce overlapping node-local collectives, `iters` times:
/// each iteration starts a cross-node allreduce, runs a node-local allreduce meanwhile,
/// then waits; both results are checked exactly (integer-valued data). Every wait is
/// under the communicators' deadline, so a deadlock between the two groups fails the run.
pub fn overlap(comm: &Communicator, iters: usize) -> Result<bool> {
    let h = Hierarchy::new(comm)?;
    let topo = comm.topology();
    let me = comm.rank();
    let local_index = |r: usize| topo.local_ranks(r).iter().position(|&x| x == r).unwrap_or(0);
    let node_members = topo.local_ranks(me);
    let cross_members: Vec<usize> = (0..comm.size()).filter(|&r| local_index(r) == local_index(me)).collect();
    let value = |r: usize, it: usize, i: usize| ((r * 7919 + it * 31 + i) % 1000) as f64;
    let mut bad = 0usize;
    for it in 0..iters {
        let cross_in: Vec<f64> = (0..1000).map(|i| value(me, it, i)).collect();
        let pending = h.start_cross(cross_in, ReduceOp::Sum)?;
        let mut node_buf: Vec<f64> = (0..5003).map(|i| value(me, it + 1, i)).collect();
        h.node.allreduce(&mut node_buf, ReduceOp::Sum)?;
        let cross_out = pending.wait()?;
        bad += (0..1000).filter(|&i| cross_out[i] != cross_members.iter().map(|&r| value(r, it, i)).sum::<f64>()).count();
        bad += (0..5003).filter(|&i| node_buf[i] != node_members.iter().map(|&r| value(r, it + 1, i)).sum::<f64>()).count();
    }
    let mut total = [bad as f64];
    comm.allreduce(&mut total, ReduceOp::Sum)?;
    if me == 0 {
        let iterations = iters * comm.size();
        let failed = if total[0] > 0.0 { 1 } else { 0 };
        println!(
            "overlap: {iters} iterations x {} ranks ({} nodes): cross-node iallreduce during node-local allreduce, {} wrong elements: {} passed, {failed} failed",
            comm.size(),
            h.nodes(),
            total[0],
            if failed == 0 { iterations } else { 0 }
        );
    }
    Ok(total[0] == 0.0)
}
