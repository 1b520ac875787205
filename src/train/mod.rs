//! Training drivers: the seven schemes of docs/algorithms.md behind one [`Strategy`] interface
//! that a framework drives step by step, a [`Model`] interface with a built-in multi-layer
//! perceptron, and the data it trains on.
//!
//! A framework's loop. ssgd, DASO and BSP leave the local update to the framework's own
//! optimizer (SGD with momentum, Adam, ...) and communicate around it: gradients before
//! it, parameters after it. The parameter-server schemes keep the servers' update rule as
//! their papers define it, inside `step`.
//!
//! ```text
//! strategy.start(&mut params)?;                 // agree on the initial parameters
//! for epoch { for batch {
//!     let loss = model.loss_and_grad(&params, batch, &mut grads);   // forward + backward
//!     if strategy.framework_update() {
//!         strategy.before_update(&mut grads, last_batch_of_epoch)?; // e.g. average gradients
//!         optimizer.step(&mut params, &grads);                      // the framework's own
//!         strategy.after_update(&mut params, last_batch_of_epoch)?; // e.g. merge parameters
//!     } else {
//!         strategy.step(&mut params, &grads, last_batch_of_epoch)?; // push, pull, apply
//!     }
//! }   strategy.end_epoch(&mut params, mean_loss)?; }
//! strategy.finish(&mut params)?;                // the final model on every rank
//! ```

pub mod bsp;
pub mod daso;
pub mod data;
pub mod model;
pub mod plan;
pub mod ps;
pub mod ssgd;

use crate::comm::Communicator;
use crate::error::{invalid, Result};

pub use data::Dataset;
pub use model::{Mlp, Model};

/// One training scheme: communication plus the parameter update, after backward.
pub trait Strategy {
    /// Short name, as on the command line.
    fn name(&self) -> &'static str;
    /// Before the first step: makes `params` the same on every rank (or fetches them from
    /// the servers). Collective.
    fn start(&mut self, params: &mut [f32]) -> Result<()>;
    /// Whether the local update is the framework's optimizer, run between
    /// [`Strategy::before_update`] and [`Strategy::after_update`] (ssgd, DASO, BSP); else
    /// the scheme's own rule runs in [`Strategy::step`] (the parameter-server schemes).
    fn framework_update(&self) -> bool {
        false
    }
    /// After backward, before the framework's optimizer step: the gradient communication.
    /// Leaves in `grads` what the optimizer steps on. `last_of_epoch` lets a strategy
    /// synchronise at the epoch's end (DASO does).
    fn before_update(&mut self, grads: &mut [f32], last_of_epoch: bool) -> Result<()> {
        let _ = (grads, last_of_epoch);
        Err(invalid(format!("{}: the update is the scheme's own (call step)", self.name())))
    }
    /// After the framework's optimizer step: the parameter communication. Leaves `params`
    /// ready for the next minibatch.
    fn after_update(&mut self, params: &mut [f32], last_of_epoch: bool) -> Result<()> {
        let _ = (params, last_of_epoch);
        Err(invalid(format!("{}: the update is the scheme's own (call step)", self.name())))
    }
    /// The parameter-server schemes' whole step, their update rule included: `grads` were
    /// computed at `params` on this rank's minibatch; leaves `params` updated for the next.
    fn step(&mut self, params: &mut [f32], grads: &[f32], last_of_epoch: bool) -> Result<()> {
        let _ = (params, grads, last_of_epoch);
        Err(invalid(format!("{}: the update is the framework's optimizer (call before_update and after_update)", self.name())))
    }
    /// Whether minibatches come from one pool per epoch shared by all ranks (asynchronous
    /// schemes: a fast worker does more of the epoch instead of waiting) rather than each
    /// rank's fixed 1/W share (the default; synchronous schemes need equal step counts).
    fn shared_pool(&self) -> bool {
        false
    }
    /// With a shared pool: whether this rank may take one more of the epoch's `total`
    /// minibatches.
    fn claim_batch(&mut self, total: usize) -> Result<bool> {
        let _ = total;
        Ok(true)
    }
    /// The model to evaluate (the agreed anchor, the servers' θ, the centre variable; by
    /// default this rank's parameters).
    fn current_model(&mut self, params: &[f32]) -> Result<Vec<f32>> {
        Ok(params.to_vec())
    }
    /// The strategy's state worth printing with the epoch's progress line.
    fn describe(&self) -> String {
        String::new()
    }
    /// The index of the epoch's last batch, where the framework knows it in advance (Heat's
    /// `last_batch`): DASO's schedule looks one batch ahead. Others ignore it.
    fn set_last_batch(&mut self, last_batch: usize) {
        let _ = last_batch;
    }
    /// At the end of an epoch, with this rank's mean training loss; returns the loss
    /// averaged over all ranks (DASO's plateau controller runs on it). Collective.
    fn end_epoch(&mut self, params: &mut [f32], loss: f64) -> Result<f64>;
    /// After the last epoch: leaves the final model in `params` on every rank. Collective.
    fn finish(&mut self, params: &mut [f32]) -> Result<()>;
    /// Bytes this rank has handed to the network for the scheme so far (payloads only).
    fn bytes_sent(&self) -> u64;
    /// Whether the caller moves the data (`data=caller`, [`plan`]): the calls then take no
    /// buffers and record [`plan::Action`]s for the caller to run.
    fn caller_moves_data(&self) -> bool {
        false
    }
    /// The actions recorded since the last take, in order (none unless the caller moves
    /// the data).
    fn take_actions(&mut self) -> Vec<plan::Action> {
        Vec::new()
    }
    /// Whether the next backward's gradients are averaged in the node (DASO's local sync,
    /// where DDP would also broadcast the model's buffers in the node).
    fn node_average_next(&self) -> bool {
        false
    }
}

