//! The [`Model`] interface and the built-in model: a multi-layer perceptron (ReLU hidden
//! layers, softmax cross-entropy) whose parameters and gradients are flat f32 buffers, the
//! layout collectives and parameter servers move without copying.

use super::data::Dataset;
use rand::{Rng, SeedableRng};

/// What a strategy needs from a model: a flat parameter vector and the gradient of the loss
/// on a minibatch, written into a flat buffer of the same length.
pub trait Model {
    /// Length of the parameter vector (and of the gradient).
    fn num_params(&self) -> usize;
    /// Initial parameters (the same on every rank for the same seed).
    fn init(&self, seed: u64) -> Vec<f32>;
    /// Mean loss over `batch` (indices into the training set) at `params`; overwrites `grads`
    /// with its gradient.
    fn loss_and_grad(&mut self, params: &[f32], batch: &[usize], grads: &mut [f32]) -> f32;
    /// (mean loss, accuracy) on the test set at `params`.
    fn evaluate(&mut self, params: &[f32]) -> (f64, f64);
    /// Training examples.
    fn train_len(&self) -> usize;
}

/// A fully connected network `sizes[0] → sizes[1] → … → classes` on a [`Dataset`].
pub struct Mlp {
    sizes: Vec<usize>,
    train: Dataset,
    test: Dataset,
    /// Per layer: activations of the current batch (layer 0 = inputs), and their gradients.
    acts: Vec<Vec<f32>>,
    delta: Vec<Vec<f32>>,
}

/// Dot product in eight lanes: f32 sums are not reassociated by the compiler, so a plain
/// iterator sum would stay scalar.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

impl Mlp {
    /// `hidden` layer widths between the data set's features and its classes; the test
    /// set is every 5th example.
    pub fn new(data: &Dataset, hidden: &[usize]) -> Mlp {
        let (train, test) = data.split_test(5);
        let mut sizes = vec![data.features];
        sizes.extend_from_slice(hidden);
        sizes.push(data.classes);
        Mlp { sizes, train, test, acts: vec![], delta: vec![] }
    }

    /// Offset of layer `l`'s weights (out × in, row-major) and biases in the flat vector.
    fn layer_at(&self, l: usize) -> (usize, usize) {
        let w: usize = (0..l).map(|k| self.sizes[k + 1] * (self.sizes[k] + 1)).sum();
        (w, w + self.sizes[l + 1] * self.sizes[l])
    }

    /// Forward pass over `rows` examples of `data`; leaves activations in `self.acts` and
    /// returns (summed loss, correct predictions), with the output layer's softmax minus
    /// one-hot (the gradient of the loss) in `self.delta`'s last entry.
    fn forward(&mut self, params: &[f32], data: &Dataset, rows: &[usize]) -> (f64, usize) {
        let layers = self.sizes.len() - 1;
        let b = rows.len();
        self.acts.resize(layers + 1, vec![]);
        self.delta.resize(layers + 1, vec![]);
        self.acts[0].clear();
        rows.iter().for_each(|&r| self.acts[0].extend_from_slice(data.example(r)));
        for l in 0..layers {
            let (n_in, n_out) = (self.sizes[l], self.sizes[l + 1]);
            let (w_at, b_at) = self.layer_at(l);
            let mut out = std::mem::take(&mut self.acts[l + 1]);
            out.resize(b * n_out, 0.0);
            for i in 0..b {
                let x = &self.acts[l][i * n_in..(i + 1) * n_in];
                for o in 0..n_out {
                    let z = dot(x, &params[w_at + o * n_in..w_at + (o + 1) * n_in]) + params[b_at + o];
                    out[i * n_out + o] = if l + 1 < layers { z.max(0.0) } else { z };
                }
            }
            self.acts[l + 1] = out;
        }
        // Softmax cross-entropy on the logits.
        let classes = self.sizes[layers];
        let (mut loss, mut correct) = (0f64, 0usize);
        let mut d = std::mem::take(&mut self.delta[layers]);
        d.resize(b * classes, 0.0);
        for (i, &r) in rows.iter().enumerate() {
            let z = &self.acts[layers][i * classes..(i + 1) * classes];
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = z.iter().map(|v| (v - max).exp()).sum();
            let label = data.y[r] as usize;
            loss += (sum.ln() - (z[label] - max)) as f64;
            let best = (0..classes).fold(0, |best, c| if z[c] > z[best] { c } else { best });
            correct += (best == label) as usize;
            for c in 0..classes {
                d[i * classes + c] = ((z[c] - max).exp() / sum - (c == label) as u8 as f32) / b as f32;
            }
        }
        self.delta[layers] = d;
        (loss, correct)
    }
}

