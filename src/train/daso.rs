//! `daso`: Distributed Asynchronous and Selective Optimization (ALGORITHMS.md §1, after
//! Heat's `DASO`). Gradients are averaged inside a node; parameters are summed across nodes
//! by a non-blocking allreduce among the ranks of one local index (rotating), every `gs`
//! batches, and merged `W` batches later with the weighted average
//! x ← (2S·x_local + Σ_nodes x_sent) / (2S + N); the send is cut into allreduces of at
//! most `sending_chunk_size` elements (Heat's chunking).
//!
//! Phases: warm-up and cool-down epochs are synchronous (Heat's gs = ls = W = 0): every
//! batch a node-local gradient average, the local step, and a global average of the
//! parameters, optionally on a bf16 wire; the cycling phase starts at gs = 4, ls = 1,
//! W = 1 and the plateau controller (Heat's `DetectMetricPlateau`, patience 2, fed the
//! globally averaged training loss from the last warm-up epoch on) adapts them.
//!
//! Kept from the reference, or changed, deliberately:
//! - Synchronous phases average parameters, as Heat does (not gradients: after cycling
//!   every rank has its own momentum, and an averaged gradient stepped through different
//!   momenta carried the replicas apart in cool-down). Changed: we average over every rank
//!   the change since the parameters last agreed, and add it to them; Heat averages one
//!   local index's parameters across nodes and broadcasts them in the node, with the
//!   parameters themselves cast to bf16 (at bf16's resolution a small SGD step vanishes).
//!   Every replica ends each synchronous batch bit-identical.
//! - bf16 sums: Heat's MPI operator accumulates in bf16; ours widens to f32 and rounds
//!   once (the collectives layer: the automatic allreduce over links and on one host).
//! - Local sync: on batch b when b % ls == 0, on the batch before a send and on the last
//!   batch. Heat sets a DDP flag for the next backward from the next batch's index and
//!   leaves it on through the wait window; with ls = 1 (the first cycling schedule and
//!   every one reached by halving from it) the two agree; with ls > 1 (after a reset to
//!   gs = max) Heat also syncs the batches between a send and its receive.
//! - A single node: the cross-node "sum" of one rank is its own parameters, and the merge
//!   weighs it in as Heat's does (x ← (2S·x + x)/(2S + 1) = x).
//! - With gs = 2 the reference defers the receive to the next send; we receive exactly W
//!   batches after each send.
//! - Warm-up plus cool-down are capped at half the run, so short runs still cycle; with
//!   no warm-up Heat never leaves the synchronous schedule, we start cycling after the
//!   first epoch.
//! - BatchNorm buffers do not exist in our models, so Heat's missing global sync of them
//!   cannot arise.

use super::ssgd::{allreduce_bytes, from_rank0, mean_loss};
use super::{f32_bytes, Strategy};
use crate::collective::hierarchical::Hierarchy;
use crate::collective::Pending;
use crate::comm::Communicator;
use crate::dtype::ReduceOp;
use crate::error::Result;
use std::collections::VecDeque;

/// DASO's knobs, named as Heat's (ALGORITHMS.md §1).
#[derive(Clone, Debug)]
pub struct DasoConfig {
    /// Synchronous epochs at the start (capped at a quarter of `epochs`).
    pub warmup_epochs: usize,
    /// Synchronous epochs at the end (capped at a quarter of `epochs`).
    pub cooldown_epochs: usize,
    /// Total epochs of the run (to know when cool-down starts).
    pub epochs: usize,
    /// Largest global skip gs: the value a plateau at gs = 1 resets it to.
    pub max_global_skips: usize,
    /// Relative loss improvement below which an epoch counts as "not improved".
    pub stability_level: f64,
    /// Synchronous phases average on a bf16 wire.
    pub bf16_wire: bool,
    /// The cycling phase's global send is cut into allreduces of at most this many
    /// elements (Heat's `sending_chunk_size`).
    pub sending_chunk_size: usize,
    /// On a plateau gs and ls are divided by this (Heat's `skip_reduction_factor`).
    pub skip_reduction_factor: usize,
    /// On a reset to gs = max, ls = W = max / this (Heat's `local_skip_factor`).
    pub local_skip_factor: usize,
}