/// Stochastic gradient descent with optional (Nesterov) momentum, PyTorch's formulation:
/// v ← μ·v + g; p ← p − lr·v (or, with Nesterov, p ← p − lr·(g + μ·v)).
#[derive(Clone, Debug)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f32,
    /// Momentum μ (0: plain SGD, no velocity kept).
    pub momentum: f32,
    /// Whether the step uses Nesterov's form.
    pub nesterov: bool,
    velocity: Vec<f32>,
}

impl Sgd {
    /// An optimizer with zero velocity (sized on the first step).
    pub fn new(lr: f32, momentum: f32, nesterov: bool) -> Self {
        Sgd { lr, momentum, nesterov, velocity: Vec::new() }
    }

    /// Updates `params` in place by one step on `grads` (the same length).
    pub fn step(&mut self, params: &mut [f32], grads: &[f32]) {
        if self.momentum == 0.0 {
            params.iter_mut().zip(grads).for_each(|(p, g)| *p -= self.lr * g);
            return;
        }
        if self.velocity.len() != params.len() {
            self.velocity = vec![0.0; params.len()];
        }
        let (lr, mu) = (self.lr, self.momentum);
        for ((p, g), v) in params.iter_mut().zip(grads).zip(&mut self.velocity) {
            *v = mu * *v + g;
            *p -= lr * if self.nesterov { g + mu * *v } else { *v };
        }
    }
}

/// Everything that selects and tunes a strategy (the command line's `gradwire train` flags).
#[derive(Clone, Debug)]
pub struct StrategyConfig {
    /// Scheme name, one of [`STRATEGIES`].
    pub strategy: String,
    /// Learning rate of the schemes' own update rule (ddcgu, cyclic, downpour, eamsgd).
    pub lr: f32,
    /// Momentum of the local optimizer `gradwire train` runs for the framework-update schemes;
    /// no strategy reads it (not an option of [`StrategyConfig::parse`]).
    pub momentum: f32,
    /// BSP: local steps between global reductions (K).
    pub interval: usize,
    /// BSP's hierarchical variant: steps between node-local reductions (K1; 0: flat).
    pub node_interval: usize,
    /// BSP: fraction of entries sent with top-k sparsification (with error feedback); 0 = dense.
    pub topk: f64,
    /// DASO knobs (docs/algorithms.md §1).
    pub daso: daso::DasoConfig,
    /// Downpour: pull every `fetch` steps, push every `push` steps.
    pub fetch: usize,
    /// Downpour: steps between pushes of the accumulated gradients.
    pub push: usize,
    /// Downpour: fetch and push on a thread of their own (Dean et al.'s form) instead of
    /// blocking the worker.
    pub background: bool,
    /// EAMSGD: exchange period τ and moving rate β (α = β / P).
    pub tau: usize,
    /// EAMSGD: moving rate β, in [0, 1].
    pub beta: f32,
    /// Parameter-server apply rule for ddcgu and cyclic.
    pub rule: crate::rma::ApplyRule,
    /// DASO and dense BSP: the caller moves the model's data (`data=caller`, [`plan`]).
    pub caller_moves_data: bool,
}

