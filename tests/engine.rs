//! Engine behaviour inside one process (ranks as threads over real sockets): abort wakes
//! every waiter, queued work fails too, and non-blocking work completes in order.

use gradwire::bootstrap::RankEnv;
use gradwire::{Communicator, Config, ReduceOp, TransportChoice};
use std::time::{Duration, Instant};

fn env(rank: usize, world: usize, port: u16) -> RankEnv {
    RankEnv {
        rank,
        world,
        local_rank: None,
        local_world: None,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        secret: "engine-test-secret".into(),
        store_exists: false,
    }
}

fn cfg(timeout_ms: u64) -> Config {
    let mut c = Config::from_env().unwrap();
    c.timeout = Duration::from_millis(timeout_ms);
    c.transport = TransportChoice::Tcp;
    c
}

fn port() -> u16 {
    gradwire::bootstrap::store::unused_ports(1).unwrap()
}

/// Runs `body` on `world` ranks, each a thread with its own communicator (a 60 s timeout,
/// `configure`d per rank), and returns what each returned, in rank order.
fn ranks_as_threads<T: Send>(world: usize, configure: impl Fn(usize, &mut Config) + Sync, body: impl Fn(usize, &Communicator) -> T + Sync) -> Vec<T> {
    let p = port();
    std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|r| {
                let (configure, body) = (&configure, &body);
                s.spawn(move || {
                    let mut c = cfg(60_000);
                    configure(r, &mut c);
                    body(r, &Communicator::with_env(env(r, world, p), c).unwrap())
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn pair(timeout_ms: u64) -> (Communicator, Communicator) {
    let p = port();
    let t = std::thread::spawn(move || Communicator::with_env(env(1, 2, p), cfg(timeout_ms)).unwrap());
    let c0 = Communicator::with_env(env(0, 2, p), cfg(timeout_ms)).unwrap();
    (c0, t.join().unwrap())
}

#[test]
fn abort_wakes_every_waiter() {
    let (c0, _c1) = pair(30_000);
    // Rank 1 never joins: rank 0's operations would wait 30 s without the abort.
    let first = c0.iallreduce(vec![1f32; 1000], ReduceOp::Sum).unwrap();
    let queued = c0.iallreduce(vec![2f32; 10], ReduceOp::Sum).unwrap();
    let start = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(200));
            c0.abort();
        });
        let e1 = first.wait().unwrap_err().to_string();
        let e2 = queued.wait().unwrap_err().to_string();
        assert!(e1.contains("abort"), "{e1}");
        assert!(e2.contains("abort") || e2.contains("unusable"), "{e2}");
    });
    assert!(start.elapsed() < Duration::from_secs(10), "abort took {:?}", start.elapsed());
    // Later calls fail at once, with the reason.
    let e = c0.barrier().unwrap_err().to_string();
    assert!(e.contains("unusable") || e.contains("abort"), "{e}");
}

