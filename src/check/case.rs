//! One case of the check: a collective on fresh random data against the reference.

use super::reference::{count_wrong, decode, encode, fingerprint, int64_reference, int64_wrong, reference, reference_rounded_once, round_to, within};
use super::{run_bytes, Buffers, Layout};
use crate::{Algo, Collective, Communicator, DType, HierarchicalAlgo, Hierarchy, ReduceOp, Request, Result};
use rand::{Rng, SeedableRng};

/// Per-rank generator of one case's input (deterministic from seed, rank and case).
pub(super) struct Gen(rand::rngs::SmallRng, DType);

impl Gen {
    pub(super) fn new(seed: u64, rank: usize, case: u64, dtype: DType) -> Self {
        Gen(rand::rngs::SmallRng::seed_from_u64(seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ case.wrapping_mul(0xD1B5_4A32_D192_ED03)), dtype)
    }
    /// Floats uniform in [-1, 1) rounded to the type; integers over the type's whole range
    /// (int64: within ±2^53, where f64 holds them); bools 0 or 1.
    pub(super) fn take(&mut self, n: usize) -> Vec<f64> {
        let r = &mut self.0;
        match self.1 {
            DType::I8 => (0..n).map(|_| r.random::<i8>() as f64).collect(),
            DType::U8 => (0..n).map(|_| r.random::<u8>() as f64).collect(),
            DType::I32 => (0..n).map(|_| r.random::<i32>() as f64).collect(),
            DType::I64 => (0..n).map(|_| r.random_range(-(1i64 << 53)..=1i64 << 53) as f64).collect(),
            DType::Bool => (0..n).map(|_| r.random_range(0..2u8) as f64).collect(),
            dtype => (0..n).map(|_| round_to(dtype, r.random_range(-1.0..1.0))).collect(),
        }
    }
}

