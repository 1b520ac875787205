//! One case of the check: a collective on fresh random data against the reference.

use super::reference::{count_wrong, decode, encode, fingerprint, int64_reference, int64_wrong, reference, reference_rounded_once, within};
use super::{run_bytes, Buffers, Layout};
use crate::{Algo, Collective, Communicator, DType, HierarchicalAlgo, Hierarchy, ReduceOp, Request, Result};
use half::{bf16, f16};
use rand::{Rng, SeedableRng};

/// One rank's input to one case, addressable by element: the elements of block `b` (of
/// [`BLOCK`]) are drawn by a generator seeded from (seed, rank, case, b), so any rank
/// regenerates any stretch of any rank's input without drawing what comes before it.
pub(super) struct Input {
    seed: u64,
    dtype: DType,
}

pub(super) const BLOCK: usize = 1 << 16;

impl Input {
    pub(super) fn new(seed: u64, rank: usize, case: u64, dtype: DType) -> Self {
        Input { seed: seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ case.wrapping_mul(0xD1B5_4A32_D192_ED03), dtype }
    }

    /// Elements `range`: floats uniform in [-1, 1) rounded to the type; integers over the
    /// type's whole range (int64: within ±2^53, where f64 holds them); bools 0 or 1.
    pub(super) fn values(&self, range: std::ops::Range<usize>) -> Vec<f64> {
        let mut out = Vec::with_capacity(range.len());
        let mut at = range.start;
        while at < range.end {
            let block = at / BLOCK;
            let (start, end) = (block * BLOCK, ((block + 1) * BLOCK).min(range.end));
            let mut r = rand::rngs::SmallRng::seed_from_u64(self.seed ^ (block as u64 + 1).wrapping_mul(0xA24B_AED4_963E_E407));
            // Draws before `at` in its block are made and dropped (an int64 may take several).
            let skip = at - start;
            let drawn = out.len();
            draw(&mut r, self.dtype, end - start, &mut out);
            out.drain(drawn..drawn + skip);
            at = end;
        }
        out
    }

    /// The first `n` elements.
    pub(super) fn take(&self, n: usize) -> Vec<f64> {
        self.values(0..n)
    }
}

/// Appends `n` draws of `dtype` from `r`.
fn draw(r: &mut rand::rngs::SmallRng, dtype: DType, n: usize, out: &mut Vec<f64>) {
    match dtype {
        DType::I8 => out.extend((0..n).map(|_| r.random::<i8>() as f64)),
        DType::U8 => out.extend((0..n).map(|_| r.random::<u8>() as f64)),
        DType::I32 => out.extend((0..n).map(|_| r.random::<i32>() as f64)),
        DType::I64 => out.extend((0..n).map(|_| r.random_range(-(1i64 << 53)..=1i64 << 53) as f64)),
        DType::Bool => out.extend((0..n).map(|_| r.random_range(0..2u8) as f64)),
        // The half types are drawn in f32 and rounded to the type once.
        DType::F32 => out.extend((0..n).map(|_| r.random_range(-1.0f32..1.0) as f64)),
        DType::F16 => out.extend((0..n).map(|_| f16::from_f32(r.random_range(-1.0f32..1.0)).to_f32() as f64)),
        DType::BF16 => out.extend((0..n).map(|_| bf16::from_f32(r.random_range(-1.0f32..1.0)).to_f32() as f64)),
        DType::F64 => out.extend((0..n).map(|_| r.random_range(-1.0..1.0))),
    }
}

/// A buffer of a case, of the kind [`Buffers`] gives this rank: private; shared
/// (`gradwire_alloc`); or private and registered in place once filled, starting a different
/// way into a page on each rank so that the ranks' partial pages differ.
struct CaseBuffer {
    /// Dropped first: it gives the pages back before the memory goes.
    registration: Option<crate::Registration>,
    shared: Option<crate::Region>,
    private: Vec<u8>,
    /// Where the buffer lies in its storage.
    at: std::ops::Range<usize>,
    registered: bool,
}

