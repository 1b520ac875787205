//! How verbs links are set up: queue pairs and rings per peer, endpoints through the
//! rendezvous store, and a hello over every new pair.

use super::link::{hello, lost, NewLink, VerbsLink, MAILBOX, MAX_SLOT, MAX_ZONE_CHUNK, WR_RECV_CREDIT, WR_RECV_DATA};
use super::{Cq, Domain, Endpoint, Mr, Qp};
use crate::bootstrap::StoreClient;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::mem::Region;
use crate::transport::Link;
use std::sync::Arc;
use std::time::Instant;

/// Connects this rank to every peer in `peers` over verbs: one RC queue pair and one ring
/// per direction per peer; endpoints (QP numbers, GID, ring address and key) go through the
/// rendezvous store. Before returning, every pair exchanges a hello over the new queue
/// pairs, so an unreachable peer (wrong GID, wrong port) fails here, named, and not in the
/// first collective.
pub fn connect_all(
    prefix: &str,
    rank: usize,
    peers: &[usize],
    store: &StoreClient,
    dom: &Arc<Domain>,
    cfg: &Config,
    deadline: Instant,
) -> Result<Vec<(usize, Box<dyn Link>)>> {
    let (ring_bytes, zone_bytes) = (cfg.ib_ring_bytes, cfg.ib_zone_bytes);
    let started = Instant::now();
    if peers.is_empty() {
        return Ok(vec![]);
    }
    let slot = MAX_SLOT.min(ring_bytes / 4);
    let slots = ring_bytes / slot;
    // Each queue holds a whole ring of slots (or of credits) plus control words.
    let depth = slots + 16;
    let rendezvous_from = ring_bytes / 2;
    struct Pending {
        peer: usize,
        data_qp: Qp,
        credit_qp: Qp,
        cq: Arc<Cq>,
        tx: Region,
        rx: Region,
        tx_mr: Mr,
        rx_mr: Mr,
        psn: (u32, u32),
    }
    let mut pending = Vec::new();
    let mut made = Vec::new();
    for &p in peers {
        let cq = dom.create_cq(4 * depth)?;
        let data_qp = dom.create_qp(&cq, depth as u32, depth as u32)?;
        let credit_qp = dom.create_qp(&cq, depth as u32, depth as u32)?;
        // The mailbox after each ring: grants arrive in the staging region's, and leave
        // from the receive region's.
        let tx = Region::anonymous(ring_bytes + MAILBOX)?;
        let rx = Region::anonymous(ring_bytes + MAILBOX)?;
        // SAFETY: both regions live in the link next to (and longer than) their registrations.
        let (tx_mr, rx_mr) = unsafe { (dom.register_raw(tx.as_ptr(), tx.len())?, dom.register_raw(rx.as_ptr(), rx.len())?) };
        let psn = (super::fresh_psn(), super::fresh_psn());
        store.set(&format!("{prefix}/ib/{rank}>{p}/data"), data_qp.endpoint(psn.0, Some(&tx_mr)).encode().as_bytes())?;
        store.set(&format!("{prefix}/ib/{rank}>{p}/credit"), credit_qp.endpoint(psn.1, Some(&rx_mr)).encode().as_bytes())?;
        pending.push(Pending { peer: p, data_qp, credit_qp, cq, tx, rx, tx_mr, rx_mr, psn });
    }
    for pd in pending {
        let p = pd.peer;
        let fetch = |which: &str| -> Result<Endpoint> {
            let v = store.get(&format!("{prefix}/ib/{p}>{rank}/{which}"), deadline)?.ok_or_else(|| Error::Timeout {
                rank,
                peer: p,
                op: format!("verbs connect (peer never published its {which} queue pair)"),
                waited_ms: started.elapsed().as_millis() as u64,
            })?;
            Endpoint::decode(&String::from_utf8_lossy(&v)).map_err(|e| Error::Protocol(format!("rank {p}: {e}")))
        };
        let (remote_data, remote) = (fetch("data")?, fetch("credit")?);
        if remote.len < ring_bytes as u64 || remote_data.len < (ring_bytes + MAILBOX) as u64 {
            return Err(Error::Config(format!(
                "rank {p} has a {}-byte verbs ring, rank {rank} {ring_bytes}: set GRADWIRE_IB_RING_BYTES alike on every rank",
                remote.len
            )));
        }
        // Our data queue pair talks to the peer's credit queue pair, and the other way round.
        pd.data_qp.connect(pd.psn.0, &remote).map_err(|e| lost(rank, p, e.to_string()))?;
        pd.credit_qp.connect(pd.psn.1, &remote_data).map_err(|e| lost(rank, p, e.to_string()))?;
        for _ in 0..depth {
            pd.credit_qp.post_recv(WR_RECV_DATA).map_err(|e| Error::io(format!("post receive for rank {p}"), e))?;
            pd.data_qp.post_recv(WR_RECV_CREDIT).map_err(|e| Error::io(format!("post receive for rank {p}"), e))?;
        }
        made.push(VerbsLink::new(NewLink {
            peer: p,
            data_qp: pd.data_qp,
            credit_qp: pd.credit_qp,
            cq: pd.cq,
            remote,
            remote_mailbox: (remote_data.addr + ring_bytes as u64, remote_data.rkey),
            tx_mr: pd.tx_mr,
            rx_mr: pd.rx_mr,
            tx: pd.tx,
            rx: pd.rx,
            slots,
            slot,
            depth,
            rendezvous_from,
            zone_bytes,
            zone_chunk: MAX_ZONE_CHUNK.min(ring_bytes / 2),
        }));
    }
    // Every queue pair of ours is ready to receive; wait until the peers' are too, so a
    // hello never meets a queue pair that is not listening yet.
    store.set(&format!("{prefix}/ib/ready/{rank}"), b"1")?;
    for &p in peers {
        store.get(&format!("{prefix}/ib/ready/{p}"), deadline)?.ok_or_else(|| Error::Timeout {
            rank,
            peer: p,
            op: "verbs connect (peer never became ready)".into(),
            waited_ms: started.elapsed().as_millis() as u64,
        })?;
    }
    hello(rank, &mut made, deadline, started)?;
    Ok(made.into_iter().map(|l| (l.peer, Box::new(l) as Box<dyn Link>)).collect())
}
