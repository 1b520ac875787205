/*
 * gradwire.h — the C interface of gradwire (C99).
 *
 * This header is the single source of truth of the ABI: tests/ffi_header.rs parses it
 * with bindgen and checks every declared function against the Rust exports.
 *
 * Conventions
 *   - Every function returns GRADWIRE_OK (0) or a negative gradwire_result_t; the text of
 *     the last error on the calling thread is gradwire_last_error().
 *   - Handles are opaque. Passing NULL, a handle that was finalized/freed, an unknown enum
 *     value, or a count whose buffer would exceed PTRDIFF_MAX bytes returns
 *     GRADWIRE_ERR_INVALID_ARGUMENT; nothing crosses this boundary as a panic or abort (a
 *     bug inside gradwire returns GRADWIRE_ERR_INTERNAL and fails the communicator).
 *   - Arguments are checked on each rank: a call refused on some ranks only (say, an
 *     overlap that is the in-place layout on one rank and not on another) leaves the
 *     others waiting until GRADWIRE_TIMEOUT_MS, which then names the missing rank.
 *   - Blocking calls return when the operation is complete on this rank, or with an error
 *     naming the peer rank and the operation once GRADWIRE_TIMEOUT_MS has passed since it
 *     started running (operations queued ahead of it run first, each with its own deadline).
 *   - A communicator may be used from several threads; operations on it run in the order
 *     they were issued. As with NCCL and MPI, every rank must issue the same collectives
 *     in the same order: threads of one rank that issue collectives concurrently must
 *     order them among themselves, or two calls of the same shape may be paired with the
 *     other rank's calls the other way round. gradwire_finalize must not race with other
 *     calls on the same communicator.
 */
#ifndef GRADWIRE_H
#define GRADWIRE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct gradwire_comm gradwire_comm_t;
typedef struct gradwire_work gradwire_work_t;

typedef enum {
    GRADWIRE_FLOAT32 = 0,
    GRADWIRE_FLOAT64 = 1,
    GRADWIRE_FLOAT16 = 2,
    GRADWIRE_BFLOAT16 = 3,
    GRADWIRE_INT8 = 4,
    GRADWIRE_UINT8 = 5,
    GRADWIRE_INT32 = 6,
    GRADWIRE_INT64 = 7,
    GRADWIRE_BOOL = 8      /* one byte: 0 false, anything else true */
} gradwire_dtype_t;

/* Integers wrap on overflow; on GRADWIRE_BOOL, SUM and MAX are a logical or, PRODUCT and MIN
 * a logical and. AVG is defined for the floating-point types only. */
typedef enum {
    GRADWIRE_SUM = 0,
    GRADWIRE_AVG = 1,
    GRADWIRE_MIN = 2,
    GRADWIRE_MAX = 3,
    GRADWIRE_PRODUCT = 4
} gradwire_op_t;

/* Result codes (0 = success, every error is negative). */
typedef enum {
    GRADWIRE_OK = 0,
    GRADWIRE_ERR_INTERNAL = -1,         /* a bug in gradwire: please report the error text */
    GRADWIRE_ERR_CONFIG = -2,           /* environment / settings missing or malformed */
    GRADWIRE_ERR_INVALID_ARGUMENT = -3, /* NULL, dead handle, unknown enum, overflow, bad rank */
    GRADWIRE_ERR_TIMEOUT = -4,          /* a deadline passed: the operation failed */
    GRADWIRE_ERR_PEER_LOST = -5,        /* a peer process died or its connection closed */
    GRADWIRE_ERR_MISMATCH = -6,         /* ranks issued different collective calls */
    GRADWIRE_ERR_ABORTED = -7,          /* the communicator was aborted (here or by a peer) */
    GRADWIRE_ERR_AUTH = -8,             /* a peer failed the job-secret check */
    GRADWIRE_ERR_PROTOCOL = -9,         /* malformed message from a peer */
    GRADWIRE_ERR_SYSTEM = -10,          /* an operating-system call failed */
    GRADWIRE_ERR_UNSUPPORTED = -11,     /* not available in this build or on this host */
    GRADWIRE_ERR_IN_PROGRESS = -12      /* gradwire_wait with a timeout: still running, the work stays valid */
} gradwire_result_t;

/* Joins the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
 * GRADWIRE_JOB_SECRET, ...; see the README). */
