/*
 * mpi_allreduce.c -- Open MPI peer for gradwire's `bench allreduce`.
 *
 * Times MPI_Allreduce(MPI_FLOAT, MPI_SUM) over message sizes MIN..MAX
 * (multiplying by FACTOR) and writes, on rank 0, a CSV with exactly the
 * columns gradwire writes:
 *
 *   size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong
 *
 * Method (same as nccl-tests / gradwire):
 *   - out-of-place by default (separate send and receive buffers);
 *     `--inplace` uses MPI_IN_PLACE instead (the buffer is then re-filled
 *     before the checked call, see below);
 *   - WARMUP untimed calls, MPI_Barrier, then ITERS timed calls;
 *     per-rank mean = elapsed / ITERS; reported time_us = max over ranks of
 *     that mean (MPI_Reduce MPI_MAX to rank 0);
 *   - algbw = size_bytes / time (GB/s, 1e9), busbw = algbw * 2 (W-1) / W.
 *   - correctness: every rank fills its send buffer with deterministic
 *     per-rank pseudo-random *integers* in [-1000, 1000] stored as float
 *     (hash of rank and index, period 1000003 elements), so
 *     any summation order gives the exact result (|sum| < 2^24 for
 *     W <= 16000).  After the last timed iteration each rank recomputes the
 *     expected sum independently (re-deriving every rank's values from the
 *     same hash) and counts differing elements; `wrong` = total over ranks.
 *
 * Usage:
 *   mpirun -np W mpi_allreduce -b 4K -e 256M -f 4 -n 20 -w 5 \
 *          [-d float32] [-o sum] [--inplace] [--selftest-corrupt] --csv FILE
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Shared with gloo_allreduce.py: value of element i on rank r, an integer in
 * [-1000, 1000] from a hash of (r, i mod GW_PERIOD).  The period (a prime,
 * so it never lines up with power-of-two chunking) lets the Python peer
 * build its data and reference from a small table instead of hashing every
 * element; it changes nothing for the timing. */
#define GW_PERIOD 1000003u
static inline float gw_value(uint64_t r, uint64_t i) {
    i %= GW_PERIOD;
    uint32_t h = (uint32_t)(i * 0x9E3779B1u + (r + 1u) * 0x85EBCA77u);
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    return (float)((int32_t)(h % 2001u) - 1000);
}

static void fill(float *buf, size_t count, int rank) {
    for (size_t i = 0; i < count; i++) buf[i] = gw_value((uint64_t)rank, i);
}

static long long count_wrong(const float *buf, size_t count, int world) {
    long long wrong = 0;
    for (size_t i = 0; i < count; i++) {
        float expect = 0.0f;
        for (int r = 0; r < world; r++) expect += gw_value((uint64_t)r, i);
        if (buf[i] != expect) wrong++;
    }
    return wrong;
}

