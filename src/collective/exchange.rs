//! Point-to-point send/recv and all-to-all on raw buffers of any [`DType`]: what the C ABI
//! and torch's `send`/`recv` and `all_to_all_single` (mixture-of-experts token exchange) need.
//!
//! All-to-all with blocks of any size posts every send and every receive of the call at
//! once in one exchange (the transports progress them together, so no pair waits for
//! another), and copies the rank's own block locally. Every rank states how many elements
//! it sends to and receives from each peer; a pair that disagrees fails with both counts
//! named. All-to-all with equal blocks is a [`crate::Collective`] of its own (on one host
//! it goes through shared memory, see `collective::shm`).

use super::layout::{layout, Span};
use super::{Collective, Ptr};
use crate::comm::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::engine::{EngineState, Job, Work};
use crate::error::{invalid, Error, Result};
use crate::transport::frame::{CallHeader, OpKind};
use crate::transport::{Links, RecvOp, SendOp, Sink};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Instant;

/// The element counts of an all-to-all: what this rank sends to and receives from each
/// peer, in rank order (its buffers hold the blocks back to back).
#[derive(Clone, Debug)]
pub struct Counts {
    /// Elements this rank sends to each rank.
    pub send: Vec<usize>,
    /// Elements this rank receives from each rank.
    pub recv: Vec<usize>,
}

impl Counts {
    /// `count` elements to and from every rank (torch's equal split).
    pub fn uniform(count: usize, world: usize) -> Counts {
        Counts { send: vec![count; world], recv: vec![count; world] }
    }

    /// (send bytes, receive bytes), checked for overflow.
    pub(crate) fn bytes(&self, dtype: DType, world: usize) -> Result<(usize, usize)> {
        if self.send.len() != world || self.recv.len() != world {
            return Err(invalid(format!("alltoall: {} send and {} receive counts for {world} ranks", self.send.len(), self.recv.len())));
        }
        let total = |v: &[usize]| -> Result<usize> {
            v.iter()
                .try_fold(0usize, |a, &c| a.checked_add(c.checked_mul(dtype.size())?))
                .filter(|&b| b <= isize::MAX as usize)
                .ok_or_else(|| invalid("alltoall: the counts overflow a buffer"))
        };
        Ok((total(&self.send)?, total(&self.recv)?))
    }
}

/// One message of a point-to-point batch ([`Communicator::start_p2p_batch`]).
#[derive(Clone, Copy, Debug)]
pub struct P2pOp {
    /// A send (else a receive).
    pub send: bool,
    /// The other rank.
    pub peer: usize,
    /// Matches a send with the receive of the same tag from the same peer (in order within a tag).
    pub tag: u32,
    /// The elements' type.
    pub dtype: DType,
    /// Elements in `buf`.
    pub count: usize,
    /// Read by a send, written by a receive.
    pub buf: *mut u8,
}

impl Communicator {
    /// Starts an all-to-all: block `p` of `send` (`counts.send[p]` elements) goes to rank `p`,
    /// and block `p` of `recv` receives rank `p`'s block for us.
    ///
    /// # Safety
    /// `send` must be readable and `recv` writable for the counts' bytes, disjoint, and
    /// both must stay valid and untouched by anyone else until the returned `Work` completes.
    pub unsafe fn start_alltoall(&self, dtype: DType, counts: Counts, send: *const u8, recv: *mut u8) -> Result<Work> {
        let job = self.alltoall_job(dtype, counts, send, recv)?;
        Ok(self.submit(format!("alltoall({})", dtype.name()), job))
    }

    /// [`Communicator::start_alltoall`], run to completion.
    ///
    /// # Safety
    /// As for [`Communicator::start_alltoall`], until this call returns.
    pub unsafe fn run_alltoall(&self, dtype: DType, counts: Counts, send: *const u8, recv: *mut u8) -> Result<()> {
        let job = self.alltoall_job(dtype, counts, send, recv)?;
        self.run_blocking(|| format!("alltoall({})", dtype.name()), job)
    }

