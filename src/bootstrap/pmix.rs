//! PMIx, the key-value exchange that Open MPI's `mpirun` (and Slurm's `srun --mpi=pmix`,
//! PRRTE's `prterun`) runs for its ranks: how ranks started by such a launcher, with no
//! gradwire variable exported, find each other. libpmix is opened at run time (as
//! libibverbs is): the build needs no PMIx, and a process that never meets a PMIx launcher
//! never loads it.
//!
//! Rank 0 makes a unique id and puts it under a key of its own; every rank commits and
//! passes the launcher's fence; the others get the id from rank 0. The id carries a fresh
//! job secret, so only processes of this job (those the launcher's PMIx server admits)
//! learn it. PMIx counts its initialisations, so a process whose MPI library already holds
//! PMIx shares it.

use super::unique_id::UniqueId;
use crate::error::{config, Error, Result};
use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::OnceLock;
use std::time::Instant;

/// The key rank 0's id is put under, followed by the number of communicators this process
/// made through PMIx before (every rank makes them in the same order).
const KEY: &str = "gradwire-unique-id";

static EXCHANGES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

// pmix_common.h (the same in PMIx 2 to 5).
const PMIX_SUCCESS: c_int = 0;
const PMIX_STRING: u16 = 3;
const PMIX_UINT32: u16 = 14;
const PMIX_GLOBAL: u8 = 3;
const PMIX_RANK_WILDCARD: u32 = u32::MAX - 1;
const PMIX_JOB_SIZE: &CStr = c"pmix.job.size";

/// `pmix_proc_t`: a namespace of at most 255 bytes and a rank.
#[repr(C)]
struct Proc {
    nspace: [c_char; 256],
    rank: u32,
}

/// `pmix_value_t`: a 16-bit type, then a union of 24 bytes at offset 8, of which only the
/// string pointer and the 32-bit unsigned integer are used here.
#[repr(C)]
struct Value {
    kind: u16,
    data: [u64; 3],
}

type Init = unsafe extern "C" fn(*mut Proc, *mut c_void, usize) -> c_int;
type Finalize = unsafe extern "C" fn(*const c_void, usize) -> c_int;
type Put = unsafe extern "C" fn(u8, *const c_char, *mut Value) -> c_int;
type Commit = unsafe extern "C" fn() -> c_int;
type Fence = unsafe extern "C" fn(*const Proc, usize, *const c_void, usize) -> c_int;
type Get = unsafe extern "C" fn(*const Proc, *const c_char, *const c_void, usize, *mut *mut Value) -> c_int;
type ErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type ValueDestruct = unsafe extern "C" fn(*mut Value);

/// The loaded library and the functions gradwire calls (never unloaded: PMIx keeps a
/// progress thread for as long as it is initialised).
struct Pmix {
    file: String,
    _lib: libloading::Library,
    init: Init,
    finalize: Finalize,
    put: Put,
    commit: Commit,
    fence: Fence,
    get: Get,
    error_string: ErrorString,
    /// Absent before PMIx 4: a got value's string is then left allocated (once per
    /// communicator).
    value_destruct: Option<ValueDestruct>,
}

const NAMES: [&str; 2] = ["libpmix.so.2", "libpmix.so"];

static LOADED: OnceLock<std::result::Result<Pmix, String>> = OnceLock::new();

fn library() -> Result<&'static Pmix> {
    LOADED.get_or_init(|| load(crate::config::env_str("GRADWIRE_PMIX_LIB").as_deref())).as_ref().map_err(|e| config(e.clone()))
}

