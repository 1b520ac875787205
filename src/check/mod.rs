//! The conformance check `gradwire check` runs on a job (and the test suite through it):
//! every collective x dtype x op x count (x allreduce algorithm), each compared with the
//! independent reference of [`reference`](mod@reference) on fresh random data, plus a check that all ranks
//! hold bit-identical allreduce results; point-to-point and one-sided operations; non-blocking
//! calls overlapped; the token ring's conservation. Each part prints its report on standard
//! output, as `gradwire check` shows it, and returns whether every case passed.
//!
//! Files: this one the plan and the runs; [`reference`](mod@reference) the reference and random data;
//! `case` one case; `p2p`, `overlap`, `token_ring` the other parts.

mod case;
mod overlap;
mod p2p;
pub mod reference;
mod token_ring;

pub use overlap::overlap;
pub use token_ring::token_ring;

use crate::{Algo, Collective, Communicator, DType, HierarchicalAlgo, Hierarchy, ReduceOp, Request, Result};
pub use case::run_case;
use p2p::p2p_and_onesided;

/// What `gradwire check` checks.
pub struct CheckArgs {
    /// Element counts every case runs with.
    pub counts: Vec<usize>,
    /// Bytes of the extra large cases (float32 sums: allreduce, automatic and ring, and
    /// every other collective of that whole size; 0: none).
    pub large_bytes: usize,
    /// The collectives to check.
    pub collectives: Vec<Collective>,
    /// The element types to check.
    pub dtypes: Vec<DType>,
    /// The reductions to check (each where the dtype has it).
    pub ops: Vec<ReduceOp>,
    /// Print every case, not only failures and the summary.
    pub verbose: bool,
    /// Test the hierarchical allreduce (both algorithms) instead of the flat collectives.
    pub hierarchical: bool,
    /// Where the allreduce buffers come from.
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

/// Where a reduce-scatter's or an allgather's output lies against its input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Separate buffers.
    Apart,
    /// NCCL's in-place layout: the allgather's input is this rank's block of its output,
    /// the reduce-scatter's output this rank's block of its input (how FSDP gathers and
    /// Megatron's distributed optimizer reduce-scatters). Other collectives ignore it.
    InPlace,
}

impl Buffers {
    /// Whether rank `rank`'s buffers come from the shared allocator.
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
        return Err(crate::Error::InvalidArgument(format!("buffers ({} and {} bytes) shorter than the request ({sl} and {rl})", send.len(), recv.len())));
    }
    let sp = if in_place { recv.as_ptr() } else { send.as_ptr() };
    // SAFETY: both buffers are borrowed for the whole call and are long enough (checked);
    // wait() returns only after the engine is done with them.
    unsafe { comm.run(req, sp, recv.as_mut_ptr()) }
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

/// Runs the matrix of `args` on `comm` and prints the report (rank 0); true when every case
/// passed on every rank.
pub fn run(comm: &Communicator, args: &CheckArgs) -> Result<bool> {
    let (w, me) = (comm.size(), comm.rank());
    let seed = job_seed(comm)?;
    let single_shm = comm.transports_used().iter().all(|&t| t == crate::transport::Transport::Shm);
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
        // The hierarchical check runs allreduces only (as above).
        let others = if args.hierarchical {
            &[][..]
        } else {
            &[Collective::Broadcast, Collective::Reduce, Collective::ReduceScatter, Collective::Allgather, Collective::AllToAll][..]
        };
        for &op in others.iter().filter(|op| args.collectives.contains(op)) {
            // The collectives that split their buffer: the whole of it this large.
            let count = if matches!(op, Collective::ReduceScatter | Collective::Allgather | Collective::AllToAll) { n / w } else { n };
            plan.push((op, DType::F32, ReduceOp::Sum, count, None));
        }
    }
    let plan: Vec<_> = plan.into_iter().flat_map(|p| hier_algos.iter().map(move |h| (p, *h))).collect();
    // The collectives that split their buffer also in NCCL's in-place layout.
    let plan: Vec<_> = plan
        .into_iter()
        .flat_map(|(p, h)| {
            [false, true]
                .into_iter()
                .filter(move |&in_place| !in_place || matches!(p.0, Collective::ReduceScatter | Collective::Allgather))
                .map(move |i| (p, h, i))
        })
        .collect();
    for ((op, dtype, redop, n, algo), hier_algo, in_place) in plan {
        cases += 1;
        let case = cases;
        let failures_before = failures.len();
        let root = (case as usize) % w;
        let req = Request { root, algo, ..Request::new(op, dtype, redop, n) };
        let label = format!(
            "{} {} {} n={n}{}{}{}",
            op.name(),
            dtype.name(),
            redop.name(),
            algo.map(|a| format!(" algo={a:?}")).unwrap_or_default(),
            if matches!(op, Collective::Broadcast | Collective::Reduce) { format!(" root={root}") } else { String::new() },
            if in_place { " in place" } else { "" }
        );
        let hier = hierarchy.as_ref().zip(hier_algo);
        let layout = if in_place { Layout::InPlace } else { Layout::Apart };
        let wrong = run_case(comm, seed, case, req, layout, hier, args.buffers, &label, &mut failures)?;
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
