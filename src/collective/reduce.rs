//! Reduction kernels: `dst = op(dst, src)` element-wise for every dtype, written as plain
//! loops over aligned slices so the compiler vectorises them; f16/bf16 widen to f32 in
//! L1-sized blocks: one rounding per combine of two buffers (as NCCL's steps do), one
//! rounding for the whole reduction where every source is at hand ([`reduce_all`]). Integers wrap on overflow (as
//! C and torch do); `bool` bytes combine as their maximum (sum, max: or) or minimum
//! (product, min: and).

use crate::dtype::{DType, ReduceOp};
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use half::{bf16, f16};

/// `Avg` combines as `Sum`; the division happens once, at the end ([`scale`]).
#[inline(always)]
fn combine_f32(op: ReduceOp, d: &mut [f32], s: &[f32]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(d, s)| *d += *s),
        ReduceOp::Min => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s < *d { *s } else { *d }),
        ReduceOp::Max => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s > *d { *s } else { *d }),
        ReduceOp::Product => d.iter_mut().zip(s).for_each(|(d, s)| *d *= *s),
    }
}

#[inline(always)]
fn combine_f64(op: ReduceOp, d: &mut [f64], s: &[f64]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(d, s)| *d += *s),
        ReduceOp::Min => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s < *d { *s } else { *d }),
        ReduceOp::Max => d.iter_mut().zip(s).for_each(|(d, s)| *d = if *s > *d { *s } else { *d }),
        ReduceOp::Product => d.iter_mut().zip(s).for_each(|(d, s)| *d *= *s),
    }
}

/// The integer types: wrapping sum and product, min, max (`avg` is refused before any
/// kernel runs; here it would combine as a sum).
macro_rules! combine_int {
    ($($name:ident: $t:ty),*) => {$(
        #[inline(always)]
        fn $name(op: ReduceOp, d: &mut [$t], s: &[$t]) {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => d.iter_mut().zip(s).for_each(|(d, s)| *d = d.wrapping_add(*s)),
                ReduceOp::Min => d.iter_mut().zip(s).for_each(|(d, s)| *d = (*d).min(*s)),
                ReduceOp::Max => d.iter_mut().zip(s).for_each(|(d, s)| *d = (*d).max(*s)),
                ReduceOp::Product => d.iter_mut().zip(s).for_each(|(d, s)| *d = d.wrapping_mul(*s)),
            }
        }
    )*};
}
combine_int!(combine_i8: i8, combine_u8: u8, combine_i32: i32, combine_i64: i64);

/// `bool` as bytes: any nonzero byte is true, so the maximum is the logical or (sum, max)
/// and the minimum the logical and (product, min): the u8 op a bool op combines as.
fn bool_as_u8(op: ReduceOp) -> ReduceOp {
    if matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max) {
        ReduceOp::Max
    } else {
        ReduceOp::Min
    }
}

#[inline(always)]
fn combine_bool(op: ReduceOp, d: &mut [u8], s: &[u8]) {
    combine_u8(bool_as_u8(op), d, s)
}

/// `d = f(a, b)` element-wise: a combine whose first operand is not `d` itself, in one
/// pass (where copying `a` into `d` first and combining there would be two).
#[inline(always)]
fn zip3<T: Copy>(d: &mut [T], a: &[T], b: &[T], f: impl Fn(T, T) -> T) {
    d.iter_mut().zip(a).zip(b).for_each(|((d, a), b)| *d = f(*a, *b));
}

/// [`combine_f32`] and [`combine_f64`] with the accumulator read from `a`: the same
/// operations in the same order (`min` = b < a ? b : a), so the same results bit for bit.
macro_rules! combine_float_from {
    ($($name:ident: $t:ty),*) => {$(
        #[inline(always)]
        fn $name(op: ReduceOp, d: &mut [$t], a: &[$t], b: &[$t]) {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => zip3(d, a, b, |x, y| x + y),
                ReduceOp::Min => zip3(d, a, b, |x, y| if y < x { y } else { x }),
                ReduceOp::Max => zip3(d, a, b, |x, y| if y > x { y } else { x }),
                ReduceOp::Product => zip3(d, a, b, |x, y| x * y),
            }
        }
    )*};
}
combine_float_from!(combine_f32_from: f32, combine_f64_from: f64);

