//! Random test data and the independent reference every correctness check compares with.
//!
//! Every rank can regenerate every other rank's input from (seed, rank, case) (see
//! `check::case`), so the reference is computed here in f64 straight from the inputs — no
//! gradwire code involved. Integer inputs are drawn where f64 holds them exactly; their
//! reference is computed in 128-bit wrapping arithmetic and wrapped to the type, as C does.

use crate::{DType, ReduceOp};
use half::{bf16, f16};

/// Rounds an f64 to the nearest value of `dtype`; an integral value wraps into an integer
/// type (as a C cast of the exact result does); bool is 1 for anything nonzero.
pub fn round_to(dtype: DType, v: f64) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::F64 => v,
        DType::F16 => f16::from_f64(v).to_f64(),
        DType::BF16 => bf16::from_f64(v).to_f64(),
        DType::I8 => v as i64 as i8 as f64,
        DType::U8 => v as i64 as u8 as f64,
        DType::I32 => v as i64 as i32 as f64,
        DType::I64 => v as i64 as f64,
        DType::Bool => (v != 0.0) as u8 as f64,
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
            DType::I8 => o.copy_from_slice(&(v as i8).to_le_bytes()),
            DType::U8 => o.copy_from_slice(&(v as u8).to_le_bytes()),
            DType::I32 => o.copy_from_slice(&(v as i32).to_le_bytes()),
            DType::I64 => o.copy_from_slice(&(v as i64).to_le_bytes()),
            DType::Bool => o[0] = (v != 0.0) as u8,
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
            DType::I8 => b[0] as i8 as f64,
            DType::U8 => b[0] as f64,
            DType::I32 => i32::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
            DType::I64 => i64::from_le_bytes(b.try_into().unwrap_or_default()) as f64,
            // Any nonzero byte is true: a reduction may leave 2 where an input had 1.
            DType::Bool => (b[0] != 0) as u8 as f64,
        })
        .collect()
}

/// The spacing of `dtype`'s subnormals: the absolute error floor of one rounding, where
/// relative error no longer holds (f16 results below 6.1e-5 are spaced 2^-24 apart).
fn subnormal_step(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f32::from_bits(1) as f64,
        DType::F64 => f64::from_bits(1),
        DType::F16 => f16::from_bits(1).to_f64(),
        DType::BF16 => bf16::from_bits(1).to_f64(),
        DType::I8 | DType::U8 | DType::I32 | DType::I64 | DType::Bool => 0.0,
    }
}

/// Reference reduction of element `i` over `inputs` (one vector per rank) with a tolerance.
///
/// Tolerance, argued: a reduction of W values in `dtype` performs at most W−1 roundings of
/// partial results whose magnitude is at most Σ|x|, plus one for the final `avg` scaling;
/// each rounding errs by at most eps/2 of its operand, or by half the subnormal spacing
/// when the result is subnormal, so |error| ≤ (W+1)·(eps·Σ|x| + step)/2. We allow twice
/// that, covering tree/ring order differences; `avg` divides the summed error by W but not
/// the final rounding's. A product errs by W−1 roundings, each relative to the result
/// (relative errors compose), plus the floor for each. Min and max involve no rounding and
/// must be exact, and so must every integer and bool result.
pub fn reference(op: ReduceOp, dtype: DType, inputs: &[Vec<f64>], i: usize) -> (f64, f64) {
    let w = inputs.len() as f64;
    let xs = inputs.iter().map(|v| v[i]);
    if dtype == DType::Bool {
        let any = inputs.iter().any(|v| v[i] != 0.0);
        let all = inputs.iter().all(|v| v[i] != 0.0);
        let or = matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max);
        return ((if or { any } else { all }) as u8 as f64, 0.0);
    }
    if !dtype.is_float() {
        // Modular arithmetic: the low bits of a 128-bit wrapping result are the type's.
        let ints = inputs.iter().map(|v| v[i] as i128);
        let exact = match op {
            ReduceOp::Sum | ReduceOp::Avg => ints.fold(0i128, i128::wrapping_add),
            ReduceOp::Product => ints.fold(1i128, i128::wrapping_mul),
            ReduceOp::Min => ints.min().unwrap_or(0),
            ReduceOp::Max => ints.max().unwrap_or(0),
        };
        let wrapped = match dtype {
            DType::I8 => exact as i8 as f64,
            DType::U8 => exact as u8 as f64,
            DType::I32 => exact as i32 as f64,
            _ => exact as i64 as f64,
        };
        return (wrapped, 0.0);
    }
    let abs: f64 = inputs.iter().map(|v| v[i].abs()).sum();
    let (relative, floor) = ((w + 1.0) * dtype.epsilon() * abs, (w + 1.0) * subnormal_step(dtype));
    match op {
        ReduceOp::Sum => (xs.sum(), relative + floor),
        ReduceOp::Avg => (xs.sum::<f64>() / w, relative / w + floor),
        ReduceOp::Min => (xs.fold(f64::INFINITY, f64::min), 0.0),
        ReduceOp::Max => (xs.fold(f64::NEG_INFINITY, f64::max), 0.0),
        ReduceOp::Product => {
            let p: f64 = xs.product();
            (p, (w + 1.0) * (dtype.epsilon() * p.abs() + subnormal_step(dtype)))
        }
    }
}