int gradwire_init(gradwire_comm_t **comm);

/* A communicator id a framework carries to its members, as NCCL's ncclUniqueId: one
 * process calls gradwire_get_unique_id (it starts a rendezvous store on a free port of
 * this host, behind a fresh secret; the address is GRADWIRE_MASTER_ADDR or MASTER_ADDR
 * when set, else this host's first non-loopback IPv4 address), hands the bytes to every
 * member, and each calls gradwire_comm_init_rank with its rank. MASTER_PORT and
 * GRADWIRE_JOB_SECRET are not read, so ids never clash with the framework's rendezvous or
 * with each other; a subgroup is made by its members alone. The store lives as long as the
 * first communicator its process makes from the id (for ever if it makes none). Bytes
 * that are not an id are GRADWIRE_ERR_INVALID_ARGUMENT. */
#define GRADWIRE_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[GRADWIRE_UNIQUE_ID_BYTES];
} gradwire_unique_id_t;
int gradwire_get_unique_id(gradwire_unique_id_t *id);
int gradwire_comm_init_rank(gradwire_comm_t **comm, const gradwire_unique_id_t *id, int nranks, int rank);
/* As gradwire_comm_init_rank, with timeout_ms (1 ms to 7 days) as the deadline of every
 * wait on the communicator and its splits instead of GRADWIRE_TIMEOUT_MS (a framework's
 * group timeout). */
int gradwire_comm_init_rank_timeout(gradwire_comm_t **comm, const gradwire_unique_id_t *id, int nranks, int rank,
                                    int64_t timeout_ms);
int gradwire_comm_rank(const gradwire_comm_t *comm, int *rank);
int gradwire_comm_size(const gradwire_comm_t *comm, int *size);
/* Splits by color (ranks with equal color form one communicator, ordered by key then rank).
 * A negative color joins no group: *newcomm is set to NULL. Collective over comm. */
int gradwire_comm_split(gradwire_comm_t *comm, int color, int key, gradwire_comm_t **newcomm);
/* The ranks of this rank's node (GRADWIRE_SPLIT_NODE, ordered by rank: the rank in it is
 * the local index), or the ranks of every node with this rank's local index
 * (GRADWIRE_SPLIT_CROSS_NODE, one per node, in node order), as MPI_Comm_split_type.
 * Collective over comm. */
#define GRADWIRE_SPLIT_NODE 0
#define GRADWIRE_SPLIT_CROSS_NODE 1
int gradwire_comm_split_type(gradwire_comm_t *comm, int split_type, gradwire_comm_t **newcomm);

/* In place if sendbuf == recvbuf; otherwise the buffers must not overlap. */
int gradwire_allreduce(gradwire_comm_t *comm, const void *sendbuf, void *recvbuf,
                       size_t count, gradwire_dtype_t dtype, gradwire_op_t op);
/* Non-blocking allreduce: the buffers must stay valid and untouched until the work is
 * waited for successfully. */
int gradwire_iallreduce(gradwire_comm_t *comm, const void *sendbuf, void *recvbuf,
                        size_t count, gradwire_dtype_t dtype, gradwire_op_t op,
                        gradwire_work_t **work);
/* Waits for work. timeout_ms < 0 waits for completion (bounded by the operation's own
 * deadline). Frees work when it has completed (successfully or not: an operation that
 * failed at its deadline is GRADWIRE_ERR_TIMEOUT); returns GRADWIRE_ERR_IN_PROGRESS and
 * keeps work valid when it is still running after timeout_ms. */
int gradwire_wait(gradwire_work_t *work, int64_t timeout_ms);
/* Whether work has finished, without waiting or freeing it: *done = 1 (gradwire_wait then
 * returns its outcome at once) or 0. Unlike gradwire_wait with a timeout, a finished work
 * stays valid and a failure (a timeout included) is left for gradwire_wait to return. */
int gradwire_test(gradwire_work_t *work, int *done);
int gradwire_broadcast(gradwire_comm_t *comm, void *buf, size_t count, gradwire_dtype_t dtype, int root);
/* recvbuf holds size * sendcount elements; part r comes from rank r. In place as NCCL (and
 * MPI_IN_PLACE): sendbuf = recvbuf + rank * sendcount; other overlaps are refused. */