    fn alltoall_job(&self, dtype: DType, counts: Counts, send: *const u8, recv: *mut u8) -> Result<Job> {
        let (w, me) = (self.size(), self.rank());
        let (slen, rlen) = counts.bytes(dtype, w)?;
        if slen > 0 && send.is_null() {
            return Err(invalid("sendbuf is NULL"));
        }
        if rlen > 0 && recv.is_null() {
            return Err(invalid("recvbuf is NULL"));
        }
        layout(Collective::AllToAll, me, Span::of(send, slen), Span::of(recv, rlen))?;
        // Checked here, not in the job: a bad argument must not fail the communicator.
        if counts.send[me] != counts.recv[me] {
            return Err(invalid(format!("alltoall: rank {me} sends {} elements to itself but expects {}", counts.send[me], counts.recv[me])));
        }
        let (s, r) = (Ptr(send as *mut u8), Ptr(recv));
        let kept = self.collectives.clone();
        Ok(Box::new(move |st: &mut EngineState, deadline: Instant| {
            let (s, r) = (s, r);
            // SAFETY: lengths and validity are the caller's contract (see start_alltoall).
            let sbuf: &[u8] = if slen == 0 { &[] } else { unsafe { std::slice::from_raw_parts(s.0, slen) } };
            // SAFETY: as for `sbuf`.
            let rbuf: &mut [u8] = if rlen == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(r.0, rlen) } };
            let es = dtype.size();
            // Block boundaries in bytes: 0, then the running sums of the counts.
            let cut = |v: &[usize]| -> Vec<usize> {
                std::iter::once(0)
                    .chain(v.iter().scan(0, |at, &c| {
                        *at += c * es;
                        Some(*at)
                    }))
                    .collect()
            };
            // The header is the same on every rank; the per-pair sizes are checked per message.
            let call = CallHeader { op: OpKind::AllToAll, dtype, redop: ReduceOp::Sum, root: 0, count: 0, seq: st.next_seq() };
            // Published like every collective's call: a peer in a one-host collective of the
            // same sequence number (the equal-block all-to-all, say) names the mismatch at
            // once instead of at the deadline.
            if let Some(one_host) = &kept.lock().one_host {
                one_host.announce(&call);
            }
            alltoall_over_links(&mut st.links, &call, sbuf, rbuf, &cut(&counts.send), &cut(&counts.recv), me, deadline)
        }))
    }

    /// Sends `count` elements of `dtype` at `data` to `peer` with `tag` (see
    /// [`Communicator::send`]).
    ///
    /// # Safety
    /// `data` must be readable for `count` elements until this call returns.
    pub unsafe fn send_raw(&self, data: *const u8, count: usize, dtype: DType, peer: usize, tag: u32) -> Result<()> {
        // Arguments first: a rejected call must not use up the pair's next sequence number.
        let len = p2p_bytes(count, dtype)?;
        if len > 0 && data.is_null() {
            return Err(invalid("send: null buffer"));
        }
        let call = self.p2p_header(dtype, peer, tag, count, true)?;
        let p = Ptr(data as *mut u8);
        let job = Box::new(move |st: &mut EngineState, deadline: Instant| {
            let p = p;
            // SAFETY: readable for `len` bytes until this call returns (the contract).
            let bytes: &[u8] = if len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(p.0, len) } };
            st.links.exchange(&call, &mut [SendOp::new(peer, 0, bytes)], &mut [], deadline)
        });
        self.run_blocking(|| call.to_string(), job)
    }

    /// Receives the next message from `peer` (`count` elements of `dtype`, `tag`) into `buf`.
    ///
    /// # Safety
    /// `buf` must be writable for `count` elements and untouched by others until this call
    /// returns.
    pub unsafe fn recv_raw(&self, buf: *mut u8, count: usize, dtype: DType, peer: usize, tag: u32) -> Result<()> {
        let len = p2p_bytes(count, dtype)?;
        if len > 0 && buf.is_null() {
            return Err(invalid("recv: null buffer"));
        }
        let call = self.p2p_header(dtype, peer, tag, count, false)?;
        let p = Ptr(buf);
        let job = Box::new(move |st: &mut EngineState, deadline: Instant| {
            let p = p;
            // SAFETY: writable for `len` bytes until this call returns (the contract).
            let bytes: &mut [u8] = if len == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(p.0, len) } };
            st.links.exchange(&call, &mut [], &mut [RecvOp { peer, step: 0, sink: Sink::Copy(bytes.into()) }], deadline)
        });
        self.run_blocking(|| call.to_string(), job)
    }

    /// Starts a batch of point-to-point sends and receives that progress together as one
    /// operation (NCCL's grouped send/recv, torch's `batch_isend_irecv`): a ring in which
    /// every rank sends before it receives completes, where blocking calls would each wait
    /// for room at a peer that is itself sending. Messages between two ranks keep their
    /// order within a batch and across calls; each is checked against its peer's (dtype,
    /// count, tag) as a single send/recv is.
    ///
    /// # Safety
    /// Each op's buffer must be valid for its count (readable for a send, writable for a
    /// receive), receive buffers must overlap no other buffer of the batch, and all must
    /// stay valid and untouched by others until the returned `Work` completes.
    pub unsafe fn start_p2p_batch(&self, ops: &[P2pOp]) -> Result<Work> {
        let (job, what) = self.p2p_batch_job(ops)?;
        Ok(self.submit(what, job))
    }

    /// [`Communicator::start_p2p_batch`], run to completion.
    ///
    /// # Safety
    /// As for [`Communicator::start_p2p_batch`], until this call returns.
    pub unsafe fn run_p2p_batch(&self, ops: &[P2pOp]) -> Result<()> {
        let (job, what) = self.p2p_batch_job(ops)?;
        self.run_blocking(|| what, job)
    }

    fn p2p_batch_job(&self, ops: &[P2pOp]) -> Result<(Job, String)> {
        // Every argument first: a rejected batch must not use up any pair's sequence numbers.
        let mut lens = Vec::with_capacity(ops.len());
        for op in ops {
            let what = if op.send { "send" } else { "recv" };
            let len = p2p_bytes(op.count, op.dtype)?;
            if len > 0 && op.buf.is_null() {
                return Err(invalid(format!("{what} to/from rank {} in a batch: null buffer", op.peer)));
            }
            // The overlap check below works on the buffers' ends.
            if (op.buf as usize).checked_add(len).is_none() {
                return Err(invalid(format!("{what} to/from rank {} in a batch: {len} bytes at {:p} wrap around the address space", op.peer, op.buf)));
            }
            lens.push(len);
        }
        // A receive's buffer must overlap no other buffer of the batch (it becomes a `&mut`
        // slice beside the others): sorted by start, an interval overlaps an earlier one iff
        // it starts before the furthest end seen so far.
        let mut spans: Vec<(usize, usize, bool)> =
            ops.iter().zip(&lens).filter(|(_, &l)| l > 0).map(|(o, &l)| (o.buf as usize, o.buf as usize + l, !o.send)).collect();
        spans.sort_unstable();
        let (mut end, mut recv_end) = (0usize, 0usize);
        for &(lo, hi, recv) in &spans {
            if lo < recv_end || (recv && lo < end) {
                return Err(invalid("send/recv batch: a receive buffer overlaps another buffer of the batch"));
            }
            end = end.max(hi);
            if recv {
                recv_end = recv_end.max(hi);
            }
        }
        if let Some(op) = ops.iter().find(|op| op.peer >= self.size() || op.peer == self.rank()) {
            let what = if op.send { "send" } else { "recv" };
            return Err(invalid(format!("{what} peer {} in a batch: must be another rank of this communicator (size {})", op.peer, self.size())));
        }
        let mut items = Vec::with_capacity(ops.len());
        for (op, len) in ops.iter().zip(lens) {
            let call = self.p2p_header(op.dtype, op.peer, op.tag, op.count, op.send)?;
            items.push((op.send, op.peer, call, Ptr(op.buf), len));
        }
        let what = format!("send/recv batch of {} (first: {})", items.len(), items.first().map(|i| i.2.to_string()).unwrap_or_default());
        let job = Box::new(move |st: &mut EngineState, deadline: Instant| {
            let items = items;
            let (mut send_calls, mut recv_calls, mut sends, mut recvs) = (vec![], vec![], vec![], vec![]);
            for &(send, peer, call, ref p, len) in &items {
                if send {
                    // SAFETY: readable for `len` bytes until the work completes (the contract).
                    let bytes: &[u8] = if len == 0 { &[] } else { unsafe { std::slice::from_raw_parts(p.0, len) } };
                    send_calls.push(call);
                    sends.push(SendOp::new(peer, 0, bytes));
                } else {
                    // SAFETY: writable for `len` bytes, overlapping no other buffer of the
                    // batch, until the work completes (the contract).
                    let bytes: &mut [u8] = if len == 0 { &mut [] } else { unsafe { std::slice::from_raw_parts_mut(p.0, len) } };
                    recv_calls.push(call);
                    recvs.push(RecvOp { peer, step: 0, sink: Sink::Copy(bytes.into()) });
                }
            }
            st.links.exchange_each(&send_calls, &recv_calls, &mut sends, &mut recvs, deadline)
        });
        Ok((job, what))
    }

    /// The header of the next message to or from `peer` with `tag`: point-to-point messages
    /// are matched by (peer, tag), in order within a tag (as MPI and torch match them), with
    /// sequence numbers of their own per peer and tag.
    pub(crate) fn p2p_header(&self, dtype: DType, peer: usize, tag: u32, count: usize, sending: bool) -> Result<CallHeader> {
        if peer >= self.size() || peer == self.rank() {
            return Err(invalid(format!("send/recv peer {peer}: must be another rank of this communicator (size {})", self.size())));
        }
        let seq = self.p2p.next(peer, tag, sending);
        Ok(CallHeader { op: OpKind::Send, dtype, redop: ReduceOp::Sum, root: tag, count: count as u64, seq })
    }
}

