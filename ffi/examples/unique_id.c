/*
 * Communicators from unique ids, as a framework makes them (NCCL's ncclGetUniqueId /
 * ncclCommInitRank): no launcher, no MASTER_PORT, no job secret.
 *
 *   unique_id W     forks W ranks. Rank 0 makes an id and hands it to the others through
 *                   pipes (a framework would use its own store); every rank joins with its
 *                   rank and checks an int64 sum, an int32 product, a bool or/and, an
 *                   int8 sum that wraps, an all-to-all (equal and uneven blocks) and tagged
 *                   send/recv around the ring; a hierarchical allreduce (both algorithms,
 *                   blocking and not) and the training schemes. Then the even ranks alone
 *                   make a subgroup from an id of their own and check a sum there, while the
 *                   odd ranks do nothing.
 *
 * UNIQUE_ID_NODES=K splits the W ranks into K "nodes" of W/K ranks (GRADWIRE_HOST_ID), so
 * the hierarchical allreduce crosses nodes over tcp.
 *
 * Prints "rank R: ok" per rank; exits non-zero if any rank failed.
 */
#define _POSIX_C_SOURCE 200809L
#include "gradwire.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static int fail(int rank, const char *what) {
    fprintf(stderr, "rank %d: %s: %s\n", rank, what, gradwire_last_error());
    return 1;
}

/* Rank 0 of a group makes the id and writes it to every other member's pipe. */
static int share_id(int rank, int members, int *fds_w, int *fd_r, gradwire_unique_id_t *id) {
    if (rank == 0) {
        if (gradwire_get_unique_id(id)) return fail(rank, "gradwire_get_unique_id");
        for (int r = 1; r < members; r++)
            if (write(fds_w[r], id, sizeof *id) != (ssize_t)sizeof *id) return fail(rank, "write id");
        return 0;
    }
    return read(*fd_r, id, sizeof *id) == (ssize_t)sizeof *id ? 0 : fail(rank, "read id");
}

