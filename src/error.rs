//! One error type for every layer: what failed, on which rank, against which peer, and why.

use std::fmt;

/// Result alias used across gradwire.
pub type Result<T> = std::result::Result<T, Error>;

/// Every failure gradwire reports. Variants name the operation and the ranks involved so a
/// user can tell which process to look at without reading logs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting (environment variable, CLI flag, config) is missing, malformed or
    /// contradicts another one.
    #[error("configuration: {0}")]
    Config(String),

    /// A caller passed something unusable (wrong length, bad root, unknown enum value).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// A deadline passed while waiting for a peer.
    #[error("rank {rank}: Timed out after {waited_ms} ms in {op} waiting for rank {peer}")]
    Timeout {
        /// The rank that waited.
        rank: usize,
        /// The rank it was waiting for.
        peer: usize,
        /// The operation that waited.
        op: String,
        /// How long it waited, in milliseconds.
        waited_ms: u64,
    },

    /// A bounded wait on a non-blocking operation ended before the operation did; the
    /// operation goes on and can be waited for again.
    #[error("the operation is still running after {waited_ms} ms; wait for it again")]
    StillRunning {
        /// How long the bounded wait lasted, in milliseconds.
        waited_ms: u64,
    },

    /// A peer went away (process died, connection closed) during an operation.
    #[error("rank {rank}: lost rank {peer} during {op}: {cause}")]
    PeerLost {
        /// The rank that noticed the loss.
        rank: usize,
        /// The rank that went away.
        peer: usize,
        /// The operation under way.
        op: String,
        /// What was observed (the OS error or the closed connection).
        cause: String,
    },

    /// Two ranks issued different collective calls at the same point in their sequence.
    #[error("collective mismatch: rank {rank} called {mine} but rank {peer} called {theirs}")]
    Mismatch {
        /// The rank that detected the mismatch.
        rank: usize,
        /// The call this rank made.
        mine: String,
        /// The rank that disagrees.
        peer: usize,
        /// The call that peer made.
        theirs: String,
    },

    /// A peer aborted the communicator; `reason` is that peer's own error text.
    #[error("rank {rank}: communicator aborted by rank {peer}: {reason}")]
    Aborted {
        /// The rank that received the abort.
        rank: usize,
        /// The rank that aborted.
        peer: usize,
        /// The aborting peer's error text.
        reason: String,
    },

    /// A peer failed the job-secret check or spoke a different protocol.
    #[error("authentication: {0}")]
    Auth(String),

    /// A wire message that does not parse.
    #[error("protocol: {0}")]
    Protocol(String),

    /// An operating-system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being attempted.
        what: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// The feature is not available in this build or on this host.
    #[error("unsupported: {0}")]
    Unsupported(String),

    /// A bug in gradwire (a panic), caught before it could cross the C ABI or hang a waiter.
    #[error("internal error (a gradwire bug; please report it): {0}")]
    Internal(String),
}

impl Error {
    /// Wraps an I/O error with a description of what was being attempted.
    pub fn io(what: impl fmt::Display, source: std::io::Error) -> Self {
        Error::Io { what: what.to_string(), source }
    }

    /// Rewrites the rank numbers of a sub-communicator's error (its own numbering) into the
    /// job's global ranks, so a message always names the process to look at.
    pub fn with_global_ranks(self, global: &[usize]) -> Self {
        let g = |r: usize| global.get(r).copied().unwrap_or(r);
        match self {
            Error::Timeout { rank, peer, op, waited_ms } => Error::Timeout { rank: g(rank), peer: g(peer), op, waited_ms },
            Error::PeerLost { rank, peer, op, cause } => Error::PeerLost { rank: g(rank), peer: g(peer), op, cause },
            Error::Mismatch { rank, mine, peer, theirs } => Error::Mismatch { rank: g(rank), mine, peer: g(peer), theirs },
            Error::Aborted { rank, peer, reason } => Error::Aborted { rank: g(rank), peer: g(peer), reason },
            other => other,
        }
    }

    /// Stable numeric code for the C ABI (negative; 0 is success).
    pub fn code(&self) -> i32 {
        match self {
            Error::Config(_) => -2,
            Error::InvalidArgument(_) => -3,
            Error::Timeout { .. } => -4,
            Error::PeerLost { .. } => -5,
            Error::Mismatch { .. } => -6,
            Error::Aborted { .. } => -7,
            Error::Auth(_) => -8,
            Error::Protocol(_) => -9,
            Error::Io { .. } => -10,
            Error::Unsupported(_) => -11,
            // Not a failure: a bounded wait ended first (NCCL's ncclInProgress).
            Error::StillRunning { .. } => -12,
            Error::Internal(_) => -1,
        }
    }
}

/// The text a panic carried (`panic!` with a literal or a formatted message), for
/// [`Error::Internal`].
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned()).unwrap_or_else(|| "panic".into())
}

/// Shorthand for an `InvalidArgument` error.
pub fn invalid(msg: impl Into<String>) -> Error {
    Error::InvalidArgument(msg.into())
}

/// Shorthand for a `Config` error.
pub fn config(msg: impl Into<String>) -> Error {
    Error::Config(msg.into())
}
