//! The parameter-server strategies, on the remote-memory layer ([`crate::rma`]): every rank
//! is a worker and serves one shard of the parameters.
//!
//! - `ddcgu` (docs/algorithms.md §3): workers never wait; whoever holds the token pushes all it
//!   accumulated since its last push (the dynamic delay), pulls θ and passes the token on.
//!   Of the knobs docs/algorithms.md lists, η_eff (sum, mean, staleness) and a holder with
//!   nothing accumulated (passes on) are implemented. Not implemented, deliberately: one
//!   token per shard (a worker would then push shard by shard at different times, each
//!   shard's θ mixing pushes of different rounds, and conservation would need a count per
//!   shard; the paper's scheme and claim are for one token), and push/pull overlapped with
//!   compute (the holder pushes, pulls and passes the token between two minibatches, a few
//!   hundred microseconds for these models, so nobody waits on it; overlap would need the
//!   pull to land in a second buffer swapped in at the next step).
//! - `cyclic`: the fixed cyclic delayed baseline; each worker contributes exactly one
//!   gradient per round, waiting for its turn.
//! - `downpour` (Dean et al. 2012, Algorithm 7.1): every gradient is applied locally and
//!   accumulated; pull θ every `fetch` steps, push the accumulation every `push` steps, no
//!   coordination at all. By default the pushes and pulls block the worker (a transfer
//!   costs tens of microseconds on shared memory against a step's compute); with
//!   `background` they run on a thread of their own as the paper runs them
//!   (`Transfers`), a fetched θ replacing the replica when it lands.
//! - `eamsgd` (Zhang et al. 2015): local Nesterov-momentum SGD; every τ steps an elastic
//!   exchange with the centre variable held by the servers.
//!
//! Asynchronous workers take minibatches from one pool per epoch ([`Strategy::claim_batch`])
//! so a fast worker processes more of them instead of waiting for a slow one.

use super::ssgd::mean_loss;
use super::{f32_bytes, Sgd, Strategy};
use crate::comm::Communicator;
use crate::error::Result;
use crate::mem::Region;
use crate::rma::{ApplyRule, RemoteMemory};
use crate::transport::onesided::Window;
use crossbeam_channel::{Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// One counter per epoch (rank 0's window), claimed with one-sided fetch-and-add.
struct BatchPool {
    win: Window,
    epoch: usize,
}

const POOL_EPOCHS: usize = 4096;

impl BatchPool {
    fn new(comm: &Communicator) -> Result<Self> {
        let win = comm.expose(Arc::new(Region::shared("gradwire-batch-pool", 8 * POOL_EPOCHS)?))?;
        Ok(BatchPool { win, epoch: 0 })
    }

    /// Whether one more of this epoch's `total` minibatches is ours to take.
    fn claim(&self, total: usize) -> Result<bool> {
        Ok(self.win.fetch_add(0, 8 * (self.epoch % POOL_EPOCHS), 1)? < total as u64)
    }

    /// Moves to the next epoch. Rank 0 clears the counter two epochs ahead, so the ring of
    /// counters can be reused past POOL_EPOCHS: nobody claims from it before every rank
    /// has passed the next epoch's end (a barrier rank 0 reaches only after this).
    fn advance(&mut self, me: usize) -> Result<()> {
        self.epoch += 1;
        if me == 0 {
            self.win.write(0, 8 * ((self.epoch + 1) % POOL_EPOCHS), &[0; 8])?;
        }
        Ok(())
    }
}

/// Waits (without blocking the token) until every rank has arrived, then agrees on the
/// mean loss. `serve` runs whenever there is nothing else to do.
fn gather_loss(comm: &Communicator, loss: f64, mut serve: impl FnMut() -> Result<()>) -> Result<f64> {
    let all_here = comm.ibarrier()?;
    while !all_here.test() {
        serve()?;
        std::thread::yield_now();
    }
    all_here.wait()?;
    mean_loss(comm, loss)
}

/// The remote memory, also where a transfer thread panicked holding it: that left nothing
/// half-done a later call relies on (every operation checks the shared words it reads).
fn lock(rm: &Mutex<RemoteMemory>) -> MutexGuard<'_, RemoteMemory> {
    rm.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What the parameter-server strategies share: the shards (every rank serves one, which
/// spreads the servers' work and memory evenly), the minibatch pool of the asynchronous
/// ones, and how a run ends.
struct Servers<'c> {
    comm: &'c Communicator,
    /// Shared with Downpour's transfer thread where it has one; uncontended otherwise.
    rm: Arc<Mutex<RemoteMemory>>,
    pool: Option<BatchPool>,
    len: usize,
}

impl<'c> Servers<'c> {
    fn new(comm: &'c Communicator, init: &[f32], rule: ApplyRule, lr: f32, pooled: bool) -> Result<Self> {
        let rm = RemoteMemory::new(comm, &(0..comm.size()).collect::<Vec<_>>(), init, rule, lr)?;
        let pool = if pooled { Some(BatchPool::new(comm)?) } else { None };
        Ok(Servers { comm, rm: Arc::new(Mutex::new(rm)), pool, len: init.len() })
    }

    /// The shards and token ring. Hold the guard for one operation: the mutex is not
    /// reentrant.
    fn rm(&self) -> MutexGuard<'_, RemoteMemory> {
        lock(&self.rm)
    }

    fn claim(&self, total: usize) -> Result<bool> {
        self.pool.as_ref().map_or(Ok(true), |p| p.claim(total))
    }

    /// The servers' parameters, read fresh.
    fn theta(&mut self) -> Result<Vec<f32>> {
        let mut theta = vec![0f32; self.len];
        self.rm().pull(&mut theta)?;
        Ok(theta)
    }

    fn next_epoch(&mut self) -> Result<()> {
        match &mut self.pool {
            Some(p) => p.advance(self.comm.rank()),
            None => Ok(()),
        }
    }

    /// The epoch's end for the strategies with nothing else to settle: the mean loss.
    fn end_epoch(&mut self, loss: f64) -> Result<f64> {
        self.next_epoch()?;
        gather_loss(self.comm, loss, || Ok(()))
    }

    /// Once every push is applied, every rank reads the final θ. Collective.
    fn final_model(&mut self, params: &mut [f32]) -> Result<()> {
        self.rm().flush()?;
        self.comm.barrier()?;
        self.rm().pull(params)?;
        self.comm.barrier()
    }
}

