//! Criterion benches of the hot paths that do not need several processes: the reduction
//! kernels (per dtype and op) and the frame header codec.

use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use gradwire::collective::reduce::reduce_bytes;
use gradwire::transport::frame::{CallHeader, FrameHeader, FrameKind, OpKind};
use gradwire::{DType, ReduceOp};

fn kernels(c: &mut Criterion) {
    let bytes = 1 << 20;
    let mut g = c.benchmark_group("reduce_1MiB");
    g.throughput(Throughput::Bytes(bytes as u64));
    for dtype in DType::ALL {
        for op in [ReduceOp::Sum, ReduceOp::Max] {
            let mut dst = vec![0u64; bytes / 8];
            let src = vec![0x3c00_3c00_3c00_3c00u64; bytes / 8];
            // SAFETY: u64 buffers viewed as bytes.
            let d = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, bytes) };
            let s = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, bytes) };
            g.bench_function(format!("{}_{}", dtype.name(), op.name()), |b| b.iter(|| reduce_bytes(dtype, op, black_box(&mut *d), black_box(s))));
        }
    }
    g.finish();
}

fn header(c: &mut Criterion) {
    let h = FrameHeader {
        kind: FrameKind::Data,
        call: CallHeader { op: OpKind::Allreduce, dtype: DType::F32, redop: ReduceOp::Sum, root: 0, count: 1 << 20, seq: 42 },
        step: 3,
        len: 4 << 20,
    };
    c.bench_function("frame_header_roundtrip", |b| b.iter(|| FrameHeader::decode(&black_box(h).encode())));
}

criterion_group!(benches, kernels, header);
criterion_main!(benches);