#[test]
fn deadline_names_the_silent_rank() {
    let (c0, _c1) = pair(2000);
    let start = Instant::now();
    let e = c0.allreduce(&mut [1f64; 4], ReduceOp::Max).unwrap_err().to_string();
    assert!(e.contains("Timed out") && e.contains("rank 1") && e.contains("allreduce#0"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(10), "{:?}", start.elapsed());
}

#[test]
fn nonblocking_overlap_and_order() {
    let (c0, c1) = pair(30_000);
    let run = |c: &Communicator| {
        let r = c.rank() as f32;
        let a = c.iallreduce(vec![r + 1.0; 100_003], ReduceOp::Sum).unwrap();
        let b = c.ibroadcast(vec![r * 10.0; 17], 1).unwrap();
        let barrier = c.ibarrier().unwrap();
        let a = a.wait().unwrap();
        let b = b.wait().unwrap();
        barrier.wait().unwrap();
        assert!(a.iter().all(|&x| x == 3.0));
        assert!(b.iter().all(|&x| x == 10.0));
    };
    std::thread::scope(|s| {
        s.spawn(|| run(&c1));
        run(&c0);
    });
}

/// Non-blocking operations waited for at once (the waiter runs each itself), waited for
/// in reverse order, and mixed with blocking calls: every result right, in order, with
/// fresh values per round so a reordering would show.
#[test]
fn waiters_that_run_their_own_operations_keep_order() {
    let (c0, c1) = pair(30_000);
    let run = |c: &Communicator| {
        let r = c.rank() as f64;
        for round in 0..200 {
            let v = round as f64;
            let now = c.iallreduce(vec![r + v; 1 + round % 7], ReduceOp::Sum).unwrap().wait().unwrap();
            assert!(now.iter().all(|&x| x == 1.0 + 2.0 * v), "round {round}: {now:?}");
            let later: Vec<_> = (0..3).map(|k| c.iallreduce(vec![r * (k as f64 + 1.0) + v; 5], ReduceOp::Max).unwrap()).collect();
            let mut blocking = [r + v; 3];
            c.allreduce(&mut blocking, ReduceOp::Min).unwrap();
            assert_eq!(blocking, [v; 3], "round {round}");
            for (k, w) in later.into_iter().enumerate().rev() {
                let got = w.wait().unwrap();
                assert!(got.iter().all(|&x| x == (k as f64 + 1.0) + v), "round {round}, op {k}: {got:?}");
            }
        }
    };
    std::thread::scope(|s| {
        s.spawn(|| run(&c1));
        run(&c0);
    });
}

/// Ranks that set up parameter servers with different parameter counts (or servers) fail
/// at set-up, naming the rank and both shapes, on shm (where a mapped shard of the wrong
/// size would be written out of bounds) and on tcp.
#[test]
fn parameter_servers_of_different_shapes_are_refused() {
    use gradwire::rma::{ApplyRule, RemoteMemory};
    for transport in [TransportChoice::Shm, TransportChoice::Tcp] {
        for (rank1_params, rank1_servers) in [(4000, vec![0, 1]), (1000, vec![1])] {
            let p = port();
            let mut c = cfg(20_000);
            c.transport = transport;
            let c1 = c.clone();
            let setup = |comm: &Communicator, n: usize, servers: &[usize]| RemoteMemory::new(comm, servers, &vec![0.5f32; n], ApplyRule::Sum, 1.0).map(|_| ());
            let t = std::thread::spawn(move || {
                let comm = Communicator::with_env(env(1, 2, p), c1).unwrap();
                setup(&comm, rank1_params, &rank1_servers).unwrap_err().to_string()
            });
            let comm = Communicator::with_env(env(0, 2, p), c).unwrap();
            let e0 = setup(&comm, 1000, &[0, 1]).unwrap_err().to_string();
            let e1 = t.join().unwrap();
            assert!(e0.contains("parameter-server mismatch: rank 1 set up") && e0.contains("this rank 1000"), "{transport:?}: {e0}");
            assert!(e1.contains("parameter-server mismatch: rank 0 set up 1000"), "{transport:?}: {e1}");
            if rank1_params == 1000 {
                assert!(e0.contains("on other servers"), "{e0}");
            }
        }
    }
}

/// The one-host staged allreduce has no barrier after its copy-out, so a rank may start
/// its next segment or call while a slower peer still copies out of the last one. Here
/// ranks (threads, shm, an 8 KiB staging area: segments of 6 KiB) issue allreduces of many
/// sizes back to back with nothing between them (small form, staged with a short last
/// segment; with cross-memory attach, that form from 256 KiB, here within one process),
/// and only then check every result against sums computed independently, on fresh random
/// integers (exact in f32).
#[test]
fn shm_allreduces_back_to_back_all_match() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let sizes = [1usize, 700, 7919, 100_003, 3, 1531, 40_000, 16_384, 65_537];
    let calls: Vec<usize> = (0..3).flat_map(|_| sizes).collect();
    let input = |rank: usize, call: usize, n: usize| -> Vec<f32> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ ((rank as u64) << 32 | call as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (0..n).map(|_| rng.random_range(-1000..=1000) as f32).collect()
    };
    // Cross-memory attach off, on, and on only for even ranks (the ranks then agree to
    // stage from 256 KiB, and to agree only from 4 MiB after that).
    for (world, attach) in [(3, "off"), (4, "off"), (3, "on"), (4, "on"), (3, "even ranks")] {
        let p = port();
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..world)
                .map(|r| {
                    let (calls, input) = (&calls, &input);
                    s.spawn(move || {
                        let mut c = cfg(60_000);
                        c.transport = TransportChoice::Shm;
                        c.shm_stage_bytes = 8192;
                        c.shm_cma = attach == "on" || (attach == "even ranks" && r % 2 == 0);
                        let comm = Communicator::with_env(env(r, world, p), c).unwrap();
                        let mut bufs: Vec<Vec<f32>> = calls.iter().enumerate().map(|(i, &n)| input(r, i, n)).collect();
                        for b in bufs.iter_mut() {
                            comm.allreduce(b, ReduceOp::Sum).unwrap();
                        }
                        bufs
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, &n) in calls.iter().enumerate() {
            let mut want = vec![0f32; n];
            for r in 0..world {
                for (w, x) in want.iter_mut().zip(input(r, i, n)) {
                    *w += x;
                }
            }
            for (r, got) in results.iter().enumerate() {
                let wrong = got[i].iter().zip(&want).filter(|(g, w)| g != w).count();
                assert_eq!(wrong, 0, "{world} ranks (attach {attach}), rank {r}, call {i} ({n} floats): {wrong} wrong elements (seed {seed})");
            }
        }
    }
}

/// The other one-host collectives back to back, mixed, with no synchronisation between
/// calls: reduce-scatter, allgather, all-to-all, broadcast and reduce (rotating roots),
/// barriers between some, through an 8 KiB staging area (many segments; a rank starts its
/// next call while a slower one still reads the last) and through the default one (large
/// calls agree on a form first), on 3 and 4 ranks (more ranks than cores); every result
/// is checked only at the end, against sums computed independently on fresh random
/// integers (exact in f32).
#[test]
fn shm_every_collective_back_to_back_all_match() {
    use rand::{Rng, SeedableRng};
    #[derive(Clone, Copy, Debug)]
    enum Op {
        ReduceScatter,
        Allgather,
        AllToAll,
        Broadcast(usize),
        Reduce(usize),
        Barrier,
    }
    let seed: u64 = rand::random();
    // Elements per rank's part (or buffer, for broadcast and reduce).
    let sizes = [1usize, 700, 7919, 100_003, 3, 65_537];
    for (world, stage) in [(3, 8192), (4, 8192), (3, 0), (4, 0)] {
        let ops: Vec<(Op, usize)> = (0..24)
            .map(|i| {
                let n = sizes[i % sizes.len()];
                let op = match i % 6 {
                    0 => Op::ReduceScatter,
                    1 => Op::Allgather,
                    2 => Op::AllToAll,
                    3 => Op::Broadcast(i % world),
                    4 => Op::Reduce((i + 1) % world),
                    _ => Op::Barrier,
                };
                (op, n)
            })
            .collect();
        let input = |rank: usize, call: usize, n: usize| -> Vec<f32> {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ ((rank as u64) << 32 | call as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            (0..n).map(|_| rng.random_range(-1000..=1000) as f32).collect()
        };
        // The length of rank inputs and outputs of each call.
        let lens = |op: Op, n: usize| match op {
            Op::ReduceScatter => (n * world, n),
            Op::Allgather => (n, n * world),
            Op::AllToAll => (n * world, n * world),
            Op::Broadcast(_) | Op::Reduce(_) => (n, n),
            Op::Barrier => (0, 0),
        };
        let p = port();
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let ranks: Vec<_> = (0..world)
                .map(|r| {
                    let (ops, input, lens) = (&ops, &input, &lens);
                    s.spawn(move || {
                        let mut c = cfg(60_000);
                        c.transport = TransportChoice::Shm;
                        if stage > 0 {
                            c.shm_stage_bytes = stage;
                        }
                        let comm = Communicator::with_env(env(r, world, p), c).unwrap();
                        let mut outs = Vec::with_capacity(ops.len());
                        for (i, &(op, n)) in ops.iter().enumerate() {
                            let (sl, rl) = lens(op, n);
                            let send = input(r, i, sl);
                            let mut recv = vec![0f32; rl];
                            match op {
                                Op::ReduceScatter => comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum).unwrap(),
                                Op::Allgather => comm.allgather(&send, &mut recv).unwrap(),
                                Op::AllToAll => comm.alltoall(&send, &mut recv).unwrap(),
                                Op::Broadcast(root) => {
                                    recv.copy_from_slice(&send);
                                    comm.broadcast(&mut recv, root).unwrap()
                                }
                                Op::Reduce(root) => {
                                    recv.copy_from_slice(&send);
                                    comm.reduce(&mut recv, root, ReduceOp::Sum).unwrap()
                                }
                                Op::Barrier => comm.barrier().unwrap(),
                            }
                            outs.push(recv);
                        }
                        outs
                    })
                })
                .collect();
            ranks.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, &(op, n)) in ops.iter().enumerate() {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, i, lens(op, n).0)).collect();
            let sum = |range: std::ops::Range<usize>| -> Vec<f32> { range.map(|j| inputs.iter().map(|x| x[j]).sum()).collect() };
            for (r, got) in results.iter().enumerate() {
                let want: Vec<f32> = match op {
                    Op::ReduceScatter => sum(r * n..(r + 1) * n),
                    Op::Allgather => inputs.concat(),
                    Op::AllToAll => inputs.iter().flat_map(|x| x[r * n..(r + 1) * n].to_vec()).collect(),
                    Op::Broadcast(root) => inputs[root].clone(),
                    Op::Reduce(root) if r == root => sum(0..n),
                    Op::Reduce(_) => inputs[r].clone(),
                    Op::Barrier => vec![],
                };
                let wrong = got[i].iter().zip(&want).filter(|(g, w)| g != w).count() + got[i].len().abs_diff(want.len());
                assert_eq!(wrong, 0, "{world} ranks (staging {stage}), rank {r}, call {i} {op:?} of {n}: {wrong} wrong elements (seed {seed})");
            }
        }
    }
}

