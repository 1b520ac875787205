//! `bsp`: aggregation-interval bulk-synchronous SGD (docs/algorithms.md §2). Each rank takes K
//! local steps of the framework's optimizer from the shared anchor x̃, then one allreduce
//! averages the changes Δ_j = x̃ − x_j and every rank moves to x̃ − avg(Δ), the new anchor.
//! Momentum (and any optimizer state) stays local, as the specification says.
//!
//! K = 1 without top-k averages the gradients before the optimizer instead: in exact
//! arithmetic the same step (the change average is the step on the gradient average, also
//! through momentum, which is linear), and it keeps `ssgd`'s bits exactly.
//!
//! `--topk F` sends only the largest F·n entries of Δ_j (by magnitude) as (index, value)
//! pairs, gathered from every rank and scatter-added; the rest stays in a residual that is
//! added to the next interval's change (error feedback), so nothing is ever dropped.
//!
//! The hierarchical variant (`node_interval` K1 > 0, K a multiple of K1): every K1 steps
//! the change is averaged inside the node only (from the node's anchor), every K steps over
//! all ranks.
//!
//! With `data=caller` (dense only) the steps are recorded as [`Action`]s for a caller that
//! keeps the model in device memory (`plan`).

use super::plan::{Action, Asked};
use super::ssgd::{allgather_bytes, allreduce_bytes, average, from_rank0, mean_loss};
use super::{f32_bytes, Strategy};
use crate::collective::hierarchical::Hierarchy;
use crate::comm::Communicator;
use crate::dtype::ReduceOp;
use crate::error::{invalid, Result};
use crate::train::daso::Wire;

/// The `bsp` strategy on one communicator (see the module docs).
pub struct Bsp<'c> {
    comm: &'c Communicator,
    interval: usize,
    /// K1 of the hierarchical variant, with its node group (None: flat).
    node: Option<(usize, Hierarchy)>,
    /// x̃: the parameters every rank agreed on at the last global reduction.
    anchor: Vec<f32>,
    /// The node's anchor of the hierarchical variant (the last node or global reduction).
    node_anchor: Vec<f32>,
    /// Δ_j, reused between reductions.
    change: Vec<f32>,
    steps: usize,
    topk: Option<TopK>,
    sent: u64,
    /// Parameters in the model.
    len: usize,
    /// With `data=caller`: the steps recorded for the caller, not yet taken.
    asked: Asked,
}

impl<'c> Bsp<'c> {
    /// `interval` is K (at least 1); `topk` the fraction of Δ's entries sent, in [0, 1] (0: dense);
    /// `node_interval` K1 (0: flat; else it must divide K and be smaller, and the node groups are made now);
    /// `len` parameters; `caller_moves_data`: record the steps instead of running them (dense only).
    pub fn new(comm: &'c Communicator, interval: usize, topk: f64, node_interval: usize, len: usize, caller_moves_data: bool) -> Result<Self> {
        if interval == 0 {
            return Err(invalid("bsp: the aggregation interval K must be at least 1"));
        }
        if !(0.0..=1.0).contains(&topk) {
            return Err(invalid(format!("bsp: --topk {topk} must be a fraction in [0, 1] (0: dense)")));
        }
        if node_interval > 0 && (node_interval >= interval || interval % node_interval != 0) {
            return Err(invalid(format!("bsp: the node interval K1 = {node_interval} must divide K = {interval} and be smaller")));
        }
        let node = if node_interval > 0 { Some((node_interval, Hierarchy::new(comm)?)) } else { None };
        if caller_moves_data && topk > 0.0 {
            return Err(invalid("bsp: topk with data=caller: the top-k selection runs on gradwire's host buffers (leave data=caller out)"));
        }
        let topk = (topk > 0.0).then(|| TopK::new(topk));
        let asked = Asked::new(caller_moves_data);
        Ok(Bsp { comm, interval, node, anchor: vec![], node_anchor: vec![], change: vec![], steps: 0, topk, sent: 0, len, asked })
    }

