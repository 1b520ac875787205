//! `gradwire train`: trains the built-in model with one of the seven strategies (run under
//! `gradwire launch`). Rank 0 prints a line per epoch and writes the CSV; `--plot` draws it.

use gradwire::rma::ApplyRule;
use gradwire::train::{
    self,
    daso::{DasoConfig, Wire},
    data::{epoch_batches, steps_per_epoch},
    Dataset, Mlp, Model, StrategyConfig,
};
use gradwire::{Communicator, ReduceOp, Result};
use std::io::Write;
use std::time::{Duration, Instant};

#[derive(clap::Args, Clone, Debug)]
pub struct TrainArgs {
    /// ssgd, daso, bsp, ddcgu, cyclic, downpour or eamsgd.
    #[arg(long, default_value = "ssgd")]
    pub strategy: String,
    #[arg(long, default_value_t = 10)]
    pub epochs: usize,
    /// digits (UCI handwritten digits, shipped by the smartcore crate) or
    /// synthetic[:LEN[:FEATURES[:CLASSES]]].
    #[arg(long, default_value = "digits")]
    pub data: String,
    /// Hidden layer widths, comma-separated.
    #[arg(long, default_value = "64,64")]
    pub hidden: String,
    /// Minibatch size per rank.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    #[arg(long, default_value_t = 0.05)]
    pub lr: f32,
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f32,
    /// bsp: local steps between global reductions (K).
    #[arg(long, default_value_t = 4)]
    pub interval: usize,
    /// bsp: the hierarchical variant's node-local reduction every K1 steps (K1 divides
    /// --interval); 0 = flat.
    #[arg(long, default_value_t = 0)]
    pub node_interval: usize,
    /// bsp: send only this fraction of entries (top-k with error feedback); 0 = dense.
    #[arg(long, default_value_t = 0.0)]
    pub topk: f64,
    /// daso: warm-up and cool-down epochs (each capped at a quarter of the run, gradwire's
    /// `cap_phases`, so that short runs cycle).
    #[arg(long, default_value_t = 4)]
    pub warmup: usize,
    #[arg(long, default_value_t = 4)]
    pub cooldown: usize,
    /// daso: average on a bf16 wire in the synchronous phases.
    #[arg(long)]
    pub bf16_wire: bool,
    /// daso: cut the cycling phase's global send into allreduces of at most this many
    /// elements (Heat's sending_chunk_size).
    #[arg(long, default_value_t = 10_000_000)]
    pub chunk: usize,
    /// downpour: pull every N steps.
    #[arg(long, default_value_t = 1)]
    pub fetch: usize,
    /// downpour: push every N steps.
    #[arg(long, default_value_t = 1)]
    pub push: usize,
    /// downpour: fetch and push on a thread of their own (Dean et al.'s form), not blocking
    /// the worker.
    #[arg(long)]
    pub background: bool,
    /// eamsgd: elastic exchange every τ steps.
    #[arg(long, default_value_t = 4)]
    pub tau: usize,
    /// eamsgd: moving rate β (α = β / P).
    #[arg(long, default_value_t = 0.9)]
    pub beta: f32,
    /// ddcgu / cyclic: how the servers apply a push: sum, mean or staleness.
    #[arg(long, default_value = "mean")]
    pub rule: String,
    /// RANK:FACTOR — that rank computes FACTOR times slower (a straggler). Repeatable.
    #[arg(long)]
    pub slow: Vec<String>,
    /// Write loss and accuracy per epoch against wall time and bytes sent (rank 0).
    #[arg(long)]
    pub csv: Option<String>,
    /// Also draw the CSV's curves into this SVG.
    #[arg(long)]
    pub plot: Option<String>,
    /// Label of the run in the CSV and plots (default: the strategy).
    #[arg(long)]
    pub label: Option<String>,
    /// Stop once the test accuracy reaches this fraction (time-to-accuracy runs).
    #[arg(long)]
    pub target: Option<f64>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write the final parameters (raw little-endian f32) here (rank 0).
    #[arg(long)]
    pub save_params: Option<String>,
    /// Exit with status 1 unless the final test accuracy reaches this fraction.
    #[arg(long)]
    pub require: Option<f64>,
    /// After every epoch, say whether every rank holds bit-identical parameters.
    #[arg(long)]
    pub check_replicas: bool,
    /// At the end, compare the bytes the scheme counted in its steps with the payload
    /// bytes the transports sent during them. Meaningful for schemes whose messages all
    /// complete inside the step on ring paths (ssgd, bsp): the one-host shared-memory
    /// allreduce and one-sided traffic send none, DASO's non-blocking sums progress between
    /// steps, and small buffers take recursive doubling, whose bytes differ from a ring's.
    #[arg(long)]
    pub check_bytes: bool,
}

