//! Data for the built-in model: the UCI optical handwritten digits (1797 8×8 images, 10
//! classes), as the `smartcore` crate ships them (compiled in, nothing is downloaded), and
//! a synthetic generator for larger runs.

use crate::error::{invalid, Result};
use rand::{Rng, SeedableRng};

/// A classification data set: `len` examples of `features` values each, labels below
/// `classes`.
#[derive(Clone, Debug)]
pub struct Dataset {
    /// The examples, row-major: example `i` is `x[i * features..(i + 1) * features]`.
    pub x: Vec<f32>,
    /// The label of every example, below `classes`.
    pub y: Vec<u32>,
    /// Values per example.
    pub features: usize,
    /// Number of classes.
    pub classes: usize,
}

impl Dataset {
    /// Number of examples.
    pub fn len(&self) -> usize {
        self.y.len()
    }

    /// Whether there are no examples.
    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    /// The `features` values of example `i` (panics if `i` is out of range).
    pub fn example(&self, i: usize) -> &[f32] {
        &self.x[i * self.features..(i + 1) * self.features]
    }

    /// The digits, pixel values scaled from 0..16 to 0..1.
    pub fn digits() -> Result<Dataset> {
        let d = smartcore::dataset::digits::load_dataset();
        if d.num_samples == 0 || d.data.len() != d.num_samples * d.num_features {
            return Err(invalid("the digits data shipped by smartcore is malformed"));
        }
        let y: Vec<u32> = d.target.iter().map(|&t| t as u32).collect();
        let classes = y.iter().copied().max().unwrap_or(0) as usize + 1;
        Ok(Dataset { x: d.data.iter().map(|v| v / 16.0).collect(), y, features: d.num_features, classes })
    }

    /// `len` examples in `features` dimensions: each class is a Gaussian blob around its
    /// own random centre, overlapping enough that accuracy keeps improving over epochs.
    pub fn synthetic(len: usize, features: usize, classes: usize, seed: u64) -> Dataset {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let centres: Vec<f32> = (0..classes * features).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let noise = 0.45 * (features as f32).sqrt();
        let mut x = Vec::with_capacity(len * features);
        let mut y = Vec::with_capacity(len);
        for _ in 0..len {
            let c = rng.random_range(0..classes);
            // Sum of three uniforms: a cheap, bounded bell curve (σ = 0.5). Its spread grows
            // with √features like the distance between centres, so the task stays equally
            // hard (about 90 % reachable) in any dimension.
            x.extend((0..features).map(|f| centres[c * features + f] + noise * (rng.random::<f32>() + rng.random::<f32>() + rng.random::<f32>() - 1.5)));
            y.push(c as u32);
        }
        Dataset { x, y, features, classes }
    }

    /// By name: `digits` or `synthetic[:LEN[:FEATURES[:CLASSES]]]`.
    pub fn by_name(name: &str) -> Result<Dataset> {
        let mut parts = name.split(':');
        match parts.next() {
            Some("digits") => Dataset::digits(),
            Some("synthetic") => {
                let mut num = |default: usize| -> Result<usize> {
                    match parts.next() {
                        None => Ok(default),
                        Some(v) => v.parse().map_err(|_| invalid(format!("data set '{name}': '{v}' is not a number"))),
                    }
                };
                let (len, features, classes) = (num(20_000)?, num(256)?, num(10)?);
                if len < 20 || features == 0 || classes < 2 {
                    return Err(invalid(format!("data set '{name}': needs at least 20 examples, 1 feature and 2 classes")));
                }
                Ok(Dataset::synthetic(len, features, classes, 0x5EED))
            }
            _ => Err(invalid(format!("unknown data set '{name}' (digits, synthetic[:LEN[:FEATURES[:CLASSES]]])"))),
        }
    }

    /// Splits off every `k`-th example (a fixed, class-balanced-enough test split).
    pub fn split_test(&self, k: usize) -> (Dataset, Dataset) {
        let mut train = Dataset { x: vec![], y: vec![], features: self.features, classes: self.classes };
        let mut test = train.clone();
        for i in 0..self.len() {
            let to = if i % k == 0 { &mut test } else { &mut train };
            to.x.extend_from_slice(self.example(i));
            to.y.push(self.y[i]);
        }
        (train, test)
    }
}

/// The minibatches of one rank in one epoch: its 1/world share of a permutation that every
/// rank draws alike from (seed, epoch), cut into batches of `batch`.
pub fn epoch_batches(len: usize, batch: usize, rank: usize, world: usize, seed: u64, epoch: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..len).collect();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (epoch as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    for i in (1..len).rev() {
        order.swap(i, rng.random_range(0..=i));
    }
    let mine: Vec<usize> = order.into_iter().skip(rank).step_by(world.max(1)).collect();
    mine.chunks(batch.max(1)).map(|c| c.to_vec()).collect()
}

/// Steps every rank takes per epoch when each trains on its own share
/// ([`epoch_batches`]): the batch count of the smallest share, so that a synchronous
/// scheme's ranks all make the same number of collective calls whatever the data size,
/// batch and world size (the larger shares leave their last few examples out).
pub fn steps_per_epoch(len: usize, batch: usize, world: usize) -> usize {
    (len / world.max(1)).div_ceil(batch.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Over a grid of (data size, batch, W): every rank's share has at least the common
    /// number of steps, and the smallest share exactly that many.
    #[test]
    fn every_rank_takes_the_same_steps() {
        for len in [1, 7, 100, 1437, 1797] {
            for batch in [1, 2, 7, 32, 5000] {
                for world in 1..=9 {
                    let steps = steps_per_epoch(len, batch, world);
                    let counts: Vec<usize> = (0..world).map(|r| epoch_batches(len, batch, r, world, 3, 0).len()).collect();
                    assert!(counts.iter().all(|&c| c >= steps), "len {len} batch {batch} W {world}: {counts:?} < {steps}");
                    assert_eq!(counts.iter().min().copied(), Some(steps), "len {len} batch {batch} W {world}: {counts:?}");
                }
            }
        }
    }

    #[test]
    fn digits_are_the_uci_set() {
        let d = Dataset::digits().unwrap();
        assert_eq!((d.len(), d.features, d.classes), (1797, 64, 10));
        assert!(d.x.iter().all(|v| (0.0..=1.0).contains(v)));
    }

    #[test]
    fn ranks_partition_each_epoch() {
        let mut seen: Vec<usize> = (0..3).flat_map(|r| epoch_batches(100, 7, r, 3, 1, 2).concat()).collect();
        seen.sort();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        assert_ne!(epoch_batches(100, 7, 0, 3, 1, 2), epoch_batches(100, 7, 0, 3, 1, 3));
    }
}