int gradwire_allgather(gradwire_comm_t *comm, const void *sendbuf, void *recvbuf, size_t sendcount,
                       gradwire_dtype_t dtype);
/* sendbuf holds size * recvcount elements; rank r receives the reduction of part r. In
 * place as NCCL: recvbuf = sendbuf + rank * recvcount (the other parts are left as they
 * were); other overlaps are refused. */
int gradwire_reduce_scatter(gradwire_comm_t *comm, const void *sendbuf, void *recvbuf, size_t recvcount,
                            gradwire_dtype_t dtype, gradwire_op_t op);
int gradwire_barrier(gradwire_comm_t *comm);
/* Reduces every rank's sendbuf into recvbuf of rank `root` (recvbuf may equal sendbuf;
 * other ranks' recvbuf is scratch space of count elements). */
int gradwire_reduce(gradwire_comm_t *comm, const void *sendbuf, void *recvbuf, size_t count,
                    gradwire_dtype_t dtype, gradwire_op_t op, int root);
/* How a collective's sendbuf and recvbuf (their sizes in bytes) lie on this rank of comm,
 * by the one rule every call, host and GPU, applies: GRADWIRE_LAYOUT_APART (no byte
 * shared), GRADWIRE_LAYOUT_IN_PLACE (the same buffer: allreduce, broadcast, reduce),
 * GRADWIRE_LAYOUT_BLOCK (NCCL's in-place block of an allgather or a reduce-scatter) or
 * GRADWIRE_LAYOUT_OVERLAPPING (shared otherwise: the call refuses it). A framework that
 * accepts such buffers, as torch does, asks it to know when it must copy. */
#define GRADWIRE_CALL_ALLREDUCE 0u
#define GRADWIRE_CALL_BROADCAST 1u
#define GRADWIRE_CALL_REDUCE 2u
#define GRADWIRE_CALL_ALLGATHER 3u
#define GRADWIRE_CALL_REDUCE_SCATTER 4u
#define GRADWIRE_CALL_ALLTOALL 5u
#define GRADWIRE_LAYOUT_APART 0
#define GRADWIRE_LAYOUT_IN_PLACE 1
#define GRADWIRE_LAYOUT_BLOCK 2
#define GRADWIRE_LAYOUT_OVERLAPPING 3
int gradwire_buffer_layout(gradwire_comm_t *comm, unsigned int collective, const void *sendbuf, size_t sendbytes,
                           const void *recvbuf, size_t recvbytes, int *layout);
/* Non-blocking broadcast, allgather and reduce-scatter: as the blocking calls, returning at
 * once; wait with gradwire_wait, buffers valid until then. */
int gradwire_ibroadcast(gradwire_comm_t *comm, void *buf, size_t count, gradwire_dtype_t dtype, int root,
                        gradwire_work_t **work);
int gradwire_iallgather(gradwire_comm_t *comm, const void *sendbuf, void *recvbuf, size_t sendcount,
                        gradwire_dtype_t dtype, gradwire_work_t **work);
int gradwire_ireduce_scatter(gradwire_comm_t *comm, const void *sendbuf, void *recvbuf, size_t recvcount,
                             gradwire_dtype_t dtype, gradwire_op_t op, gradwire_work_t **work);
/* All-to-all: block p of sendbuf (sendcounts[p] elements) goes to rank p, and block p of
 * recvbuf (recvcounts[p] elements) receives rank p's block for this rank; blocks lie back to
 * back in rank order. With sendcounts and recvcounts both NULL every block has `count`
 * elements (otherwise `count` is ignored): MPI_Alltoall, a collective of its own (through
 * shared memory on one host), which every rank must then call with NULL counts and the same
 * `count` (MPI_Alltoallv with equal counts is a different call: a mismatch). Every pair must
 * agree on its counts. The buffers must not overlap. gradwire_ialltoall returns at once;
 * buffers stay valid until waited. */
int gradwire_alltoall(gradwire_comm_t *comm, const void *sendbuf, const size_t *sendcounts, void *recvbuf,
                      const size_t *recvcounts, size_t count, gradwire_dtype_t dtype);
int gradwire_ialltoall(gradwire_comm_t *comm, const void *sendbuf, const size_t *sendcounts, void *recvbuf,
                       const size_t *recvcounts, size_t count, gradwire_dtype_t dtype, gradwire_work_t **work);
