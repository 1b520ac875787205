//! A link to one peer over TCP: a non-blocking stream, vectored writes (never SIGPIPE),
//! Nagle off.

use crate::sys::sock::NoSigpipe;
use crate::transport::{Link, Transport};
use std::io::{IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};

/// A link to one peer over TCP.
pub(crate) struct TcpLink {
    pub(super) stream: TcpStream,
}

fn would_block(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted)
}

impl Link for TcpLink {
    fn kind(&self) -> Transport {
        Transport::Tcp
    }

    fn try_write(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match NoSigpipe(&self.stream).write_vectored(bufs) {
            Ok(n) => Ok(n),
            Err(e) if would_block(&e) => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn try_read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        match self.stream.read(buf) {
            Ok(0) => Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "peer closed the connection")),
            Ok(n) => Ok(n),
            Err(e) if would_block(&e) => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn poll_fd(&self) -> Option<RawFd> {
        Some(self.stream.as_raw_fd())
    }

    fn shutdown(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}
