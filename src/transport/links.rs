//! The exchange over one rank's links: a set of tagged two-sided sends and receives run
//! concurrently under one deadline, received data reduced as it arrives when asked to, and
//! every message's call header checked against the local call.

use super::frame::{CallHeader, FrameHeader, FrameKind, OpKind, HEADER_LEN};
use super::wait::{wait_stage, Backoff, WaitStage};
use super::{bytemuck_bytes, Link, LinkTable};
use crate::error::{Error, Result};
use crate::sys::poll::poll;
use std::io::IoSlice;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes an exchange reads (a send's payload) or writes (a receive's sink).
///
/// Made from a slice, it borrows the slice for `'a`. A pipelined algorithm whose operations
/// share memory in a dependency order (a received chunk is forwarded by a later send, see
/// [`SendOp::after`]) makes them from raw pointers instead: the exchange makes a slice of a
/// span only while it works on that operation, never touches a receive's span once it
/// is complete, and never starts a send before the receive it waits for is complete.
#[derive(Clone, Copy)]
pub struct Span<'a> {
    ptr: *mut u8,
    len: usize,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl<'a> Span<'a> {
    /// `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The bytes must stay valid for `'a`, and while the exchange works on an operation
    /// with this span nothing else may access them (a send's may be read elsewhere).
    pub unsafe fn raw(ptr: *mut u8, len: usize) -> Self {
        Span { ptr, len, _borrow: PhantomData }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// # Safety
    /// See [`Span::raw`]: only while working on this span's operation.
    unsafe fn bytes(&self) -> &[u8] {
        if self.len == 0 {
            &[]
        } else {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
        }
    }

    /// # Safety
    /// As [`Span::bytes`], and only for a receive's span (made from `&mut` or `raw`).
    #[allow(clippy::mut_from_ref)]
    unsafe fn bytes_mut(&self) -> &mut [u8] {
        if self.len == 0 {
            &mut []
        } else {
            // SAFETY: the caller's contract.
            unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
        }
    }
}

impl<'a> From<&'a mut [u8]> for Span<'a> {
    fn from(s: &'a mut [u8]) -> Self {
        Span { ptr: s.as_mut_ptr(), len: s.len(), _borrow: PhantomData }
    }
}

/// Where a received payload goes.
pub enum Sink<'a> {
    /// Copy into this span (its length is the expected payload length).
    Copy(Span<'a>),
    /// Combine into `dst` element by element with `reduce(dst_part, src_part)`; both parts
    /// are whole elements of `elem` bytes.
    Reduce { dst: Span<'a>, elem: usize, reduce: &'a dyn Fn(&mut [u8], &[u8]) },
    /// As `Reduce`, with the other operand read from `with` (as long as `dst`) instead of
    /// from `dst`: `reduce(dst_part, with_part, src_part)` sets `dst_part` to their
    /// combination, in one pass. A ring or chain combines its own input with what arrives
    /// straight into the bytes it passes on (or its output), where it would otherwise
    /// first copy the input there and read it back.
    ReduceFrom { dst: Span<'a>, with: &'a [u8], elem: usize, reduce: &'a ReduceFromFn },
}

/// `reduce(dst, with, arrived)`: sets `dst` to `with` combined with `arrived`.
pub type ReduceFromFn = dyn Fn(&mut [u8], &[u8], &[u8]);

impl Sink<'_> {
    fn len(&self) -> usize {
        match self {
            Sink::Copy(b) => b.len(),
            Sink::Reduce { dst, .. } | Sink::ReduceFrom { dst, .. } => dst.len(),
        }
    }
}

/// Bytes copied beside an exchange each time it finds no link ready
/// ([`Links::exchange_copying`]).
const COPY_PIECE: usize = 256 << 10;

/// How a receive combines what arrives with what it holds.
#[derive(Clone, Copy)]
enum Combine<'a> {
    /// `dst = reduce(dst, arrived)` ([`Sink::Reduce`]).
    Into(&'a dyn Fn(&mut [u8], &[u8])),
    /// `dst = reduce(with, arrived)`, `dst`'s old bytes unused ([`Sink::ReduceFrom`]).
    From(&'a [u8], &'a ReduceFromFn),
}