/* Tagged point-to-point: messages are matched by (peer, tag), in order within a tag, as in
 * MPI; a recv takes the oldest message from that peer with its tag, which must have the
 * same count and dtype, or both fail with GRADWIRE_ERR_MISMATCH. Blocking (a send may wait until the peer receives): pair them
 * or use a batch (below). */
int gradwire_send(gradwire_comm_t *comm, const void *buf, size_t count, gradwire_dtype_t dtype, int peer,
                  unsigned int tag);
int gradwire_recv(gradwire_comm_t *comm, void *buf, size_t count, gradwire_dtype_t dtype, int peer,
                  unsigned int tag);
/* A batch of sends and receives progressed together as one operation (as NCCL's grouped
 * ncclSend/ncclRecv; torch's batch_isend_irecv): a ring in which every rank sends before
 * it receives completes, where blocking calls would each wait for room at a peer that is
 * itself sending. Each message is matched with its peer's as gradwire_send/recv are, in
 * order between two ranks, within a batch and across calls. Receive buffers must overlap
 * no other buffer of the batch. gradwire_ip2p_batch returns at once; buffers stay valid
 * until waited. */
#define GRADWIRE_P2P_SEND 0u
#define GRADWIRE_P2P_RECV 1u
typedef struct {
    unsigned int kind; /* GRADWIRE_P2P_SEND (reads buf) or GRADWIRE_P2P_RECV (writes it) */
    int peer;
    unsigned int tag;
    gradwire_dtype_t dtype;
    size_t count;
    void *buf;
} gradwire_p2p_op_t;
int gradwire_p2p_batch(gradwire_comm_t *comm, const gradwire_p2p_op_t *ops, size_t nops);
int gradwire_ip2p_batch(gradwire_comm_t *comm, const gradwire_p2p_op_t *ops, size_t nops, gradwire_work_t **work);

/* Hierarchical allreduce (the collective DASO and BSP's node level stand on): a node-local
 * group and a cross-node group made once from comm (collective; every node must hold the
 * same number of ranks), then allreduces over every rank of comm through them. SHARDED:
 * reduce-scatter in the node, one cross-node allreduce per shard, allgather in the node
 * (each rank's link carries 1/G of the cross-node bytes); LEADER: reduce to local rank 0,
 * allreduce among those, broadcast in the node. sendbuf == recvbuf is in place. Both forms
 * run in order with comm's other calls (the blocking one after comm's queued non-blocking
 * work); complete the non-blocking one with gradwire_wait or gradwire_test. Freeing a
 * hierarchy, or gradwire_finalize(comm), while one runs is safe: it finishes first. */
typedef struct gradwire_hierarchy gradwire_hierarchy_t;
typedef unsigned int gradwire_hierarchical_algo_t;
#define GRADWIRE_HIERARCHICAL_SHARDED 0u
#define GRADWIRE_HIERARCHICAL_LEADER 1u
int gradwire_hierarchy_create(gradwire_comm_t *comm, gradwire_hierarchy_t **hier);
int gradwire_hierarchy_free(gradwire_hierarchy_t *hier);
int gradwire_hierarchy_nodes(gradwire_hierarchy_t *hier, int *nodes);
int gradwire_hierarchical_allreduce(gradwire_hierarchy_t *hier, const void *sendbuf, void *recvbuf, size_t count,
                                    gradwire_dtype_t dtype, gradwire_op_t op, gradwire_hierarchical_algo_t algo);
int gradwire_hierarchical_iallreduce(gradwire_hierarchy_t *hier, const void *sendbuf, void *recvbuf, size_t count,
                                     gradwire_dtype_t dtype, gradwire_op_t op, gradwire_hierarchical_algo_t algo,
                                     gradwire_work_t **work);