impl CaseBuffer {
    fn new(buffers: Buffers, rank: usize, len: usize, es: usize) -> Result<Self> {
        let (mut shared, mut private, mut at) = (None, vec![], 0..len);
        if buffers.shared_on(rank) {
            shared = Some(crate::Region::shared("gradwire-check", len.max(1))?);
        } else if buffers == Buffers::Registered {
            let page = crate::mem::page_size();
            private = vec![0u8; len + 3 * page];
            let skip = page - private.as_ptr() as usize % page + 8 * es * (rank + 1);
            at = skip..skip + len;
        } else {
            private = vec![0u8; len];
        }
        Ok(CaseBuffer { registration: None, shared, private, at, registered: buffers == Buffers::Registered })
    }

    fn bytes(&mut self) -> &mut [u8] {
        match &mut self.shared {
            Some(region) => &mut region.as_mut_slice()[self.at.clone()],
            None => &mut self.private[self.at.clone()],
        }
    }

    /// Registers a registered buffer (filled, as a framework registers a filled tensor);
    /// one without a whole page stays private.
    fn register(&mut self) -> Result<()> {
        if self.registered && self.registration.is_none() && self.at.len() >= 2 * crate::mem::page_size() {
            let buf = self.bytes();
            // SAFETY: the buffer is ours, stays allocated past the registration (dropped
            // first), and only this thread writes it.
            self.registration = Some(unsafe { crate::Registration::new(buf.as_mut_ptr(), buf.len()) }?);
        }
        Ok(())
    }
}

