//! One-host allreduce through shared memory, in four forms chosen by size, by where the
//! buffers live and by what the kernel allows (see [`shm_allreduce`]):
//!
//! - small (at most [`SMALL_MAX`]): one barrier; every rank reduces every input itself;
//! - staged: per segment of the buffer (at most the staging size, about 1 MiB, so that
//!   the segments of all ranks stay in cache): (1) every rank copies the parts it does not
//!   own into its staging area; (2) rank r reduces part r of the peers' staging areas into
//!   its own buffer and copies the result into its staging area; (3) every rank copies the
//!   other finished parts from their owners' staging areas. Two barriers per segment and
//!   one more at the end of the call (part p always has slot p of a staging area, so the
//!   next segment's copy-in never touches what peers may still be copying out),
//!   made of per-rank phase counters (no shared contended line). What peers read is
//!   written with plain or streaming stores, whichever [`StoreChooser`] has timed faster;
//! - zero-copy (from [`LARGE_MIN`], when every rank's buffer comes from
//!   `gradwire_alloc` or is registered in place, and every rank maps every other's): rank
//!   r reduces part r straight out of the peers' buffers and writes it straight into them
//!   (a registered buffer's partial first and last pages, which stay private, every rank
//!   reduces itself from copies all ranks staged);
//! - cross-memory attach (from [`LARGE_MIN`], private buffers, when the kernel lets every
//!   rank read every peer's memory): the zero-copy form's pattern, with the kernel copying
//!   part r of every peer's buffer into a scratch and each finished block into the peers'
//!   buffers, once, where the staged form copies every byte in and out of shared memory.
//!
//! The small form reads its peers' staging after its only barrier, while they may have
//! returned already; so it has an area of its own at the end of the staging area, which
//! the staged form never writes.

use super::reduce::reduce_all;
use crate::config::StagedStores;
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::mem::page_size;
use crate::transport::frame::{CallHeader, FrameHeader, FrameKind};
use crate::transport::shm::{process_gone, Reach, ShmDomain};
use crate::transport::Backoff;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Reduction block: every source's block is combined into the destination block while it
/// is still in L1/L2.
const BLOCK: usize = 32 << 10;

/// Waits shorter than this do not look for a dead peer in /proc (see `check_peer`).
const PROC_CHECK_AFTER: Duration = Duration::from_micros(100);

pub struct ShmCtx<'a> {
    pub dom: &'a ShmDomain,
    pub rank: usize,
    pub world: usize,
    pub call: CallHeader,
    pub deadline: Instant,
    pub abort: &'a AtomicBool,
    pub spin: Duration,
}

/// Encodes a call for publication in the shared control page.
pub fn encode_call(call: &CallHeader) -> [u8; crate::transport::frame::HEADER_LEN] {
    FrameHeader { kind: FrameKind::Data, call: *call, step: 0, len: 0 }.encode()
}

