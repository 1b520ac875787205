//! The C ABI (`ffi/gradwire.h`): error codes plus thread-local error text, opaque handles,
//! and no undefined behaviour at the boundary.
//!
//! Handles given to C are opaque ids, not addresses: every call looks its handle up in a
//! registry, so NULL, a finalized communicator, a waited-for work or a pointer that never
//! came from gradwire is an error, never a dereference. Every body runs under
//! `catch_unwind`, so a bug surfaces as `GRADWIRE_ERR_INTERNAL`, not as an abort of the
//! host process.
#![allow(non_camel_case_types)]

#[cfg(feature = "cuda")]
mod gpu;
mod hierarchical;
mod train;
#[cfg(feature = "cuda")]
pub use gpu::*;
pub use hierarchical::*;
pub use train::*;

use crate::bootstrap::unique_id::{UniqueId, UNIQUE_ID_BYTES};
use crate::collective::exchange::{Counts, P2pOp};
use crate::collective::layout::{layout, Layout, Span};
use crate::collective::Collective;
use crate::collective::Request;
use crate::comm::Communicator;
use crate::dtype::{DType, ReduceOp};
use crate::engine::Work;
use crate::error::{invalid, Error, Result};
use crate::mem::{Region, Registration};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

/// Opaque communicator handle (never dereferenced; its address is a registry id).
pub enum gradwire_comm {}
/// Opaque work handle.
pub enum gradwire_work {}
/// The communicator handle type of ffi/gradwire.h.
pub type gradwire_comm_t = gradwire_comm;
/// The work handle type of ffi/gradwire.h.
pub type gradwire_work_t = gradwire_work;
/// An element type code (`GRADWIRE_FLOAT32`, ...; see ffi/gradwire.h).
pub type gradwire_dtype_t = c_uint;
/// A reduction code (`GRADWIRE_SUM`, ...; see ffi/gradwire.h).
pub type gradwire_op_t = c_uint;

/// Success.
pub const GRADWIRE_OK: c_int = 0;
/// A caught panic: a gradwire bug.
pub const GRADWIRE_ERR_INTERNAL: c_int = -1;

#[derive(Default)]
struct Registry {
    comms: HashMap<u64, Arc<Communicator>>,
    works: HashMap<u64, Work>,
    /// Allocations by address, with the communicator that made them.
    allocs: HashMap<usize, (u64, Region)>,
    /// Registered buffers by the address the caller gave, with the communicator that
    /// registered them.
    registered: HashMap<usize, (u64, Registration)>,
    /// Training schemes (`train.rs`) with the id of their communicator, each behind its
    /// own lock: a step can take long.
    strategies: HashMap<u64, (u64, Arc<Mutex<train::Scheme>>)>,
    /// Hierarchical groups (`hierarchical.rs`) with the id of their communicator.
    hierarchies: HashMap<u64, (u64, Arc<crate::collective::hierarchical::Hierarchy>)>,
    /// GPU communicators (`gpu.rs`) with the id of their communicator.
    #[cfg(feature = "cuda")]
    gpus: HashMap<u64, (u64, Arc<crate::gpu::DeviceComm>)>,
}

/// Removes and returns `ptr`'s entry in `map`, which communicator `id` must own.
fn take_one<T>(map: &mut HashMap<usize, (u64, T)>, id: u64, ptr: *mut c_void, w: &str, unknown: &str) -> Result<T> {
    match map.remove(&(ptr as usize)) {
        Some((owner, value)) if owner == id => Ok(value),
        Some(other) => {
            map.insert(ptr as usize, other);
            Err(invalid(format!("{w}: {ptr:p} belongs to another communicator")))
        }
        None => Err(invalid(format!("{w}: ptr {ptr:p} {unknown}"))),
    }
}

/// The entry of `p`, a handle of `kind` ("strategy", "hierarchy"), in `map` (id to owning
/// communicator and object): NULL and stale handles are errors naming `w`.
fn live_handle<T, V: Clone>(map: &HashMap<u64, (u64, V)>, p: *const T, w: &str, kind: &str) -> Result<(u64, V)> {
    if p.is_null() {
        return Err(invalid(format!("{w}: {kind} is NULL")));
    }
    map.get(&handle_id(p)).cloned().ok_or_else(|| stale(w, kind))
}

/// Removes `p`'s entry (as [`live_handle`] finds it) from `map` and returns its object, to be
/// dropped by the caller outside the registry lock.
fn take_handle<T, V>(map: &mut HashMap<u64, (u64, V)>, p: *const T, w: &str, kind: &str) -> Result<V> {
    if p.is_null() {
        return Err(invalid(format!("{w}: {kind} is NULL")));
    }
    map.remove(&handle_id(p)).map(|(_, v)| v).ok_or_else(|| stale(w, kind))
}

fn stale(w: &str, kind: &str) -> Error {
    invalid(format!("{w}: {kind} is not a live {kind} handle (freed already, or its communicator finalized?)"))
}

/// Removes and returns the entries of `map` that communicator `id` owns.
fn take_owned<K: Copy + Eq + std::hash::Hash, T>(map: &mut HashMap<K, (u64, T)>, id: u64) -> Vec<(u64, T)> {
    let mine: Vec<K> = map.iter().filter(|(_, (owner, _))| *owner == id).map(|(a, _)| *a).collect();
    mine.into_iter().filter_map(|a| map.remove(&a)).collect()
}

