//! Random test data and the independent reference every correctness check compares with.
//!
//! Every rank can regenerate every other rank's input from (seed, rank, case) (see
//! `check::Gen`), so the reference is computed here in f64 straight from the inputs — no
//! gradwire code involved.

use gradwire::{DType, ReduceOp};
use half::{bf16, f16};

/// Rounds an f64 to the nearest value of `dtype`.
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::F64 => v,
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
    }
}

/// Encodes f64 values as `dtype` bytes.
pub fn encode(dtype: DType, vals: &[f64], out: &mut [u8]) {
    let es = dtype.size();
    for (i, &v) in vals.iter().enumerate() {
        let o = &mut out[i * es..(i + 1) * es];
        match dtype {
            DType::F32 => o.copy_from_slice(&(v as f32).to_le_bytes()),
            DType::F64 => o.copy_from_slice(&v.to_le_bytes()),
            DType::F16 => o.copy_from_slice(&f16::from_f64(v).to_le_bytes()),
            DType::BF16 => o.copy_from_slice(&bf16::from_f64(v).to_le_bytes()),
        }
    }
}

/// Decodes `dtype` bytes to f64.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|b| match dtype {
            DType::F32 => f32::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
            DType::F64 => f64::from_le_bytes(b.try_into().unwrap_or_default()),
            DType::F16 => f16::from_le_bytes(b.try_into().unwrap_or_default()).to_f64(),
            DType::BF16 => bf16::from_le_bytes(b.try_into().unwrap_or_default()).to_f64(),
        })
        .collect()
}

/// Reference reduction of element `i` over `inputs` (one vector per rank) with a tolerance.
///
/// Tolerance, argued: a reduction of W values in `dtype` performs at most W−1 roundings of
/// partial results whose magnitude is at most Σ|x|, plus one for the final `avg` scaling;
/// each rounding errs by at most eps/2 of its operand, so |error| ≤ (W+1)·eps/2·Σ|x|. We
/// allow (W+1)·eps·Σ|x| (twice the bound, covering tree/ring order differences). Min and
/// max involve no rounding and must be exact.
pub fn reference(op: ReduceOp, dtype: DType, inputs: &[Vec<f64>], i: usize) -> (f64, f64) {
    let w = inputs.len() as f64;
    let xs = inputs.iter().map(|v| v[i]);
    let abs: f64 = inputs.iter().map(|v| v[i].abs()).sum();
    let tol = (w + 1.0) * dtype.epsilon() * abs;
    match op {
        ReduceOp::Sum => (xs.sum(), tol),
        ReduceOp::Avg => (xs.sum::<f64>() / w, tol / w),
        ReduceOp::Min => (xs.fold(f64::INFINITY, f64::min), 0.0),
        ReduceOp::Max => (xs.fold(f64::NEG_INFINITY, f64::max), 0.0),
    }
}

/// Whether `got` is within `tol` of `want` (a NaN never is).
pub fn within(got: f64, (want, tol): (f64, f64)) -> bool {
    (got - want).abs() <= tol
}

/// Counts elements of `got` outside the tolerance of `want`.
pub fn count_wrong(got: &[f64], want: &[(f64, f64)]) -> usize {
    got.iter().zip(want).filter(|(g, w)| !within(**g, **w)).count() + got.len().abs_diff(want.len())
}

/// FNV-1a over bytes, for checking that every rank holds bit-identical results.
pub fn fingerprint(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}