impl Default for DasoConfig {
    fn default() -> Self {
        DasoConfig {
            warmup_epochs: 4,
            cooldown_epochs: 4,
            epochs: 20,
            max_global_skips: 8,
            stability_level: 0.05,
            bf16_wire: false,
            sending_chunk_size: 10_000_000,
            skip_reduction_factor: 2,
            local_skip_factor: 4,
        }
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
    /// Global skip: batches between cross-node parameter sends.
    pub gs: usize,
    /// Local skip: batches between node-local gradient averages.
    pub ls: usize,
    /// W: batches between a send and the merge of what it received.
    pub wait: usize,
}

/// The plateau controller: once per epoch, on the globally averaged training loss.
#[derive(Clone, Debug)]
pub struct Plateau {
    best: f64,
    stale_epochs: usize,
    stability_level: f64,
    max_global_skips: usize,
    skip_reduction_factor: usize,
    local_skip_factor: usize,
}

impl Plateau {
    /// With Heat's default factors (skip reduction 2, local skip 4).
    pub fn new(stability_level: f64, max_global_skips: usize) -> Self {
        Self::with_factors(stability_level, max_global_skips, 2, 4)
    }

    /// `skip_reduction_factor` divides gs and ls on a plateau; a reset sets ls = W =
    /// max / `local_skip_factor` (both at least 1).
    pub fn with_factors(stability_level: f64, max_global_skips: usize, skip_reduction_factor: usize, local_skip_factor: usize) -> Self {
        let (skip_reduction_factor, local_skip_factor) = (skip_reduction_factor.max(1), local_skip_factor.max(1));
        Plateau { best: f64::INFINITY, stale_epochs: 0, stability_level, max_global_skips, skip_reduction_factor, local_skip_factor }
    }

    /// Feeds one epoch's loss; returns the schedule for the next epoch. As Heat's
    /// `DetectMetricPlateau(patience=2, threshold=stability_level)`: `best` moves only on a
    /// real improvement (below best·(1 − stability level)), so losses that fall a little
    /// every epoch still make a plateau. A plateau (a third epoch without one) divides gs
    /// and ls by the skip reduction factor (2) and decrements W (W ≥ 1 while gs > 0); at
    /// gs = 1 it resets to gs = max, ls = W = max / local skip factor (4).
    pub fn next(&mut self, loss: f64, s: Schedule) -> Schedule {
        if loss < self.best * (1.0 - self.stability_level) {
            self.best = loss;
            self.stale_epochs = 0;
            return s;
        }
        self.stale_epochs += 1;
        if self.stale_epochs <= 2 {
            return s;
        }
        self.stale_epochs = 0;
        if s.gs <= 1 {
            let (m, l) = (self.max_global_skips, self.local_skip_factor);
            Schedule { gs: m, ls: (m / l).max(1), wait: (m / l).max(1) }
        } else {
            let f = self.skip_reduction_factor;
            Schedule { gs: s.gs / f, ls: (s.ls / f).max(1), wait: s.wait.saturating_sub(1).max(1) }
        }
    }
}

/// The schedule after `epochs_done` epochs, the last with `loss` (globally averaged):
/// None (synchronous) in warm-up and cool-down; gs = 4, ls = 1, W = 1 on entering the
/// cycling phase; then the plateau controller's. The controller is fed the last warm-up
/// epoch's loss too, as Heat's `epoch_loss_logic` does.
pub fn next_schedule(plateau: &mut Plateau, cfg: &DasoConfig, epochs_done: usize, current: Option<Schedule>, loss: f64) -> Option<Schedule> {
    let cycling = epochs_done >= cfg.warmup_epochs && epochs_done < cfg.epochs.saturating_sub(cfg.cooldown_epochs);
    match (cycling, current) {
        (false, _) => None,
        (true, None) => Some(plateau.next(loss, Schedule { gs: 4, ls: 1, wait: 1 })),
        (true, Some(s)) => Some(plateau.next(loss, s)),
    }
}

/// A global parameter sum in flight: started at batch `at` by local index `root`; only the
/// ranks of that local index hold the request.
struct InFlight {
    at: usize,
    root: usize,
    /// One allreduce per chunk of the parameters, in order.
    chunks: Option<Vec<Pending<Vec<f32>>>>,
}

/// The `daso` strategy on one communicator (see the module docs).
pub struct Daso<'c> {
    comm: &'c Communicator,
    groups: Hierarchy,
    cfg: DasoConfig,
    /// None in the synchronous phases.
    schedule: Option<Schedule>,
    plateau: Plateau,
    epoch: usize,
    batch: usize,
    send_mod: usize,
    in_flight: VecDeque<InFlight>,
    /// The parameters as last made identical on every rank (synchronous phases average the
    /// change since then).
    anchor: Vec<f32>,
    sent: u64,
}

