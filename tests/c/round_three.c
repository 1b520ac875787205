/*
 * Faults and bad input through the C ABI, for tests/round_three.rs (issue 59):
 *   round_three hier-mismatch N0 N   under `gradwire launch -n 4`: two "nodes" of two ranks
 *                                    (GRADWIRE_HOST_ID), rank 0 passes count N0 and the others
 *                                    N to a sharded hierarchical allreduce; every rank must get
 *                                    GRADWIRE_ERR_MISMATCH.
 *   round_three peer-lost            two ranks started directly (RANK etc. set) over tcp, SIGPIPE
 *                                    at its default disposition: rank 1 SIGKILLs itself in the
 *                                    middle of a large allreduce; rank 0 must get
 *                                    GRADWIRE_ERR_PEER_LOST (not die of SIGPIPE).
 *   round_three overflow             under `gradwire launch -n 2`: array counts whose bytes pass
 *                                    PTRDIFF_MAX (or wrap) must be GRADWIRE_ERR_INVALID_ARGUMENT
 *                                    with an error text, as must element counts past it and a
 *                                    batch buffer that wraps around the address space; the
 *                                    communicator still works afterwards.
 * Prints "rank R: ok" on success; anything else prints why and exits 1.
 */
#define _POSIX_C_SOURCE 200809L
#include "gradwire.h"
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int fail(int rank, const char *what) {
    fprintf(stderr, "rank %d: %s: %s\n", rank, what, gradwire_last_error());
    return 1;
}

static int env_rank(void) {
    const char *r = getenv("RANK");
    return r ? atoi(r) : 0;
}

static int hier_mismatch(size_t n0, size_t n) {
    int rank = env_rank();
    /* Two nodes of two ranks: 0, 1 on node0 and 2, 3 on node1. */
    char host[32];
    snprintf(host, sizeof host, "node%d", rank / 2);
    if (setenv("GRADWIRE_HOST_ID", host, 1)) return fail(rank, "setenv");
    gradwire_comm_t *c = NULL;
    gradwire_hierarchy_t *h = NULL;
    if (gradwire_init(&c)) return fail(rank, "gradwire_init");
    if (gradwire_hierarchy_create(c, &h)) return fail(rank, "gradwire_hierarchy_create");
    int nodes = 0;
    if (gradwire_hierarchy_nodes(h, &nodes) || nodes != 2) return fail(rank, "expected 2 nodes");
    size_t count = rank == 0 ? n0 : n;
    float *x = malloc(count * sizeof *x);
    if (!x) return fail(rank, "malloc");
    for (size_t i = 0; i < count; i++) x[i] = (float)(rank + 1);
    int rc = gradwire_hierarchical_allreduce(h, x, x, count, GRADWIRE_FLOAT32, GRADWIRE_SUM, GRADWIRE_HIERARCHICAL_SHARDED);
    if (rc != GRADWIRE_ERR_MISMATCH) {
        fprintf(stderr, "rank %d: count %zu returned %d, want GRADWIRE_ERR_MISMATCH (%d); last element %g: %s\n", rank, count, rc,
                GRADWIRE_ERR_MISMATCH, (double)x[count - 1], rc ? gradwire_last_error() : "");
        return 1;
    }
    printf("rank %d: mismatch: %s\n", rank, gradwire_last_error());
    free(x);
    gradwire_hierarchy_free(h);
    gradwire_finalize(c);
    printf("rank %d: ok\n", rank);
    return 0;
}

static int peer_lost(void) {
    int rank = env_rank();
    /* Rank 0 hosts the rendezvous store: when it dies, the survivor's request for the
       reason goes to a dead store connection. */
    const char *victim_env = getenv("ROUND_THREE_VICTIM");
    int victim = victim_env ? atoi(victim_env) : 1;
    /* What a C host gets unless it says otherwise; the test fails if this process dies of it. */
    signal(SIGPIPE, SIG_DFL);
    gradwire_comm_t *c = NULL;
    if (gradwire_init(&c)) return fail(rank, "gradwire_init");
    size_t count = 4u << 20; /* 16 MiB: many writes in flight when the peer dies */
    float *x = calloc(count, sizeof *x);
    if (!x) return fail(rank, "calloc");
    for (int i = 0;; i++) {
        if (rank == victim && i == 3) {
            /* Die mid-transfer: the survivor is writing when the connection goes. */
            gradwire_work_t *wk = NULL;
            if (gradwire_iallreduce(c, x, x, count, GRADWIRE_FLOAT32, GRADWIRE_SUM, &wk)) return fail(rank, "iallreduce");
            struct timespec ms2 = {0, 2000000};
            nanosleep(&ms2, NULL);
            kill(getpid(), SIGKILL);
        }
        int rc = gradwire_allreduce(c, x, x, count, GRADWIRE_FLOAT32, GRADWIRE_SUM);
        if (rc == 0) continue;
        if (rc != GRADWIRE_ERR_PEER_LOST) {
            fprintf(stderr, "rank %d: allreduce %d returned %d, want GRADWIRE_ERR_PEER_LOST (%d): %s\n", rank, i, rc, GRADWIRE_ERR_PEER_LOST,
                    gradwire_last_error());
            return 1;
        }
        printf("rank %d: peer lost: %s\n", rank, gradwire_last_error());
        break;
    }
    /* Whatever gradwire writes to the dead peer while finalizing must not kill us either. */
    gradwire_finalize(c);
    free(x);
    printf("rank %d: ok\n", rank);
    return 0;
}