/// The integer combines with the accumulator read from `a` (see `combine_int`).
macro_rules! combine_int_from {
    ($($name:ident: $t:ty),*) => {$(
        #[inline(always)]
        fn $name(op: ReduceOp, d: &mut [$t], a: &[$t], b: &[$t]) {
            match op {
                ReduceOp::Sum | ReduceOp::Avg => zip3(d, a, b, <$t>::wrapping_add),
                ReduceOp::Min => zip3(d, a, b, <$t>::min),
                ReduceOp::Max => zip3(d, a, b, <$t>::max),
                ReduceOp::Product => zip3(d, a, b, <$t>::wrapping_mul),
            }
        }
    )*};
}
combine_int_from!(combine_i8_from: i8, combine_u8_from: u8, combine_i32_from: i32, combine_i64_from: i64);

const BLOCK: usize = 512;

/// f16: widen to f32, combine, narrow back (one rounding per combine). x86 CPUs with F16C
/// convert 8 lanes per instruction; others go through `half` in blocks.
fn combine_f16(op: ReduceOp, d: &mut [f16], s: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        let n8 = d.len() / 8 * 8;
        // SAFETY: the CPU supports the enabled features (checked above); n8 <= both lengths.
        unsafe { f16c::combine(op, &mut d[..n8], &s[..n8]) };
        return combine_f16_blocks(op, &mut d[n8..], &s[n8..]);
    }
    combine_f16_blocks(op, d, s)
}

#[cfg(target_arch = "x86_64")]
mod f16c {
    use super::ReduceOp;
    use half::f16;
    use std::arch::x86_64::*;

    /// # Safety
    /// The CPU must support AVX and F16C; `d` and `s` have the same length, a multiple of 8.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn combine(op: ReduceOp, d: &mut [f16], s: &[f16]) {
        for i in (0..d.len()).step_by(8) {
            // SAFETY: i + 8 <= len of both slices (the caller's contract): 16 bytes each.
            let (dp, sp) = unsafe { (d.as_mut_ptr().add(i) as *mut __m128i, s.as_ptr().add(i) as *const __m128i) };
            // SAFETY: as above; unaligned loads.
            let (a, b) = unsafe { (_mm256_cvtph_ps(_mm_loadu_si128(dp)), _mm256_cvtph_ps(_mm_loadu_si128(sp))) };
            // Same semantics as the f32 kernel: min = s < d ? s : d, max = s > d ? s : d.
            let r = match op {
                ReduceOp::Sum | ReduceOp::Avg => _mm256_add_ps(a, b),
                ReduceOp::Min => _mm256_min_ps(b, a),
                ReduceOp::Max => _mm256_max_ps(b, a),
                ReduceOp::Product => _mm256_mul_ps(a, b),
            };
            // SAFETY: as above; an unaligned store of the 8 results.
            unsafe { _mm_storeu_si128(dp, _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(r)) };
        }
    }
}

fn combine_f16_blocks(op: ReduceOp, d: &mut [f16], s: &[f16]) {
    let (mut a, mut b) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (dc, sc) in d.chunks_mut(BLOCK).zip(s.chunks(BLOCK)) {
        let n = dc.len();
        dc.convert_to_f32_slice(&mut a[..n]);
        sc.convert_to_f32_slice(&mut b[..n]);
        combine_f32(op, &mut a[..n], &b[..n]);
        dc.convert_from_f32_slice(&a[..n]);
    }
}

