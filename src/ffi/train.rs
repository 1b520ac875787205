//! The C ABI of the training layer: a scheme of docs/algorithms.md (`Strategy`) on a
//! communicator, which a framework drives step by step. For ssgd, DASO and BSP the
//! framework's own optimizer makes the local update between `before_update` (gradients)
//! and `after_update` (parameters); the parameter-server schemes take whole steps.

use super::{comm, gradwire_comm_t, guard, live_handle, out, put, registry, take_handle, to_handle};
use crate::collective::layout::Span;
use crate::comm::Communicator;
use crate::error::{invalid, Result};
use crate::train::plan::Action;
use crate::train::{self, Strategy, StrategyConfig};
use std::ffi::{c_char, c_int, CStr};
use std::sync::{Arc, Mutex};

/// Opaque strategy handle (never dereferenced; its address is a registry id).
pub enum gradwire_strategy {}
/// The strategy handle type of ffi/gradwire.h.
pub type gradwire_strategy_t = gradwire_strategy;

/// A scheme and the communicator it runs on.
pub(super) struct Scheme {
    // Declared before `comm`: dropped first, as it borrows the communicator.
    strategy: Box<dyn Strategy + Send + 'static>,
    _comm: Arc<Communicator>,
    /// Parameters in the model (every buffer handed in must hold exactly this many).
    len: usize,
    /// Recorded actions not yet handed to the caller (`data=caller`).
    pending: std::collections::VecDeque<Action>,
}

impl Scheme {
    fn check(&self, n: usize, what: &str) -> Result<()> {
        if self.strategy.caller_moves_data() {
            if n != 0 {
                return Err(invalid(format!("{what}: the scheme was made with data=caller: it takes no buffer (NULL, 0) and records the steps to take")));
            }
            return Ok(());
        }
        if n != self.len {
            return Err(invalid(format!("{what}: {n} values, but the scheme was made for {} parameters", self.len)));
        }
        Ok(())
    }
}

fn scheme(p: *const gradwire_strategy_t, what: &str) -> Result<Arc<Mutex<Scheme>>> {
    live_handle(&registry().strategies, p, what, "strategy").map(|(_, s)| s)
}

/// Locks a scheme; one whose earlier call failed inside (a gradwire bug) stays refused.
fn lock<'a>(s: &'a Mutex<Scheme>, what: &str) -> Result<std::sync::MutexGuard<'a, Scheme>> {
    s.lock().map_err(|_| invalid(format!("{what}: an earlier call on this strategy failed inside gradwire; free it")))
}

/// Runs `f` on the scheme behind `p`, with `n` checked against its parameter count. (The
/// scheme itself refuses calls out of its life cycle: train::build's.)
fn with_scheme(p: *const gradwire_strategy_t, n: usize, what: &str, f: impl FnOnce(&mut Scheme) -> Result<()>) -> c_int {
    guard(|| {
        let s = scheme(p, what)?;
        let mut s = lock(&s, what)?;
        s.check(n, what)?;
        f(&mut s).map_err(|e| super::prefixed(e, what))
    })
}

/// Checks a float buffer the C caller hands in: NULL only when empty, aligned, and no
/// larger than any buffer can be.
fn float_buffer(p: *const f32, n: usize, what: &str, name: &str) -> Result<()> {
    if n > 0 && p.is_null() {
        return Err(invalid(format!("{what}: {name} is NULL")));
    }
    if n > 0 && (p as usize) % std::mem::align_of::<f32>() != 0 {
        return Err(invalid(format!("{what}: {name} is not aligned for float")));
    }
    if n > isize::MAX as usize / 4 {
        return Err(invalid(format!("{what}: {n} floats are more than any buffer can hold")));
    }
    Ok(())
}