/// [`reference`](fn@reference) for a half-precision sum, average or product that is computed in f32 and
/// rounded once (the automatic allreduce and reduce-scatter, see the collectives layer):
/// at most half a unit in the last place of the result (or half the subnormal spacing),
/// plus the f32 accumulation's W roundings — far tighter than W−1 half roundings, so a
/// path that rounds at every step fails it.
pub fn reference_rounded_once(op: ReduceOp, dtype: DType, inputs: &[Vec<f64>], i: usize) -> (f64, f64) {
    let (want, _) = reference(op, dtype, inputs, i);
    let w = inputs.len() as f64;
    let scale = match op {
        ReduceOp::Product => want.abs(),
        _ => inputs.iter().map(|v| v[i].abs()).sum::<f64>(),
    };
    let f32_slack = w * f32::EPSILON as f64 * scale;
    (want, 0.5 * dtype.epsilon() * want.abs() + 0.5 * subnormal_step(dtype) + f32_slack)
}

/// The exact int64 results of `op` over `inputs` (each within ±2^53, so exact as f64),
/// wrapped as the kernels wrap: what [`reference`](fn@reference) gives as f64 loses the low bits of a
/// result beyond 2^53, so int64 results are compared here, bit for bit.
pub fn int64_reference(op: ReduceOp, inputs: &[Vec<f64>], i: usize) -> i64 {
    let ints = inputs.iter().map(|v| v[i] as i128);
    (match op {
        ReduceOp::Sum | ReduceOp::Avg => ints.fold(0i128, i128::wrapping_add),
        ReduceOp::Product => ints.fold(1i128, i128::wrapping_mul),
        ReduceOp::Min => ints.min().unwrap_or(0),
        ReduceOp::Max => ints.max().unwrap_or(0),
    }) as i64
}

/// How many int64 elements of `got` (little-endian bytes) differ from `want`.
pub fn int64_wrong(got: &[u8], want: impl Iterator<Item = i64>) -> usize {
    got.chunks_exact(8).zip(want).filter(|(g, w)| i64::from_le_bytes([g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]]) != *w).count()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A wrong low bit of an int64 result beyond 2^53 is invisible as f64 but caught here.
    #[test]
    fn int64_results_are_compared_exactly() {
        let inputs = vec![vec![(1i64 << 53) as f64], vec![(1i64 << 53) as f64], vec![3.0]];
        let want = int64_reference(ReduceOp::Sum, &inputs, 0);
        assert_eq!(want, (1i64 << 54) + 3);
        let off_by_one = (want + 1).to_le_bytes();
        assert_eq!(((want + 1) as f64), (want as f64), "the f64 comparison cannot see it");
        assert_eq!(int64_wrong(&off_by_one, std::iter::once(want)), 1);
        assert_eq!(int64_wrong(&want.to_le_bytes(), std::iter::once(want)), 0);
    }

    /// The CI failure that taught the subnormal floor: an f16 average of 2 ranks whose
    /// result (about -7.5e-6) is subnormal, rounded once to the nearest step of 2^-24.
    #[test]
    fn subnormal_results_get_an_absolute_floor() {
        for k in 1..2000 {
            let inputs = vec![vec![-(k as f64) * 1.3e-8], vec![-(k as f64) * 1.7e-8 + 2e-9]];
            for op in [ReduceOp::Sum, ReduceOp::Avg] {
                let want = reference(op, DType::F16, &inputs, 0);
                assert!(within(round_to(DType::F16, want.0), want), "{op:?} k={k}: {want:?}");
            }
        }
        // Still strict for normal values: the floor adds only 3 steps of 2^-24 here.
        let (want, tol) = reference(ReduceOp::Sum, DType::F16, &[vec![1.0], vec![0.5]], 0);
        assert!(within(want + DType::F16.epsilon(), (want, tol)));
        assert!(!within(want + 8.0 * DType::F16.epsilon(), (want, tol)));
    }
}
