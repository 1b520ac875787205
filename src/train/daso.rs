//! `daso`: Distributed Asynchronous and Selective Optimization (ALGORITHMS.md §1, after
//! Heat's `DASO`). Gradients are averaged inside a node; parameters are summed across nodes
//! by a non-blocking allreduce among the ranks of one local index (rotating), every `gs`
//! batches, and merged `W` batches later with the weighted average
//! x ← (2S·x_local + Σ_nodes x_sent) / (2S + N).
//!
//! Phases: warm-up and cool-down epochs are fully synchronous (a global gradient average
//! every batch, optionally on a bf16 wire); the cycling phase starts at gs = 4, ls = 1,
//! W = 1 and a plateau controller on the globally averaged training loss adapts them.
//!
//! Reference-code quirks: BatchNorm buffers do not exist in our models, so the missing
//! global sync of them cannot arise. bf16 sums: our bf16 reduction adds in f32 and rounds
//! once per step (fixed: the reference accumulates in bf16). With gs = 2 the reference defers
//! the receive to the next send; we receive exactly W batches after each send (fixed).
//! Warm-up plus cool-down are capped at half the run, so short runs still cycle.

use super::ssgd::{allreduce_bytes, from_rank0, mean_loss};
use super::{f32_bytes, Sgd, Strategy};
use crate::collective::hierarchical::Hierarchy;
use crate::collective::Pending;
use crate::comm::Communicator;
use crate::dtype::ReduceOp;
use crate::error::Result;
use std::collections::VecDeque;

#[derive(Clone, Debug)]
pub struct DasoConfig {
    pub warmup_epochs: usize,
    pub cooldown_epochs: usize,
    /// Total epochs of the run (to know when cool-down starts).
    pub epochs: usize,
    pub max_global_skips: usize,
    /// Relative loss improvement below which an epoch counts as "not improved".
    pub stability_level: f64,
    /// Synchronous phases average gradients on a bf16 wire.
    pub bf16_wire: bool,
}

impl Default for DasoConfig {
    fn default() -> Self {
        DasoConfig { warmup_epochs: 4, cooldown_epochs: 4, epochs: 20, max_global_skips: 8, stability_level: 0.05, bf16_wire: false }
    }
}

/// The weighted merge of DASO: (2S·x_local + Σ) / (2S + N), S batches after the send, over
/// N nodes. If every input equals x, the result is x.
pub fn merge(local: &mut [f32], sum: &[f32], s: usize, nodes: usize) {
    let (w, d) = (2.0 * s as f32, 2.0 * s as f32 + nodes as f32);
    local.iter_mut().zip(sum).for_each(|(x, t)| *x = (w * *x + t) / d);
}

/// DASO's schedule knobs: global skip, local skip, batches to wait.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Schedule {
    pub gs: usize,
    pub ls: usize,
    pub wait: usize,
}

/// The plateau controller: once per epoch, on the globally averaged training loss.
#[derive(Clone, Debug)]
pub struct Plateau {
    best: f64,
    stale_epochs: usize,
    stability_level: f64,
    max_global_skips: usize,
}

impl Plateau {
    pub fn new(stability_level: f64, max_global_skips: usize) -> Self {
        Plateau { best: f64::INFINITY, stale_epochs: 0, stability_level, max_global_skips }
    }

    /// Feeds one epoch's loss; returns the schedule for the next epoch. A plateau (no
    /// improvement by more than the stability level for more than 2 epochs) halves gs and
    /// ls and decrements W (W ≥ 1 while gs > 0); at gs = 1 it resets to gs = max,
    /// ls = W = max / 4.
    pub fn next(&mut self, loss: f64, s: Schedule) -> Schedule {
        if loss < self.best * (1.0 - self.stability_level) {
            self.best = loss;
            self.stale_epochs = 0;
            return s;
        }
        self.best = self.best.min(loss);
        self.stale_epochs += 1;
        if self.stale_epochs <= 2 {
            return s;
        }
        self.stale_epochs = 0;
        if s.gs <= 1 {
            let m = self.max_global_skips;
            Schedule { gs: m, ls: (m / 4).max(1), wait: (m / 4).max(1) }
        } else {
            Schedule { gs: s.gs / 2, ls: (s.ls / 2).max(1), wait: s.wait.saturating_sub(1).max(1) }
        }
    }
}