static size_t parse_size(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    size_t mult = 1;
    if (end && *end) {
        switch (*end) {
        case 'k': case 'K': mult = 1ull << 10; break;
        case 'm': case 'M': mult = 1ull << 20; break;
        case 'g': case 'G': mult = 1ull << 30; break;
        case 'b': case 'B': mult = 1; break;
        default:
            fprintf(stderr, "bad size '%s'\n", s);
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    return (size_t)(v * (double)mult);
}

static void usage(void) {
    fprintf(stderr,
            "usage: mpi_allreduce -b MIN -e MAX -f FACTOR -n ITERS -w WARMUP "
            "[-d float32] [-o sum] [--inplace] [--csv FILE]\n"
            "  --selftest-corrupt  perturb one element on rank 0 before checking\n"
            "                      (wrong must then be 1 per size)\n");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    size_t minb = 4 << 10, maxb = 4 << 20, factor = 4;
    int iters = 20, warmup = 5, inplace = 0, corrupt = 0;
    const char *csv = NULL;

    for (int a = 1; a < argc; a++) {
        const char *o = argv[a];
        const char *v = (a + 1 < argc) ? argv[a + 1] : NULL;
#define NEEDV() do { if (!v) { usage(); MPI_Abort(MPI_COMM_WORLD, 2); } a++; } while (0)
        if (!strcmp(o, "-b") || !strcmp(o, "--minbytes")) { NEEDV(); minb = parse_size(v); }
        else if (!strcmp(o, "-e") || !strcmp(o, "--maxbytes")) { NEEDV(); maxb = parse_size(v); }
        else if (!strcmp(o, "-f") || !strcmp(o, "--stepfactor")) { NEEDV(); factor = (size_t)atol(v); }
        else if (!strcmp(o, "-n") || !strcmp(o, "--iters")) { NEEDV(); iters = atoi(v); }
        else if (!strcmp(o, "-w") || !strcmp(o, "--warmup")) { NEEDV(); warmup = atoi(v); }
        else if (!strcmp(o, "-d") || !strcmp(o, "--dtype")) {
            NEEDV();
            if (strcasecmp(v, "float32") && strcasecmp(v, "float") && strcasecmp(v, "f32")) {
                if (rank == 0) fprintf(stderr, "only float32 is supported\n");
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        } else if (!strcmp(o, "-o") || !strcmp(o, "--op")) {
            NEEDV();
            if (strcasecmp(v, "sum")) {
                if (rank == 0) fprintf(stderr, "only sum is supported\n");
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        } else if (!strcmp(o, "--csv")) { NEEDV(); csv = v; }
        else if (!strcmp(o, "--inplace")) inplace = 1;
        else if (!strcmp(o, "--selftest-corrupt")) corrupt = 1;
        else if (!strcmp(o, "-h") || !strcmp(o, "--help")) {
            if (rank == 0) usage();
            MPI_Finalize();
            return 0;
        } else {
            if (rank == 0) { fprintf(stderr, "unknown argument '%s'\n", o); usage(); }
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
#undef NEEDV
    }
    if (factor < 2 || minb < 4 || maxb < minb || iters < 1 || warmup < 0) {
        if (rank == 0) usage();
        MPI_Abort(MPI_COMM_WORLD, 2);
    }

    size_t maxcount = maxb / sizeof(float);
    float *sendbuf = NULL, *recvbuf = NULL;
    if (posix_memalign((void **)&recvbuf, 4096, maxcount * sizeof(float)) ||
        (!inplace && posix_memalign((void **)&sendbuf, 4096, maxcount * sizeof(float)))) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    /* Touch every page up front so first-touch faults are not timed. */
    memset(recvbuf, 0, maxcount * sizeof(float));
    if (!inplace) fill(sendbuf, maxcount, rank);

    FILE *out = NULL;
    if (rank == 0) {
        out = csv ? fopen(csv, "w") : stdout;
        if (!out) { perror(csv); MPI_Abort(MPI_COMM_WORLD, 4); }
        fprintf(out, "size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n");
        fflush(out);
        fprintf(stderr, "# mpi_allreduce: W=%d %s-place iters=%d warmup=%d\n", world,
                inplace ? "in" : "out-of", iters, warmup);
        fprintf(stderr, "#%12s %12s %10s %10s %8s\n", "size", "time_us", "algbw", "busbw", "wrong");
    }

    for (size_t size = minb; size <= maxb; size *= factor) {
        int count = (int)(size / sizeof(float));
        size_t bytes = (size_t)count * sizeof(float);
        const void *sb = inplace ? MPI_IN_PLACE : (const void *)sendbuf;

        for (int i = 0; i < warmup; i++)
            MPI_Allreduce(sb, recvbuf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++)
            MPI_Allreduce(sb, recvbuf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        double t1 = MPI_Wtime();
        double mean = (t1 - t0) / iters, maxmean = 0.0;
        MPI_Reduce(&mean, &maxmean, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

        /* Check.  Out-of-place: the last timed call's result.  In-place:
         * the data was summed repeatedly, so re-fill and do one more call. */
        if (inplace) {
            fill(recvbuf, (size_t)count, rank);
            MPI_Allreduce(MPI_IN_PLACE, recvbuf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        }
        if (corrupt && rank == 0) recvbuf[count / 2] += 1.0f; /* checker self-test */
        long long wrong = count_wrong(recvbuf, (size_t)count, world), total = 0;
        MPI_Reduce(&wrong, &total, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
        if (inplace) memset(recvbuf, 0, bytes);

        if (rank == 0) {
            double us = maxmean * 1e6;
            double algbw = (double)bytes / maxmean / 1e9;
            double busbw = algbw * 2.0 * (world - 1) / world;
            fprintf(out, "%zu,%d,float32,sum,%.3f,%.4f,%.4f,%lld\n", bytes, count, us, algbw,
                    busbw, total);
            fflush(out);
            fprintf(stderr, " %12zu %12.2f %10.3f %10.3f %8lld\n", bytes, us, algbw, busbw, total);
        }
        if (size > maxb / factor) break; /* avoid overflow */
    }
    if (out && out != stdout) fclose(out);
    free(sendbuf);
    free(recvbuf);
    MPI_Finalize();
    return 0;
}
