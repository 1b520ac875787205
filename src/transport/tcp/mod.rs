//! TCP transport: one authenticated, non-blocking stream per peer pair ([`link`]), set up
//! by [`connect`]. Works on loopback, across network namespaces and across hosts.

pub mod connect;
pub mod link;

pub use connect::connect_all;

use super::backend::{Backend, Setup};
use super::{Link, Transport};
use crate::error::Result;

/// The TCP backend: needs nothing but the rendezvous store.
pub(crate) struct TcpBackend;

impl Backend for TcpBackend {
    fn transport(&self) -> Transport {
        Transport::Tcp
    }

    fn connect(&self, s: &Setup<'_>, peers: &[usize]) -> Result<Vec<(usize, Box<dyn Link>)>> {
        let links = connect_all(s.prefix, s.rank, s.size, peers, s.store, s.secret, s.deadline)?;
        Ok(links.into_iter().enumerate().filter_map(|(p, l)| Some((p, l?))).collect())
    }
}