/// `n` floats at `p` as a mutable slice.
///
/// # Safety
/// `p` must be NULL (with n 0) or valid for reads and writes of `n` floats, unaliased.
unsafe fn floats<'a>(p: *mut f32, n: usize, what: &str, name: &str) -> Result<&'a mut [f32]> {
    float_buffer(p, n, what, name)?;
    if n == 0 {
        return Ok(&mut []);
    }
    // SAFETY: non-NULL, aligned and valid for n floats (checked; the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// `n` floats at `p`, only read.
///
/// # Safety
/// `p` must be NULL (with n 0) or valid for reads of `n` floats.
unsafe fn floats_in<'a>(p: *const f32, n: usize, what: &str, name: &str) -> Result<&'a [f32]> {
    float_buffer(p, n, what, name)?;
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-NULL, aligned and readable for n floats (checked; the caller's contract).
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A 32-bit FNV-1a of `text` (exact as an f64, for the agreement check).
fn fingerprint(text: &str) -> u32 {
    text.bytes().fold(0x811c_9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x0100_0193))
}

/// # Safety
/// `scheme` and `options` must be NULL or NUL-terminated strings; `init` NULL (with n 0) or
/// readable for `n` floats; `strategy` NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_create(
    comm_p: *mut gradwire_comm_t,
    scheme: *const c_char,
    options: *const c_char,
    init: *const f32,
    n: usize,
    strategy: *mut *mut gradwire_strategy_t,
) -> c_int {
    guard(|| {
        let w = "gradwire_strategy_create";
        let (comm_id, c) = comm(comm_p, w)?;
        out(strategy, w, "strategy")?;
        if scheme.is_null() {
            return Err(invalid(format!("{w}: scheme is NULL")));
        }
        let text = |p: *const c_char, name: &str| -> Result<String> {
            // SAFETY: a NUL-terminated string by contract (NULL is handled by the caller).
            unsafe { CStr::from_ptr(p) }.to_str().map(str::to_string).map_err(|_| invalid(format!("{w}: {name} is not UTF-8")))
        };
        let scheme = text(scheme, "scheme")?;
        let options = if options.is_null() { String::new() } else { text(options, "options")? };
        let cfg = StrategyConfig::parse(&scheme, &options).map_err(|e| super::prefixed(e, w))?;
        let init = if cfg.caller_moves_data {
            // The caller keeps the model (in device memory, say): only its size comes here.
            if !init.is_null() {
                return Err(invalid(format!("{w}: with data=caller, init must be NULL (n is the parameter count)")));
            }
            vec![]
        } else {
            // SAFETY: readable for n floats by contract.
            unsafe { floats_in(init, n, w, "init")? }.to_vec()
        };
        // SAFETY: the reference lives in `Scheme` beside the Arc that keeps the communicator
        // alive, and the strategy that holds it is dropped first (field order).
        let c_ref: &'static Communicator = unsafe { &*Arc::as_ptr(&c) };
        // Every rank must make the same scheme for the same model: checked here, before the
        // scheme's own collectives could mismatch in harder-to-read ways.
        let key = [n as f64, (fingerprint(&scheme) ^ fingerprint(&options)) as f64];
        let (mut lo, mut hi) = (key, key);
        c.allreduce(&mut lo, crate::dtype::ReduceOp::Min)?;
        c.allreduce(&mut hi, crate::dtype::ReduceOp::Max)?;
        if lo != hi {
            return Err(invalid(format!(
                "{w}: the ranks disagree on the scheme, its options or the parameter count ({n} here, {} to {} over the ranks)",
                lo[0], hi[0]
            )));
        }
        let built = train::build(c_ref, &cfg, &init, n).map_err(|e| super::prefixed(e, w))?;
        let mut reg = registry();
        let id = reg.id();
        reg.strategies.insert(id, (comm_id, Arc::new(Mutex::new(Scheme { strategy: built, _comm: c, len: n, pending: Default::default() }))));
        drop(reg);
        put(strategy, to_handle(id), w, "strategy")
    })
}

/// Frees a strategy (its communicator stays as it is).
#[no_mangle]
pub extern "C" fn gradwire_strategy_free(strategy: *mut gradwire_strategy_t) -> c_int {
    // Dropped after the `let` that held the registry lock.
    guard(|| {
        let taken = take_handle(&mut registry().strategies, strategy, "gradwire_strategy_free", "strategy")?;
        drop(taken);
        Ok(())
    })
}

/// Writes what `f` reads of the scheme behind `p` into `out_p` (named `name`).
fn query<T>(p: *const gradwire_strategy_t, out_p: *mut T, what: &str, name: &str, f: impl FnOnce(&Scheme) -> T) -> c_int {
    guard(|| {
        out(out_p, what, name)?;
        let s = scheme(p, what)?;
        let v = f(&*lock(&s, what)?);
        put(out_p, v, what, name)
    })
}

/// # Safety
/// `yes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_framework_update(strategy: *mut gradwire_strategy_t, yes: *mut c_int) -> c_int {
    query(strategy, yes, "gradwire_strategy_framework_update", "yes", |s| c_int::from(s.strategy.framework_update()))
}