fn registry() -> std::sync::MutexGuard<'static, Registry> {
    static REG: OnceLock<Mutex<Registry>> = OnceLock::new();
    REG.get_or_init(Mutex::default).lock().unwrap_or_else(|p| p.into_inner())
}

impl Registry {
    /// A fresh handle id: random, so that no small integer, stale handle or pointer that
    /// never came from gradwire names a live object (1 in 2^60 by chance), and with the low
    /// bits clear, so that it looks like an aligned pointer.
    fn id(&mut self) -> u64 {
        loop {
            let id = rand::random::<u64>() & !0xf & (usize::MAX as u64);
            #[cfg(feature = "cuda")]
            let gpu_taken = self.gpus.contains_key(&id);
            #[cfg(not(feature = "cuda"))]
            let gpu_taken = false;
            let taken = gpu_taken
                || self.comms.contains_key(&id)
                || self.works.contains_key(&id)
                || self.strategies.contains_key(&id)
                || self.hierarchies.contains_key(&id);
            if id != 0 && !taken {
                return id;
            }
        }
    }
}

fn to_handle<T>(id: u64) -> *mut T {
    id as usize as *mut T
}

fn handle_id<T>(p: *const T) -> u64 {
    p as usize as u64
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: String) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    // During thread teardown the text has nowhere to go; the error code still does.
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// Runs `f`, turning errors into codes plus error text and panics into
/// `GRADWIRE_ERR_INTERNAL`.
fn guard(f: impl FnOnce() -> Result<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => GRADWIRE_OK,
        Ok(Err(e)) => {
            set_last_error(e.to_string());
            e.code()
        }
        Err(panic) => {
            let e = Error::Internal(crate::error::panic_message(&*panic));
            set_last_error(e.to_string());
            e.code()
        }
    }
}

fn comm(p: *const gradwire_comm_t, what: &str) -> Result<(u64, Arc<Communicator>)> {
    if p.is_null() {
        return Err(invalid(format!("{what}: comm is NULL")));
    }
    let id = handle_id(p);
    registry()
        .comms
        .get(&id)
        .cloned()
        .map(|c| (id, c))
        .ok_or_else(|| invalid(format!("{what}: comm is not a live communicator (finalized, or not from gradwire_init?)")))
}

fn out<T>(p: *mut T, what: &str, name: &str) -> Result<()> {
    if p.is_null() {
        Err(invalid(format!("{what}: {name} is NULL")))
    } else {
        Ok(())
    }
}

/// Registers a communicator and returns its handle.
fn register(c: Communicator) -> *mut gradwire_comm_t {
    let mut reg = registry();
    let id = reg.id();
    reg.comms.insert(id, Arc::new(c));
    to_handle(id)
}

/// Writes `value` through an out-parameter after checking it is not NULL.
fn put<T>(p: *mut T, value: T, what: &str, name: &str) -> Result<()> {
    out(p, what, name)?;
    // SAFETY: checked non-null; the C contract makes it valid for one write of T.
    unsafe { p.write(value) };
    Ok(())
}

