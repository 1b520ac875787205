//! The `gradwire` command: launch, bench, check, info, train, plot.

mod bench;
mod bench_rma;
#[cfg(feature = "cuda")]
mod gpu_bench;
#[cfg(feature = "cuda")]
mod gpu_check;
mod info;
mod launch;
mod model;
mod plot;
mod train;

use clap::{Parser, Subcommand};
use gradwire::config::parse_size;
use gradwire::{Algo, Collective, Communicator, DType, ReduceOp, TransportChoice};
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "gradwire",
    version,
    about = "Communication backend for distributed training: launch ranks, benchmark and check collectives, inspect the host"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

fn size_arg(s: &str) -> Result<usize, String> {
    parse_size(s).map(|v| v as usize)
}

/// What `gradwire bench` measures: a collective, or the remote-memory layer.
#[derive(Clone, Copy)]
enum BenchTarget {
    Collective(Collective),
    Ps,
    TokenRing,
    Write,
}

fn bench_arg(s: &str) -> Result<BenchTarget, String> {
    match s {
        "ps" => Ok(BenchTarget::Ps),
        "write" => Ok(BenchTarget::Write),
        "token-ring" | "token_ring" => Ok(BenchTarget::TokenRing),
        other => collective_arg(other).map(BenchTarget::Collective),
    }
}

fn collective_arg(s: &str) -> Result<Collective, String> {
    Ok(match s {
        "allreduce" | "all_reduce" => Collective::Allreduce,
        "reduce_scatter" | "reducescatter" | "reduce-scatter" => Collective::ReduceScatter,
        "allgather" | "all_gather" => Collective::Allgather,
        "broadcast" | "bcast" => Collective::Broadcast,
        "reduce" => Collective::Reduce,
        "barrier" => Collective::Barrier,
        "alltoall" | "all_to_all" => Collective::AllToAll,
        _ => return Err(format!("unknown collective {s:?} (allreduce, reduce_scatter, allgather, broadcast, reduce, barrier, alltoall)")),
    })
}

