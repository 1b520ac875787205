//! Transport layer: point-to-point links between two ranks.
//!
//! Files: this one the [`Link`] interface and the [`Transport`] names; `links` the
//! exchange over a rank's links; `wait` how a waiting rank backs off; `backend` the
//! seam to the transports, each in its folder (`shm/`, `tcp/`, `verbs/`); [`frame`] the
//! wire header; [`onesided`] the one-sided windows.
//!
//! Each transport (`shm`, `tcp`, `verbs`) implements one small interface, [`Link`]:
//! a non-blocking, ordered byte stream to one peer plus liveness. On top of it,
//! `Links::exchange` runs a set of tagged two-sided sends and receives concurrently, with
//! one deadline, reducing received data as it arrives when asked to, and checking every
//! message's [`CallHeader`](frame::CallHeader) against the local call.

pub(crate) mod backend;
pub mod frame;
pub(crate) mod links;
pub mod onesided;
pub(crate) mod shm;
pub(crate) mod tcp;
pub(crate) mod verbs;
mod wait;

pub use links::payload_bytes_sent;
pub(crate) use links::{Links, RecvOp, SendOp, Sink, Span};
pub use verbs::report as verbs_report;
pub(crate) use wait::Backoff;

use std::io::IoSlice;
use std::os::fd::RawFd;

/// The transports a link can run over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Transport {
    /// Shared memory between processes of one host.
    Shm,
    /// TCP sockets.
    Tcp,
    /// RDMA verbs (InfiniBand, RoCE, soft-RoCE).
    Verbs,
}

impl Transport {
    /// The name messages and settings use (`GRADWIRE_TRANSPORT`).
    pub fn name(self) -> &'static str {
        match self {
            Transport::Shm => "shm",
            Transport::Tcp => "tcp",
            Transport::Verbs => "verbs",
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A non-blocking ordered byte stream to one peer.
pub trait Link: Send {
    /// The transport it runs over.
    fn kind(&self) -> Transport;
    /// Writes as much of `bufs` as fits now; `Ok(0)` means "try later".
    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize>;
    /// Reads what is available now into `buf`; `Ok(0)` means "nothing yet". A closed
    /// stream is an error.
    fn try_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize>;
    /// Hands up to `max` bytes that are available now to `f` straight from the transport's
    /// receive memory, then consumes them; `Some(Ok(0))` means nothing yet. `None`: the
    /// transport has no such memory, use `try_read` (reduce-on-receive then skips a copy).
    fn try_read_in_place(&mut self, _max: usize, _f: &mut dyn FnMut(&[u8])) -> Option<std::io::Result<usize>> {
        None
    }
    /// Payloads of at least this many bytes go by rendezvous on this link: the receiver
    /// grants room for the whole payload as soon as it waits for it, and the sender writes
    /// straight into that room, so a receiver late to read does not stall the sender. Both
    /// ends of a link answer alike. `None`: every byte goes through the stream.
    fn rendezvous_from(&self) -> Option<usize> {
        None
    }
    /// Receiver, rendezvous: the next payload read from this link is `len` bytes.
    fn expect_payload(&mut self, _len: usize) -> std::io::Result<()> {
        Ok(())
    }
    /// Sender, rendezvous: the next `len` bytes written are one payload.
    fn begin_payload(&mut self, _len: usize) {}
    /// A descriptor to `poll` for readiness, if the transport has one.
    fn poll_fd(&self) -> Option<RawFd>;
    /// Liveness check for transports without a connection to notice the peer dying.
    /// Returns a description of why the peer is gone.
    fn peer_gone(&mut self) -> Option<String> {
        None
    }
    /// Best-effort: tell the peer why we abort (out of band where possible).
    fn notify_abort(&mut self, _reason: &str) -> bool {
        false
    }
    /// Stops the link; the peer's next read or write fails.
    fn shutdown(&mut self);
}

/// Links of one rank indexed by peer rank (`None` for itself and unconnected peers).
pub type LinkTable = Vec<Option<Box<dyn Link>>>;

/// The first `len` bytes of a scratch buffer kept between calls, grown (never shrunk) to
/// hold them; its u64s keep every dtype's elements aligned.
pub(crate) fn scratch_bytes(v: &mut Vec<u64>, len: usize) -> &mut [u8] {
    if v.len() * 8 < len {
        v.resize(len.div_ceil(8), 0);
    }
    &mut bytemuck_bytes(v)[..len]
}

/// The scratch buffer as bytes.
pub(crate) fn bytemuck_bytes(v: &mut [u64]) -> &mut [u8] {
    // SAFETY: a u64 slice reinterpreted as bytes; u8 has no alignment needs.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, v.len() * 8) }
}