impl ShmCtx<'_> {
    /// Waits until every other rank's phase counter reaches `target`.
    fn wait_all(&self, target: u64) -> Result<()> {
        let backoff = Backoff::new(self.spin);
        for p in 0..self.world {
            if p == self.rank {
                continue;
            }
            let ph = self.dom.phase(p);
            let mut iter = 0u64;
            while ph.load(Ordering::Acquire) < target {
                iter += 1;
                if iter % 64 == 0 {
                    if let Err(e) = self.check_peer(p, backoff.idle()) {
                        // The peer may have reached the phase, then exited, after our load.
                        if ph.load(Ordering::Acquire) >= target {
                            break;
                        }
                        return Err(e);
                    }
                }
                backoff.pause();
            }
        }
        Ok(())
    }

    /// Checks every rank's published call against ours.
    fn check_calls(&self) -> Result<()> {
        for p in 0..self.world {
            let h = FrameHeader::decode(&self.dom.call_of(p)).map_err(|e| Error::Protocol(format!("rank {p}'s shared call header: {e}")))?;
            if h.call != self.call {
                return Err(Error::Mismatch { rank: self.rank, mine: self.call.to_string(), peer: p, theirs: h.call.to_string() });
            }
        }
        Ok(())
    }

    fn check_peer(&self, p: usize, waited: Duration) -> Result<()> {
        if self.abort.load(Ordering::Acquire) {
            return Err(Error::Aborted { rank: self.rank, peer: self.rank, reason: "aborted locally".into() });
        }
        // The abort flag is a shared-memory read; asking /proc whether the process lives
        // costs microseconds, which a short wait cannot afford (the peer would arrive while
        // we sit in the syscall), so that waits until the wait is no longer short.
        let gone = if waited >= PROC_CHECK_AFTER { self.dom.peer_gone(p) } else { self.dom.aborted_reason(p) };
        if let Some(why) = gone {
            return Err(Error::PeerLost { rank: self.rank, peer: p, op: self.call.to_string(), cause: why });
        }
        // A peer that started a different call with the same sequence number will never
        // reach our phase: report the mismatch now instead of at the deadline.
        if let Ok(h) = FrameHeader::decode(&self.dom.call_of(p)) {
            if h.call.seq == self.call.seq && h.call != self.call {
                return Err(Error::Mismatch { rank: self.rank, mine: self.call.to_string(), peer: p, theirs: h.call.to_string() });
            }
        }
        if Instant::now() >= self.deadline {
            return Err(Error::Timeout { rank: self.rank, peer: p, op: format!("{} (shared-memory phase)", self.call), waited_ms: waited.as_millis() as u64 });
        }
        Ok(())
    }

    fn advance(&self, to: u64) {
        self.dom.phase(self.rank).store(to, Ordering::Release);
    }

    /// A call in the peers' buffers (zero-copy or cross-memory attach) failed after peers
    /// may have started writing into our buffer: the caller must not get it back before
    /// they write no more. We say that we write no more (so that a peer doing the same does
    /// not wait for us) and fail the communicator now rather than after returning (peers
    /// waiting for our phase fail at once, and stop writing into our buffer).
    fn fail_in_peer_buffers(&self, e: Error, done: u64) -> Error {
        self.dom.set_writes_done(done);
        self.dom.set_aborted(&e.to_string());
        self.let_writers_finish(done);
        e
    }

    /// After a failed call in the peers' buffers: waits until no peer writes into our buffer
    /// any more before phase `done` (see `ShmDomain::writes_done`). A peer never waits for
    /// us on the way there, so this ends; the bound is for a peer that is frozen (it checks
    /// our abort flag before each block it writes, so at most one block may still land).
    fn let_writers_finish(&self, done: u64) {
        let until = Instant::now() + WRITERS_GRACE;
        for p in (0..self.world).filter(|&p| p != self.rank) {
            while !self.dom.writes_done(p, done) {
                if Instant::now() >= until {
                    log::error!(
                        "rank {}: rank {p} neither finished nor failed its part of {} within {WRITERS_GRACE:?}; it may still write one block into this buffer",
                        self.rank,
                        self.call
                    );
                    return;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
    }
}

/// Longest a failed call in the peers' buffers waits for peers still writing into its
/// buffer.
const WRITERS_GRACE: Duration = Duration::from_secs(2);

/// What the one-host allreduce keeps between calls.
pub struct ShmAllreduceState {
    /// What the staged form has learned about this host's stores.
    pub stores: StoreChooser,
    /// Cross-memory attach for private buffers.
    pub attach: Attach,
    /// Size from which the ranks agree on a large form: [`LARGE_MIN`], or
    /// [`ZERO_COPY_MIN`] once some rank cannot attach (every rank learns it in the same
    /// call, from the same published addresses).
    agree_from: usize,
}

impl Default for ShmAllreduceState {
    fn default() -> Self {
        ShmAllreduceState::new(StagedStores::Auto, true)
    }
}

impl ShmAllreduceState {
    pub fn new(stores: StagedStores, cross_memory_attach: bool) -> Self {
        let attach = Attach { enabled: cross_memory_attach, scratch: Vec::new() };
        ShmAllreduceState { stores: StoreChooser::new(stores), attach, agree_from: LARGE_MIN }
    }
}

/// In-place allreduce of `buf` among all ranks of the domain (all on this host), in the
/// form its size calls for. Every rank picks the same: the sizes match (checked), and
/// which large form runs is agreed in its first one or two barriers.
pub fn shm_allreduce(cx: &ShmCtx<'_>, state: &mut ShmAllreduceState, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    if buf.len() <= cx.small_capacity() && buf.len() * cx.world <= SMALL_READ_MAX {
        return shm_allreduce_small(cx, buf, dtype, op);
    }
    if buf.len() >= state.agree_from {
        let access = match agree_on_form(cx, &mut state.attach, buf, dtype.size())? {
            Agreed::Mapped { peers, body } => Some((PeerAccess::Mapped(peers), body)),
            Agreed::Attach(peers) => Some((PeerAccess::Attach { peers, scratch: &mut state.attach.scratch }, 0..buf.len())),
            Agreed::Staged { someone_cannot_attach } => {
                if someone_cannot_attach && state.agree_from < ZERO_COPY_MIN {
                    state.agree_from = ZERO_COPY_MIN;
                    log::debug!("rank {}: not every rank can attach; only calls from {ZERO_COPY_MIN} bytes look for mapped buffers from now on", cx.rank);
                }
                None
            }
        };
        if let Some((access, body)) = access {
            return shm_allreduce_in_peer_buffers(cx, buf, body, dtype, op, access);
        }
    }
    let stores = &mut state.stores;
    let streaming = stores.choose(buf.len(), dtype);
    let took = shm_allreduce_staged(cx, buf, dtype, op, streaming)?;
    if let Some(flip) = stores.record(buf.len(), dtype, streaming, took) {
        log::debug!("rank {}: the staged allreduce of {flip}", cx.rank);
    }
    Ok(())
}

/// Staged allreduce (see the module comment). A rank's own part does not pass through
/// staging on the way in: it is reduced in its buffer, then staged once for the peers
/// (2 ranks, medians of 5 alternating runs: 1 MiB 14.8 against 8.2 GB/s busbw, 64 MiB
/// 9.4 against 7.0, with every part staged both ways). Segments of about 1 MiB keep the
/// staging areas in cache (every part staged, 16 and 64 MiB: 2 ranks 4.3-4.4 GB/s with
/// 16 MiB segments, 6.7-7.1 with 2 MiB and 6.2-7.3 with 1 MiB; 4 ranks 3.0-3.6 with
/// 4 MiB, 3.7-4.5 with 2 MiB, 4.1-4.8 with 1 MiB).
///
/// Returns how long the call took, less the wait for the peers to arrive at its first
/// barrier: what [`StoreChooser`] compares.
fn shm_allreduce_staged(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp, streaming: bool) -> Result<Duration> {
    let (w, me) = (cx.world, cx.rank);
    let elem = dtype.size();
    // Part p of every segment has the same slot in the staging areas, whatever the
    // segment's length: whole cache lines where there is room, and always a multiple of
    // every element size.
    let slot_len = match cx.staged_capacity() / w {
        n if n >= 64 => n / 64 * 64,
        n => n / 8 * 8,
    };
    if slot_len == 0 {
        return Err(Error::InvalidArgument(format!("GRADWIRE_SHM_STAGE_BYTES={} leaves no staging room for {w} ranks", cx.dom.stage_len())));
    }
    let slot = |p: usize| p * slot_len;
    let seg = slot_len * w;
    let mut base = cx.dom.phase(me).load(Ordering::Relaxed);
    let mut off = 0;
    let others = || (0..w).filter(move |&p| p != me);
    // Timed: the first copy-in, then everything after the first barrier (not the wait for
    // the peers to arrive, which has nothing to do with the stores).
    let started = Instant::now();
    let (mut first_copy_in, mut since) = (Duration::ZERO, started);
    loop {
        let len = (buf.len() - off).min(seg);
        let bounds = super::algos::part_bounds(len / elem, w, elem);
        let part = |p: usize| bounds[p]..bounds[p + 1];
        // (1) Copy in the parts the peers reduce, publish.
        debug_assert!((0..w).all(|p| part(p).len() <= slot_len));
        for p in others() {
            // SAFETY: our own staging area, slot p (a part is at most a slot); peers read
            // it only after the Release store below and stop before barrier base+2. What
            // peers may still read of ours, from the segment before, is slot `me`.
            unsafe { copy_for_peers(cx.dom.stage(me).add(slot(p)), &buf[off..][part(p)], streaming) };
        }
        if off == 0 {
            first_copy_in = started.elapsed();
        }
        cx.advance(base + 1);
        cx.wait_all(base + 1)?;
        if off == 0 {
            cx.check_calls()?;
            since = Instant::now();
        }
        // (2) Reduce my part of every peer's staging area into my buffer, block by block,
        // and stage each finished block for the peers while it is in cache.
        let mine = &mut buf[off..][part(me)];
        for b in (0..mine.len()).step_by(BLOCK) {
            let e = (b + BLOCK).min(mine.len());
            // SAFETY: slot `me` of every peer's staging area is only read, by us, until
            // barrier base+2; the range lies in it.
            let theirs = others().map(|p| unsafe { std::slice::from_raw_parts(cx.dom.stage(p).add(slot(me) + b), e - b) });
            reduce_all(dtype, op, w, &mut mine[b..e], theirs);
            // SAFETY: slot `me` of our staging area: only we write it; peers read it only
            // after barrier base+2, and have finished reading it for the segment
            // before, since they have passed barrier base+1.
            unsafe { copy_for_peers(cx.dom.stage(me).add(slot(me) + b), &mine[b..e], streaming) };
        }
        cx.advance(base + 2);
        cx.wait_all(base + 2)?;
        // (3) Copy the peers' finished parts out of their staging areas. No barrier after
        // it between segments: p writes slot p again only in phase (2) of its next segment,
        // after a barrier that we pass only once this copy is done.
        for p in others() {
            // SAFETY: slot p of p's staging area is final after barrier base+2 and is not
            // written again before our next barrier (above).
            unsafe { std::ptr::copy_nonoverlapping(cx.dom.stage(p).add(slot(p)), buf.as_mut_ptr().add(off + bounds[p]), part(p).len()) };
        }
        base += 2;
        off += len;
        if off >= buf.len() {
            // The call ends with every copy-out done, as every other form ends: no later
            // call needs to reason about this one, and the time [`StoreChooser`] compares
            // ends at the same moment on every rank (without it, ranks timed differently
            // and fell out of step on their choice: 4 ranks, 512 KiB, 213 against 324 us).
            cx.advance(base + 1);
            cx.wait_all(base + 1)?;
            return Ok(first_copy_in + since.elapsed());
        }
    }
}

/// Copies `src` to `dst` in our staging area, for peers to read: with non-temporal stores
/// when `streaming` (x86-64), so the lines go to memory instead of staying modified in this
/// core's cache, from where every peer's read has to fetch them. How fast that fetch is
/// changes on a virtual machine from one minute to the next: two processes handing 512 KiB
/// back and forth (benches/peers/handoff.c) ran at 3.4-4.8 GB/s with plain copies against
/// 16-20 with streaming ones in some minutes, and 14-16 either way in others, where plain
/// stores win by keeping everything in cache (2 ranks, 1-4 MiB: 12-13 against 6.3 GB/s
/// busbw). Hence [`StoreChooser`].
///
/// # Safety
/// `dst..dst + src.len()` is writable and does not overlap `src`.
unsafe fn copy_for_peers(dst: *mut u8, src: &[u8], streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if streaming {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let n = src.len();
        let head = dst.align_offset(16).min(n);
        let body_end = head + (n - head) / 16 * 16;
        std::ptr::copy_nonoverlapping(src.as_ptr(), dst, head);
        for i in (head..body_end).step_by(16) {
            // SAFETY: dst + i is 16-aligned and i + 16 <= n; SSE2 is part of x86-64.
            _mm_stream_si128(dst.add(i) as *mut __m128i, _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i));
        }
        std::ptr::copy_nonoverlapping(src.as_ptr().add(body_end), dst.add(body_end), n - body_end);
        // Streaming stores are weakly ordered: make them visible before the phase store
        // that publishes them.
        _mm_sfence();
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = streaming;
    std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len());
}