/// Private buffers of reduce-scatter, allgather, all-to-all, broadcast and reduce from 256 KiB go
/// through cross-memory attach or staging, whichever rank 0 has timed faster (the others
/// follow it: the 3rd and 4th call of a size take cross-memory attach), so six calls of
/// each run both forms. With attach on, off, and on only for even ranks (the others cannot
/// attach: all stage), at 2 and 3 ranks (threads), every call is checked
/// against an independent reference on fresh random integers (exact in f32).
#[test]
fn shm_private_buffers_attached_or_staged_all_match() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let n = 70_000; // floats per rank's part: 280 KB
    for (world, attach) in [(2, "on"), (3, "on"), (3, "off"), (3, "even ranks")] {
        let input = |rank: usize, call: usize, len: usize| -> Vec<f32> {
            let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ ((rank as u64) << 32 | call as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            (0..len).map(|_| rng.random_range(-1000..=1000) as f32).collect()
        };
        // Call i: collective i / 6, the (i % 6)+1-th call of it; the roots rotate.
        let calls = 30;
        let lens = |i: usize| match i / 6 {
            0 => (n * world, n),         // reduce-scatter
            1 => (n, n * world),         // allgather
            2 => (n * world, n * world), // all-to-all
            _ => (n, n),                 // broadcast, reduce
        };
        let configure = |r: usize, c: &mut Config| {
            c.transport = TransportChoice::Shm;
            c.shm_cma = attach == "on" || (attach == "even ranks" && r % 2 == 0);
        };
        let results: Vec<Vec<Vec<f32>>> = ranks_as_threads(world, configure, |r, comm| {
            (0..calls)
                .map(|i| {
                    let (sl, rl) = lens(i);
                    let send = input(r, i, sl);
                    let mut recv = vec![0f32; rl];
                    match i / 6 {
                        0 => comm.reduce_scatter(&send, &mut recv, ReduceOp::Sum).unwrap(),
                        1 => comm.allgather(&send, &mut recv).unwrap(),
                        2 => comm.alltoall(&send, &mut recv).unwrap(),
                        3 => {
                            recv.copy_from_slice(&send);
                            comm.broadcast(&mut recv, i % world).unwrap()
                        }
                        _ => {
                            recv.copy_from_slice(&send);
                            comm.reduce(&mut recv, (i + 1) % world, ReduceOp::Sum).unwrap()
                        }
                    }
                    recv
                })
                .collect()
        });
        for i in 0..calls {
            let inputs: Vec<Vec<f32>> = (0..world).map(|r| input(r, i, lens(i).0)).collect();
            for (r, got) in results.iter().enumerate() {
                let want: Vec<f32> = match i / 6 {
                    0 => (r * n..(r + 1) * n).map(|j| inputs.iter().map(|x| x[j]).sum()).collect(),
                    1 => inputs.concat(),
                    2 => inputs.iter().flat_map(|x| x[r * n..(r + 1) * n].to_vec()).collect(),
                    3 => inputs[i % world].clone(),
                    _ if r == (i + 1) % world => (0..n).map(|j| inputs.iter().map(|x| x[j]).sum()).collect(),
                    _ => inputs[r].clone(),
                };
                let wrong = got[i].iter().zip(&want).filter(|(g, w)| g != w).count() + got[i].len().abs_diff(want.len());
                assert_eq!(wrong, 0, "{world} ranks (attach {attach}), rank {r}, call {i}: {wrong} wrong elements (seed {seed})");
            }
        }
    }
}