impl Default for StrategyConfig {
    fn default() -> Self {
        StrategyConfig {
            strategy: "ssgd".into(),
            lr: 0.05,
            momentum: 0.9,
            interval: 4,
            node_interval: 0,
            topk: 0.0,
            daso: daso::DasoConfig::default(),
            fetch: 1,
            push: 1,
            background: false,
            tau: 4,
            beta: 0.9,
            rule: crate::rma::ApplyRule::Mean,
            caller_moves_data: false,
        }
    }
}

impl StrategyConfig {
    /// `scheme` with `options` ("key=value,key=value"; empty: the defaults), as a framework
    /// hands them over the C ABI. Keys, per scheme: bsp: interval, node_interval, topk, data
    /// (gradwire, caller: [`plan`]; dense only);
    /// daso: warmup_epochs, cooldown_epochs, epochs, max_global_skips, stability_level,
    /// wire (f32, bf16, f16), sending_chunk_size, skip_reduction_factor, local_skip_factor,
    /// sync_average (heat, change), cap_phases, data (gradwire, caller: [`plan`]); ddcgu and cyclic: lr, rule (sum, mean or staleness);
    /// downpour: lr, fetch, push, background (true, false); eamsgd: lr, tau, beta; ssgd: none. ssgd, daso and bsp take
    /// no lr: the framework's own optimizer makes their local step. A key the scheme does
    /// not take, or a value out of range, is an error naming it.
    pub fn parse(scheme: &str, options: &str) -> Result<StrategyConfig> {
        let keys: &[&str] = match scheme {
            "ssgd" => &[],
            "bsp" => &["interval", "node_interval", "topk", "data"],
            "daso" => &[
                "warmup_epochs",
                "cooldown_epochs",
                "epochs",
                "max_global_skips",
                "stability_level",
                "wire",
                "sending_chunk_size",
                "skip_reduction_factor",
                "local_skip_factor",
                "sync_average",
                "cap_phases",
                "data",
            ],
            "ddcgu" | "cyclic" => &["lr", "rule"],
            "downpour" => &["lr", "fetch", "push", "background"],
            "eamsgd" => &["lr", "tau", "beta"],
            _ => return Err(invalid(format!("unknown strategy '{scheme}' (known: {})", STRATEGIES.join(", ")))),
        };
        let mut cfg = StrategyConfig { strategy: scheme.into(), ..Default::default() };
        let mut seen: Vec<&str> = vec![];
        for item in options.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item.split_once('=').ok_or_else(|| invalid(format!("option '{item}': expected key=value")))?;
            let (key, value) = (key.trim(), value.trim());
            // A second value for a key is a mistake or an injection ("rule=sum,lr=5" built
            // from one value): never the last one silently winning.
            if seen.contains(&key) {
                return Err(invalid(format!("option '{key}' is given twice in '{options}'")));
            }
            seen.push(key);
            let bad = |why: &str| invalid(format!("option {key}={value}: {why}"));
            let real = |lo: f64, hi: f64| -> Result<f64> {
                value.parse::<f64>().ok().filter(|v| v.is_finite() && (lo..=hi).contains(v)).ok_or_else(|| bad(&format!("expected a number in [{lo}, {hi}]")))
            };
            let count =
                |lo: usize| -> Result<usize> { value.parse::<usize>().ok().filter(|v| *v >= lo).ok_or_else(|| bad(&format!("expected an integer >= {lo}"))) };
            if !keys.contains(&key) {
                let takes = if keys.is_empty() { "none".to_string() } else { keys.join(", ") };
                let why = if key == "lr" || key == "momentum" { " (the framework's optimizer makes its local step)" } else { "" };
                return Err(invalid(format!("{scheme} takes no option '{key}'{why}; its options: {takes}")));
            }
            match key {
                "lr" => cfg.lr = real(f32::MIN_POSITIVE as f64, 1e6)? as f32,
                "interval" => cfg.interval = count(1)?,
                "node_interval" => cfg.node_interval = count(0)?,
                // Top-0 would send nothing: the whole change is sent by leaving topk out.
                "topk" if value.parse::<f64>() == Ok(0.0) => return Err(bad("expected a fraction in (0, 1]; leave topk out to send the whole change")),
                "topk" => cfg.topk = real(0.0, 1.0)?,
                "warmup_epochs" => cfg.daso.warmup_epochs = count(0)?,
                "cooldown_epochs" => cfg.daso.cooldown_epochs = count(0)?,
                "epochs" => cfg.daso.epochs = count(1)?,
                "max_global_skips" => cfg.daso.max_global_skips = count(0)?,
                "stability_level" => cfg.daso.stability_level = real(0.0, 1.0)?,
                "wire" => cfg.daso.wire = daso::Wire::parse(value).ok_or_else(|| bad("expected f32, bf16 or f16"))?,
                "sync_average" => {
                    cfg.daso.average_change = match value {
                        "heat" => false,
                        "change" => true,
                        _ => return Err(bad("expected heat or change")),
                    }
                }
                "data" => {
                    cfg.caller_moves_data = match value {
                        "gradwire" => false,
                        "caller" => true,
                        _ => return Err(bad("expected gradwire or caller")),
                    }
                }
                "cap_phases" => cfg.daso.cap_phases = value.parse().map_err(|_| bad("expected true or false"))?,
                "sending_chunk_size" => cfg.daso.sending_chunk_size = count(1)?,
                "skip_reduction_factor" => cfg.daso.skip_reduction_factor = count(1)?,
                "local_skip_factor" => cfg.daso.local_skip_factor = count(1)?,
                "fetch" => cfg.fetch = count(1)?,
                "push" => cfg.push = count(1)?,
                "background" => cfg.background = value.parse().map_err(|_| bad("expected true or false"))?,
                "tau" => cfg.tau = count(1)?,
                "beta" => cfg.beta = real(0.0, 1.0)? as f32,
                "rule" => {
                    cfg.rule = match value {
                        "sum" => crate::rma::ApplyRule::Sum,
                        "mean" => crate::rma::ApplyRule::Mean,
                        "staleness" => crate::rma::ApplyRule::Staleness,
                        _ => return Err(bad("expected sum, mean or staleness")),
                    }
                }
                other => return Err(invalid(format!("{scheme}: option '{other}' is listed but not handled (a gradwire bug)"))),
            }
        }
        Ok(cfg)
    }
}

