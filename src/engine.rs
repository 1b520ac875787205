//! Engine layer: one progress thread per communicator runs submitted operations in order,
//! each under its own deadline; `Work` handles wait for them; abort fails the running
//! operation and everything queued behind it, and wakes every waiter.
//!
//! A blocking call with nothing queued runs on the caller's thread instead (under the same
//! state lock the progress thread takes), which saves two thread hand-offs — most of the
//! latency of a small collective. So does the waiter of a non-blocking operation that is
//! the only one outstanding and not yet started: it takes the job back from the queue and
//! runs it itself (a framework that starts every collective non-blocking and waits at once,
//! as torch.distributed does, pays no hand-off). Order is still the order in which
//! operations take the lock, and sequence numbers are assigned then, at execution.

use crate::error::{Error, Result};
use crate::transport::shm::ShmDomain;
use crate::transport::Links;
use crossbeam_channel::{Receiver, Sender};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What a running operation may use: the links and the one-host shared segments (whose
/// abort flags the engine sets when it fails).
pub struct EngineState {
    pub rank: usize,
    pub world: usize,
    pub links: Links,
    pub shm: Option<Arc<ShmDomain>>,
    pub abort: Arc<AtomicBool>,
    failed: Option<String>,
    /// Collectives executed so far: the sequence number in every message header.
    seq: u64,
    /// Global rank of each rank of this communicator (errors name global ranks).
    global: Vec<usize>,
    /// This engine's entry in the sibling registry.
    id: u64,
    /// The rendezvous store and this communicator's key prefix: where a failing rank leaves
    /// its reason, so a peer that only sees a closed connection can name the root cause.
    store: Option<(Arc<crate::bootstrap::StoreClient>, String)>,
}

/// Every live communicator of this process, so that one that fails can abort its siblings
/// with the same reason: a rank that dies of an error in one group (say the cross-node
/// one) must not look like an unexplained exit to its peers in another (the node group).
#[derive(Clone)]
struct Sibling {
    id: u64,
    state: Weak<Mutex<EngineState>>,
    shm: Option<Arc<ShmDomain>>,
    abort: Arc<AtomicBool>,
}

fn siblings() -> std::sync::MutexGuard<'static, Vec<Sibling>> {
    static SIBLINGS: OnceLock<Mutex<Vec<Sibling>>> = OnceLock::new();
    SIBLINGS.get_or_init(Mutex::default).lock().unwrap_or_else(|p| p.into_inner())
}

/// Aborts every other communicator of this process with `reason`: directly when it is
/// idle (abort frames to its tcp peers, the reason in its shared-memory page), else
/// through its shared-memory page and abort flag (its running operation then fails).
fn abort_siblings(except: u64, reason: &str) {
    let others: Vec<Sibling> = siblings().iter().filter(|s| s.id != except).cloned().collect();
    let reason = format!("another communicator of this process failed: {reason}");
    for Sibling { state, shm, abort, .. } in others {
        if let Some(shm) = shm {
            shm.set_aborted(&reason);
        }
        if let Some(state) = state.upgrade() {
            if let Ok(mut st) = state.try_lock() {
                if st.failed.is_none() {
                    st.fail_here(reason.clone());
                }
                continue;
            }
        }
        abort.store(true, Ordering::Release);
    }
}

/// An operation for the progress thread. Receives the state and its deadline.
pub type Job = Box<dyn FnOnce(&mut EngineState, Instant) -> Result<()> + Send>;

#[derive(Default)]
struct Status {
    result: Option<Result<()>>,
    started: Option<Instant>,
}

struct WorkShared {
    status: Mutex<Status>,
    cv: Condvar,
    /// The operation until someone runs it: the progress thread, or the waiter (see
    /// `Work::run_here`). Taken only under the state lock, so exactly one runs it.
    job: Mutex<Option<Job>>,
}

impl WorkShared {
    fn finish(&self, r: Result<()>) {
        let mut st = self.status.lock().unwrap_or_else(|p| p.into_inner());
        st.result = Some(r);
        self.cv.notify_all();
    }
}

/// Handle of a submitted operation.
pub struct Work {
    shared: Arc<WorkShared>,
    abort: Arc<AtomicBool>,
    timeout: Duration,
    what: String,
    /// The engine's state and count of unfinished operations, for running the job here.
    engine: Option<(Weak<Mutex<EngineState>>, Arc<AtomicUsize>)>,
}

impl Work {
    /// Whether the operation has finished (successfully or not).
    pub fn test(&self) -> bool {
        self.shared.status.lock().unwrap_or_else(|p| p.into_inner()).result.is_some()
    }