fn parse_slow(specs: &[String], world: usize) -> Result<Vec<f64>> {
    let mut factor = vec![1.0; world];
    for s in specs {
        let bad = || gradwire::Error::InvalidArgument(format!("--slow {s}: expected RANK:FACTOR with RANK < {world} and FACTOR >= 1"));
        let (r, f) = s.split_once(':').ok_or_else(bad)?;
        let (r, f): (usize, f64) = (r.parse().map_err(|_| bad())?, f.parse().map_err(|_| bad())?);
        if r >= world || f.is_nan() || f < 1.0 {
            return Err(bad());
        }
        factor[r] = f;
    }
    Ok(factor)
}

fn strategy_config(a: &TrainArgs) -> Result<StrategyConfig> {
    let rule = match a.rule.as_str() {
        "sum" => ApplyRule::Sum,
        "mean" => ApplyRule::Mean,
        "staleness" => ApplyRule::Staleness,
        r => return Err(gradwire::Error::InvalidArgument(format!("--rule {r}: sum, mean or staleness"))),
    };
    let daso = DasoConfig {
        warmup_epochs: a.warmup,
        cooldown_epochs: a.cooldown,
        epochs: a.epochs,
        wire: if a.bf16_wire { Wire::Bf16 } else { Wire::F32 },
        cap_phases: true,
        sending_chunk_size: a.chunk,
        ..Default::default()
    };
    Ok(StrategyConfig {
        strategy: a.strategy.clone(),
        lr: a.lr,
        momentum: a.momentum,
        interval: a.interval,
        node_interval: a.node_interval,
        topk: a.topk,
        daso,
        fetch: a.fetch,
        push: a.push,
        background: a.background,
        tau: a.tau,
        beta: a.beta,
        rule,
        caller_moves_data: false,
    })
}

/// "  replicas identical" when every rank's parameters are bit-identical, else how far
/// apart they are. Collective.
fn replica_state(comm: &Communicator, params: &[f32]) -> Result<String> {
    let fp = gradwire::check::reference::fingerprint(&params.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<u8>>());
    let mut all = vec![0f64; 2 * comm.size()];
    comm.allgather(&[(fp >> 32) as f64, (fp & 0xffff_ffff) as f64], &mut all)?;
    if all.chunks(2).all(|c| c == &all[..2]) {
        return Ok("  replicas identical".into());
    }
    let mut rank0 = params.to_vec();
    comm.broadcast(&mut rank0, 0)?;
    let mut apart = [rank0.iter().zip(params).map(|(a, b)| (a - b).abs() as f64).fold(0.0, f64::max)];
    comm.allreduce(&mut apart, ReduceOp::Max)?;
    Ok(format!("  replicas differ (max |rank 0 - rank r| {:.3e})", apart[0]))
}

