//! Socket writes that a dead peer cannot turn into SIGPIPE.
//!
//! A write to a connection whose peer has gone raises SIGPIPE, and its default action kills
//! the process. A Rust `main` ignores it, but gradwire is also a C library and a Python
//! extension: a C host at the default disposition died instead of getting
//! GRADWIRE_ERR_PEER_LOST. `sendmsg` with MSG_NOSIGNAL returns EPIPE instead, for that call
//! only, without touching the process's signal dispositions (which belong to the host).

use std::io::{IoSlice, Write};
use std::os::fd::AsRawFd;

/// The writing side of a connected socket whose writes never raise SIGPIPE: `Write` as the
/// stream's own (`write_all`, vectored writes, non-blocking `WouldBlock`), through
/// `sendmsg(MSG_NOSIGNAL)`. Reads stay with the stream.
pub struct NoSigpipe<'a, S: AsRawFd>(pub &'a S);

impl<S: AsRawFd> Write for NoSigpipe<'_, S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        // SAFETY: an all-zero msghdr is valid (no address, no control data, no iovecs).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec on Unix (std's documented guarantee), and
        // sendmsg only reads through msg_iov; more than UIO_MAXIOV is EINVAL, so the rest
        // waits for the next write, as std's write_vectored does.
        msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = bufs.len().min(libc::UIO_MAXIOV as usize) as _;
        // SAFETY: `msg` points at `bufs`, valid for reads for the call; the fd is the
        // borrowed socket's, open while it is borrowed.
        let n = unsafe { libc::sendmsg(self.0.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A descriptor of our own for the inherited socket `fd` (a launcher's PMI connection):
/// closing ours leaves the original open for whoever else uses it (an MPI library).
pub fn dup_inherited_socket(fd: i32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    // SAFETY: an all-zero stat is valid; fstat writes at most its size, and on a descriptor
    // that is not open fails with EBADF without touching anything else.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a socket"));
    }
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an open descriptor returns a new one or -1.
    let own = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if own < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `own` is a fresh descriptor that nothing else owns.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(own) })
}