static int check_world(gradwire_comm_t *c, int rank, int w) {
    int64_t big[3] = {((int64_t)1 << 40) * (rank + 1), -rank, 7};
    if (gradwire_allreduce(c, big, big, 3, GRADWIRE_INT64, GRADWIRE_SUM)) return fail(rank, "int64 sum");
    if (big[0] != ((int64_t)1 << 40) * w * (w + 1) / 2 || big[1] != -(int64_t)w * (w - 1) / 2 || big[2] != 7 * w) {
        fprintf(stderr, "rank %d: int64 sum wrong: %lld %lld %lld\n", rank, (long long)big[0], (long long)big[1], (long long)big[2]);
        return 1;
    }
    int32_t p = rank + 2, want_p = 1;
    for (int r = 0; r < w; r++) want_p *= r + 2;
    if (gradwire_allreduce(c, &p, &p, 1, GRADWIRE_INT32, GRADWIRE_PRODUCT)) return fail(rank, "int32 product");
    if (p != want_p) {
        fprintf(stderr, "rank %d: int32 product %d, want %d\n", rank, p, want_p);
        return 1;
    }
    unsigned char any = rank == w - 1, all = rank != 0;
    if (gradwire_allreduce(c, &any, &any, 1, GRADWIRE_BOOL, GRADWIRE_SUM)) return fail(rank, "bool or");
    if (gradwire_allreduce(c, &all, &all, 1, GRADWIRE_BOOL, GRADWIRE_MIN)) return fail(rank, "bool and");
    if (!any || all) {
        fprintf(stderr, "rank %d: bool or %d (want 1), and %d (want 0)\n", rank, any, all);
        return 1;
    }
    int8_t b = 100;
    if (gradwire_allreduce(c, &b, &b, 1, GRADWIRE_INT8, GRADWIRE_SUM)) return fail(rank, "int8 sum");
    if (b != (int8_t)(uint8_t)(100 * w)) {
        fprintf(stderr, "rank %d: int8 sum %d does not wrap to %d\n", rank, b, (int8_t)(uint8_t)(100 * w));
        return 1;
    }
    /* All-to-all, equal blocks: rank r sends 1000 r + 10 p + k to rank p. */
    int32_t sa[64 * 3], ra[64 * 3];
    for (int p = 0; p < w; p++)
        for (int k = 0; k < 3; k++) sa[p * 3 + k] = 1000 * rank + 10 * p + k;
    if (gradwire_alltoall(c, sa, NULL, ra, NULL, 3, GRADWIRE_INT32)) return fail(rank, "alltoall");
    for (int p = 0; p < w; p++)
        for (int k = 0; k < 3; k++)
            if (ra[p * 3 + k] != 1000 * p + 10 * rank + k) {
                fprintf(stderr, "rank %d: alltoall block %d[%d] = %d, want %d\n", rank, p, k, ra[p * 3 + k], 1000 * p + 10 * rank + k);
                return 1;
            }
    /* Uneven blocks, non-blocking: rank r sends p + 1 elements to rank p (so receives r + 1
     * from each), all 64-bit and equal to 1000 r + p. */
    size_t sc[64], rc[64];
    int64_t sv[64 * 65 / 2], rv[64 * 64];
    size_t at = 0;
    for (int p = 0; p < w; p++) {
        sc[p] = (size_t)p + 1, rc[p] = (size_t)rank + 1;
        for (int k = 0; k <= p; k++) sv[at++] = 1000 * rank + p;
    }
    gradwire_work_t *work = NULL;
    if (gradwire_ialltoall(c, sv, sc, rv, rc, 0, GRADWIRE_INT64, &work) || gradwire_wait(work, -1)) return fail(rank, "ialltoall (uneven)");
    for (int p = 0; p < w; p++)
        for (int k = 0; k <= rank; k++)
            if (rv[p * (rank + 1) + k] != 1000 * p + rank) {
                fprintf(stderr, "rank %d: uneven alltoall from %d = %lld, want %d\n", rank, p, (long long)rv[p * (rank + 1) + k], 1000 * p + rank);
                return 1;
            }
    /* Reduce to the last rank, out of place; then the non-blocking broadcast, allgather and
     * reduce-scatter started together and waited for in reverse order. */
    int64_t mine = rank + 1, total = -1;
    if (gradwire_reduce(c, &mine, &total, 1, GRADWIRE_INT64, GRADWIRE_SUM, w - 1)) return fail(rank, "reduce");
    if (rank == w - 1 && total != (int64_t)w * (w + 1) / 2) {
        fprintf(stderr, "rank %d: reduce gave %lld\n", rank, (long long)total);
        return 1;
    }
    int32_t bc[4] = {rank, rank, rank, rank}, ag[64], rs_in[64], rs_out = -1, one = rank;
    for (int p = 0; p < w; p++) rs_in[p] = p * 10 + rank;
    gradwire_work_t *wb = NULL, *wg = NULL, *wr = NULL;
    if (gradwire_ibroadcast(c, bc, 4, GRADWIRE_INT32, 0, &wb) || gradwire_iallgather(c, &one, ag, 1, GRADWIRE_INT32, &wg) ||
        gradwire_ireduce_scatter(c, rs_in, &rs_out, 1, GRADWIRE_INT32, GRADWIRE_MAX, &wr))
        return fail(rank, "start ibroadcast/iallgather/ireduce_scatter");
    if (gradwire_wait(wr, -1) || gradwire_wait(wg, -1) || gradwire_wait(wb, -1)) return fail(rank, "wait");
    int bad = rs_out != rank * 10 + (w - 1);
    for (int k = 0; k < 4; k++) bad |= bc[k] != 0;
    for (int p = 0; p < w; p++) bad |= ag[p] != p;
    if (bad) {
        fprintf(stderr, "rank %d: non-blocking broadcast/allgather/reduce-scatter wrong (reduce-scatter %d)\n", rank, rs_out);
        return 1;
    }
    /* Tagged send/recv around the ring: even ranks send first, odd ranks receive first. */
    if (w > 1) {
        int next = (rank + 1) % w, prev = (rank + w - 1) % w;
        double out[5], in[5];
        for (int k = 0; k < 5; k++) out[k] = rank + 0.25 * k;
        int rc1 = rank % 2 ? gradwire_recv(c, in, 5, GRADWIRE_FLOAT64, prev, 7) : gradwire_send(c, out, 5, GRADWIRE_FLOAT64, next, 7);
        int rc2 = rank % 2 ? gradwire_send(c, out, 5, GRADWIRE_FLOAT64, next, 7) : gradwire_recv(c, in, 5, GRADWIRE_FLOAT64, prev, 7);
        if (rc1 || rc2) return fail(rank, "send/recv");
        for (int k = 0; k < 5; k++)
            if (in[k] != prev + 0.25 * k) {
                fprintf(stderr, "rank %d: recv[%d] = %g, want %g\n", rank, k, in[k], prev + 0.25 * k);
                return 1;
            }
    }
    /* A batch around the ring in which every rank sends first, 4 Mi floats (more than any
     * link buffers): blocking sends would each wait for a peer that is sending too. */
    if (w > 1) {
        int next = (rank + 1) % w, prev = (rank + w - 1) % w;
        size_t n = (size_t)4 << 20;
        float *out = malloc(n * sizeof *out), *in = malloc(n * sizeof *in);
        if (!out || !in) return fail(rank, "malloc");
        for (size_t k = 0; k < n; k++) out[k] = (float)(rank * 1000 + k % 997);
        gradwire_p2p_op_t ops[2] = {
            {GRADWIRE_P2P_SEND, next, 9, GRADWIRE_FLOAT32, n, out},
            {GRADWIRE_P2P_RECV, prev, 9, GRADWIRE_FLOAT32, n, in},
        };
        gradwire_work_t *wp = NULL;
        if (gradwire_ip2p_batch(c, ops, 2, &wp) || gradwire_wait(wp, -1)) return fail(rank, "p2p batch");
        for (size_t k = 0; k < n; k++)
            if (in[k] != (float)(prev * 1000 + k % 997)) {
                fprintf(stderr, "rank %d: batch recv[%zu] = %g, want %d\n", rank, k, in[k], (int)(prev * 1000 + k % 997));
                return 1;
            }
        free(out);
        free(in);
    }
    float f = 1.0f;
    if (gradwire_allreduce(c, &f, &f, 1, GRADWIRE_INT32, GRADWIRE_AVG) != GRADWIRE_ERR_INVALID_ARGUMENT) {
        fprintf(stderr, "rank %d: avg of int32 was not refused\n", rank);
        return 1;
    }
    return 0;
}

