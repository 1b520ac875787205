//! `gradwire check`: every collective x dtype x op x count (x allreduce algorithm) on the
//! running job, each compared with the independent reference of `verify` on fresh random
//! data, plus a check that all ranks hold bit-identical allreduce results.

use crate::verify::{count_wrong, decode, encode, fingerprint, int64_reference, int64_wrong, reference, reference_rounded_once, round_to, within};
use gradwire::transport::onesided::{Accumulate, AccumulateError};
use gradwire::{Algo, Communicator, DType, HierarchicalAlgo, Hierarchy, Collective, ReduceOp, Request, Result};
use rand::{Rng, SeedableRng};
use std::sync::Arc;
use std::time::Duration;

pub struct CheckArgs {
    pub counts: Vec<usize>,
    pub large_bytes: usize,
    pub collectives: Vec<Collective>,
    pub dtypes: Vec<DType>,
    pub ops: Vec<ReduceOp>,
    pub verbose: bool,
    /// Test the hierarchical allreduce (both algorithms) instead of the flat collectives.
    pub hierarchical: bool,
    pub buffers: Buffers,
}

/// Where the allreduce buffers of a check or bench come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Buffers {
    /// Private memory (a `Vec` or an anonymous mapping).
    Private,
    /// gradwire's shared allocator (`gradwire_alloc`): ranks of one host reach them without
    /// a copy.
    Shared,
    /// Shared on even ranks, private on odd ones (checks the mix).
    Mixed,
    /// Private memory registered in place (`gradwire_register`), starting inside a page as
    /// `malloc`'s does: 64 bytes in for a bench, a different offset per rank for a check.
    Registered,
}

impl Buffers {
    pub fn shared_on(self, rank: usize) -> bool {
        match self {
            Buffers::Private | Buffers::Registered => false,
            Buffers::Shared => true,
            Buffers::Mixed => rank % 2 == 0,
        }
    }
}

impl std::str::FromStr for Buffers {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "private" => Ok(Buffers::Private),
            "shared" => Ok(Buffers::Shared),
            "mixed" => Ok(Buffers::Mixed),
            "registered" => Ok(Buffers::Registered),
            _ => Err(format!("unknown buffers {s:?} (private, shared, mixed or registered)")),
        }
    }
}

/// Runs a request on byte buffers and waits.
pub fn run_bytes(comm: &Communicator, req: Request, send: &[u8], recv: &mut [u8]) -> Result<()> {
    let (sl, rl) = req.lengths(comm.size())?;
    let in_place = send.is_empty() && matches!(req.op, Collective::Allreduce | Collective::Broadcast | Collective::Reduce);
    if (!in_place && send.len() < sl) || recv.len() < rl {
        return Err(gradwire::Error::InvalidArgument(format!("buffers ({} and {} bytes) shorter than the request ({sl} and {rl})", send.len(), recv.len())));
    }
    let sp = if in_place { recv.as_ptr() } else { send.as_ptr() };
    // SAFETY: both buffers are borrowed for the whole call and are long enough (checked);
    // wait() returns only after the engine is done with them.
    unsafe { comm.run(req, sp, recv.as_mut_ptr()) }
}

/// Per-rank generator of one case's input (deterministic from seed, rank and case).
struct Gen(rand::rngs::SmallRng, DType);

