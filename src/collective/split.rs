//! Sub-communicators: `split` by colour and key (as MPI_Comm_split), and the node-local and
//! cross-node groups of the hierarchical schemes.

use crate::comm::Communicator;
use crate::error::{config, Result};
use std::sync::atomic::Ordering;
use std::time::Instant;

impl Communicator {
    /// Splits into sub-communicators by `color` (ranks with equal colour form one group,
    /// ordered by `key`, then by rank). A negative colour joins no group (`None`). Every
    /// rank must call it, in the same order relative to other collectives.
    pub fn split(&self, color: i32, key: i32) -> Result<Option<Communicator>> {
        let n = self.rendezvous.splits.fetch_add(1, Ordering::Relaxed);
        let mine = [color as f64, key as f64];
        let mut all = vec![0f64; 2 * self.size()];
        self.allgather(&mine, &mut all)?;
        if color < 0 {
            return Ok(None);
        }
        let mut members: Vec<(i32, usize)> = (0..self.size()).filter(|&r| all[2 * r] as i32 == color).map(|r| (all[2 * r + 1] as i32, r)).collect();
        members.sort();
        let ranks: Vec<usize> = members.iter().map(|m| m.1).collect();
        let new_rank = ranks.iter().position(|&r| r == self.rank()).unwrap_or(0);
        let topo = self.topology().subset(&ranks);
        let rendezvous = self.rendezvous.child(format!("{}/s{n}c{color}", self.rendezvous.prefix), ranks.len() == 1);
        let deadline = Instant::now() + self.config.timeout;
        let global = ranks.iter().map(|&r| self.global_ranks()[r]).collect();
        let sub = Self::build(new_rank, ranks.len(), topo, self.config.clone(), rendezvous, deadline, global)?;
        sub.closing_agreement(deadline)?;
        Ok(Some(sub))
    }

    /// The ranks of this rank's host, as a communicator (the intra-node group).
    pub fn split_node_local(&self) -> Result<Communicator> {
        let host = self.topology().host_of[self.rank()] as i32;
        self.split(host, self.rank() as i32)?.ok_or_else(|| config("node-local split produced no group"))
    }

    /// One rank per host with the same local index (the cross-node group of that index).
    pub fn split_cross_node(&self) -> Result<Communicator> {
        let local_index = self.topology().local_ranks(self.rank()).iter().position(|&r| r == self.rank()).unwrap_or(0) as i32;
        self.split(local_index, self.rank() as i32)?.ok_or_else(|| config("cross-node split produced no group"))
    }
}
