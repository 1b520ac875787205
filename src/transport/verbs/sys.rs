//! libibverbs, opened at run time (as NCCL's `ibvwrap` does): the types, constants and
//! functions of `<infiniband/verbs.h>` that the verbs transport uses, and nothing else.
//!
//! Loading at run time means the build needs no rdma-core (no cmake, libclang or headers)
//! and the binary and `libgradwire.so` start on hosts without it: the transport then
//! reports itself unavailable with the reason, and shm and tcp work as before.
//!
//! The layouts are written out by hand from rdma-core's `verbs.h` (stable ABI since
//! libibverbs 1.1). Where gradwire only reads a library-owned object (`ibv_context`,
//! `ibv_cq`, `ibv_qp`, `ibv_mr`) the struct declares only the prefix it reads; every struct
//! gradwire fills or lets the library fill is complete. The test at the bottom compiles a C
//! program against the system's header, wherever it and a C compiler exist, and compares
//! every size, offset and constant declared here.
//!
//! `ibv_poll_cq`, `ibv_post_send` and `ibv_post_recv` are inline functions in `verbs.h` that
//! call through the context's ops table; [`poll_cq`], [`post_send`] and [`post_recv`] do the
//! same.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_void};
use std::sync::OnceLock;

/// Opaque library objects, only ever behind pointers.
#[repr(C)]
pub struct ibv_device {
    _private: [u8; 0],
}
#[repr(C)]
pub struct ibv_pd {
    _private: [u8; 0],
}

type PollCq = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
type PostSend = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
type PostRecv = unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;

/// `struct ibv_context_ops`, up to `post_recv`: the data-path entries the inline verbs use.
/// The slots before them are compatibility stubs and management calls gradwire never takes
/// from the table.
#[repr(C)]
pub struct ibv_context_ops {
    _before_poll_cq: [*mut c_void; 11],
    pub poll_cq: Option<PollCq>,
    _before_post_send: [*mut c_void; 13],
    pub post_send: Option<PostSend>,
    pub post_recv: Option<PostRecv>,
}

/// `struct ibv_context`, up to its ops table (read only).
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
}

/// `struct ibv_cq`, first field only (read only).
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
}

/// `struct ibv_qp`, up to `qp_num` (read only).
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
}

/// `struct ibv_mr` (read only).
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_device_attr` (filled by `ibv_query_device`).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    /// From `max_qp` to `max_srq_sge`: 29 `int`s gradwire does not read.
    pub limits: [c_int; 29],
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr` (filled by `ibv_query_port`; the exported symbol writes its
/// libibverbs-1.1 prefix, up to `link_layer`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// `union ibv_gid`: 16 bytes, whose other member (two big-endian 64-bit words) gives it
/// 8-byte alignment.
#[repr(C, align(8))]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_gid_entry` (filled by `ibv_query_gid_table`).
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_qp_attr {
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// The `wr` union of `struct ibv_send_wr` (its `ud` member is never used here and is
/// smaller than `atomic`).
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
}

/// `struct ibv_send_wr`. The `imm_data` union's members are both 32-bit words; the
/// `qp_type` (XRC) and `bind_mw`/`tso` unions are never used here.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: u32,
    pub send_flags: u32,
    /// Immediate data in network byte order.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: u32,
    /// The `bind_mw` / `tso` union, unused here.
    pub bind_mw: [u64; 6],
}

impl Default for ibv_send_wr {
    fn default() -> Self {
        ibv_send_wr {
            wr_id: 0,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
            opcode: 0,
            send_flags: 0,
            imm_data: 0,
            wr: ibv_send_wr_wr { atomic: ibv_send_wr_atomic::default() },
            qp_type: 0,
            bind_mw: [0; 6],
        }
    }
}

#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc` (filled by `ibv_poll_cq`).
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// Immediate data in network byte order, when `wc_flags` has `IBV_WC_WITH_IMM`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

impl ibv_wc {
    pub fn is_ok(&self) -> bool {
        self.status == IBV_WC_SUCCESS
    }
    /// The immediate data in network byte order, if the completion carries one.
    pub fn imm(&self) -> Option<u32> {
        (self.wc_flags & IBV_WC_WITH_IMM != 0).then_some(self.imm_data)
    }
}