fn load(path: Option<&str>) -> std::result::Result<Pmix, String> {
    let names: Vec<&str> = path.map_or_else(|| NAMES.to_vec(), |p| vec![p]);
    let mut why = Vec::new();
    for name in &names {
        // SAFETY: loading runs libpmix's initialisers, which only set up its own globals.
        let lib = match unsafe { libloading::Library::new(name) } {
            Ok(lib) => lib,
            Err(e) => {
                why.push(e.to_string());
                continue;
            }
        };
        let file = name.to_string();
        macro_rules! symbol {
            ($name:literal, $ty:ty) => {
                // SAFETY: the symbol is declared in pmix.h with exactly this signature (the
                // layouts are checked against the installed header by this module's test).
                unsafe { lib.get::<$ty>(concat!($name, "\0").as_bytes()) }.map(|f| *f)
            };
        }
        macro_rules! needed {
            ($name:literal, $ty:ty) => {
                symbol!($name, $ty).map_err(|e| format!("{file} has no {} ({e}): PMIx 2 or newer is needed", $name))?
            };
        }
        let init = needed!("PMIx_Init", Init);
        let finalize = needed!("PMIx_Finalize", Finalize);
        let put = needed!("PMIx_Put", Put);
        let commit = needed!("PMIx_Commit", Commit);
        let fence = needed!("PMIx_Fence", Fence);
        let get = needed!("PMIx_Get", Get);
        let error_string = needed!("PMIx_Error_string", ErrorString);
        let value_destruct = symbol!("PMIx_Value_destruct", ValueDestruct).ok();
        return Ok(Pmix { file, _lib: lib, init, finalize, put, commit, fence, get, error_string, value_destruct });
    }
    let what = path.map_or_else(|| "libpmix.so.2".to_string(), |p| format!("GRADWIRE_PMIX_LIB={p}"));
    Err(format!(
        "the launcher runs PMIx (PMIX_NAMESPACE is set) but {what} cannot be loaded ({}): install the PMIx library the launcher uses (Debian/Ubuntu: libpmix2), point GRADWIRE_PMIX_LIB at it, or export MASTER_ADDR, MASTER_PORT and GRADWIRE_JOB_SECRET",
        why.join("; ")
    ))
}

/// Whether the environment asks for PMIx: a PMIx launcher's namespace and rank are set and
/// neither a rendezvous address nor a job secret is (explicit variables win).
pub fn wanted(lookup: &dyn Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| lookup(k).is_some_and(|v| !v.trim().is_empty());
    set("PMIX_NAMESPACE") && set("PMIX_RANK") && !["GRADWIRE_MASTER_ADDR", "MASTER_ADDR", "GRADWIRE_JOB_SECRET"].iter().any(|k| set(k))
}

/// What the exchange gives a rank: the group's id (None in a job of one rank), its rank and
/// the job's size.
pub struct Shared {
    /// Rank 0's id; None in a job of one rank.
    pub id: Option<UniqueId>,
    /// This process's rank, as the launcher gave it.
    pub rank: usize,
    /// The job's size.
    pub world: usize,
}

/// Hands rank 0's unique id to every rank through the launcher's PMIx server, within
/// `deadline`. PMIx's calls block without a bound, so they run on a thread of their own;
/// past the deadline this returns an error and leaves that thread waiting.
pub fn share_unique_id(deadline: Instant) -> Result<Shared> {
    let pmix = library()?;
    let key = CString::new(format!("{KEY}-{}", EXCHANGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed))).expect("no NUL in the key");
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::Builder::new()
        .name("gradwire-pmix".into())
        .spawn(move || {
            let _ = tx.send(exchange(pmix, &key));
        })
        .map_err(|e| Error::io("PMIx: starting its thread", e))?;
    let left = deadline.saturating_duration_since(Instant::now());
    match rx.recv_timeout(left) {
        Ok(r) => r,
        Err(_) => Err(Error::Protocol(format!(
            "PMIx ({}): timed out after {} ms waiting for the launcher's fence (a rank of the job is missing or stuck)",
            pmix.file,
            left.as_millis()
        ))),
    }
}