/// bf16 is the top half of an f32: widening is a shift, narrowing rounds to nearest even
/// (NaN stays a quiet NaN). One fused, branch-free loop per op so it vectorises (in the
/// AVX2 build: the baseline target has no cheap 32-to-16-bit pack).
#[inline(always)]
fn combine_bf16(op: ReduceOp, d: &mut [u16], s: &[u16]) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => bf16_loop(d, s, |x, y| x + y),
        ReduceOp::Min => bf16_loop(d, s, |x, y| if y < x { y } else { x }),
        ReduceOp::Max => bf16_loop(d, s, |x, y| if y > x { y } else { x }),
        ReduceOp::Product => bf16_loop(d, s, |x, y| x * y),
    }
}

#[inline(always)]
fn bf16_loop(d: &mut [u16], s: &[u16], f: impl Fn(f32, f32) -> f32) {
    for (dv, sv) in d.iter_mut().zip(s) {
        let r = f(f32::from_bits((*dv as u32) << 16), f32::from_bits((*sv as u32) << 16)).to_bits();
        let rounded = r.wrapping_add(0x7fff + ((r >> 16) & 1)) >> 16;
        let quiet_nan = (r >> 16) | 0x40;
        *dv = (if (r & 0x7fff_ffff) > 0x7f80_0000 { quiet_nan } else { rounded }) as u16;
    }
}

/// Reinterprets bytes as `T` when aligned; `None` otherwise.
fn cast<T>(b: &[u8]) -> Option<&[T]> {
    // SAFETY: only instantiated with the wire types (floats, integers, bf16 as u16), for
    // which every bit pattern is valid; align_to only yields aligned middles.
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
            // SAFETY: as for `ab`.
            let bb = unsafe { std::slice::from_raw_parts_mut(b.as_mut_ptr() as *mut u8, sc.len()) };
            ab.copy_from_slice(dc);
            bb.copy_from_slice(sc);
            reduce_bytes(dtype, op, ab, bb);
            dc.copy_from_slice(ab);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked above).
        return unsafe { reduce_aligned_avx2(dtype, op, dst, src) };
    }
    reduce_aligned(dtype, op, dst, src)
}

/// [`reduce_aligned`] compiled for AVX2. The baseline x86-64 target stops at SSE2: an f32
/// sum from a 256 KiB staging buffer into 64 MiB (the transports' reduce-on-receive;
/// `cargo bench --bench kernels -- reduce_staged`) ran at 9.8–16.4 GiB/s as SSE2 and
/// 16.1–18.3 as AVX2, and bf16, which needs a cheap 32-to-16-bit pack to vectorise at all,
/// at 2.5 against 8.4 GiB/s.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_aligned_avx2(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    reduce_aligned(dtype, op, dst, src)
}

