#![warn(missing_docs, unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]
//! gradwire: a communication backend for distributed deep-learning training.
//!
//! Layers, bottom-up (each calls only the ones below it):
//!
//! | layer | module | owns |
//! |---|---|---|
//! | OS calls | [`sys`] | the system calls more than one layer needs (cross-memory attach, /proc, poll, CPUs) |
//! | memory | [`mem`], [`dtype`] | page-aligned regions (anonymous, huge pages, memfd-shared), registration, `GradBuffer` slots; element types and reduction ops |
//! | bootstrap | [`bootstrap`] | rank identity from the environment, unique ids, authenticated rendezvous store, topology |
//! | transport | [`transport`] | the `Link` interface; a `Backend` per transport (`shm/`, `tcp/`, `verbs/`, each a folder of the same shape) behind one seam; the framed, checked exchange on top; one-sided windows |
//! | engine | `engine` | progress thread per communicator, `Work` handles, deadlines, abort |
//! | collectives | [`collective`], [`comm`] | the algorithms (every one-host collective in `collective/shm/`, rings, the hierarchical allreduce, all-to-all and point-to-point, `split`) and the `Communicator` API |
//! | GPU | `gpu` (feature `cuda`) | Collectives on CUDA device memory on the caller's stream: NCCL inside a node (cudarc, loaded at run time), the hierarchical path through pinned memory across nodes |
//! | remote memory | [`rma`] | parameter-server shards and the token ring on one-sided operations |
//! | training | [`train`] | the `Strategy` interface and the seven schemes of docs/algorithms.md, the built-in model and data |
//! | C ABI | [`ffi`] + `ffi/gradwire.h` | the stable C interface other frameworks link (collectives, hierarchy, training schemes) |
//! | check | [`check`] | the conformance suite `gradwire check` runs: every collective against an independent reference |
//! | CLI | `src/bin` | `gradwire launch`, `bench`, `check`, `info`, `train`, `plot` |

pub mod bootstrap;
pub mod check;
pub mod collective;
pub mod comm;
pub mod config;
pub mod cost;
pub mod dtype;
pub(crate) mod engine;
pub mod error;
pub mod ffi;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod mem;
pub mod rma;
pub mod sys;
#[cfg(test)]
mod test_support;
pub mod train;
pub mod transport;

pub use collective::exchange::{Counts, P2pOp};
pub use collective::hierarchical::{HierarchicalAlgo, Hierarchy};
pub use collective::{Collective, Pending, Request};
pub use comm::Communicator;
pub use config::{Algo, Config, TransportChoice};
pub use dtype::{DType, Element, ReduceOp};
pub use engine::Work;
pub use error::{Error, Result};
pub use mem::{GradBuffer, Region, RegionKind, Registration};
pub use transport::Transport;