/// All-to-all over the links: block p of `sbuf` (bytes `soff[p]..soff[p + 1]`) goes to
/// rank p, and block p of `rbuf` (`roff`) receives rank p's block for us. Every send and
/// receive is posted at once in one exchange; our own block is copied here.
#[allow(clippy::too_many_arguments)]
pub(super) fn alltoall_over_links(
    links: &mut Links,
    call: &CallHeader,
    sbuf: &[u8],
    rbuf: &mut [u8],
    soff: &[usize],
    roff: &[usize],
    me: usize,
    deadline: Instant,
) -> Result<()> {
    let w = soff.len() - 1;
    let mut sends: Vec<SendOp> = (0..w).filter(|&p| p != me).map(|p| SendOp::new(p, 0, &sbuf[soff[p]..soff[p + 1]])).collect();
    let mut recvs: Vec<RecvOp> = Vec::with_capacity(w.saturating_sub(1));
    let mut mine: &mut [u8] = &mut [];
    let mut rest: &mut [u8] = rbuf;
    for p in 0..w {
        let (block, tail) = std::mem::take(&mut rest).split_at_mut(roff[p + 1] - roff[p]);
        rest = tail;
        if p != me {
            recvs.push(RecvOp { peer: p, step: 0, sink: Sink::Copy(block.into()) });
        } else {
            mine = block;
        }
    }
    // This rank's own block is copied beside the exchange, a piece whenever no link is
    // ready, not before it: the links start at once (on 10 Gbit/s links about a tenth of
    // a 64 MiB call faster).
    links.exchange_copying(call, &mut sends, &mut recvs, deadline, &sbuf[soff[me]..soff[me + 1]], mine)
}

/// Per peer and tag, the point-to-point messages sent to it and received from it so far:
/// the sequence numbers of their headers.
#[derive(Default)]
pub(crate) struct P2pCounters {
    sent: Mutex<HashMap<(usize, u32), u64>>,
    received: Mutex<HashMap<(usize, u32), u64>>,
}

impl P2pCounters {
    /// The sequence number of the next message to (`sending`) or from `peer` with `tag`.
    fn next(&self, peer: usize, tag: u32, sending: bool) -> u64 {
        let counters = if sending { &self.sent } else { &self.received };
        let mut c = counters.lock().unwrap_or_else(|p| p.into_inner());
        let n = c.entry((peer, tag)).or_insert(0);
        *n += 1;
        *n - 1
    }
}

fn p2p_bytes(count: usize, dtype: DType) -> Result<usize> {
    count.checked_mul(dtype.size()).filter(|&b| b <= isize::MAX as usize).ok_or_else(|| Error::InvalidArgument(format!("count {count} overflows")))
}
