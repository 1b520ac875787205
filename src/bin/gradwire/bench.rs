//! `gradwire bench`: nccl-tests style tables (size, count, type, redop, time, algbw, busbw,
//! #wrong), run under `gradwire launch`; CSV and JSON output for scripts.

use gradwire::check::{job_seed, run_bytes, run_case, Buffers, Layout};
use gradwire::{Algo, Collective, Communicator, DType, ReduceOp, Region, RegionKind, Registration, Request, Result};
use std::io::Write;
use std::time::Instant;

pub struct BenchArgs {
    pub op: Collective,
    pub min: usize,
    pub max: usize,
    pub factor: usize,
    pub iters: usize,
    pub warmup: usize,
    pub dtype: DType,
    pub redop: ReduceOp,
    /// Root of broadcast and reduce.
    pub root: usize,
    pub algo: Option<Algo>,
    pub check: bool,
    pub csv: Option<String>,
    pub json: Option<String>,
    /// Allreduce through the node-local + cross-node hierarchy.
    pub hierarchical: Option<gradwire::HierarchicalAlgo>,
    /// Where the buffers come from (shared: what `gradwire_alloc` hands out).
    pub buffers: Buffers,
}

/// nccl-tests' bus-bandwidth factor: what each rank's link carries relative to S/t.
pub fn busbw_factor(op: Collective, w: usize) -> f64 {
    let w = w as f64;
    match op {
        Collective::Allreduce => 2.0 * (w - 1.0) / w,
        Collective::ReduceScatter | Collective::Allgather | Collective::AllToAll => (w - 1.0) / w,
        _ => 1.0,
    }
}

pub struct Row {
    pub size: usize,
    pub count: usize,
    pub time_us: f64,
    pub algbw: f64,
    pub busbw: f64,
    pub wrong: Option<u64>,
}