/* Training schemes driven as a framework drives them, on a toy least-squares model: rank
 * r's gradient at p is p - target_r (target_r[k] = r + k), so the synchronous schemes
 * reach mean_r target_r; asynchronous Downpour ends at some mix of the targets (the last
 * pushes weigh most), inside their range. Every rank must end with the same parameters. */
static int train_schemes(gradwire_comm_t *c, int rank, int w) {
    enum { N = 16, EPOCHS = 6, BATCHES = 8 };
    const char *schemes[][2] = {
        {"ssgd", ""},
        {"bsp", "interval=2"},
        {"daso", "epochs=6,warmup_epochs=1,cooldown_epochs=1"},
        {"downpour", "lr=0.2,fetch=2,push=2"},
    };
    if (gradwire_strategy_create(c, "sgdx", NULL, NULL, 0, NULL) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "strategy NULL out accepted");
    gradwire_strategy_t *s = NULL;
    float init[N] = {0};
    if (gradwire_strategy_create(c, "bsp", "interval=0", init, N, &s) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "interval=0 accepted");
    if (gradwire_strategy_create(c, "ssgd", "lr=0.1", init, N, &s) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "ssgd lr accepted");
    for (size_t k = 0; k < sizeof schemes / sizeof schemes[0]; k++) {
        float p[N], g[N];
        for (int i = 0; i < N; i++) p[i] = (float)(rank * 100 + i); /* start apart: start() agrees */
        if (gradwire_strategy_create(c, schemes[k][0], schemes[k][1], p, N, &s)) return fail(rank, schemes[k][0]);
        int framework = -1, pool = -1, more = 0;
        if (gradwire_strategy_framework_update(s, &framework) || gradwire_strategy_shared_pool(s, &pool)) return fail(rank, "queries");
        if (gradwire_strategy_claim_batch(s, 8, &more) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "claim before start accepted");
        if (gradwire_strategy_start(s, p, N)) return fail(rank, "start");
        if (!pool && gradwire_strategy_claim_batch(s, 8, &more) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "claim without a pool accepted");
        int64_t taken = 0;
        for (int e = 0; e < EPOCHS; e++) {
            double loss = 0, mean = 0;
            /* With a shared pool (the parameter-server schemes) the ranks draw the epoch's
             * BATCHES * w minibatches from one pool; else each takes its BATCHES. */
            for (int b = 0;; b++) {
                if (pool) {
                    if (gradwire_strategy_claim_batch(s, (size_t)BATCHES * w, &more)) return fail(rank, "claim_batch");
                    if (!more) break;
                } else if (b == BATCHES) {
                    break;
                }
                taken++;
                for (int i = 0; i < N; i++) {
                    g[i] = p[i] - (float)(rank + i);
                    loss += 0.5 * g[i] * g[i];
                }
                int last = !pool && b == BATCHES - 1, rc;
                if (framework) {
                    rc = gradwire_strategy_before_update(s, g, N, last);
                    for (int i = 0; i < N && !rc; i++) p[i] -= 0.2f * g[i]; /* the framework's optimizer */
                    rc = rc ? rc : gradwire_strategy_after_update(s, p, N, last);
                } else {
                    rc = gradwire_strategy_step(s, p, g, N, last);
                }
                if (rc) return fail(rank, schemes[k][0]);
            }
            if (gradwire_strategy_end_epoch(s, p, N, loss / BATCHES, &mean)) return fail(rank, "end_epoch");
        }
        if (gradwire_strategy_finish(s, p, N)) return fail(rank, "finish");
        /* Every minibatch of every epoch taken once, by some rank. */
        if (gradwire_allreduce(c, &taken, &taken, 1, GRADWIRE_INT64, GRADWIRE_SUM)) return fail(rank, "count");
        if (taken != (int64_t)EPOCHS * BATCHES * w) {
            fprintf(stderr, "rank %d: %s took %lld minibatches, want %d\n", rank, schemes[k][0], (long long)taken, EPOCHS * BATCHES * w);
            return 1;
        }
        char state[128];
        uint64_t bytes = 0;
        if (gradwire_strategy_describe(s, state, sizeof state) || gradwire_strategy_bytes_sent(s, &bytes)) return fail(rank, "describe");
        if (gradwire_strategy_free(s) || gradwire_strategy_free(s) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "free");
        /* Identical on every rank, and near the mean target. */
        float lo[N], hi[N];
        if (gradwire_allreduce(c, p, lo, N, GRADWIRE_FLOAT32, GRADWIRE_MIN) || gradwire_allreduce(c, p, hi, N, GRADWIRE_FLOAT32, GRADWIRE_MAX)) return fail(rank, "compare");
        for (int i = 0; i < N; i++) {
            float want = (float)(w - 1) / 2 + (float)i, err = p[i] - want;
            float tol = k == 3 ? (float)(w - 1) / 2 + 0.1f : 0.5f;
            if (lo[i] != hi[i] || err > tol || err < -tol) {
                fprintf(stderr, "rank %d: %s: parameter %d = %g (ranks from %g to %g), want about %g\n", rank, state, i, p[i], lo[i], hi[i], want);
                return 1;
            }
        }
        if (rank == 0) printf("%s: %llu bytes sent by rank 0\n", state, (unsigned long long)bytes);
    }
    return 0;
}

