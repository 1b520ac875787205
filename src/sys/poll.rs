//! `poll(2)` on a set of descriptors.

/// Waits up to `timeout_ms` (0: not at all, negative: without limit) for an event on
/// `fds`; the number of descriptors with events, 0 on timeout, negative on error.
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> i32 {
    // SAFETY: fds is a valid, exclusively borrowed array of pollfd for the call.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) }
}