fn exchange(pmix: &Pmix, key: &CStr) -> Result<Shared> {
    let failed = |what: &str, rc: c_int| {
        // SAFETY: PMIx_Error_string returns a static string for any status.
        let text = unsafe { CStr::from_ptr((pmix.error_string)(rc)) }.to_string_lossy();
        Error::Protocol(format!("PMIx ({}): {what} failed: {text} ({rc})", pmix.file))
    };
    let mut me = Proc { nspace: [0; 256], rank: 0 };
    // SAFETY: `me` is a pmix_proc_t the call fills; no info is passed.
    let rc = unsafe { (pmix.init)(&mut me, std::ptr::null_mut(), 0) };
    if rc != PMIX_SUCCESS {
        return Err(failed("PMIx_Init", rc));
    }
    let result = exchange_initialised(pmix, key, &me, &failed);
    // SAFETY: balances the PMIx_Init above (PMIx counts them); no info is passed.
    let rc = unsafe { (pmix.finalize)(std::ptr::null(), 0) };
    let shared = result?;
    if rc != PMIX_SUCCESS {
        return Err(failed("PMIx_Finalize", rc));
    }
    Ok(shared)
}

fn exchange_initialised(pmix: &Pmix, key: &CStr, me: &Proc, failed: &dyn Fn(&str, c_int) -> Error) -> Result<Shared> {
    let rank = me.rank as usize;
    let job = Proc { nspace: me.nspace, rank: PMIX_RANK_WILDCARD };
    let world = get(pmix, &job, PMIX_JOB_SIZE, failed)?;
    let world = match world {
        Got::Number(n) if n >= 1 && (n as usize) > rank => n as usize,
        other => return Err(Error::Protocol(format!("PMIx: the job size is {other:?} for rank {rank}"))),
    };
    if world == 1 {
        return Ok(Shared { id: None, rank, world });
    }
    if rank == 0 {
        let id = UniqueId::create()?;
        let text = CString::new(id.to_hex()?).expect("hex digits hold no NUL");
        let mut value = Value { kind: PMIX_STRING, data: [text.as_ptr() as u64, 0, 0] };
        // SAFETY: key and value are valid for the call, which copies both.
        let rc = unsafe { (pmix.put)(PMIX_GLOBAL, key.as_ptr(), &mut value) };
        if rc != PMIX_SUCCESS {
            return Err(failed("PMIx_Put", rc));
        }
        // SAFETY: no arguments.
        let rc = unsafe { (pmix.commit)() };
        if rc != PMIX_SUCCESS {
            return Err(failed("PMIx_Commit", rc));
        }
        fence(pmix, failed)?;
        return Ok(Shared { id: Some(id), rank, world });
    }
    fence(pmix, failed)?;
    let leader = Proc { nspace: me.nspace, rank: 0 };
    match get(pmix, &leader, key, failed)? {
        Got::Text(t) => Ok(Shared { id: Some(UniqueId::from_hex(&t)?), rank, world }),
        other => Err(Error::Protocol(format!("PMIx: rank 0's {} is {other:?}, not a gradwire unique id", key.to_string_lossy()))),
    }
}

/// Every rank of the job (no procs: the caller's namespace) has committed what it put.
fn fence(pmix: &Pmix, failed: &dyn Fn(&str, c_int) -> Error) -> Result<()> {
    // SAFETY: no procs (all of this namespace) and no info.
    let rc = unsafe { (pmix.fence)(std::ptr::null(), 0, std::ptr::null(), 0) };
    if rc != PMIX_SUCCESS {
        return Err(failed("PMIx_Fence", rc));
    }
    Ok(())
}

/// A value PMIx returned, as far as gradwire reads values.
enum Got {
    Text(String),
    Number(u32),
    /// Of a PMIx type gradwire does not read.
    Other(u16),
}

impl std::fmt::Debug for Got {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Got::Text(t) => write!(f, "the string {t:?}"),
            Got::Number(n) => write!(f, "{n}"),
            Got::Other(kind) => write!(f, "a value of PMIx type {kind}"),
        }
    }
}