/* The hierarchical allreduce against the sum and mean computed here, for both algorithms,
 * blocking out of place and non-blocking in place; bad arguments refused. */
static int hierarchical(gradwire_comm_t *c, int rank, int w, int nodes_want) {
    gradwire_hierarchy_t *h = NULL;
    if (gradwire_hierarchy_create(c, NULL) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "hierarchy NULL out accepted");
    if (gradwire_hierarchy_create(c, &h)) return fail(rank, "gradwire_hierarchy_create");
    int nodes = 0;
    if (gradwire_hierarchy_nodes(h, &nodes)) return fail(rank, "gradwire_hierarchy_nodes");
    if (nodes != nodes_want) {
        fprintf(stderr, "rank %d: %d nodes, want %d\n", rank, nodes, nodes_want);
        return 1;
    }
    enum { N = 100003 }; /* not a multiple of any node size: the sharded form pads */
    static float x[N], y[N], m[N];
    gradwire_hierarchical_algo_t algos[2] = {GRADWIRE_HIERARCHICAL_SHARDED, GRADWIRE_HIERARCHICAL_LEADER};
    for (int a = 0; a < 2; a++) {
        for (int i = 0; i < N; i++) m[i] = x[i] = (float)((rank + 1) * (i % 7));
        /* The blocking sum runs while the non-blocking mean may still be queued: both are
         * ordered with the communicator's calls, so neither takes the other's data. */
        gradwire_work_t *work = NULL;
        if (gradwire_hierarchical_iallreduce(h, m, m, N, GRADWIRE_FLOAT32, GRADWIRE_AVG, algos[a], &work)) return fail(rank, "hierarchical non-blocking mean");
        if (gradwire_hierarchical_allreduce(h, x, y, N, GRADWIRE_FLOAT32, GRADWIRE_SUM, algos[a])) return fail(rank, "hierarchical sum");
        if (gradwire_wait(work, -1)) return fail(rank, "hierarchical non-blocking mean (wait)");
        for (int i = 0; i < N; i++) {
            /* Small integers and halves: exact in float, whatever the order of the sum. */
            float sum = (float)((i % 7) * w * (w + 1) / 2), mean = (float)(i % 7) * (float)(w + 1) / 2.0f;
            if (y[i] != sum || m[i] != mean) {
                fprintf(stderr, "rank %d: algo %d element %d: sum %g (want %g), mean %g (want %g)\n", rank, a, i, y[i], sum, m[i], mean);
                return 1;
            }
        }
    }
    int64_t v = 1;
    if (gradwire_hierarchical_allreduce(h, &v, &v, 1, GRADWIRE_INT64, GRADWIRE_AVG, 0) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "int64 avg accepted");
    if (gradwire_hierarchical_allreduce(h, &v, &v, 1, GRADWIRE_INT64, GRADWIRE_SUM, 7) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "algo 7 accepted");
    if (gradwire_hierarchical_allreduce(NULL, &v, &v, 1, GRADWIRE_INT64, GRADWIRE_SUM, 0) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "NULL hierarchy accepted");
    if (gradwire_hierarchical_allreduce(h, x, x + 1, 4, GRADWIRE_FLOAT32, GRADWIRE_SUM, 0) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "overlap accepted");
    if (gradwire_hierarchy_free(h) || gradwire_hierarchy_free(h) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "hierarchy free");
    return 0;
}

