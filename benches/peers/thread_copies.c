/*
 * thread_copies.c -- the one-copy ceiling of allgather, alltoall, broadcast and
 * reduce-scatter on this machine: W threads of one process, one per rank, each buffer its
 * own allocation, and every output byte copied (or reduced) once, straight from the inputs
 * that hold it (memcpy, or one float32 sum per output element; no kernel, no staging, no
 * process boundary, nothing to agree on). No library moving data between processes'
 * private buffers can do less, nor with less in the way; so where a goal's reference (this
 * run's Open MPI figure, or gradwire's allreduce) times the goal's multiple is above this,
 * the goal is out of reach on this machine. benches/collectives.sh runs it beside gradwire
 * and Open MPI (tool "threads").
 *
 *   allgather  thread t writes its output: part p from rank p's input (S/W bytes each,
 *              starting with part t+1, as gradwire reads its peers), S bytes per thread;
 *   alltoall   thread t writes block p of its output from block t of rank p's input;
 *   broadcast  from rank 0: the (W-1)·S bytes of the other ranks' outputs, cut into W equal
 *              pieces, one per thread (here the root may write the others' buffers too);
 *   reduce_scatter  thread t writes its output (S/W bytes of float32): the sum of part t of
 *              every rank's input, block by block (each block of the output written once,
 *              from the first two inputs, then added to from the rest while in L1).
 *
 * Sizes, timing and CSV as `gradwire bench` and benches/peers/mpi_collectives.c: S is the
 * whole buffer (allgather's output, alltoall's input of one rank, broadcast's buffer,
 * reduce-scatter's input of one rank);
 * WARMUP untimed calls, then ITERS timed ones, each ended by a barrier of all threads (a
 * call ends when every rank has its data); time_us = the slowest thread's mean; busbw =
 * algbw x (W-1)/W (allgather, alltoall, reduce-scatter) or x 1 (broadcast). `wrong` counts
 * output bytes (reduce-scatter: elements) that differ from what they should hold after the
 * last call.
 *
 *   gcc -O3 -pthread benches/peers/thread_copies.c -o target/peers/thread_copies
 *   target/peers/thread_copies -c allgather -W 2 -b 1M -e 64M -f 4 -n 20 -w 5 [--csv FILE]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

enum coll { ALLGATHER, ALLTOALL, BROADCAST, REDUCE_SCATTER };

static enum coll coll;
static int world, iters, warmup;
static size_t size;
static unsigned char **in, **out;
static double *mean_s;

/* The end of a call: a spinning barrier (then yielding, for more threads than cores), as
 * gradwire's ranks wait; a sleeping one would add a wake-up to every call. */
static _Atomic int arrived, generation;
static void barrier(void) {
    int g = atomic_load(&generation);
    if (atomic_fetch_add(&arrived, 1) == world - 1) {
        atomic_store(&arrived, 0);
        atomic_fetch_add(&generation, 1);
        return;
    }
    for (int spins = 0; atomic_load(&generation) == g; spins++) {
        if (spins >= 4000) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
        else __builtin_ia32_pause();
#endif
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* Elements per block of the reduce-scatter: the output's block stays in L1 while every
 * input's is added to it. */
#define RS_BLOCK 4096

/* Thread t's reduce-scatter: part t of every rank's input summed into out[t], the inputs
 * in the order t+1, t+2, ... (as gradwire reads its peers). */
static void reduce_part(int t) {
    size_t n = size / (size_t)world / sizeof(float);
    float *dst = (float *)out[t];
    for (size_t b = 0; b < n; b += RS_BLOCK) {
        size_t e = b + RS_BLOCK < n ? b + RS_BLOCK : n;
        const float *x = (const float *)in[(t + 1) % world] + (size_t)t * n;
        const float *y = (const float *)in[(t + 2) % world] + (size_t)t * n;
        for (size_t i = b; i < e; i++) dst[i] = x[i] + y[i];
        for (int k = 3; k <= world; k++) {
            const float *z = (const float *)in[(t + k) % world] + (size_t)t * n;
            for (size_t i = b; i < e; i++) dst[i] += z[i];
        }
    }
}

/* One call's copies for thread t. */
static void call(int t) {
    size_t part = size / (size_t)world;
    switch (coll) {
    case ALLGATHER:
        for (int k = 1; k <= world; k++) {
            int p = (t + k) % world;
            memcpy(out[t] + (size_t)p * part, in[p], part);
        }
        break;
    case ALLTOALL:
        for (int k = 1; k <= world; k++) {
            int p = (t + k) % world;
            memcpy(out[t] + (size_t)p * part, in[p] + (size_t)t * part, part);
        }
        break;
    case BROADCAST: {
        /* Byte range [lo, hi) of the concatenated outputs of ranks 1..W-1. */
        size_t total = (size_t)(world - 1) * size;
        size_t lo = total * (size_t)t / (size_t)world, hi = total * (size_t)(t + 1) / (size_t)world;
        while (lo < hi) {
            size_t r = 1 + lo / size, at = lo % size, n = size - at < hi - lo ? size - at : hi - lo;
            memcpy(out[r] + at, in[0] + at, n);
            lo += n;
        }
        break;
    }
    case REDUCE_SCATTER:
        reduce_part(t);
        break;
    }
}

static void *thread_main(void *arg) {
    int t = (int)(intptr_t)arg;
    for (int i = 0; i < warmup; i++) {
        call(t);
        barrier();
    }
    double start = now();
    for (int i = 0; i < iters; i++) {
        call(t);
        barrier();
    }
    mean_s[t] = (now() - start) / iters;
    return NULL;
}

/* Output bytes that differ from what the collective should have left. */
static long long wrong_bytes(void) {
    size_t part = size / (size_t)world;
    long long wrong = 0;
    if (coll == REDUCE_SCATTER) {
        /* Small whole numbers: every sum is exact in float32, whatever the order. */
        for (int t = 0; t < world; t++) {
            const float *got = (const float *)out[t];
            for (size_t i = 0; i < part / sizeof(float); i++) {
                float want = 0;
                for (int p = 0; p < world; p++) want += ((const float *)in[p])[(size_t)t * part / sizeof(float) + i];
                wrong += got[i] != want;
            }
        }
        return wrong;
    }
    for (int t = 0; t < world; t++) {
        for (int p = 0; p < world; p++) {
            const unsigned char *got, *want;
            size_t n = part;
            if (coll == ALLGATHER) {
                got = out[t] + (size_t)p * part, want = in[p];
            } else if (coll == ALLTOALL) {
                got = out[t] + (size_t)p * part, want = in[p] + (size_t)t * part;
            } else {
                if (t == 0 || p > 0) continue;
                got = out[t], want = in[0], n = size;
            }
            for (size_t i = 0; i < n; i++) wrong += got[i] != want[i];
        }
    }
    return wrong;
}

static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    size_t mul = 1;
    if (*end == 'K' || *end == 'k') mul = 1 << 10, end++;
    else if (*end == 'M' || *end == 'm') mul = 1 << 20, end++;
    else if (*end == 'G' || *end == 'g') mul = 1 << 30, end++;
    if (*end || v <= 0) {
        fprintf(stderr, "bad size '%s'\n", s);
        exit(2);
    }
    return (size_t)(v * (double)mul);
}

static void *pages(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        perror("mmap");
        exit(3);
    }
    return p;
}