impl<'c> Daso<'c> {
    /// Caps warm-up and cool-down at a quarter of the run each and makes the node and
    /// cross-node groups (every node must hold the same number of ranks).
    pub fn new(comm: &'c Communicator, mut cfg: DasoConfig) -> Result<Self> {
        let half = cfg.epochs / 4;
        cfg.warmup_epochs = cfg.warmup_epochs.min(half);
        cfg.cooldown_epochs = cfg.cooldown_epochs.min(half);
        let groups = Hierarchy::new(comm)?;
        let plateau = Plateau::with_factors(cfg.stability_level, cfg.max_global_skips, cfg.skip_reduction_factor, cfg.local_skip_factor);
        Ok(Daso { comm, groups, cfg, schedule: None, plateau, epoch: 0, batch: 0, send_mod: 0, in_flight: VecDeque::new(), anchor: vec![], sent: 0 })
    }

    /// The current schedule (None while synchronous).
    pub fn schedule(&self) -> Option<Schedule> {
        self.schedule
    }

    fn local_index(&self) -> usize {
        self.groups.node.rank()
    }

    /// Synchronous phases: every rank's parameters averaged, as the average of their change
    /// since the anchor (the parameters every rank last held identically), so that a bf16
    /// wire carries small changes at bf16's relative precision instead of rounding the
    /// parameters themselves; every replica ends bit-identical (one allreduce result added
    /// to one anchor).
    fn average_parameters(&mut self, params: &mut [f32]) -> Result<()> {
        let mut change: Vec<f32> = params.iter().zip(&self.anchor).map(|(p, a)| p - a).collect();
        self.global_average(&mut change)?;
        for ((p, a), d) in params.iter_mut().zip(self.anchor.iter_mut()).zip(&change) {
            *p = *a + d;
            *a = *p;
        }
        Ok(())
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
        if let Some(chunks) = f.chunks {
            let mut at = 0;
            for chunk in chunks {
                let sum = chunk.wait()?;
                merge(&mut params[at..at + sum.len()], &sum, self.batch - f.at, self.groups.nodes());
                at += sum.len();
            }
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
        self.node_broadcast(params, 0)?;
        self.anchor.clear();
        self.anchor.extend_from_slice(params);
        Ok(())
    }
}

impl Strategy for Daso<'_> {
    fn name(&self) -> &'static str {
        "daso"
    }

    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        from_rank0(self.comm, params, &mut self.sent)?;
        self.anchor = params.to_vec();
        Ok(())
    }

    fn framework_update(&self) -> bool {
        true
    }

    fn before_update(&mut self, grads: &mut [f32], last_of_epoch: bool) -> Result<()> {
        // Synchronous phases (Heat's gs = ls = W = 0) average every batch's gradients in
        // the node; the cycling phase on local-sync batches: every ls-th, the batch before
        // a send, and the epoch's last.
        let b = self.batch;
        let local_sync = match self.schedule {
            None => true,
            Some(s) => b % s.ls == 0 || (b + 1) % s.gs == 0 || last_of_epoch,
        };
        if local_sync && self.groups.node.size() > 1 {
            self.groups.node.allreduce(grads, ReduceOp::Avg)?;
            self.sent += allreduce_bytes(grads.len(), self.groups.node.size());
        }
        Ok(())
    }

    fn after_update(&mut self, params: &mut [f32], last_of_epoch: bool) -> Result<()> {
        let b = self.batch;
        self.batch += 1;
        let Some(s) = self.schedule else {
            // Synchronous: the parameters averaged over every rank. Averaging gradients
            // instead left each rank's own momentum to carry the replicas apart.
            return self.average_parameters(params);
        };
        while self.in_flight.front().is_some_and(|f| self.batch - f.at >= s.wait) {
            self.receive(params)?;
        }
        if b % s.gs == 0 {
            let root = self.send_mod;
            // Only the ranks of local index `root` send; with a single node their "sum over
            // nodes" is their own parameters.
            let chunks = if self.local_index() == root {
                self.sent += allreduce_bytes(params.len(), self.groups.cross.size());
                let chunk = self.cfg.sending_chunk_size.max(1);
                Some(params.chunks(chunk).map(|c| self.groups.cross.iallreduce(c.to_vec(), ReduceOp::Sum)).collect::<Result<Vec<_>>>()?)
            } else {
                None
            };
            self.in_flight.push_back(InFlight { at: self.batch, root, chunks });
            self.send_mod = (self.send_mod + 1) % self.groups.node.size();
        }
        if last_of_epoch {
            self.blocking_sync(params)?;
        }
        Ok(())
    }

    fn end_epoch(&mut self, params: &mut [f32], loss: f64) -> Result<f64> {
        // The epoch's last step already synchronised (blocking) in the cycling phase; a
        // framework that never flagged it (a wrong last batch) still ends the epoch with
        // nothing in flight, as every rank has the same sends outstanding.
        if !self.in_flight.is_empty() {
            self.blocking_sync(params)?;
        }
        let loss = mean_loss(self.comm, loss)?;
        self.epoch += 1;
        self.batch = 0;
        self.schedule = next_schedule(&mut self.plateau, &self.cfg, self.epoch, self.schedule, loss);
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

    /// Heat's controller, transcribed from `heat/optim/dp_optimizer.py` (`DASO.
    /// epoch_loss_logic`) and `heat/optim/utils.py` (`DetectMetricPlateau`, patience 2,
    /// relative threshold, no cool-down), gs = 0 meaning synchronous.
    struct HeatController {
        best: f64,
        bad: usize,
        threshold: f64,
        gs: usize,
        ls: usize,
        w: usize,
        max_gs: usize,
        epoch: usize,
        warmup: usize,
        cooldown: usize,
        total: usize,
    }

    impl HeatController {
        fn test_if_improving(&mut self, loss: f64) -> bool {
            if loss < self.best * (1.0 - self.threshold) {
                self.best = loss;
                self.bad = 0;
            } else {
                self.bad += 1;
            }
            if self.bad > 2 {
                self.bad = 0;
                return true;
            }
            false
        }

        /// Called after an epoch, with Heat's epoch counter already advanced.
        fn epoch_loss_logic(&mut self, loss: f64) {
            if self.epoch < self.warmup {
                (self.gs, self.ls, self.w) = (0, 0, 0);
                return;
            } else if self.epoch == self.warmup {
                (self.gs, self.ls, self.w) = (4, 1, 1);
            }
            if self.epoch >= self.total - self.cooldown {
                (self.gs, self.ls, self.w) = (0, 0, 0);
                return;
            }
            let stable = self.test_if_improving(loss);
            if stable && self.gs > 1 {
                self.gs /= 2;
                self.ls /= 2;
                self.w = self.w.saturating_sub(1);
                if self.gs > 0 {
                    self.w = self.w.max(1);
                    self.ls = self.ls.max(1);
                }
            } else if self.gs == 1 && stable {
                (self.gs, self.ls, self.w) = (self.max_gs, self.max_gs / 4, self.max_gs / 4);
            }
        }
    }

    /// Our schedule against Heat's, epoch by epoch, on fixed loss sequences: falling 2 %
    /// per epoch (Heat never halves gs: every third epoch brings a 5 % gain over `best`;
    /// lowering `best` on every epoch, as this code once did, halved it after the fourth
    /// cycling epoch), plateaus with real improvements between them, and a seeded random
    /// walk.
    #[test]
    fn plateau_controller_matches_heats() {
        let falling: Vec<f64> = (0..30).map(|e| 2.0 * 0.98f64.powi(e)).collect();
        let steps: Vec<f64> = (0..30).map(|e| [1.0, 0.99, 0.98, 0.97, 0.5, 0.5, 0.49, 0.2][e % 8] / (1 + e / 8) as f64).collect();
        let mut state = 7u64;
        let walk: Vec<f64> = (0..30)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                1.0 + (state >> 33) as f64 / (1u64 << 31) as f64
            })
            .collect();
        for (losses, moves) in [(falling, false), (steps, true), (walk, true)] {
            let total = losses.len();
            let cfg = DasoConfig { warmup_epochs: 3, cooldown_epochs: 4, epochs: total, ..Default::default() };
            let mut heat =
                HeatController { best: f64::INFINITY, bad: 0, threshold: 0.05, gs: 0, ls: 0, w: 0, max_gs: 8, epoch: 0, warmup: 3, cooldown: 4, total };
            let (mut plateau, mut ours) = (Plateau::new(0.05, 8), None);
            let mut halved = false;
            for (e, &loss) in losses.iter().enumerate() {
                heat.epoch = e + 1;
                heat.epoch_loss_logic(loss);
                ours = next_schedule(&mut plateau, &cfg, e + 1, ours, loss);
                let theirs = (heat.gs > 0).then_some(Schedule { gs: heat.gs, ls: heat.ls, wait: heat.w });
                assert_eq!(ours, theirs, "after epoch {} (loss {loss}) of {losses:?}", e + 1);
                halved |= ours.is_some_and(|s| s.gs < 4);
            }
            // Falling 2 % per epoch is a 5 % gain every third epoch: never a plateau.
            assert_eq!(halved, moves, "the controller {} on {losses:?}", if halved { "moved" } else { "never moved" });
        }
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