#[derive(Subcommand)]
enum Cmd {
    /// Start N local ranks of CMD with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
    /// MASTER_ADDR, MASTER_PORT and GRADWIRE_JOB_SECRET set.
    Launch {
        /// Number of ranks.
        #[arg(short = 'n', long = "nprocs")]
        nprocs: usize,
        /// One "node" per network namespace on a private bridge (needs root).
        #[arg(long)]
        netns: bool,
        /// With --netns: ranks per namespace (node).
        #[arg(long, default_value_t = 1)]
        ranks_per_node: usize,
        /// With --netns: shape every node's link to R Gbit/s (tc tbf).
        #[arg(long)]
        link_gbit: Option<f64>,
        /// Stop everything after S seconds.
        #[arg(long)]
        timeout: Option<f64>,
        /// core: pin each rank to its own CPU when ranks <= CPUs (as mpirun does); none.
        #[arg(long, default_value = "core", value_parser = ["core", "none"])]
        bind: String,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        cmd: Vec<String>,
    },
    /// Internal: the guard `gradwire launch` starts to stop its ranks (and remove its
    /// namespaces) should the launcher die without doing so.
    #[command(hide = true, name = "launch-guard")]
    LaunchGuard,
    /// nccl-tests style benchmark of one collective (run under `gradwire launch`).
    Bench {
        /// allreduce, reduce_scatter, allgather, broadcast, reduce, barrier, alltoall; or write
        /// (point-to-point one-sided write, rank 0 into rank 1), ps (parameter-server
        /// push/pull against raw one-sided bandwidth) or token-ring
        /// (round time; with --check also pushes under the dynamic delay, conservation checked).
        #[arg(value_parser = bench_arg)]
        collective: BenchTarget,
        #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = size_arg)]
        min: usize,
        #[arg(short = 'e', long = "maxbytes", default_value = "64M", value_parser = size_arg)]
        max: usize,
        /// Multiplication factor between sizes.
        #[arg(short = 'f', long = "stepfactor", default_value_t = 2)]
        factor: usize,
        #[arg(short = 'n', long = "iters", default_value_t = 20)]
        iters: usize,
        #[arg(short = 'w', long = "warmup", default_value_t = 5)]
        warmup: usize,
        #[arg(short = 'd', long = "dtype", default_value = "float32")]
        dtype: DType,
        #[arg(short = 'o', long = "op", default_value = "sum")]
        op: ReduceOp,
        /// Root rank of broadcast and reduce.
        #[arg(short = 'r', long = "root", default_value_t = 0)]
        root: usize,
        /// Allreduce algorithm: auto, ring, rd, hd, shm.
        #[arg(long)]
        algo: Option<Algo>,
        /// auto, shm or tcp (sets GRADWIRE_TRANSPORT for this run).
        #[arg(long)]
        transport: Option<TransportChoice>,
        /// Count elements that differ from an independent reference on fresh random data.
        #[arg(long)]
        check: bool,
        #[arg(long)]
        csv: Option<String>,
        #[arg(long)]
        json: Option<String>,
        /// Allreduce through node-local + cross-node groups: sharded or leader.
        #[arg(long)]
        hierarchical: Option<gradwire::HierarchicalAlgo>,
        /// private, shared (gradwire's allocator, `gradwire_alloc`: ranks on one host reach
        /// these buffers without a copy), registered (private, made shared in place by
        /// `gradwire_register`) or mixed (shared on even ranks).
        #[arg(long, default_value = "private")]
        buffers: gradwire::check::Buffers,
    },
    /// Correctness matrix: every collective x dtype x op x count against an independent
    /// reference on fresh random data (run under `gradwire launch`).
    Check {
        /// Element counts to test.
        #[arg(long, value_delimiter = ',', default_value = "0,1,7919,1003")]
        counts: Vec<usize>,
        /// Also run f32 sums of this many bytes (e.g. 64M): allreduce (automatic and ring)
        /// and every other collective of that whole size.
        #[arg(long, default_value = "0", value_parser = size_arg)]
        large: usize,
        #[arg(long, value_delimiter = ',', value_parser = collective_arg, default_value = "allreduce,reduce_scatter,allgather,broadcast,reduce,barrier,alltoall")]
        collectives: Vec<Collective>,
        /// Element types to check (default: every one gradwire has).
        #[arg(long, value_delimiter = ',')]
        dtypes: Vec<DType>,
        /// Reductions to check (default: every one gradwire has).
        #[arg(long, value_delimiter = ',')]
        ops: Vec<ReduceOp>,
        #[arg(long)]
        transport: Option<TransportChoice>,
        /// Run the matrix on sub-communicators instead: node-local, cross-node and
        /// even/odd ranks (all made by `split`).
        #[arg(long)]
        split: bool,
        /// Run the matrix through the hierarchical allreduce (node-local + cross-node groups).
        #[arg(long)]
        hierarchical: bool,
        /// Instead: N iterations of a non-blocking cross-node allreduce overlapping a
        /// node-local allreduce, both checked.
        #[arg(long)]
        overlap: Option<usize>,
        /// Instead: the token ring and parameter-server shards, N steps per rank
        /// (conservation, token uniqueness, no torn pulls).
        #[arg(long)]
        token_ring: Option<usize>,
        /// With --token-ring: the fixed cyclic policy instead of the dynamic delay.
        #[arg(long)]
        cyclic: bool,
        /// With --token-ring: RANK:STEP — that rank SIGKILLs itself holding the token.
        #[arg(long)]
        kill: Option<String>,
        /// Allreduce buffers: private, shared (gradwire's allocator), registered (private,
        /// made shared in place) or mixed (shared on even ranks).
        #[arg(long, default_value = "private")]
        buffers: gradwire::check::Buffers,
        #[arg(short, long)]
        verbose: bool,
    },
    /// The collectives on CUDA device memory against an independent reference (needs a
    /// GPU; run under `gradwire launch`): NCCL inside a node, the hierarchical path across
    /// nodes. --hierarchical fails unless the ranks span several nodes.
    #[cfg(feature = "cuda")]
    GpuCheck {
        #[arg(long)]
        hierarchical: bool,
    },
    /// The GPU path's figures (needs a GPU; run under `gradwire launch`): the allreduce on
    /// device memory beside the host allreduce of the same bytes, per size, then the
    /// staging copies against pinned cudaMemcpy.
    #[cfg(feature = "cuda")]
    GpuBench {
        #[arg(short = 'b', long = "minbytes", default_value = "1M", value_parser = size_arg)]
        min: usize,
        #[arg(short = 'e', long = "maxbytes", default_value = "256M", value_parser = size_arg)]
        max: usize,
        #[arg(short = 'n', long = "iters", default_value_t = 20)]
        iters: usize,
    },
    /// Train the built-in model with one of the seven strategies (run under `gradwire
    /// launch`): ssgd, daso, bsp, ddcgu, cyclic, downpour, eamsgd.
    Train {
        #[command(flatten)]
        args: train::TrainArgs,
        /// shm, tcp, verbs or auto (default: GRADWIRE_TRANSPORT, else auto).
        #[arg(long)]
        transport: Option<TransportChoice>,
    },
    /// Draw the curves of `gradwire train --csv` runs (test accuracy and training loss) into
    /// one SVG.
    Plot {
        /// Output SVG.
        #[arg(short, long)]
        out: String,
        /// X axis: time (wall seconds), epoch or bytes (MB sent per rank).
        #[arg(long, default_value = "time")]
        x: String,
        /// CSV files written by `gradwire train --csv`.
        #[arg(required = true)]
        csv: Vec<String>,
    },
    /// The cost model: predicted allreduce time per algorithm for N nodes of G ranks on the
    /// links given, and the choice; or (--fit) its parameters fitted from measured runs.
    Model {
        /// Nodes.
        #[arg(long, default_value_t = 2)]
        nodes: usize,
        /// Ranks per node.
        #[arg(long, default_value_t = 1)]
        ranks_per_node: usize,
        /// The network's rate between nodes, Gbit/s.
        #[arg(long, default_value_t = 25.0)]
        gbit: f64,
        /// Seconds per step on the network, in microseconds.
        #[arg(long, default_value_t = 10.0)]
        alpha_us: f64,
        /// Seconds per byte reduced outside the transfer, in nanoseconds.
        #[arg(long, default_value_t = 0.1)]
        gamma_ns: f64,
        /// The rate inside a node (shared memory, NVLink), Gbit/s.
        #[arg(long, default_value_t = 400.0)]
        node_gbit: f64,
        /// Seconds per step inside a node, in microseconds.
        #[arg(long, default_value_t = 2.0)]
        node_alpha_us: f64,
        #[arg(short = 'b', long = "minbytes", default_value = "4K", value_parser = size_arg)]
        min: usize,
        #[arg(short = 'e', long = "maxbytes", default_value = "1G", value_parser = size_arg)]
        max: usize,
        #[arg(short = 'f', long = "stepfactor", default_value_t = 4)]
        factor: usize,
        /// Also the communication a DASO rank waits for per batch in its cycling phase
        /// (Heat's schedule after warm-up: a global send every 4 batches, merged 1 batch
        /// later, node-local averages every batch) when a batch computes this long.
        #[arg(long)]
        compute_ms: Option<f64>,
        /// Fit the network's parameters to these runs instead (ALGO:RANKS:FILE, a
        /// `gradwire bench allreduce --csv` file run by GRADWIRE_ALGO=ALGO on RANKS ranks,
        /// one per node) and print each run's measured and predicted time.
        #[arg(long, value_parser = model::run_arg, value_delimiter = ',')]
        fit: Vec<(gradwire::cost::Algorithm, usize, String)>,
        /// Runs predicted with the fitted parameters but not used to fit them.
        #[arg(long, value_parser = model::run_arg, value_delimiter = ',')]
        check: Vec<(gradwire::cost::Algorithm, usize, String)>,
        /// The cores of the one host the --fit and --check runs' ranks shared (network
        /// namespaces on one machine); left out, each rank had a core of its own.
        #[arg(long)]
        cores: Option<usize>,
    },
    /// What this host offers (transports, RDMA devices, huge pages, RLIMIT_MEMLOCK) and the
    /// settings gradwire will use.
    Info {
        /// Print the settings table (markdown) and exit.
        #[arg(long)]
        settings: bool,
    },
}