/// The strategies by name, in the order of the papers' claims.
pub const STRATEGIES: [&str; 7] = ["ssgd", "daso", "bsp", "ddcgu", "cyclic", "downpour", "eamsgd"];

/// Builds the strategy `cfg.strategy` on `comm`, for a model of `len` parameters with
/// initial values `init` (the same on every rank: the parameter servers start from them;
/// empty where the caller moves the data). It refuses calls out of its life cycle
/// (`InOrder`).
pub fn build<'c>(comm: &'c Communicator, cfg: &StrategyConfig, init: &[f32], len: usize) -> Result<Box<dyn Strategy + Send + 'c>> {
    if !init.is_empty() && init.len() != len {
        return Err(invalid(format!("{}: {} initial values for a model of {len} parameters", cfg.strategy, init.len())));
    }
    let scheme: Box<dyn Strategy + Send + 'c> = match cfg.strategy.as_str() {
        "ssgd" => Box::new(ssgd::Ssgd::new(comm)),
        "bsp" => Box::new(bsp::Bsp::new(comm, cfg.interval, cfg.topk, cfg.node_interval, len, cfg.caller_moves_data)?),
        "daso" => Box::new(daso::Daso::new(comm, cfg.daso.clone(), len, cfg.caller_moves_data)?),
        "ddcgu" => Box::new(ps::TokenRing::new(comm, init, cfg.lr, cfg.rule, ps::Turn::DynamicDelay)?),
        "cyclic" => Box::new(ps::TokenRing::new(comm, init, cfg.lr, cfg.rule, ps::Turn::FixedCyclic)?),
        "downpour" => Box::new(ps::Downpour::new(comm, init, cfg.lr, cfg.fetch, cfg.push, cfg.background)?),
        "eamsgd" => Box::new(ps::Eamsgd::new(comm, init, Sgd::new(cfg.lr, 0.99, true), cfg.tau, cfg.beta)?),
        other => return Err(invalid(format!("unknown strategy '{other}' (known: {})", STRATEGIES.join(", ")))),
    };
    Ok(Box::new(InOrder { scheme, stage: Stage::Made }))
}

/// A strategy that refuses calls out of its life cycle: `start` once, then its steps, then
/// `finish` once; after that only `current_model` (the final model is what an evaluation
/// asks for) and the queries. A second start would reset the scheme's state under a running
/// training, and a step after finish would move parameters every rank took as final.
struct InOrder<'c> {
    scheme: Box<dyn Strategy + Send + 'c>,
    stage: Stage,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    Made,
    Started,
    Finished,
}

