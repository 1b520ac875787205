/*
 * Communicator lifecycles through the C ABI, for tests/lifecycle.rs:
 *   lifecycle exit   gradwire_init, then gradwire_finalize and exit at once: init must be
 *                    complete on every rank when it returns.
 *   lifecycle two    a second communicator while the first is alive: both work, each on
 *                    its own data (no cross-talk).
 * Prints "rank R: ok" on success; any failure prints gradwire's error and exits 1.
 */
#include "gradwire.h"
#include <stdio.h>
#include <string.h>

static int fail(const char *what) {
    fprintf(stderr, "lifecycle: %s: %s\n", what, gradwire_last_error());
    return 1;
}

/* Allreduces `base * (rank + 1)` over `comm` and checks the sum. */
static int sum_check(gradwire_comm_t *comm, float base, const char *name) {
    int rank = 0, size = 0;
    if (gradwire_comm_rank(comm, &rank) || gradwire_comm_size(comm, &size)) return fail("rank/size");
    float v[4];
    for (int i = 0; i < 4; i++) v[i] = base * (float)(rank + 1);
    if (gradwire_allreduce(comm, v, v, 4, GRADWIRE_FLOAT32, GRADWIRE_SUM)) return fail(name);
    float want = base * (float)(size * (size + 1) / 2);
    for (int i = 0; i < 4; i++) {
        if (v[i] != want) {
            fprintf(stderr, "rank %d: %s: got %g, want %g\n", rank, name, v[i], want);
            return 1;
        }
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "exit";
    gradwire_comm_t *first = NULL, *second = NULL;
    if (gradwire_init(&first)) return fail("first gradwire_init");
    int rank = 0;
    gradwire_comm_rank(first, &rank);
    if (strcmp(mode, "two") == 0) {
        if (gradwire_init(&second)) return fail("second gradwire_init");
        if (sum_check(second, 1.0f, "allreduce on the second communicator")) return 1;
        if (sum_check(first, 100.0f, "allreduce on the first communicator")) return 1;
        if (gradwire_finalize(second)) return fail("finalize second");
    }
    if (gradwire_finalize(first)) return fail("finalize first");
    printf("rank %d: ok\n", rank);
    return 0;
}