// enum ibv_gid_type
pub const IBV_GID_TYPE_ROCE_V1: u32 = 1;
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
// enum ibv_port_state
pub const IBV_PORT_ACTIVE: u32 = 4;
// enum ibv_link_layer
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
// enum ibv_mtu
pub const IBV_MTU_256: u32 = 1;
pub const IBV_MTU_512: u32 = 2;
pub const IBV_MTU_1024: u32 = 3;
pub const IBV_MTU_2048: u32 = 4;
pub const IBV_MTU_4096: u32 = 5;
// enum ibv_access_flags
pub const IBV_ACCESS_LOCAL_WRITE: u32 = 1;
pub const IBV_ACCESS_REMOTE_WRITE: u32 = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: u32 = 1 << 2;
pub const IBV_ACCESS_REMOTE_ATOMIC: u32 = 1 << 3;
// enum ibv_qp_type
pub const IBV_QPT_RC: u32 = 2;
// enum ibv_qp_state
pub const IBV_QPS_INIT: u32 = 1;
pub const IBV_QPS_RTR: u32 = 2;
pub const IBV_QPS_RTS: u32 = 3;
// enum ibv_qp_attr_mask
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PKEY_INDEX: c_int = 1 << 4;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: c_int = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: c_int = 1 << 17;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;
// enum ibv_wr_opcode
pub const IBV_WR_RDMA_WRITE: u32 = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: u32 = 1;
pub const IBV_WR_SEND_WITH_IMM: u32 = 3;
pub const IBV_WR_RDMA_READ: u32 = 4;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: u32 = 6;
// enum ibv_send_flags
pub const IBV_SEND_SIGNALED: u32 = 1 << 1;
pub const IBV_SEND_INLINE: u32 = 1 << 3;
// enum ibv_wc_status
pub const IBV_WC_SUCCESS: u32 = 0;
pub const IBV_WC_WR_FLUSH_ERR: u32 = 5;
pub const IBV_WC_REM_ACCESS_ERR: u32 = 10;
pub const IBV_WC_RETRY_EXC_ERR: u32 = 12;
// enum ibv_wc_opcode
pub const IBV_WC_RECV_RDMA_WITH_IMM: u32 = 129;
// enum ibv_wc_flags
pub const IBV_WC_WITH_IMM: u32 = 1 << 1;

/// Declares the exported functions gradwire calls, resolved by name when the library loads.
macro_rules! exported {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The loaded library and its exported functions (the library is never unloaded:
        /// its providers live as long as the process).
        pub struct Verbs {
            /// Which file was loaded, for messages.
            pub file: String,
            _lib: libloading::Library,
            $(pub $name: unsafe extern "C" fn($($arg),*) -> $ret,)*
        }

        impl Verbs {
            fn resolve(lib: libloading::Library, file: String) -> Result<Verbs, String> {
                $(
                    // SAFETY: the symbol is declared in verbs.h with exactly this signature
                    // (the layouts are checked by this module's test).
                    let $name = unsafe { lib.get::<unsafe extern "C" fn($($arg),*) -> $ret>(concat!(stringify!($name), "\0").as_bytes()) }
                        .map(|f| *f)
                        .map_err(|e| format!("{file} has no {} ({e}): rdma-core 32 or newer is needed", stringify!($name)))?;
                )*
                Ok(Verbs { file, _lib: lib, $($name,)* })
            }
        }
    };
}

exported! {
    ibv_get_device_list: fn(*mut c_int) -> *mut *mut ibv_device;
    ibv_free_device_list: fn(*mut *mut ibv_device) -> ();
    ibv_get_device_name: fn(*mut ibv_device) -> *const c_char;
    ibv_open_device: fn(*mut ibv_device) -> *mut ibv_context;
    ibv_close_device: fn(*mut ibv_context) -> c_int;
    ibv_query_device: fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    ibv_query_port: fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    _ibv_query_gid_table: fn(*mut ibv_context, *mut ibv_gid_entry, usize, u32, usize) -> isize;
    ibv_port_state_str: fn(u32) -> *const c_char;
    ibv_wc_status_str: fn(u32) -> *const c_char;
    ibv_alloc_pd: fn(*mut ibv_context) -> *mut ibv_pd;
    ibv_dealloc_pd: fn(*mut ibv_pd) -> c_int;
    ibv_reg_mr: fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    ibv_dereg_mr: fn(*mut ibv_mr) -> c_int;
    ibv_create_cq: fn(*mut ibv_context, c_int, *mut c_void, *mut c_void, c_int) -> *mut ibv_cq;
    ibv_destroy_cq: fn(*mut ibv_cq) -> c_int;
    ibv_create_qp: fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv_destroy_qp: fn(*mut ibv_qp) -> c_int;
    ibv_modify_qp: fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
}

/// What a user sees when no libibverbs can be loaded.
pub const INSTALL_HINT: &str = "install rdma-core's libibverbs1 and a provider package (Debian/Ubuntu: libibverbs1 ibverbs-providers; RHEL: libibverbs)";

/// The names tried when `GRADWIRE_IBVERBS_LIB` is unset: the runtime package's soname, then
/// the development symlink.
const NAMES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

static LOADED: OnceLock<Result<Verbs, String>> = OnceLock::new();