/// Runs one collective on fresh inputs of `case` and returns how many output elements
/// differ from the independent reference; describes failures in `failures`.
#[allow(clippy::too_many_arguments)]
pub fn run_case(
    comm: &Communicator,
    seed: u64,
    case: u64,
    req: Request,
    layout: Layout,
    hier: Option<(&Hierarchy, HierarchicalAlgo)>,
    buffers: Buffers,
    label: &str,
    failures: &mut Vec<String>,
) -> Result<usize> {
    let (w, me) = (comm.size(), comm.rank());
    let (op, dtype, redop, n, root) = (req.op, req.dtype, req.redop, req.count, req.root);
    let es = dtype.size();
    // f16 and bf16 reduced on the automatic and one-host paths round each element once.
    let algo = req.algo.unwrap_or(comm.config().algo);
    let once = matches!(dtype, DType::F16 | DType::BF16)
        && hier.is_none()
        && matches!(redop, ReduceOp::Sum | ReduceOp::Avg | ReduceOp::Product)
        && (op == Collective::ReduceScatter || (op == Collective::Allreduce && matches!(algo, Algo::Auto | Algo::SharedMemory)));
    // Block `b` (of n elements) of every rank's input, in rank order.
    let block_of_every_input = |b: usize| -> Vec<Vec<f64>> { (0..w).map(|r| Input::new(seed, r, case, dtype).values(b * n..(b + 1) * n)).collect() };
    let reference = |inputs: &[Vec<f64>], i| if once { reference_rounded_once(redop, dtype, inputs, i) } else { reference(redop, dtype, inputs, i) };
    Ok(match op {
        Collective::Allreduce | Collective::Reduce => {
            let mut storage = CaseBuffer::new(buffers, me, n * es, es)?;
            let buf = storage.bytes();
            let mine = Input::new(seed, me, case, dtype);
            for (i, c) in buf.chunks_mut(BLOCK * es).enumerate() {
                encode(dtype, &mine.values(i * BLOCK..i * BLOCK + c.len() / es), c);
            }
            storage.register()?;
            let buf = storage.bytes();
            match hier {
                Some((h, algo)) => h.allreduce_bytes(dtype, buf, redop, algo)?,
                None => run_bytes(comm, req, &[], buf)?,
            }
            // Where every rank must hold the same bytes (an allreduce: their fingerprints are
            // compared), each checks its share against the reference, block b falling to
            // rank b % w; the root of a reduce checks every block.
            let shared = op == Collective::Allreduce;
            if shared {
                let fp = fingerprint(buf);
                let mut all = vec![0f64; 2 * w];
                comm.allgather(&[(fp >> 32) as f64, (fp & 0xffff_ffff) as f64], &mut all)?;
                if all.chunks(2).any(|c| c != &all[..2]) {
                    failures.push(format!("rank {me}: {label}: ranks hold different results"));
                }
            }
            let inputs: Vec<Input> = (0..w).map(|r| Input::new(seed, r, case, dtype)).collect();
            let mut wrong = 0;
            for (block, off) in (0..n).step_by(BLOCK).enumerate() {
                let m = BLOCK.min(n - off);
                let bytes = &buf[off * es..(off + m) * es];
                if shared && block % w != me {
                    continue;
                }
                let got = decode(dtype, bytes);
                // int64 results are compared exactly; every other type within its tolerance.
                let (want, bad) = if op == Collective::Reduce && me != root {
                    // Any other rank's buffer stays its input.
                    let own = mine.values(off..off + m);
                    let bad = if dtype == DType::I64 { int64_wrong(bytes, own.iter().map(|&v| v as i64)) } else { 0 };
                    (own.iter().map(|&v| (v, 0.0)).collect::<Vec<_>>(), bad)
                } else {
                    let stretch: Vec<Vec<f64>> = inputs.iter().map(|input| input.values(off..off + m)).collect();
                    let bad = if dtype == DType::I64 { int64_wrong(bytes, (0..m).map(|i| int64_reference(redop, &stretch, i))) } else { 0 };
                    ((0..m).map(|i| reference(&stretch, i)).collect(), bad)
                };
                let bad = if dtype == DType::I64 { bad } else { count_wrong(&got, &want) };
                if bad > 0 && wrong == 0 {
                    if let Some(i) = (0..m).find(|&i| !within(got[i], want[i])) {
                        failures.push(format!("rank {me}: {label}: element {} = {} but reference {} ± {}", off + i, got[i], want[i].0, want[i].1));
                    }
                }
                wrong += bad;
            }
            wrong
        }
        Collective::ReduceScatter if layout == Layout::InPlace => {
            let mine = Input::new(seed, me, case, dtype).take(n * w);
            let mut whole = CaseBuffer::new(buffers, me, n * w * es, es)?;
            encode(dtype, &mine, whole.bytes());
            whole.register()?;
            let buf = whole.bytes();
            let p = buf.as_mut_ptr();
            // SAFETY: `buf` is borrowed (mutably: the result is reduced into it) for the whole
            // call; the output is its block `me`.
            unsafe { comm.run(req, p, p.add(me * n * es)) }?;
            let got = decode(dtype, buf);
            // The other blocks stay as they were (compared bit for bit as decoded).
            let kept = got.iter().zip(&mine).enumerate().filter(|&(i, (g, v))| i / n.max(1) != me && g.to_bits() != v.to_bits()).count();
            if kept > 0 {
                failures.push(format!("rank {me}: {label}: {kept} elements outside this rank's block changed"));
            }
            let ours = block_of_every_input(me);
            if dtype == DType::I64 {
                return Ok(kept + int64_wrong(&buf[me * n * es..(me + 1) * n * es], (0..n).map(|i| int64_reference(redop, &ours, i))));
            }
            let want: Vec<(f64, f64)> = (0..n).map(|i| reference(&ours, i)).collect();
            kept + count_wrong(&got[me * n..(me + 1) * n], &want)
        }
        Collective::Allgather if layout == Layout::InPlace => {
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Input::new(seed, r, case, dtype).take(n)).collect();
            let mut whole = CaseBuffer::new(buffers, me, n * w * es, es)?;
            // The peers' blocks start as this rank's input: every one must be overwritten.
            for block in whole.bytes().chunks_mut((n * es).max(1)) {
                encode(dtype, &inputs[me], block);
            }
            whole.register()?;
            let buf = whole.bytes();
            let p = buf.as_mut_ptr();
            // SAFETY: `buf` is borrowed mutably for the whole call; the input is its block `me`.
            unsafe { comm.run(req, p.add(me * n * es), p) }?;
            let want: Vec<(f64, f64)> = inputs.iter().flatten().map(|&v| (v, 0.0)).collect();
            count_wrong(&decode(dtype, buf), &want)
        }
        Collective::ReduceScatter => {
            let (mut send, mut recv) = (CaseBuffer::new(buffers, me, n * w * es, es)?, CaseBuffer::new(buffers, me, n * es, es)?);
            encode(dtype, &Input::new(seed, me, case, dtype).take(n * w), send.bytes());
            send.register()?;
            recv.register()?;
            run_bytes(comm, req, send.bytes(), recv.bytes())?;
            let ours = block_of_every_input(me);
            if dtype == DType::I64 {
                return Ok(int64_wrong(recv.bytes(), (0..n).map(|i| int64_reference(redop, &ours, i))));
            }
            let want: Vec<(f64, f64)> = (0..n).map(|i| reference(&ours, i)).collect();
            count_wrong(&decode(dtype, recv.bytes()), &want)
        }
        Collective::Allgather => {
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Input::new(seed, r, case, dtype).take(n)).collect();
            let (mut send, mut recv) = (CaseBuffer::new(buffers, me, n * es, es)?, CaseBuffer::new(buffers, me, n * w * es, es)?);
            encode(dtype, &inputs[me], send.bytes());
            send.register()?;
            recv.register()?;
            run_bytes(comm, req, send.bytes(), recv.bytes())?;
            let want: Vec<(f64, f64)> = inputs.iter().flatten().map(|&v| (v, 0.0)).collect();
            count_wrong(&decode(dtype, recv.bytes()), &want)
        }
        Collective::AllToAll => {
            // Rank r sends block p of its input to rank p: we get block `me` of every input.
            let (mut send, mut recv) = (CaseBuffer::new(buffers, me, n * w * es, es)?, CaseBuffer::new(buffers, me, n * w * es, es)?);
            encode(dtype, &Input::new(seed, me, case, dtype).take(n * w), send.bytes());
            send.register()?;
            recv.register()?;
            run_bytes(comm, req, send.bytes(), recv.bytes())?;
            let want: Vec<(f64, f64)> = block_of_every_input(me).into_iter().flatten().map(|v| (v, 0.0)).collect();
            count_wrong(&decode(dtype, recv.bytes()), &want)
        }
        Collective::Broadcast => {
            let root_data = Input::new(seed, root, case, dtype).take(n);
            let mut buf = CaseBuffer::new(buffers, me, n * es, es)?;
            let mine = if me == root { root_data.clone() } else { Input::new(seed, me, case, dtype).take(n) };
            encode(dtype, &mine, buf.bytes());
            buf.register()?;
            run_bytes(comm, req, &[], buf.bytes())?;
            count_wrong(&decode(dtype, buf.bytes()), &root_data.iter().map(|&v| (v, 0.0)).collect::<Vec<_>>())
        }
        Collective::Barrier => {
            comm.barrier()?;
            0
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any stretch of an input, however it straddles blocks, is those elements of the whole.
    #[test]
    fn a_stretch_of_an_input_is_that_part_of_the_whole() {
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64, DType::I8, DType::U8, DType::I32, DType::I64, DType::Bool] {
            let input = Input::new(7, 2, 11, dtype);
            let whole = input.take(3 * BLOCK + 5);
            for range in [0..1, 5..BLOCK + 3, BLOCK - 1..2 * BLOCK + 1, 3 * BLOCK..3 * BLOCK + 5, 9..9] {
                let part = input.values(range.clone());
                assert!(part.iter().zip(&whole[range.clone()]).all(|(a, b)| a.to_bits() == b.to_bits()) && part.len() == range.len(), "{dtype:?} {range:?}");
            }
            assert_ne!(whole[..BLOCK], Input::new(7, 3, 11, dtype).take(BLOCK)[..], "{dtype:?}: another rank draws the same");
        }
        assert!(Input::new(7, 2, 11, DType::F16).take(BLOCK).iter().all(|&v| (-1.0..=1.0).contains(&v) && half::f16::from_f64(v).to_f64() == v));
    }
}