impl Gen {
    fn new(seed: u64, rank: usize, case: u64, dtype: DType) -> Self {
        Gen(rand::rngs::SmallRng::seed_from_u64(seed ^ (rank as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ case.wrapping_mul(0xD1B5_4A32_D192_ED03)), dtype)
    }
    /// Floats uniform in [-1, 1) rounded to the type; integers over the type's whole range
    /// (int64: within ±2^53, where f64 holds them); bools 0 or 1.
    fn take(&mut self, n: usize) -> Vec<f64> {
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

/// A job-wide random seed chosen by rank 0 (or `GRADWIRE_CHECK_SEED`), so every run uses
/// fresh data and every rank can regenerate every other rank's input.
pub fn job_seed(comm: &Communicator) -> Result<u64> {
    let mine: u64 = match std::env::var("GRADWIRE_CHECK_SEED").ok().and_then(|s| s.parse().ok()) {
        Some(s) => s,
        None => rand::random(),
    };
    let mut halves = [(mine >> 32) as f64, (mine & 0xffff_ffff) as f64];
    comm.broadcast(&mut halves, 0)?;
    Ok(((halves[0] as u64) << 32) | halves[1] as u64)
}

const BLOCK: usize = 1 << 16;

pub fn run(comm: &Communicator, args: &CheckArgs) -> Result<bool> {
    let (w, me) = (comm.size(), comm.rank());
    let seed = job_seed(comm)?;
    let single_shm = comm.transports_used().iter().all(|&t| t == gradwire::transport::Transport::Shm);
    let mut allreduce_algos = vec![None, Some(Algo::Ring), Some(Algo::RecursiveDoubling), Some(Algo::HalvingDoubling)];
    if single_shm && w > 1 {
        allreduce_algos.push(Some(Algo::SharedMemory));
    }
    let mut cases = 0u64;
    let mut failures: Vec<String> = Vec::new();
    let mut failed_cases = 0u64;
    let mut plan: Vec<(Collective, DType, ReduceOp, usize, Option<Algo>)> = Vec::new();
    let hierarchy = if args.hierarchical { Some(Hierarchy::new(comm)?) } else { None };
    let hier_algos: Vec<Option<HierarchicalAlgo>> =
        if args.hierarchical { vec![Some(HierarchicalAlgo::Sharded), Some(HierarchicalAlgo::Leader)] } else { vec![None] };
    for &op in &args.collectives {
        if args.hierarchical && op != Collective::Allreduce {
            continue;
        }
        for &dt in &args.dtypes {
            let redops: Vec<ReduceOp> = if matches!(op, Collective::Allreduce | Collective::ReduceScatter | Collective::Reduce) {
                args.ops.iter().copied().filter(|o| o.check(dt).is_ok()).collect()
            } else {
                vec![ReduceOp::Sum]
            };
            for &ro in &redops {
                for &n in &args.counts {
                    if op == Collective::Allreduce && !args.hierarchical {
                        for &a in &allreduce_algos {
                            plan.push((op, dt, ro, n, a));
                        }
                    } else if op != Collective::Barrier || (dt == DType::F32 && n == args.counts[0]) {
                        plan.push((op, dt, ro, n, None));
                    }
                }
            }
        }
    }
    if args.large_bytes > 0 {
        let n = args.large_bytes / 4;
        if args.collectives.contains(&Collective::Allreduce) {
            for a in [None, Some(Algo::Ring)] {
                plan.push((Collective::Allreduce, DType::F32, ReduceOp::Sum, n, a));
            }
        }
        if args.collectives.contains(&Collective::Broadcast) {
            plan.push((Collective::Broadcast, DType::F32, ReduceOp::Sum, n, None));
        }
    }
    let plan: Vec<_> = plan.into_iter().flat_map(|p| hier_algos.iter().map(move |h| (p, *h))).collect();
    for ((op, dtype, redop, n, algo), hier_algo) in plan {
        cases += 1;
        let case = cases;
        let failures_before = failures.len();
        let root = (case as usize) % w;
        let req = Request { root, algo, ..Request::new(op, dtype, redop, n) };
        let label = format!(
            "{} {} {} n={n}{}{}",
            op.name(),
            dtype.name(),
            redop.name(),
            algo.map(|a| format!(" algo={a:?}")).unwrap_or_default(),
            if matches!(op, Collective::Broadcast | Collective::Reduce) { format!(" root={root}") } else { String::new() }
        );
        let hier = hierarchy.as_ref().zip(hier_algo);
        let wrong = run_case(comm, seed, case, req, hier, args.buffers, &label, &mut failures)?;
        if wrong > 0 {
            failures.push(format!("rank {me}: {label}: {wrong} wrong elements"));
        } else if args.verbose && me == 0 {
            println!("ok   {label}");
        }
        if failures.len() > failures_before {
            failed_cases += 1;
        }
    }
    // Point-to-point and one-sided operations, on the same transports.
    if !args.hierarchical {
        cases += 2;
        for f in p2p_and_onesided(comm, seed)? {
            failures.push(f);
            failed_cases += 1;
        }
    }
    let mut total = [failed_cases as f64];
    comm.allreduce(&mut total, ReduceOp::Sum)?;
    for f in &failures {
        eprintln!("FAIL {f}");
    }
    let kinds: Vec<&str> = comm.transports_used().into_iter().map(|t| t.name()).collect();
    if me == 0 {
        let failed = total[0] as u64;
        let rank_cases = cases * w as u64;
        println!(
            "check: {} ranks on {} host(s), links {:?}, seed {seed}: {} cases x {} ranks: {} passed, {} failed",
            w,
            comm.topology().hosts(),
            kinds,
            cases,
            w,
            rank_cases - failed.min(rank_cases),
            failed,
        );
    }
    Ok(total[0] == 0.0)
}

/// Runs the matrix on sub-communicators made by `split`: the node-local group, the
/// cross-node group, and even/odd ranks. Returns true when every group passed.
pub fn run_split(comm: &Communicator, args: &CheckArgs) -> Result<bool> {
    let mut ok = true;
    let groups = [("node-local", comm.split_node_local()?), ("cross-node", comm.split_cross_node()?)];
    let parity = comm.split((comm.rank() % 2) as i32, 0)?;
    for (name, sub) in groups.iter().map(|(n, c)| (*n, c)).chain(parity.iter().map(|c| ("even/odd", c))) {
        if sub.rank() == 0 {
            println!("group {name}: world rank {} leads {} ranks", comm.rank(), sub.size());
        }
        ok &= run(sub, args)?;
    }
    let mut bad = [if ok { 0.0 } else { 1.0 }];
    comm.allreduce(&mut bad, ReduceOp::Sum)?;
    Ok(bad[0] == 0.0)
}

/// Runs one collective on fresh inputs of `case` and returns how many output elements
/// differ from the independent reference; describes failures in `failures`.
#[allow(clippy::too_many_arguments)]
pub fn run_case(
    comm: &Communicator,
    seed: u64,
    case: u64,
    req: Request,
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
            let (mut private, mut shared);
            let buf: &mut [u8] = if buffers.shared_on(me) {
                shared = gradwire::Region::shared("gradwire-check", n * es)?;
                &mut shared.as_mut_slice()[..n * es]
            } else if buffers == Buffers::Registered {
                // Starts a different way into a page on each rank, so that the ranks' partial
                // pages differ.
                let page = gradwire::mem::page_size();
                private = vec![0u8; n * es + 3 * page];
                let skip = page - private.as_ptr() as usize % page + 8 * es * (me + 1);
                &mut private[skip..skip + n * es]
            } else {
                private = vec![0u8; n * es];
                &mut private
            };
            let mut g = Gen::new(seed, me, case, dtype);
            for (i, c) in buf.chunks_mut(BLOCK * es).enumerate() {
                let vals = g.take(c.len() / es);
                debug_assert!(i * BLOCK * es < n * es || n == 0);
                encode(dtype, &vals, c);
            }
            // Registered once the data is in, as a framework registers a filled tensor (a
            // buffer without a whole page stays private).
            let whole_page = buf.len() >= 2 * gradwire::mem::page_size();
            let registration = match buffers == Buffers::Registered && whole_page {
                // SAFETY: `buf` is ours, stays allocated past the registration, and only this
                // thread writes it.
                true => Some(unsafe { gradwire::Registration::new(buf.as_mut_ptr(), buf.len()) }?),
                false => None,
            };
            match hier {
                Some((h, algo)) => h.allreduce_bytes(dtype, buf, redop, algo)?,
                None => run_bytes(comm, req, &[], buf)?,
            }
            drop(registration);
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
                let want: Vec<(f64, f64)> =
                    if op == Collective::Reduce && me != root { mine.iter().map(|&v| (v, 0.0)).collect() } else { (0..m).map(|i| reference(&inputs, i)).collect() };
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
        Collective::ReduceScatter => {
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Gen::new(seed, r, case, dtype).take(n * w)).collect();
            let mut send = vec![0u8; n * w * es];
            encode(dtype, &inputs[me], &mut send);
            let mut recv = vec![0u8; n * es];
            run_bytes(comm, req, &send, &mut recv)?;
            if dtype == DType::I64 {
                return Ok(int64_wrong(&recv, (me * n..(me + 1) * n).map(|i| int64_reference(redop, &inputs, i))));
            }
            let want: Vec<(f64, f64)> = (me * n..(me + 1) * n).map(|i| reference(&inputs, i)).collect();
            count_wrong(&decode(dtype, &recv), &want)
        }
        Collective::Allgather => {
            let inputs: Vec<Vec<f64>> = (0..w).map(|r| Gen::new(seed, r, case, dtype).take(n)).collect();
            let mut send = vec![0u8; n * es];
            encode(dtype, &inputs[me], &mut send);
            let mut recv = vec![0u8; n * w * es];
            run_bytes(comm, req, &send, &mut recv)?;
            let want: Vec<(f64, f64)> = inputs.iter().flatten().map(|&v| (v, 0.0)).collect();
            count_wrong(&decode(dtype, &recv), &want)
        }
        Collective::Broadcast => {
            let root_data = Gen::new(seed, root, case, dtype).take(n);
            let mut buf = vec![0u8; n * es];
            let mine = if me == root { root_data.clone() } else { Gen::new(seed, me, case, dtype).take(n) };
            encode(dtype, &mine, &mut buf);
            run_bytes(comm, req, &[], &mut buf)?;
            count_wrong(&decode(dtype, &buf), &root_data.iter().map(|&v| (v, 0.0)).collect::<Vec<_>>())
        }
        Collective::Barrier => {
            comm.barrier()?;
            0
        }
    })
}

