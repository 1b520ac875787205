//! How a call's send and receive buffers may lie: the one rule every entry point applies,
//! host and device, the C ABI, the Rust API and the torch backend (which asks it through
//! `gradwire_buffer_layout` to know when it must copy). Nothing else computes an overlap.

use super::Collective;
use crate::error::{invalid, Result};

/// Bytes at an address (host or device memory).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The first byte's address.
    pub at: usize,
    /// How many bytes.
    pub len: usize,
}

impl Span {
    /// The `len` bytes at `p`.
    pub fn of<T>(p: *const T, len: usize) -> Span {
        Span { at: p as usize, len }
    }

    /// Whether the two share a byte (an empty span shares none; ends that pass the top of
    /// the address space count as its end).
    pub fn overlaps(self, other: Span) -> bool {
        self.len > 0 && other.len > 0 && self.at < other.at.saturating_add(other.len) && other.at < self.at.saturating_add(self.len)
    }
}

/// How the send and receive buffers of a collective lie relative to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// No byte shared (or either buffer empty).
    Apart,
    /// The same buffer (allreduce, broadcast and reduce in place).
    InPlace,
    /// NCCL's in-place layout of an allgather (`send` is this rank's block of `recv`) or a
    /// reduce-scatter (`recv` is this rank's block of `send`).
    Block,
}

/// The layout of `send` and `recv` for `op` on `rank`, or the error every entry point
/// gives for buffers that overlap otherwise (its text without the caller's name).
pub fn layout(op: Collective, rank: usize, send: Span, recv: Span) -> Result<Layout> {
    if send.len == 0 || recv.len == 0 {
        return Ok(Layout::Apart);
    }
    let block_of = |whole: Span, part: Span| rank.checked_mul(part.len).and_then(|o| whole.at.checked_add(o)) == Some(part.at);
    let same = send.at == recv.at;
    match op {
        Collective::Allgather if block_of(recv, send) => return Ok(Layout::Block),
        Collective::ReduceScatter if block_of(send, recv) => return Ok(Layout::Block),
        Collective::Allreduce | Collective::Broadcast | Collective::Reduce if same => return Ok(Layout::InPlace),
        _ => {}
    }
    if !send.overlaps(recv) {
        return Ok(Layout::Apart);
    }
    Err(invalid(match op {
        Collective::Allgather if same => {
            "allgather cannot run with the same send and receive buffer (in place, as NCCL: sendbuf = recvbuf + rank x sendcount)".into()
        }
        Collective::ReduceScatter if same => {
            "reduce_scatter cannot run with the same send and receive buffer (in place, as NCCL: recvbuf = sendbuf + rank x recvcount)".into()
        }
        Collective::Allgather => "sendbuf and recvbuf overlap (in place, as NCCL: sendbuf = recvbuf + rank x sendcount)".into(),
        Collective::ReduceScatter => "sendbuf and recvbuf overlap (in place, as NCCL: recvbuf = sendbuf + rank x recvcount)".into(),
        Collective::Allreduce | Collective::Broadcast | Collective::Reduce => "sendbuf and recvbuf overlap (pass the same pointer for in place)".into(),
        op => format!("sendbuf and recvbuf overlap ({} cannot run in place)", op.name()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(at: usize, len: usize) -> Span {
        Span { at, len }
    }

    #[test]
    fn spans_overlap_when_they_share_a_byte() {
        assert!(at(0x1000, 16).overlaps(at(0x100f, 1)));
        assert!(!at(0x1000, 16).overlaps(at(0x1010, 16)), "adjacent spans share no byte");
        assert!(!at(0x1000, 0).overlaps(at(0x1000, 16)), "an empty span shares nothing");
        assert!(at(usize::MAX - 4, 16).overlaps(at(usize::MAX - 1, 1)), "an end past the address space still overlaps");
    }

    #[test]
    fn in_place_forms_are_accepted_and_other_overlaps_refused() {
        // Rank 2 of 4, 16-byte blocks of a 64-byte whole at 0x1000.
        let (whole, mine, other) = (at(0x1000, 64), at(0x1020, 16), at(0x1010, 16));
        assert_eq!(layout(Collective::Allgather, 2, mine, whole).unwrap(), Layout::Block);
        assert_eq!(layout(Collective::ReduceScatter, 2, whole, mine).unwrap(), Layout::Block);
        assert!(layout(Collective::Allgather, 2, other, whole).unwrap_err().to_string().contains("overlap"));
        assert!(layout(Collective::ReduceScatter, 1, whole, mine).unwrap_err().to_string().contains("overlap"));
        // Rank 0's block starts where the whole does: in place, not the same buffer.
        assert_eq!(layout(Collective::Allgather, 0, at(0x1000, 16), whole).unwrap(), Layout::Block);
        assert!(layout(Collective::Allgather, 1, at(0x1000, 16), whole).unwrap_err().to_string().contains("same send and receive"));
        for op in [Collective::Allreduce, Collective::Broadcast, Collective::Reduce] {
            assert_eq!(layout(op, 0, whole, whole).unwrap(), Layout::InPlace);
            assert!(layout(op, 0, whole, at(0x1004, 64)).unwrap_err().to_string().contains("same pointer"));
        }
        assert!(layout(Collective::AllToAll, 0, whole, whole).unwrap_err().to_string().contains("alltoall cannot run in place"));
        assert_eq!(layout(Collective::AllToAll, 0, whole, at(0x1040, 64)).unwrap(), Layout::Apart);
        assert_eq!(layout(Collective::Allreduce, 0, at(0, 0), at(0, 0)).unwrap(), Layout::Apart);
        // A rank whose block offset overflows has no block.
        assert!(layout(Collective::Allgather, usize::MAX, mine, whole).is_err());
    }
}