/// The `Strategy` methods every shard-served strategy answers alike, from its `ps`: the
/// minibatch pool decides who trains on what, and the model is the servers' θ.
macro_rules! served_by_shards {
    () => {
        fn shared_pool(&self) -> bool {
            self.ps.pool.is_some()
        }

        fn claim_batch(&mut self, total: usize) -> Result<bool> {
            self.ps.claim(total)
        }

        fn current_model(&mut self, _params: &[f32]) -> Result<Vec<f32>> {
            self.ps.theta()
        }
    };
}

/// How a worker's turn with the token is scheduled.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Turn {
    /// Push whatever has accumulated whenever the token is here; never wait for it.
    DynamicDelay,
    /// Wait for the token after every minibatch; push exactly that gradient.
    FixedCyclic,
}

/// The `ddcgu` ([`Turn::DynamicDelay`]) and `cyclic` ([`Turn::FixedCyclic`]) strategies:
/// one token circulates among the workers, and its holder pushes to the servers and pulls θ.
pub struct TokenRing<'c> {
    ps: Servers<'c>,
    turn: Turn,
    acc: Vec<f32>,
    count: u64,
    sent: u64,
    /// Pushes made so far (for the report).
    pub pushes: u64,
}

impl<'c> TokenRing<'c> {
    /// Every rank serves a shard of `init` (the same on every rank), applying pushes by `rule`
    /// with step `lr`; with `DynamicDelay` minibatches come from a shared pool. Collective.
    pub fn new(comm: &'c Communicator, init: &[f32], lr: f32, rule: ApplyRule, turn: Turn) -> Result<Self> {
        let ps = Servers::new(comm, init, rule, lr, turn == Turn::DynamicDelay)?;
        Ok(TokenRing { ps, turn, acc: vec![0.0; init.len()], count: 0, sent: 0, pushes: 0 })
    }

    /// The token is here: push what accumulated (if anything), pull θ, pass the token.
    fn take_turn(&mut self, params: &mut [f32]) -> Result<()> {
        let mut rm = self.ps.rm();
        rm.take_token()?;
        if self.count > 0 {
            rm.push(&self.acc, self.count)?;
            self.sent += f32_bytes(self.acc.len());
            self.pushes += 1;
            self.acc.fill(0.0);
            self.count = 0;
        }
        rm.pull(params)?;
        rm.pass_token()
    }

