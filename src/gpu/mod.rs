//! GPU layer (cargo feature `cuda`, on by default): collectives on CUDA device memory,
//! NCCL inside a node and gradwire's hierarchical path across nodes, with CUDA and NCCL
//! loaded at run time through cudarc, so a build on a machine without CUDA works and
//! reports "no GPU support" cleanly instead of failing to link or panicking.
//!
//! | file | concern |
//! |---|---|
//! | `load.rs` | finding the CUDA driver and NCCL, and saying why not |
//! | `memory.rs` | which memory a pointer is; the pinned staging region; stream waits with a deadline |
//! | `nccl.rs` | one NCCL communicator, its calls enqueued on a stream |
//! | `device_comm.rs` | [`DeviceComm`]: the collectives on device buffers, one node or several |

mod device_comm;
mod load;
mod memory;
mod nccl;

pub use device_comm::DeviceComm;
pub use load::{describe, nccl_link_dir, nccl_search, unavailable, NcclSearch};
pub use memory::{expect_device, expect_host, memory_kind, staging_bandwidth, MemoryKind};