/// The C array of `n` entries at `p` (`name` in messages, its length named `len`): NULL
/// only when empty, and refused when `n` entries would pass PTRDIFF_MAX bytes (a count that wraps
/// the byte size, say SIZE_MAX or 2^59 of 32-byte entries): no array is that large, and a
/// slice over one would be undefined behaviour before any entry is read.
///
/// # Safety
/// `p` must be NULL or readable for `n` entries for `'a`.
unsafe fn c_array<'a, T>(p: *const T, n: usize, w: &str, name: &str, len: &str) -> Result<&'a [T]> {
    if n == 0 {
        return Ok(&[]);
    }
    if n.checked_mul(std::mem::size_of::<T>()).is_none_or(|b| b > isize::MAX as usize) {
        let each = std::mem::size_of::<T>();
        return Err(invalid(format!("{w}: {len} {n}: that many entries of {name} ({each} bytes each) are more than any array can hold")));
    }
    if p.is_null() {
        return Err(invalid(format!("{w}: {name} is NULL with {len} {n}")));
    }
    // SAFETY: non-NULL, no larger than an object can be (checked), and readable for n
    // entries (the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

fn dtype(v: gradwire_dtype_t, what: &str) -> Result<DType> {
    u8::try_from(v)
        .ok()
        .and_then(|v| DType::from_u8(v).ok())
        .ok_or_else(|| invalid(format!("{what}: unknown dtype {v} (expected GRADWIRE_FLOAT32..GRADWIRE_BOOL)")))
}

fn redop(v: gradwire_op_t, what: &str) -> Result<ReduceOp> {
    u8::try_from(v)
        .ok()
        .and_then(|v| ReduceOp::from_u8(v).ok())
        .ok_or_else(|| invalid(format!("{what}: unknown op {v} (expected GRADWIRE_SUM..GRADWIRE_PRODUCT)")))
}

/// The host entry points' own check of a call's buffers: none is CUDA device memory. The
/// rest (sizes, presence, layout) is the request's one check, [`Request::check`], made where
/// the call is run.
fn check_buffers(c: &Communicator, req: &Request, send: *const c_void, recv: *mut c_void, what: &str) -> Result<()> {
    let (slen, rlen) = req.lengths(c.size()).map_err(|e| prefixed(e, what))?;
    host_memory(send, slen, recv, rlen, what)
}

/// `gradwire_buffer_layout`'s collective codes, in the order of ffi/gradwire.h.
pub const GRADWIRE_CALLS: [(&str, Collective); 6] = [
    ("GRADWIRE_CALL_ALLREDUCE", Collective::Allreduce),
    ("GRADWIRE_CALL_BROADCAST", Collective::Broadcast),
    ("GRADWIRE_CALL_REDUCE", Collective::Reduce),
    ("GRADWIRE_CALL_ALLGATHER", Collective::Allgather),
    ("GRADWIRE_CALL_REDUCE_SCATTER", Collective::ReduceScatter),
    ("GRADWIRE_CALL_ALLTOALL", Collective::AllToAll),
];
/// `gradwire_buffer_layout`'s answers.
pub const GRADWIRE_LAYOUT_APART: c_int = 0;
/// The same buffer.
pub const GRADWIRE_LAYOUT_IN_PLACE: c_int = 1;
/// NCCL's in-place block.
pub const GRADWIRE_LAYOUT_BLOCK: c_int = 2;
/// Overlapping otherwise: refused by every call.
pub const GRADWIRE_LAYOUT_OVERLAPPING: c_int = 3;

/// How a collective's buffers lie on this rank, by [`layout`], the rule every call applies.
///
/// # Safety
/// `layout_out` must be NULL or valid for a write; the buffers are not read.
#[no_mangle]
pub unsafe extern "C" fn gradwire_buffer_layout(
    comm_p: *mut gradwire_comm_t,
    collective: c_uint,
    sendbuf: *const c_void,
    sendbytes: usize,
    recvbuf: *const c_void,
    recvbytes: usize,
    layout_out: *mut c_int,
) -> c_int {
    guard(|| {
        let w = "gradwire_buffer_layout";
        let (_, c) = comm(comm_p, w)?;
        let (_, op) = GRADWIRE_CALLS
            .get(collective as usize)
            .ok_or_else(|| invalid(format!("{w}: unknown collective {collective} (expected GRADWIRE_CALL_ALLREDUCE..GRADWIRE_CALL_ALLTOALL)")))?;
        let answer = match layout(*op, c.rank(), Span::of(sendbuf, sendbytes), Span::of(recvbuf, recvbytes)) {
            Ok(Layout::Apart) => GRADWIRE_LAYOUT_APART,
            Ok(Layout::InPlace) => GRADWIRE_LAYOUT_IN_PLACE,
            Ok(Layout::Block) => GRADWIRE_LAYOUT_BLOCK,
            Err(_) => GRADWIRE_LAYOUT_OVERLAPPING,
        };
        put(layout_out, answer, w, "layout")
    })
}

/// An error when a buffer of a host entry point is CUDA device memory (asked of the driver
/// only in a process that loaded it: no other can hold device pointers).
fn host_memory(send: *const c_void, slen: usize, recv: *mut c_void, rlen: usize, what: &str) -> Result<()> {
    #[cfg(feature = "cuda")]
    for (p, len, name) in [(send as *const u8, slen, "sendbuf"), (recv as *const u8, rlen, "recvbuf")] {
        if len > 0 && !p.is_null() {
            crate::gpu::expect_host(p, what, name)?;
        }
    }
    #[cfg(not(feature = "cuda"))]
    let _ = (send, slen, recv, rlen, what);
    Ok(())
}

/// A blocking reducing collective after decoding its C dtype and op.
#[allow(clippy::too_many_arguments)]
fn reducing(
    comm_p: *mut gradwire_comm_t,
    kind: Collective,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    send: *const c_void,
    recv: *mut c_void,
    w: &str,
) -> c_int {
    match (dtype(dt, w), redop(op, w)) {
        (Ok(d), Ok(o)) => blocking(comm_p, Request::new(kind, d, o, count), send, recv, w),
        (Err(e), _) | (_, Err(e)) => guard(|| Err(e)),
    }
}

fn blocking(p: *mut gradwire_comm_t, req: Request, send: *const c_void, recv: *mut c_void, what: &str) -> c_int {
    guard(|| {
        let (_, c) = comm(p, what)?;
        check_buffers(&c, &req, send, recv, what)?;
        // SAFETY: checked buffers of the sizes the C contract documents, valid for the call.
        unsafe { c.run(req, send as *const u8, recv as *mut u8) }.map_err(|e| match e {
            Error::InvalidArgument(m) if !m.starts_with(what) => invalid(format!("{what}: {m}")),
            e => e,
        })
    })
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_init(comm_out: *mut *mut gradwire_comm_t) -> c_int {
    guard(|| {
        out(comm_out, "gradwire_init", "comm")?;
        let c = Communicator::init()?;
        put(comm_out, register(c), "gradwire_init", "comm")
    })
}

/// A unique id's bytes (`gradwire_unique_id_t`).
#[repr(C)]
pub struct gradwire_unique_id_t {
    /// The id's bytes (opaque to the caller).
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function.
#[no_mangle]
pub unsafe extern "C" fn gradwire_get_unique_id(id: *mut gradwire_unique_id_t) -> c_int {
    guard(|| {
        out(id, "gradwire_get_unique_id", "id")?;
        let bytes = UniqueId::create()?.to_bytes()?;
        // SAFETY: id is non-NULL (checked) and points to a gradwire_unique_id_t by contract.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (*id).internal.as_mut_ptr() as *mut u8, UNIQUE_ID_BYTES) };
        Ok(())
    })
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function.
#[no_mangle]
pub unsafe extern "C" fn gradwire_comm_init_rank(comm_out: *mut *mut gradwire_comm_t, id: *const gradwire_unique_id_t, nranks: c_int, rank: c_int) -> c_int {
    // SAFETY: the caller's contract, passed on.
    unsafe { init_rank(comm_out, id, nranks, rank, None, "gradwire_comm_init_rank") }
}

/// # Safety
/// As [`gradwire_comm_init_rank`].
#[no_mangle]
pub unsafe extern "C" fn gradwire_comm_init_rank_timeout(
    comm_out: *mut *mut gradwire_comm_t,
    id: *const gradwire_unique_id_t,
    nranks: c_int,
    rank: c_int,
    timeout_ms: i64,
) -> c_int {
    let w = "gradwire_comm_init_rank_timeout";
    if !(1..=crate::config::MAX_TIMEOUT_MS as i64).contains(&timeout_ms) {
        return guard(|| Err(invalid(format!("{w}: timeout_ms {timeout_ms} must be between 1 and {} (7 days)", crate::config::MAX_TIMEOUT_MS))));
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { init_rank(comm_out, id, nranks, rank, Some(std::time::Duration::from_millis(timeout_ms as u64)), w) }
}

/// # Safety
/// As [`gradwire_comm_init_rank`].
unsafe fn init_rank(
    comm_out: *mut *mut gradwire_comm_t,
    id: *const gradwire_unique_id_t,
    nranks: c_int,
    rank: c_int,
    timeout: Option<std::time::Duration>,
    w: &str,
) -> c_int {
    guard(|| {
        out(comm_out, w, "comm")?;
        if id.is_null() {
            return Err(invalid(format!("{w}: id is NULL")));
        }
        if nranks < 1 || rank < 0 || rank >= nranks {
            return Err(invalid(format!("{w}: rank {rank} of nranks {nranks}: need nranks >= 1 and 0 <= rank < nranks")));
        }
        // SAFETY: id is non-NULL (checked) and points to a gradwire_unique_id_t by contract.
        let bytes = unsafe { std::slice::from_raw_parts((*id).internal.as_ptr() as *const u8, UNIQUE_ID_BYTES) };
        let id = UniqueId::from_bytes(bytes).map_err(|e| invalid(format!("{w}: {e}")))?;
        let c = Communicator::from_unique_id_with_timeout(&id, nranks as usize, rank as usize, timeout)?;
        put(comm_out, register(c), w, "comm")
    })
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_comm_rank(comm_p: *const gradwire_comm_t, rank: *mut c_int) -> c_int {
    guard(|| {
        let (_, c) = comm(comm_p, "gradwire_comm_rank")?;
        put(rank, c.rank() as c_int, "gradwire_comm_rank", "rank")
    })
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_comm_size(comm_p: *const gradwire_comm_t, size: *mut c_int) -> c_int {
    guard(|| {
        let (_, c) = comm(comm_p, "gradwire_comm_size")?;
        put(size, c.size() as c_int, "gradwire_comm_size", "size")
    })
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_comm_split(comm_p: *mut gradwire_comm_t, color: c_int, key: c_int, newcomm: *mut *mut gradwire_comm_t) -> c_int {
    guard(|| {
        let (_, c) = comm(comm_p, "gradwire_comm_split")?;
        out(newcomm, "gradwire_comm_split", "newcomm")?;
        let handle = c.split(color, key)?.map(register).unwrap_or(std::ptr::null_mut());
        put(newcomm, handle, "gradwire_comm_split", "newcomm")
    })
}

/// # Safety
/// `newcomm` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_comm_split_type(comm_p: *mut gradwire_comm_t, split_type: c_int, newcomm: *mut *mut gradwire_comm_t) -> c_int {
    guard(|| {
        let w = "gradwire_comm_split_type";
        let (_, c) = comm(comm_p, w)?;
        out(newcomm, w, "newcomm")?;
        let split = match split_type {
            0 => c.split_node_local()?,
            1 => c.split_cross_node()?,
            other => return Err(invalid(format!("{w}: split_type {other} is neither GRADWIRE_SPLIT_NODE (0) nor GRADWIRE_SPLIT_CROSS_NODE (1)"))),
        };
        put(newcomm, register(split), w, "newcomm")
    })
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_allreduce(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
) -> c_int {
    reducing(comm_p, Collective::Allreduce, count, dt, op, sendbuf, recvbuf, "gradwire_allreduce")
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_iallreduce(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    work: *mut *mut gradwire_work_t,
) -> c_int {
    let w = "gradwire_iallreduce";
    nonblocking(comm_p, w, work, sendbuf, recvbuf, || Ok(Request::new(Collective::Allreduce, dtype(dt, w)?, redop(op, w)?, count)))
}

/// Starts the collective `req()` describes and puts its work handle in `work`.
fn nonblocking(
    comm_p: *mut gradwire_comm_t,
    w: &str,
    work: *mut *mut gradwire_work_t,
    send: *const c_void,
    recv: *mut c_void,
    req: impl FnOnce() -> Result<Request>,
) -> c_int {
    guard(|| {
        let (_, c) = comm(comm_p, w)?;
        out(work, w, "work")?;
        let req = req()?;
        check_buffers(&c, &req, send, recv, w)?;
        // SAFETY: checked buffers; the caller keeps them valid until the work completes.
        let handle = unsafe { c.start(req, send as *const u8, recv as *mut u8) }.map_err(|e| prefixed(e, w))?;
        put_work(work, handle, w)
    })
}

/// Registers `handle` and puts its id in `work`.
fn put_work(work: *mut *mut gradwire_work_t, handle: Work, w: &str) -> Result<()> {
    let id = {
        let mut reg = registry();
        let id = reg.id();
        reg.works.insert(id, handle);
        id
    };
    put(work, to_handle(id), w, "work")
}

fn root_of(root: c_int, w: &str) -> Result<usize> {
    usize::try_from(root).map_err(|_| invalid(format!("{w}: root {root} is negative")))
}

/// # Safety
/// As `gradwire_broadcast`, with the buffer valid until the work completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_ibroadcast(
    comm_p: *mut gradwire_comm_t,
    buf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    root: c_int,
    work: *mut *mut gradwire_work_t,
) -> c_int {
    let w = "gradwire_ibroadcast";
    nonblocking(comm_p, w, work, buf, buf, || {
        Ok(Request { root: root_of(root, w)?, ..Request::new(Collective::Broadcast, dtype(dt, w)?, ReduceOp::Sum, count) })
    })
}

/// # Safety
/// As `gradwire_allgather`, with the buffers valid until the work completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_iallgather(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dt: gradwire_dtype_t,
    work: *mut *mut gradwire_work_t,
) -> c_int {
    let w = "gradwire_iallgather";
    nonblocking(comm_p, w, work, sendbuf, recvbuf, || Ok(Request::new(Collective::Allgather, dtype(dt, w)?, ReduceOp::Sum, sendcount)))
}

/// # Safety
/// As `gradwire_reduce_scatter`, with the buffers valid until the work completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_ireduce_scatter(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    work: *mut *mut gradwire_work_t,
) -> c_int {
    let w = "gradwire_ireduce_scatter";
    nonblocking(comm_p, w, work, sendbuf, recvbuf, || Ok(Request::new(Collective::ReduceScatter, dtype(dt, w)?, redop(op, w)?, recvcount)))
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_reduce(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    root: c_int,
) -> c_int {
    let w = "gradwire_reduce";
    match (dtype(dt, w), redop(op, w), root_of(root, w)) {
        (Ok(d), Ok(o), Ok(root)) => blocking(comm_p, Request { root, ..Request::new(Collective::Reduce, d, o, count) }, sendbuf, recvbuf, w),
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => guard(|| Err(e)),
    }
}

/// The counts of an all-to-all from C: `sendcounts`/`recvcounts` arrays of `size` entries,
/// or (both NULL) `count` elements to and from every rank; the two buffers must not overlap.
fn alltoall_counts(c: &Communicator, count: usize, sendcounts: *const usize, recvcounts: *const usize, w: &str) -> Result<Counts> {
    match (sendcounts.is_null(), recvcounts.is_null()) {
        (true, true) => Ok(Counts::uniform(count, c.size())),
        (false, false) => {
            // SAFETY: by contract arrays of one entry per rank.
            let (s, r) = unsafe { (c_array(sendcounts, c.size(), w, "sendcounts", "size")?, c_array(recvcounts, c.size(), w, "recvcounts", "size")?) };
            Ok(Counts { send: s.to_vec(), recv: r.to_vec() })
        }
        _ => Err(invalid(format!("{w}: sendcounts and recvcounts must both be NULL (equal split) or both arrays"))),
    }
}

/// The host entry point's own check of an all-to-all's buffers: sizes a buffer can have,
/// none of CUDA device memory (the rest: the call's one check, where it is run).
fn alltoall_buffers(c: &Communicator, counts: &Counts, dt: DType, send: *const c_void, recv: *mut c_void, w: &str) -> Result<()> {
    let (sl, rl) = counts.bytes(dt, c.size()).map_err(|e| prefixed(e, w))?;
    host_memory(send, sl, recv, rl, w)
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_alltoall(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    sendcounts: *const usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    count: usize,
    dt: gradwire_dtype_t,
) -> c_int {
    let w = "gradwire_alltoall";
    if sendcounts.is_null() && recvcounts.is_null() {
        // Equal blocks: the collective of its own (through shared memory on one host).
        return match dtype(dt, w) {
            Ok(d) => blocking(comm_p, Request::new(Collective::AllToAll, d, ReduceOp::Sum, count), sendbuf, recvbuf, w),
            Err(e) => guard(|| Err(e)),
        };
    }
    guard(|| {
        let (_, c) = comm(comm_p, w)?;
        let d = dtype(dt, w)?;
        let counts = alltoall_counts(&c, count, sendcounts, recvcounts, w)?;
        alltoall_buffers(&c, &counts, d, sendbuf, recvbuf, w)?;
        // SAFETY: checked buffers, valid for the call by contract.
        unsafe { c.run_alltoall(d, counts, sendbuf as *const u8, recvbuf as *mut u8) }.map_err(|e| prefixed(e, w))
    })
}

/// # Safety
/// As `gradwire_alltoall`, with the buffers valid until the work completes.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gradwire_ialltoall(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    sendcounts: *const usize,
    recvbuf: *mut c_void,
    recvcounts: *const usize,
    count: usize,
    dt: gradwire_dtype_t,
    work: *mut *mut gradwire_work_t,
) -> c_int {
    let w = "gradwire_ialltoall";
    if sendcounts.is_null() && recvcounts.is_null() {
        // Equal blocks: the collective of its own (through shared memory on one host).
        return nonblocking(comm_p, w, work, sendbuf, recvbuf, || Ok(Request::new(Collective::AllToAll, dtype(dt, w)?, ReduceOp::Sum, count)));
    }
    guard(|| {
        let (_, c) = comm(comm_p, w)?;
        out(work, w, "work")?;
        let d = dtype(dt, w)?;
        let counts = alltoall_counts(&c, count, sendcounts, recvcounts, w)?;
        alltoall_buffers(&c, &counts, d, sendbuf, recvbuf, w)?;
        // SAFETY: checked buffers; the caller keeps them valid until the work completes.
        let handle = unsafe { c.start_alltoall(d, counts, sendbuf as *const u8, recvbuf as *mut u8) }.map_err(|e| prefixed(e, w))?;
        put_work(work, handle, w)
    })
}

/// `gradwire_p2p_op_t.kind` of a send.
pub const GRADWIRE_P2P_SEND: c_uint = 0;
/// `gradwire_p2p_op_t.kind` of a receive.
pub const GRADWIRE_P2P_RECV: c_uint = 1;

/// One message of a point-to-point batch (`gradwire_p2p_op_t`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct gradwire_p2p_op_t {
    /// [`GRADWIRE_P2P_SEND`] or [`GRADWIRE_P2P_RECV`].
    pub kind: c_uint,
    /// The other rank.
    pub peer: c_int,
    /// Matched in order between two ranks: sender's and receiver's must agree.
    pub tag: c_uint,
    /// Element type.
    pub dtype: gradwire_dtype_t,
    /// Elements.
    pub count: usize,
    /// The message's data (read for a send, written for a receive).
    pub buf: *mut c_void,
}

/// The checked ops of a batch (`nops` entries at `ops`).
///
/// # Safety
/// `ops` must be NULL (with nops 0) or readable for `nops` entries.
unsafe fn p2p_ops(ops: *const gradwire_p2p_op_t, nops: usize, w: &str) -> Result<Vec<P2pOp>> {
    // SAFETY: readable for nops entries (the caller's contract).
    let raw = unsafe { c_array(ops, nops, w, "ops", "nops")? };
    raw.iter()
        .enumerate()
        .map(|(i, o)| {
            let send = match o.kind {
                GRADWIRE_P2P_SEND => true,
                GRADWIRE_P2P_RECV => false,
                k => return Err(invalid(format!("{w}: ops[{i}].kind is {k} (GRADWIRE_P2P_SEND or GRADWIRE_P2P_RECV)"))),
            };
            let peer = usize::try_from(o.peer).map_err(|_| invalid(format!("{w}: ops[{i}].peer {} is negative", o.peer)))?;
            Ok(P2pOp { send, peer, tag: o.tag, dtype: dtype(o.dtype, &format!("{w}: ops[{i}]"))?, count: o.count, buf: o.buf as *mut u8 })
        })
        .collect()
}

/// # Safety
/// `ops` must be NULL (with nops 0) or readable for `nops` entries, each buffer valid for
/// its count (readable for a send, writable for a receive), receive buffers overlapping no
/// other buffer of the batch, until the call returns.
#[no_mangle]
pub unsafe extern "C" fn gradwire_p2p_batch(comm_p: *mut gradwire_comm_t, ops: *const gradwire_p2p_op_t, nops: usize) -> c_int {
    guard(|| {
        let w = "gradwire_p2p_batch";
        let (_, c) = comm(comm_p, w)?;
        // SAFETY: the caller's contract; the batch checks NULL buffers, peers and counts.
        let ops = unsafe { p2p_ops(ops, nops, w)? };
        // SAFETY: as above.
        unsafe { c.run_p2p_batch(&ops) }.map_err(|e| prefixed(e, w))
    })
}

/// # Safety
/// As for `gradwire_p2p_batch`, with the buffers valid until the work completes; `work`
/// must be valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_ip2p_batch(
    comm_p: *mut gradwire_comm_t,
    ops: *const gradwire_p2p_op_t,
    nops: usize,
    work: *mut *mut gradwire_work_t,
) -> c_int {
    guard(|| {
        let w = "gradwire_ip2p_batch";
        let (_, c) = comm(comm_p, w)?;
        out(work, w, "work")?;
        // SAFETY: the caller's contract; the batch checks NULL buffers, peers and counts.
        let ops = unsafe { p2p_ops(ops, nops, w)? };
        // SAFETY: as above.
        let handle = unsafe { c.start_p2p_batch(&ops) }.map_err(|e| prefixed(e, w))?;
        put_work(work, handle, w)
    })
}

/// # Safety
/// `buf` must be NULL (with count 0) or readable for `count` elements of `dt`.
#[no_mangle]
pub unsafe extern "C" fn gradwire_send(
    comm_p: *mut gradwire_comm_t,
    buf: *const c_void,
    count: usize,
    dt: gradwire_dtype_t,
    peer: c_int,
    tag: c_uint,
) -> c_int {
    guard(|| {
        let w = "gradwire_send";
        let (_, c) = comm(comm_p, w)?;
        let peer = usize::try_from(peer).map_err(|_| invalid(format!("{w}: peer {peer} is negative")))?;
        // SAFETY: the caller's contract; send_raw checks NULL and the byte count.
        unsafe { c.send_raw(buf as *const u8, count, dtype(dt, w)?, peer, tag) }.map_err(|e| prefixed(e, w))
    })
}

/// # Safety
/// `buf` must be NULL (with count 0) or writable for `count` elements of `dt`.
#[no_mangle]
pub unsafe extern "C" fn gradwire_recv(comm_p: *mut gradwire_comm_t, buf: *mut c_void, count: usize, dt: gradwire_dtype_t, peer: c_int, tag: c_uint) -> c_int {
    guard(|| {
        let w = "gradwire_recv";
        let (_, c) = comm(comm_p, w)?;
        let peer = usize::try_from(peer).map_err(|_| invalid(format!("{w}: peer {peer} is negative")))?;
        // SAFETY: the caller's contract; recv_raw checks NULL and the byte count.
        unsafe { c.recv_raw(buf as *mut u8, count, dtype(dt, w)?, peer, tag) }.map_err(|e| prefixed(e, w))
    })
}

/// An invalid-argument error with the C function's name in front.
fn prefixed(e: Error, what: &str) -> Error {
    match e {
        Error::InvalidArgument(m) if !m.starts_with(what) => invalid(format!("{what}: {m}")),
        e => e,
    }
}

/// Waits up to `timeout_ms` for a non-blocking call (negative: until it completes, within
/// its own deadline); frees the handle once it has completed and returns its result
/// (`GRADWIRE_ERR_IN_PROGRESS`, the handle still valid, when it is still running).
#[no_mangle]
pub extern "C" fn gradwire_wait(work: *mut gradwire_work_t, timeout_ms: i64) -> c_int {
    guard(|| {
        if work.is_null() {
            return Err(invalid("gradwire_wait: work is NULL"));
        }
        let id = handle_id(work);
        let mut w = registry().works.remove(&id).ok_or_else(|| invalid("gradwire_wait: work is not a live work handle (already waited for?)"))?;
        if timeout_ms < 0 {
            return w.wait();
        }
        match w.wait_timeout(Duration::from_millis(timeout_ms as u64)) {
            Ok(true) => Ok(()),
            Ok(false) => {
                registry().works.insert(id, w);
                Err(Error::StillRunning { waited_ms: timeout_ms as u64 })
            }
            Err(e) => Err(e),
        }
    })
}

/// # Safety
/// `done` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_test(work: *mut gradwire_work_t, done: *mut c_int) -> c_int {
    guard(|| {
        if work.is_null() {
            return Err(invalid("gradwire_test: work is NULL"));
        }
        out(done, "gradwire_test", "done")?;
        let id = handle_id(work);
        let finished =
            registry().works.get(&id).map(|w| w.test()).ok_or_else(|| invalid("gradwire_test: work is not a live work handle (already waited for?)"))?;
        // SAFETY: done is non-NULL (checked) and valid for a write (the contract).
        unsafe { *done = c_int::from(finished) };
        Ok(())
    })
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_broadcast(comm_p: *mut gradwire_comm_t, buf: *mut c_void, count: usize, dt: gradwire_dtype_t, root: c_int) -> c_int {
    let w = "gradwire_broadcast";
    match (dtype(dt, w), usize::try_from(root)) {
        (Ok(d), Ok(root)) => blocking(comm_p, Request { root, ..Request::new(Collective::Broadcast, d, ReduceOp::Sum, count) }, buf, buf, w),
        (Err(e), _) => guard(|| Err(e)),
        (_, Err(_)) => guard(|| Err(invalid(format!("{w}: root {root} is negative")))),
    }
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_allgather(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    sendcount: usize,
    dt: gradwire_dtype_t,
) -> c_int {
    let w = "gradwire_allgather";
    match dtype(dt, w) {
        Ok(d) => blocking(comm_p, Request::new(Collective::Allgather, d, ReduceOp::Sum, sendcount), sendbuf, recvbuf, w),
        Err(e) => guard(|| Err(e)),
    }
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_reduce_scatter(
    comm_p: *mut gradwire_comm_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    recvcount: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
) -> c_int {
    reducing(comm_p, Collective::ReduceScatter, recvcount, dt, op, sendbuf, recvbuf, "gradwire_reduce_scatter")
}

/// Returns once every rank of the communicator has entered the barrier.
#[no_mangle]
pub extern "C" fn gradwire_barrier(comm_p: *mut gradwire_comm_t) -> c_int {
    guard(|| comm(comm_p, "gradwire_barrier")?.1.barrier())
}

/// # Safety
/// Pointer arguments must be NULL or valid for the reads and writes `ffi/gradwire.h`
/// documents for this function; buffers stay valid until the call (or its work) completes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_alloc(comm_p: *mut gradwire_comm_t, bytes: usize, ptr: *mut *mut c_void) -> c_int {
    guard(|| {
        let w = "gradwire_alloc";
        let (id, _) = comm(comm_p, w)?;
        out(ptr, w, "ptr")?;
        if bytes == 0 {
            return Err(invalid(format!("{w}: bytes is 0")));
        }
        if bytes > isize::MAX as usize / 2 {
            return Err(invalid(format!("{w}: {bytes} bytes is more than this process can map")));
        }
        let region = Region::shared("gradwire-alloc", bytes)?;
        let addr = region.as_ptr();
        registry().allocs.insert(addr as usize, (id, region));
        put(ptr, addr as *mut c_void, w, "ptr")
    })
}

/// Frees memory `gradwire_alloc` gave on this communicator.
#[no_mangle]
pub extern "C" fn gradwire_free(comm_p: *mut gradwire_comm_t, ptr: *mut c_void) -> c_int {
    guard(|| {
        let w = "gradwire_free";
        let (id, _) = comm(comm_p, w)?;
        if ptr.is_null() {
            return Err(invalid(format!("{w}: ptr is NULL")));
        }
        take_one(&mut registry().allocs, id, ptr, w, "did not come from gradwire_alloc (or was freed already)").map(drop)
    })
}

/// # Safety
/// `ptr..ptr + bytes` must be memory of this process that the caller may read and write,
/// written by nobody during the call, and allocated until `gradwire_deregister`.
#[no_mangle]
pub unsafe extern "C" fn gradwire_register(comm_p: *mut gradwire_comm_t, ptr: *mut c_void, bytes: usize) -> c_int {
    guard(|| {
        let w = "gradwire_register";
        let (id, _) = comm(comm_p, w)?;
        if ptr.is_null() {
            return Err(invalid(format!("{w}: ptr is NULL")));
        }
        {
            let mut reg = registry();
            if reg.registered.get(&(ptr as usize)).is_some_and(|(_, r)| r.is_live()) {
                return Err(invalid(format!("{w}: {ptr:p} is registered already")));
            }
            // Freed or unmapped without gradwire_deregister: the address may be registered
            // again (the old registration keeps nothing of it).
            if let Some((_, stale)) = reg.registered.remove(&(ptr as usize)) {
                stale.forget();
            }
        }
        // Outside the registry lock, which every call takes: this copies the buffer. Two
        // threads registering the same buffer at once cannot both succeed (the overlap).
        // SAFETY: the caller's promise above.
        let registration = unsafe { Registration::new(ptr.cast(), bytes) }.map_err(|e| match e {
            Error::InvalidArgument(why) => invalid(format!("{w}: {why}")),
            other => other,
        })?;
        registry().registered.insert(ptr as usize, (id, registration));
        Ok(())
    })
}

/// Gives back memory registered with `gradwire_register`: its pages become private again,
/// with their contents.
#[no_mangle]
pub extern "C" fn gradwire_deregister(comm_p: *mut gradwire_comm_t, ptr: *mut c_void) -> c_int {
    guard(|| {
        let w = "gradwire_deregister";
        let (id, _) = comm(comm_p, w)?;
        // Dropped outside the registry lock: it copies the pages back.
        let registration = take_one(&mut registry().registered, id, ptr, w, "is not registered (or was deregistered already)")?;
        drop(registration);
        Ok(())
    })
}

/// Destroys a communicator, its strategies, hierarchies and GPU communicators; waits for
/// its pending calls.
#[no_mangle]
pub extern "C" fn gradwire_finalize(comm_p: *mut gradwire_comm_t) -> c_int {
    guard(|| {
        let (id, _) = comm(comm_p, "gradwire_finalize")?;
        let (c0, c1, regions, registrations) = {
            let mut reg = registry();
            let c = reg.comms.remove(&id);
            // The strategies and hierarchies on this communicator go with it: each strategy
            // holds it alive.
            let strategies = take_owned(&mut reg.strategies, id);
            let hierarchies = take_owned(&mut reg.hierarchies, id);
            #[cfg(feature = "cuda")]
            let hierarchies = (hierarchies, take_owned(&mut reg.gpus, id));
            let regions = take_owned(&mut reg.allocs, id);
            let registrations = take_owned(&mut reg.registered, id);
            (c, (strategies, hierarchies), regions, registrations)
        };
        // Dropped outside the registry lock: joining the progress thread may take until the
        // running operation's deadline. The strategies and communicator first: a
        // non-blocking operation may still be working in these regions.
        drop(c1);
        drop(c0);
        drop(regions);
        // Not given back as private pages: the buffers may have been freed and hold other
        // objects now, which other threads may be writing (see `Registration::forget`).
        registrations.into_iter().for_each(|(_, r)| r.forget());
        Ok(())
    })
}

/// The message of this thread's last failed call (valid until its next call), or "".
#[no_mangle]
pub extern "C" fn gradwire_last_error() -> *const c_char {
    // After this thread's locals are gone (a C++ thread_local destructor), empty text.
    LAST_ERROR.try_with(|e| e.borrow().as_ptr()).unwrap_or(c"".as_ptr())
}
