/*
 * Collectives on CUDA device memory through the C ABI: a GPU communicator on device
 * LOCAL_RANK (modulo the devices there are), an allreduce, a broadcast, a reduce, a
 * reduce-scatter, an allgather and an all-to-all on a stream of our own, each checked against what is
 * computed here, and
 * the wrong kind of memory refused at both kinds of entry point. The CUDA driver is
 * opened at run time, so this builds without the CUDA toolkit; on a machine without a GPU
 * it prints gradwire's reason and exits 0 ("SKIP"). Run under the launcher:
 *
 *   cc -std=c99 -Wall -Wextra -Werror -I ffi ffi/examples/gpu.c -ldl \
 *      -L target/release -lgradwire -Wl,-rpath,$PWD/target/release -o target/gpu-example
 *   target/release/gradwire launch -n 1 -- target/gpu-example
 *   GRADWIRE_HOST_ID=... per rank: several "nodes" sharing one GPU (hierarchical path)
 */
#define _POSIX_C_SOURCE 200809L
#include "gradwire.h"

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(call)                                                                      \
    do {                                                                                 \
        int rc_ = (call);                                                                \
        if (rc_ != GRADWIRE_OK) {                                                        \
            fprintf(stderr, "%s failed (%d): %s\n", #call, rc_, gradwire_last_error()); \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* The few CUDA driver calls used, by their documented C signatures. */
typedef int (*cu_init_t)(unsigned);
typedef int (*cu_device_get_t)(int *, int);
typedef int (*cu_device_get_count_t)(int *);
typedef int (*cu_ctx_retain_t)(void **, int);
typedef int (*cu_ctx_set_t)(void *);
typedef int (*cu_mem_alloc_t)(uint64_t *, size_t);
typedef int (*cu_mem_free_t)(uint64_t);
typedef int (*cu_htod_t)(uint64_t, const void *, size_t);
typedef int (*cu_dtoh_t)(void *, uint64_t, size_t);
typedef int (*cu_stream_create_t)(void **, unsigned);
typedef int (*cu_stream_sync_t)(void *);
static struct {
    cu_init_t init;
    cu_device_get_t device_get;
    cu_device_get_count_t device_count;
    cu_ctx_retain_t ctx_retain;
    cu_ctx_set_t ctx_set;
    cu_mem_alloc_t alloc;
    cu_mem_free_t free;
    cu_htod_t htod;
    cu_dtoh_t dtoh;
    cu_stream_create_t stream_create;
    cu_stream_sync_t stream_sync;
} cu;

#define CU(call)                                                    \
    do {                                                            \
        int rc_ = (call);                                           \
        if (rc_ != 0) {                                             \
            fprintf(stderr, "%s failed: CUDA error %d\n", #call, rc_); \
            exit(1);                                                \
        }                                                           \
    } while (0)

static void *sym(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "libcuda has no %s\n", name);
        exit(1);
    }
    return f;
}

static void load_cuda(void *lib) {
    *(void **)&cu.init = sym(lib, "cuInit");
    *(void **)&cu.device_get = sym(lib, "cuDeviceGet");
    *(void **)&cu.device_count = sym(lib, "cuDeviceGetCount");
    *(void **)&cu.ctx_retain = sym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&cu.ctx_set = sym(lib, "cuCtxSetCurrent");
    *(void **)&cu.alloc = sym(lib, "cuMemAlloc_v2");
    *(void **)&cu.free = sym(lib, "cuMemFree_v2");
    *(void **)&cu.htod = sym(lib, "cuMemcpyHtoD_v2");
    *(void **)&cu.dtoh = sym(lib, "cuMemcpyDtoH_v2");
    *(void **)&cu.stream_create = sym(lib, "cuStreamCreate");
    *(void **)&cu.stream_sync = sym(lib, "cuStreamSynchronize");
}

/* Small integers, so float sums are exact. */
static float input(int rank, size_t i) {
    return (float)((int)((rank * 7919u + i * 104729u) % 2001u) - 1000);
}

static uint64_t device_copy(const float *host, size_t n) {
    uint64_t d = 0;
    CU(cu.alloc(&d, n * sizeof(float) + 4));
    if (host) CU(cu.htod(d, host, n * sizeof(float)));
    return d;
}

int main(void) {
    gradwire_comm_t *comm = NULL;
    CHECK(gradwire_init(&comm));
    int rank = -1, size = 0;
    CHECK(gradwire_comm_rank(comm, &rank));
    CHECK(gradwire_comm_size(comm, &size));

    /* Every rank asks, so all take the same branch: without a GPU gradwire says why. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int devices = 0;
    if (lib) {
        load_cuda(lib);
        if (cu.init(0) != 0 || cu.device_count(&devices) != 0) devices = 0;
    }
    const char *local = getenv("LOCAL_RANK");
    int device = devices > 0 ? (local ? atoi(local) : 0) % devices : 0;
    gradwire_gpu_comm_t *gpu = NULL;
    int rc = gradwire_gpu_comm_create(comm, device, &gpu);
    if (rc == GRADWIRE_ERR_UNSUPPORTED) {
        printf("rank %d: SKIP: no GPU here: %s\n", rank, gradwire_last_error());
        CHECK(gradwire_finalize(comm));
        return 0;
    }
    CHECK(rc);

    void *ctx = NULL, *stream = NULL;
    int dev = 0;
    CU(cu.device_get(&dev, device));
    CU(cu.ctx_retain(&ctx, dev));
    CU(cu.ctx_set(ctx));
    /* Flags 0: the stream waits for the legacy default stream, where the synchronous
     * copies below run (a copy from pageable memory may return before its DMA lands). */
    CU(cu.stream_create(&stream, 0));

    const size_t n = 1 << 20, m = 4099;
    float *host = malloc(n * size * sizeof(float)), *got = malloc(n * size * sizeof(float));
    long wrong = 0;

    /* Allreduce in place. */
    for (size_t i = 0; i < n; i++) host[i] = input(rank, i);
    uint64_t buf = device_copy(host, n);
    CHECK(gradwire_gpu_allreduce(gpu, (void *)buf, (void *)buf, n, GRADWIRE_FLOAT32, GRADWIRE_SUM, stream));
    CU(cu.stream_sync(stream));
    CU(cu.dtoh(got, buf, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < size; r++) want += input(r, i);
        wrong += got[i] != want;
    }

    /* Broadcast from the last rank. */
    for (size_t i = 0; i < n; i++) host[i] = input(rank, i);
    CU(cu.htod(buf, host, n * sizeof(float)));
    CHECK(gradwire_gpu_broadcast(gpu, (void *)buf, n, GRADWIRE_FLOAT32, size - 1, stream));
    CU(cu.stream_sync(stream));
    CU(cu.dtoh(got, buf, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) wrong += got[i] != input(size - 1, i);

    /* Reduce to rank 0, in place: its buffer gets the sum, the others' stay as they were. */
    for (size_t i = 0; i < n; i++) host[i] = input(rank, i);
    CU(cu.htod(buf, host, n * sizeof(float)));
    CHECK(gradwire_gpu_reduce(gpu, (void *)buf, (void *)buf, n, GRADWIRE_FLOAT32, GRADWIRE_SUM, 0, stream));
    CU(cu.stream_sync(stream));
    CU(cu.dtoh(got, buf, n * sizeof(float)));
    for (size_t i = 0; i < n; i++) {
        float want = 0;
        for (int r = 0; r < size; r++) want += input(r, i);
        wrong += got[i] != (rank == 0 ? want : input(rank, i));
    }

    /* Reduce-scatter, then allgather of its result: every rank ends with the whole sum. */
    for (size_t i = 0; i < m * size; i++) host[i] = input(rank, i);
    uint64_t whole = device_copy(host, m * size), part = device_copy(NULL, m);
    CHECK(gradwire_gpu_reduce_scatter(gpu, (void *)whole, (void *)part, m, GRADWIRE_FLOAT32, GRADWIRE_SUM, stream));
    CHECK(gradwire_gpu_allgather(gpu, (void *)part, (void *)whole, m, GRADWIRE_FLOAT32, stream));
    CU(cu.stream_sync(stream));
    CU(cu.dtoh(got, whole, m * size * sizeof(float)));
    for (size_t i = 0; i < m * size; i++) {
        float want = 0;
        for (int r = 0; r < size; r++) want += input(r, i);
        wrong += got[i] != want;
    }

    /* All-to-all: block b of `whole` goes to rank b; block b of `spread` comes from rank
     * b (its block for this rank). */
    for (size_t i = 0; i < m * size; i++) host[i] = input(rank, i);
    CU(cu.htod(whole, host, m * size * sizeof(float)));
    uint64_t spread = device_copy(NULL, m * size);
    CHECK(gradwire_gpu_alltoall(gpu, (void *)whole, NULL, (void *)spread, NULL, m, GRADWIRE_FLOAT32, stream));
    CU(cu.stream_sync(stream));
    CU(cu.dtoh(got, spread, m * size * sizeof(float)));
    for (size_t i = 0; i < m * size; i++) wrong += got[i] != input((int)(i / m), rank * m + i % m);

    /* The wrong kind of memory, both ways: clear errors, nothing touched. */
    int host_to_gpu = gradwire_gpu_allreduce(gpu, host, host, 16, GRADWIRE_FLOAT32, GRADWIRE_SUM, stream);
    int refused = host_to_gpu == GRADWIRE_ERR_INVALID_ARGUMENT && strstr(gradwire_last_error(), "host memory") != NULL;
    int gpu_to_host = gradwire_allreduce(comm, (void *)buf, (void *)buf, 16, GRADWIRE_FLOAT32, GRADWIRE_SUM);
    refused += gpu_to_host == GRADWIRE_ERR_INVALID_ARGUMENT && strstr(gradwire_last_error(), "CUDA device") != NULL;
    if (refused != 2) {
        printf("rank %d: wrong memory kinds not refused (%d, %d): %s\n", rank, host_to_gpu, gpu_to_host, gradwire_last_error());
        wrong++;
    }

    printf("rank %d: gpu example on device %d: %ld wrong elements\n", rank, device, wrong);
    CU(cu.free(buf));
    CU(cu.free(whole));
    CU(cu.free(part));
    CU(cu.free(spread));
    free(host);
    free(got);
    CHECK(gradwire_gpu_comm_free(gpu));
    CHECK(gradwire_finalize(comm));
    return wrong != 0;
}