/// Allgather and reduce-scatter in place (NCCL's layout: this rank's block of the larger
/// buffer), over shm (staged only, and with cross-memory attach, which rank 0's chooser
/// tries from a size's third call) and tcp at 3 ranks, 6 calls per size, against sums
/// computed independently on fresh random integers; the reduce-scatter leaves the other
/// blocks as they were, and the allgather fills every peer's block (NaN before the call).
#[test]
fn in_place_allgather_and_reduce_scatter_match() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let (world, calls) = (3, 6);
    let input = |rank: usize, call: usize, n: usize| -> Vec<f32> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ ((rank as u64) << 32 | call as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (0..n).map(|_| rng.random_range(-1000..=1000) as f32).collect()
    };
    let blocks = [1usize, 7919, 100_003];
    let forms = [("shm", TransportChoice::Shm, true), ("shm, staged only", TransportChoice::Shm, false), ("tcp", TransportChoice::Tcp, true)];
    for (form, transport, attach) in forms {
        let results: Vec<Vec<Vec<f32>>> = ranks_as_threads(
            world,
            |_, c| {
                c.transport = transport;
                c.shm_cma = attach;
            },
            |r, comm| {
                let mut outs = Vec::new();
                for (i, &m) in blocks.iter().enumerate() {
                    for k in 0..calls {
                        let call = 2 * (i * calls + k);
                        let mut buf = vec![f32::NAN; m * world];
                        buf[r * m..(r + 1) * m].copy_from_slice(&input(r, call, m));
                        comm.allgather_in_place(&mut buf).unwrap();
                        outs.push(buf);
                        let mut buf = input(r, call + 1, m * world);
                        comm.reduce_scatter_in_place(&mut buf, ReduceOp::Sum).unwrap();
                        outs.push(buf);
                    }
                }
                outs
            },
        );
        for (i, &m) in blocks.iter().enumerate() {
            for k in 0..calls {
                let call = 2 * (i * calls + k);
                let gathered: Vec<f32> = (0..world).flat_map(|r| input(r, call, m)).collect();
                let reduce_in: Vec<Vec<f32>> = (0..world).map(|r| input(r, call + 1, m * world)).collect();
                for (r, got) in results.iter().enumerate() {
                    assert!(got[call] == gathered, "{form}: rank {r}, allgather in place of {m}, call {k} (seed {seed})");
                    let want: Vec<f32> = (0..m * world).map(|j| if j / m == r { reduce_in.iter().map(|x| x[j]).sum() } else { reduce_in[r][j] }).collect();
                    assert!(got[call + 1] == want, "{form}: rank {r}, reduce-scatter in place of {m}, call {k} (seed {seed})");
                }
            }
        }
    }
}