/// Tagged send/recv around the ring, then one-sided write/read/fetch-add through a window:
/// every rank writes a random block into its slot of every peer's region, reads each peer's
/// own block back, and adds to a counter on rank 0 whose returned old values must all
/// differ (atomicity) and whose final value must be the exact sum.
fn p2p_and_onesided(comm: &Communicator, seed: u64) -> Result<Vec<String>> {
    use std::sync::Arc;
    let (w, me) = (comm.size(), comm.rank());
    let mut bad = vec![];
    if w == 1 {
        return Ok(bad);
    }
    // send/recv: even ranks send first, odd ranks receive first (no cycle of blocked sends).
    let n = 7919;
    let (next, prev) = ((me + 1) % w, (me + w - 1) % w);
    let mine = Gen::new(seed, me, 900_001, DType::F32).take(n);
    let out: Vec<f32> = mine.iter().map(|&v| v as f32).collect();
    let mut got = vec![0f32; n];
    if me % 2 == 0 {
        comm.send(&out, next, 7)?;
        comm.recv(&mut got, prev, 7)?;
    } else {
        comm.recv(&mut got, prev, 7)?;
        comm.send(&out, next, 7)?;
    }
    let want = Gen::new(seed, prev, 900_001, DType::F32).take(n);
    if got.iter().zip(&want).any(|(g, w)| *g as f64 != *w) {
        bad.push(format!("rank {me}: send/recv from rank {prev}: data differs"));
    }
    // One-sided.
    const BLOCK_BYTES: usize = 512;
    let counter_at = 0;
    let slots_at = 64;
    let own_at = slots_at + w * BLOCK_BYTES;
    let sum_at = own_at + BLOCK_BYTES;
    let region = Arc::new(gradwire::Region::shared("check-window", sum_at + BLOCK_BYTES)?);
    let block = |r: usize| -> Vec<u8> {
        let v = Gen::new(seed, r, 900_002, DType::F64).take(BLOCK_BYTES / 8);
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    };
    // SAFETY: nobody else can reach the region before `expose` returns.
    unsafe { std::ptr::copy_nonoverlapping(block(me).as_ptr(), region.as_ptr().add(own_at), BLOCK_BYTES) };
    let win = comm.expose_with(region.clone(), Some(Arc::new(AddF64 { region: region.clone(), at: sum_at, lock: Default::default() })))?;
    for p in 0..w {
        win.write(p, slots_at + me * BLOCK_BYTES, &block(me))?;
        if win.accumulates(p) {
            win.accumulate(p, sum_at, &block(me), ACCUMULATE_TAG)?;
            // A refused accumulate says why and leaves the connection usable.
            match win.accumulate(p, sum_at, &block(me), ACCUMULATE_TAG + 1) {
                Err(e) if e.to_string().contains("wrong tag") => {}
                other => bad.push(format!("rank {me}: accumulate with a wrong tag at rank {p}: expected a refusal naming it, got {other:?}")),
            }
        }
    }
    let mut olds = vec![];
    for _ in 0..FETCH_ADDS {
        olds.push(win.fetch_add(0, counter_at, (me + 1) as u64)? as f64);
    }
    comm.barrier()?;
    for p in 0..w {
        let mut theirs = vec![0u8; BLOCK_BYTES];
        win.read(p, own_at, &mut theirs)?;
        if theirs != block(p) {
            bad.push(format!("rank {me}: one-sided read of rank {p}'s block: data differs"));
        }
        let (mut last, mut head, mut tail) = (vec![0u8; 24], vec![0u8; 24], vec![0u8; BLOCK_BYTES - 24]);
        win.read_sequence(p, &mut [(own_at + BLOCK_BYTES - 24, &mut last), (own_at, &mut head), (own_at + 24, &mut tail)])?;
        if [head, tail].concat() != block(p) || last != block(p)[BLOCK_BYTES - 24..] {
            bad.push(format!("rank {me}: one-sided read sequence of rank {p}'s block: data differs"));
        }
        // SAFETY: all writes to our region finished before the barrier.
        let landed = unsafe { std::slice::from_raw_parts(region.as_ptr().add(slots_at + p * BLOCK_BYTES), BLOCK_BYTES) };
        if landed != block(p).as_slice() {
            bad.push(format!("rank {me}: one-sided write from rank {p}: data differs"));
        }
    }
    // Accumulates from the ranks behind tcp: sums computed here from regenerated blocks.
    let senders: Vec<usize> = (0..w).filter(|&p| win.accumulates(p)).collect();
    // SAFETY: all accumulates into our region finished before the barrier.
    let summed = unsafe { std::slice::from_raw_parts(region.as_ptr().add(sum_at) as *const f64, BLOCK_BYTES / 8) };
    let mut want = vec![0f64; BLOCK_BYTES / 8];
    for &p in &senders {
        want.iter_mut().zip(Gen::new(seed, p, 900_002, DType::F64).take(BLOCK_BYTES / 8)).for_each(|(w, x)| *w += x);
    }
    if summed.iter().zip(&want).any(|(s, w)| (s - w).abs() > 1e-9 * (1.0 + w.abs())) {
        bad.push(format!("rank {me}: one-sided accumulates from ranks {senders:?}: sum differs"));
    }
    let mut all_olds = vec![0f64; FETCH_ADDS * w];
    comm.allgather(&olds, &mut all_olds)?;
    all_olds.sort_by(f64::total_cmp);
    if all_olds.windows(2).any(|p| p[0] == p[1]) {
        bad.push(format!("rank {me}: fetch-add returned the same old value twice (not atomic)"));
    }
    if me == 0 {
        let total = win.fetch_add(0, counter_at, 0)?;
        let want: u64 = (1..=w as u64).sum::<u64>() * FETCH_ADDS as u64;
        if total != want {
            bad.push(format!("rank 0: fetch-add counter is {total}, expected {want}"));
        }
    }
    comm.barrier()?;
    Ok(bad)
}

