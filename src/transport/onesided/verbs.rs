//! One-sided operations over RDMA: a window's queue pairs to its verbs peers, and the NIC
//! atomics that ranks mapping a region must share with remote ranks.

use super::service::FetchAdd;
use super::{Target, Window, WindowSetup};
use crate::error::{invalid, Error, Result};
use crate::mem::Region;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Queue pairs for this rank's fetch-adds on the regions it maps (its own and those of its
/// peers on this host) while ranks on other hosts fetch-add there through RDMA: a NIC's
/// atomics are atomic only with respect to the NIC's (`IBV_ATOMIC_HCA`; soft-RoCE applies
/// them under a lock of its own with plain loads and stores), so a CPU atomic on the same
/// word can be lost (seen: two ranks, 20 fetch-adds, one lost and one old value returned
/// twice). The one-sided service applies tcp peers' fetch-adds through the same loop.
/// Plain reads and writes of mapped memory stay in place.
pub(super) struct NicAtomics {
    /// Per rank: the queue pair to its region (this rank's own: looped to `_loop_responder`).
    pub(super) to: Vec<Option<Arc<Mutex<crate::transport::verbs::RmaPeer>>>>,
    _loop_responder: crate::transport::verbs::RmaPeer,
}

impl Window {
    /// Runs `op` on a queue pair to `peer`'s region: the one it is reached over when it is
    /// a verbs peer and, for an `atomic` op, the one to a region mapped here whose atomics
    /// go through the NIC (see [`NicAtomics`]); `None` when there is neither.
    pub(super) fn on_verbs<T>(
        &self,
        peer: usize,
        what: &str,
        atomic: bool,
        op: impl FnOnce(&crate::transport::verbs::RmaPeer, Instant) -> std::io::Result<T>,
    ) -> Option<Result<T>> {
        let rma = match &self.targets[peer] {
            Target::Verbs(rma) => rma,
            _ if atomic => self.nic_atomics.as_ref()?.to[peer].as_deref()?,
            _ => return None,
        };
        let r = op(&rma.lock().unwrap_or_else(|p| p.into_inner()), Instant::now() + self.timeout);
        Some(r.map_err(|e| match peer == self.rank {
            true => Error::io(format!("rank {}: {what} on its own region through the NIC", self.rank), e),
            false => Error::PeerLost { rank: self.rank, peer, op: what.into(), cause: e.to_string() },
        }))
    }
}