    /// Keeps the token moving (pushing what is left) while waiting for the other ranks.
    fn settle(&mut self, params: &mut [f32], loss: f64) -> Result<f64> {
        let comm = self.ps.comm;
        gather_loss(comm, loss, || {
            let here = self.ps.rm().poll_token()?;
            if here {
                self.take_turn(params)
            } else {
                Ok(())
            }
        })
    }
}

impl Strategy for TokenRing<'_> {
    fn name(&self) -> &'static str {
        match self.turn {
            Turn::DynamicDelay => "ddcgu",
            Turn::FixedCyclic => "cyclic",
        }
    }

    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        self.ps.rm().pull(params)
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], _last_of_epoch: bool) -> Result<()> {
        self.acc.iter_mut().zip(grads).for_each(|(a, g)| *a += g);
        self.count += 1;
        match self.turn {
            Turn::DynamicDelay => {
                let here = self.ps.rm().poll_token()?;
                if here {
                    self.take_turn(params)
                } else {
                    Ok(())
                }
            }
            Turn::FixedCyclic => {
                self.ps.rm().wait_token()?;
                self.take_turn(params)
            }
        }
    }

    served_by_shards!();

    fn describe(&self) -> String {
        format!("  [{} pushes]", self.pushes)
    }

    fn end_epoch(&mut self, params: &mut [f32], loss: f64) -> Result<f64> {
        let loss = self.settle(params, loss)?;
        self.ps.next_epoch()?;
        Ok(loss)
    }

    fn finish(&mut self, params: &mut [f32]) -> Result<()> {
        // Push the remainder on the token's next visits, then everyone reads the final θ.
        while self.count > 0 {
            self.ps.rm().wait_token()?;
            self.take_turn(params)?;
        }
        self.settle(params, 0.0)?;
        self.ps.final_model(params)
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

/// The `downpour` strategy (see the module docs).
pub struct Downpour<'c> {
    ps: Servers<'c>,
    /// The local step's learning rate (the servers apply the pushes with the same).
    lr: f32,
    fetch: usize,
    push: usize,
    acc: Vec<f32>,
    steps: usize,
    sent: u64,
    /// The fetches and pushes on a thread of their own (`background=true`).
    transfers: Option<Transfers>,
}

impl<'c> Downpour<'c> {
    /// Shards start at `init` and apply each push as θ −= `lr`·a; pulls every `fetch` steps,
    /// pushes every `push` (0 counts as 1); with `background` the pulls and pushes run on a
    /// thread of their own, as Dean et al. run them. Collective.
    pub fn new(comm: &'c Communicator, init: &[f32], lr: f32, fetch: usize, push: usize, background: bool) -> Result<Self> {
        let ps = Servers::new(comm, init, ApplyRule::Sum, lr, true)?;
        let transfers = if background { Some(Transfers::start(ps.rm.clone(), init.len())?) } else { None };
        Ok(Downpour { ps, lr, fetch: fetch.max(1), push: push.max(1), acc: vec![0.0; init.len()], steps: 0, sent: 0, transfers })
    }
}