/// Picks the stores of the staged form per call (unless `GRADWIRE_SHM_STORES` forces a
/// kind), by size class (a power of two) and dtype (a bf16 reduction costs more per byte
/// than an f32 one), from the time per byte of past calls, each kind's cost being the least
/// of its last three (the noise of a shared machine only ever adds time). A class's first
/// call only warms up (page faults, cold caches); then each kind is timed twice,
/// alternately, and the faster one is kept. The other is tried again after 32 calls, then
/// twice as seldom each time it loses again, at most every 1024 calls: a host whose cache
/// hand-off slows down shows in the kind in use within three calls, one that recovers
/// within the probe interval, and trying the slower kind costs little once the interval has
/// grown (a probe of plain stores in a slow minute costs about five calls). The kind in use
/// changes only when the other is at least 10 % faster, so that noise does not flip it back
/// and forth. Every rank makes the same calls, so the first tries coincide; ranks that
/// later disagree lose speed, never correctness. Measured (2 ranks, 1-256 MiB, alternating
/// runs): in a good minute within 1-4 % of plain stores, 1.7x streaming ones; in a slow
/// minute, 3.5-4.5x plain.
#[derive(Default)]
pub struct StoreChooser {
    setting: StagedStores,
    classes: Vec<StoreClass>,
}

