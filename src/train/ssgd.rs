//! `ssgd`: synchronous data parallel SGD, one allreduce of the gradients every step (the
//! baseline everyone uses), before the framework's optimizer steps on their average.

use super::{f32_bytes, Strategy};
use crate::comm::Communicator;
use crate::dtype::ReduceOp;
use crate::error::Result;

/// The `ssgd` strategy on one communicator (see the module docs).
pub struct Ssgd<'c> {
    comm: &'c Communicator,
    sent: u64,
}

impl<'c> Ssgd<'c> {
    /// A strategy over every rank of `comm`; nothing is communicated until [`Strategy::start`].
    pub fn new(comm: &'c Communicator) -> Self {
        Ssgd { comm, sent: 0 }
    }
}

/// Bytes a rank sends in a ring allgather of `n` f32 per rank: every other rank's share.
pub(crate) fn allgather_bytes(n: usize, w: usize) -> u64 {
    (w.max(1) as u64 - 1) * f32_bytes(n)
}

/// Bytes one rank sends in a ring allreduce of `n` f32 values over `w` ranks.
pub(crate) fn allreduce_bytes(n: usize, w: usize) -> u64 {
    if w < 2 {
        0
    } else {
        2 * (w as u64 - 1) * f32_bytes(n) / w as u64
    }
}

/// Averages `buf` over all ranks of `comm` in place, counting the bytes sent.
pub(crate) fn average(comm: &Communicator, buf: &mut [f32], sent: &mut u64) -> Result<()> {
    comm.allreduce(buf, ReduceOp::Avg)?;
    *sent += allreduce_bytes(buf.len(), comm.size());
    Ok(())
}

/// Makes `params` rank 0's on every rank.
pub(crate) fn from_rank0(comm: &Communicator, params: &mut [f32], sent: &mut u64) -> Result<()> {
    comm.broadcast(params, 0)?;
    if comm.rank() == 0 {
        *sent += f32_bytes(params.len());
    }
    Ok(())
}

/// The globally averaged loss.
pub(crate) fn mean_loss(comm: &Communicator, loss: f64) -> Result<f64> {
    let mut l = [loss];
    comm.allreduce(&mut l, ReduceOp::Avg)?;
    Ok(l[0])
}

impl Strategy for Ssgd<'_> {
    fn name(&self) -> &'static str {
        "ssgd"
    }

    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        from_rank0(self.comm, params, &mut self.sent)
    }

    fn framework_update(&self) -> bool {
        true
    }

    fn before_update(&mut self, grads: &mut [f32], _last_of_epoch: bool) -> Result<()> {
        average(self.comm, grads, &mut self.sent)
    }

    fn after_update(&mut self, _params: &mut [f32], _last_of_epoch: bool) -> Result<()> {
        Ok(())
    }

    fn end_epoch(&mut self, _params: &mut [f32], loss: f64) -> Result<f64> {
        mean_loss(self.comm, loss)
    }

    fn finish(&mut self, _params: &mut [f32]) -> Result<()> {
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}