fn get(pmix: &Pmix, proc_: &Proc, key: &CStr, failed: &dyn Fn(&str, c_int) -> Error) -> Result<Got> {
    let mut value: *mut Value = std::ptr::null_mut();
    // SAFETY: proc_ and key are valid; on success PMIx allocates *value for us.
    let rc = unsafe { (pmix.get)(proc_, key.as_ptr(), std::ptr::null(), 0, &mut value) };
    if rc != PMIX_SUCCESS || value.is_null() {
        return Err(failed(&format!("PMIx_Get({})", key.to_string_lossy()), rc));
    }
    // SAFETY: a pmix_value_t PMIx allocated; its union holds what `kind` says.
    let got = unsafe {
        match (*value).kind {
            PMIX_STRING => {
                let s = (*value).data[0] as *const c_char;
                Got::Text(if s.is_null() { String::new() } else { CStr::from_ptr(s).to_string_lossy().into_owned() })
            }
            PMIX_UINT32 => Got::Number(*((*value).data.as_ptr() as *const u32)),
            k => Got::Other(k),
        }
    };
    if let Some(destruct) = pmix.value_destruct {
        // SAFETY: PMIX_VALUE_RELEASE: the contents, then the malloc'd value itself.
        unsafe {
            destruct(value);
            libc::free(value as *mut c_void);
        }
    }
    Ok(got)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn pmix_only_where_no_rendezvous_is_named() {
        let wanted_in = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            wanted(&move |k| m.get(k).cloned())
        };
        assert!(wanted_in(&[("PMIX_NAMESPACE", "6422529"), ("PMIX_RANK", "1")]));
        assert!(!wanted_in(&[("PMIX_RANK", "1")]));
        assert!(!wanted_in(&[("PMIX_NAMESPACE", "6422529"), ("PMIX_RANK", "1"), ("MASTER_ADDR", "h")]));
        assert!(!wanted_in(&[("PMIX_NAMESPACE", "6422529"), ("PMIX_RANK", "1"), ("GRADWIRE_JOB_SECRET", "0123456789")]));
    }

    #[test]
    fn a_missing_library_says_what_to_do() {
        let e = load(Some("/nonexistent/libpmix.so.2")).err().unwrap();
        assert!(e.contains("GRADWIRE_PMIX_LIB=/nonexistent/libpmix.so.2") && e.contains("libpmix2") && e.contains("MASTER_ADDR"), "{e}");
    }

    /// Every layout and constant above against the installed `pmix.h` (Debian: libpmix-dev,
    /// which CI installs; elsewhere the test says why it skips), compiled by the C compiler.
    #[test]
    fn layouts_match_the_installed_header() {
        let include = ["/usr/lib/x86_64-linux-gnu/pmix2/include", "/usr/include/pmix", "/usr/include"]
            .into_iter()
            .find(|d| std::path::Path::new(d).join("pmix.h").exists());
        let Some(include) = include else {
            crate::test_support::skip_test("layouts_match_the_installed_header", "no pmix.h (Debian: libpmix-dev)");
            return;
        };
        let declared: Vec<(&str, u64)> = vec![
            ("sizeof(pmix_proc_t)", std::mem::size_of::<Proc>() as u64),
            ("offsetof(pmix_proc_t, rank)", std::mem::offset_of!(Proc, rank) as u64),
            ("sizeof(pmix_value_t)", std::mem::size_of::<Value>() as u64),
            ("offsetof(pmix_value_t, data)", std::mem::offset_of!(Value, data) as u64),
            ("sizeof(((pmix_value_t *)0)->type)", 2),
            ("sizeof(pmix_scope_t)", 1),
            ("PMIX_SUCCESS", PMIX_SUCCESS as u64),
            ("PMIX_STRING", PMIX_STRING as u64),
            ("PMIX_UINT32", PMIX_UINT32 as u64),
            ("PMIX_GLOBAL", PMIX_GLOBAL as u64),
            ("PMIX_RANK_WILDCARD", PMIX_RANK_WILDCARD as u64),
            ("sizeof(PMIX_JOB_SIZE)", PMIX_JOB_SIZE.to_bytes_with_nul().len() as u64),
        ];
        let same_key = format!("strcmp(PMIX_JOB_SIZE, {:?}) == 0", PMIX_JOB_SIZE.to_str().unwrap());
        let mut declared: Vec<(String, u64)> = declared.into_iter().map(|(e, v)| (e.to_string(), v)).collect();
        declared.push((same_key, 1));
        crate::test_support::assert_c_values("layouts_match_the_installed_header", Some(include), "pmix.h", &declared, "src/bootstrap/pmix.rs");
    }
}
