//! The C ABI from C and from the boundary's point of view: the example program under
//! `gradwire launch` with 4 ranks, and bad input to every exported function.

mod common;
use common::*;
use gradwire::ffi::*;
use std::ffi::{c_void, CStr};
use std::process::Command;
use std::time::Duration;

#[test]
fn c_example_with_four_ranks() {
    let exe = c_program("ffi/examples/collectives.c", "collectives-c-example");
    for transport in ["shm", "tcp"] {
        let mut cmd = Command::new(bin());
        cmd.args(["launch", "-n", "4", "--"]).arg(&exe).env("GRADWIRE_TRANSPORT", transport);
        let out = run_with_limit(cmd, Duration::from_secs(120));
        let t = text(&out);
        println!("{t}");
        assert!(out.status.success(), "{transport}: {t}");
        assert_eq!(t.matches(": 0 wrong elements").count(), 4, "{t}");
    }
}

/// Communicators from unique ids, with no launcher and no rendezvous variables: the whole
/// world, then a subgroup made by its members alone (ffi/examples/unique_id.c), over shm
/// and tcp (and across two "nodes" for the hierarchical allreduce), with none of MASTER_ADDR, MASTER_PORT or GRADWIRE_JOB_SECRET set.
#[test]
fn unique_ids_make_groups_without_a_launcher() {
    let exe = c_program("ffi/examples/unique_id.c", "unique-id-c-example");
    // Auto with two "nodes": the hierarchical allreduce crosses them over tcp.
    for (transport, w, nodes) in [("shm", 4, 1), ("tcp", 3, 1), ("shm", 1, 1), ("auto", 4, 2)] {
        let mut cmd = Command::new(&exe);
        cmd.arg(w.to_string()).env("GRADWIRE_TRANSPORT", transport).env("GRADWIRE_TIMEOUT_MS", "30000").env("UNIQUE_ID_NODES", nodes.to_string());
        for k in ["MASTER_ADDR", "MASTER_PORT", "GRADWIRE_MASTER_ADDR", "GRADWIRE_MASTER_PORT", "GRADWIRE_JOB_SECRET", "RANK", "WORLD_SIZE"] {
            cmd.env_remove(k);
        }
        let out = run_with_limit(cmd, Duration::from_secs(120));
        let t = text(&out);
        assert!(out.status.success(), "{transport}, {w} ranks: {t}");
        assert_eq!(t.matches(": ok").count(), w, "{t}");
    }
}

fn last_error() -> String {
    // SAFETY: gradwire_last_error returns a valid NUL-terminated string.
    unsafe { CStr::from_ptr(gradwire_last_error()) }.to_string_lossy().into_owned()
}

/// Expects `code` to be the given error and the error text to contain `needle`.
#[track_caller]
fn expect(code: i32, want: i32, needle: &str) {
    let msg = last_error();
    assert_eq!(code, want, "code {code} (want {want}); last error: {msg}");
    assert!(msg.contains(needle), "last error {msg:?} lacks {needle:?}");
}

const INVALID: i32 = -3;
const CONFIG: i32 = -2;

#[test]
fn bad_input_to_every_function() {
    // SAFETY: the calls below pass NULL, bogus handles and short or overlapping buffers on
    // purpose; gradwire must reject each before touching memory, and the valid buffers
    // (`x`, `mem`) outlive every call.
    unsafe { bad_inputs() }
}

