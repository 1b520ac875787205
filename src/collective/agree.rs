//! Agreement before a collective whose steps cannot see every rank's arguments (broadcast,
//! reduce, the hierarchical allreduce): every rank learns whether all ranks passed the same
//! arguments, and fails naming a rank that differs if not.
//!
//! Why a separate step: in a rooted tree a rank that only sends (the root of a broadcast,
//! a leaf of a reduce) never reads a peer's header, so ranks that disagree on the root
//! could all return success with different data, and leave frames behind that fail an
//! unrelated later call; a hierarchical allreduce's steps carry only the padded shard
//! size, so counts that pad to the same shard meet nowhere. Cost ⌈log2 W⌉α (+2α when W is
//! not a power of two): a recursive doubling max over the call's fields and their
//! negatives, so every rank ends with every field's maximum and minimum and decides alike.
//! Only when they differ does a second round exchange every rank's fields with every other,
//! to name who passed what.

use super::algos::{recursive_doubling_allreduce, Ctx};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use crate::transport::frame::{CallHeader, OpKind};
use crate::transport::{RecvOp, SendOp, Sink};

/// The fields of a rooted collective that ranks must agree on, named by [`ROOTED`].
fn fields(call: &CallHeader) -> [u64; 4] {
    let redop = if call.op == OpKind::Reduce { call.redop as u64 } else { 0 };
    [u64::from(call.root), call.count, call.dtype as u64, redop]
}

/// The names of [`fields`], for the error.
const ROOTED: [&str; 4] = ["root", "count", "dtype", "reduce op"];

/// `[v_hi, v_lo, ..., -v_hi, -v_lo, ...]`, each field as two exact f64 halves (hi, lo 32
/// bits): after a max over ranks, each field's max and -min.
fn encode(f: &[u64]) -> Vec<u8> {
    let halves = f.iter().flat_map(|&v| [(v >> 32) as f64, (v & 0xffff_ffff) as f64]);
    let vals: Vec<f64> = halves.clone().chain(halves.map(|h| -h)).collect();
    vals.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f64s(b: &[u8]) -> Vec<f64> {
    b.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default())).collect()
}

/// Checks that every rank of `cx` runs `cx.call` with the same root, count, dtype and (for
/// reduce) reduce op. The same error on every rank when they do not.
pub fn agree_on_call(cx: &mut Ctx<'_>) -> Result<()> {
    let call = cx.call;
    let named = |f: &[u64]| {
        let other = CallHeader {
            root: f[0] as u32,
            count: f[1],
            dtype: DType::from_u8(f[2] as u8).unwrap_or(call.dtype),
            redop: ReduceOp::from_u8(f[3] as u8).unwrap_or(call.redop),
            ..call
        };
        other.to_string()
    };
    agree_on(cx, &ROOTED, &fields(&call), named)
}

/// Checks that every rank of `cx` passed the same `mine` (one value per name in `what`) to
/// the call `cx.call` stands for; `named` describes a call from its values, for the error.
/// The agreement's own messages carry `cx.call`'s operation and sequence number. The same
/// error on every rank when they differ, naming this rank's call and one that differs.
pub(crate) fn agree_on(cx: &mut Ctx<'_>, what: &[&str], mine: &[u64], named: impl Fn(&[u64]) -> String) -> Result<()> {
    let call = cx.call;
    // The agreement's own messages: same operation and sequence number (a rank running
    // another collective here is a mismatch its partner reports, as for any call), nothing
    // of what is being agreed on.
    let header = CallHeader { op: call.op, dtype: DType::F64, redop: ReduceOp::Max, root: 0, count: 0, seq: call.seq };
    let mut acx = Ctx { links: &mut *cx.links, call: header, deadline: cx.deadline, rank: cx.rank, world: cx.world, dtype: DType::F64, op: ReduceOp::Max };
    let mut buf = encode(mine);
    recursive_doubling_allreduce(&mut acx, &mut buf).map_err(|e| renamed(e, &named(mine)))?;
    let v = f64s(&buf);
    let n = v.len() / 2;
    if (0..n).all(|i| v[i] == -v[n + i]) {
        return Ok(());
    }
    // They differ: learn every rank's fields to name one that differs from ours.
    let (rank, world) = (cx.rank, cx.world);
    let sent = mine.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    let mut theirs = vec![vec![0u8; sent.len()]; world];
    {
        let mut sends: Vec<SendOp<'_>> = (0..world).filter(|&p| p != rank).map(|p| SendOp::new(p, 1000, &sent)).collect();
        let mut recvs: Vec<RecvOp<'_>> = theirs
            .iter_mut()
            .enumerate()
            .filter(|(p, _)| *p != rank)
            .map(|(p, b)| RecvOp { peer: p, step: 1000, sink: Sink::Copy((&mut b[..]).into()) })
            .collect();
        acx.links.exchange(&header, &mut sends, &mut recvs, acx.deadline).map_err(|e| renamed(e, &named(mine)))?;
    }
    let decoded = |b: &[u8]| -> Vec<u64> { b.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect() };
    let (peer, other) = (0..world).filter(|&p| p != rank).map(|p| (p, decoded(&theirs[p]))).find(|(_, f)| f != mine).unwrap_or((rank, mine.to_vec()));
    let differ: Vec<&str> = what.iter().zip(mine.iter().zip(&other)).filter(|(_, (a, b))| a != b).map(|(w, _)| *w).collect();
    Err(Error::Mismatch { rank, mine: named(mine), peer, theirs: format!("{} (the ranks disagree on the {})", named(&other), differ.join(" and ")) })
}

/// An agreement's failure names the call it was agreeing on, not its own messages.
fn renamed(e: Error, call: &str) -> Error {
    let op = format!("{call} (agreeing on its arguments)");
    match e {
        Error::Timeout { rank, peer, waited_ms, .. } => Error::Timeout { rank, peer, op, waited_ms },
        Error::PeerLost { rank, peer, cause, .. } => Error::PeerLost { rank, peer, op, cause },
        Error::Mismatch { rank, peer, theirs, .. } => Error::Mismatch { rank, mine: call.to_string(), peer, theirs },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encoding_is_exact_for_every_count() {
        for count in [0u64, 1, 1 << 40, (1 << 62) - 1, u64::MAX] {
            let call = CallHeader { op: OpKind::Broadcast, dtype: DType::BF16, redop: ReduceOp::Sum, root: u32::MAX, count, seq: 3 };
            let v = f64s(&encode(&fields(&call)));
            let back = |i: usize| ((v[2 * i] as u64) << 32) | v[2 * i + 1] as u64;
            assert_eq!([back(0), back(1), back(2), back(3)], fields(&call));
            assert!((0..8).all(|i| v[i] == -v[8 + i]));
        }
    }
}
