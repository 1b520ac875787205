//! Reduction kernels: `dst = op(dst, src)` element-wise for every dtype, written as plain
//! loops over aligned slices so the compiler vectorises them; f16/bf16 widen to f32 in
//! L1-sized blocks (one rounding per combine, as NCCL does).

use crate::dtype::{DType, ReduceOp};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// `Avg` combines as `Sum`; the division happens once, at the end ([`scale`]).
#[inline]
fn combine_f32(op: ReduceOp, d: &mut [f32], s: &[f32]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(d, s)| *d += *s),
        ReduceOp::Min => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s < *d { *s } else { *d }),
        ReduceOp::Max => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s > *d { *s } else { *d }),
    }
}

#[inline]
fn combine_f64(op: ReduceOp, d: &mut [f64], s: &[f64]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(d, s)| *d += *s),
        ReduceOp::Min => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s < *d { *s } else { *d }),
        ReduceOp::Max => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s > *d { *s } else { *d }),
    }
}

const BLOCK: usize = 512;

/// f16 and bf16: widen a block to f32, combine, narrow back (one rounding per combine).
fn combine_half<H>(op: ReduceOp, d: &mut [H], s: &[H])
where
    [H]: HalfFloatSliceExt,
{
    let (mut a, mut b) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (dc, sc) in d.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
        let n = dc.len();
        dc.convert_to_f32_slice(&mut a[..n]);
        sc.convert_to_f32_slice(&mut b[..n]);
        combine_f32(op, &mut a[..n], &b[..n]);
        dc.convert_from_f32_slice(&a[..n]);
    }
}

/// Reinterprets bytes as `T` when aligned; `None` otherwise.
fn cast<T>(b: &[u8]) -> Option<&[T]> {
    // SAFETY: every bit pattern is a valid float; align_to only yields aligned middles.
    let (pre, mid, post) = unsafe { b.align_to::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

fn cast_mut<T>(b: &mut [u8]) -> Option<&mut [T]> {
    // SAFETY: as in `cast`.
    let (pre, mid, post) = unsafe { b.align_to_mut::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// `dst = op(dst, src)` over raw bytes of `dtype` elements. Both lengths must be equal
/// multiples of the element size. Unaligned buffers take a slower copy-through path.
pub fn reduce_bytes(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    debug_assert_eq!(dst.len(), src.len());
    let n = dst.len().min(src.len());
    let (dst, src) = (&mut dst[..n], &src[..n]);
    let aligned = (dst.as_ptr() as usize | src.as_ptr() as usize) % dtype.size() == 0;
    if !aligned {
        // Rare (only when a caller hands odd offsets): bounce through aligned blocks.
        let mut a = vec![0u64; 4096];
        let mut b = vec![0u64; 4096];
        for (dc, sc) in dst.chunks_mut(32768).zip(src.chunks(32768)) {
            // SAFETY: u64 buffers viewed as bytes.
            let ab = unsafe { std::slice::from_raw_parts_mut(a.as_mut_ptr() as *mut u8, dc.len()) };
            let bb = unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u8, sc.len()) };
            ab.copy_from_slice(dc);
            bb.copy_from_slice(sc);
            reduce_bytes(dtype, op, ab, bb);
            dc.copy_from_slice(ab);
        }
        return;
    }
    match dtype {
        DType::F32 => combine_f32(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::F64 => combine_f64(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::F16 => combine_half::<f16>(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::BF16 => combine_half::<bf16>(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
    }
}

/// Multiplies every element by `factor` (the final step of `Avg`).
pub fn scale(dtype: DType, buf: &mut [u8], factor: f64) {
    let aligned = buf.as_ptr() as usize % dtype.size() == 0;
    if !aligned {
        let mut tmp = vec![0u64; buf.len().div_ceil(8)];
        // SAFETY: u64 buffer viewed as bytes, at least buf.len() long.
        let t = unsafe { std::slice::from_raw_parts_mut(tmp.as_mut_ptr() as *mut u8, buf.len()) };
        t.copy_from_slice(buf);
        scale(dtype, t, factor);
        buf.copy_from_slice(t);
        return;
    }
    match dtype {
        DType::F32 => cast_mut::<f32>(buf).unwrap_or_default().iter_mut().for_each(|x| *x *= factor as f32),
        DType::F64 => cast_mut::<f64>(buf).unwrap_or_default().iter_mut().for_each(|x| *x *= factor),
        DType::F16 => {
            let f = factor as f32;
            cast_mut::<f16>(buf).unwrap_or_default().iter_mut().for_each(|x| *x = f16::from_f32(x.to_f32() * f));
        }
        DType::BF16 => {
            let f = factor as f32;
            cast_mut::<bf16>(buf).unwrap_or_default().iter_mut().for_each(|x| *x = bf16::from_f32(x.to_f32() * f));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes<T>(v: &[T]) -> &[u8] {
        // SAFETY: test helper viewing floats as bytes.
        unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
    }
    fn bytes_mut<T>(v: &mut [T]) -> &mut [u8] {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
    }

    #[test]
    fn every_dtype_and_op() {
        let a = [1.5f32, -2.0, 3.25, 96.0, -0.5];
        let b = [0.25f32, 4.0, -3.0, 1.0, -0.75];
        for op in ReduceOp::ALL {
            let want: Vec<f64> = a
                .iter()
                .zip(&b)
                .map(|(&x, &y)| match op {
                    ReduceOp::Sum | ReduceOp::Avg => x as f64 + y as f64,
                    ReduceOp::Min => x.min(y) as f64,
                    ReduceOp::Max => x.max(y) as f64,
                })
                .collect();
            let mut d = a;
            reduce_bytes(DType::F32, op, bytes_mut(&mut d), bytes(&b));
            assert_eq!(d.iter().map(|&x| x as f64).collect::<Vec<_>>(), want);
            let mut d: Vec<f64> = a.iter().map(|&x| x as f64).collect();
            let s: Vec<f64> = b.iter().map(|&x| x as f64).collect();
            reduce_bytes(DType::F64, op, bytes_mut(&mut d), bytes(&s));
            assert_eq!(d, want);
            // These values are exact in f16 and bf16, and so are their sums.
            let mut d: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
            let s: Vec<f16> = b.iter().map(|&x| f16::from_f32(x)).collect();
            reduce_bytes(DType::F16, op, bytes_mut(&mut d), bytes(&s));
            assert_eq!(d.iter().map(|x| x.to_f64()).collect::<Vec<_>>(), want);
            let mut d: Vec<bf16> = a.iter().map(|&x| bf16::from_f32(x)).collect();
            let s: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
            reduce_bytes(DType::BF16, op, bytes_mut(&mut d), bytes(&s));
            assert_eq!(d.iter().map(|x| x.to_f64()).collect::<Vec<_>>(), want);
        }
    }

    #[test]
    fn unaligned_path_matches() {
        let mut raw = vec![0u8; 4 * 9 + 1];
        let src: Vec<f32> = (0..9).map(|i| i as f32).collect();
        raw[1..].copy_from_slice(bytes(&src));
        let mut dst = raw.clone();
        reduce_bytes(DType::F32, ReduceOp::Sum, &mut dst[1..], &raw[1..]);
        for i in 0..9 {
            let v = f32::from_le_bytes(dst[1 + 4 * i..5 + 4 * i].try_into().unwrap());
            assert_eq!(v, 2.0 * i as f32);
        }
    }
}