/// The process's libibverbs, loaded on first use (`GRADWIRE_IBVERBS_LIB`, else the system's),
/// or why it cannot be.
pub fn verbs() -> Result<&'static Verbs, String> {
    LOADED.get_or_init(|| load(crate::config::env_str("GRADWIRE_IBVERBS_LIB").as_deref())).as_ref().map_err(Clone::clone)
}

fn load(path: Option<&str>) -> Result<Verbs, String> {
    let names: Vec<&str> = match path {
        Some(p) => vec![p],
        None => NAMES.to_vec(),
    };
    let mut why = Vec::new();
    for name in &names {
        // SAFETY: loading runs libibverbs' initialisers, which only register its providers.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return Verbs::resolve(lib, name.to_string()),
            Err(e) => why.push(e.to_string()),
        }
    }
    let missing = why.iter().all(|w| w.contains("No such file"));
    let what = match path {
        Some(p) => format!("GRADWIRE_IBVERBS_LIB={p}"),
        None => "libibverbs.so.1".to_string(),
    };
    Err(format!("{what} {} ({}): {INSTALL_HINT}", if missing { "not found" } else { "cannot be loaded" }, why.join("; ")))
}

/// `ibv_poll_cq`: takes up to `n` completions into `wc`.
///
/// # Safety
/// `cq` is a live completion queue and `wc` has room for `n` entries.
pub unsafe fn poll_cq(cq: *mut ibv_cq, n: c_int, wc: *mut ibv_wc) -> c_int {
    // SAFETY: the caller's contract; a live CQ's context and ops table are the library's.
    match unsafe { (*(*cq).context).ops.poll_cq } {
        // SAFETY: the caller's contract; `f` is the provider's entry point for this object.
        Some(f) => unsafe { f(cq, n, wc) },
        None => -libc::EOPNOTSUPP,
    }
}

/// `ibv_post_send`: 0 or an errno value.
///
/// # Safety
/// `qp` is a live queue pair; `wr` and what it points to are valid for the call, and the
/// memory its scatter entries name stays registered until the request completes.
pub unsafe fn post_send(qp: *mut ibv_qp, wr: *mut ibv_send_wr, bad: *mut *mut ibv_send_wr) -> c_int {
    // SAFETY: the caller's contract.
    match unsafe { (*(*qp).context).ops.post_send } {
        // SAFETY: the caller's contract; `f` is the provider's entry point for this object.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => libc::EOPNOTSUPP,
    }
}