fn set_transport(t: Option<TransportChoice>) {
    if let Some(t) = t {
        let v = match t {
            TransportChoice::Auto => "auto",
            TransportChoice::Shm => "shm",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Verbs => "verbs",
        };
        std::env::set_var("GRADWIRE_TRANSPORT", v);
    }
}

/// 0 when the run passed, 1 when it found wrong results or failed (the error printed with
/// the rank, so launcher output from many ranks stays readable).
fn exit_code(what: &str, result: gradwire::Result<bool>) -> i32 {
    match result {
        Ok(true) => 0,
        Ok(false) => 1,
        Err(e) => {
            let rank = std::env::var("RANK").map(|r| format!("rank {r}: ")).unwrap_or_default();
            // One write per line: ranks share the launcher's stderr.
            use std::io::Write;
            let _ = std::io::stderr().write_all(format!("{rank}gradwire {what}: {e}\n").as_bytes());
            1
        }
    }
}

fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Launch { nprocs, netns, ranks_per_node, link_gbit, timeout, bind, cmd } => launch::run(&launch::LaunchArgs {
            nprocs,
            netns,
            ranks_per_node,
            link_gbit,
            timeout: timeout.map(Duration::from_secs_f64),
            bind: bind == "core",
            cmd,
        }),
        Cmd::LaunchGuard => launch::guard(),
        Cmd::Train { args, transport } => {
            set_transport(transport);
            exit_code("train", Communicator::init().and_then(|c| train::run(&c, &args)))
        }
        Cmd::Model { nodes, ranks_per_node, gbit, alpha_us, gamma_ns, node_gbit, node_alpha_us, min, max, factor, compute_ms, fit, check, cores } => {
            let run = || -> Result<bool, String> {
                if !fit.is_empty() {
                    return model::fit_runs(&fit, &check, cores).map(|_| true);
                }
                if !check.is_empty() || cores.is_some() {
                    return Err("--check and --cores need --fit (the runs to fit the parameters to)".into());
                }
                if nodes == 0 || ranks_per_node == 0 || min == 0 || factor < 2 || max < min {
                    return Err(format!("--nodes {nodes}, --ranks-per-node {ranks_per_node}, sizes {min}..{max} x{factor}: nodes, ranks and sizes must be positive, the factor at least 2"));
                }
                let job = gradwire::cost::Job {
                    nodes,
                    per_node: ranks_per_node,
                    network: model::link(gbit, alpha_us, gamma_ns)?,
                    node: model::link(node_gbit, node_alpha_us, gamma_ns)?,
                };
                let sizes: Vec<usize> = std::iter::successors(Some(min), |&s| s.checked_mul(factor)).take_while(|&s| s <= max).collect();
                let daso = match compute_ms {
                    Some(ms) if ms >= 0.0 && ms.is_finite() => {
                        Some(gradwire::cost::DasoStep { global_skip: 4, local_skip: 1, batches_to_wait: 1, compute: ms * 1e-3 })
                    }
                    Some(ms) => return Err(format!("--compute-ms {ms}: a batch's computation is a time, not negative")),
                    None => None,
                };
                model::predict(&job, &sizes, daso);
                Ok(true)
            };
            exit_code("model", run().map_err(gradwire::error::invalid))
        }
        Cmd::Plot { out, x, csv } => exit_code("plot", plot::draw(&csv, &out, &x).map(|_| true)),
        Cmd::Info { settings } => {
            // `gradwire info | head` should end quietly like other Unix tools. Only here:
            // everywhere else SIGPIPE stays ignored so that a write to a dead peer's socket
            // is an EPIPE error naming the peer, not a silent death.
            // SAFETY: restoring the default disposition of a signal has no preconditions.
            unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
            info::run(settings)
        }
        #[cfg(feature = "cuda")]
        Cmd::GpuCheck { hierarchical } => exit_code("gpu-check", Communicator::init().and_then(|c| gpu_check::run(&c, hierarchical))),
        #[cfg(feature = "cuda")]
        Cmd::GpuBench { min, max, iters } => {
            let sizes: Vec<usize> = std::iter::successors(Some(min.max(4)), |s| Some(s * 4)).take_while(|s| *s <= max).collect();
            exit_code("gpu-bench", Communicator::init().and_then(|c| gpu_bench::run(&c, &sizes, iters.max(1))))
        }
        Cmd::Bench { collective: target @ (BenchTarget::Ps | BenchTarget::Write), min, max, factor, iters, transport, check, .. } => {
            set_transport(transport);
            let sizes: Vec<usize> = std::iter::successors(Some(min.max(4)), |s| Some(s * factor.max(2))).take_while(|s| *s <= max).collect();
            let run = |c: Communicator| {
                if matches!(target, BenchTarget::Ps) {
                    bench_rma::ps(&c, &sizes, iters, check)
                } else {
                    bench_rma::write(&c, &sizes, iters).map(|_| true)
                }
            };
            exit_code("bench", Communicator::init().and_then(run))
        }
        Cmd::Bench { collective: BenchTarget::TokenRing, iters, transport, check, .. } => {
            set_transport(transport);
            exit_code(
                "bench token-ring",
                Communicator::init().and_then(|c| {
                    bench_rma::token_ring(&c, iters.max(1) * 50)?;
                    // Pushes under the dynamic-delay policy with randomized worker speeds; it
                    // always checks conservation, and the verdict decides the exit status
                    // under --check.
                    let conserved = gradwire::check::token_ring(&c, 300, false, None)?;
                    Ok(conserved || !check)
                }),
            )
        }
        Cmd::Bench {
            collective: BenchTarget::Collective(collective),
            min,
            max,
            factor,
            iters,
            warmup,
            dtype,
            op,
            root,
            algo,
            transport,
            check,
            csv,
            json,
            hierarchical,
            buffers,
        } => {
            set_transport(transport);
            let args =
                bench::BenchArgs { op: collective, min, max, factor, iters, warmup, dtype, redop: op, root, algo, check, csv, json, hierarchical, buffers };
            let all_right = Communicator::init().and_then(|c| bench::run(&c, &args)).map(|rows| rows.iter().all(|r| r.wrong.unwrap_or(0) == 0));
            exit_code("bench", all_right)
        }
        Cmd::Check { counts, large, collectives, dtypes, ops, transport, split, hierarchical, overlap, token_ring, cyclic, kill, buffers, verbose } => {
            let kill = kill.and_then(|k| k.split_once(':').and_then(|(r, s)| Some((r.parse().ok()?, s.parse().ok()?))));
            set_transport(transport);
            let dtypes = if dtypes.is_empty() { DType::ALL.to_vec() } else { dtypes };
            let ops = if ops.is_empty() { ReduceOp::ALL.to_vec() } else { ops };
            let args = gradwire::check::CheckArgs { counts, large_bytes: large, collectives, dtypes, ops, verbose, hierarchical, buffers };
            exit_code(
                "check",
                Communicator::init().and_then(|c| match (overlap, split) {
                    _ if token_ring.is_some() => gradwire::check::token_ring(&c, token_ring.unwrap_or(0), cyclic, kill),
                    (Some(iters), _) => gradwire::check::overlap(&c, iters),
                    (None, true) => gradwire::check::run_split(&c, &args),
                    (None, false) => gradwire::check::run(&c, &args),
                }),
            )
        }
    };
    std::process::exit(code);
}