impl Combine<'_> {
    /// Combines `arrived` (whole elements) into `dst` from byte `at` of the payload.
    fn apply(self, dst: &mut [u8], at: usize, arrived: &[u8]) {
        let dst = &mut dst[at..at + arrived.len()];
        match self {
            Combine::Into(reduce) => reduce(dst, arrived),
            Combine::From(with, reduce) => reduce(dst, &with[at..at + arrived.len()], arrived),
        }
    }
}

/// A send of one framed message.
pub struct SendOp<'a> {
    pub peer: usize,
    pub step: u32,
    /// The payload, only read. Private: made from a shared slice, it must never become
    /// a receive's span.
    data: Span<'a>,
    /// Index of a receive of the same exchange that must be complete before this send
    /// starts: the payload is (part of) what that receive brings.
    pub after: Option<usize>,
}

impl<'a> SendOp<'a> {
    pub fn new(peer: usize, step: u32, data: &'a [u8]) -> Self {
        SendOp { peer, step, data: Span { ptr: data.as_ptr() as *mut u8, len: data.len(), _borrow: PhantomData }, after: None }
    }

    /// A send of (part of) what receive `after` of the same exchange brings, once it is
    /// complete: how a pipelined algorithm forwards.
    pub fn forwarding(peer: usize, step: u32, data: Span<'a>, after: Option<usize>) -> Self {
        SendOp { peer, step, data, after }
    }
}

/// A receive of one framed message.
pub struct RecvOp<'a> {
    pub peer: usize,
    pub step: u32,
    pub sink: Sink<'a>,
}

struct SendState {
    header: [u8; HEADER_LEN],
    /// Bytes of the frame (header and payload) written, of `total`.
    done: usize,
    total: usize,
    /// The payload goes by rendezvous: the header is written alone, then the payload is
    /// announced (`begun`) and written.
    rendezvous: bool,
    begun: bool,
}

struct RecvState {
    /// Payload length (kept here: a complete receive's span is not touched again).
    len: usize,
    header: [u8; HEADER_LEN],
    header_done: usize,
    payload_done: usize,
    /// Bytes of a partial element carried between reads (reduce sinks).
    carry: usize,
    /// The payload comes by rendezvous and the link has not been told yet.
    grant_pending: bool,
    /// A point-to-point message of another tag, arrived first, being read into the stash.
    diverted: Option<Diverted>,
}

/// A point-to-point message being read aside (see [`Links::unexpected`]).
struct Diverted {
    call: CallHeader,
    data: Vec<u8>,
    done: usize,
}

impl SendState {
    fn complete(&self) -> bool {
        self.done == self.total
    }
}

impl RecvState {
    /// The receive's own header and payload are in. A header read while another message
    /// is read aside is that message's: a receive of 0 bytes is not complete then.
    fn complete(&self) -> bool {
        self.header_done == HEADER_LEN && self.diverted.is_none() && self.payload_done == self.len
    }
}

/// Bytes staged per reduce-on-receive read: small enough to stay in L2.
const REDUCE_SCRATCH: usize = 256 << 10;

/// All links of one rank in one communicator, indexed by peer rank.
pub struct Links {
    pub rank: usize,
    pub links: LinkTable,
    /// Set from any thread to make every pending exchange fail promptly.
    pub abort_flag: Arc<AtomicBool>,
    pub spin: Duration,
    scratch: Vec<u64>,
    /// Streams we left in the middle of a frame (no in-band abort frame possible).
    mid_frame: Vec<bool>,
    /// Per peer, point-to-point messages that arrived before their receive was posted,
    /// read aside while a receive of another tag, or a collective's, from that peer waited:
    /// point-to-point messages are matched by (peer, tag), as torch and MPI match them,
    /// and a stream delivers them in the order they were sent.
    unexpected: Vec<std::collections::VecDeque<(CallHeader, Vec<u8>)>>,
}

impl Links {
    pub fn new(rank: usize, links: LinkTable, abort_flag: Arc<AtomicBool>, spin: Duration) -> Self {
        let n = links.len();
        Links {
            rank,
            links,
            abort_flag,
            spin,
            scratch: vec![0u64; REDUCE_SCRATCH / 8],
            mid_frame: vec![false; n],
            unexpected: (0..n).map(|_| Default::default()).collect(),
        }
    }