impl Strategy for Downpour<'_> {
    fn name(&self) -> &'static str {
        "downpour"
    }

    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        self.ps.rm().pull(params)
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], _last_of_epoch: bool) -> Result<()> {
        // Algorithm 7.1 of Dean et al.: the gradient is applied locally as well as
        // accumulated for the next push, so the replica moves between fetches.
        self.acc.iter_mut().zip(grads).for_each(|(a, g)| *a += g);
        params.iter_mut().zip(grads).for_each(|(p, g)| *p -= self.lr * g);
        self.steps += 1;
        let (push_now, fetch_now) = (self.steps % self.push == 0, self.steps % self.fetch == 0);
        match &mut self.transfers {
            None => {
                if push_now {
                    self.ps.rm().push(&self.acc, self.push as u64)?;
                    self.sent += f32_bytes(self.acc.len());
                    self.acc.fill(0.0);
                }
                if fetch_now {
                    self.ps.rm().pull(params)?;
                }
            }
            Some(t) => {
                if push_now {
                    t.push(&mut self.acc, self.push as u64)?;
                    self.sent += f32_bytes(self.acc.len());
                }
                if fetch_now {
                    t.fetch()?;
                }
                // A fetch that has landed replaces the replica before the next minibatch
                // (what the replica learnt since is in the accumulation, pushed later).
                t.land(params)?;
            }
        }
        Ok(())
    }

    served_by_shards!();

    fn end_epoch(&mut self, _params: &mut [f32], loss: f64) -> Result<f64> {
        self.ps.end_epoch(loss)
    }

    fn finish(&mut self, params: &mut [f32]) -> Result<()> {
        if let Some(t) = self.transfers.take() {
            t.finish()?;
        }
        if self.steps % self.push != 0 {
            self.ps.rm().push(&self.acc, (self.steps % self.push) as u64)?;
            self.sent += f32_bytes(self.acc.len());
            self.acc.fill(0.0);
        }
        self.ps.final_model(params)
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

/// One transfer for Downpour's thread: a push (the accumulation, its minibatch count) or
/// a fetch into the buffer given.
enum Transfer {
    Push(Vec<f32>, u64),
    Fetch(Vec<f32>),
}

/// Downpour's fetches and pushes in the background: the worker hands each over and goes
/// on computing; a fetched θ lands whenever the servers have answered. One thread runs
/// them in the order handed over. At most one fetch is in
/// flight (a fetch due meanwhile is skipped, as a busy fetching thread would skip it) and
/// at most two pushes wait (the worker then waits for the thread: memory stays bounded and
/// no gradient is dropped). Every transfer keeps the shards' deadline; the first error
/// stops the thread and is returned by the worker's next call.
struct Transfers {
    jobs: Option<Sender<Transfer>>,
    /// Fetched θ, or the error that stopped the thread.
    landed: Receiver<Result<Vec<f32>>>,
    /// Push buffers back from the thread, zeroed, for the next accumulation.
    spare: Receiver<Vec<f32>>,
    /// The buffer the next fetch lands in (with the thread while a fetch is in flight).
    fetch_buf: Option<Vec<f32>>,
    thread: Option<JoinHandle<()>>,
}

impl Transfers {
    fn start(rm: Arc<Mutex<RemoteMemory>>, len: usize) -> Result<Self> {
        let (jobs, todo) = crossbeam_channel::bounded::<Transfer>(1);
        let (landed_tx, landed) = crossbeam_channel::unbounded();
        let (spare_tx, spare) = crossbeam_channel::unbounded();
        let thread = std::thread::Builder::new()
            .name("gradwire-downpour".into())
            .spawn(move || {
                for job in todo {
                    let failed = match job {
                        Transfer::Push(mut acc, count) => {
                            let r = lock(&rm).push(&acc, count);
                            acc.fill(0.0);
                            let _ = spare_tx.send(acc);
                            r.err()
                        }
                        Transfer::Fetch(mut theta) => match lock(&rm).pull(&mut theta) {
                            Ok(()) => {
                                let _ = landed_tx.send(Ok(theta));
                                None
                            }
                            Err(e) => Some(e),
                        },
                    };
                    if let Some(e) = failed {
                        let _ = landed_tx.send(Err(e));
                        return;
                    }
                }
            })
            .map_err(|e| crate::error::invalid(format!("downpour: cannot start its transfer thread: {e}")))?;
        Ok(Transfers { jobs: Some(jobs), landed, spare, fetch_buf: Some(vec![0.0; len]), thread: Some(thread) })
    }

    /// Hands the accumulation `acc` over to be pushed; `acc` is left zeroed.
    fn push(&mut self, acc: &mut Vec<f32>, count: u64) -> Result<()> {
        let next = self.spare.try_recv().unwrap_or_else(|_| vec![0.0; acc.len()]);
        let full = std::mem::replace(acc, next);
        self.send(Transfer::Push(full, count))
    }

    /// Starts a fetch unless one is in flight.
    fn fetch(&mut self) -> Result<()> {
        match self.fetch_buf.take() {
            Some(buf) => self.send(Transfer::Fetch(buf)),
            None => Ok(()),
        }
    }

    fn send(&mut self, t: Transfer) -> Result<()> {
        let jobs = self.jobs.as_ref().expect("Downpour's transfers are used after finish");
        if jobs.send(t).is_err() {
            // The thread has stopped: its error says why.
            return self.land(&mut []).and(Err(stopped()));
        }
        Ok(())
    }

    /// Copies a fetched θ that has landed into `params`; returns the thread's error if it
    /// stopped.
    fn land(&mut self, params: &mut [f32]) -> Result<()> {
        loop {
            match self.landed.try_recv() {
                Ok(Ok(theta)) => {
                    if !params.is_empty() {
                        params.copy_from_slice(&theta);
                    }
                    self.fetch_buf = Some(theta);
                }
                Ok(Err(e)) => return Err(e),
                Err(crossbeam_channel::TryRecvError::Empty) => return Ok(()),
                Err(crossbeam_channel::TryRecvError::Disconnected) => return Err(stopped()),
            }
        }
    }

    /// Waits until every transfer handed over is done (a fetch still landing is dropped:
    /// the final model is read from the servers).
    fn finish(mut self) -> Result<()> {
        if !self.close() {
            return Err(stopped());
        }
        self.landed.try_iter().try_for_each(|r| r.map(drop))
    }

    /// Closes the queue and waits for the thread to take what is in it; false if it panicked.
    fn close(&mut self) -> bool {
        drop(self.jobs.take());
        self.thread.take().is_none_or(|t| t.join().is_ok())
    }
}

impl Drop for Transfers {
    fn drop(&mut self) {
        self.close();
    }
}

fn stopped() -> crate::error::Error {
    crate::error::invalid("downpour: its transfer thread stopped without saying why (a gradwire bug)")
}

/// The elastic exchange of EASGD: with d = x − x̃, the worker moves to x − α·d and the
/// centre to x̃ + α·d. Returns what to push to the servers, which apply θ −= push.
pub fn elastic(x: &mut [f32], centre: &[f32], alpha: f32) -> Vec<f32> {
    x.iter_mut()
        .zip(centre)
        .map(|(x, c)| {
            let d = alpha * (*x - c);
            *x -= d;
            -d
        })
        .collect()
}

/// The `eamsgd` strategy: local SGD with an elastic exchange against the servers' centre
/// variable every τ steps (see the module docs).
pub struct Eamsgd<'c> {
    ps: Servers<'c>,
    opt: Sgd,
    tau: usize,
    alpha: f32,
    centre: Vec<f32>,
    steps: usize,
    sent: u64,
}