/// # Safety
/// `params` must be NULL (with n 0) or valid for `n` floats, unaliased, during the call.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_start(strategy: *mut gradwire_strategy_t, params: *mut f32, n: usize) -> c_int {
    guard(|| {
        let w = "gradwire_strategy_start";
        let s = scheme(strategy, w)?;
        let mut s = lock(&s, w)?;
        s.check(n, w)?;
        // SAFETY: the caller's contract.
        s.strategy.start(unsafe { floats(params, n, w, "params")? }).map_err(|e| super::prefixed(e, w))?;
        Ok(())
    })
}

/// # Safety
/// `grads` must be NULL (with n 0) or valid for `n` floats, unaliased, during the call.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_before_update(strategy: *mut gradwire_strategy_t, grads: *mut f32, n: usize, last_of_epoch: c_int) -> c_int {
    let w = "gradwire_strategy_before_update";
    // SAFETY: the caller's contract.
    with_scheme(strategy, n, w, |s| s.strategy.before_update(unsafe { floats(grads, n, w, "grads")? }, last_of_epoch != 0))
}

/// # Safety
/// `params` must be NULL (with n 0) or valid for `n` floats, unaliased, during the call.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_after_update(strategy: *mut gradwire_strategy_t, params: *mut f32, n: usize, last_of_epoch: c_int) -> c_int {
    let w = "gradwire_strategy_after_update";
    // SAFETY: the caller's contract.
    with_scheme(strategy, n, w, |s| s.strategy.after_update(unsafe { floats(params, n, w, "params")? }, last_of_epoch != 0))
}

/// # Safety
/// `params` and `grads` must be NULL (with n 0) or valid for `n` floats each, not
/// overlapping, during the call.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_step(
    strategy: *mut gradwire_strategy_t,
    params: *mut f32,
    grads: *const f32,
    n: usize,
    last_of_epoch: c_int,
) -> c_int {
    let w = "gradwire_strategy_step";
    with_scheme(strategy, n, w, |s| {
        // Checked before any slice exists: a `&mut` overlapping a `&` is undefined behaviour.
        let bytes = n.checked_mul(4).ok_or_else(|| invalid(format!("{w}: {n} floats are more than any buffer holds")))?;
        if Span::of(params, bytes).overlaps(Span::of(grads, bytes)) {
            return Err(invalid(format!("{w}: params and grads overlap")));
        }
        // SAFETY: the caller's contract; disjoint (checked); grads is only read.
        let (p, g) = unsafe { (floats(params, n, w, "params")?, floats_in(grads, n, w, "grads")?) };
        s.strategy.step(p, g, last_of_epoch != 0)
    })
}

/// # Safety
/// `params` must be NULL (with n 0) or valid for `n` floats; `mean_loss` NULL or valid for
/// a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_end_epoch(strategy: *mut gradwire_strategy_t, params: *mut f32, n: usize, loss: f64, mean_loss: *mut f64) -> c_int {
    let w = "gradwire_strategy_end_epoch";
    with_scheme(strategy, n, w, |s| {
        out(mean_loss, w, "mean_loss")?;
        // A NaN loss is averaged like any other (every rank must make this call): the mean
        // then tells every rank that one diverged.
        // SAFETY: the caller's contract.
        let mean = s.strategy.end_epoch(unsafe { floats(params, n, w, "params")? }, loss)?;
        put(mean_loss, mean, w, "mean_loss")
    })
}

/// # Safety
/// `params` must be NULL (with n 0) or valid for `n` floats during the call.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_current_model(strategy: *mut gradwire_strategy_t, params: *mut f32, n: usize) -> c_int {
    let w = "gradwire_strategy_current_model";
    with_scheme(strategy, n, w, |s| {
        // SAFETY: the caller's contract.
        let p = unsafe { floats(params, n, w, "params")? };
        let model = s.strategy.current_model(p)?;
        p.copy_from_slice(&model);
        Ok(())
    })
}

/// # Safety
/// `params` must be NULL (with n 0) or valid for `n` floats during the call.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_finish(strategy: *mut gradwire_strategy_t, params: *mut f32, n: usize) -> c_int {
    let w = "gradwire_strategy_finish";
    // SAFETY: the caller's contract.
    with_scheme(strategy, n, w, |s| s.strategy.finish(unsafe { floats(params, n, w, "params")? }))
}

/// # Safety
/// `bytes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_bytes_sent(strategy: *mut gradwire_strategy_t, bytes: *mut u64) -> c_int {
    query(strategy, bytes, "gradwire_strategy_bytes_sent", "bytes", |s| s.strategy.bytes_sent())
}