    pub fn world(&self) -> usize {
        self.links.len()
    }

    /// [`Link::rendezvous_from`] of the link to `peer`.
    pub fn rendezvous_from(&self, peer: usize) -> Option<usize> {
        self.links.get(peer).and_then(|l| l.as_ref()).and_then(|l| l.rendezvous_from())
    }

    fn link(&mut self, peer: usize) -> Result<&mut Box<dyn Link>> {
        let rank = self.rank;
        self.links.get_mut(peer).and_then(|l| l.as_mut()).ok_or_else(|| Error::InvalidArgument(format!("rank {rank} has no link to rank {peer}")))
    }

    /// Runs all `sends` and `recvs` concurrently until every one is complete, the deadline
    /// passes, a peer fails, or the communicator is aborted. Messages to or from the same
    /// peer complete in list order; a send with [`SendOp::after`] starts once that receive
    /// is complete, so one exchange can run a whole pipelined algorithm.
    pub fn exchange(&mut self, call: &CallHeader, sends: &mut [SendOp<'_>], recvs: &mut [RecvOp<'_>], deadline: Instant) -> Result<()> {
        self.exchange_calls(Calls::Same(call), sends, recvs, deadline, None)
    }

    /// [`Links::exchange`] that also copies `from` into `to` (of the same length, touched by
    /// no send or receive): a piece whenever no link is ready instead of waiting, the rest
    /// after, so that the copy never holds the links back.
    pub fn exchange_copying(
        &mut self,
        call: &CallHeader,
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        from: &[u8],
        to: &mut [u8],
    ) -> Result<()> {
        assert_eq!(from.len(), to.len(), "a copy beside an exchange needs equal lengths");
        let mut copied = 0;
        let mut copy_piece = || {
            let n = (from.len() - copied).min(COPY_PIECE);
            to[copied..copied + n].copy_from_slice(&from[copied..copied + n]);
            copied += n;
            copied < from.len()
        };
        self.exchange_calls(Calls::Same(call), sends, recvs, deadline, Some(&mut copy_piece))?;
        while copy_piece() {}
        Ok(())
    }

    /// `Links::exchange` where every operation is a call of its own: send i carries
    /// `send_calls[i]` and receive j expects `recv_calls[j]` (a batch of point-to-point
    /// messages, each with its own tag and sequence number, progressed together).
    pub fn exchange_each(
        &mut self,
        send_calls: &[CallHeader],
        recv_calls: &[CallHeader],
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
    ) -> Result<()> {
        if send_calls.len() != sends.len() || recv_calls.len() != recvs.len() {
            return Err(Error::InvalidArgument(format!(
                "exchange of {} sends and {} receives given {} and {} calls",
                sends.len(),
                recvs.len(),
                send_calls.len(),
                recv_calls.len()
            )));
        }
        self.exchange_calls(Calls::Each { sends: send_calls, recvs: recv_calls }, sends, recvs, deadline, None)
    }