const BLOCK: usize = 1 << 16;

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
    let reference = |inputs: &[Vec<f64>], i| if once { reference_rounded_once(redop, dtype, inputs, i) } else { reference(redop, dtype, inputs, i) };
    Ok(match op {
        Collective::Allreduce | Collective::Reduce => {
            let mut storage = CaseBuffer::new(buffers, me, n * es, es)?;
            let buf = storage.bytes();
            let mut g = Gen::new(seed, me, case, dtype);
            for (i, c) in buf.chunks_mut(BLOCK * es).enumerate() {
                let vals = g.take(c.len() / es);
                debug_assert!(i * BLOCK * es < n * es || n == 0);
                encode(dtype, &vals, c);
            }
            storage.register()?;
            let buf = storage.bytes();
            match hier {
                Some((h, algo)) => h.allreduce_bytes(dtype, buf, redop, algo)?,
                None => run_bytes(comm, req, &[], buf)?,
            }
            if op == Collective::Allreduce {
                let fp = fingerprint(buf);
                let mut all = vec![0f64; 2 * w];
                comm.allgather(&[(fp >> 32) as f64, (fp & 0xffff_ffff) as f64], &mut all)?;
                if all.chunks(2).any(|c| c != &all[..2]) {
                    failures.push(format!("rank {me}: {label}: ranks hold different results"));
                }
            }
            // Stream the reference in blocks: W generators advance in lockstep.
            let mut gens: Vec<Gen> = (0..w).map(|r| Gen::new(seed, r, case, dtype)).collect();
            let mut mine_gen = Gen::new(seed, me, case, dtype);
            let mut wrong = 0;
            let mut off = 0;
            while off < n {
                let m = BLOCK.min(n - off);
                let inputs: Vec<Vec<f64>> = gens.iter_mut().map(|g| g.take(m)).collect();
                let mine = mine_gen.take(m);
                let got = decode(dtype, &buf[off * es..(off + m) * es]);
                let want: Vec<(f64, f64)> = if op == Collective::Reduce && me != root {
                    mine.iter().map(|&v| (v, 0.0)).collect()
                } else {
                    (0..m).map(|i| reference(&inputs, i)).collect()
                };
                let mut bad = count_wrong(&got, &want);
                if dtype == DType::I64 {
                    let bytes = &buf[off * es..(off + m) * es];
                    bad = if op == Collective::Reduce && me != root {
                        int64_wrong(bytes, mine.iter().map(|&v| v as i64))
                    } else {
                        int64_wrong(bytes, (0..m).map(|i| int64_reference(redop, &inputs, i)))
                    };
                }
                if bad > 0 && wrong == 0 {
                    if let Some(i) = (0..m).find(|&i| !within(got[i], want[i])) {
                        failures.push(format!("rank {me}: {label}: element {} = {} but reference {} ± {}", off + i, got[i], want[i].0, want[i].1));
                    }
                }
                wrong += bad;
                off += m;
            }
            wrong
        }
        Collective::ReduceScatter if layout == Layout::InPlace => {
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Gen::new(seed, r, case, dtype).take(n * w)).collect();
            let mut whole = CaseBuffer::new(buffers, me, n * w * es, es)?;
            encode(dtype, &inputs[me], whole.bytes());
            whole.register()?;
            let buf = whole.bytes();
            let p = buf.as_mut_ptr();
            // SAFETY: `buf` is borrowed (mutably: the result is reduced into it) for the whole
            // call; the output is its block `me`.
            unsafe { comm.run(req, p, p.add(me * n * es)) }?;
            let got = decode(dtype, buf);
            // The other blocks stay as they were (compared bit for bit as decoded).
            let kept = got.iter().zip(&inputs[me]).enumerate().filter(|&(i, (g, v))| i / n.max(1) != me && g.to_bits() != v.to_bits()).count();
            if kept > 0 {
                failures.push(format!("rank {me}: {label}: {kept} elements outside this rank's block changed"));
            }
            if dtype == DType::I64 {
                return Ok(kept + int64_wrong(&buf[me * n * es..(me + 1) * n * es], (me * n..(me + 1) * n).map(|i| int64_reference(redop, &inputs, i))));
            }
            let want: Vec<(f64, f64)> = (me * n..(me + 1) * n).map(|i| reference(&inputs, i)).collect();
            kept + count_wrong(&got[me * n..(me + 1) * n], &want)
        }
        Collective::Allgather if layout == Layout::InPlace => {
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Gen::new(seed, r, case, dtype).take(n)).collect();
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
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Gen::new(seed, r, case, dtype).take(n * w)).collect();
            let (mut send, mut recv) = (CaseBuffer::new(buffers, me, n * w * es, es)?, CaseBuffer::new(buffers, me, n * es, es)?);
            encode(dtype, &inputs[me], send.bytes());
            send.register()?;
            recv.register()?;
            run_bytes(comm, req, send.bytes(), recv.bytes())?;
            if dtype == DType::I64 {
                return Ok(int64_wrong(recv.bytes(), (me * n..(me + 1) * n).map(|i| int64_reference(redop, &inputs, i))));
            }
            let want: Vec<(f64, f64)> = (me * n..(me + 1) * n).map(|i| reference(&inputs, i)).collect();
            count_wrong(&decode(dtype, recv.bytes()), &want)
        }
        Collective::Allgather => {
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Gen::new(seed, r, case, dtype).take(n)).collect();
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
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Gen::new(seed, r, case, dtype).take(n * w)).collect();
            let (mut send, mut recv) = (CaseBuffer::new(buffers, me, n * w * es, es)?, CaseBuffer::new(buffers, me, n * w * es, es)?);
            encode(dtype, &inputs[me], send.bytes());
            send.register()?;
            recv.register()?;
            run_bytes(comm, req, send.bytes(), recv.bytes())?;
            let want: Vec<(f64, f64)> = inputs.iter().flat_map(|input| &input[me * n..(me + 1) * n]).map(|&v| (v, 0.0)).collect();
            count_wrong(&decode(dtype, recv.bytes()), &want)
        }
        Collective::Broadcast => {
            let root_data = Gen::new(seed, root, case, dtype).take(n);
            let mut buf = CaseBuffer::new(buffers, me, n * es, es)?;
            let mine = if me == root { root_data.clone() } else { Gen::new(seed, me, case, dtype).take(n) };
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