/// A global parameter sum in flight: started at batch `at` by local index `root`; only the
/// ranks of that local index hold the request.
struct InFlight {
    at: usize,
    root: usize,
    request: Option<Pending<Vec<f32>>>,
}

pub struct Daso<'c> {
    comm: &'c Communicator,
    groups: Hierarchy,
    opt: Sgd,
    cfg: DasoConfig,
    /// None in the synchronous phases.
    schedule: Option<Schedule>,
    plateau: Plateau,
    epoch: usize,
    batch: usize,
    send_mod: usize,
    in_flight: VecDeque<InFlight>,
    scratch: Vec<f32>,
    sent: u64,
}

impl<'c> Daso<'c> {
    pub fn new(comm: &'c Communicator, opt: Sgd, mut cfg: DasoConfig) -> Result<Self> {
        let half = cfg.epochs / 4;
        cfg.warmup_epochs = cfg.warmup_epochs.min(half);
        cfg.cooldown_epochs = cfg.cooldown_epochs.min(half);
        let groups = Hierarchy::new(comm)?;
        let plateau = Plateau::new(cfg.stability_level, cfg.max_global_skips);
        Ok(Daso { comm, groups, opt, cfg, schedule: None, plateau, epoch: 0, batch: 0, send_mod: 0, in_flight: VecDeque::new(), scratch: vec![], sent: 0 })
    }

    /// The current schedule (None while synchronous).
    pub fn schedule(&self) -> Option<Schedule> {
        self.schedule
    }

    fn local_index(&self) -> usize {
        self.groups.node.rank()
    }

    /// Average over all ranks (synchronous phases).
    fn global_average(&mut self, buf: &mut [f32]) -> Result<()> {
        if self.cfg.bf16_wire {
            let mut wire: Vec<half::bf16> = buf.iter().map(|&v| half::bf16::from_f32(v)).collect();
            self.comm.allreduce(&mut wire, ReduceOp::Avg)?;
            buf.iter_mut().zip(&wire).for_each(|(b, w)| *b = w.to_f32());
            self.sent += allreduce_bytes(buf.len(), self.comm.size()) / 2;
        } else {
            self.comm.allreduce(buf, ReduceOp::Avg)?;
            self.sent += allreduce_bytes(buf.len(), self.comm.size());
        }
        Ok(())
    }

    fn node_broadcast(&mut self, params: &mut [f32], root: usize) -> Result<()> {
        if self.groups.node.size() > 1 {
            self.groups.node.broadcast(params, root)?;
            if self.local_index() == root {
                self.sent += f32_bytes(params.len());
            }
        }
        Ok(())
    }

    /// Completes the oldest global sum and merges it; the sending rank then shares the
    /// result inside its node.
    fn receive(&mut self, params: &mut [f32]) -> Result<()> {
        let Some(f) = self.in_flight.pop_front() else { return Ok(()) };
        if let Some(req) = f.request {
            let sum = req.wait()?;
            merge(params, &sum, self.batch - f.at, self.groups.nodes());
        }
        self.node_broadcast(params, f.root)
    }

    /// Blocking global average of the parameters plus node broadcast (end of an epoch).
    fn blocking_sync(&mut self, params: &mut [f32]) -> Result<()> {
        while !self.in_flight.is_empty() {
            self.receive(params)?;
        }
        if self.local_index() == 0 && self.groups.cross.size() > 1 {
            self.groups.cross.allreduce(params, ReduceOp::Avg)?;
            self.sent += allreduce_bytes(params.len(), self.groups.cross.size());
        }
        self.node_broadcast(params, 0)
    }
}