/// `dst = op(dst, src)` on buffers aligned to the element size.
#[inline(always)]
fn reduce_aligned(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) {
    match dtype {
        DType::F32 => combine_f32(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::F64 => combine_f64(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::F16 => combine_f16(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::BF16 => combine_bf16(op, cast_mut::<u16>(dst).unwrap_or_default(), cast::<u16>(src).unwrap_or_default()),
        DType::I8 => combine_i8(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::U8 => combine_u8(op, dst, src),
        DType::I32 => combine_i32(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::I64 => combine_i64(op, cast_mut(dst).unwrap_or_default(), cast(src).unwrap_or_default()),
        DType::Bool => combine_bool(op, dst, src),
    }
}

/// `dst = op(a, b)` over raw bytes of `dtype` elements, in one pass: [`reduce_bytes`] with
/// the accumulator read from `a` instead of `dst` (the same results). All three lengths
/// must be equal multiples of the element size. f16 and bf16, and unaligned buffers, copy
/// `a` into `dst` a block at a time (while it is in L1) and combine there.
pub fn reduce_bytes_from(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    debug_assert!(dst.len() == a.len() && a.len() == b.len());
    let n = dst.len().min(a.len()).min(b.len());
    let (dst, a, b) = (&mut dst[..n], &a[..n], &b[..n]);
    let aligned = (dst.as_ptr() as usize | a.as_ptr() as usize | b.as_ptr() as usize) % dtype.size() == 0;
    if !aligned || matches!(dtype, DType::F16 | DType::BF16) {
        for ((d, a), b) in dst.chunks_mut(FROM_BLOCK).zip(a.chunks(FROM_BLOCK)).zip(b.chunks(FROM_BLOCK)) {
            d.copy_from_slice(a);
            reduce_bytes(dtype, op, d, b);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2 (checked above).
        return unsafe { reduce_aligned_from_avx2(dtype, op, dst, a, b) };
    }
    reduce_aligned_from(dtype, op, dst, a, b)
}

/// Bytes of `a` copied into `dst` at a time where [`reduce_bytes_from`] cannot combine in
/// one pass: they are still in L1 when combined.
const FROM_BLOCK: usize = 16 << 10;

/// [`reduce_aligned_from`] compiled for AVX2 (see [`reduce_aligned_avx2`]).
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn reduce_aligned_from_avx2(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    reduce_aligned_from(dtype, op, dst, a, b)
}

/// `dst = op(a, b)` on buffers aligned to the element size; f16 and bf16 never come here.
#[inline(always)]
fn reduce_aligned_from(dtype: DType, op: ReduceOp, dst: &mut [u8], a: &[u8], b: &[u8]) {
    match dtype {
        DType::F32 => combine_f32_from(op, cast_mut(dst).unwrap_or_default(), cast(a).unwrap_or_default(), cast(b).unwrap_or_default()),
        DType::F64 => combine_f64_from(op, cast_mut(dst).unwrap_or_default(), cast(a).unwrap_or_default(), cast(b).unwrap_or_default()),
        DType::I8 => combine_i8_from(op, cast_mut(dst).unwrap_or_default(), cast(a).unwrap_or_default(), cast(b).unwrap_or_default()),
        DType::U8 => combine_u8_from(op, dst, a, b),
        DType::I32 => combine_i32_from(op, cast_mut(dst).unwrap_or_default(), cast(a).unwrap_or_default(), cast(b).unwrap_or_default()),
        DType::I64 => combine_i64_from(op, cast_mut(dst).unwrap_or_default(), cast(a).unwrap_or_default(), cast(b).unwrap_or_default()),
        DType::Bool => combine_u8_from(bool_as_u8(op), dst, a, b),
        DType::F16 | DType::BF16 => unreachable!("half-precision combines go through reduce_bytes"),
    }
}

/// The last step of a reduction over `w` ranks: an average divides the finished sum by `w`,
/// once; every other operation is already final.
pub fn finish(dtype: DType, op: ReduceOp, buf: &mut [u8], w: usize) {
    if op == ReduceOp::Avg && dtype.is_float() {
        scale(dtype, buf, 1.0 / w as f64);
    }
}

/// Reduces every one of `sources` into `acc`, then [`finish`]es it: the whole reduction of
/// one block when the peers' copies of it all lie in memory we can read.
/// f16 and bf16 are reduced in f32 and rounded once, so the result is the correctly
/// rounded sum of the inputs whatever W and the order (up to f32's own rounding), where
/// combining pairwise would round W-1 times.
pub fn reduce_all<'s>(dtype: DType, op: ReduceOp, w: usize, acc: &mut [u8], sources: impl IntoIterator<Item = &'s [u8]>) {
    if matches!(dtype, DType::F16 | DType::BF16) {
        let sources: Vec<&[u8]> = sources.into_iter().collect();
        return reduce_all_half(dtype, op, w, acc, None, &sources);
    }
    for src in sources {
        reduce_bytes(dtype, op, acc, src);
    }
    finish(dtype, op, acc, w);
}

/// [`reduce_all`] with the accumulator's first operand read from `first` instead of from
/// `acc` (whose contents are ignored): `acc = first ⊕ sources`, finished, without copying
/// `first` into `acc` and reading it back.
pub fn reduce_all_from<'s>(dtype: DType, op: ReduceOp, w: usize, acc: &mut [u8], first: &[u8], sources: impl IntoIterator<Item = &'s [u8]>) {
    if matches!(dtype, DType::F16 | DType::BF16) {
        let sources: Vec<&[u8]> = sources.into_iter().collect();
        return reduce_all_half(dtype, op, w, acc, Some(first), &sources);
    }
    let mut sources = sources.into_iter();
    match sources.next() {
        Some(src) => reduce_bytes_from(dtype, op, acc, first, src),
        None => acc.copy_from_slice(first),
    }
    for src in sources {
        reduce_bytes(dtype, op, acc, src);
    }
    finish(dtype, op, acc, w);
}

/// Elements per block of the half-precision reduction: its f32 blocks stay in L1.
const HALF_BLOCK: usize = 1024;

/// [`reduce_all`] for f16 and bf16: per block, the accumulator and every source widened to
/// f32 and combined there; an average divided in f32; one rounding back. Byte slices of any
/// alignment (bits are copied out, which costs little beside the conversions). The first
/// operand is `first` where given, else `acc`.
fn reduce_all_half(dtype: DType, op: ReduceOp, w: usize, acc: &mut [u8], first: Option<&[u8]>, sources: &[&[u8]]) {
    let (mut wide, mut other, mut bits) = ([0f32; HALF_BLOCK], [0f32; HALF_BLOCK], [0u16; HALF_BLOCK]);
    for start in (0..acc.len()).step_by(2 * HALF_BLOCK) {
        let end = (start + 2 * HALF_BLOCK).min(acc.len());
        let n = (end - start) / 2;
        widen_half(dtype, &first.unwrap_or(acc)[start..end], &mut bits[..n], &mut wide[..n]);
        for src in sources {
            widen_half(dtype, &src[start..end], &mut bits[..n], &mut other[..n]);
            combine_f32(op, &mut wide[..n], &other[..n]);
        }
        if op == ReduceOp::Avg {
            let f = (1.0 / w as f64) as f32;
            wide[..n].iter_mut().for_each(|x| *x *= f);
        }
        match dtype {
            DType::F16 => bits[..n].reinterpret_cast_mut::<f16>().convert_from_f32_slice(&wide[..n]),
            _ => bits[..n].reinterpret_cast_mut::<bf16>().convert_from_f32_slice(&wide[..n]),
        }
        for (c, b) in acc[start..end].chunks_exact_mut(2).zip(&bits[..n]) {
            c.copy_from_slice(&b.to_ne_bytes());
        }
    }
}

fn widen_half(dtype: DType, bytes: &[u8], bits: &mut [u16], out: &mut [f32]) {
    for (b, c) in bits.iter_mut().zip(bytes.chunks_exact(2)) {
        *b = u16::from_ne_bytes([c[0], c[1]]);
    }
    match dtype {
        DType::F16 => bits.reinterpret_cast::<f16>().convert_to_f32_slice(out),
        _ => bits.reinterpret_cast::<bf16>().convert_to_f32_slice(out),
    }
}

/// Multiplies every floating-point element by `factor` (the final step of `Avg`); integer
/// buffers are left as they are (`avg` is refused for them).
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
        DType::I8 | DType::U8 | DType::I32 | DType::I64 | DType::Bool => {}
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
                    ReduceOp::Product => x as f64 * y as f64,
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
    fn bf16_rounding_matches_half() {
        // Round-to-nearest-even (1 + 2^-8 and 1 + 3·2^-8 are ties), overflow to infinity,
        // NaN: same as `half`.
        let vals = [1.0f32, f32::from_bits(0x3f80_8000), f32::from_bits(0x3f81_8000), -3.3e38, 3.3e38, f32::INFINITY, f32::NAN, 1e-40, 65504.0, 0.1];
        for &a in &vals {
            for &b in &vals {
                let mut d = [bf16::from_f32(a)];
                let s = [bf16::from_f32(b)];
                reduce_bytes(DType::BF16, ReduceOp::Sum, bytes_mut(&mut d), bytes(&s));
                let want = bf16::from_f32(bf16::from_f32(a).to_f32() + bf16::from_f32(b).to_f32());
                assert!(d[0] == want || (d[0].is_nan() && want.is_nan()), "{a} + {b}: {} vs {}", d[0], want);
            }
        }
    }

    #[test]
    fn f16_vector_path_matches_scalar() {
        // 37 elements: the 8-lane path and the scalar tail both run.
        let a: Vec<f16> = (0..37).map(|i| f16::from_f32(i as f32 * 0.37 - 5.0)).collect();
        let b: Vec<f16> = (0..37).map(|i| f16::from_f32(3.0 - i as f32 * 0.11)).collect();
        for op in ReduceOp::ALL {
            let mut fast = a.clone();
            reduce_bytes(DType::F16, op, bytes_mut(&mut fast), bytes(&b));
            let mut slow = a.clone();
            combine_f16_blocks(op, &mut slow, &b);
            assert_eq!(fast, slow, "{op:?}");
        }
    }

    /// The vector body and the tail of both builds (AVX2 where the CPU has it, and the
    /// baseline one), on fresh random data, against one scalar combine per element.
    #[test]
    fn long_buffers_match_a_scalar_reference() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = 4099; // not a multiple of any vector width: the tail runs too
        let a: Vec<f32> = (0..n).map(|_| rng.random_range(-1000.0f32..1000.0)).collect();
        let b: Vec<f32> = (0..n).map(|_| rng.random_range(-1000.0f32..1000.0)).collect();
        type Kernel = fn(DType, ReduceOp, &mut [u8], &[u8]);
        let builds: [(&str, Kernel); 2] = [("dispatched", reduce_bytes), ("baseline", reduce_aligned)];
        for (build, kernel) in builds {
            for op in ReduceOp::ALL {
                let what = format!("{build} build, {op:?}, seed {seed}");
                let combine = |x: f64, y: f64| match op {
                    ReduceOp::Sum | ReduceOp::Avg => x + y,
                    ReduceOp::Min => x.min(y),
                    ReduceOp::Max => x.max(y),
                    ReduceOp::Product => x * y,
                };
                // Two f32 summed in f64 and rounded to f32 give the f32 sum (f64 has more
                // than twice the bits). f16 and bf16 combine in f32 and round once, as NCCL does.
                let mut d = a.clone();
                kernel(DType::F32, op, bytes_mut(&mut d), bytes(&b));
                let want: Vec<f32> = a.iter().zip(&b).map(|(&x, &y)| combine(x as f64, y as f64) as f32).collect();
                assert_eq!(d, want, "f32, {what}");
                let (a64, b64): (Vec<f64>, Vec<f64>) = (a.iter().map(|&x| x as f64 / 3.0).collect(), b.iter().map(|&x| x as f64 / 7.0).collect());
                let mut d = a64.clone();
                kernel(DType::F64, op, bytes_mut(&mut d), bytes(&b64));
                assert_eq!(d, a64.iter().zip(&b64).map(|(&x, &y)| combine(x, y)).collect::<Vec<_>>(), "f64, {what}");
                let (a16, b16): (Vec<f16>, Vec<f16>) = (a.iter().map(|&x| f16::from_f32(x)).collect(), b.iter().map(|&x| f16::from_f32(x)).collect());
                let mut d = a16.clone();
                kernel(DType::F16, op, bytes_mut(&mut d), bytes(&b16));
                let want: Vec<f16> = a16.iter().zip(&b16).map(|(x, y)| f16::from_f32(combine(x.to_f64(), y.to_f64()) as f32)).collect();
                assert_eq!(d, want, "f16, {what}");
                let (ab, bb): (Vec<bf16>, Vec<bf16>) = (a.iter().map(|&x| bf16::from_f32(x)).collect(), b.iter().map(|&x| bf16::from_f32(x)).collect());
                let mut d = ab.clone();
                kernel(DType::BF16, op, bytes_mut(&mut d), bytes(&bb));
                let want: Vec<bf16> = ab.iter().zip(&bb).map(|(x, y)| bf16::from_f32(combine(x.to_f64(), y.to_f64()) as f32)).collect();
                assert_eq!(d, want, "bf16, {what}");
            }
        }
    }

    /// Equal bit for bit, but any two NaNs of a float type count as equal (which NaN an
    /// operation returns is the compiler's and CPU's choice).
    fn same_elements(dtype: DType, x: &[u8], y: &[u8]) -> bool {
        let nan = |c: &[u8]| match dtype {
            DType::F32 => f32::from_ne_bytes(c.try_into().unwrap()).is_nan(),
            DType::F64 => f64::from_ne_bytes(c.try_into().unwrap()).is_nan(),
            DType::F16 => f16::from_ne_bytes(c.try_into().unwrap()).is_nan(),
            DType::BF16 => bf16::from_ne_bytes(c.try_into().unwrap()).is_nan(),
            _ => false,
        };
        x.len() == y.len() && x.chunks(dtype.size()).zip(y.chunks(dtype.size())).all(|(a, b)| a == b || (nan(a) && nan(b)))
    }

    /// The one-pass combines (`dst = op(a, b)`, and a whole reduction from a first operand
    /// that is not the accumulator) give what copying the first operand into the
    /// accumulator and combining there gives: every dtype and op, fresh random bytes (NaNs
    /// and infinities included), aligned and not.
    #[test]
    fn one_pass_combines_match_copy_then_combine() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = 4099 * 8; // bytes: no vector width divides the element count
        let mut raw = |len: usize| {
            let mut v = vec![0u8; len + 8];
            rng.fill(&mut v[..]);
            v
        };
        let (a, b, c, mut out, mut want) = (raw(n), raw(n), raw(n), raw(n), raw(n));
        for dtype in DType::ALL {
            for op in ReduceOp::ALL.into_iter().filter(|&op| op != ReduceOp::Avg || dtype.is_float()) {
                // Offsets of dst and of the first operand: both aligned, dst off, `a` off.
                for (od, oa) in [(0, 0), (1, 0), (0, dtype.size().min(3))] {
                    let what = format!("{dtype:?} {op:?}, dst +{od}, a +{oa}, seed {seed}");
                    let len = (n - 8) / dtype.size() * dtype.size();
                    let (d, w) = (&mut out[od..od + len], &mut want[..len]);
                    let (a, b, c) = (&a[oa..oa + len], &b[..len], &c[..len]);
                    reduce_bytes_from(dtype, op, d, a, b);
                    w.copy_from_slice(a);
                    reduce_bytes(dtype, op, w, b);
                    assert!(same_elements(dtype, d, w), "reduce_bytes_from, {what}");
                    reduce_all_from(dtype, op, 3, d, a, [b, c]);
                    w.copy_from_slice(a);
                    reduce_all(dtype, op, 3, w, [b, c]);
                    assert!(same_elements(dtype, d, w), "reduce_all_from, {what}");
                }
            }
        }
    }

    /// Integers wrap, on fresh random data over the whole range, in both builds; `bool` is
    /// or/and over any nonzero byte.
    #[test]
    fn integers_wrap_and_bools_are_logical() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let n = 1031;
        type Kernel = fn(DType, ReduceOp, &mut [u8], &[u8]);
        let builds: [(&str, Kernel); 2] = [("dispatched", reduce_bytes), ("baseline", reduce_aligned)];
        macro_rules! check_int {
            ($t:ty, $d:expr, $kernel:expr, $op:expr, $what:expr) => {{
                let a: Vec<$t> = (0..n).map(|_| rng.random()).collect();
                let b: Vec<$t> = (0..n).map(|_| rng.random()).collect();
                let want: Vec<$t> = a
                    .iter()
                    .zip(&b)
                    .map(|(&x, &y)| match $op {
                        ReduceOp::Sum | ReduceOp::Avg => x.wrapping_add(y),
                        ReduceOp::Min => x.min(y),
                        ReduceOp::Max => x.max(y),
                        ReduceOp::Product => x.wrapping_mul(y),
                    })
                    .collect();
                let mut d = a.clone();
                $kernel($d, $op, bytes_mut(&mut d), bytes(&b));
                assert_eq!(d, want, "{} {}", $d.name(), $what);
            }};
        }
        for (build, kernel) in builds {
            for op in ReduceOp::ALL {
                let what = format!("{build} build, {op:?}, seed {seed}");
                check_int!(i8, DType::I8, kernel, op, what);
                check_int!(u8, DType::U8, kernel, op, what);
                check_int!(i32, DType::I32, kernel, op, what);
                check_int!(i64, DType::I64, kernel, op, what);
                let a: Vec<u8> = (0..n).map(|_| rng.random_range(0..3)).collect();
                let b: Vec<u8> = (0..n).map(|_| rng.random_range(0..3)).collect();
                let mut d = a.clone();
                kernel(DType::Bool, op, &mut d, &b);
                let or = matches!(op, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Max);
                for i in 0..n {
                    let want = if or { a[i] != 0 || b[i] != 0 } else { a[i] != 0 && b[i] != 0 };
                    assert_eq!(d[i] != 0, want, "bool {what}: {} {} -> {}", a[i], b[i], d[i]);
                }
            }
        }
    }

    /// f16 and bf16 over W sources: the f32 sum (an average: divided in f32) rounded once,
    /// on fresh random data, at odd byte offsets too; the reference is an independent
    /// scalar loop. Pairwise combining (one rounding per add) misses it on this data.
    #[test]
    fn half_reductions_round_once() {
        use rand::{Rng, SeedableRng};
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (w, n) = (5, 2 * HALF_BLOCK + 77);
        for dtype in [DType::F16, DType::BF16] {
            type Narrow = fn(f32) -> u16;
            type Widen = fn(u16) -> f32;
            let (to_bits, to_f32): (Narrow, Widen) = match dtype {
                DType::F16 => (|x| f16::from_f32(x).to_bits(), |b| f16::from_bits(b).to_f32()),
                _ => (|x| bf16::from_f32(x).to_bits(), |b| bf16::from_bits(b).to_f32()),
            };
            let inputs: Vec<Vec<u16>> = (0..w).map(|_| (0..n).map(|_| to_bits(rng.random_range(-1.0..1.0))).collect()).collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Product, ReduceOp::Max] {
                let want: Vec<u16> = (0..n)
                    .map(|i| {
                        let mut x = to_f32(inputs[0][i]);
                        for v in &inputs[1..] {
                            let y = to_f32(v[i]);
                            x = match op {
                                ReduceOp::Sum | ReduceOp::Avg => x + y,
                                ReduceOp::Product => x * y,
                                _ => x.max(y),
                            };
                        }
                        to_bits(if op == ReduceOp::Avg { x * (1.0 / w as f32) } else { x })
                    })
                    .collect();
                for offset in [0, 1] {
                    let raw = |v: &[u16]| {
                        let mut r = vec![0u8; offset];
                        r.extend(v.iter().flat_map(|b| b.to_ne_bytes()));
                        r
                    };
                    let mut acc = raw(&inputs[0]);
                    let rest: Vec<Vec<u8>> = inputs[1..].iter().map(|v| raw(v)).collect();
                    reduce_all(dtype, op, w, &mut acc[offset..], rest.iter().map(|r| &r[offset..]));
                    let got: Vec<u16> = acc[offset..].chunks_exact(2).map(|c| u16::from_ne_bytes([c[0], c[1]])).collect();
                    let wrong = (0..n).filter(|&i| got[i] != want[i]).count();
                    assert_eq!(wrong, 0, "{} {op:?} offset {offset}: {wrong} of {n} differ (seed {seed})", dtype.name());
                }
                if op == ReduceOp::Sum {
                    let mut pairwise = inputs[0].clone();
                    for v in &inputs[1..] {
                        reduce_bytes(dtype, op, bytes_mut(&mut pairwise), bytes(v));
                    }
                    assert!(pairwise != want, "{}: pairwise rounding matched the one rounding; the test data is too easy (seed {seed})", dtype.name());
                }
            }
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