unsafe fn bad_inputs() {
    // A one-rank job: every collective is legal and local, so only the input is at fault.
    for (k, v) in [("RANK", "0"), ("WORLD_SIZE", "1")] {
        std::env::set_var(k, v);
    }
    let bogus = 0x1230 as *mut gradwire_comm_t;
    let null: *mut gradwire_comm_t = std::ptr::null_mut();
    let mut comm: *mut gradwire_comm_t = std::ptr::null_mut();
    let mut x = [1.0f32; 8];
    let xp = x.as_mut_ptr() as *mut c_void;

    expect(gradwire_init(std::ptr::null_mut()), INVALID, "comm is NULL");
    assert_eq!(gradwire_init(&mut comm), 0, "{}", last_error());
    let (mut rank, mut size) = (-1, -1);
    // Handles are not small integers: none of the first sixteen aligned values is live
    // (0x10-0x1f used to be communicator #1).
    for guess in 1..=0x20usize {
        expect(gradwire_comm_rank((guess << 4) as *mut gradwire_comm_t, &mut rank), INVALID, "not a live communicator");
    }
    for guess in 0x10..0x20usize {
        expect(gradwire_comm_rank(guess as *mut gradwire_comm_t, &mut rank), INVALID, "not a live communicator");
    }

    expect(gradwire_comm_rank(null, &mut rank), INVALID, "comm is NULL");
    expect(gradwire_comm_rank(bogus, &mut rank), INVALID, "not a live communicator");
    expect(gradwire_comm_rank(comm, std::ptr::null_mut()), INVALID, "rank is NULL");
    expect(gradwire_comm_size(bogus, &mut size), INVALID, "not a live communicator");
    expect(gradwire_comm_size(comm, std::ptr::null_mut()), INVALID, "size is NULL");
    let mut sub: *mut gradwire_comm_t = std::ptr::null_mut();
    expect(gradwire_get_unique_id(std::ptr::null_mut()), INVALID, "id is NULL");
    let mut id = gradwire::ffi::gradwire_unique_id_t { internal: [0; 128] };
    expect(gradwire_comm_init_rank(&mut sub, &id, 2, 0), INVALID, "not a gradwire unique id");
    expect(gradwire_comm_init_rank(std::ptr::null_mut(), &id, 2, 0), INVALID, "comm is NULL");
    expect(gradwire_comm_init_rank(&mut sub, std::ptr::null(), 2, 0), INVALID, "id is NULL");
    expect(gradwire_get_unique_id(&mut id), 0, "");
    for (n, r) in [(0, 0), (2, 2), (2, -1), (-3, 0)] {
        expect(gradwire_comm_init_rank(&mut sub, &id, n, r), INVALID, "need nranks >= 1 and 0 <= rank < nranks");
    }
    expect(gradwire_comm_split(bogus, 0, 0, &mut sub), INVALID, "not a live communicator");
    expect(gradwire_comm_split(comm, 0, 0, std::ptr::null_mut()), INVALID, "newcomm is NULL");

    expect(gradwire_allreduce(bogus, xp, xp, 8, 0, 0), INVALID, "not a live communicator");
    expect(gradwire_allreduce(comm, xp, xp, 8, 42, 0), INVALID, "unknown dtype 42");
    expect(gradwire_allreduce(comm, xp, xp, 8, 0, 9), INVALID, "unknown op 9");
    expect(gradwire_allreduce(comm, xp, xp, usize::MAX, 0, 0), INVALID, "overflows");
    // No overflow in usize, but no buffer can be that large (a slice over isize::MAX bytes
    // is undefined behaviour): refused before anything touches memory.
    expect(gradwire_allreduce(comm, xp, xp, usize::MAX / 4, 0, 0), INVALID, "more than any buffer can hold");
    expect(gradwire_allgather(comm, xp, xp, (isize::MAX as usize) / 4 + 1, 0), INVALID, "more than any buffer can hold");
    expect(gradwire_allreduce(comm, std::ptr::null(), xp, 8, 0, 0), INVALID, "sendbuf is NULL");
    expect(gradwire_allreduce(comm, xp, std::ptr::null_mut(), 8, 0, 0), INVALID, "recvbuf is NULL");
    // SAFETY: pointer arithmetic inside `x` only, to build an overlapping pair.
    let shifted = unsafe { (xp as *mut f32).add(1) } as *mut c_void;
    expect(gradwire_allreduce(comm, xp, shifted, 4, 0, 0), INVALID, "overlap");

    let mut work: *mut gradwire_work_t = std::ptr::null_mut();
    expect(gradwire_iallreduce(comm, xp, xp, 8, 0, 0, std::ptr::null_mut()), INVALID, "work is NULL");
    expect(gradwire_iallreduce(comm, xp, xp, 8, 9, 0, &mut work), INVALID, "unknown dtype 9");
    expect(gradwire_wait(std::ptr::null_mut(), -1), INVALID, "work is NULL");
    expect(gradwire_wait(0x4560 as *mut gradwire_work_t, -1), INVALID, "not a live work");
    assert_eq!(gradwire_iallreduce(comm, xp, xp, 8, 0, 0, &mut work), 0, "{}", last_error());
    let mut done = -1;
    expect(gradwire_test(work, std::ptr::null_mut()), INVALID, "done is NULL");
    expect(gradwire_test(std::ptr::null_mut(), &mut done), INVALID, "work is NULL");
    while done != 1 {
        assert_eq!(gradwire_test(work, &mut done), 0, "{}", last_error());
    }
    assert_eq!(gradwire_wait(work, 1000), 0, "{}", last_error());
    expect(gradwire_test(work, &mut done), INVALID, "not a live work handle");
    expect(gradwire_wait(work, -1), INVALID, "already waited");

    expect(gradwire_broadcast(comm, xp, 8, 0, -1), INVALID, "negative");
    expect(gradwire_broadcast(comm, xp, 8, 0, 1), INVALID, "root 1 is not a rank");
    expect(gradwire_broadcast(comm, std::ptr::null_mut(), 8, 0, 0), INVALID, "NULL");
    expect(gradwire_broadcast(comm, xp, 8, 11, 0), INVALID, "unknown dtype 11");
    expect(gradwire_ibroadcast(bogus, xp, 8, 0, 0, &mut work), INVALID, "not a live communicator");
    expect(gradwire_ibroadcast(comm, xp, 8, 0, -1, &mut work), INVALID, "root -1 is negative");
    expect(gradwire_ibroadcast(comm, xp, 8, 0, 0, std::ptr::null_mut()), INVALID, "work is NULL");
    expect(gradwire_iallgather(comm, xp, std::ptr::null_mut(), 8, 0, &mut work), INVALID, "recvbuf is NULL");
    expect(gradwire_ireduce_scatter(comm, xp, xp, 8, 0, 9, &mut work), INVALID, "unknown op 9");
    expect(gradwire_reduce(comm, xp, xp, 8, 0, 0, -2), INVALID, "root -2 is negative");
    expect(gradwire_reduce(bogus, xp, xp, 8, 0, 0, 0), INVALID, "not a live communicator");
    expect(gradwire_alltoall(bogus, xp, std::ptr::null(), xp, std::ptr::null(), 1, 0), INVALID, "not a live communicator");
    let counts = [1usize];
    expect(gradwire_alltoall(comm, xp, counts.as_ptr(), xp, std::ptr::null(), 1, 0), INVALID, "both be NULL");
    expect(gradwire_alltoall(comm, xp, std::ptr::null(), xp, std::ptr::null(), 4, 0), INVALID, "overlap");
    expect(gradwire_ialltoall(comm, xp, std::ptr::null(), std::ptr::null_mut(), std::ptr::null(), 4, 0, &mut work), INVALID, "recvbuf is NULL");
    expect(gradwire_send(comm, xp, 8, 0, 0, 1), INVALID, "must be another rank");
    expect(gradwire_recv(comm, xp, 8, 0, -1, 1), INVALID, "peer -1 is negative");
    expect(gradwire_send(bogus, xp, 8, 0, 1, 1), INVALID, "not a live communicator");
    let op = |kind, peer, dtype, buf| gradwire_p2p_op_t { kind, peer, tag: 3, dtype, count: 8, buf };
    expect(gradwire_p2p_batch(comm, std::ptr::null(), 2), INVALID, "ops is NULL with nops 2");
    expect(gradwire_p2p_batch(comm, [op(7, 1, 0, xp)].as_ptr(), 1), INVALID, "ops[0].kind is 7");
    expect(gradwire_p2p_batch(comm, [op(GRADWIRE_P2P_SEND, 1, 0, xp), op(GRADWIRE_P2P_RECV, -1, 0, xp)].as_ptr(), 2), INVALID, "ops[1].peer -1 is negative");
    expect(gradwire_p2p_batch(comm, [op(GRADWIRE_P2P_RECV, 0, 0, xp)].as_ptr(), 1), INVALID, "must be another rank");
    expect(gradwire_p2p_batch(comm, [op(GRADWIRE_P2P_SEND, 1, 13, xp)].as_ptr(), 1), INVALID, "unknown dtype 13");
    expect(gradwire_p2p_batch(comm, [op(GRADWIRE_P2P_SEND, 1, 0, std::ptr::null_mut())].as_ptr(), 1), INVALID, "null buffer");
    expect(gradwire_ip2p_batch(comm, [op(GRADWIRE_P2P_SEND, 1, 0, xp)].as_ptr(), 1, std::ptr::null_mut()), INVALID, "work is NULL");
    expect(gradwire_ip2p_batch(bogus, [op(GRADWIRE_P2P_SEND, 1, 0, xp)].as_ptr(), 1, &mut work), INVALID, "not a live communicator");
    // A receive may not overlap another buffer of the batch (two sends may share one).
    let two = [op(GRADWIRE_P2P_SEND, 1, 0, xp), op(GRADWIRE_P2P_RECV, 1, 0, shifted)];
    expect(gradwire_p2p_batch(comm, two.as_ptr(), 2), INVALID, "overlaps another buffer");
    // Training schemes: bad input, then a one-rank ssgd round trip.
    let mut strat: *mut gradwire_strategy_t = std::ptr::null_mut();
    let init = [0.5f32; 8];
    let c = |s: &str| std::ffi::CString::new(s).unwrap();
    let (ssgd, bsp, junk) = (c("ssgd"), c("bsp"), c("sgdx"));
    expect(gradwire_strategy_create(comm, std::ptr::null(), std::ptr::null(), init.as_ptr(), 8, &mut strat), INVALID, "scheme is NULL");
    expect(gradwire_strategy_create(comm, junk.as_ptr(), std::ptr::null(), init.as_ptr(), 8, &mut strat), INVALID, "unknown strategy 'sgdx'");
    expect(gradwire_strategy_create(comm, bsp.as_ptr(), c("interval=0").as_ptr(), init.as_ptr(), 8, &mut strat), INVALID, "interval=0");
    expect(gradwire_strategy_create(comm, ssgd.as_ptr(), std::ptr::null(), std::ptr::null(), 8, &mut strat), INVALID, "init is NULL");
    expect(gradwire_strategy_create(comm, ssgd.as_ptr(), std::ptr::null(), init.as_ptr(), 8, std::ptr::null_mut()), INVALID, "strategy is NULL");
    expect(gradwire_strategy_create(bogus, ssgd.as_ptr(), std::ptr::null(), init.as_ptr(), 8, &mut strat), INVALID, "not a live communicator");
    assert_eq!(gradwire_strategy_create(comm, ssgd.as_ptr(), std::ptr::null(), init.as_ptr(), 8, &mut strat), 0, "{}", last_error());
    let (mut p, mut g) = ([1.0f32; 8], [0.25f32; 8]);
    expect(gradwire_strategy_start(strat, p.as_mut_ptr(), 7), INVALID, "7 values, but the scheme was made for 8 parameters");
    expect(gradwire_strategy_before_update(strat, g.as_mut_ptr(), 8, 0), INVALID, "before_update before start: call start first");
    assert_eq!(gradwire_strategy_start(strat, p.as_mut_ptr(), 8), 0, "{}", last_error());
    expect(gradwire_strategy_before_update(strat, std::ptr::null_mut(), 8, 0), INVALID, "grads is NULL");
    // SAFETY: pointer arithmetic inside `g`, to make a misaligned float pointer (refused
    // before anything reads through it).
    let odd = unsafe { (g.as_mut_ptr() as *mut u8).add(1) } as *mut f32;
    expect(gradwire_strategy_before_update(strat, odd, 8, 0), INVALID, "grads is not aligned for float");
    expect(gradwire_strategy_step(strat, p.as_mut_ptr(), g.as_ptr(), 8, 0), INVALID, "call before_update and after_update");
    expect(gradwire_strategy_step(strat, p.as_mut_ptr(), p.as_ptr(), 8, 0), INVALID, "params and grads overlap");
    assert_eq!(gradwire_strategy_before_update(strat, g.as_mut_ptr(), 8, 1), 0, "{}", last_error());
    assert_eq!(gradwire_strategy_after_update(strat, p.as_mut_ptr(), 8, 1), 0, "{}", last_error());
    let mut mean = 0.0;
    assert_eq!(gradwire_strategy_end_epoch(strat, p.as_mut_ptr(), 8, 2.5, &mut mean), 0, "{}", last_error());
    assert_eq!(mean, 2.5);
    let mut text = [0 as std::ffi::c_char; 5];
    assert_eq!(gradwire_strategy_describe(strat, text.as_mut_ptr(), 5), 0, "{}", last_error());
    // SAFETY: describe NUL-terminates within the 5 bytes.
    assert_eq!(unsafe { CStr::from_ptr(text.as_ptr()) }.to_str().unwrap(), "ssgd");
    assert_eq!(gradwire_strategy_finish(strat, p.as_mut_ptr(), 8), 0, "{}", last_error());
    assert_eq!(gradwire_strategy_free(strat), 0, "{}", last_error());
    expect(gradwire_strategy_free(strat), INVALID, "not a live strategy handle");
    expect(gradwire_strategy_start(strat, p.as_mut_ptr(), 8), INVALID, "not a live strategy handle");
    let mut mean_bad = 0.0;
    expect(gradwire_strategy_end_epoch(strat, p.as_mut_ptr(), 8, 1.0, &mut mean_bad), INVALID, "not a live strategy handle");
    // A scheme whose caller moves the data: only the size comes in, the calls take no
    // buffer, and the recorded actions come out in order, in pieces of `capacity`.
    let daso = c("daso");
    let caller = c("data=caller,warmup_epochs=1,epochs=4");
    let mut acts = [0i64; 6];
    let mut count = 0usize;
    expect(gradwire_strategy_create(comm, daso.as_ptr(), caller.as_ptr(), init.as_ptr(), 8, &mut strat), INVALID, "init must be NULL");
    expect(gradwire_strategy_create(comm, daso.as_ptr(), c("data=gpu").as_ptr(), std::ptr::null(), 8, &mut strat), INVALID, "expected gradwire or caller");
    assert_eq!(gradwire_strategy_create(comm, daso.as_ptr(), caller.as_ptr(), std::ptr::null(), 8, &mut strat), 0, "{}", last_error());
    expect(gradwire_strategy_start(strat, p.as_mut_ptr(), 8), INVALID, "it takes no buffer");
    assert_eq!(gradwire_strategy_start(strat, std::ptr::null_mut(), 0), 0, "{}", last_error());
    expect(gradwire_strategy_take_actions(strat, std::ptr::null_mut(), 2, &mut count), INVALID, "out is NULL");
    expect(gradwire_strategy_take_actions(strat, acts.as_mut_ptr(), 2, std::ptr::null_mut()), INVALID, "count is NULL");
    assert_eq!(gradwire_strategy_take_actions(strat, acts.as_mut_ptr(), 1, &mut count), 0, "{}", last_error());
    assert_eq!((count, &acts[..3]), (1, &[1, 0, 0][..]), "first: rank 0's parameters to every rank");
    assert_eq!(gradwire_strategy_take_actions(strat, acts.as_mut_ptr(), 2, &mut count), 0, "{}", last_error());
    assert_eq!((count, &acts[..3]), (1, &[10, 1, 0][..]), "then: the next backward's gradients are averaged in the node");
    assert_eq!(gradwire_strategy_take_actions(strat, acts.as_mut_ptr(), 2, &mut count), 0, "{}", last_error());
    assert_eq!(count, 0);
    assert_eq!(gradwire_strategy_free(strat), 0, "{}", last_error());
    assert_eq!(gradwire_strategy_create(comm, ssgd.as_ptr(), std::ptr::null(), init.as_ptr(), 8, &mut strat), 0, "{}", last_error());
    expect(gradwire_strategy_take_actions(strat, acts.as_mut_ptr(), 2, &mut count), INVALID, "was not made with data=caller");
    assert_eq!(gradwire_strategy_free(strat), 0, "{}", last_error());
    let mut sub: *mut gradwire_comm_t = std::ptr::null_mut();
    expect(gradwire_comm_split_type(comm, 2, &mut sub), INVALID, "split_type 2");
    expect(gradwire_comm_init_rank_timeout(&mut sub, std::ptr::null(), 1, 0, 0), INVALID, "timeout_ms 0 must be between 1 and");
    expect(gradwire_comm_init_rank_timeout(&mut sub, std::ptr::null(), 1, 0, -5), INVALID, "timeout_ms -5");
    expect(gradwire_comm_init_rank_timeout(&mut sub, std::ptr::null(), 1, 0, 1000), INVALID, "id is NULL");
    // An empty batch is a no-op.
    assert_eq!(gradwire_p2p_batch(comm, std::ptr::null(), 0), 0, "{}", last_error());
    expect(gradwire_allgather(comm, xp, shifted, 4, 0), INVALID, "overlap");
    // One rank: the same pointer is NCCL's in-place layout (this rank's block at offset 0).
    assert_eq!(gradwire_allgather(comm, xp, xp, 4, 0), 0, "{}", last_error());
    expect(gradwire_allgather(comm, xp, std::ptr::null_mut(), 4, 0), INVALID, "recvbuf is NULL");
    expect(gradwire_allgather(null, xp, shifted, 4, 0), INVALID, "comm is NULL");
    assert_eq!(gradwire_reduce_scatter(comm, xp, xp, 4, 0, 0), 0, "{}", last_error());
    // SAFETY: inside `x`, one element on: neither in-place layout.
    expect(gradwire_reduce_scatter(comm, xp, unsafe { xp.add(4) }, 4, 0, 0), INVALID, "recvbuf = sendbuf + rank x recvcount");
    expect(gradwire_reduce_scatter(comm, xp, shifted, 4, 0, 5), INVALID, "unknown op 5");
    expect(gradwire_reduce_scatter(comm, std::ptr::null(), xp, 4, 0, 0), INVALID, "sendbuf is NULL");
    expect(gradwire_barrier(bogus), INVALID, "not a live communicator");
    // The rule every call applies, as a framework asks it (one rank: its block is at 0).
    let mut lay = -1;
    let cx = xp as *const c_void;
    // SAFETY: inside `x`, 4 bytes on (the buffers are not read).
    let x4 = unsafe { cx.add(4) };
    expect(gradwire_buffer_layout(comm, 6, cx, 16, cx, 16, &mut lay), INVALID, "unknown collective 6");
    expect(gradwire_buffer_layout(comm, 0, cx, 16, cx, 16, std::ptr::null_mut()), INVALID, "layout is NULL");
    expect(gradwire_buffer_layout(bogus, 0, cx, 16, cx, 16, &mut lay), INVALID, "not a live communicator");
    let code = |name: &str| GRADWIRE_CALLS.iter().position(|(n, _)| *n == name).unwrap() as u32;
    let (allreduce, allgather) = (code("GRADWIRE_CALL_ALLREDUCE"), code("GRADWIRE_CALL_ALLGATHER"));
    let (reduce_scatter, alltoall) = (code("GRADWIRE_CALL_REDUCE_SCATTER"), code("GRADWIRE_CALL_ALLTOALL"));
    for (call, send, sb, recv, rb, want) in [
        (allreduce, cx, 16, cx, 16, GRADWIRE_LAYOUT_IN_PLACE),
        (allreduce, cx, 16, x4, 16, GRADWIRE_LAYOUT_OVERLAPPING),
        (allreduce, cx, 4, x4, 4, GRADWIRE_LAYOUT_APART),
        (allgather, cx, 4, cx, 4, GRADWIRE_LAYOUT_BLOCK),
        (allgather, x4, 4, cx, 8, GRADWIRE_LAYOUT_OVERLAPPING),
        (reduce_scatter, cx, 8, cx, 4, GRADWIRE_LAYOUT_BLOCK),
        (alltoall, cx, 16, cx, 16, GRADWIRE_LAYOUT_OVERLAPPING),
        (alltoall, cx, 0, cx, 16, GRADWIRE_LAYOUT_APART),
    ] {
        assert_eq!(gradwire_buffer_layout(comm, call, send, sb, recv, rb, &mut lay), 0, "{}", last_error());
        assert_eq!(lay, want, "collective {call}, {sb} bytes at {send:p}, {rb} at {recv:p}");
    }

    let mut mem: *mut c_void = std::ptr::null_mut();
    expect(gradwire_alloc(comm, 0, &mut mem), INVALID, "bytes is 0");
    expect(gradwire_alloc(comm, usize::MAX, &mut mem), INVALID, "more than this process can map");
    // 64 TiB: a sparse memfd would "succeed" and the first touch past memory would kill us.
    expect(gradwire_alloc(comm, 64 << 40, &mut mem), INVALID, "more than this host has");
    expect(gradwire_alloc(comm, 64, std::ptr::null_mut()), INVALID, "ptr is NULL");
    expect(gradwire_free(comm, xp), INVALID, "did not come from gradwire_alloc");
    expect(gradwire_free(comm, std::ptr::null_mut()), INVALID, "ptr is NULL");
    assert_eq!(gradwire_alloc(comm, 4096, &mut mem), 0, "{}", last_error());
    assert_eq!(gradwire_free(comm, mem), 0, "{}", last_error());
    expect(gradwire_free(comm, mem), INVALID, "freed already");

    // Registration: bad input, then a round trip that keeps the contents.
    let mut big = vec![7u8; 5 * 4096 + 100];
    let bp = big[100..].as_mut_ptr() as *mut c_void;
    expect(gradwire_register(comm, std::ptr::null_mut(), 4096), INVALID, "ptr is NULL");
    expect(gradwire_register(bogus, bp, 4096), INVALID, "not a live communicator");
    expect(gradwire_register(comm, xp, 32), INVALID, "no whole page");
    expect(gradwire_register(comm, bp, usize::MAX), INVALID, "wraps around");
    expect(gradwire_deregister(comm, bp), INVALID, "is not registered");
    assert_eq!(gradwire_register(comm, bp, 5 * 4096), 0, "{}", last_error());
    expect(gradwire_register(comm, bp, 5 * 4096), INVALID, "registered already");
    // SAFETY: inside `big`, one page on.
    expect(gradwire_register(comm, unsafe { bp.add(4096) }, 3 * 4096), INVALID, "overlap");
    assert_eq!(gradwire_allreduce(comm, bp, bp, 4096, 0, 0), 0, "{}", last_error());
    assert_eq!(gradwire_deregister(comm, bp), 0, "{}", last_error());
    expect(gradwire_deregister(comm, bp), INVALID, "deregistered already");
    assert!(big.iter().all(|&b| b == 7), "registering and deregistering keep the contents");
    assert_eq!(gradwire_register(comm, bp, 5 * 4096), 0, "{}", last_error());

    // A buffer unmapped without deregistering, and new memory mapped at its address: that
    // address can be registered again (it used to say "registered already" for ever).
    let pages = 4 * 4096;
    // SAFETY (all below): our own fresh anonymous mappings, which nothing else uses.
    let anon =
        |at: *mut c_void, flags| unsafe { libc::mmap(at, pages, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | flags, -1, 0) };
    let first = anon(std::ptr::null_mut(), 0);
    assert_ne!(first, libc::MAP_FAILED);
    assert_eq!(gradwire_register(comm, first, pages), 0, "{}", last_error());
    assert_eq!(unsafe { libc::munmap(first, pages) }, 0);
    let again = anon(first, libc::MAP_FIXED_NOREPLACE);
    assert_eq!(again, first, "the address was taken meanwhile");
    assert_eq!(gradwire_register(comm, again, pages), 0, "re-registering a reused address: {}", last_error());
    assert_eq!(gradwire_allreduce(comm, again, again, pages / 4, 0, 0), 0, "{}", last_error());
    assert_eq!(gradwire_deregister(comm, again), 0, "{}", last_error());
    assert_eq!(unsafe { libc::munmap(again, pages) }, 0);

    // The GPU entry points: handles and arguments are checked before any CUDA call, and
    // without a GPU the communicator's creation says why (with one, ffi/examples/gpu.c and
    // tests/gpu.rs cover the rest).
    let gbogus = 0x4560 as *mut gradwire_gpu_comm_t;
    let mut gpu: *mut gradwire_gpu_comm_t = std::ptr::null_mut();
    expect(gradwire_gpu_comm_create(null, 0, &mut gpu), INVALID, "comm is NULL");
    expect(gradwire_gpu_comm_create(comm, 0, std::ptr::null_mut()), INVALID, "gpu is NULL");
    expect(gradwire_gpu_comm_create(comm, -1, &mut gpu), INVALID, "device -1 is negative");
    expect(gradwire_gpu_comm_free(std::ptr::null_mut()), INVALID, "gpu communicator is NULL");
    expect(gradwire_gpu_comm_free(gbogus), INVALID, "not a live gpu communicator");
    expect(gradwire_gpu_allreduce(gbogus, xp, xp, 8, 0, 0, std::ptr::null_mut()), INVALID, "not a live gpu communicator");
    expect(gradwire_gpu_broadcast(std::ptr::null_mut(), xp, 8, 0, 0, std::ptr::null_mut()), INVALID, "gpu communicator is NULL");
    expect(gradwire_gpu_reduce_scatter(gbogus, xp, xp, 8, 0, 0, std::ptr::null_mut()), INVALID, "not a live gpu communicator");
    expect(gradwire_gpu_reduce(gbogus, xp, xp, 8, 0, 0, 0, std::ptr::null_mut()), INVALID, "not a live gpu communicator");
    expect(gradwire_gpu_allgather(gbogus, xp, xp, 8, 0, std::ptr::null_mut()), INVALID, "not a live gpu communicator");
    expect(gradwire_gpu_alltoall(gbogus, xp, std::ptr::null(), xp, std::ptr::null(), 8, 0, std::ptr::null_mut()), INVALID, "not a live gpu communicator");
    match gradwire::gpu::unavailable() {
        Some(why) => expect(gradwire_gpu_comm_create(comm, 0, &mut gpu), -11, why.split(';').next().unwrap_or(&why)),
        None => {
            assert_eq!(gradwire_gpu_comm_create(comm, 0, &mut gpu), 0, "{}", last_error());
            expect(gradwire_gpu_allreduce(gpu, xp, xp, 8, 0, 0, std::ptr::null_mut()), INVALID, "is host memory");
            expect(gradwire_gpu_allreduce(gpu, xp, xp, 8, 99, 0, std::ptr::null_mut()), INVALID, "unknown dtype");
            expect(gradwire_gpu_broadcast(gpu, xp, 8, 0, 5, std::ptr::null_mut()), INVALID, "root 5 is not a rank");
            assert_eq!(gradwire_gpu_comm_free(gpu), 0, "{}", last_error());
        }
    }

    // The happy path still works after all that, then use after finalize is refused.
    assert_eq!(gradwire_allreduce(comm, xp, xp, 8, 0, 1), 0, "{}", last_error());
    assert_eq!(gradwire_alloc(comm, 4096, &mut mem), 0, "{}", last_error());
    assert_eq!(gradwire_finalize(comm), 0, "{}", last_error());
    expect(gradwire_finalize(comm), INVALID, "finalized");
    assert!(gradwire::mem::shared_cover(&big[100..]).is_none(), "finalize deregisters what the communicator registered");
    expect(gradwire_barrier(comm), INVALID, "finalized");
    expect(gradwire_allreduce(comm, xp, xp, 8, 0, 0), INVALID, "finalized");
    expect(gradwire_free(comm, mem), INVALID, "finalized");
}

#[test]
fn init_reports_configuration_errors() {
    std::env::remove_var("RANK");
    std::env::remove_var("WORLD_SIZE");
    let mut comm: *mut gradwire_comm_t = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    expect(unsafe { gradwire_init(&mut comm) }, CONFIG, "no rank found");
    assert!(comm.is_null());
}
