//! The operating system's calls that more than one layer needs, one small module per
//! family, each wrapping its `unsafe` at the call with the contract it relies on.
//! (Memory mapping stays with the memory layer, verbs with the verbs device, process
//! control with the launcher: each has one user.)

pub(crate) mod cma;
pub mod cpus;
pub(crate) mod poll;
pub(crate) mod proc;
pub(crate) mod sock;
