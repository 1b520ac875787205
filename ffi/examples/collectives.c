/*
 * A C program using gradwire the way a framework would: init from the environment,
 * registered memory, blocking and non-blocking collectives, checked against sums computed
 * here from every rank's (regenerated) input. Run under the launcher:
 *
 *   cc -std=c99 -Wall -Wextra -Werror -I ffi ffi/examples/collectives.c \
 *      -L target/release -lgradwire -Wl,-rpath,$PWD/target/release -o target/collectives
 *   target/release/gradwire launch -n 4 -- target/collectives
 */
#include "gradwire.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHECK(call)                                                                      \
    do {                                                                                 \
        int rc_ = (call);                                                                \
        if (rc_ != GRADWIRE_OK) {                                                        \
            fprintf(stderr, "%s failed (%d): %s\n", #call, rc_, gradwire_last_error()); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* Small integers, so float sums are exact and the reference needs no tolerance. */
static float input(int rank, size_t i, unsigned seed) {
    unsigned x = (unsigned)rank * 2654435761u ^ (unsigned)i * 40503u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    return (float)((int)(x % 2001u) - 1000);
}

/* Allgathers `mine` (`part` elements per rank) into `all`, then reduce-scatters `all` back
 * into `mine`, and counts the elements that differ from sums computed here. `mine` may be
 * this rank's block of `all`: in place, as NCCL (and MPI_IN_PLACE) lay them out, where the
 * other blocks of the reduce-scatter's input stay as they were. */
static long gather_then_scatter(gradwire_comm_t *comm, int rank, int size, float *mine, float *all, size_t part, unsigned seed) {
    const size_t whole = part * (size_t)size;
    const int in_place = mine == all + (size_t)rank * part;
    long wrong = 0;
    for (size_t i = 0; i < part; i++) mine[i] = input(rank, i, seed);
    CHECK(gradwire_allgather(comm, mine, all, part, GRADWIRE_FLOAT32));
    for (size_t i = 0; i < whole; i++) wrong += all[i] != input((int)(i / part), i % part, seed);
    for (size_t i = 0; i < whole; i++) all[i] = input(rank, i, seed + 1);
    CHECK(gradwire_reduce_scatter(comm, all, mine, part, GRADWIRE_FLOAT32, GRADWIRE_SUM));
    for (size_t i = 0; i < part; i++) {
        float want = 0;
        for (int r = 0; r < size; r++) want += input(r, (size_t)rank * part + i, seed + 1);
        wrong += mine[i] != want;
    }
    for (size_t i = 0; i < whole; i++)
        if (!in_place || i / part != (size_t)rank) wrong += all[i] != input(rank, i, seed + 1);
    return wrong;
}

int main(void) {
    gradwire_comm_t *comm = NULL;
    CHECK(gradwire_init(&comm));
    int rank = -1, size = 0;
    CHECK(gradwire_comm_rank(comm, &rank));
    CHECK(gradwire_comm_size(comm, &size));

    /* Fresh data every run: a seed every rank agrees on (rank 0's, broadcast). */
    srand((unsigned)time(NULL));
    float seedf = (float)(rand() % 100000);
    CHECK(gradwire_broadcast(comm, &seedf, 1, GRADWIRE_FLOAT32, 0));
    unsigned seed = (unsigned)seedf;

    const size_t n = 100003; /* prime: not divisible by the world size */
    float *buf = NULL;
    CHECK(gradwire_alloc(comm, n * sizeof(float), (void **)&buf));
    long wrong = 0;

    /* Blocking allreduce, in place, in gradwire-allocated (shared) memory. */
    for (size_t i = 0; i < n; i++) buf[i] = input(rank, i, seed);
    CHECK(gradwire_allreduce(comm, buf, buf, n, GRADWIRE_FLOAT32, GRADWIRE_SUM));
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < size; r++) want += input(r, i, seed);
        wrong += buf[i] != want;
    }

    /* Non-blocking allreduce (max), out of place, in ordinary malloc'd memory. */
    float *src = malloc(n * sizeof(float)), *dst = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) src[i] = input(rank, i, seed + 1);
    gradwire_work_t *work = NULL;
    CHECK(gradwire_iallreduce(comm, src, dst, n, GRADWIRE_FLOAT32, GRADWIRE_MAX, &work));
    CHECK(gradwire_wait(work, -1));
    for (size_t i = 0; i < n; i++) {
        float want = input(0, i, seed + 1);
        for (int r = 1; r < size; r++) want = input(r, i, seed + 1) > want ? input(r, i, seed + 1) : want;
        wrong += dst[i] != want;
    }

    /* Blocking allreduce, in place, in malloc'd memory registered once for many calls (as
     * with ncclCommRegister): between ranks of a host as fast as gradwire_alloc memory. */
    float *grads = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) grads[i] = input(rank, i, seed + 4);
    CHECK(gradwire_register(comm, grads, n * sizeof(float)));
    for (unsigned round = 0; round < 2; round++) {
        if (round > 0)
            for (size_t i = 0; i < n; i++) grads[i] = input(rank, i, seed + 4 + round);
        CHECK(gradwire_allreduce(comm, grads, grads, n, GRADWIRE_FLOAT32, GRADWIRE_SUM));
        for (size_t i = 0; i < n; i++) {
            float want = 0;
            for (int r = 0; r < size; r++) want += input(r, i, seed + 4 + round);
            wrong += grads[i] != want;
        }
    }
    CHECK(gradwire_deregister(comm, grads));
    free(grads);

    /* Allgather and reduce-scatter, then the same in place. */
    const size_t part = 1001;
    float *mine = malloc(part * sizeof(float)), *all = malloc(part * (size_t)size * sizeof(float));
    wrong += gather_then_scatter(comm, rank, size, mine, all, part, seed + 2);
    wrong += gather_then_scatter(comm, rank, size, all + (size_t)rank * part, all, part, seed + 4);
    CHECK(gradwire_barrier(comm));

    CHECK(gradwire_free(comm, buf));
    free(src);
    free(dst);
    free(mine);
    free(all);
    CHECK(gradwire_finalize(comm));
    printf("rank %d of %d: %ld wrong elements\n", rank, size, wrong);
    return wrong == 0 ? 0 : 1;
}