const ACCUMULATE_TAG: u64 = 7;
/// Fetch-adds per rank on rank 0's counter, all at once: enough for a lost update between
/// a CPU atomic and a NIC's to show (see `NicAtomics`).
const FETCH_ADDS: usize = 100;

/// The check's accumulate: adds f64 payloads into the words at `at`, one request at a time.
struct AddF64 {
    region: Arc<gradwire::Region>,
    at: usize,
    lock: std::sync::Mutex<()>,
}

impl Accumulate for AddF64 {
    fn accumulate(&self, tag: u64, off: usize, len: usize, recv: &mut dyn FnMut(&mut [u8]) -> std::io::Result<()>) -> std::result::Result<(), AccumulateError> {
        if tag != ACCUMULATE_TAG || off != self.at || len % 8 != 0 {
            return Err(AccumulateError::Refused(format!("wrong tag {tag}, offset {off} or length {len}")));
        }
        let _held = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut word = [0u8; 8];
        for i in 0..len / 8 {
            recv(&mut word)?;
            // SAFETY: off + len is inside the region (checked by the service); we hold the lock.
            unsafe { *(self.region.as_ptr().add(off + 8 * i) as *mut f64) += f64::from_le_bytes(word) };
        }
        Ok(())
    }
}

/// The non-blocking cross-node allreduce overlapping node-local collectives, `iters` times:
/// each iteration starts a cross-node allreduce, runs a node-local allreduce meanwhile,
/// then waits; both results are checked exactly (integer-valued data). Every wait is
/// under the communicators' deadline, so a deadlock between the two groups fails the run.
pub fn overlap(comm: &Communicator, iters: usize) -> Result<bool> {
    let h = Hierarchy::new(comm)?;
    let topo = comm.topology();
    let me = comm.rank();
    let local_index = |r: usize| topo.local_ranks(r).iter().position(|&x| x == r).unwrap_or(0);
    let node_members = topo.local_ranks(me);
    let cross_members: Vec<usize> = (0..comm.size()).filter(|&r| local_index(r) == local_index(me)).collect();
    let value = |r: usize, it: usize, i: usize| ((r * 7919 + it * 31 + i) % 1000) as f64;
    let mut bad = 0usize;
    for it in 0..iters {
        let cross_in: Vec<f64> = (0..1000).map(|i| value(me, it, i)).collect();
        let pending = h.start_cross(cross_in, ReduceOp::Sum)?;
        let mut node_buf: Vec<f64> = (0..5003).map(|i| value(me, it + 1, i)).collect();
        h.node.allreduce(&mut node_buf, ReduceOp::Sum)?;
        let cross_out = pending.wait()?;
        bad += (0..1000).filter(|&i| cross_out[i] != cross_members.iter().map(|&r| value(r, it, i)).sum::<f64>()).count();
        bad += (0..5003).filter(|&i| node_buf[i] != node_members.iter().map(|&r| value(r, it + 1, i)).sum::<f64>()).count();
    }
    let mut total = [bad as f64];
    comm.allreduce(&mut total, ReduceOp::Sum)?;
    if me == 0 {
        let iterations = iters * comm.size();
        let failed = if total[0] > 0.0 { 1 } else { 0 };
        println!(
            "overlap: {iters} iterations x {} ranks ({} nodes): cross-node iallreduce during node-local allreduce, {} wrong elements: {} passed, {failed} failed",
            comm.size(),
            h.nodes(),
            total[0],
            if failed == 0 { iterations } else { 0 }
        );
    }
    Ok(total[0] == 0.0)
}