/// # Safety
/// `yes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_shared_pool(strategy: *mut gradwire_strategy_t, yes: *mut c_int) -> c_int {
    query(strategy, yes, "gradwire_strategy_shared_pool", "yes", |s| c_int::from(s.strategy.shared_pool()))
}

/// # Safety
/// `yes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_claim_batch(strategy: *mut gradwire_strategy_t, total: usize, yes: *mut c_int) -> c_int {
    let w = "gradwire_strategy_claim_batch";
    guard(|| {
        out(yes, w, "yes")?;
        let s = scheme(strategy, w)?;
        let mut s = lock(&s, w)?;
        if !s.strategy.shared_pool() {
            return Err(invalid(format!("{w}: {} gives each rank its own share of the epoch, not a shared pool", s.strategy.name())));
        }
        let more = s.strategy.claim_batch(total).map_err(|e| super::prefixed(e, w))?;
        put(yes, c_int::from(more), w, "yes")
    })
}

/// # Safety
/// `yes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_node_average_next(strategy: *mut gradwire_strategy_t, yes: *mut c_int) -> c_int {
    query(strategy, yes, "gradwire_strategy_node_average_next", "yes", |s| c_int::from(s.strategy.node_average_next()))
}

/// The index of the epoch's last batch, known before it runs (DASO's schedule looks one
/// batch ahead, as Heat's `last_batch`); other schemes ignore it.
#[no_mangle]
pub extern "C" fn gradwire_strategy_set_last_batch(strategy: *mut gradwire_strategy_t, last_batch: usize) -> c_int {
    guard(|| {
        let w = "gradwire_strategy_set_last_batch";
        let s = scheme(strategy, w)?;
        let mut s = lock(&s, w)?;
        s.strategy.set_last_batch(last_batch);
        Ok(())
    })
}

/// Hands the caller of a `data=caller` scheme the steps recorded so far, in order: up to
/// `capacity` actions, three int64 each (code, two arguments; ffi/gradwire.h), into `out`;
/// `count` receives how many. The caller calls again while `count` equals `capacity`.
///
/// # Safety
/// `out` must be NULL or valid for `3 * capacity` int64 writes; `count` NULL or valid for a
/// write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_take_actions(strategy: *mut gradwire_strategy_t, out_p: *mut i64, capacity: usize, count: *mut usize) -> c_int {
    guard(|| {
        let w = "gradwire_strategy_take_actions";
        out(count, w, "count")?;
        if capacity == 0 {
            return Err(invalid(format!("{w}: capacity is 0 (room for at least one action is needed)")));
        }
        if out_p.is_null() || (out_p as usize) % std::mem::align_of::<i64>() != 0 {
            return Err(invalid(format!("{w}: out is NULL or not aligned for int64")));
        }
        if capacity > isize::MAX as usize / 24 {
            return Err(invalid(format!("{w}: capacity {capacity} is more than any buffer holds")));
        }
        let s = scheme(strategy, w)?;
        let mut s = lock(&s, w)?;
        if !s.strategy.caller_moves_data() {
            return Err(invalid(format!("{w}: {} was not made with data=caller: it moves the data itself", s.strategy.name())));
        }
        let taken = s.strategy.take_actions();
        s.pending.extend(taken);
        let k = s.pending.len().min(capacity);
        for (i, a) in s.pending.drain(..k).enumerate() {
            // SAFETY: i < capacity, and out is valid for 3 * capacity int64 (the contract).
            unsafe { std::ptr::copy_nonoverlapping(a.encode().as_ptr(), out_p.add(3 * i), 3) };
        }
        put(count, k, w, "count")
    })
}

/// # Safety
/// `buf` must be NULL (with len 0) or valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn gradwire_strategy_describe(strategy: *mut gradwire_strategy_t, buf: *mut c_char, len: usize) -> c_int {
    guard(|| {
        let w = "gradwire_strategy_describe";
        if buf.is_null() || len == 0 {
            return Err(invalid(format!("{w}: buf is NULL or len is 0")));
        }
        let s = scheme(strategy, w)?;
        let s = lock(&s, w)?;
        let text = format!("{}{}", s.strategy.name(), s.strategy.describe());
        let n = text.len().min(len - 1);
        // SAFETY: buf is valid for len bytes (the contract) and n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr() as *const c_char, buf, n);
            *buf.add(n) = 0;
        }
        Ok(())
    })
}