/* Expects GRADWIRE_ERR_INVALID_ARGUMENT with an error text naming `needle`. */
static int refused(int rank, int rc, const char *call, const char *needle) {
    const char *why = gradwire_last_error();
    if (rc != GRADWIRE_ERR_INVALID_ARGUMENT || !strstr(why, needle)) {
        fprintf(stderr, "rank %d: %s returned %d (want GRADWIRE_ERR_INVALID_ARGUMENT, %d, naming %s): %s\n", rank, call, rc,
                GRADWIRE_ERR_INVALID_ARGUMENT, needle, why);
        return 1;
    }
    printf("rank %d: %s refused: %s\n", rank, call, why);
    return 0;
}

static int overflow(void) {
    gradwire_comm_t *c = NULL;
    int rank = env_rank();
    if (gradwire_init(&c)) return fail(rank, "gradwire_init");
    int peer = 1 - rank;
    float out[4] = {1, 2, 3, 4}, in[4] = {0};
    gradwire_p2p_op_t ops[2] = {
        {GRADWIRE_P2P_SEND, peer, 7, GRADWIRE_FLOAT32, 4, out},
        {GRADWIRE_P2P_RECV, peer, 7, GRADWIRE_FLOAT32, 4, in},
    };
    /* SIZE_MAX entries wrap any byte size; 2^59 x 32-byte entries wrap to 0 bytes; one past
     * PTRDIFF_MAX / sizeof(op) is the first count whose array no object can be. */
    const size_t nops[] = {SIZE_MAX, (size_t)1 << 59, PTRDIFF_MAX / sizeof(gradwire_p2p_op_t) + 1};
    gradwire_work_t *wk = NULL;
    int bad = 0;
    for (size_t i = 0; i < sizeof nops / sizeof nops[0]; i++) {
        bad |= refused(rank, gradwire_p2p_batch(c, ops, nops[i]), "gradwire_p2p_batch", "nops");
        bad |= refused(rank, gradwire_ip2p_batch(c, ops, nops[i], &wk), "gradwire_ip2p_batch", "nops");
    }
    /* Per-rank counts whose sum of bytes passes PTRDIFF_MAX without wrapping a size_t. */
    size_t huge[2] = {(size_t)1 << 60, (size_t)1 << 60};
    bad |= refused(rank, gradwire_alltoall(c, out, huge, in, huge, 0, GRADWIRE_FLOAT32), "gradwire_alltoall", "overflow");
    bad |= refused(rank, gradwire_ialltoall(c, out, huge, in, huge, 0, GRADWIRE_FLOAT32, &wk), "gradwire_ialltoall", "overflow");
    /* A batch buffer whose end wraps around the address space. */
    gradwire_p2p_op_t wraps = {GRADWIRE_P2P_SEND, peer, 7, GRADWIRE_FLOAT32, 4, (void *)(UINTPTR_MAX - 7)};
    bad |= refused(rank, gradwire_p2p_batch(c, &wraps, 1), "gradwire_p2p_batch", "wrap around");
    /* Element counts past PTRDIFF_MAX bytes, wrapping or not. */
    const size_t counts[] = {SIZE_MAX, PTRDIFF_MAX / sizeof(float) + 1};
    gradwire_hierarchy_t *h = NULL;
    if (gradwire_hierarchy_create(c, &h)) return fail(rank, "gradwire_hierarchy_create");
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
        bad |= refused(rank, gradwire_send(c, out, counts[i], GRADWIRE_FLOAT32, peer, 7), "gradwire_send", "overflow");
        bad |= refused(rank, gradwire_hierarchical_allreduce(h, out, out, counts[i], GRADWIRE_FLOAT32, GRADWIRE_SUM, GRADWIRE_HIERARCHICAL_SHARDED),
                       "gradwire_hierarchical_allreduce", i ? "more than any buffer can hold" : "overflows");
    }
    gradwire_hierarchy_free(h);
    if (bad) return 1;
    /* Nothing was sent or counted: the communicator still works, batch included. */
    if (gradwire_p2p_batch(c, ops, 2)) return fail(rank, "gradwire_p2p_batch after the refusals");
    for (int k = 0; k < 4; k++)
        if (in[k] != (float)(k + 1)) return fail(rank, "wrong data after the refusals");
    if (gradwire_barrier(c)) return fail(rank, "barrier");
    gradwire_finalize(c);
    printf("rank %d: ok\n", rank);
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    if (strcmp(mode, "hier-mismatch") == 0 && argc == 4) return hier_mismatch(strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10));
    if (strcmp(mode, "peer-lost") == 0) return peer_lost();
    if (strcmp(mode, "overflow") == 0) return overflow();
    fprintf(stderr, "usage: round_three hier-mismatch N0 N | peer-lost | overflow\n");
    return 2;
}