    /// The anchors become `params` (the node's too, in the hierarchical variant).
    fn set_anchors(&mut self, params: &[f32], global: bool) {
        if global && !self.asked.ask(Action::SetAnchor) {
            self.anchor.clear();
            self.anchor.extend_from_slice(params);
        }
        if self.node.is_some() && !self.asked.ask(Action::SetNodeAnchor) {
            self.node_anchor.clear();
            self.node_anchor.extend_from_slice(params);
        }
    }

    /// K = 1, dense, flat: the gradient-average form (see the module docs).
    fn gradient_form(&self) -> bool {
        self.interval == 1 && self.topk.is_none() && self.node.is_none()
    }

    /// Every rank moves to x̃ − avg(Δ) over `group` (all ranks or the node), from `anchor`.
    fn reduce_change(&mut self, params: &mut [f32], global: bool) -> Result<()> {
        if self.asked.caller_moves_data() {
            let size = if global { self.comm.size() } else { self.node.as_ref().map_or(1, |(_, h)| h.node.size()) };
            self.sent += allreduce_bytes(self.len, size);
            self.asked.ask(if global { Action::AverageChange { wire: Wire::F32 } } else { Action::AverageChangeInNode });
            if global {
                self.set_anchors(params, false);
            }
            return Ok(());
        }
        let anchor = if global { &self.anchor } else { &self.node_anchor };
        self.change.clear();
        self.change.extend(anchor.iter().zip(params.iter()).map(|(a, p)| a - p));
        let group = match (&self.node, global) {
            (Some((_, h)), false) => &h.node,
            _ => self.comm,
        };
        match (&mut self.topk, global) {
            (Some(topk), true) => {
                let pairs = topk.compress(&self.change);
                // Indices travel as the bit patterns of f32 values: allgather moves bytes.
                let send: Vec<f32> = pairs.iter().flat_map(|&(i, v)| [f32::from_bits(i), v]).collect();
                let w = group.size();
                let mut all = vec![0f32; send.len() * w];
                group.allgather(&send, &mut all)?;
                self.sent += allgather_bytes(send.len(), w);
                self.change.fill(0.0);
                for pair in all.chunks_exact(2) {
                    self.change[pair[0].to_bits() as usize] += pair[1];
                }
                self.change.iter_mut().for_each(|d| *d /= w as f32);
            }
            _ => {
                group.allreduce(&mut self.change, ReduceOp::Avg)?;
                self.sent += allreduce_bytes(self.change.len(), group.size());
            }
        }
        let anchor = if global { &self.anchor } else { &self.node_anchor };
        params.iter_mut().zip(anchor).zip(&self.change).for_each(|((p, a), d)| *p = a - d);
        self.set_anchors(params, global);
        Ok(())
    }
}

/// Top-k selection with error feedback, on its own so it can be tested without a network.
#[derive(Clone, Debug)]
pub struct TopK {
    fraction: f64,
    /// What was not sent yet.
    pub residual: Vec<f32>,
}

impl TopK {
    /// Selects `fraction` (in (0, 1]) of the entries, with an empty residual.
    pub fn new(fraction: f64) -> Self {
        TopK { fraction, residual: vec![] }
    }

    /// Entries to send for a vector of `n`: at least one.
    pub fn k(&self, n: usize) -> usize {
        ((self.fraction * n as f64).ceil() as usize).clamp(1, n.max(1))
    }

    /// Adds `a` to the residual, takes out its `k` largest entries by magnitude (ties: lower
    /// index first) and returns them as (index, value), sorted by index.
    pub fn compress(&mut self, a: &[f32]) -> Vec<(u32, f32)> {
        if self.residual.len() != a.len() {
            self.residual = vec![0.0; a.len()];
        }
        self.residual.iter_mut().zip(a).for_each(|(r, a)| *r += a);
        let k = self.k(a.len()).min(a.len());
        let mut idx: Vec<u32> = (0..a.len() as u32).collect();
        if k < a.len() {
            idx.select_nth_unstable_by(k, |&x, &y| self.residual[y as usize].abs().total_cmp(&self.residual[x as usize].abs()).then(x.cmp(&y)));
            idx.truncate(k);
        }
        idx.sort_unstable();
        idx.into_iter().map(|i| (i, std::mem::take(&mut self.residual[i as usize]))).collect()
    }
}

