//! Criterion benches of the hot paths: the reduction kernels (per dtype and op), the frame
//! header codec, and a two-rank allreduce over each transport (ranks as threads of one
//! process, real shared memory and real sockets). `cargo bench --bench kernels`.

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
    // The transports' reduce-on-receive: a 256 KiB staging buffer (in L2) summed into a
    // destination too large for the cache, so memory bandwidth counts as well as the loop.
    let (big, staged) = (64 << 20, 256 << 10);
    let mut g = c.benchmark_group("reduce_staged_into_64MiB");
    g.throughput(Throughput::Bytes(big as u64));
    g.sample_size(10);
    let mut dst: Vec<f32> = (0..big / 4).map(|i| (i % 1000) as f32).collect();
    let src: Vec<f32> = (0..staged / 4).map(|i| (i % 7) as f32).collect();
    // SAFETY: f32 buffers viewed as bytes.
    let d = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, big) };
    let s = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, staged) };
    g.bench_function("float32_sum", |b| {
        b.iter(|| {
            for part in d.chunks_mut(staged) {
                reduce_bytes(DType::F32, ReduceOp::Sum, black_box(part), black_box(s));
            }
        })
    });
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

criterion_group!(benches, kernels, header, transports);
criterion_main!(benches);

/// Two ranks as threads of this process, joined by real links of one transport.
fn pair(transport: gradwire::TransportChoice) -> (gradwire::Communicator, gradwire::Communicator) {
    use gradwire::bootstrap::RankEnv;
    let port = gradwire::bootstrap::store::unused_ports(1).unwrap();
    let env = move |rank| RankEnv {
        rank,
        world: 2,
        local_rank: None,
        local_world: None,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: "bench-secret-123".into(),
        store_exists: false,
    };
    let mut cfg = gradwire::Config::from_env().unwrap();
    cfg.transport = transport;
    let cfg1 = cfg.clone();
    let t = std::thread::spawn(move || gradwire::Communicator::with_env(env(1), cfg1).unwrap());
    let c0 = gradwire::Communicator::with_env(env(0), cfg).unwrap();
    (c0, t.join().unwrap())
}

/// The transports' hot path end to end: a blocking allreduce between two ranks (the peer
/// runs the same number of iterations on its own thread).
fn transports(c: &mut Criterion) {
    for (name, t) in [("shm", gradwire::TransportChoice::Shm), ("tcp", gradwire::TransportChoice::Tcp)] {
        let (c0, c1) = pair(t);
        let mut g = c.benchmark_group(format!("allreduce_pair_{name}"));
        for bytes in [4usize << 10, 1 << 20] {
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(format!("{}KiB", bytes >> 10), |b| {
                b.iter_custom(|iters| {
                    std::thread::scope(|s| {
                        s.spawn(|| {
                            let mut v = vec![1f32; bytes / 4];
                            for _ in 0..iters {
                                c1.allreduce(&mut v, ReduceOp::Sum).unwrap();
                            }
                        });
                        let mut v = vec![1f32; bytes / 4];
                        let t0 = std::time::Instant::now();
                        for _ in 0..iters {
                            c0.allreduce(&mut v, ReduceOp::Sum).unwrap();
                        }
                        t0.elapsed()
                    })
                })
            });
        }
        g.finish();
    }
}
