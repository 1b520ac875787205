//! What a scheme (DASO, dense BSP) asks of a caller that moves the model's data itself
//! (`data=caller`): the scheme keeps its schedule and bookkeeping, and instead of touching host buffers it
//! records, in order, each collective and arithmetic step on the parameters or gradients.
//! A framework whose model lives in device memory runs them there (NCCL inside the node,
//! only what crosses nodes staged through the host), so no step copies the whole model
//! to the host. `python/gradwire/_caller_plane.py` is that caller for PyTorch.
//!
//! Each action travels over the C ABI as three int64 values: its code and two arguments
//! (unused ones are 0); `ffi/gradwire.h` lists the codes.

use super::daso::Wire;

/// One step the caller runs, in the order the scheme recorded them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// The parameters of communicator rank `root` to every rank.
    BroadcastAll {
        /// The communicator rank whose parameters everyone takes.
        root: usize,
    },
    /// The gradients averaged over the ranks of this node.
    AverageGradsInNode,
    /// The parameters of local index `root` to the rest of its node.
    BroadcastInNode {
        /// The local index (rank in the node) whose parameters the node takes.
        root: usize,
    },
    /// Start a float32 sum of a copy of the parameters over the nodes (this rank's
    /// cross-node group), in allreduces of `first` elements, then `chunk` elements each.
    SendSum {
        /// Elements in the first allreduce (the remainder, as Heat cuts it).
        first: usize,
        /// Elements in each later allreduce.
        chunk: usize,
    },
    /// Wait for the oldest sum in flight and merge it as `daso::merge` does.
    MergeOldest {
        /// S: the batches between the send and this merge.
        batches_between: usize,
        /// N: the nodes.
        nodes: usize,
    },
    /// Wait for the (only) sum in flight and take the nodes' average: x ← Σ/N.
    TakeAverage {
        /// N: the nodes.
        nodes: usize,
    },
    /// Cast the parameters to `wire`, sum them over the nodes in that dtype, divide by
    /// `nodes` and round to `wire` (Heat's synchronous average).
    AverageOnWire {
        /// N: the nodes.
        nodes: usize,
        /// The dtype the sum travels and is divided in.
        wire: Wire,
    },
    /// The parameters' change since the anchor, cast to `wire` and averaged over every
    /// rank in that dtype, added to the anchor; the anchor becomes the result.
    AverageChange {
        /// The dtype the change travels in.
        wire: Wire,
    },
    /// The anchor becomes the current parameters (they agree on every rank).
    SetAnchor,
    /// Whether the next backward's gradients will be averaged in the node (a caller may
    /// start that average during backward).
    AverageNextGrads(bool),
    /// The gradients averaged over every rank.
    AverageGradsAll,
    /// The parameters' change since the node's anchor averaged over the node (float32),
    /// added to that anchor; the node's anchor becomes the result.
    AverageChangeInNode,
    /// The parameters become the anchor.
    TakeAnchor,
    /// The node's anchor becomes the current parameters.
    SetNodeAnchor,
}

/// A scheme's recorder: `Some` where the caller moves the data (the actions not yet
/// taken), `None` where the scheme moves it on host buffers itself.
#[derive(Debug, Default)]
pub struct Asked(Option<Vec<Action>>);

impl Asked {
    /// Recording when `caller_moves_data`.
    pub fn new(caller_moves_data: bool) -> Self {
        Asked(caller_moves_data.then(Vec::new))
    }

    /// Records `a` for the caller (true), or leaves the step to the host code that
    /// follows (false).
    pub fn ask(&mut self, a: Action) -> bool {
        match &mut self.0 {
            Some(asked) => {
                asked.push(a);
                true
            }
            None => false,
        }
    }

    /// Whether the caller moves the data.
    pub fn caller_moves_data(&self) -> bool {
        self.0.is_some()
    }

    /// The actions recorded since the last take, in order.
    pub fn take(&mut self) -> Vec<Action> {
        self.0.as_mut().map(std::mem::take).unwrap_or_default()
    }
}

fn wire_code(w: Wire) -> i64 {
    match w {
        Wire::F32 => 0,
        Wire::Bf16 => 1,
        Wire::F16 => 2,
    }
}

impl Action {
    /// The action as the C ABI's three values: code, then two arguments.
    pub fn encode(self) -> [i64; 3] {
        let n = |v: usize| v as i64;
        match self {
            Action::BroadcastAll { root } => [1, n(root), 0],
            Action::AverageGradsInNode => [2, 0, 0],
            Action::BroadcastInNode { root } => [3, n(root), 0],
            Action::SendSum { first, chunk } => [4, n(first), n(chunk)],
            Action::MergeOldest { batches_between, nodes } => [5, n(batches_between), n(nodes)],
            Action::TakeAverage { nodes } => [6, n(nodes), 0],
            Action::AverageOnWire { nodes, wire } => [7, n(nodes), wire_code(wire)],
            Action::AverageChange { wire } => [8, wire_code(wire), 0],
            Action::SetAnchor => [9, 0, 0],
            Action::AverageNextGrads(yes) => [10, i64::from(yes), 0],
            Action::AverageGradsAll => [11, 0, 0],
            Action::AverageChangeInNode => [12, 0, 0],
            Action::TakeAnchor => [13, 0, 0],
            Action::SetNodeAnchor => [14, 0, 0],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_action_has_its_own_code() {
        let all = [
            Action::BroadcastAll { root: 0 },
            Action::AverageGradsInNode,
            Action::BroadcastInNode { root: 1 },
            Action::SendSum { first: 3, chunk: 4 },
            Action::MergeOldest { batches_between: 2, nodes: 2 },
            Action::TakeAverage { nodes: 2 },
            Action::AverageOnWire { nodes: 2, wire: Wire::F16 },
            Action::AverageChange { wire: Wire::Bf16 },
            Action::SetAnchor,
            Action::AverageNextGrads(true),
            Action::AverageGradsAll,
            Action::AverageChangeInNode,
            Action::TakeAnchor,
            Action::SetNodeAnchor,
        ];
        let mut codes: Vec<i64> = all.iter().map(|a| a.encode()[0]).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes, (1..=14).collect::<Vec<_>>());
        assert_eq!(Action::AverageOnWire { nodes: 4, wire: Wire::F16 }.encode(), [7, 4, 2]);
    }
}
