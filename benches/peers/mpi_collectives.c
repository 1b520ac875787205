/*
 * mpi_collectives.c -- Open MPI peer for every collective of `gradwire bench`.
 *
 * Times one collective (-c COLL), float32, sum, over message sizes MIN..MAX
 * (multiplying by FACTOR) and writes, on rank 0, a CSV with exactly the
 * columns gradwire writes:
 *
 *   size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong
 *
 * Collectives and size conventions (those of `gradwire bench`, which are
 * nccl-tests'; `size` is the whole buffer, W the number of ranks):
 *   allreduce       MPI_Allreduce, MPI_IN_PLACE (as gradwire's bench and Gloo;
 *                   --out-of-place: separate send and receive buffers);
 *                   count = size/4;                 busbw = algbw * 2(W-1)/W
 *   reduce_scatter  MPI_Reduce_scatter_block; size = the total send buffer,
 *                   count = size/4/W received per rank; busbw = algbw * (W-1)/W
 *   allgather       MPI_Allgather; size = the total receive buffer,
 *                   count = size/4/W sent per rank;     busbw = algbw * (W-1)/W
 *   broadcast       MPI_Bcast from root 0; count = size/4; busbw = algbw
 *   reduce          MPI_Reduce to root 0, MPI_IN_PLACE at the root (gradwire's
 *                   bench reduces in place); count = size/4; busbw = algbw
 *   alltoall        MPI_Alltoall; size = one rank's total send buffer, count =
 *                   size/4/W elements to each peer; busbw = algbw * (W-1)/W
 *
 * Method (same as nccl-tests / gradwire):
 *   - WARMUP untimed calls, MPI_Barrier, then ITERS timed calls; per-rank
 *     mean = elapsed / ITERS; time_us = max over ranks of that mean
 *     (MPI_Reduce MPI_MAX to rank 0); algbw = size_bytes / time (GB/s, 1e9).
 *   - data: integer-valued floats in [-1000, 1000] from a hash of (rank,
 *     global element index) -- gw_value(), shared with gloo_collectives.py
 *     -- so any summation order gives the exact result.
 *   - correctness: the out-of-place collectives (reduce_scatter, allgather,
 *     alltoall) and broadcast are checked on the result of the last timed
 *     call; the in-place reductions (allreduce, reduce), whose timed calls
 *     run on zeroed buffers (repeated summing then never overflows), are
 *     re-filled and checked on one more, untimed call.  Every rank recomputes its expected result independently from
 *     gw_value(); `wrong` = differing elements summed over ranks.
 *
 * Usage:
 *   mpirun -np W mpi_collectives -c allgather -b 1M -e 64M -f 4 -n 20 -w 5 \
 *          [-d float32] [-o sum] [--inplace | --out-of-place] [--selftest-corrupt] --csv FILE
 */
#define _POSIX_C_SOURCE 200809L
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Must match gw_table() in the Python peers. */
#define GW_PERIOD 1000003u
static inline float gw_value(uint64_t r, uint64_t i) {
    i %= GW_PERIOD;
    uint32_t h = (uint32_t)(i * 0x9E3779B1u + (r + 1u) * 0x85EBCA77u);
    h ^= h >> 15;
    h *= 0x2C1B3C6Du;
    h ^= h >> 12;
    return (float)((int32_t)(h % 2001u) - 1000);
}

enum coll { ALLREDUCE, REDUCE_SCATTER, ALLGATHER, BROADCAST, REDUCE, ALLTOALL };
static const char *const COLL_NAMES[] = {"allreduce", "reduce_scatter", "allgather",
                                         "broadcast", "reduce", "alltoall"};
#define NCOLL ((int)(sizeof COLL_NAMES / sizeof COLL_NAMES[0]))

/* buf[j] = value of global element lo + j on rank r. */
static void fill(float *buf, size_t n, int r, size_t lo) {
    for (size_t j = 0; j < n; j++) buf[j] = gw_value((uint64_t)r, lo + j);
}

/* Sum over all ranks of global element i. */
static float sum_value(int world, size_t i) {
    float s = 0.0f;
    for (int r = 0; r < world; r++) s += gw_value((uint64_t)r, i);
    return s;
}

