/*
 * A program that already runs on MPI makes its gradwire communicator from a unique id it
 * broadcasts itself, as NCCL programs do (ncclGetUniqueId, MPI_Bcast, ncclCommInitRank):
 * no gradwire variable, under any MPI launcher.
 *
 *   mpirun -n W mpi_unique_id
 *
 * Rank 0 makes the id; MPI_Bcast carries its bytes; every rank joins with its MPI rank.
 * Then a float64 allreduce of fresh random data, checked against MPI_Allreduce of the same
 * data (an independent reference), and a broadcast from the last rank. Prints
 * "rank R of W: ok" per rank; exits non-zero if a check fails.
 */
#include "gradwire.h"
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define COUNT 100000

static int fail(int rank, const char *what) {
    fprintf(stderr, "rank %d: %s: %s\n", rank, what, gradwire_last_error());
    return 1;
}

static int run(int rank, int world) {
    gradwire_unique_id_t id;
    if (rank == 0 && gradwire_get_unique_id(&id)) return fail(rank, "gradwire_get_unique_id");
    MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    gradwire_comm_t *comm;
    if (gradwire_comm_init_rank(&comm, &id, world, rank)) return fail(rank, "gradwire_comm_init_rank");

    double *mine = malloc(COUNT * sizeof *mine), *ours = malloc(COUNT * sizeof *ours), *want = malloc(COUNT * sizeof *want);
    if (!mine || !ours || !want) return fail(rank, "malloc");
    srand((unsigned)time(NULL) * 7919u + (unsigned)rank);
    for (int i = 0; i < COUNT; i++) mine[i] = (double)rand() / RAND_MAX - 0.5;
    MPI_Allreduce(mine, want, COUNT, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    if (gradwire_allreduce(comm, mine, ours, COUNT, GRADWIRE_FLOAT64, GRADWIRE_SUM)) return fail(rank, "gradwire_allreduce");
    for (int i = 0; i < COUNT; i++) {
        /* Summation orders differ: a bound of the rounding of W terms of magnitude 1/2. */
        if (fabs(ours[i] - want[i]) > 1e-12 * world) {
            fprintf(stderr, "rank %d: element %d: gradwire %.17g, MPI %.17g\n", rank, i, ours[i], want[i]);
            return 1;
        }
    }
    int token = rank == world - 1 ? 4242 : -1;
    if (gradwire_broadcast(comm, &token, 1, GRADWIRE_INT32, world - 1)) return fail(rank, "gradwire_broadcast");
    if (token != 4242) {
        fprintf(stderr, "rank %d: broadcast gave %d\n", rank, token);
        return 1;
    }
    free(mine);
    free(ours);
    free(want);
    if (gradwire_finalize(comm)) return fail(rank, "gradwire_finalize");
    printf("rank %d of %d: ok\n", rank, world);
    return 0;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    int failed = run(rank, world);
    int any = 0;
    MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Finalize();
    return any;
}
