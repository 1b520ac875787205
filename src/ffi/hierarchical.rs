//! The C ABI of the hierarchical allreduce the schemes stand on: a node-local group and a
//! cross-node group made once from a communicator (`gradwire_hierarchy_create`), then
//! blocking and non-blocking allreduces through them.

use super::{
    check_buffers, comm, dtype, gradwire_comm_t, gradwire_dtype_t, gradwire_op_t, gradwire_work_t, guard, live_handle, out, prefixed, put, put_work, redop,
    registry, take_handle, to_handle,
};
use crate::collective::hierarchical::{HierarchicalAlgo, Hierarchy, RawAllreduce};
use crate::collective::Collective;
use crate::collective::Request;
use crate::error::{invalid, Result};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::Arc;

/// Opaque hierarchy handle (never dereferenced; its address is a registry id).
pub enum gradwire_hierarchy {}
/// The hierarchy handle type of ffi/gradwire.h.
pub type gradwire_hierarchy_t = gradwire_hierarchy;
/// A hierarchical allreduce algorithm code (see ffi/gradwire.h).
pub type gradwire_hierarchical_algo_t = c_uint;
/// Reduce-scatter in the node, one cross-node allreduce per shard, allgather in the node.
pub const GRADWIRE_HIERARCHICAL_SHARDED: gradwire_hierarchical_algo_t = 0;
/// Reduce to local rank 0, allreduce among those, broadcast in the node.
pub const GRADWIRE_HIERARCHICAL_LEADER: gradwire_hierarchical_algo_t = 1;

fn algo(v: gradwire_hierarchical_algo_t, w: &str) -> Result<HierarchicalAlgo> {
    match v {
        GRADWIRE_HIERARCHICAL_SHARDED => Ok(HierarchicalAlgo::Sharded),
        GRADWIRE_HIERARCHICAL_LEADER => Ok(HierarchicalAlgo::Leader),
        _ => Err(invalid(format!("{w}: algo {v} is not GRADWIRE_HIERARCHICAL_SHARDED (0) or GRADWIRE_HIERARCHICAL_LEADER (1)"))),
    }
}

/// The hierarchy behind `p` and the id of the communicator it was made from.
fn hierarchy(p: *const gradwire_hierarchy_t, w: &str) -> Result<(u64, Arc<Hierarchy>)> {
    live_handle(&registry().hierarchies, p, w, "hierarchy")
}

/// Makes the node-local and cross-node groups of `comm` (collective: every rank calls it).
/// Every node must hold the same number of ranks.
///
/// # Safety
/// `hier` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_hierarchy_create(comm_p: *mut gradwire_comm_t, hier: *mut *mut gradwire_hierarchy_t) -> c_int {
    guard(|| {
        let w = "gradwire_hierarchy_create";
        let (comm_id, c) = comm(comm_p, w)?;
        out(hier, w, "hier")?;
        let h = Hierarchy::new(&c).map_err(|e| prefixed(e, w))?;
        let mut reg = registry();
        let id = reg.id();
        reg.hierarchies.insert(id, (comm_id, Arc::new(h)));
        drop(reg);
        put(hier, to_handle(id), w, "hier")
    })
}

/// Frees a hierarchy (its communicator stays); an allreduce still running keeps its groups
/// until it completes.
#[no_mangle]
pub extern "C" fn gradwire_hierarchy_free(hier: *mut gradwire_hierarchy_t) -> c_int {
    // Dropped after the `let` that held the registry lock: a running non-blocking
    // allreduce holds its own reference, and the groups close when the last goes.
    guard(|| {
        let taken = take_handle(&mut registry().hierarchies, hier, "gradwire_hierarchy_free", "hierarchy")?;
        drop(taken);
        Ok(())
    })
}

/// # Safety
/// `nodes` must be NULL or valid for a write.
#[no_mangle]
pub unsafe extern "C" fn gradwire_hierarchy_nodes(hier: *mut gradwire_hierarchy_t, nodes: *mut c_int) -> c_int {
    guard(|| {
        let w = "gradwire_hierarchy_nodes";
        out(nodes, w, "nodes")?;
        let (_, h) = hierarchy(hier, w)?;
        put(nodes, h.nodes() as c_int, w, "nodes")
    })
}

/// Decodes and checks an allreduce's arguments against the communicator the hierarchy was
/// made from; returns the hierarchy, that communicator and the decoded call.
#[allow(clippy::too_many_arguments)]
fn decode(
    hier: *const gradwire_hierarchy_t,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    al: gradwire_hierarchical_algo_t,
    w: &str,
) -> Result<(Arc<Hierarchy>, Arc<crate::comm::Communicator>, RawAllreduce)> {
    let (comm_id, h) = hierarchy(hier, w)?;
    let c = registry().comms.get(&comm_id).cloned().ok_or_else(|| invalid(format!("{w}: the hierarchy's communicator is finalized")))?;
    let req = Request::new(Collective::Allreduce, dtype(dt, w)?, redop(op, w)?, count);
    check_buffers(&c, &req, send, recv, w)?;
    let call = RawAllreduce { dtype: req.dtype, op: req.redop, algo: algo(al, w)?, send: send as *const u8, recv: recv as *mut u8, count };
    Ok((h, c, call))
}

/// Allreduce of `count` elements over every rank of the hierarchy's communicator, through
/// the node-local and cross-node groups, in order with the communicator's other calls;
/// `sendbuf == recvbuf` is in place.
///
/// # Safety
/// `sendbuf` must be readable and `recvbuf` writable for `count` elements of `dt` during
/// the call.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gradwire_hierarchical_allreduce(
    hier: *mut gradwire_hierarchy_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    al: gradwire_hierarchical_algo_t,
) -> c_int {
    guard(|| {
        let w = "gradwire_hierarchical_allreduce";
        let (h, c, call) = decode(hier, sendbuf, recvbuf, count, dt, op, al, w)?;
        // SAFETY: checked buffers (sizes, overlap), valid for the call by contract.
        unsafe { h.run_raw(&c, call) }.map_err(|e| prefixed(e, w))
    })
}

/// The non-blocking form: ordered with the communicator's other calls; complete it with
/// `gradwire_wait` or `gradwire_test`.
///
/// # Safety
/// As for `gradwire_hierarchical_allreduce`, until the work completes; `work` must be NULL
/// or valid for a write.
#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn gradwire_hierarchical_iallreduce(
    hier: *mut gradwire_hierarchy_t,
    sendbuf: *const c_void,
    recvbuf: *mut c_void,
    count: usize,
    dt: gradwire_dtype_t,
    op: gradwire_op_t,
    al: gradwire_hierarchical_algo_t,
    work: *mut *mut gradwire_work_t,
) -> c_int {
    guard(|| {
        let w = "gradwire_hierarchical_iallreduce";
        out(work, w, "work")?;
        let (h, c, call) = decode(hier, sendbuf, recvbuf, count, dt, op, al, w)?;
        // SAFETY: checked buffers; the caller keeps them valid until the work completes.
        let handle = unsafe { h.start_raw(&c, call) }.map_err(|e| prefixed(e, w))?;
        put_work(work, handle, w)
    })
}
