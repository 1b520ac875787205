//! `bsp`: aggregation-interval bulk-synchronous SGD (ALGORITHMS.md §2). Each rank takes K
//! local SGD steps from the shared anchor x̃, then one allreduce combines what every rank
//! accumulated and all ranks step from x̃ together.
//!
//! The paper reduces Δ_j = x̃ − x_j; with local plain SGD that is exactly γ·Σ g_j in real
//! arithmetic. We reduce the gradient sum a_j = Σ g_j instead and let the global optimizer
//! step from x̃ with the average, so that K = 1 is `ssgd` bit for bit (same values, same
//! operations, same order) and momentum stays a property of the global optimizer. Local
//! steps between reductions are plain SGD at the same learning rate.
//!
//! `--topk F` sends only the largest F·n entries of a_j (by magnitude) as (index, value)
//! pairs, gathered from every rank and scatter-added; the rest stays in a residual that is
//! added to the next interval's sum (error feedback), so nothing is ever dropped.

use super::ssgd::{allgather_bytes, average, from_rank0, mean_loss};
use super::{Sgd, Strategy};
use crate::comm::Communicator;
use crate::error::{invalid, Result};

pub struct Bsp<'c> {
    comm: &'c Communicator,
    global: Sgd,
    local: Sgd,
    interval: usize,
    /// x̃: the parameters every rank agreed on at the last reduction.
    anchor: Vec<f32>,
    /// a_j: gradients summed since the last reduction.
    acc: Vec<f32>,
    steps: usize,
    topk: Option<TopK>,
    sent: u64,
}

impl<'c> Bsp<'c> {
    pub fn new(comm: &'c Communicator, opt: Sgd, interval: usize, topk: f64) -> Result<Self> {
        if interval == 0 {
            return Err(invalid("bsp: the aggregation interval K must be at least 1"));
        }
        if !(0.0..=1.0).contains(&topk) {
            return Err(invalid(format!("bsp: --topk {topk} must be a fraction in [0, 1] (0: dense)")));
        }
        let local = Sgd::new(opt.lr, 0.0, false);
        let topk = (topk > 0.0).then(|| TopK::new(topk));
        Ok(Bsp { comm, global: opt, local, interval, anchor: vec![], acc: vec![], steps: 0, topk, sent: 0 })
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
        from_rank0(self.comm, params, &mut self.sent)?;
        self.anchor = params.to_vec();
        self.acc = vec![0.0; params.len()];
        Ok(())
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], _last_of_epoch: bool) -> Result<()> {
        if self.steps % self.interval == 0 {
            self.acc.copy_from_slice(grads);
        } else {
            self.acc.iter_mut().zip(grads).for_each(|(a, g)| *a += g);
        }
        self.steps += 1;
        if self.steps % self.interval != 0 {
            self.local.step(params, grads);
            return Ok(());
        }
        match &mut self.topk {
            None => average(self.comm, &mut self.acc, &mut self.sent)?,
            Some(topk) => {
                let pairs = topk.compress(&self.acc);
                // Indices travel as the bit patterns of f32 values: allgather moves bytes.
                let send: Vec<f32> = pairs.iter().flat_map(|&(i, v)| [f32::from_bits(i), v]).collect();
                let w = self.comm.size();
                let mut all = vec![0f32; send.len() * w];
                self.comm.allgather(&send, &mut all)?;
                self.sent += allgather_bytes(send.len(), w);
                self.acc.fill(0.0);
                for pair in all.chunks_exact(2) {
                    self.acc[pair[0].to_bits() as usize] += pair[1];
                }
                self.acc.iter_mut().for_each(|a| *a /= w as f32);
            }
        }
        params.copy_from_slice(&self.anchor);
        self.global.step(params, &self.acc);
        self.anchor.copy_from_slice(params);
        Ok(())
    }

    fn end_epoch(&mut self, _params: &mut [f32], loss: f64) -> Result<f64> {
        mean_loss(self.comm, loss)
    }

    fn current_model(&mut self, _params: &[f32]) -> Result<Vec<f32>> {
        Ok(self.anchor.clone())
    }

    fn describe(&self) -> String {
        format!("  [K={}{}]", self.interval, self.topk.as_ref().map_or(String::new(), |t| format!(", top-{:.2} %", 100.0 * t.fraction)))
    }

    fn finish(&mut self, params: &mut [f32]) -> Result<()> {
        // Local steps since the last reduction are dropped: the model is the agreed anchor.
        params.copy_from_slice(&self.anchor);
        Ok(())
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
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