impl Strategy for Daso<'_> {
    fn name(&self) -> &'static str {
        "daso"
    }

    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        from_rank0(self.comm, params, &mut self.sent)
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], last_of_epoch: bool) -> Result<()> {
        let b = self.batch;
        self.batch += 1;
        self.scratch.clear();
        self.scratch.extend_from_slice(grads);
        let mut g = std::mem::take(&mut self.scratch);
        let Some(s) = self.schedule else {
            // Warm-up / cool-down: fully synchronous.
            self.global_average(&mut g)?;
            self.opt.step(params, &g);
            self.scratch = g;
            return Ok(());
        };
        let send_now = b % s.gs == 0;
        let before_send = (b + 1) % s.gs == 0;
        if (b % s.ls == 0 || before_send || last_of_epoch) && self.groups.node.size() > 1 {
            self.groups.node.allreduce(&mut g, ReduceOp::Avg)?;
            self.sent += allreduce_bytes(g.len(), self.groups.node.size());
        }
        self.opt.step(params, &g);
        self.scratch = g;
        while self.in_flight.front().is_some_and(|f| self.batch - f.at >= s.wait) {
            self.receive(params)?;
        }
        if send_now {
            let root = self.send_mod;
            // Only the ranks of local index `root` send; with a single node their "sum over
            // nodes" is their own parameters.
            let request = if self.local_index() == root {
                self.sent += allreduce_bytes(params.len(), self.groups.cross.size());
                Some(self.groups.cross.iallreduce(params.to_vec(), ReduceOp::Sum)?)
            } else {
                None
            };
            self.in_flight.push_back(InFlight { at: self.batch, root, request });
            self.send_mod = (self.send_mod + 1) % self.groups.node.size();
        }
        if last_of_epoch {
            self.blocking_sync(params)?;
        }
        Ok(())
    }

    fn end_epoch(&mut self, params: &mut [f32], loss: f64) -> Result<f64> {
        // The epoch's last step already synchronised (blocking) in the cycling phase.
        let _ = params;
        let loss = mean_loss(self.comm, loss)?;
        self.epoch += 1;
        self.batch = 0;
        let cycling = self.epoch >= self.cfg.warmup_epochs && self.epoch < self.cfg.epochs.saturating_sub(self.cfg.cooldown_epochs);
        self.schedule = match (cycling, self.schedule) {
            (false, _) => None,
            (true, None) => Some(Schedule { gs: 4, ls: 1, wait: 1 }),
            (true, Some(s)) => Some(self.plateau.next(loss, s)),
        };
        Ok(loss)
    }

    fn describe(&self) -> String {
        match self.schedule {
            None => "  [synchronous]".into(),
            Some(s) => format!("  [gs={} ls={} W={}]", s.gs, s.ls, s.wait),
        }
    }

    fn finish(&mut self, params: &mut [f32]) -> Result<()> {
        self.blocking_sync(params)?;
        if self.groups.cross.size() > 1 || self.groups.node.size() > 1 {
            // Every rank ends with the same model.
            self.comm.broadcast(params, 0)?;
        }
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_test_vector() {
        // N = 4, S = 1: x_local / 3 + Σ / 6.
        let mut x = vec![3.0f32, -6.0, 1.5];
        let sum = [12.0f32, 6.0, -3.0];
        merge(&mut x, &sum, 1, 4);
        let want = [3.0 / 3.0 + 12.0 / 6.0, -6.0 / 3.0 + 6.0 / 6.0, 1.5 / 3.0 - 3.0 / 6.0];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{a} vs {b}");
        }
        // All inputs equal: unchanged.
        let mut y = vec![0.7f32; 3];
        merge(&mut y, &[2.8f32; 3], 3, 4);
        assert!(y.iter().all(|v| (v - 0.7).abs() < 1e-6));
    }

    #[test]
    fn plateau_schedule() {
        let mut p = Plateau::new(0.05, 8);
        let s0 = Schedule { gs: 4, ls: 1, wait: 1 };
        // Improving by more than 5 %: unchanged.
        assert_eq!(p.next(1.0, s0), s0);
        assert_eq!(p.next(0.9, s0), s0);
        // Three epochs without a 5 % improvement: the third is the plateau.
        assert_eq!(p.next(0.89, s0), s0);
        assert_eq!(p.next(0.88, s0), s0);
        let s1 = p.next(0.87, s0);
        assert_eq!(s1, Schedule { gs: 2, ls: 1, wait: 1 });
        // Halving goes on down to gs = 1, then resets to gs = 8, ls = W = 2.
        for _ in 0..2 {
            p.next(0.87, s1);
        }
        let s2 = p.next(0.87, s1);
        assert_eq!(s2, Schedule { gs: 1, ls: 1, wait: 1 });
        for _ in 0..2 {
            p.next(0.87, s2);
        }
        assert_eq!(p.next(0.87, s2), Schedule { gs: 8, ls: 2, wait: 2 });
        // A real improvement resets the count.
        assert_eq!(p.next(0.5, s2), s2);
    }
}
