//! The model's parameters from measured runs: α, β, γ and σ of one kind of link by least
//! squares on the relative error of every measured (algorithm, ranks, bytes, time), so
//! that a 4 KiB call weighs as much as a 64 MiB one; a parameter the fit would make
//! negative is held at zero (the terms cannot speed a call up).

use super::{flat_terms, Algorithm, Link, Terms};

/// One measured call: an allreduce of `bytes` over `ranks` ranks by `algo` took `seconds`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    /// The algorithm that ran.
    pub algo: Algorithm,
    /// Ranks, one per node.
    pub ranks: usize,
    /// Bytes per rank.
    pub bytes: f64,
    /// The slowest rank's mean time per call.
    pub seconds: f64,
    /// Ranks per core of the host the ranks shared (1 where each had a core of its own).
    pub ranks_per_core: f64,
}

impl Sample {
    /// The model's terms of this call.
    pub fn terms(&self) -> Terms {
        flat_terms(self.algo, self.bytes, self.ranks).sharing(self.ranks_per_core)
    }
}

/// The samples of a `gradwire bench --csv` file (size_bytes and time_us columns), run by
/// `algo` over `ranks` ranks, each on a core of its own (see [`Sample::ranks_per_core`]).
pub fn samples_from_csv(text: &str, algo: Algorithm, ranks: usize) -> Result<Vec<Sample>, String> {
    let mut lines = text.lines().filter(|l| !l.trim().is_empty());
    let header: Vec<&str> = lines.next().ok_or("an empty CSV")?.split(',').collect();
    let col = |name: &str| header.iter().position(|h| h.trim() == name).ok_or_else(|| format!("no column {name} in the CSV header {header:?}"));
    let (size, time) = (col("size_bytes")?, col("time_us")?);
    lines
        .map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let num = |i: usize| f.get(i).and_then(|v| v.trim().parse::<f64>().ok()).ok_or_else(|| format!("bad row {l:?}"));
            Ok(Sample { algo, ranks, bytes: num(size)?, seconds: num(time)? * 1e-6, ranks_per_core: 1.0 })
        })
        .collect()
}

/// The link whose predictions are closest to `samples` (relative error, least squares).
pub fn fit(samples: &[Sample]) -> Result<Link, String> {
    let rows: Vec<([f64; 4], f64)> = samples
        .iter()
        .filter(|s| s.seconds > 0.0 && s.ranks > 1)
        .map(|s| {
            let t = s.terms();
            ([t.steps / s.seconds, t.bytes / s.seconds, t.reduced / s.seconds, t.shared / s.seconds], 1.0)
        })
        .collect();
    if rows.len() < 3 {
        return Err(format!("{} usable samples: a fit needs at least 3 (calls over 2 or more ranks)", rows.len()));
    }
    // Every subset of the four parameters, largest first: the best fit whose parameters
    // are all non-negative (a term the samples do not exercise, say γ without recursive
    // doubling or σ where no ranks shared a core, stays at zero).
    let mut masks: Vec<u8> = (1..16).collect();
    masks.sort_by_key(|m| std::cmp::Reverse(m.count_ones()));
    let mut best: Option<([f64; 4], f64)> = None;
    for mask in masks {
        let Some(theta) = solve_subset(&rows, mask) else { continue };
        if theta.iter().any(|&v| v < 0.0) {
            continue;
        }
        let err: f64 = rows.iter().map(|(x, y)| (x.iter().zip(&theta).map(|(a, b)| a * b).sum::<f64>() - y).powi(2)).sum();
        if best.is_none_or(|(_, e)| err < e * (1.0 - 1e-9)) {
            best = Some((theta, err));
        }
    }
    let (theta, _) = best.ok_or("no non-negative fit")?;
    Ok(Link { alpha: theta[0], beta: theta[1], gamma: theta[2], sigma: theta[3] })
}