impl InOrder<'_> {
    /// Refuses `call` unless the scheme is in one of the `allowed` stages.
    fn expect(&self, allowed: &[Stage], call: &str) -> Result<()> {
        let name = self.scheme.name();
        match self.stage {
            s if allowed.contains(&s) => Ok(()),
            Stage::Made => Err(invalid(format!("{name}: {call} before start: call start first"))),
            Stage::Started => Err(invalid(format!("{name}: the strategy has already started (start runs once)"))),
            Stage::Finished => Err(invalid(format!("{name}: {call} after finish: the strategy has finished (make a new one to train again)"))),
        }
    }
}

impl Strategy for InOrder<'_> {
    fn name(&self) -> &'static str {
        self.scheme.name()
    }
    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        self.expect(&[Stage::Made], "start")?;
        self.scheme.start(params)?;
        self.stage = Stage::Started;
        Ok(())
    }
    fn framework_update(&self) -> bool {
        self.scheme.framework_update()
    }
    fn before_update(&mut self, grads: &mut [f32], last_of_epoch: bool) -> Result<()> {
        self.expect(&[Stage::Started], "before_update")?;
        self.scheme.before_update(grads, last_of_epoch)
    }
    fn after_update(&mut self, params: &mut [f32], last_of_epoch: bool) -> Result<()> {
        self.expect(&[Stage::Started], "after_update")?;
        self.scheme.after_update(params, last_of_epoch)
    }
    fn step(&mut self, params: &mut [f32], grads: &[f32], last_of_epoch: bool) -> Result<()> {
        self.expect(&[Stage::Started], "step")?;
        self.scheme.step(params, grads, last_of_epoch)
    }
    fn shared_pool(&self) -> bool {
        self.scheme.shared_pool()
    }
    fn claim_batch(&mut self, total: usize) -> Result<bool> {
        self.expect(&[Stage::Started], "claim_batch")?;
        self.scheme.claim_batch(total)
    }
    fn current_model(&mut self, params: &[f32]) -> Result<Vec<f32>> {
        self.expect(&[Stage::Started, Stage::Finished], "current_model")?;
        self.scheme.current_model(params)
    }
    fn describe(&self) -> String {
        self.scheme.describe()
    }
    fn set_last_batch(&mut self, last_batch: usize) {
        self.scheme.set_last_batch(last_batch)
    }
    fn end_epoch(&mut self, params: &mut [f32], loss: f64) -> Result<f64> {
        self.expect(&[Stage::Started], "end_epoch")?;
        self.scheme.end_epoch(params, loss)
    }
    fn finish(&mut self, params: &mut [f32]) -> Result<()> {
        self.expect(&[Stage::Started], "finish")?;
        self.scheme.finish(params)?;
        self.stage = Stage::Finished;
        Ok(())
    }
    fn bytes_sent(&self) -> u64 {
        self.scheme.bytes_sent()
    }
    fn caller_moves_data(&self) -> bool {
        self.scheme.caller_moves_data()
    }
    fn take_actions(&mut self) -> Vec<plan::Action> {
        self.scheme.take_actions()
    }
    fn node_average_next(&self) -> bool {
        self.scheme.node_average_next()
    }
}

/// One training step of any strategy: for the schemes whose local update is the
/// framework's, `before_update`, `local`'s step, `after_update`; else the scheme's `step`.
pub fn step(strategy: &mut dyn Strategy, local: &mut Sgd, params: &mut [f32], grads: &mut [f32], last_of_epoch: bool) -> Result<()> {
    if strategy.framework_update() {
        strategy.before_update(grads, last_of_epoch)?;
        local.step(params, grads);
        strategy.after_update(params, last_of_epoch)
    } else {
        strategy.step(params, grads, last_of_epoch)
    }
}

