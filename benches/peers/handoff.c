/*
 * handoff.c -- how fast two cores hand data to each other through shared
 * memory, printed beside the allreduce tables in docs/benchmarks.md.
 *
 * Two threads pinned to CPUs 0 and 1. Each round, each copies BLOCK_KIB
 * (default 512 KiB) of its private buffer into its half of a shared buffer,
 * meets the other at a spinning barrier, copies the other's half into its
 * private buffer, and meets it again: the pattern of a staged shared-memory
 * allreduce without the reduction, all in cache. On some virtual machines
 * this rate changes several-fold from one minute to the next with nothing
 * else running in the guest, which no allreduce can hide; compare.sh
 * measures it before and after its runs.
 *
 * Output: one CSV line (with -H, a header line first):
 *   block_kib,handoff_gbs     (bytes copied per second per thread, GB = 1e9)
 *
 * Usage: handoff [-H] [BLOCK_KIB [ROUNDS]]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static size_t block;
static long rounds;
static char *shared;
static long arrived; /* barrier: both threads add 1 per crossing */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void cross(long target) {
    __atomic_add_fetch(&arrived, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&arrived, __ATOMIC_ACQUIRE) < target)
        __builtin_ia32_pause();
}

static void *run(void *arg) {
    long me = (long)arg;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET((int)me, &set);
    pthread_setaffinity_np(pthread_self(), sizeof set, &set);
    char *priv = malloc(block);
    memset(priv, (int)me + 1, block);
    char *mine = shared + me * block, *theirs = shared + (1 - me) * block;
    for (long i = 0; i < rounds; i++) {
        memcpy(mine, priv, block);
        cross(2 * (2 * i + 1));
        memcpy(priv, theirs, block);
        cross(2 * (2 * i + 2));
    }
    free(priv);
    return NULL;
}

int main(int argc, char **argv) {
    int header = argc > 1 && strcmp(argv[1], "-H") == 0;
    int a = header ? 2 : 1;
    block = (size_t)(argc > a ? atol(argv[a]) : 512) << 10;
    rounds = argc > a + 1 ? atol(argv[a + 1]) : 2000;
    if (block == 0 || rounds <= 0) {
        fprintf(stderr, "usage: handoff [-H] [BLOCK_KIB [ROUNDS]]\n");
        return 2;
    }
    shared = aligned_alloc(4096, 2 * block);
    memset(shared, 0, 2 * block);
    pthread_t t[2];
    double t0 = now();
    for (long i = 0; i < 2; i++)
        pthread_create(&t[i], NULL, run, (void *)i);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    double dt = now() - t0;
    if (header)
        printf("block_kib,handoff_gbs\n");
    printf("%zu,%.2f\n", block >> 10, 2.0 * (double)block * (double)rounds / dt / 1e9);
    return 0;
}