/// The in-place reduce-scatter on buffers from gradwire's shared memory, large enough for
/// the zero-copy form (peers reduce straight out of this rank's buffer while its own block
/// is the output), and the in-place allgather on them, over shm at 3 ranks.
#[test]
fn in_place_collectives_on_shared_buffers() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let (world, m) = (3, 100_003);
    let input = |rank: usize, call: usize, n: usize| -> Vec<f32> {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ ((rank as u64) << 32 | call as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        (0..n).map(|_| rng.random_range(-1000..=1000) as f32).collect()
    };
    let p = port();
    let results: Vec<(Vec<f32>, Vec<f32>)> = std::thread::scope(|s| {
        let ranks: Vec<_> = (0..world)
            .map(|r| {
                let input = &input;
                s.spawn(move || {
                    let mut c = cfg(60_000);
                    c.transport = TransportChoice::Shm;
                    let comm = Communicator::with_env(env(r, world, p), c).unwrap();
                    let region = gradwire::mem::Region::shared("in-place-test", m * world * 4).unwrap();
                    // SAFETY: the region is ours, page-aligned and m × world f32 long.
                    let buf = unsafe { std::slice::from_raw_parts_mut(region.as_ptr() as *mut f32, m * world) };
                    buf.copy_from_slice(&input(r, 0, m * world));
                    comm.reduce_scatter_in_place(buf, ReduceOp::Sum).unwrap();
                    let reduced = buf.to_vec();
                    buf.fill(0.0);
                    buf[r * m..(r + 1) * m].copy_from_slice(&input(r, 1, m));
                    comm.allgather_in_place(buf).unwrap();
                    (reduced, buf.to_vec())
                })
            })
            .collect();
        ranks.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ins: Vec<Vec<f32>> = (0..world).map(|r| input(r, 0, m * world)).collect();
    let gathered: Vec<f32> = (0..world).flat_map(|r| input(r, 1, m)).collect();
    for (r, (reduced, all)) in results.iter().enumerate() {
        let want: Vec<f32> = (0..m * world).map(|j| if j / m == r { ins.iter().map(|x| x[j]).sum() } else { ins[r][j] }).collect();
        assert!(reduced == &want, "rank {r}: reduce-scatter in place on shared buffers (seed {seed})");
        assert!(all == &gathered, "rank {r}: allgather in place on shared buffers (seed {seed})");
    }
}

/// A receive of 0 bytes that finds another tag's message first reads that message aside
/// before taking its own: it is not done until then, even though its own payload is empty.
/// Here the message read aside (32 MiB) outgrows what the link holds, so it arrives in
/// pieces while the batch's next receive from the same peer waits its turn (that receive
/// once read from the middle of it: "bad frame magic"). Over tcp and shm; the data is
/// checked.
#[test]
fn an_empty_receive_reads_a_large_message_of_another_tag_aside_whole() {
    use gradwire::{DType, P2pOp};
    for transport in [TransportChoice::Tcp, TransportChoice::Shm] {
        let n = 8 << 20;
        let sent: Vec<f32> = (0..n).map(|i| (i % 9973) as f32 * 0.5 + 1.0).collect();
        ranks_as_threads(
            2,
            |_, c| c.transport = transport,
            |rank, comm| {
                let mut big = if rank == 0 { sent.clone() } else { vec![0f32; n] };
                let mut empty: [f32; 0] = [];
                let op = |send, tag, count, buf: *mut f32| P2pOp { send, peer: 1 - rank, tag, dtype: DType::F32, count, buf: buf as *mut u8 };
                let ops = if rank == 0 {
                    [op(true, 21, n, big.as_mut_ptr()), op(true, 23, 0, empty.as_mut_ptr())]
                } else {
                    [op(false, 23, 0, empty.as_mut_ptr()), op(false, 21, n, big.as_mut_ptr())]
                };
                // SAFETY: every buffer lives, untouched, until the batch returns.
                unsafe { comm.run_p2p_batch(&ops) }.unwrap_or_else(|e| panic!("{transport:?}, rank {rank}: {e}"));
                if rank == 1 {
                    assert!(big == sent, "{transport:?}: the message read aside arrived changed");
                }
            },
        );
    }
}