    /// Waits up to `timeout`. `Ok(true)`: done; `Ok(false)`: still running (the handle stays
    /// valid); `Err`: the operation failed.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<bool> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.status.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = st.result.take() {
                // Keep "done" observable for test() after the result is taken.
                st.result = Some(Ok(()));
                return r.map(|_| true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            st = self.shared.cv.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Runs the operation on this thread if it is the only unfinished one and the progress
    /// thread has not taken it: no earlier operation can then be pending, so order holds.
    fn run_here(&self) {
        let Some((state, queued)) = &self.engine else { return };
        if queued.load(Ordering::Acquire) != 1 {
            return;
        }
        let Some(state) = state.upgrade() else { return };
        let mut st = state.lock().unwrap_or_else(|p| p.into_inner());
        let Some(job) = self.shared.job.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
        self.shared.status.lock().unwrap_or_else(|p| p.into_inner()).started = Some(Instant::now());
        let r = st.run(job, self.timeout);
        drop(st);
        queued.fetch_sub(1, Ordering::AcqRel);
        self.shared.finish(r);
    }

    /// Waits for completion. Operations enforce their own deadline; as a backstop, one that
    /// overruns it by 5 s gets the communicator aborted, which ends it promptly. Returns
    /// only once the engine no longer touches the operation's buffers.
    pub fn wait(mut self) -> Result<()> {
        self.run_here();
        loop {
            if self.wait_timeout(Duration::from_millis(200))? {
                return Ok(());
            }
            let started = self.shared.status.lock().unwrap_or_else(|p| p.into_inner()).started;
            if let Some(t) = started {
                if t.elapsed() > self.timeout + Duration::from_secs(5) && !self.abort.load(Ordering::Acquire) {
                    log::error!("{} overran its deadline; aborting the communicator", self.what);
                    self.abort.store(true, Ordering::Release);
                }
            }
        }
    }
}

/// The progress thread and its queue.
pub struct Engine {
    tx: Option<Sender<Arc<WorkShared>>>,
    thread: Option<JoinHandle<()>>,
    state: Arc<Mutex<EngineState>>,
    /// Operations submitted to the queue and not finished yet.
    queued: Arc<AtomicUsize>,
    pub abort: Arc<AtomicBool>,
    timeout: Duration,
}

impl Engine {
    pub fn start(state: EngineState, timeout: Duration, name: String) -> Result<Self> {
        let (tx, rx): (Sender<Arc<WorkShared>>, Receiver<_>) = crossbeam_channel::unbounded();
        let abort = state.abort.clone();
        let (id, shm) = (state.id, state.shm.clone());
        let state = Arc::new(Mutex::new(state));
        siblings().push(Sibling { id, state: Arc::downgrade(&state), shm, abort: abort.clone() });
        let queued = Arc::new(AtomicUsize::new(0));
        let (st, q) = (state.clone(), queued.clone());
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for shared in rx.iter() {
                    let mut state = st.lock().unwrap_or_else(|p| p.into_inner());
                    // None: its waiter ran it already.
                    let Some(job) = shared.job.lock().unwrap_or_else(|p| p.into_inner()).take() else { continue };
                    shared.status.lock().unwrap_or_else(|p| p.into_inner()).started = Some(Instant::now());
                    let r = state.run(job, timeout);
                    drop(state);
                    q.fetch_sub(1, Ordering::AcqRel);
                    shared.finish(r);
                }
            })
            .map_err(|e| Error::io("spawn progress thread", e))?;
        Ok(Engine { tx: Some(tx), thread: Some(thread), state, queued, abort, timeout })
    }

    /// Queues `job`; `what` names it for messages.
    pub fn submit(&self, what: String, job: Job) -> Work {
        let shared = Arc::new(WorkShared { status: Mutex::new(Status::default()), cv: Condvar::new(), job: Mutex::new(Some(job)) });
        let engine = Some((Arc::downgrade(&self.state), self.queued.clone()));
        let work = Work { shared: shared.clone(), abort: self.abort.clone(), timeout: self.timeout, what, engine };
        self.queued.fetch_add(1, Ordering::AcqRel);
        match &self.tx {
            Some(tx) if tx.send(shared.clone()).is_ok() => {}
            _ => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                drop(shared.job.lock().unwrap_or_else(|p| p.into_inner()).take());
                shared.finish(Err(Error::Aborted { rank: 0, peer: 0, reason: "communicator is shut down".into() }))
            }
        }
        work
    }

    /// Runs `job` to completion: on this thread when nothing is queued ahead of it (no
    /// hand-off to the progress thread), else behind the queued operations. `what` names it
    /// only if it has to be queued: formatting a name costs a small collective about 5 %.
    pub fn run_blocking(&self, what: impl FnOnce() -> String, job: Job) -> Result<()> {
        {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if self.queued.load(Ordering::Acquire) == 0 {
                return state.run(job, self.timeout);
            }
        }
        self.submit(what(), job).wait()
    }
}