static size_t parse_size(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    size_t mult = 1;
    if (end == s || v < 0) {
        fprintf(stderr, "bad size '%s'\n", s);
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
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
            "usage: mpi_collectives -c COLL -b MIN -e MAX -f FACTOR -n ITERS -w WARMUP "
            "[-d float32] [-o sum] [--inplace | --out-of-place] [--csv FILE]\n"
            "  COLL: allreduce, reduce_scatter, allgather, broadcast, reduce, alltoall\n"
            "  --selftest-corrupt  perturb one element on rank 0 before checking\n"
            "                      (wrong must then be 1 per size)\n");
}

/* Allreduce with separate send and receive buffers (--out-of-place). */
static int out_of_place = 0;

/* One call of the collective on `count` elements (per-rank block for
 * reduce_scatter, allgather and alltoall). */
static void once(enum coll c, float *sendbuf, float *recvbuf, int count, int rank) {
    switch (c) {
    case ALLREDUCE:
        MPI_Allreduce(out_of_place ? (const void *)sendbuf : MPI_IN_PLACE, recvbuf, count, MPI_FLOAT, MPI_SUM,
                      MPI_COMM_WORLD);
        break;
    case REDUCE_SCATTER:
        MPI_Reduce_scatter_block(sendbuf, recvbuf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        break;
    case ALLGATHER:
        MPI_Allgather(sendbuf, count, MPI_FLOAT, recvbuf, count, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    case BROADCAST:
        MPI_Bcast(recvbuf, count, MPI_FLOAT, 0, MPI_COMM_WORLD);
        break;
    case REDUCE:
        /* recvbuf is significant only at the root; elsewhere another (unused)
         * buffer, so that no two arguments alias. */
        MPI_Reduce(rank == 0 ? MPI_IN_PLACE : (const void *)recvbuf, rank == 0 ? recvbuf : sendbuf,
                   count, MPI_FLOAT, MPI_SUM, 0, MPI_COMM_WORLD);
        break;
    case ALLTOALL:
        MPI_Alltoall(sendbuf, count, MPI_FLOAT, recvbuf, count, MPI_FLOAT, MPI_COMM_WORLD);
        break;
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);

    size_t minb = 1 << 20, maxb = 64 << 20, factor = 4;
    int iters = 20, warmup = 5, corrupt = 0, coll = -1;
    const char *csv = NULL;

    for (int a = 1; a < argc; a++) {
        const char *o = argv[a];
        const char *v = (a + 1 < argc) ? argv[a + 1] : NULL;
#define NEEDV() do { if (!v) { usage(); MPI_Abort(MPI_COMM_WORLD, 2); } a++; } while (0)
        if (!strcmp(o, "-c") || !strcmp(o, "--coll")) {
            NEEDV();
            for (int k = 0; k < NCOLL; k++)
                if (!strcmp(v, COLL_NAMES[k])) coll = k;
            if (coll < 0) {
                if (rank == 0) { fprintf(stderr, "unknown collective '%s'\n", v); usage(); }
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        } else if (!strcmp(o, "-b") || !strcmp(o, "--minbytes")) { NEEDV(); minb = parse_size(v); }
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
        else if (!strcmp(o, "--selftest-corrupt")) corrupt = 1;
        else if (!strcmp(o, "--inplace")) out_of_place = 0;
        else if (!strcmp(o, "--out-of-place")) out_of_place = 1;
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
    if (coll < 0 || factor < 2 || minb < 4 || maxb < minb || iters < 1 || warmup < 0 ||
        maxb / sizeof(float) > (size_t)0x7fffffff) {
        if (rank == 0) { if (coll < 0) fprintf(stderr, "-c COLL is required\n"); usage(); }
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const enum coll c = (enum coll)coll;
    const int blocked = c == REDUCE_SCATTER || c == ALLGATHER || c == ALLTOALL;
    const double busf = c == ALLREDUCE ? 2.0 * (world - 1) / world
                        : blocked      ? (double)(world - 1) / world
                                       : 1.0;

    /* Both buffers hold a whole `size` (the send buffer of allgather needs
     * only 1/W of it); first-touch faults are taken here, not timed. */
    size_t maxcount = maxb / sizeof(float);
    float *sendbuf = NULL, *recvbuf = NULL;
    if (posix_memalign((void **)&recvbuf, 4096, maxcount * sizeof(float)) ||
        posix_memalign((void **)&sendbuf, 4096, maxcount * sizeof(float))) {
        fprintf(stderr, "rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 3);
    }
    memset(recvbuf, 0, maxcount * sizeof(float));
    memset(sendbuf, 0, maxcount * sizeof(float));

    FILE *out = NULL;
    if (rank == 0) {
        out = csv ? fopen(csv, "w") : stdout;
        if (!out) { perror(csv); MPI_Abort(MPI_COMM_WORLD, 4); }
        fprintf(out, "size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n");
        fflush(out);
        fprintf(stderr, "# mpi_collectives %s: W=%d iters=%d warmup=%d busbw factor %.3f\n",
                COLL_NAMES[c], world, iters, warmup, busf);
        fprintf(stderr, "#%12s %12s %12s %10s %10s %8s\n", "size", "count", "time_us", "algbw",
                "busbw", "wrong");
    }

    for (size_t size = minb; size <= maxb; size *= factor) {
        size_t total = size / sizeof(float);
        /* count: elements per call argument (per-rank block where blocked). */
        size_t count = blocked ? total / (size_t)world : total;
        size_t block = count; /* elements per rank block */
        if (count == 0) {
            if (rank == 0) fprintf(stderr, "# size %zu: fewer than W elements, skipped\n", size);
            if (size > maxb / factor) break;
            continue;
        }
        size_t bytes = (blocked ? count * (size_t)world : count) * sizeof(float);

        /* Data for the timed calls. */
        switch (c) {
        case ALLREDUCE: case REDUCE:
            memset(recvbuf, 0, count * sizeof(float));
            break;
        case REDUCE_SCATTER: case ALLTOALL:
            fill(sendbuf, block * (size_t)world, rank, 0);
            memset(recvbuf, 0, block * (size_t)world * sizeof(float));
            break;
        case ALLGATHER:
            fill(sendbuf, block, rank, (size_t)rank * block);
            memset(recvbuf, 0, block * (size_t)world * sizeof(float));
            break;
        case BROADCAST:
            /* Non-roots start with their own data: the check then sees whether
             * the root's arrived. */
            fill(recvbuf, count, rank, 0);
            break;
        }

        for (int i = 0; i < warmup; i++) once(c, sendbuf, recvbuf, (int)count, rank);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) once(c, sendbuf, recvbuf, (int)count, rank);
        double t1 = MPI_Wtime();
        double mean = (t1 - t0) / iters, maxmean = 0.0;
        MPI_Reduce(&mean, &maxmean, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);

        /* In-place reductions: fresh data, one more (untimed) call. */
        if (c == ALLREDUCE || c == REDUCE) {
            fill(c == ALLREDUCE && out_of_place ? sendbuf : recvbuf, count, rank, 0);
            once(c, sendbuf, recvbuf, (int)count, rank);
        }
        size_t nres = (c == REDUCE_SCATTER) ? block
                      : blocked            ? block * (size_t)world
                      : (c == REDUCE && rank != 0) ? 0
                                                   : count;
        if (corrupt && rank == 0 && nres > 0) recvbuf[nres / 2] += 1.0f; /* checker self-test */
        long long wrong = 0, totalwrong = 0;
        for (size_t j = 0; j < nres; j++) {
            float expect;
            switch (c) {
            case ALLREDUCE: case REDUCE: expect = sum_value(world, j); break;
            case REDUCE_SCATTER: expect = sum_value(world, (size_t)rank * block + j); break;
            case ALLGATHER: expect = gw_value(j / block, j); break;
            case BROADCAST: expect = gw_value(0, j); break;
            default: /* ALLTOALL: block q came from rank q's block `rank` */
                expect = gw_value(j / block, (size_t)rank * block + j % block);
                break;
            }
            if (recvbuf[j] != expect) wrong++;
        }
        MPI_Reduce(&wrong, &totalwrong, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);

        if (rank == 0) {
            double us = maxmean * 1e6;
            double algbw = (double)bytes / maxmean / 1e9;
            double busbw = algbw * busf;
            fprintf(out, "%zu,%zu,float32,sum,%.3f,%.4f,%.4f,%lld\n", bytes, count, us, algbw,
                    busbw, totalwrong);
            fflush(out);
            fprintf(stderr, " %12zu %12zu %12.2f %10.3f %10.3f %8lld\n", bytes, count, us, algbw,
                    busbw, totalwrong);
        }
        if (size > maxb / factor) break; /* avoid overflow */
    }
    if (out && out != stdout) fclose(out);
    free(sendbuf);
    free(recvbuf);
    MPI_Finalize();
    return 0;
}