#[derive(Clone, Copy, Default)]
struct StoreClass {
    warm: bool,
    /// Nanoseconds per byte of the latest calls, [plain, streaming].
    recent: [Recent; 2],
    /// The kind in use, once both are timed: true for streaming.
    streaming: Option<bool>,
    calls_since_probe: u32,
    probe_every: u32,
}

/// The last (up to) three figures of one kind, newest at `next - 1`.
#[derive(Clone, Copy, Default)]
struct Recent {
    figures: [f64; 3],
    len: usize,
    next: usize,
}

impl Recent {
    fn push(&mut self, x: f64) {
        self.figures[self.next] = x;
        self.next = (self.next + 1) % self.figures.len();
        self.len = (self.len + 1).min(self.figures.len());
    }

    fn least(&self) -> f64 {
        self.figures[..self.len].iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// Calls between probes of the other kind: at first, and after a change (see [`StoreChooser`]).
const PROBE_MIN: u32 = 32;
/// Calls between probes of the other kind: at most.
const PROBE_MAX: u32 = 1024;
/// The other kind must cost at most this fraction of the kind in use to replace it.
const SWITCH_GAIN: f64 = 0.9;

impl StoreChooser {
    pub fn new(setting: StagedStores) -> Self {
        StoreChooser { setting, classes: Vec::new() }
    }

    fn class(&mut self, len: usize, dtype: DType) -> &mut StoreClass {
        let c = (usize::BITS - len.leading_zeros()) as usize * DType::ALL.len() + dtype as usize;
        if self.classes.len() <= c {
            self.classes.resize(c + 1, StoreClass { probe_every: PROBE_MIN, ..Default::default() });
        }
        &mut self.classes[c]
    }

    /// Whether the staged allreduce of `len` bytes uses streaming stores.
    pub fn choose(&mut self, len: usize, dtype: DType) -> bool {
        match self.setting {
            StagedStores::Plain => false,
            StagedStores::Streaming => true,
            StagedStores::Auto => {
                let c = self.class(len, dtype);
                match c.streaming {
                    None => c.recent[1].len < c.recent[0].len,
                    Some(in_use) => in_use != (c.calls_since_probe + 1 >= c.probe_every),
                }
            }
        }
    }

    /// Records the time of a call of `len` bytes; returns the new choice, explained, when
    /// it changed.
    pub fn record(&mut self, len: usize, dtype: DType, streaming: bool, took: Duration) -> Option<String> {
        let c = self.class(len, dtype);
        if !std::mem::replace(&mut c.warm, true) {
            return None;
        }
        let per_byte = took.as_nanos() as f64 / len.max(1) as f64;
        let probe = c.streaming.is_some_and(|s| s != streaming);
        // A probe is the only recent figure for the other kind: it replaces the old ones.
        let kind = &mut c.recent[streaming as usize];
        if probe {
            *kind = Recent::default();
        }
        kind.push(per_byte);
        if c.streaming.is_none() && c.recent.iter().any(|r| r.len < 2) {
            return None;
        }
        let (plain, stream) = (c.recent[0].least(), c.recent[1].least());
        let before = c.streaming;
        let after = match before {
            None => stream < plain,
            Some(true) => plain >= SWITCH_GAIN * stream,
            Some(false) => stream < SWITCH_GAIN * plain,
        };
        c.streaming = Some(after);
        if before == Some(after) {
            if probe {
                c.calls_since_probe = 0;
                c.probe_every = (c.probe_every * 2).min(PROBE_MAX);
            } else {
                c.calls_since_probe += 1;
            }
            return None;
        }
        // A first choice, or the host changed: look at the other kind again soon.
        c.calls_since_probe = 0;
        c.probe_every = PROBE_MIN;
        let kind = if after { "streaming" } else { "plain" };
        Some(format!("{len} bytes of {} now uses {kind} stores (plain {plain:.3} ns/B, streaming {stream:.3} ns/B)", dtype.name()))
    }
}

/// Largest buffer for the one-barrier small form.
pub const SMALL_MAX: usize = 64 << 10;

/// The small form has every rank read every input (W·S bytes); beyond this the staged
/// form, where each rank reduces 1/W of them, wins. Alternating runs, 4 ranks: 4 KiB
/// 6.2-6.7 µs against 11.7-17.5 staged, 16 KiB 13-19 against 17, 32 KiB 22-32 against
/// 22-23, 64 KiB 39-48 against 34-42; 2 ranks: even at 64 KiB.
const SMALL_READ_MAX: usize = 128 << 10;

/// Room for the call header in front of each half of the small form's area (a cache line).
const SMALL_HEADER: usize = 64;

impl ShmCtx<'_> {
    /// Bytes of each of the small form's two halves: a call header and the data (the
    /// area is at most a quarter of the staging area; whole cache lines).
    fn small_half(&self) -> usize {
        (self.dom.stage_len() / 8).min(SMALL_HEADER + SMALL_MAX) / 64 * 64
    }

    /// Largest buffer the small form takes.
    fn small_capacity(&self) -> usize {
        self.small_half().saturating_sub(SMALL_HEADER)
    }

    /// Bytes of the staging area the staged form uses: all but the small form's area.
    fn staged_capacity(&self) -> usize {
        self.dom.stage_len() - 2 * self.small_half()
    }
}

/// Latency-optimised one-host allreduce for small buffers: one barrier instead of the
/// staged form's three or more.
/// Every rank copies its call header and its input into its small area, announces it,
/// waits for all, then reduces all inputs itself, in rank order, so every rank gets
/// bit-identical results. Consecutive calls alternate between the two halves of the small
/// area: a rank may only overwrite a half once every peer has arrived at the call after
/// the one that read it, which that later call's barrier guarantees (whatever form it
/// took). No other form writes this area. The call is checked against the header in the
/// half, not the control page: a peer may have returned and announced its next call.
fn shm_allreduce_small(cx: &ShmCtx<'_>, buf: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (w, me) = (cx.world, cx.rank);
    let (at, half) = (cx.staged_capacity(), cx.small_half());
    debug_assert!(buf.len() <= cx.small_capacity());
    let base = cx.dom.phase(me).load(Ordering::Relaxed);
    let slot = |r: usize| {
        // SAFETY: the half lies inside rank r's staging area, past the staged form's part.
        unsafe { cx.dom.stage(r).add(at + (base % 2) as usize * half) }
    };
    let header = encode_call(&cx.call);
    // SAFETY: our own half, header then data; see the function comment for why no peer
    // reads it now.
    unsafe {
        std::ptr::copy_nonoverlapping(header.as_ptr(), slot(me), header.len());
        std::ptr::copy_nonoverlapping(buf.as_ptr(), slot(me).add(SMALL_HEADER), buf.len());
    }
    cx.advance(base + 1);
    cx.wait_all(base + 1)?;
    // SAFETY (all reads below): every rank's half is complete (barrier above) and is not
    // rewritten before everyone has arrived at the next call.
    for p in (0..w).filter(|&p| p != me) {
        let mut theirs = [0u8; crate::transport::frame::HEADER_LEN];
        unsafe { std::ptr::copy_nonoverlapping(slot(p), theirs.as_mut_ptr(), theirs.len()) };
        if theirs != header {
            // A peer in another form of the call wrote no header here: name its call from
            // the control page, which it has not left yet (it waits for our next phase).
            cx.check_calls()?;
            return Err(Error::Protocol(format!("rank {p}'s shared call header does not match {} (a different size of allreduce?)", cx.call)));
        }
    }
    let len = buf.len();
    let data = |p: usize| unsafe { std::slice::from_raw_parts(slot(p).add(SMALL_HEADER), len) };
    // Rank 0's buffer already holds its input.
    if me != 0 {
        buf.copy_from_slice(data(0));
    }
    reduce_all(dtype, op, w, buf, (1..w).map(data));
    Ok(())
}

/// From this size on, the ranks agree on a form that works in the peers' buffers: buffers
/// that every rank maps take the zero-copy form, private ones cross-memory attach where
/// the kernel lets every rank reach every peer. Agreeing costs a call that stages anyway
/// one barrier, about 5 % at 2-4 MiB and 4 ranks (30-40 % at 128-512 KiB), while mapped
/// buffers gain 2-6x over staging at every size from 128 KiB (2 ranks, alternating runs),
/// and private ones through cross-memory attach, against staged (3-4 alternating turns):
/// 2 ranks 256 KiB 20-24 against 36-46 us, 512 KiB 38-40 against 78-89, 1-2 MiB 12.3-14.4
/// against 6.4-7.9 GB/s busbw; 4 ranks on 2 cores, 256 KiB 79-85 against 83-96 us, 512 KiB
/// 152-159 against 160-196, 1 MiB 353-376 against 385-424, 2 MiB 736-984 against 745-779.
pub const LARGE_MIN: usize = 256 << 10;

/// Where some rank cannot attach, only calls from this size agree (on zero-copy or not):
/// the agreement's barrier costs a call that stages more at smaller sizes than mapped
/// buffers gain there.
pub const ZERO_COPY_MIN: usize = 4 << 20;

/// Bytes of a part reduced and then written to the peers at a time: the block is still in
/// L2 when it is written (and 256 KiB was the fastest block for cross-memory attach, 2
/// ranks, 16 MiB: 9.2, 13.1, 10.8 and 10.2 GB/s with 64 KiB, 256 KiB, 1 and 4 MiB).
const PEER_BLOCK: usize = 256 << 10;

/// What the ranks agreed on for a large call.
enum Agreed {
    /// Every rank mapped every peer's buffer, all but its registered buffer's partial pages
    /// (see [`crate::mem::Registration`]): the bytes of every buffer that all can reach,
    /// and where they start in the peers' buffers (ours null).
    Mapped {
        peers: Vec<*mut u8>,
        body: Range<usize>,
    },
    /// Every rank reached every peer's buffer through cross-memory attach: each rank's
    /// process and buffer address.
    Attach(Vec<(u32, u64)>),
    Staged {
        someone_cannot_attach: bool,
    },
}

/// The large forms' agreement: every rank publishes where its buffer lies, and its
/// address unless it cannot attach (barrier base+1). Unless every buffer is shared or
/// every rank can attach, that is all: staged. Otherwise each rank maps every peer's buffer
/// if all are shared, reads a few bytes of every peer's buffer through cross-memory
/// attach, and says what worked (barrier base+2). Every rank then takes the first form
/// that worked for all: zero-copy, cross-memory attach, staged.
fn agree_on_form(cx: &ShmCtx<'_>, attach: &mut Attach, buf: &[u8], elem: usize) -> Result<Agreed> {
    let (w, me) = (cx.world, cx.rank);
    let base = cx.dom.phase(me).load(Ordering::Relaxed);
    // The phase before which a rank that fails here writes nothing into peers' buffers.
    let done = base + 3;
    // A failing rank that never said it could reach its peers tells those that did (and
    // wait for writers) that it will not write.
    let never_wrote = |e: Error| {
        cx.dom.set_writes_done(done);
        e
    };
    cx.dom.publish_buffer(buf, attach.enabled);
    let ends_staged = cx.dom.buffer_is_shared(me) && stage_ends(cx, buf);
    cx.advance(base + 1);
    cx.wait_all(base + 1).and_then(|()| cx.check_calls()).map_err(never_wrote)?;
    let all_shared = (0..w).all(|p| cx.dom.buffer_is_shared(p));
    let all_can_attach = (0..w).all(|p| cx.dom.peer_address(p).1 != 0);
    if !all_shared && !all_can_attach {
        return Ok(Agreed::Staged { someone_cannot_attach: true });
    }
    // What every rank's region holds: all but the largest uncovered start and end, in
    // whole elements.
    let (head, tail) = (0..w).map(|p| cx.dom.uncovered(p)).fold((0, 0), |(h, t), (hp, tp)| (h.max(hp), t.max(tp)));
    let body = head.next_multiple_of(elem)..buf.len().saturating_sub(tail.next_multiple_of(elem));
    // Ranks with the same settings all staged their ends (all buffers are shared); one that
    // did not and needs them says so at barrier base+2 (no mapped reach), and nobody maps.
    let ends_fit = body.start <= page_size() && buf.len() - body.end <= page_size() && (body.len() == buf.len() || ends_staged);
    let peers: Option<Vec<*mut u8>> = if all_shared && ends_fit && body.len() >= buf.len() / 2 {
        (0..w).map(|p| if p == me { Some(std::ptr::null_mut()) } else { cx.dom.peer_buffer(p, body.start, body.len()) }).collect()
    } else {
        None
    };
    let reach = Reach { mapped: peers.is_some(), attach: all_can_attach && attach.reaches_all(cx) };
    cx.dom.set_reach(reach);
    cx.advance(base + 2);
    // A peer that failed after announcing its reach (it may be a step behind us) has set
    // its abort flag; going on would write into a buffer it is about to hand back.
    let all = cx.wait_all(base + 2).and_then(|()| {
        (0..w).filter(|&p| p != me).try_for_each(|p| cx.check_peer(p, Duration::ZERO))?;
        let reaches: Vec<Reach> = (0..w).map(|p| cx.dom.reach(p)).collect();
        Ok((reaches.iter().all(|r| r.mapped), reaches.iter().all(|r| r.attach)))
    });
    match (all, peers) {
        (Ok((true, _)), Some(peers)) => {
            log::debug!("rank {me}: {} zero-copy in the peers' buffers ({} of {} bytes)", cx.call, body.len(), buf.len());
            Ok(Agreed::Mapped { peers, body })
        }
        (Ok((_, true)), _) => {
            log::debug!("rank {me}: {} through cross-memory attach", cx.call);
            Ok(Agreed::Attach((0..w).map(|p| cx.dom.peer_address(p)).collect()))
        }
        (Ok(_), _) => Ok(Agreed::Staged { someone_cannot_attach: !all_can_attach }),
        // Peers that saw us reach them may be writing into our buffer already.
        (Err(e), _) if reach != Reach::default() => Err(cx.fail_in_peer_buffers(e, done)),
        (Err(e), _) => Err(never_wrote(e)),
    }
}

/// Cross-memory attach (`process_vm_readv`/`process_vm_writev`): the kernel copies
/// between this process's memory and a peer's, once, where staging copies every byte into
/// shared memory and out again. 2 ranks, private buffers, alternating with the staged form
/// (benches/peers/cma_probe.c, kernel 6.18): 4 and 16 MiB 12.1-12.3 against 6.1-7.4 GB/s
/// busbw, 64 MiB 6.9-7.0 against 5.7-5.9, 256 MiB 6.6-6.8 against 5.4-5.6; 4 ranks on 2
/// cores, 4-16 MiB 3.9-5.1 against 2.9-3.0, 64 MiB even.
pub struct Attach {
    /// `GRADWIRE_SHM_CMA`; cleared for good when the kernel refuses (permissions do not
    /// come back within a job).
    enabled: bool,
    /// Where peers' blocks land to be reduced: W−1 blocks.
    scratch: Vec<u64>,
}

impl Attach {
    /// Whether a byte of every peer's published buffer can be read from here.
    fn reaches_all(&mut self, cx: &ShmCtx<'_>) -> bool {
        let mut probe = [0u8; 1];
        for p in (0..cx.world).filter(|&p| p != cx.rank) {
            let (pid, addr) = cx.dom.peer_address(p);
            if let Err(e) = fetch(pid, addr, &mut probe) {
                if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EACCES | libc::ENOSYS)) {
                    self.enabled = false;
                    log::info!(
                        "rank {}: cross-memory attach to rank {p} (pid {pid}) refused ({e}): large allreduces of private buffers stage through shared memory \
                         (with Yama ptrace_scope 1 a process may read only its descendants; GRADWIRE_SHM_CMA=0 silences this)",
                        cx.rank
                    );
                } else {
                    log::debug!("rank {}: cross-memory attach to rank {p} (pid {pid}) failed ({e}); this allreduce stages", cx.rank);
                }
                return false;
            }
        }
        true
    }
}