impl Model for Mlp {
    fn num_params(&self) -> usize {
        self.sizes.windows(2).map(|s| s[1] * (s[0] + 1)).sum()
    }

    fn init(&self, seed: u64) -> Vec<f32> {
        // He initialisation for ReLU layers; zero biases.
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let mut p = vec![0f32; self.num_params()];
        for l in 0..self.sizes.len() - 1 {
            let (w_at, b_at) = self.layer_at(l);
            let scale = (6.0 / self.sizes[l] as f32).sqrt();
            p[w_at..b_at].iter_mut().for_each(|w| *w = rng.random_range(-scale..scale));
        }
        p
    }

    fn loss_and_grad(&mut self, params: &[f32], batch: &[usize], grads: &mut [f32]) -> f32 {
        let train = std::mem::replace(&mut self.train, Dataset { x: vec![], y: vec![], features: 0, classes: 0 });
        let (loss, _) = self.forward(params, &train, batch);
        self.train = train;
        let b = batch.len();
        grads.fill(0.0);
        for l in (0..self.sizes.len() - 1).rev() {
            let (n_in, n_out) = (self.sizes[l], self.sizes[l + 1]);
            let (w_at, b_at) = self.layer_at(l);
            let d = std::mem::take(&mut self.delta[l + 1]);
            let mut below = std::mem::take(&mut self.delta[l]);
            below.clear();
            below.resize(b * n_in, 0.0);
            for i in 0..b {
                let x = &self.acts[l][i * n_in..(i + 1) * n_in];
                for o in 0..n_out {
                    let g = d[i * n_out + o];
                    if g == 0.0 {
                        continue;
                    }
                    axpy(&mut grads[w_at + o * n_in..w_at + (o + 1) * n_in], g, x);
                    grads[b_at + o] += g;
                    if l > 0 {
                        axpy(&mut below[i * n_in..(i + 1) * n_in], g, &params[w_at + o * n_in..w_at + (o + 1) * n_in]);
                    }
                }
            }
            if l > 0 {
                // Through the ReLU of the layer below.
                below.iter_mut().zip(&self.acts[l]).for_each(|(g, a)| {
                    if *a <= 0.0 {
                        *g = 0.0
                    }
                });
            }
            self.delta[l + 1] = d;
            self.delta[l] = below;
        }
        (loss / b.max(1) as f64) as f32
    }

    fn evaluate(&mut self, params: &[f32]) -> (f64, f64) {
        let test = std::mem::replace(&mut self.test, Dataset { x: vec![], y: vec![], features: 0, classes: 0 });
        let (mut loss, mut correct) = (0f64, 0usize);
        let rows: Vec<usize> = (0..test.len()).collect();
        for chunk in rows.chunks(256) {
            let (l, c) = self.forward(params, &test, chunk);
            loss += l;
            correct += c;
        }
        let n = test.len().max(1) as f64;
        self.test = test;
        (loss / n, correct as f64 / n)
    }

    fn train_len(&self) -> usize {
        self.train.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The analytic gradient agrees with central differences of the loss.
    #[test]
    fn gradient_matches_finite_differences() {
        let data = Dataset::synthetic(40, 6, 3, 7);
        let mut m = Mlp::new(&data, &[5, 4]);
        let p = m.init(3);
        let batch: Vec<usize> = (0..8).collect();
        let mut g = vec![0f32; p.len()];
        m.loss_and_grad(&p, &batch, &mut g);
        let mut scratch = vec![0f32; p.len()];
        for i in (0..p.len()).step_by(7) {
            let (mut hi, mut lo) = (p.clone(), p.clone());
            hi[i] += 1e-2;
            lo[i] -= 1e-2;
            let numeric = (m.loss_and_grad(&hi, &batch, &mut scratch) - m.loss_and_grad(&lo, &batch, &mut scratch)) / 2e-2;
            assert!((numeric - g[i]).abs() < 2e-3 + 0.05 * g[i].abs(), "param {i}: analytic {} numeric {numeric}", g[i]);
        }
    }

    #[test]
    fn plain_sgd_learns_the_digits() {
        let data = Dataset::digits().unwrap();
        let mut m = Mlp::new(&data, &[32]);
        let mut p = m.init(1);
        let mut g = vec![0f32; p.len()];
        let mut opt = super::super::Sgd::new(0.1, 0.9, false);
        for epoch in 0..8 {
            for b in super::super::data::epoch_batches(m.train_len(), 32, 0, 1, 5, epoch) {
                m.loss_and_grad(&p, &b, &mut g);
                opt.step(&mut p, &g);
            }
        }
        let (_, acc) = m.evaluate(&p);
        assert!(acc > 0.9, "test accuracy {acc}");
    }
}