int main(int argc, char **argv) {
    const char *csv = NULL, *name = NULL;
    size_t min = 1 << 20, max = 64 << 20;
    int factor = 4;
    world = 2, iters = 20, warmup = 5;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "%s needs a value\n", o);
            return 2;
        }
        if (!strcmp(o, "-c")) name = v;
        else if (!strcmp(o, "-W")) world = atoi(v);
        else if (!strcmp(o, "-b")) min = parse_size(v);
        else if (!strcmp(o, "-e")) max = parse_size(v);
        else if (!strcmp(o, "-f")) factor = atoi(v);
        else if (!strcmp(o, "-n")) iters = atoi(v);
        else if (!strcmp(o, "-w")) warmup = atoi(v);
        else if (!strcmp(o, "--csv")) csv = v;
        else {
            fprintf(stderr, "usage: thread_copies -c allgather|alltoall|broadcast|reduce_scatter [-W W] [-b MIN] [-e MAX] [-f F] [-n ITERS] [-w WARMUP] [--csv FILE]\n");
            return 2;
        }
        i++;
    }
    if (!name || !strcmp(name, "allgather")) coll = ALLGATHER, name = "allgather";
    else if (!strcmp(name, "alltoall")) coll = ALLTOALL;
    else if (!strcmp(name, "broadcast")) coll = BROADCAST;
    else if (!strcmp(name, "reduce_scatter")) coll = REDUCE_SCATTER;
    else {
        printf("gw-na: thread_copies has no %s\n", name);
        return 0;
    }
    if (world < 2 || world > 64 || factor < 2 || iters < 1 || warmup < 0 || min > max) {
        fprintf(stderr, "need 2 <= W <= 64, F >= 2, ITERS >= 1, WARMUP >= 0, MIN <= MAX\n");
        return 2;
    }
    FILE *f = csv ? fopen(csv, "w") : stdout;
    if (!f) {
        perror(csv);
        return 3;
    }
    fprintf(f, "size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n");
    double busbw_factor = coll == BROADCAST ? 1.0 : (double)(world - 1) / world;
    in = calloc((size_t)world, sizeof *in), out = calloc((size_t)world, sizeof *out);
    mean_s = calloc((size_t)world, sizeof *mean_s);
    pthread_t *threads = calloc((size_t)world, sizeof *threads);
    for (size_t s = min; s <= max; s *= (size_t)factor) {
        size = s / (4 * (size_t)world) * 4 * (size_t)world; /* whole float32 parts */
        if (size == 0) continue;
        for (int t = 0; t < world; t++) {
            in[t] = pages(size), out[t] = pages(size);
            if (coll == REDUCE_SCATTER) {
                float *x = (float *)in[t];
                for (size_t i = 0; i < size / sizeof(float); i++) x[i] = (float)((i * 131 + (size_t)t * 7 + 1) % 1021);
            } else {
                for (size_t i = 0; i < size; i++) in[t][i] = (unsigned char)(i * 131 + (size_t)t * 7 + 1);
            }
            memset(out[t], 0, size);
        }
        for (int t = 0; t < world; t++) pthread_create(&threads[t], NULL, thread_main, (void *)(intptr_t)t);
        double slowest = 0;
        for (int t = 0; t < world; t++) {
            pthread_join(threads[t], NULL);
            if (mean_s[t] > slowest) slowest = mean_s[t];
        }
        double algbw = (double)size / slowest / 1e9;
        fprintf(f, "%zu,%zu,float32,sum,%.3f,%.4f,%.4f,%lld\n", size, size / 4 / (coll == BROADCAST ? 1 : (size_t)world),
                slowest * 1e6, algbw, algbw * busbw_factor, wrong_bytes());
        fflush(f);
        for (int t = 0; t < world; t++) munmap(in[t], size), munmap(out[t], size);
    }
    if (f != stdout) fclose(f);
    return 0;
}