/// Copies `into.len()` bytes from address `remote` of process `pid` into `into`.
fn fetch(pid: u32, remote: u64, into: &mut [u8]) -> std::io::Result<()> {
    // SAFETY: `into` is writable for its length; the kernel checks the peer's side.
    unsafe { cross_memory(pid, into.as_mut_ptr(), remote, into.len(), libc::process_vm_readv) }
}

/// Copies `from` to address `remote` of process `pid`.
fn put(pid: u32, remote: u64, from: &[u8]) -> std::io::Result<()> {
    // SAFETY: `from` is readable for its length and process_vm_writev only reads the local
    // side; the kernel checks the peer's side.
    unsafe { cross_memory(pid, from.as_ptr().cast_mut(), remote, from.len(), libc::process_vm_writev) }
}

type CrossMemoryCall = unsafe extern "C" fn(libc::pid_t, *const libc::iovec, libc::c_ulong, *const libc::iovec, libc::c_ulong, libc::c_ulong) -> isize;

/// Moves `len` bytes between `local` and `remote` in process `pid` with `call`, resuming
/// after partial transfers and interruptions.
///
/// # Safety
/// `local..local + len` is valid for what `call` does with it.
unsafe fn cross_memory(pid: u32, local: *mut u8, remote: u64, len: usize, call: CrossMemoryCall) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let l = libc::iovec { iov_base: local.add(done).cast(), iov_len: len - done };
        let r = libc::iovec { iov_base: (remote as usize + done) as *mut libc::c_void, iov_len: len - done };
        match call(pid as libc::pid_t, &l, 1, &r, 1, 0) {
            n if n > 0 => done += n as usize,
            0 => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "no bytes moved")),
            _ => {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// How a rank reaches its peers' buffers in a call that works in them.
enum PeerAccess<'s> {
    /// Mapped here (zero-copy): every rank's buffer, ours null.
    Mapped(Vec<*mut u8>),
    /// Through cross-memory attach: every rank's process and buffer address, and where
    /// fetched blocks land.
    Attach { peers: Vec<(u32, u64)>, scratch: &'s mut Vec<u64> },
}

/// One-host allreduce in the peers' buffers, after [`agree_on_form`]: rank r reduces part
/// r of every buffer block by block into its own buffer, reading the peers' blocks where
/// they are mapped or having the kernel fetch them into a scratch (cross-memory attach),
/// and writes each finished block, still in cache, into every peer's buffer, directly or
/// through the kernel. Bytes moved per rank: S read (its part of every buffer), S written
/// (its part of every buffer), plus the kernel's copy of both halves when attached. Only
/// rank r touches part r of any buffer, so nothing it writes is read by anyone else. One
/// more barrier: all parts reduced and written (nobody reads or writes our buffer any
/// more).
fn shm_allreduce_in_peer_buffers(cx: &ShmCtx<'_>, whole: &mut [u8], body: Range<usize>, dtype: DType, op: ReduceOp, mut access: PeerAccess<'_>) -> Result<()> {
    let buf = &mut whole[body.clone()];
    let (w, me) = (cx.world, cx.rank);
    let done = cx.dom.phase(me).load(Ordering::Relaxed) + 1;
    let elem = dtype.size();
    let bounds = super::algos::part_bounds(buf.len() / elem, w, elem);
    let others = || (0..w).filter(move |&p| p != me);
    let (lo, hi) = (bounds[me], bounds[me + 1]);
    if let PeerAccess::Attach { scratch, .. } = &mut access {
        scratch.resize((w - 1) * PEER_BLOCK / 8, 0);
    }
    let attach_failed = |p: usize, pid: u32, e: std::io::Error| {
        // A peer that exits while we copy can also show as a bad address.
        let e = match process_gone(pid) {
            Some(cause) => Error::PeerLost { rank: me, peer: p, op: cx.call.to_string(), cause },
            None => Error::io(format!("rank {me}: cross-memory attach to rank {p}'s buffer (pid {pid}) in {}", cx.call), e),
        };
        cx.fail_in_peer_buffers(e, done)
    };
    for b in (lo..hi).step_by(PEER_BLOCK) {
        let len = (b + PEER_BLOCK).min(hi) - b;
        match &mut access {
            PeerAccess::Mapped(peers) => {
                // SAFETY: bytes b..b+len of every peer's buffer (part `me`, inside its
                // `buf.len()` bytes), which only we touch until the last barrier; the
                // mappings outlive this call.
                let theirs = others().map(|p| unsafe { std::slice::from_raw_parts(peers[p].add(b), len) });
                reduce_all(dtype, op, w, &mut buf[b..b + len], theirs);
            }
            PeerAccess::Attach { peers, scratch } => {
                let blocks = crate::transport::bytemuck_bytes(scratch);
                for (block, p) in blocks.chunks_mut(PEER_BLOCK).zip(others()) {
                    let (pid, addr) = peers[p];
                    fetch(pid, addr + b as u64, &mut block[..len]).map_err(|e| attach_failed(p, pid, e))?;
                }
                reduce_all(dtype, op, w, &mut buf[b..b + len], blocks.chunks(PEER_BLOCK).map(|c| &c[..len]));
            }
        }
        // A peer that failed hands its buffer back once we have stopped writing or a grace
        // has passed: stop writing into anyone's.
        others().try_for_each(|p| cx.check_peer(p, Duration::ZERO)).map_err(|e| cx.fail_in_peer_buffers(e, done))?;
        for p in others() {
            match &access {
                // SAFETY: as above.
                PeerAccess::Mapped(peers) => unsafe { std::ptr::copy_nonoverlapping(buf[b..].as_ptr(), peers[p].add(b), len) },
                PeerAccess::Attach { peers, .. } => {
                    let (pid, addr) = peers[p];
                    put(pid, addr + b as u64, &buf[b..b + len]).map_err(|e| attach_failed(p, pid, e))?;
                }
            }
        }
    }
    if body.len() < whole.len() {
        reduce_staged_ends(cx, whole, body, dtype, op);
    }
    cx.advance(done);
    cx.wait_all(done).map_err(|e| cx.fail_in_peer_buffers(e, done))
}

/// Copies the first and last page of `buf` to the start of our staging area (before the
/// agreement's first barrier), where peers read them if the zero-copy form leaves them out
/// (see [`reduce_staged_ends`]); false where the staging area has no room for them. Nobody
/// reads that part of it now: the forms that read it (staged, and this one) end with a
/// barrier after the last read, and the small form's area lies past `staged_capacity()`.
fn stage_ends(cx: &ShmCtx<'_>, buf: &[u8]) -> bool {
    let page = page_size();
    if cx.staged_capacity() < 2 * page || buf.len() < 2 * page {
        return false;
    }
    // SAFETY: two pages at the start of our own staging area, which fit (checked).
    unsafe {
        std::ptr::copy_nonoverlapping(buf.as_ptr(), cx.dom.stage(cx.rank), page);
        std::ptr::copy_nonoverlapping(buf[buf.len() - page..].as_ptr(), cx.dom.stage(cx.rank).add(page), page);
    }
    true
}

/// The bytes of a registered buffer outside `body` (its partial first and last pages, less
/// than a page each, which no peer maps): every rank reduces them itself from the copies
/// all ranks staged (see [`stage_ends`]), in rank order, so that all get bit-identical
/// results, before the zero-copy form's last barrier (after it, a rank's staging area may
/// be written again).
fn reduce_staged_ends(cx: &ShmCtx<'_>, buf: &mut [u8], body: Range<usize>, dtype: DType, op: ReduceOp) {
    let (page, w) = (page_size(), cx.world);
    let (head, tail) = (body.start, buf.len() - body.end);
    // Where each end lies in a staging area: the head at its start, the tail at the end of
    // the second page.
    for (range, staged_at) in [(0..head, 0), (body.end..buf.len(), 2 * page - tail)] {
        if range.is_empty() {
            continue;
        }
        // SAFETY: every rank staged two pages before barrier base+1 (we are past it) and
        // writes them again only after the last barrier of this call.
        let staged = |p: usize| unsafe { std::slice::from_raw_parts(cx.dom.stage(p).add(staged_at), range.len()) };
        // A u64 scratch keeps every dtype's elements aligned.
        let mut scratch = vec![0u64; range.len().div_ceil(8)];
        let acc = &mut crate::transport::bytemuck_bytes(&mut scratch)[..range.len()];
        acc.copy_from_slice(staged(0));
        reduce_all(dtype, op, w, acc, (1..w).map(staged));
        buf[range].copy_from_slice(acc);
    }
    log::debug!("rank {}: {}: the {} bytes outside the shared pages reduced from the staged copies", cx.rank, cx.call, head + tail);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `calls` calls of `len` bytes on a host where a byte costs `plain` or
    /// `streaming` ns; returns the kinds used, true for streaming.
    fn run(ch: &mut StoreChooser, len: usize, calls: usize, plain: f64, streaming: f64) -> Vec<bool> {
        (0..calls)
            .map(|_| {
                let s = ch.choose(len, DType::F32);
                ch.record(len, DType::F32, s, Duration::from_nanos((len as f64 * if s { streaming } else { plain }) as u64));
                s
            })
            .collect()
    }

    #[test]
    fn tries_both_then_keeps_the_faster_and_probes_ever_more_seldom() {
        let mut ch = StoreChooser::default();
        let used = run(&mut ch, 1 << 20, 4000, 0.1, 0.2);
        // The first call warms up (plain, not timed), then each kind is timed twice.
        assert_eq!(&used[..5], &[false, false, true, false, true]);
        let probes: Vec<usize> = used.iter().enumerate().skip(5).filter(|(_, &s)| s).map(|(i, _)| i).collect();
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.windows(2).all(|g| g[1] >= g[0]) && gaps.iter().all(|&g| g <= PROBE_MAX as usize + 1), "{probes:?}");
        assert!(probes.len() >= 4 && probes.len() <= 12, "{probes:?}");
    }

    #[test]
    fn follows_the_host_when_it_changes_and_classes_are_separate() {
        let mut ch = StoreChooser::default();
        run(&mut ch, 1 << 20, 100, 0.1, 0.2);
        // Cross-core fetches slow down 5x: once the fast figures have left plain's last
        // three, streaming takes over, and plain is tried again only after PROBE_MIN calls,
        // then ever more seldom.
        let used = run(&mut ch, 1 << 20, 3 * PROBE_MIN as usize, 0.5, 0.2);
        let plain: Vec<usize> = used.iter().enumerate().skip(4).filter(|(_, &s)| !s).map(|(i, _)| i).collect();
        assert!(plain.len() <= 2 && plain.windows(2).all(|w| w[1] - w[0] >= PROBE_MIN as usize), "{used:?}");
        // They recover: the next probe of plain (the interval has grown to twice
        // PROBE_MIN) finds it, and plain is kept again.
        let used = run(&mut ch, 1 << 20, 3 * PROBE_MIN as usize, 0.1, 0.2);
        let back = used.iter().position(|&s| !s).expect("plain never tried again");
        assert!(back <= 2 * PROBE_MIN as usize && used[back..].iter().filter(|&&s| s).count() <= 2, "{used:?}");
        // Another size class starts from scratch, and so does another dtype.
        assert_eq!(run(&mut ch, 16 << 20, 5, 0.5, 0.2), [false, false, true, false, true]);
        assert!(!ch.choose(1 << 20, DType::BF16));
    }

    #[test]
    fn noise_does_not_flip_the_choice() {
        let mut ch = StoreChooser::default();
        let mut used = vec![];
        for i in 0..400 {
            // Within 5 % of each other, the lead changing with every call.
            let (p, s) = if i % 2 == 0 { (0.100, 0.104) } else { (0.104, 0.100) };
            used.extend(run(&mut ch, 4 << 20, 1, p, s));
        }
        // After the first tries, one kind stays in use: the other appears only as single
        // probes, ever more seldom.
        let after = &used[5..];
        let in_use = after[0];
        let probes = after.iter().filter(|&&s| s != in_use).count();
        assert!(probes <= 8 && after.windows(2).all(|w| w[0] == in_use || w[1] == in_use), "{probes} probes: {used:?}");
    }

    #[test]
    fn a_forced_kind_is_always_used() {
        let (mut plain, mut streaming) = (StoreChooser::new(StagedStores::Plain), StoreChooser::new(StagedStores::Streaming));
        for _ in 0..50 {
            assert!(!plain.choose(1 << 20, DType::F32));
            assert!(streaming.choose(1 << 20, DType::BF16));
        }
    }
}