/// Trains; returns whether `--require` (if given) was met.
pub fn run(comm: &Communicator, a: &TrainArgs) -> Result<bool> {
    let (w, me) = (comm.size(), comm.rank());
    let slow = parse_slow(&a.slow, w)?;
    let hidden: Vec<usize> = a
        .hidden
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().parse().map_err(|_| gradwire::Error::InvalidArgument(format!("--hidden {}: comma-separated widths", a.hidden))))
        .collect::<Result<_>>()?;
    let data = Dataset::by_name(&a.data)?;
    let mut model = Mlp::new(&data, &hidden);
    let mut params = model.init(a.seed);
    let mut grads = vec![0f32; params.len()];
    let cfg = strategy_config(a)?;
    let mut strategy = train::build(comm, &cfg, &params, params.len())?;
    // The local optimizer of the schemes that leave the local update to the framework.
    let mut local = train::Sgd::new(a.lr, a.momentum, false);
    strategy.start(&mut params)?;
    let label = a.label.clone().unwrap_or_else(|| a.strategy.clone());
    let mut csv = match (&a.csv, me) {
        (Some(path), 0) => {
            let mut f = std::fs::File::create(path).map_err(|e| gradwire::Error::InvalidArgument(format!("--csv {path}: {e}")))?;
            writeln!(f, "label,strategy,ranks,epoch,wall_s,train_loss,test_loss,test_acc,mb_sent_per_rank_mean,mb_sent_per_rank_max").ok();
            Some(f)
        }
        _ => None,
    };
    if me == 0 {
        println!(
            "# gradwire train: {} on {} ranks ({}), MLP {}-{}-{} ({} parameters), {} training examples, batch {} per rank",
            a.strategy,
            w,
            comm.link_kinds().iter().flatten().map(|t| t.name()).collect::<Vec<_>>().join("/"),
            data.features,
            a.hidden.replace(',', "-"),
            data.classes,
            params.len(),
            model.train_len(),
            a.batch
        );
    }
    let per_epoch = model.train_len().div_ceil(a.batch * w);
    if steps_per_epoch(model.train_len(), a.batch, w) == 0 {
        return Err(gradwire::Error::InvalidArgument(format!("{} training examples cannot feed {w} ranks (each needs at least one)", model.train_len())));
    }
    let mut wall = Duration::ZERO;
    // Passes over the training set this rank has drawn (shared-pool schemes).
    let mut passes = 0u64;
    let mut acc = 0.0;
    // Bytes the scheme counted in its steps, and payload bytes the transports sent then.
    let (mut counted, mut wire) = (0u64, 0u64);
    for epoch in 0..a.epochs {
        // The schedule this epoch runs with (DASO changes it at the epoch's end).
        let ran = strategy.describe();
        let t0 = Instant::now();
        let (mut loss_sum, mut batches) = (0f64, 0usize);
        let mut step = |model: &mut Mlp, strategy: &mut Box<dyn train::Strategy + Send + '_>, batch: &[usize], last: bool| -> Result<()> {
            let c0 = Instant::now();
            loss_sum += model.loss_and_grad(&params, batch, &mut grads) as f64;
            batches += 1;
            if slow[me] > 1.0 {
                std::thread::sleep(c0.elapsed().mul_f64(slow[me] - 1.0));
            }
            let (c0, w0) = (strategy.bytes_sent(), gradwire::transport::payload_bytes_sent());
            train::step(strategy.as_mut(), &mut local, &mut params, &mut grads, last)?;
            counted += strategy.bytes_sent() - c0;
            wire += gradwire::transport::payload_bytes_sent() - w0;
            Ok(())
        };
        if strategy.shared_pool() {
            // A pool shared by all ranks: this rank draws from its own shuffled stream of
            // the whole training set until the epoch's minibatches are all taken.
            let len = model.train_len();
            let mut pass = || {
                passes += 1;
                epoch_batches(len, a.batch, 0, 1, a.seed ^ (me as u64 + 1) << 32 ^ passes, epoch).into_iter()
            };
            let mut stream = pass();
            while strategy.claim_batch(per_epoch * w)? {
                let b = match stream.next() {
                    Some(b) => b,
                    None => {
                        stream = pass();
                        stream.next().unwrap_or_default()
                    }
                };
                step(&mut model, &mut strategy, &b, false)?;
            }
        } else {
            let mine = epoch_batches(model.train_len(), a.batch, me, w, a.seed, epoch);
            // Every rank takes the same number of steps (synchronous schemes need that).
            let n = steps_per_epoch(model.train_len(), a.batch, w);
            for (i, b) in mine.iter().take(n).enumerate() {
                step(&mut model, &mut strategy, b, i + 1 == n)?;
            }
        }
        let train_loss = strategy.end_epoch(&mut params, loss_sum / batches.max(1) as f64)?;
        wall += t0.elapsed();
        // Evaluation is not timed: it is the same for every strategy.
        let current = strategy.current_model(&params)?;
        let (test_loss, test_acc) = model.evaluate(&current);
        acc = test_acc;
        let mine = [strategy.bytes_sent() as f64 / 1e6];
        let (mut sent, mut max) = (mine, mine);
        comm.allreduce(&mut sent, ReduceOp::Avg)?;
        comm.allreduce(&mut max, ReduceOp::Max)?;
        let mut agreed = [test_acc];
        comm.broadcast(&mut agreed, 0)?;
        let replicas = if a.check_replicas { replica_state(comm, &params)? } else { String::new() };
        if me == 0 {
            println!(
                "epoch {:>3}/{}  train loss {train_loss:.4}  test loss {test_loss:.4}  test acc {:5.1} %  wall {:7.2} s  sent {:8.2} MB/rank{}{replicas}",
                epoch + 1,
                a.epochs,
                100.0 * test_acc,
                wall.as_secs_f64(),
                sent[0],
                ran
            );
            if let Some(f) = &mut csv {
                writeln!(
                    f,
                    "{label},{},{w},{},{:.4},{train_loss:.6},{test_loss:.6},{test_acc:.6},{:.3},{:.3}",
                    a.strategy,
                    epoch + 1,
                    wall.as_secs_f64(),
                    sent[0],
                    max[0]
                )
                .ok();
            }
        }
        if a.target.is_some_and(|t| agreed[0] >= t) {
            if me == 0 {
                println!("target accuracy {:.1} % reached after {:.2} s", 100.0 * a.target.unwrap_or(0.0), wall.as_secs_f64());
            }
            break;
        }
    }
    strategy.finish(&mut params)?;
    drop(csv);
    if a.check_bytes {
        let mut totals = [counted as f64, wire as f64];
        comm.allreduce(&mut totals, ReduceOp::Sum)?;
        if me == 0 {
            println!("bytes in steps (all ranks): counted by the scheme {}, sent by the transports {}", totals[0], totals[1]);
        }
    }
    if let (Some(path), 0) = (&a.save_params, me) {
        let bytes: Vec<u8> = params.iter().flat_map(|p| p.to_le_bytes()).collect();
        std::fs::write(path, bytes).map_err(|e| gradwire::Error::InvalidArgument(format!("--save-params {path}: {e}")))?;
    }
    if let (Some(svg), Some(path), 0) = (&a.plot, &a.csv, me) {
        crate::plot::draw(std::slice::from_ref(path), svg, "time")?;
    }
    Ok(a.require.is_none_or(|r| acc >= r))
}