/* Collectives on CUDA device memory (built with the cargo feature `cuda`, the default).
 * gradwire_gpu_comm_create makes, from a communicator, the NCCL communicator of this
 * rank's node on CUDA device `device` and the cross-node group (collective: every rank
 * calls it; every node must hold the same number of ranks, each on its own device). Each
 * call is enqueued on `stream` (a cudaStream_t/CUstream of that device; NULL: the legacy
 * default stream), as NCCL's calls are: work queued earlier on the stream runs first, work
 * queued later sees the result. Inside one node the calls are NCCL's. Across nodes the
 * allreduce is hierarchical: NCCL reduce-scatter in the node, the 1/G shard copied into a
 * pinned host region, gradwire's allreduce across the nodes, copied back, NCCL allgather;
 * broadcast, reduce, reduce-scatter, allgather and all-to-all cross through the pinned region in
 * pieces (at most 4 MiB of a block, 16 MiB in all: the pinned region stays small whatever the
 * buffer and the number of ranks). Such a call returns after
 * its host step, which waits (with GRADWIRE_TIMEOUT_MS) for the stream to reach it. A
 * host pointer here, a device pointer to the host calls above, or a count past the end of
 * the buffer's allocation is GRADWIRE_ERR_INVALID_ARGUMENT; no CUDA driver, NCCL or device
 * is GRADWIRE_ERR_UNSUPPORTED, with what was searched in gradwire_last_error(). A call
 * that fails after it has queued work (a deadline, a lost peer) aborts NCCL, so the node's
 * other ranks are not left waiting for it, and every later call on the GPU communicator
 * fails with GRADWIRE_ERR_ABORTED. Inside one node the calls are NCCL's alone and, as
 * NCCL's, carry no deadline of gradwire's: a node peer that dies mid-call stalls the
 * stream. The caller's current CUDA context is the same after every call. */
typedef struct gradwire_gpu_comm gradwire_gpu_comm_t;
int gradwire_gpu_comm_create(gradwire_comm_t *comm, int device, gradwire_gpu_comm_t **gpu);
int gradwire_gpu_comm_free(gradwire_gpu_comm_t *gpu);
int gradwire_gpu_allreduce(gradwire_gpu_comm_t *gpu, const void *sendbuf, void *recvbuf, size_t count,
                           gradwire_dtype_t dtype, gradwire_op_t op, void *stream);
int gradwire_gpu_broadcast(gradwire_gpu_comm_t *gpu, void *buf, size_t count, gradwire_dtype_t dtype, int root,
                           void *stream);
/* The root's recvbuf gets the result (the others' is not written; sendbuf = recvbuf is in
 * place), as ncclReduce. */
int gradwire_gpu_reduce(gradwire_gpu_comm_t *gpu, const void *sendbuf, void *recvbuf, size_t count,
                        gradwire_dtype_t dtype, gradwire_op_t op, int root, void *stream);
/* sendbuf holds size x recvcount elements; in place as NCCL: recvbuf = sendbuf + rank x
 * recvcount; no other overlap. */
int gradwire_gpu_reduce_scatter(gradwire_gpu_comm_t *gpu, const void *sendbuf, void *recvbuf, size_t recvcount,
                                gradwire_dtype_t dtype, gradwire_op_t op, void *stream);
/* recvbuf holds size x sendcount elements, rank r's block at r; in place as NCCL: sendbuf
 * = recvbuf + rank x sendcount; no other overlap. */
int gradwire_gpu_allgather(gradwire_gpu_comm_t *gpu, const void *sendbuf, void *recvbuf, size_t sendcount,
                           gradwire_dtype_t dtype, void *stream);
/* Block b of sendbuf goes to rank b, rank b's block for this rank lands in block b of
 * recvbuf: blocks of `count` elements (sendcounts and recvcounts both NULL, the equal-block
 * call every rank must then make so) or of the counts (one entry per rank, blocks back to
 * back; every pair agrees), as gradwire_alltoall; no overlap. */
int gradwire_gpu_alltoall(gradwire_gpu_comm_t *gpu, const void *sendbuf, const size_t *sendcounts, void *recvbuf,
                          const size_t *recvcounts, size_t count, gradwire_dtype_t dtype, void *stream);

