//! Shared-memory transport for ranks on one host: the ranks' segments ([`segment`]), the
//! byte-ring links between them ([`link`]), and the backend that sets both up.

pub mod link;
pub mod segment;

pub use link::ShmLink;
pub use segment::ShmDomain;
pub(crate) use segment::{atomic_u64, COLLECTIVE_AREA};

use super::backend::{Backend, Setup};
use super::{Link, Transport};
use crate::error::Result;
use std::sync::Arc;

/// The shared-memory backend of one communicator: the segments of its ranks on this host.
pub(crate) struct ShmBackend {
    pub(crate) domain: Arc<ShmDomain>,
}

impl ShmBackend {
    /// Creates this rank's segment and maps those of `members` (the communicator's ranks on
    /// this host, this one included).
    pub(crate) fn create(setup: &Setup<'_>, members: &[usize]) -> Result<Self> {
        let domain = ShmDomain::create(setup.prefix, setup.rank, setup.size, members, setup.cfg, setup.store, setup.deadline)?;
        Ok(ShmBackend { domain })
    }
}

impl Backend for ShmBackend {
    fn transport(&self) -> Transport {
        Transport::Shm
    }

    fn connect(&self, _: &Setup<'_>, peers: &[usize]) -> Result<Vec<(usize, Box<dyn Link>)>> {
        Ok(peers.iter().map(|&p| (p, Box::new(ShmLink::new(self.domain.clone(), p)) as Box<dyn Link>)).collect())
    }
}