/// `ibv_post_recv`: 0 or an errno value.
///
/// # Safety
/// As [`post_send`].
pub unsafe fn post_recv(qp: *mut ibv_qp, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    // SAFETY: the caller's contract.
    match unsafe { (*(*qp).context).ops.post_recv } {
        // SAFETY: the caller's contract; `f` is the provider's entry point for this object.
        Some(f) => unsafe { f(qp, wr, bad) },
        None => libc::EOPNOTSUPP,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    /// `(C expression, value here)` for every size, offset and constant this module declares
    /// about verbs.h.
    fn declared() -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = Vec::new();
        macro_rules! size {
            ($($t:ident),*) => { $(
                v.push((format!("sizeof(struct {})", stringify!($t)), size_of::<$t>() as u64));
                v.push((format!("_Alignof(struct {})", stringify!($t)), align_of::<$t>() as u64));
            )* };
        }
        macro_rules! at {
            ($t:ident: $($f:ident $(. $g:ident)*),*) => {
                $( v.push((format!("offsetof(struct {}, {})", stringify!($t), stringify!($f $(. $g)*).replace(' ', "")), offset_of!($t, $f $(. $g)*) as u64)); )*
            };
        }
        macro_rules! konst {
            ($($c:ident),*) => { $( v.push((stringify!($c).to_string(), $c as u64)); )* };
        }
        // Complete structs: the size must match too.
        size!(ibv_device_attr, ibv_gid_entry, ibv_qp_cap, ibv_qp_init_attr, ibv_global_route, ibv_ah_attr, ibv_qp_attr);
        // rdma-core 45 appended `active_speed_ex`: the exported ibv_query_port writes only the
        // libibverbs-1.1 prefix, so ours must hold that prefix and may be shorter than a newer
        // header's.
        v.push((format!("sizeof(struct ibv_port_attr) >= {}", size_of::<ibv_port_attr>()), 1));
        size!(ibv_sge, ibv_send_wr, ibv_recv_wr, ibv_wc);
        v.push(("sizeof(union ibv_gid)".into(), size_of::<ibv_gid>() as u64));
        v.push(("_Alignof(union ibv_gid)".into(), align_of::<ibv_gid>() as u64));
        at!(ibv_context_ops: poll_cq, post_send, post_recv);
        at!(ibv_context: device, ops);
        at!(ibv_cq: context);
        at!(ibv_qp: context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num);
        at!(ibv_mr: context, pd, addr, length, handle, lkey, rkey);
        at!(ibv_device_attr: fw_ver, node_guid, sys_image_guid, max_mr_size, page_size_cap, vendor_id, vendor_part_id, hw_ver);
        at!(ibv_device_attr: max_pkeys, local_ca_ack_delay, phys_port_cnt);
        v.push(("offsetof(struct ibv_device_attr, max_qp)".into(), offset_of!(ibv_device_attr, limits) as u64));
        v.push(("offsetof(struct ibv_device_attr, max_srq_sge) + sizeof(int)".into(), (offset_of!(ibv_device_attr, limits) + 29 * 4) as u64));
        at!(ibv_port_attr: state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz, bad_pkey_cntr, qkey_viol_cntr, pkey_tbl_len, lid);
        at!(ibv_port_attr: sm_lid, lmc, max_vl_num, sm_sl, subnet_timeout, init_type_reply, active_width, active_speed, phys_state, link_layer);
        at!(ibv_port_attr: flags, port_cap_flags2);
        at!(ibv_gid_entry: gid, gid_index, port_num, gid_type, ndev_ifindex);
        at!(ibv_qp_cap: max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data);
        at!(ibv_qp_init_attr: qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all);
        at!(ibv_global_route: dgid, flow_label, sgid_index, hop_limit, traffic_class);
        at!(ibv_ah_attr: grh, dlid, sl, src_path_bits, static_rate, is_global, port_num);
        at!(ibv_qp_attr: qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn, dest_qp_num, qp_access_flags, cap);
        at!(ibv_qp_attr: ah_attr, alt_ah_attr, pkey_index, alt_pkey_index, en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic);
        at!(ibv_qp_attr: min_rnr_timer, port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout, rate_limit);
        at!(ibv_sge: addr, length, lkey);
        at!(ibv_send_wr: wr_id, next, sg_list, num_sge, opcode, send_flags, imm_data, wr, qp_type);
        at!(ibv_send_wr: wr.rdma.remote_addr, wr.rdma.rkey, wr.atomic.remote_addr, wr.atomic.compare_add, wr.atomic.swap, wr.atomic.rkey);
        v.push(("offsetof(struct ibv_send_wr, bind_mw)".into(), offset_of!(ibv_send_wr, bind_mw) as u64));
        at!(ibv_recv_wr: wr_id, next, sg_list, num_sge);
        at!(ibv_wc: wr_id, status, opcode, vendor_err, byte_len, imm_data, qp_num, src_qp, wc_flags, pkey_index, slid, sl, dlid_path_bits);
        konst!(IBV_GID_TYPE_ROCE_V1, IBV_GID_TYPE_ROCE_V2, IBV_PORT_ACTIVE, IBV_LINK_LAYER_ETHERNET);
        konst!(IBV_MTU_256, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096);
        konst!(IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ, IBV_ACCESS_REMOTE_ATOMIC, IBV_QPT_RC);
        konst!(IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS);
        konst!(IBV_QP_STATE, IBV_QP_ACCESS_FLAGS, IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_TIMEOUT, IBV_QP_RETRY_CNT);
        konst!(IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN, IBV_QP_MAX_QP_RD_ATOMIC, IBV_QP_MIN_RNR_TIMER, IBV_QP_SQ_PSN, IBV_QP_MAX_DEST_RD_ATOMIC, IBV_QP_DEST_QPN);
        konst!(IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_READ, IBV_WR_ATOMIC_FETCH_AND_ADD);
        konst!(IBV_SEND_SIGNALED, IBV_SEND_INLINE, IBV_WC_SUCCESS, IBV_WC_WR_FLUSH_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_RETRY_EXC_ERR);
        konst!(IBV_WC_RECV_RDMA_WITH_IMM, IBV_WC_WITH_IMM);
        v
    }

    /// Every layout and constant above against the system's `infiniband/verbs.h`, compiled
    /// by the C compiler (CI installs both; elsewhere the test says why it skips).
    #[test]
    fn layouts_match_the_system_header() {
        let header = std::path::Path::new("/usr/include/infiniband/verbs.h");
        if !header.exists() {
            crate::test_support::skip_test("layouts_match_the_system_header", &format!("{} is absent (Debian: libibverbs-dev)", header.display()));
            return;
        }
        crate::test_support::assert_c_values("layouts_match_the_system_header", None, "infiniband/verbs.h", &declared(), "src/transport/verbs/sys.rs");
    }

    #[test]
    fn missing_library_is_explained() {
        let e = load(Some("/nonexistent/libibverbs.so.1")).err().unwrap();
        assert!(e.contains("GRADWIRE_IBVERBS_LIB=/nonexistent/libibverbs.so.1 not found") && e.contains("libibverbs1"), "{e}");
        let e = load(Some("/dev/null")).err().unwrap();
        assert!(e.contains("cannot be loaded") && e.contains("ibverbs-providers"), "{e}");
    }
}