/* Training schemes (docs/algorithms.md) on a communicator, driven by the framework step by
 * step over a flat float32 parameter vector of n values (every buffer below holds n):
 * scheme "ssgd", "daso", "bsp", "ddcgu", "cyclic", "downpour" or "eamsgd"; options
 * "key=value,..." (NULL or "": defaults), per scheme: bsp: interval, node_interval, topk;
 * daso: warmup_epochs, cooldown_epochs, epochs, max_global_skips, stability_level,
 * wire (f32, bf16, f16), sending_chunk_size, skip_reduction_factor, local_skip_factor,
 * sync_average (heat, change), cap_phases (true, false), data (gradwire, caller: see
 * gradwire_strategy_take_actions; bsp takes data too, without topk); ddcgu, cyclic:
 * lr, rule (sum, mean, staleness); downpour: lr, fetch, push, background (true:
 * fetch and push on a thread of their own, as Dean et al.; default false: blocking); eamsgd: lr, tau, beta; ssgd: none (ssgd, daso and bsp take no lr: the
 * framework's optimizer makes their local step). A key the scheme does not take, a key
 * given twice, bsp's topk=0 (leave topk out to send the whole change) or a bad value is
 * GRADWIRE_ERR_INVALID_ARGUMENT naming it; a value cannot hold ',' or '='. init: the initial parameters (the
 * parameter servers start from them). Collective: every rank of comm creates its scheme,
 * with the same scheme, options and n (checked). Every other call needs
 * gradwire_strategy_start first; start runs once, and after gradwire_strategy_finish only
 * current_model and the queries remain (anything else is GRADWIRE_ERR_INVALID_ARGUMENT). gradwire_finalize frees the communicator's strategies.
 * When gradwire_strategy_framework_update says 1 (ssgd, daso, bsp), each step is
 *   gradwire_strategy_before_update(grads)   (e.g. averages the gradients)
 *   the framework's own optimizer step        (SGD with momentum, Adam, ...)
 *   gradwire_strategy_after_update(params)   (e.g. DASO's merges, BSP's change average)
 * otherwise gradwire_strategy_step(params, grads) applies the servers' rule. After each
 * epoch gradwire_strategy_end_epoch (the loss averaged over ranks; DASO adapts its
 * schedule), at the end gradwire_strategy_finish (the final model in params).
 * gradwire_strategy_current_model writes the model to evaluate into params. */
typedef struct gradwire_strategy gradwire_strategy_t;
int gradwire_strategy_create(gradwire_comm_t *comm, const char *scheme, const char *options, const float *init,
                             size_t n, gradwire_strategy_t **strategy);
int gradwire_strategy_free(gradwire_strategy_t *strategy);
int gradwire_strategy_framework_update(gradwire_strategy_t *strategy, int *yes);
int gradwire_strategy_start(gradwire_strategy_t *strategy, float *params, size_t n);
int gradwire_strategy_before_update(gradwire_strategy_t *strategy, float *grads, size_t n, int last_of_epoch);
int gradwire_strategy_after_update(gradwire_strategy_t *strategy, float *params, size_t n, int last_of_epoch);
int gradwire_strategy_step(gradwire_strategy_t *strategy, float *params, const float *grads, size_t n,
                           int last_of_epoch);
int gradwire_strategy_end_epoch(gradwire_strategy_t *strategy, float *params, size_t n, double loss,
                                double *mean_loss);
int gradwire_strategy_current_model(gradwire_strategy_t *strategy, float *params, size_t n);
int gradwire_strategy_finish(gradwire_strategy_t *strategy, float *params, size_t n);
int gradwire_strategy_bytes_sent(gradwire_strategy_t *strategy, uint64_t *bytes);
/* Whether the scheme's ranks draw minibatches from one pool per epoch (the asynchronous
 * parameter-server schemes: a fast worker takes more of the epoch instead of waiting for a
 * slow one) rather than each rank taking its fixed 1/W share. With a pool, before each
 * minibatch gradwire_strategy_claim_batch(total = the epoch's minibatches over all ranks,
 * the same on every rank) says whether this rank may take one more of the pool since the
 * last gradwire_strategy_end_epoch (*yes = 1) or it is empty (0). */
int gradwire_strategy_shared_pool(gradwire_strategy_t *strategy, int *yes);
int gradwire_strategy_claim_batch(gradwire_strategy_t *strategy, size_t total, int *yes);
/* The index of the epoch's last batch, known before it runs (DASO's schedule looks one batch
 * ahead, as Heat's last_batch); other schemes ignore it. */
int gradwire_strategy_set_last_batch(gradwire_strategy_t *strategy, size_t last_batch);
/* Whether the next backward's gradients are averaged in the node (DASO's node-local sync:
 * where Heat's DDP also broadcasts the model's buffers in the node); 0 for other schemes. */
