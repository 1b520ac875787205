//! What the collectives keep between their calls: the one-host collectives' state and the
//! work buffers of the reduce-scatter over links. It lives beside the collectives, not in
//! the engine: the communicator owns it, and a collective's job locks it while it runs.
//! Jobs run one at a time (under the engine's state lock), so the lock is never contended.

use super::shm::OneHost;
use std::sync::{Arc, Mutex, MutexGuard};

/// The collectives' state of one communicator.
pub(crate) struct CollectiveState {
    /// The one-host collectives, where this communicator has ranks on this host.
    pub(crate) one_host: Option<OneHost>,
    /// The work buffer of a reduce-scatter over the links (it reduces in a copy of its
    /// input), kept between calls: a fresh one per call faulted in every page again.
    pub(crate) scratch: Vec<u64>,
    /// The reduced block of an in-place reduce-scatter over the links, kept as `scratch` is
    /// (copied into place at the end).
    pub(crate) in_place_block: Vec<u64>,
}

/// [`CollectiveState`] shared by a communicator and its queued jobs.
#[derive(Clone)]
pub(crate) struct SharedState(Arc<Mutex<CollectiveState>>);

impl SharedState {
    pub(crate) fn new(one_host: Option<OneHost>) -> Self {
        SharedState(Arc::new(Mutex::new(CollectiveState { one_host, scratch: Vec::new(), in_place_block: Vec::new() })))
    }

    /// The state, for the job that runs now (after a job that panicked, none runs: the
    /// panic failed the communicator).
    pub(crate) fn lock(&self) -> MutexGuard<'_, CollectiveState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