/// Payload bytes of `n` f32 values.
pub(crate) fn f32_bytes(n: usize) -> u64 {
    4 * n as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A built strategy refuses calls out of its life cycle (start twice, a step before
    /// start or after finish returned Ok before) and still hands out its final model.
    #[test]
    fn a_strategy_refuses_calls_out_of_its_life_cycle() {
        let env = crate::bootstrap::RankEnv {
            rank: 0,
            world: 1,
            local_rank: None,
            local_world: None,
            master_addr: "127.0.0.1".into(),
            master_port: 0,
            secret: String::new(),
            store_exists: false,
        };
        let comm = Communicator::with_env(env, crate::Config::from_env().unwrap()).unwrap();
        let mut p = vec![1f32; 8];
        let mut g = vec![0f32; 8];
        let mut s = build(&comm, &StrategyConfig::parse("bsp", "interval=2").unwrap(), &p, p.len()).unwrap();
        let refused = |r: Result<()>, want: &str| {
            let e = r.expect_err(want).to_string();
            assert!(e.contains(want), "{e}");
        };
        refused(s.before_update(&mut g, false), "before_update before start: call start first");
        refused(s.current_model(&p).map(drop), "current_model before start: call start first");
        s.start(&mut p).unwrap();
        refused(s.start(&mut p), "bsp: the strategy has already started");
        s.before_update(&mut g, false).unwrap();
        s.after_update(&mut p, false).unwrap();
        s.end_epoch(&mut p, 0.5).unwrap();
        s.finish(&mut p).unwrap();
        refused(s.before_update(&mut g, false), "before_update after finish: the strategy has finished");
        refused(s.after_update(&mut p, false), "after_update after finish: the strategy has finished");
        refused(s.step(&mut p, &g, false), "step after finish: the strategy has finished");
        refused(s.end_epoch(&mut p, 0.5).map(drop), "end_epoch after finish: the strategy has finished");
        refused(s.claim_batch(4).map(drop), "claim_batch after finish: the strategy has finished");
        refused(s.finish(&mut p), "finish after finish: the strategy has finished");
        refused(s.start(&mut p), "start after finish: the strategy has finished");
        assert_eq!(s.current_model(&p).unwrap(), p, "the final model stays readable");
    }

    #[test]
    fn options_parse_and_refuse_clearly() {
        let c = StrategyConfig::parse("bsp", "interval=8, topk=0.01").unwrap();
        assert_eq!((c.interval, c.topk), (8, 0.01));
        let e = StrategyConfig::parse("eamsgd", "lr=0.1,tau=16").unwrap();
        assert_eq!((e.lr, e.tau), (0.1, 16));
        let d = StrategyConfig::parse("daso", "epochs=20,warmup_epochs=2,wire=f16,sending_chunk_size=1000,sync_average=change").unwrap();
        assert_eq!((d.daso.epochs, d.daso.warmup_epochs, d.daso.wire, d.daso.sending_chunk_size), (20, 2, daso::Wire::F16, 1000));
        assert!(d.daso.average_change && !d.daso.cap_phases);
        assert_eq!(StrategyConfig::parse("ssgd", "").unwrap().strategy, "ssgd");
        for (scheme, options, want) in [
            ("sgdx", "", "unknown strategy 'sgdx'"),
            ("bsp", "interval=0", "option interval=0: expected an integer >= 1"),
            ("bsp", "topk=2", "option topk=2: expected a number in [0, 1]"),
            ("downpour", "lr=nan", "option lr=nan"),
            ("daso", "wire=f64", "expected f32, bf16 or f16"),
            ("daso", "cap_phases=yes", "expected true or false"),
            ("ddcgu", "rule=median", "expected sum, mean or staleness"),
            ("ssgd", "colour=blue", "ssgd takes no option 'colour'"),
            ("ssgd", "lr=0.1", "the framework's optimizer makes its local step"),
            ("bsp", "fetch=2", "bsp takes no option 'fetch'; its options: interval, node_interval, topk"),
            ("ssgd", "lr", "option 'lr': expected key=value"),
            ("bsp", "interval=2,interval=3", "option 'interval' is given twice"),
            ("ddcgu", "rule=sum,lr=5,lr=0.01", "option 'lr' is given twice"),
            ("bsp", "topk=0", "option topk=0: expected a fraction in (0, 1]"),
        ] {
            let e = StrategyConfig::parse(scheme, options).unwrap_err().to_string();
            assert!(e.contains(want), "{scheme} {options}: {e}");
        }
    }

    #[test]
    fn sgd_momentum_matches_hand_computed_steps() {
        let mut o = Sgd::new(0.1, 0.5, false);
        let mut p = vec![1.0f32];
        o.step(&mut p, &[2.0]); // v = 2, p = 1 - 0.2
        assert_eq!(p[0], 0.8);
        o.step(&mut p, &[2.0]); // v = 3, p = 0.8 - 0.3
        assert!((p[0] - 0.5).abs() < 1e-7);
        let mut n = Sgd::new(0.1, 0.5, true);
        let mut q = vec![1.0f32];
        n.step(&mut q, &[2.0]); // v = 2, p = 1 - 0.1 (2 + 1)
        assert!((q[0] - 0.7).abs() < 1e-7);
    }
}