/// Least squares over the columns in `mask` (bit 3 the first; the others zero): the normal
/// equations, solved by Gaussian elimination with partial pivoting; None when singular.
fn solve_subset(rows: &[([f64; 4], f64)], mask: u8) -> Option<[f64; 4]> {
    let cols: Vec<usize> = (0..4).filter(|c| mask & (1 << (3 - c)) != 0).collect();
    let n = cols.len();
    let mut a = vec![vec![0.0; n + 1]; n];
    for (x, y) in rows {
        for (i, &ci) in cols.iter().enumerate() {
            for (j, &cj) in cols.iter().enumerate() {
                a[i][j] += x[ci] * x[cj];
            }
            a[i][n] += x[ci] * y;
        }
    }
    for k in 0..n {
        let pivot = (k..n).max_by(|&i, &j| a[i][k].abs().total_cmp(&a[j][k].abs()))?;
        if a[pivot][k].abs() < 1e-12 * a.iter().map(|r| r[k].abs()).fold(0.0, f64::max).max(f64::MIN_POSITIVE) {
            return None;
        }
        a.swap(k, pivot);
        let row_k = a[k].clone();
        for (i, row) in a.iter_mut().enumerate() {
            if i != k {
                let f = row[k] / row_k[k];
                for (x, &y) in row.iter_mut().zip(&row_k).skip(k) {
                    *x -= f * y;
                }
            }
        }
    }
    let mut theta = [0.0; 4];
    for (i, &c) in cols.iter().enumerate() {
        theta[c] = a[i][n] / a[i][i];
    }
    Some(theta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fit_recovers_the_parameters_that_made_the_samples() {
        let truth = Link { alpha: 50e-6, beta: 8e-9, gamma: 0.3e-9, sigma: 20e-6 };
        let mut samples = vec![];
        for algo in Algorithm::OVER_LINKS {
            for ranks in [2, 3, 4, 8] {
                for bytes in [4096.0, 65536.0, 1048576.0, 16777216.0] {
                    // The ranks of each run shared 2 cores.
                    let ranks_per_core = ranks as f64 / 2.0;
                    let seconds = flat_terms(algo, bytes, ranks).sharing(ranks_per_core).time(&truth);
                    samples.push(Sample { algo, ranks, bytes, seconds, ranks_per_core });
                }
            }
        }
        let got = fit(&samples).unwrap();
        for (g, t) in [(got.alpha, truth.alpha), (got.beta, truth.beta), (got.gamma, truth.gamma), (got.sigma, truth.sigma)] {
            assert!((g - t).abs() <= 1e-6 * t, "{got:?} against {truth:?}");
        }
    }

    #[test]
    fn a_term_without_support_stays_zero_and_a_short_csv_is_an_error() {
        let truth = Link { alpha: 10e-6, beta: 1e-9, gamma: 0.0, sigma: 0.0 };
        let samples: Vec<Sample> = [4096.0, 1e6, 1e7]
            .iter()
            .map(|&bytes| Sample { algo: Algorithm::Ring, ranks: 4, bytes, seconds: flat_terms(Algorithm::Ring, bytes, 4).time(&truth), ranks_per_core: 1.0 })
            .collect();
        let got = fit(&samples).unwrap();
        assert_eq!((got.gamma, got.sigma), (0.0, 0.0));
        assert!((got.beta - 1e-9).abs() < 1e-15, "{got:?}");
        assert!(fit(&samples[..2]).is_err());
        let csv = "size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n4096,1024,float32,sum,100.5,0,0,0\n";
        assert_eq!(
            samples_from_csv(csv, Algorithm::Ring, 4).unwrap(),
            vec![Sample { algo: Algorithm::Ring, ranks: 4, bytes: 4096.0, seconds: 100.5 * 1e-6, ranks_per_core: 1.0 }]
        );
        assert!(samples_from_csv("bytes,t\n1,2\n", Algorithm::Ring, 4).unwrap_err().contains("size_bytes"));
    }
}