int gradwire_strategy_node_average_next(gradwire_strategy_t *strategy, int *yes);
/* The scheme's name and state (DASO's schedule, BSP's K), NUL-terminated, truncated to len. */
int gradwire_strategy_describe(gradwire_strategy_t *strategy, char *buf, size_t len);
/* A daso or bsp (dense) scheme made with "data=caller" keeps its schedule but moves no
 * data: the caller
 * keeps the model (in device memory, say). It is created with init NULL and n the
 * parameter count; every later call takes no buffer (NULL, 0) and records, in order, the
 * steps the caller must run on its parameters and gradients before its next call. This
 * hands over up to `capacity` (at least 1) of them (three int64 each: code, a, b) and sets
 * *count; call again while *count == capacity. Every rank runs its own actions, in order:
 *   1 BROADCAST_ALL        parameters of communicator rank a to every rank
 *   2 AVERAGE_GRADS_NODE   gradients averaged over the node (GRADWIRE_SPLIT_NODE)
 *   3 BROADCAST_NODE       parameters of local index a to the rest of the node
 *   4 SEND_SUM             start a float32 sum of a copy of the parameters over the nodes
 *                          (GRADWIRE_SPLIT_CROSS_NODE), as allreduces of a, then b elements
 *   5 MERGE_OLDEST         wait for the oldest sum and merge it, S = a, N = b:
 *                          x = x*f + sum/d, d = N + (S > 0 ? 2S : 1), f = (d - N)/d (float32)
 *   6 TAKE_AVERAGE         wait for the only sum in flight; x = sum/a
 *   7 AVERAGE_ON_WIRE      x cast to wire b (0 f32, 1 bf16, 2 f16), summed over the nodes
 *                          in it, divided by a and rounded to b
 *   8 AVERAGE_CHANGE       (x - anchor) cast to wire a, averaged over every rank in it,
 *                          added to the anchor; the anchor becomes x
 *   9 SET_ANCHOR           the anchor becomes x
 *  10 AVERAGE_NEXT_GRADS   a = 1: the next backward's gradients are averaged in the node
 *                          (action 2 follows; the caller may start it during backward)
 *  11 AVERAGE_GRADS_ALL    gradients averaged over every rank
 *  12 AVERAGE_CHANGE_NODE  (x - node anchor) averaged over the node (float32), added to the
 *                          node anchor; the node anchor becomes x
 *  13 TAKE_ANCHOR          x = anchor
 *  14 SET_NODE_ANCHOR      the node anchor becomes x */
int gradwire_strategy_take_actions(gradwire_strategy_t *strategy, int64_t *out, size_t capacity, size_t *count);

/* Page-aligned memory shared with the ranks of this host (registered, zero-copy): an
 * allreduce of at least 256 KiB (4 MiB where the kernel refuses cross-memory attach)
 * whose buffers all come from here reads and writes the peers' buffers in place. */
int gradwire_alloc(gradwire_comm_t *comm, size_t bytes, void **ptr);
int gradwire_free(gradwire_comm_t *comm, void *ptr);
/* Registers memory the caller allocated (a framework's tensor, malloc) for many
 * collectives, as ncclCommRegister does: the whole pages inside ptr..ptr+bytes become
 * shared in place (same address, same contents), so that an allreduce whose buffers are
 * all registered or from gradwire_alloc works in the peers' buffers with no copy; the
 * partial pages at either end stay private and every rank reduces them from copies all
 * ranks stage (this needs room for two pages in GRADWIRE_SHM_STAGE_BYTES). The buffer
 * must hold at least one whole page of private anonymous memory (heap, malloc; not a
 * file's or a shared mapping, not huge pages, not pinned for a device's DMA), stay
 * allocated until gradwire_deregister, and not be written by other threads during either
 * call; a child forked meanwhile shares those pages instead of copying them. A buffer
 * unmapped without deregistering is noticed and treated as private. gradwire_finalize ends
 * the communicator's registrations but leaves their pages shared (contents kept): it
 * cannot know whether a buffer is still the caller's. */
int gradwire_register(gradwire_comm_t *comm, void *ptr, size_t bytes);
/* Gives the pages back as private memory, contents kept. */
int gradwire_deregister(gradwire_comm_t *comm, void *ptr);
/* Releases the communicator and every allocation and registration made through it. */
int gradwire_finalize(gradwire_comm_t *comm);

/* Text of the last error on this thread ("" if none); valid until the next gradwire call
 * on this thread. */
const char *gradwire_last_error(void);

#ifdef __cplusplus
}
#endif

#endif /* GRADWIRE_H */