impl EngineState {
    pub fn new(rank: usize, world: usize, links: Links, shm: Option<Arc<ShmDomain>>, abort: Arc<AtomicBool>, global: Vec<usize>) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        EngineState { rank, world, links, shm, abort, failed: None, seq: 0, global, id, store: None }
    }

    /// Lets failures be explained through the rendezvous store (see `store`).
    pub fn with_store(mut self, store: Option<Arc<crate::bootstrap::StoreClient>>, prefix: &str) -> Self {
        self.store = store.map(|s| (s, prefix.to_string()));
        self
    }

    fn reason_key(&self, prefix: &str, local: usize) -> String {
        crate::bootstrap::store::failure_key(prefix, self.global.get(local).copied().unwrap_or(local))
    }

    /// For a lost peer, the reason it left in the store when it failed first, if any.
    fn reason_of(&self, e: Error) -> Error {
        let Error::PeerLost { rank, peer, op, cause } = e else { return e };
        let Some((store, prefix)) = &self.store else { return Error::PeerLost { rank, peer, op, cause } };
        let local = self.global.iter().position(|&g| g == peer).unwrap_or(peer);
        let found = store.get(&self.reason_key(prefix, local), Instant::now() + Duration::from_millis(300)).ok().flatten();
        let cause = match found {
            Some(why) => format!("{cause}; it had failed first: {}", String::from_utf8_lossy(&why)),
            None => cause,
        };
        Error::PeerLost { rank, peer, op, cause }
    }

    /// The next collective's sequence number.
    pub fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq - 1
    }

    fn run(&mut self, job: Job, timeout: Duration) -> Result<()> {
        if let Some(why) = &self.failed {
            return Err(Error::Aborted { rank: self.rank, peer: self.rank, reason: format!("communicator unusable after an earlier error: {why}") });
        }
        if self.abort.load(Ordering::Acquire) {
            self.fail("aborted by the application".into());
            return Err(Error::Aborted { rank: self.rank, peer: self.rank, reason: "aborted by the application".into() });
        }
        let deadline = Instant::now() + timeout;
        // A panic is a bug; caught here it fails this communicator like any error (its peers
        // learn why) instead of killing the progress thread and leaving waiters hanging.
        let r = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(self, deadline))) {
            Ok(r) => r.map_err(|e| self.reason_of(e.with_global_ranks(&self.global))),
            Err(panic) => {
                let rank = self.global.get(self.rank).copied().unwrap_or(self.rank);
                Err(Error::Internal(format!("rank {rank}: {}", crate::error::panic_message(&*panic))))
            }
        };
        if let Err(e) = &r {
            self.fail(e.to_string());
        }
        r
    }

    /// Marks the communicator failed, tells every peer why (so that they fail with our
    /// reason instead of waiting for their deadline), and aborts the process's other
    /// communicators with the same reason.
    fn fail(&mut self, reason: String) {
        self.fail_here(reason.clone());
        abort_siblings(self.id, &reason);
    }

    fn fail_here(&mut self, reason: String) {
        if let Some((store, prefix)) = &self.store {
            let _ = store.set_within(&self.reason_key(prefix, self.rank), reason.as_bytes(), Duration::from_secs(1));
        }
        log::debug!("rank {}: aborting communicator: {reason}", self.rank);
        self.links.abort_all(&reason);
        if let Some(shm) = &self.shm {
            shm.set_aborted(&reason);
        }
        self.abort.store(true, Ordering::Release);
        self.failed = Some(reason);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let me = Arc::as_ptr(&self.state) as usize;
        siblings().retain(|s| s.state.as_ptr() as usize != me && s.state.strong_count() > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A job that panics (a bug) fails its work, and every later one, with an internal
    /// error naming the rank, on the progress thread and on the caller's: nothing hangs.
    #[test]
    fn a_panicking_job_fails_its_work_instead_of_hanging() {
        let abort = Arc::new(AtomicBool::new(false));
        let links = Links::new(0, vec![None], abort.clone(), Duration::ZERO);
        let state = EngineState::new(0, 1, links, None, abort, vec![0]);
        let engine = Engine::start(state, Duration::from_secs(5), "panic-test".into()).unwrap();
        let boom: Job = Box::new(|_, _| panic!("injected fault"));
        let e = engine.submit("boom#0".into(), boom).wait().expect_err("a panicking job must fail");
        assert!(matches!(&e, Error::Internal(m) if m.contains("rank 0") && m.contains("injected fault")), "{e}");
        assert_eq!(e.code(), -1);
        let later = engine.run_blocking(|| "later#1".into(), Box::new(|_, _| Ok(())));
        assert!(matches!(&later, Err(Error::Aborted { reason, .. }) if reason.contains("injected fault")), "{later:?}");
    }
}
