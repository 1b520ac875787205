//! The header every two-sided message carries: which collective call it belongs to
//! (operation, dtype, reduce op, root, count, sequence number), the algorithm step, and the
//! payload length. Receivers compare the call with their own, which turns a mismatched
//! collective into an error naming both ranks instead of a hang or silently wrong data.

use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};
use std::fmt;

/// The collective (or point-to-point) operation a message belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// [`crate::Collective::Allreduce`].
    Allreduce = 1,
    /// [`crate::Collective::ReduceScatter`].
    ReduceScatter = 2,
    /// [`crate::Collective::Allgather`].
    Allgather = 3,
    /// [`crate::Collective::Broadcast`].
    Broadcast = 4,
    /// [`crate::Collective::Reduce`].
    Reduce = 5,
    /// [`crate::Collective::Barrier`].
    Barrier = 6,
    /// A point-to-point message (its tag travels as the root).
    Send = 7,
    /// An all-to-all exchange.
    AllToAll = 8,
}

impl OpKind {
    /// Its name in messages, e.g. `reduce_scatter`.
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Allreduce => "allreduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::Allgather => "allgather",
            OpKind::Broadcast => "broadcast",
            OpKind::Reduce => "reduce",
            OpKind::Barrier => "barrier",
            OpKind::Send => "send/recv",
            OpKind::AllToAll => "alltoall",
        }
    }

    fn from_u8(v: u8) -> Result<Self> {
        Ok(match v {
            1 => OpKind::Allreduce,
            2 => OpKind::ReduceScatter,
            3 => OpKind::Allgather,
            4 => OpKind::Broadcast,
            5 => OpKind::Reduce,
            6 => OpKind::Barrier,
            7 => OpKind::Send,
            8 => OpKind::AllToAll,
            _ => return Err(Error::Protocol(format!("unknown operation code {v} in message header"))),
        })
    }
}

/// One collective call as a rank issued it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallHeader {
    /// The operation.
    pub op: OpKind,
    /// Element type of the buffers.
    pub dtype: DType,
    /// Reduction (sum for operations that do not reduce).
    pub redop: ReduceOp,
    /// Root rank of a rooted collective; a point-to-point message's tag.
    pub root: u32,
    /// Elements, as the call counts them (see [`crate::Request::count`]).
    pub count: u64,
    /// The communicator's sequence number of the call (point-to-point: per peer).
    pub seq: u64,
}

impl fmt::Display for CallHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}(count {}, {}", self.op.name(), self.seq, self.count, self.dtype.name())?;
        match self.op {
            OpKind::Allreduce | OpKind::ReduceScatter | OpKind::Reduce => write!(f, ", {}", self.redop.name())?,
            _ => {}
        }
        match self.op {
            OpKind::Broadcast | OpKind::Reduce => write!(f, ", root {}", self.root)?,
            OpKind::Send => write!(f, ", tag {}", self.root)?,
            _ => {}
        }
        write!(f, ")")
    }
}

/// Bytes of an encoded [`FrameHeader`].
pub const HEADER_LEN: usize = 40;
const MAGIC: u32 = u32::from_le_bytes(*b"GWF1");

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A message of a call (header, then `len` payload bytes).
    Data = 1,
    /// The sender aborted its communicator; the payload is its error text.
    Abort = 2,
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// Data or abort.
    pub kind: FrameKind,
    /// The call the message belongs to.
    pub call: CallHeader,
    /// The algorithm's step (messages of one call between two ranks are told apart by it).
    pub step: u32,
    /// Payload bytes that follow the header.
    pub len: u64,
}

impl FrameHeader {
    /// The header's wire form (little-endian, starting with a magic number).
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[5] = self.call.op as u8;
        b[6] = self.call.dtype as u8;
        b[7] = self.call.redop as u8;
        b[8..12].copy_from_slice(&self.call.root.to_le_bytes());
        b[12..16].copy_from_slice(&self.step.to_le_bytes());
        b[16..24].copy_from_slice(&self.call.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.call.seq.to_le_bytes());
        b[32..40].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Parses a header received from a peer: an error for anything a correct peer never
    /// sends (bad magic, unknown codes).
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Self> {
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        if u32_at(0) != MAGIC {
            return Err(Error::Protocol("bad frame magic: the stream is out of sync or the peer is not gradwire".into()));
        }
        let kind = match b[4] {
            1 => FrameKind::Data,
            2 => FrameKind::Abort,
            k => return Err(Error::Protocol(format!("unknown frame kind {k}"))),
        };
        Ok(FrameHeader {
            kind,
            call: CallHeader {
                op: OpKind::from_u8(b[5])?,
                dtype: DType::from_u8(b[6]).map_err(|e| Error::Protocol(e.to_string()))?,
                redop: ReduceOp::from_u8(b[7]).map_err(|e| Error::Protocol(e.to_string()))?,
                root: u32_at(8),
                count: u64_at(16),
                seq: u64_at(24),
            },
            step: u32_at(12),
            len: u64_at(32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_garbage() {
        let h = FrameHeader {
            kind: FrameKind::Data,
            call: CallHeader { op: OpKind::Broadcast, dtype: DType::BF16, redop: ReduceOp::Max, root: 3, count: 1 << 40, seq: 77 },
            step: 5,
            len: 123456,
        };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        assert!(FrameHeader::decode(&[0u8; HEADER_LEN]).is_err());
        let mut bad = h.encode();
        bad[6] = 99;
        assert!(FrameHeader::decode(&bad).is_err());
        assert_eq!(h.call.to_string(), "broadcast#77(count 1099511627776, bfloat16, root 3)");
    }
}