/// The token ring and parameter-server shards under load: every rank computes `steps`
/// integer-valued gradients at its own randomised speed (unbalanced: rank r sleeps up to
/// (1 + r mod 3) × 300 µs per step) and pushes by the dynamic-delay policy (whenever the
/// token passes, everything accumulated) or the fixed cyclic one (one gradient per turn,
/// waiting for it); a quarter of the steps also pull outside the rank's turn, racing the
/// holder's pushes. Checked: one token holder at every take; every pull sees each shard
/// consistent (a push is a constant vector, so a torn update would show mixed values);
/// and conservation, exactly: applied + still accumulated = computed. `kill = (rank, step)`
/// SIGKILLs that rank when it first takes the token at or after that step (fault tests).
pub fn token_ring(comm: &Communicator, steps: usize, cyclic: bool, kill: Option<(usize, usize)>) -> Result<bool> {
    use gradwire::rma::{ApplyRule, RemoteMemory};
    let (w, me) = (comm.size(), comm.rank());
    let seed = job_seed(comm)?;
    // Large enough that a push takes a while to apply (over tcp: to arrive), so that pulls
    // outside the turn do meet pushes half-way; small in fault runs, so that the victim
    // reaches its fatal step while the others still pass the token.
    let n = if kill.is_some() { 1000 } else { 1 << 16 };
    let servers: Vec<usize> = if w > 1 { vec![0, w - 1] } else { vec![0] };
    let mut rm = RemoteMemory::new(comm, &servers, &vec![0f32; n], ApplyRule::Sum, 1.0)?;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ (me as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let (mut acc, mut count) = (vec![0f32; n], 0u64);
    let mut computed = vec![0f64; n];
    let mut params = vec![0f32; n];
    let (mut pushes, mut torn) = (0u64, 0usize);
    let bounds: Vec<usize> = (0..=servers.len()).map(|i| n * i / servers.len()).collect();
    // A push is a constant vector per shard: mixed values in a shard mean a torn pull.
    let torn_shards = |p: &[f32]| (0..servers.len()).filter(|&i| p[bounds[i]..bounds[i + 1]].windows(2).any(|w| w[0] != w[1])).count();
    let (mut side, mut side_torn) = (vec![0f32; n], 0usize);
    let mut turn = |rm: &mut RemoteMemory, acc: &mut Vec<f32>, count: &mut u64, step: usize| -> Result<()> {
        rm.take_token()?;
        if kill.is_some_and(|(r, s)| r == me && step >= s) {
            // SAFETY: raising a signal on ourselves has no memory-safety preconditions.
            unsafe { libc::raise(libc::SIGKILL) };
        }
        if *count > 0 {
            rm.push(acc, *count)?;
            acc.iter_mut().for_each(|a| *a = 0.0);
            *count = 0;
            pushes += 1;
        }
        rm.pull(&mut params)?;
        torn += torn_shards(&params);
        rm.pass_token()
    };
    for step in 0..steps {
        let g = rng.random_range(-3i32..=3) as f32;
        acc.iter_mut().for_each(|a| *a += g);
        computed.iter_mut().for_each(|c| *c += g as f64);
        count += 1;
        std::thread::sleep(Duration::from_micros(rng.random_range(0..300) * (1 + me as u64 % 3)));
        // Pulls outside our turn race with the holder's pushes: the seqlock must hold. Not
        // in fault runs: there they would reach survivors that already exited because of
        // the death (and, with rank 0, the store that holds their reasons), and the report
        // under test is of the death itself.
        if kill.is_none() && rng.random_ratio(1, 4) {
            rm.pull(&mut side)?;
            side_torn += torn_shards(&side);
        }
        if cyclic {
            rm.wait_token()?;
            turn(&mut rm, &mut acc, &mut count, step)?;
        } else if rm.poll_token()? {
            turn(&mut rm, &mut acc, &mut count, step)?;
        }
    }
    // Keep the token moving until every rank has finished computing.
    let done = comm.ibarrier()?;
    while !done.test() {
        if rm.poll_token()? {
            turn(&mut rm, &mut acc, &mut count, usize::MAX)?;
        }
        std::thread::yield_now();
    }
    done.wait()?;
    rm.flush()?;
    comm.barrier()?;
    // Conservation: shards hold −Σ applied (lr 1, start 0); ranks hold their residuals.
    rm.pull(&mut params)?;
    let mut totals: Vec<f64> = computed.iter().zip(&acc).map(|(c, a)| c - *a as f64).collect();
    comm.allreduce(&mut totals, ReduceOp::Sum)?;
    let applied: Vec<f64> = params.iter().map(|p| -*p as f64).collect();
    let lost = totals.iter().zip(&applied).filter(|(t, a)| t != a).count();
    // Every remote read happens before the last collectives: after them a server rank may
    // already be gone.
    let applied_pushes: u64 = (0..servers.len()).map(|i| rm.applied(i)).sum::<Result<u64>>()?;
    let mut stats = [pushes as f64, (torn + side_torn) as f64, lost as f64];
    comm.allreduce(&mut stats, ReduceOp::Sum)?;
    comm.barrier()?;
    let ok = stats[1] == 0.0 && stats[2] == 0.0 && applied_pushes == stats[0] as u64 * servers.len() as u64;
    if me == 0 {
        println!(
            "token-ring ({}): {steps} steps x {w} ranks, {} pushes ({:.1} minibatches each), {} shard updates applied, {} torn pulls, conservation {} (first element: computed − still accumulated = {}, applied = {}): {} passed, {} failed",
            if cyclic { "fixed cyclic" } else { "dynamic delay" },
            stats[0],
            (steps * w) as f64 / stats[0].max(1.0),
            applied_pushes,
            stats[1],
            if stats[2] == 0.0 { "exact" } else { "VIOLATED" },
            totals[0] + 0.0,
            applied[0],
            if ok { 1 } else { 0 },
            if ok { 0 } else { 1 }
        );
    }
    Ok(ok)
}
