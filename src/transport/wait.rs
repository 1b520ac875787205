//! How a rank waits for a peer: spin, yield, sleep.

use std::time::{Duration, Instant};

/// How a rank waits for a peer on shared memory: spin briefly (only when every rank has a
/// core), then yield the core for a while (a peer that shares our core can run), then sleep
/// in short naps (a slow peer should not cost us a whole core).
pub struct Backoff {
    start: Instant,
    spin: Duration,
}

/// How long waiting ranks yield, after their spin, before they sleep.
const YIELD_FOR: Duration = Duration::from_millis(2);

/// What a rank that has waited `idle` does next (see [`Backoff`]); sockets wait the same
/// way, polling in each stage.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum WaitStage {
    Spin,
    Yield,
    Sleep,
}

pub(super) fn wait_stage(idle: Duration, spin: Duration) -> WaitStage {
    if idle < spin {
        WaitStage::Spin
    } else if idle < spin + YIELD_FOR {
        WaitStage::Yield
    } else {
        WaitStage::Sleep
    }
}

impl Backoff {
    /// `spin` is zero when ranks outnumber cores (spinning would steal the core of the
    /// very peer we wait for).
    pub fn new(spin: Duration) -> Self {
        Backoff { start: Instant::now(), spin }
    }

    /// A backoff that has waited `idle` already.
    pub(super) fn waited(spin: Duration, idle: Duration) -> Self {
        Backoff { start: Instant::now() - idle, spin }
    }

    pub fn idle(&self) -> Duration {
        self.start.elapsed()
    }

    /// Waits a little, according to how long we have been waiting.
    pub fn pause(&self) {
        match wait_stage(self.idle(), self.spin) {
            WaitStage::Spin => std::hint::spin_loop(),
            WaitStage::Yield => std::thread::yield_now(),
            WaitStage::Sleep => std::thread::sleep(Duration::from_micros(50)),
        }
    }
}