    fn exchange_calls(
        &mut self,
        calls: Calls<'_>,
        sends: &mut [SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        mut side_work: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<()> {
        if let Some(bad) = sends.iter().find(|s| s.after.is_some_and(|i| i >= recvs.len())) {
            return Err(Error::InvalidArgument(format!("send of step {} waits for receive {:?} of {}", bad.step, bad.after, recvs.len())));
        }
        let rendezvous = |peer: usize, len: usize| self.rendezvous_from(peer).is_some_and(|from| len > 0 && len >= from);
        let mut sstate: Vec<SendState> = sends
            .iter()
            .enumerate()
            .map(|(i, s)| SendState {
                header: FrameHeader { kind: FrameKind::Data, call: *calls.send(i), step: s.step, len: s.data.len() as u64 }.encode(),
                done: 0,
                total: HEADER_LEN + s.data.len(),
                rendezvous: rendezvous(s.peer, s.data.len()),
                begun: false,
            })
            .collect();
        let mut rstate: Vec<RecvState> = recvs
            .iter()
            .map(|r| {
                let len = r.sink.len();
                RecvState { len, header: [0; HEADER_LEN], header_done: 0, payload_done: 0, carry: 0, grant_pending: rendezvous(r.peer, len), diverted: None }
            })
            .collect();
        // Everything before these indices is complete: long pipelines skip it.
        let (mut first_send, mut first_recv) = (0, 0);
        let start = Instant::now();
        let mut idle_since: Option<Instant> = None;
        let mut last_liveness = start;
        // A peer found gone: reported only after one more pass without progress, since its
        // last message may have landed between our pass and the liveness check.
        let mut gone: Option<(usize, String)> = None;
        loop {
            let mut progressed = false;
            // Sends waiting for room on a link; sends held back behind an earlier one to
            // the same peer (in progress, or waiting for its receive: no room to poll for).
            let mut pending_send = vec![false; self.world()];
            let mut held = vec![false; self.world()];
            let mut pending_recv = vec![false; self.world()];
            self.grant_rendezvous(recvs, &mut rstate, first_recv, &calls)?;
            for i in first_send..sends.len() {
                let (op, st) = (&sends[i], &mut sstate[i]);
                if st.complete() || held[op.peer] {
                    continue;
                }
                if op.after.is_some_and(|r| !rstate[r].complete()) {
                    held[op.peer] = true;
                    continue;
                }
                let n = self.progress_send(op, st, calls.send(i))?;
                progressed |= n > 0;
                if !st.complete() {
                    held[op.peer] = true;
                    pending_send[op.peer] = true;
                }
            }
            for i in first_recv..recvs.len() {
                let (op, st) = (&mut recvs[i], &mut rstate[i]);
                if st.complete() || pending_recv[op.peer] {
                    continue;
                }
                let n = self.progress_recv(op, st, calls.recv(i))?;
                progressed |= n > 0;
                if !st.complete() {
                    pending_recv[op.peer] = true;
                }
            }
            while first_send < sends.len() && sstate[first_send].complete() {
                first_send += 1;
            }
            while first_recv < recvs.len() && rstate[first_recv].complete() {
                first_recv += 1;
            }
            if first_send == sends.len() && first_recv == recvs.len() {
                return Ok(());
            }
            if progressed {
                idle_since = None;
                gone = None;
                continue;
            }
            // The call an error names: the first open one with that peer.
            let call_with = |p: usize| {
                let recv = (first_recv..recvs.len()).find(|&j| recvs[j].peer == p && !rstate[j].complete()).map(|j| calls.recv(j));
                let send = || (first_send..sends.len()).find(|&i| sends[i].peer == p && !sstate[i].complete()).map(|i| calls.send(i));
                recv.or_else(send).unwrap_or(calls.send(0)).to_string()
            };
            if let Some((p, why)) = gone.take() {
                return Err(Error::PeerLost { rank: self.rank, peer: p, op: call_with(p), cause: why });
            }
            if self.abort_flag.load(Ordering::Acquire) {
                return Err(Error::Aborted { rank: self.rank, peer: self.rank, reason: "aborted locally".into() });
            }
            let now = Instant::now();
            let waiting_on = (0..self.world()).find(|&p| pending_recv[p]).or_else(|| (0..self.world()).find(|&p| pending_send[p])).unwrap_or(self.rank);
            if now >= deadline {
                let dir = if pending_recv[waiting_on] { "data from" } else { "room to send to" };
                return Err(Error::Timeout {
                    rank: self.rank,
                    peer: waiting_on,
                    op: format!("{} ({dir} rank {waiting_on})", call_with(waiting_on)),
                    waited_ms: now.duration_since(start).as_millis() as u64,
                });
            }
            if now.duration_since(last_liveness) > Duration::from_millis(20) {
                last_liveness = now;
                for p in 0..self.world() {
                    if pending_send[p] || pending_recv[p] {
                        if let Some(why) = self.link(p)?.peer_gone() {
                            gone = Some((p, why));
                            break;
                        }
                    }
                }
                if gone.is_some() {
                    continue;
                }
            }
            if let Some(work) = side_work.as_mut() {
                if work() {
                    continue;
                }
                side_work = None;
            }
            let idle = *idle_since.get_or_insert(now);
            self.wait_ready(&pending_send, &pending_recv, now.duration_since(idle), deadline)?;
        }
    }

    /// Tells each link whose next payload comes by rendezvous to grant it, before any send
    /// of ours: on soft-RoCE a send does the transfer itself, so a grant issued after our
    /// own sends would make the two directions of an exchange take turns.
    fn grant_rendezvous(&mut self, recvs: &[RecvOp<'_>], rstate: &mut [RecvState], first: usize, calls: &Calls<'_>) -> Result<()> {
        // Most exchanges (every one on shm and tcp) have nothing to grant: no allocation then.
        if !rstate.iter().any(|st| st.grant_pending) {
            return Ok(());
        }
        let mut earlier_open = vec![false; self.world()];
        for (j, (op, st)) in recvs.iter().zip(rstate.iter_mut()).enumerate().skip(first) {
            // Only a receive with none before it from the same peer is the link's next payload.
            if st.complete() || std::mem::replace(&mut earlier_open[op.peer], true) || !st.grant_pending {
                continue;
            }
            let rank = self.rank;
            self.link(op.peer)?.expect_payload(st.len).map_err(|e| lost(rank, op.peer, calls.recv(j), "receive", e))?;
            st.grant_pending = false;
        }
        Ok(())
    }

    fn progress_send(&mut self, op: &SendOp<'_>, st: &mut SendState, call: &CallHeader) -> Result<usize> {
        let rank = self.rank;
        let peer = op.peer;
        let link = self.link(peer)?;
        let mut total = 0;
        loop {
            let done = st.done;
            let bufs: Vec<IoSlice<'_>> = if done < HEADER_LEN && st.rendezvous {
                vec![IoSlice::new(&st.header[done..])]
            } else if done < HEADER_LEN {
                // SAFETY: the exchange is working on this send (see `Span`).
                vec![IoSlice::new(&st.header[done..]), IoSlice::new(unsafe { op.data.bytes() })]
            } else if done < st.total {
                if st.rendezvous && !st.begun {
                    link.begin_payload(op.data.len());
                    st.begun = true;
                }
                // SAFETY: as above.
                vec![IoSlice::new(unsafe { &op.data.bytes()[done - HEADER_LEN..] })]
            } else {
                break;
            };
            let n = link.try_write(&bufs).map_err(|e| lost(rank, peer, call, "send", e))?;
            if n == 0 {
                break;
            }
            st.done += n;
            total += n;
            // A rendezvous write can be a blocking call (on soft-RoCE the post does the
            // transfer): let the receives reduce what has landed before the next one.
            if st.begun {
                break;
            }
        }
        self.mid_frame[peer] = st.done > 0 && !st.complete();
        if total > 0 && st.complete() {
            PAYLOAD_SENT.fetch_add(op.data.len() as u64, Ordering::Relaxed);
        }
        Ok(total)
    }

    fn progress_recv(&mut self, op: &mut RecvOp<'_>, st: &mut RecvState, call: &CallHeader) -> Result<usize> {
        let rank = self.rank;
        let peer = op.peer;
        let mut total = 0;
        if st.header_done == 0 && st.diverted.is_none() && call.op == OpKind::Send {
            if let Some(n) = self.take_unexpected(op, st, call)? {
                return Ok(n);
            }
        }
        loop {
            if let Some(d) = st.diverted.as_mut() {
                while d.done < d.data.len() {
                    let n = self.link(peer)?.try_read(&mut d.data[d.done..]).map_err(|e| lost(rank, peer, call, "receive", e))?;
                    if n == 0 {
                        return Ok(total);
                    }
                    d.done += n;
                    total += n;
                }
                let d = st.diverted.take().expect("diverting");
                self.unexpected[peer].push_back((d.call, d.data));
                st.header_done = 0;
            }
            if st.header_done == HEADER_LEN {
                break;
            }
            let n = self.link(peer)?.try_read(&mut st.header[st.header_done..]).map_err(|e| lost(rank, peer, call, "receive", e))?;
            if n == 0 {
                return Ok(total);
            }
            st.header_done += n;
            total += n;
            if st.header_done == HEADER_LEN {
                if let Some(other) = self.check_header(op, &st.header, call)? {
                    let len = usize::try_from(other.len)
                        .ok()
                        .filter(|&l| l <= isize::MAX as usize)
                        .ok_or_else(|| Error::Protocol(format!("rank {rank}: message from rank {peer} announces {} bytes", other.len)))?;
                    st.diverted = Some(Diverted { call: other.call, data: vec![0; len], done: 0 });
                }
            }
        }
        let expected = op.sink.len();
        while st.payload_done < expected {
            let n = match &mut op.sink {
                Sink::Copy(span) => {
                    // SAFETY: the exchange is working on this receive (see `Span`).
                    let buf = unsafe { span.bytes_mut() };
                    let n = self.link(peer)?.try_read(&mut buf[st.payload_done..]).map_err(|e| lost(rank, peer, call, "receive", e))?;
                    st.payload_done += n;
                    n
                }
                Sink::Reduce { dst, elem, reduce } => self.read_reducing(op.peer, call, st, expected, *dst, *elem, Combine::Into(*reduce))?,
                Sink::ReduceFrom { dst, with, elem, reduce } => self.read_reducing(op.peer, call, st, expected, *dst, *elem, Combine::From(with, *reduce))?,
            };
            if n == 0 {
                break;
            }
            total += n;
        }
        Ok(total)
    }

    /// Reads what arrives for a reducing sink into `dst` (see [`combine`]): straight out
    /// of the transport's memory where it has some, else through the scratch. Returns the
    /// payload bytes read (0: none ready).
    #[allow(clippy::too_many_arguments)]
    fn read_reducing(
        &mut self,
        peer: usize,
        call: &CallHeader,
        st: &mut RecvState,
        expected: usize,
        dst: Span<'_>,
        elem: usize,
        reduce: Combine<'_>,
    ) -> Result<usize> {
        let rank = self.rank;
        // SAFETY: the exchange is working on this receive (see `Span`).
        let dst = unsafe { dst.bytes_mut() };
        if st.carry == 0 {
            // Reduce straight out of the transport's memory where it has some.
            let at = st.payload_done;
            let mut carry = [0u8; 16];
            let mut rem = 0;
            let r = self.link(peer)?.try_read_in_place(expected - at, &mut |bytes: &[u8]| {
                let whole = bytes.len() / elem * elem;
                reduce.apply(dst, at, &bytes[..whole]);
                rem = bytes.len() - whole;
                carry[..rem].copy_from_slice(&bytes[whole..]);
            });
            if let Some(r) = r {
                let n = r.map_err(|e| lost(rank, peer, call, "receive", e))?;
                // A partial element waits in the scratch for the rest of its bytes.
                let scratch_bytes: &mut [u8] = bytemuck_bytes(&mut self.scratch);
                scratch_bytes[..rem].copy_from_slice(&carry[..rem]);
                st.carry = rem;
                st.payload_done += n;
                return Ok(n);
            }
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        let bytes = bytemuck_bytes(&mut scratch);
        let want = (expected - st.payload_done).min(bytes.len() - st.carry);
        let r = self.link(peer)?.try_read(&mut bytes[st.carry..st.carry + want]);
        let n = match r {
            Ok(n) => n,
            Err(e) => {
                self.scratch = scratch;
                return Err(lost(rank, peer, call, "receive", e));
            }
        };
        let have = st.carry + n;
        let whole = have / elem * elem;
        if whole > 0 {
            let at = st.payload_done - st.carry;
            reduce.apply(dst, at, &bytes[..whole]);
            bytes.copy_within(whole..have, 0);
        }
        st.carry = have - whole;
        st.payload_done += n;
        self.scratch = scratch;
        Ok(n)
    }

    /// A point-to-point message of another tag from the same peer, read aside before, that
    /// this receive matches: copied into its sink (the receive is then complete). Returns
    /// the bytes taken, or None.
    fn take_unexpected(&mut self, op: &mut RecvOp<'_>, st: &mut RecvState, call: &CallHeader) -> Result<Option<usize>> {
        let peer = op.peer;
        let Some(at) = self.unexpected[peer].iter().position(|(h, _)| h.root == call.root && h.seq == call.seq) else { return Ok(None) };
        let (theirs, data) = self.unexpected[peer].remove(at).expect("found above");
        if theirs != *call || data.len() != op.sink.len() {
            return Err(Error::Mismatch {
                rank: self.rank,
                mine: format!("{call} expecting {} bytes", op.sink.len()),
                peer,
                theirs: format!("{theirs} with {} bytes", data.len()),
            });
        }
        match &mut op.sink {
            // SAFETY: the exchange is working on this receive (see `Span`).
            Sink::Copy(span) => unsafe { span.bytes_mut() }.copy_from_slice(&data),
            _ => return Err(Error::InvalidArgument(format!("{call}: a point-to-point receive must copy"))),
        }
        st.header_done = HEADER_LEN;
        st.payload_done = st.len;
        Ok(Some(data.len().max(1)))
    }

    /// Checks a message's header against the receive's call: None when the message is the
    /// receive's; the header of a point-to-point message it is not for (another tag's, or
    /// one where a collective's message was due), to be read aside (see
    /// [`Links::unexpected`]); else the error.
    fn check_header(&mut self, op: &RecvOp<'_>, raw: &[u8; HEADER_LEN], call: &CallHeader) -> Result<Option<FrameHeader>> {
        let h = FrameHeader::decode(raw).map_err(|e| Error::Protocol(format!("rank {}: message from rank {}: {e}", self.rank, op.peer)))?;
        if h.kind == FrameKind::Abort {
            let mut reason = vec![0u8; (h.len as usize).min(4096)];
            let deadline = Instant::now() + Duration::from_millis(500);
            let mut got = 0;
            while got < reason.len() && Instant::now() < deadline {
                match self.link(op.peer)?.try_read(&mut reason[got..]) {
                    Ok(0) => std::thread::yield_now(),
                    Ok(n) => got += n,
                    Err(_) => break,
                }
            }
            return Err(Error::Aborted { rank: self.rank, peer: op.peer, reason: String::from_utf8_lossy(&reason[..got]).into_owned() });
        }
        if h.call != *call {
            // A point-to-point message this receive is not for: another tag's, or one sent
            // before a collective that this receive belongs to.
            let other_tag = h.call.op == OpKind::Send && h.step == 0 && !(call.op == OpKind::Send && h.call.root == call.root);
            // A payload that comes by rendezvous lands where the receive granted it: only
            // messages below the link's rendezvous size can be read aside.
            let small = |len: usize| self.rendezvous_from(op.peer).is_none_or(|from| len < from);
            if other_tag && small(h.len as usize) && small(op.sink.len()) {
                return Ok(Some(h));
            }
            let mine = match self.rendezvous_from(op.peer) {
                Some(from) if other_tag => format!("{call} (over this link, messages of {from} bytes or more are received in the order they were sent)"),
                _ => call.to_string(),
            };
            return Err(Error::Mismatch { rank: self.rank, mine, peer: op.peer, theirs: h.call.to_string() });
        }
        if h.step != op.step || h.len != op.sink.len() as u64 {
            // Same call, different cut: the ranks split the buffer differently.
            let why = match call.op {
                OpKind::AllToAll => "the two ranks' alltoall counts for this pair disagree",
                _ => "do all ranks use the same GRADWIRE_RING_CHUNK_BYTES?",
            };
            return Err(Error::Mismatch {
                rank: self.rank,
                mine: format!("{call} expecting step {} with {} bytes", op.step, op.sink.len()),
                peer: op.peer,
                theirs: format!("step {} with {} bytes ({why})", h.step, h.len),
            });
        }
        Ok(None)
    }

    /// Waits for readiness: on sockets poll without sleeping while `idle` is under the spin
    /// time, then poll and yield for [`YIELD_FOR`] more, then sleep in poll; on shm links
    /// spin, then yield, then sleep.
    fn wait_ready(&mut self, send: &[bool], recv: &[bool], idle: Duration, deadline: Instant) -> Result<()> {
        let mut fds = Vec::new();
        let mut any_fdless = false;
        for p in 0..self.world() {
            if !(send[p] || recv[p]) {
                continue;
            }
            match self.link(p)?.poll_fd() {
                Some(fd) => {
                    let mut events = 0;
                    if send[p] {
                        events |= libc::POLLOUT;
                    }
                    if recv[p] {
                        events |= libc::POLLIN;
                    }
                    fds.push(libc::pollfd { fd, events, revents: 0 });
                }
                None => any_fdless = true,
            }
        }
        if any_fdless {
            // Shared-memory peers have no descriptor: back off, and look at sockets too.
            if !fds.is_empty() {
                poll(&mut fds, 0);
            }
            Backoff::waited(self.spin, idle).pause();
            return Ok(());
        }
        match wait_stage(idle, self.spin) {
            // A core of our own: look again at once rather than pay a sleep and a wake-up.
            WaitStage::Spin => {
                poll(&mut fds, 0);
            }
            // As Open MPI does when oversubscribed: a rank sharing a core gives it to the
            // peer it waits for, yet sees the data without a sleep and a wake-up.
            WaitStage::Yield => {
                if poll(&mut fds, 0) == 0 {
                    std::thread::yield_now();
                }
            }
            // Sleep in poll, capped so a local abort is noticed promptly.
            WaitStage::Sleep => {
                let left = deadline.saturating_duration_since(Instant::now());
                poll(&mut fds, left.as_millis().clamp(1, 50) as i32);
            }
        }
        Ok(())
    }

    /// Tells every peer we abort (where the stream allows an in-band frame or the transport
    /// has an out-of-band channel), then shuts every link down.
    pub fn abort_all(&mut self, reason: &str) {
        for p in 0..self.world() {
            let mid = self.mid_frame[p];
            if let Some(link) = self.links[p].as_mut() {
                if !link.notify_abort(reason) && !mid {
                    let msg = reason.as_bytes();
                    let call = CallHeader {
                        op: OpKind::Barrier,
                        dtype: crate::dtype::DType::F32,
                        redop: crate::dtype::ReduceOp::Sum,
                        root: 0,
                        count: 0,
                        seq: u64::MAX,
                    };
                    let h = FrameHeader { kind: FrameKind::Abort, call, step: 0, len: msg.len() as u64 }.encode();
                    let _ = link.try_write(&[IoSlice::new(&h), IoSlice::new(msg)]);
                }
                link.shutdown();
            }
        }
    }
}

/// See [`payload_bytes_sent`].
static PAYLOAD_SENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Payload bytes of every message this process has sent through `Links::exchange` so
/// far (headers and one-sided traffic excluded): what a scheme's own byte count can be
/// checked against.
pub fn payload_bytes_sent() -> u64 {
    PAYLOAD_SENT.load(Ordering::Relaxed)
}

/// The call header of each operation of an exchange: one for all (a collective), or one
/// per operation (a batch of point-to-point messages).
enum Calls<'c> {
    Same(&'c CallHeader),
    Each { sends: &'c [CallHeader], recvs: &'c [CallHeader] },
}

impl Calls<'_> {
    /// The call of send `i`; with no sends at all, the first receive's (for naming only).
    fn send(&self, i: usize) -> &CallHeader {
        match self {
            Calls::Same(c) => c,
            Calls::Each { sends, recvs } => sends.get(i).or_else(|| recvs.first()).unwrap_or(&NO_CALL),
        }
    }

    fn recv(&self, j: usize) -> &CallHeader {
        match self {
            Calls::Same(c) => c,
            Calls::Each { recvs, .. } => recvs.get(j).unwrap_or(&NO_CALL),
        }
    }
}

/// Named by an empty batch's errors, which cannot happen (an empty exchange returns at once).
const NO_CALL: CallHeader = CallHeader { op: OpKind::Send, dtype: crate::dtype::DType::U8, redop: crate::dtype::ReduceOp::Sum, root: 0, count: 0, seq: 0 };

fn lost(rank: usize, peer: usize, call: &CallHeader, dir: &str, e: std::io::Error) -> Error {
    let cause = match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe => {
            format!("connection closed during {dir} (process exited or was killed?)")
        }
        _ => format!("{dir} failed: {e}"),
    };
    Error::PeerLost { rank, peer, op: call.to_string(), cause }
}