impl<'c> Eamsgd<'c> {
    /// `opt` is the local optimizer (Nesterov momentum 0.99 in the paper); α = β / P.
    pub fn new(comm: &'c Communicator, init: &[f32], opt: Sgd, tau: usize, beta: f32) -> Result<Self> {
        let ps = Servers::new(comm, init, ApplyRule::Sum, 1.0, true)?;
        let alpha = beta / comm.size() as f32;
        Ok(Eamsgd { ps, opt, tau: tau.max(1), alpha, centre: vec![0.0; init.len()], steps: 0, sent: 0 })
    }
}

impl Strategy for Eamsgd<'_> {
    fn name(&self) -> &'static str {
        "eamsgd"
    }

    fn start(&mut self, params: &mut [f32]) -> Result<()> {
        self.ps.rm().pull(params)
    }

    fn step(&mut self, params: &mut [f32], grads: &[f32], _last_of_epoch: bool) -> Result<()> {
        self.opt.step(params, grads);
        self.steps += 1;
        if self.steps % self.tau == 0 {
            self.ps.rm().pull(&mut self.centre)?;
            let push = elastic(params, &self.centre, self.alpha);
            self.ps.rm().push(&push, 1)?;
            self.sent += f32_bytes(push.len());
        }
        Ok(())
    }

    // The model is the centre variable, which the shards hold.
    served_by_shards!();

    fn end_epoch(&mut self, _params: &mut [f32], loss: f64) -> Result<f64> {
        self.ps.end_epoch(loss)
    }

    fn finish(&mut self, params: &mut [f32]) -> Result<()> {
        self.ps.final_model(params)
    }

    fn bytes_sent(&self) -> u64 {
        self.sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elastic_update_moves_both_by_alpha_d() {
        let mut x = vec![1.0f32, -2.0, 0.5];
        let centre = [0.0f32, 2.0, 0.5];
        let push = elastic(&mut x, &centre, 0.25);
        // d = (1, -4, 0): x -= 0.25 d; the centre (θ −= push) moves by +0.25 d.
        assert_eq!(x, vec![0.75, -1.0, 0.5]);
        let new_centre: Vec<f32> = centre.iter().zip(&push).map(|(c, p)| c - p).collect();
        assert_eq!(new_centre, vec![0.25, 1.0, 0.5]);
        // The pair's sum is conserved: the exchange only moves them towards each other.
        assert_eq!(x.iter().zip(&new_centre).map(|(a, b)| a + b).collect::<Vec<_>>(), vec![1.0, 0.0, 1.0]);
    }
}