impl Strategy for Bsp<'_> {
    fn name(&self) -> &'static str {
        "bsp"
    }

    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        if self.asked.ask(Action::BroadcastAll { root: 0 }) {
            if self.comm.rank() == 0 {
                self.sent += f32_bytes(self.len);
            }
        } else {
            from_rank0(self.comm, params, &mut self.sent)?;
        }
        self.set_anchors(params, true);
        Ok(())
    }

    fn framework_update(&self) -> bool {
        true
    }

    fn before_update(&mut self, grads: &mut [f32], _last_of_epoch: bool) -> Result<()> {
        if self.gradient_form() {
            if self.asked.ask(Action::AverageGradsAll) {
                self.sent += allreduce_bytes(self.len, self.comm.size());
            } else {
                average(self.comm, grads, &mut self.sent)?;
            }
        }
        Ok(())
    }

    fn after_update(&mut self, params: &mut [f32], _last_of_epoch: bool) -> Result<()> {
        self.steps += 1;
        if self.gradient_form() {
            self.set_anchors(params, true);
            return Ok(());
        }
        if self.steps % self.interval == 0 {
            return self.reduce_change(params, true);
        }
        if self.node.as_ref().is_some_and(|(k1, _)| self.steps % k1 == 0) {
            return self.reduce_change(params, false);
        }
        Ok(())
    }

    fn end_epoch(&mut self, _params: &mut [f32], loss: f64) -> Result<f64> {
        mean_loss(self.comm, loss)
    }

    fn current_model(&mut self, _params: &[f32]) -> Result<Vec<f32>> {
        Ok(self.anchor.clone())
    }

    fn describe(&self) -> String {
        format!(
            "  [K={}{}{}]",
            self.interval,
            self.node.as_ref().map_or(String::new(), |(k1, _)| format!(", K1={k1} in the node")),
            self.topk.as_ref().map_or(String::new(), |t| format!(", top-{:.2} %", 100.0 * t.fraction))
        )
    }

    fn finish(&mut self, params: &mut [f32]) -> Result<()> {
        // Local steps since the last reduction are dropped: the model is the agreed anchor.
        if !self.asked.ask(Action::TakeAnchor) {
            params.copy_from_slice(&self.anchor);
        }
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }

    fn caller_moves_data(&self) -> bool {
        self.asked.caller_moves_data()
    }

    fn take_actions(&mut self) -> Vec<Action> {
        self.asked.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whatever the selection, sent + residual equals everything put in, exactly (integer
    /// values, so sums are exact).
    #[test]
    fn top_k_error_feedback_loses_nothing() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        let n = 1000;
        let mut t = TopK::new(0.01);
        let (mut put, mut sent) = (vec![0f64; n], vec![0f64; n]);
        for _ in 0..200 {
            let a: Vec<f32> = (0..n).map(|_| rng.random_range(-50i32..=50) as f32).collect();
            a.iter().zip(&mut put).for_each(|(a, p)| *p += *a as f64);
            let pairs = t.compress(&a);
            assert_eq!(pairs.len(), 10);
            assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0));
            pairs.iter().for_each(|&(i, v)| sent[i as usize] += v as f64);
        }
        for i in 0..n {
            assert_eq!(sent[i] + t.residual[i] as f64, put[i], "entry {i}");
        }
        // And the largest residual entries are what gets sent next.
        let max = t.residual.iter().map(|r| r.abs()).fold(0.0, f32::max);
        let next = t.compress(&vec![0.0; n]);
        assert!(next.iter().any(|&(_, v)| v.abs() == max));
    }
}