pub fn run(comm: &Communicator, a: &BenchArgs) -> Result<Vec<Row>> {
    let (w, me) = (comm.size(), comm.rank());
    let es = a.dtype.size();
    let seed = if a.check { job_seed(comm)? } else { 0 };
    // `size` is the whole buffer as nccl-tests counts it: the total gathered/scattered
    // buffer for allgather and reduce-scatter, one rank's whole send buffer for all-to-all.
    let mut sizes = vec![];
    let mut s = a.min.max(es);
    while s <= a.max {
        sizes.push(s);
        s = if a.factor > 1 { s * a.factor } else { s + a.min.max(es) };
    }
    let kind = match (a.buffers.shared_on(me), comm.config().hugepages) {
        (true, _) => RegionKind::Shared,
        // Only normal pages can be registered in place.
        (false, true) if a.buffers != Buffers::Registered => RegionKind::HugePages,
        (false, _) => RegionKind::Anonymous,
    };
    let region_of = |len: usize| -> Result<Region> {
        match kind {
            RegionKind::Shared => Region::shared("gradwire-bench", len),
            RegionKind::HugePages => Region::huge(len),
            RegionKind::Anonymous => Region::anonymous(len),
        }
    };
    // Registered buffers start 64 bytes into a page, where `malloc` and framework
    // allocators put large ones: every rank reduces their partial pages from staged copies.
    let skew = if a.buffers == Buffers::Registered { 64 } else { 0 };
    let mut send = region_of(a.max.max(es) + skew)?;
    let mut recv = region_of(a.max.max(es) + skew)?;
    // Touch every page before timing, with non-trivial values.
    for (i, b) in send.as_mut_slice().iter_mut().enumerate() {
        *b = (i % 251) as u8 & 0x3f;
    }
    recv.as_mut_slice().copy_from_slice(send.as_slice());
    // Registered once, for every size, as a framework registers its gradient buckets;
    // dropped before the regions (declared after them).
    let _registrations = if skew > 0 {
        // SAFETY: both regions are ours and outlive the registrations; only this thread
        // writes them.
        Some(unsafe { [Registration::new(send.as_ptr().add(skew), send.len() - skew)?, Registration::new(recv.as_ptr().add(skew), recv.len() - skew)?] })
    } else {
        None
    };
    let kinds: Vec<&str> = comm.transports_used().into_iter().map(|t| t.name()).collect();
    if me == 0 {
        println!(
            "# gradwire bench {}: {} ranks, {} host(s), links {:?}, algo {}, dtype {}, op {}, iters {}, warmup {}, buffers {:?}",
            a.op.name(),
            w,
            comm.topology().hosts(),
            kinds,
            match a.hierarchical {
                Some(h) => format!("hierarchical {h:?}"),
                None => format!("{:?}", a.algo.unwrap_or(comm.config().algo)),
            },
            a.dtype.name(),
            a.redop.name(),
            a.iters,
            a.warmup,
            kind
        );
        println!(
            "# busbw = algbw x {:.3} ({})",
            busbw_factor(a.op, w),
            match a.op {
                Collective::Allreduce => "2(W-1)/W",
                Collective::ReduceScatter | Collective::Allgather | Collective::AllToAll => "(W-1)/W",
                _ => "1",
            }
        );
        println!(
            "{:>12} {:>12} {:>9} {:>6} {:>11} {:>11} {:>11} {:>7}",
            "size(B)", "count", "type", "redop", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
        );
    }
    let hierarchy = match a.hierarchical {
        Some(_) if a.op != Collective::Allreduce => return Err(gradwire::Error::InvalidArgument("--hierarchical applies to allreduce".into())),
        Some(algo) => Some((gradwire::Hierarchy::new(comm)?, algo)),
        None => None,
    };
    let mut rows = vec![];
    for (si, &size) in sizes.iter().enumerate() {
        let total = size / es;
        let count = match a.op {
            Collective::ReduceScatter | Collective::Allgather | Collective::AllToAll => total / w,
            _ => total,
        };
        let req = Request { algo: a.algo, root: a.root, ..Request::new(a.op, a.dtype, a.redop, count) };
        let inplace = matches!(a.op, Collective::Allreduce | Collective::Broadcast | Collective::Reduce);
        let mut once = || -> Result<()> {
            let recv = &mut recv.as_mut_slice()[skew..];
            if let Some((h, algo)) = &hierarchy {
                h.allreduce_bytes(a.dtype, &mut recv[..count * es], a.redop, *algo)
            } else if inplace {
                run_bytes(comm, req, &[], recv)
            } else {
                run_bytes(comm, req, &send.as_slice()[skew..], recv)
            }
        };
        for _ in 0..a.warmup {
            once()?;
        }
        comm.barrier()?;
        let t0 = Instant::now();
        for _ in 0..a.iters {
            once()?;
        }
        let mine = t0.elapsed().as_secs_f64() / a.iters.max(1) as f64;
        let mut slowest = [mine];
        comm.allreduce(&mut slowest, ReduceOp::Max)?;
        let t = slowest[0];
        let bytes = (count * es * if matches!(a.op, Collective::ReduceScatter | Collective::Allgather | Collective::AllToAll) { w } else { 1 }) as f64;
        let algbw = bytes / t / 1e9;
        let busbw = algbw * busbw_factor(a.op, w);
        let wrong = if a.check {
            let mut failures = vec![];
            let label = format!("bench {} size {size}", a.op.name());
            let hier = hierarchy.as_ref().map(|(h, algo)| (h, *algo));
            let bad = run_case(comm, seed, 1000 + si as u64, req, Layout::Apart, hier, a.buffers, &label, &mut failures)?;
            for f in &failures {
                eprintln!("FAIL {f}");
            }
            let mut total = [bad as f64];
            comm.allreduce(&mut total, ReduceOp::Sum)?;
            Some(total[0] as u64)
        } else {
            None
        };
        if me == 0 {
            println!(
                "{:>12} {:>12} {:>9} {:>6} {:>11.2} {:>11.3} {:>11.3} {:>7}",
                bytes as usize,
                count,
                a.dtype.name(),
                a.redop.name(),
                t * 1e6,
                algbw,
                busbw,
                wrong.map(|x| x.to_string()).unwrap_or_else(|| "N/A".into())
            );
            let _ = std::io::stdout().flush();
        }
        rows.push(Row { size: bytes as usize, count, time_us: t * 1e6, algbw, busbw, wrong });
    }
    if me == 0 {
        if let Some(path) = &a.csv {
            let mut out = String::from("size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n");
            for r in &rows {
                out += &format!(
                    "{},{},{},{},{:.3},{:.4},{:.4},{}\n",
                    r.size,
                    r.count,
                    a.dtype.name(),
                    a.redop.name(),
                    r.time_us,
                    r.algbw,
                    r.busbw,
                    r.wrong.map(|x| x.to_string()).unwrap_or_default()
                );
            }
            std::fs::write(path, out).map_err(|e| gradwire::Error::io(format!("write {path}"), e))?;
        }
        if let Some(path) = &a.json {
            let v = serde_json::json!({
                "collective": a.op.name(), "ranks": w, "hosts": comm.topology().hosts(), "links": kinds,
                "dtype": a.dtype.name(), "redop": a.redop.name(),
                "rows": rows.iter().map(|r| serde_json::json!({
                    "size_bytes": r.size, "count": r.count, "time_us": r.time_us,
                    "algbw_gbs": r.algbw, "busbw_gbs": r.busbw, "wrong": r.wrong,
                })).collect::<Vec<_>>(),
            });
            std::fs::write(path, serde_json::to_string_pretty(&v).unwrap_or_default()).map_err(|e| gradwire::Error::io(format!("write {path}"), e))?;
        }
    }
    Ok(rows)
}