/// Queue pairs to every verbs peer of a window, connected through the store, and, when
/// there are any, those for this rank's atomics on the regions it maps (see [`NicAtomics`]).
pub(super) fn verbs_setup(
    w: &WindowSetup<'_>,
    region: &Arc<Region>,
    deadline: Instant,
) -> Result<(Vec<Option<crate::transport::verbs::RmaPeer>>, Option<NicAtomics>)> {
    use crate::transport::verbs::{fresh_psn, Endpoint, RmaPeer};
    let mut out: Vec<Option<RmaPeer>> = (0..w.world).map(|_| None).collect();
    let verbs_peer = |p: usize| p != w.rank && w.verbs.is_some_and(|(_, v)| v.get(p).copied().unwrap_or(false));
    let peers: Vec<usize> = (0..w.world).filter(|&p| verbs_peer(p)).collect();
    let mapped: Vec<usize> = (0..w.world).filter(|&p| p != w.rank && w.shm_peer.get(p).copied().unwrap_or(false)).collect();
    agree_on_nic_atomics(w, !peers.is_empty(), &mapped, deadline)?;
    let Some((dom, _)) = w.verbs.filter(|_| !peers.is_empty()) else { return Ok((out, None)) };
    let store = w.store.ok_or_else(|| invalid("no rendezvous store"))?;
    let mr = dom.register(region)?;
    let mut to: Vec<Option<Arc<Mutex<RmaPeer>>>> = (0..w.world).map(|_| None).collect();
    let loop_responder = {
        let ((qa, ca), (qb, cb)) = (RmaPeer::create(dom)?, RmaPeer::create(dom)?);
        let (pa, pb) = (fresh_psn(), fresh_psn());
        let (ea, eb) = (qa.endpoint(pa, Some(&mr)), qb.endpoint(pb, Some(&mr)));
        let own = Arc::new(Mutex::new(RmaPeer::connect(dom, qa, ca, pa, eb)?));
        // Before any verbs peer can reach the region (they wait for our `ready` below).
        if let Some(svc) = w.service {
            let (own, timeout) = (own.clone(), w.timeout);
            let through_nic: FetchAdd = Arc::new(move |off, add| own.lock().unwrap_or_else(|p| p.into_inner()).fetch_add(off, add, Instant::now() + timeout));
            svc.expose(w.id, region.clone(), w.accumulate.clone(), w.timeout, Some(through_nic));
        }
        to[w.rank] = Some(own);
        RmaPeer::connect(dom, qb, cb, pb, ea)?
    };
    let key = |a: usize, b: usize| format!("{}/win{}/ib/{a}>{b}", w.prefix, w.id);
    let mut made = Vec::new();
    for &p in peers.iter().chain(&mapped) {
        let (qp, cq) = RmaPeer::create(dom)?;
        let psn = fresh_psn();
        store.set(&key(w.rank, p), qp.endpoint(psn, Some(&mr)).encode().as_bytes())?;
        made.push((p, qp, cq, psn));
    }
    for (p, qp, cq, psn) in made {
        let v = w.published_by(store, &key(p, w.rank), p, "never published its queue pair", deadline)?;
        let remote = Endpoint::decode(&String::from_utf8_lossy(&v)).map_err(|e| Error::Protocol(format!("rank {p}: {e}")))?;
        let rma = RmaPeer::connect(dom, qp, cq, psn, remote).map_err(|e| Error::PeerLost {
            rank: w.rank,
            peer: p,
            op: "one-sided window setup".into(),
            cause: e.to_string(),
        })?;
        if verbs_peer(p) {
            out[p] = Some(rma);
        } else {
            to[p] = Some(Arc::new(Mutex::new(rma)));
        }
    }
    // A peer's first request must not reach a queue pair that is not connected yet.
    let ready = |r: usize| format!("{}/win{}/ib/ready/{r}", w.prefix, w.id);
    store.set(&ready(w.rank), b"1")?;
    for &p in peers.iter().chain(&mapped) {
        w.published_by(store, &ready(p), p, "never connected its queue pair", deadline)?;
    }
    log::debug!(
        "rank {}: window {}: fetch-adds on the regions of ranks {:?} (mapped here) go through the NIC",
        w.rank,
        w.id,
        (0..w.world).filter(|&p| to[p].is_some()).collect::<Vec<_>>()
    );
    Ok((out, Some(NicAtomics { to, _loop_responder: loop_responder })))
}

/// Ranks that map each other's regions must agree on where their atomics run: a rank whose
/// region other hosts reach through RDMA needs its peers on this host to use the NIC too.
/// Ranks of one host that differ in whether RDMA works for them (their RDMA settings, or a
/// device one of them could not open) fail here, at once, naming both.
fn agree_on_nic_atomics(w: &WindowSetup<'_>, mine: bool, mapped: &[usize], deadline: Instant) -> Result<()> {
    let Some(store) = w.store.filter(|_| !mapped.is_empty()) else { return Ok(()) };
    let key = |r: usize| format!("{}/win{}/nic-atomics/{r}", w.prefix, w.id);
    store.set(&key(w.rank), if mine { b"1" } else { b"0" })?;
    for &p in mapped {
        let theirs = w.published_by(store, &key(p), p, "never said where its atomics run", deadline)?;
        if (theirs.as_slice() == b"1") != mine {
            let (with, without) = if mine { (w.rank, p) } else { (p, w.rank) };
            return Err(Error::Config(format!(
                "window {}: rank {with} reaches ranks on other hosts through RDMA and rank {without}, on its host, does not: their atomics on each other's regions would not be atomic with each other (every rank of a host needs the same RDMA device: GRADWIRE_IB_DEV, GRADWIRE_IB_PORT, GRADWIRE_GID_INDEX; see `gradwire info`)",
                w.id
            )));
        }
    }
    Ok(())
}