static int run_rank(int rank, int w, int (*world_pipes)[2], int (*even_pipes)[2]) {
    gradwire_unique_id_t id;
    int world_w[64], even_w[64];
    for (int r = 0; r < w; r++) world_w[r] = world_pipes[r][1];
    for (int r = 0; r < w; r += 2) even_w[r / 2] = even_pipes[r][1];
    if (share_id(rank, w, world_w, &world_pipes[rank][0], &id)) return 1;
    const char *k = getenv("UNIQUE_ID_NODES");
    int nodes = k ? atoi(k) : 1;
    if (nodes < 1 || w % nodes) return fail(rank, "UNIQUE_ID_NODES must divide W");
    if (nodes > 1) {
        char host[64];
        snprintf(host, sizeof host, "unique-id-example-node-%d", rank / (w / nodes));
        setenv("GRADWIRE_HOST_ID", host, 1);
    }
    gradwire_comm_t *world = NULL, *evens = NULL;
    if (gradwire_comm_init_rank(&world, &id, w, rank)) return fail(rank, "gradwire_comm_init_rank");
    if (check_world(world, rank, w)) return 1;
    if (hierarchical(world, rank, w, nodes)) return 1;
    if (train_schemes(world, rank, w)) return 1;
    if (rank % 2 == 0) {
        int er = rank / 2, ew = (w + 1) / 2;
        if (share_id(er, ew, even_w, &even_pipes[rank][0], &id)) return 1;
        if (gradwire_comm_init_rank(&evens, &id, ew, er)) return fail(rank, "even subgroup init");
        int64_t v = rank;
        if (gradwire_allreduce(evens, &v, &v, 1, GRADWIRE_INT64, GRADWIRE_SUM)) return fail(rank, "even subgroup sum");
        int64_t want = 0;
        for (int r = 0; r < w; r += 2) want += r;
        if (v != want) {
            fprintf(stderr, "rank %d: even subgroup sum %lld, want %lld\n", rank, (long long)v, (long long)want);
            return 1;
        }
        if (gradwire_finalize(evens)) return fail(rank, "finalize subgroup");
    }
    if (gradwire_barrier(world)) return fail(rank, "barrier");
    /* A strategy left alive goes with its communicator. */
    gradwire_strategy_t *left = NULL;
    float one[1] = {1.0f};
    if (gradwire_strategy_create(world, "ssgd", NULL, one, 1, &left)) return fail(rank, "strategy for finalize");
    gradwire_hierarchy_t *left_h = NULL;
    if (gradwire_hierarchy_create(world, &left_h)) return fail(rank, "hierarchy for finalize");
    if (gradwire_finalize(world)) return fail(rank, "finalize");
    if (gradwire_strategy_free(left) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "strategy outlived its communicator");
    if (gradwire_hierarchy_free(left_h) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(rank, "hierarchy outlived its communicator");
    printf("rank %d: ok\n", rank);
    return 0;
}

int main(int argc, char **argv) {
    int w = argc > 1 ? atoi(argv[1]) : 4;
    if (w < 1 || w > 64) {
        fprintf(stderr, "usage: unique_id W (1..64)\n");
        return 2;
    }
    /* Bad ids and ranks are refused with a clear error, before any rendezvous. */
    gradwire_unique_id_t junk = {{0}};
    gradwire_comm_t *c = NULL;
    if (gradwire_comm_init_rank(&c, &junk, 2, 0) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(-1, "junk id accepted");
    if (gradwire_comm_init_rank(&c, NULL, 2, 0) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(-1, "NULL id accepted");
    if (gradwire_comm_init_rank(&c, &junk, 2, 2) != GRADWIRE_ERR_INVALID_ARGUMENT) return fail(-1, "rank 2 of 2 accepted");
    /* (No id is made before the fork: a forked child would inherit a store without its
     * threads.) */
    fflush(stdout);

    int world_pipes[64][2], even_pipes[64][2];
    for (int r = 0; r < w; r++)
        if (pipe(world_pipes[r]) || pipe(even_pipes[r])) return fail(-1, "pipe");
    for (int r = 0; r < w; r++) {
        pid_t pid = fork();
        if (pid < 0) return fail(-1, "fork");
        if (pid == 0) {
            int rc = run_rank(r, w, world_pipes, even_pipes);
            fflush(NULL);
            _exit(rc);
        }
    }
    int failed = 0;
    for (int r = 0; r < w; r++) {
        int status = 0;
        if (wait(&status) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0) failed = 1;
    }
    return failed;
}
