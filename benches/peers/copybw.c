/*
 * copybw.c -- this machine's single-thread memory bandwidth, printed beside
 * the allreduce tables in docs/benchmarks.md as "the machine's measured copy
 * bandwidth".
 *
 * Three kernels over BUF_MIB (default 256 MiB) float buffers, pages touched
 * first, best of REPS (default 7) runs each:
 *   memcpy : memcpy(dst, src, N)            -> N bytes copied per second
 *   add    : dst[i] += src[i]   (float)     -> N bytes of dst reduced per s
 *            (2 reads + 1 write: the inner loop of a sum-allreduce)
 *   triad  : a[i] = b[i] + s * c[i]  (STREAM triad; 2 reads + 1 write)
 *            -> N bytes of a written per second
 *   memcpy on every core at once: one thread per online CPU, each copying
 *            its own N/cores bytes, started together -> N bytes per second of
 *            the slowest; the bound for ranks that outnumber cores, which can
 *            only copy as fast as all cores together.
 * All figures are GB/s with GB = 1e9 bytes, counting the N bytes of the
 * destination once (not read+write traffic, which would be 2x / 3x).
 *
 * Output: one CSV line (with -H, a header line first):
 *   buffer_mib,memcpy_gbs,add_gbs,triad_gbs,cores,memcpy_all_cores_gbs
 *
 * Usage: copybw [-H] [BUF_MIB [REPS]]
 */
#define _POSIX_C_SOURCE 200809L
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Keep the compiler from discarding results. */
static volatile float sink;

static void __attribute__((noinline)) add_kernel(float *restrict d, const float *restrict s,
                                                 size_t n) {
    for (size_t i = 0; i < n; i++) d[i] += s[i];
}

static void __attribute__((noinline)) triad_kernel(float *restrict a, const float *restrict b,
                                                   const float *restrict c, float k, size_t n) {
    for (size_t i = 0; i < n; i++) a[i] = b[i] + k * c[i];
}

/* One thread of the all-cores copy: its own slice, started and timed together. */
struct slice {
    char *dst;
    const char *src;
    size_t len;
    int reps;
    pthread_barrier_t *go;
    double best; /* thread 0: best wall time from start to all done */
};

static void *copy_slice(void *arg) {
    struct slice *s = arg;
    s->best = 1e30;
    for (int r = 0; r < s->reps; r++) {
        pthread_barrier_wait(s->go);
        double t0 = now();
        memcpy(s->dst, s->src, s->len);
        pthread_barrier_wait(s->go); /* everyone done */
        double t1 = now();
        if (t1 - t0 < s->best) s->best = t1 - t0;
    }
    return NULL;
}

/* Aggregate memcpy GB/s with `cores` threads copying `bytes` in total. */
static double copy_all_cores(char *dst, const char *src, size_t bytes, int cores, int reps) {
    pthread_barrier_t go;
    pthread_barrier_init(&go, NULL, (unsigned)cores);
    struct slice *sl = calloc((size_t)cores, sizeof *sl);
    pthread_t *th = calloc((size_t)cores, sizeof *th);
    if (!sl || !th) return 0.0;
    size_t part = bytes / (size_t)cores / 4096 * 4096;
    for (int i = 0; i < cores; i++) {
        sl[i] = (struct slice){dst + (size_t)i * part, src + (size_t)i * part, part, reps, &go, 0};
        if (i > 0) pthread_create(&th[i], NULL, copy_slice, &sl[i]);
    }
    copy_slice(&sl[0]);
    for (int i = 1; i < cores; i++) pthread_join(th[i], NULL);
    double gbs = (double)part * cores / sl[0].best / 1e9;
    pthread_barrier_destroy(&go);
    free(sl);
    free(th);
    return gbs;
}

int main(int argc, char **argv) {
    int header = 0, argi = 1;
    if (argi < argc && !strcmp(argv[argi], "-H")) { header = 1; argi++; }
    size_t mib = (argi < argc) ? (size_t)atol(argv[argi++]) : 256;
    int reps = (argi < argc) ? atoi(argv[argi++]) : 7;
    if (mib == 0 || reps < 1) {
        fprintf(stderr, "usage: copybw [-H] [BUF_MIB [REPS]]\n");
        return 2;
    }
    size_t bytes = mib << 20, n = bytes / sizeof(float);
    float *a, *b, *c;
    if (posix_memalign((void **)&a, 4096, bytes) || posix_memalign((void **)&b, 4096, bytes) ||
        posix_memalign((void **)&c, 4096, bytes)) {
        fprintf(stderr, "copybw: out of memory\n");
        return 3;
    }
    /* Touch every page (and give the data non-trivial values). */
    for (size_t i = 0; i < n; i++) {
        a[i] = 0.0f;
        b[i] = (float)(i & 1023);
        c[i] = (float)((i * 7) & 1023);
    }

    double best_copy = 1e30, best_add = 1e30, best_triad = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        memcpy(a, b, bytes);
        double t1 = now();
        sink = a[n / 3];
        if (t1 - t0 < best_copy) best_copy = t1 - t0;

        t0 = now();
        add_kernel(a, c, n);
        t1 = now();
        sink = a[n / 5];
        if (t1 - t0 < best_add) best_add = t1 - t0;

        t0 = now();
        triad_kernel(a, b, c, 0.5f, n);
        t1 = now();
        sink = a[n / 7];
        if (t1 - t0 < best_triad) best_triad = t1 - t0;
    }
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
    double all = copy_all_cores((char *)a, (const char *)b, bytes, (int)cores, reps);
    if (header) printf("buffer_mib,memcpy_gbs,add_gbs,triad_gbs,cores,memcpy_all_cores_gbs\n");
    printf("%zu,%.2f,%.2f,%.2f,%ld,%.2f\n", mib, (double)bytes / best_copy / 1e9,
           (double)bytes / best_add / 1e9, (double)bytes / best_triad / 1e9, cores, all);
    free(a);
    free(b);
    free(c);
    return 0;
}
