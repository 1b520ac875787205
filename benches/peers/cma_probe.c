// Would cross-memory attach help the one-host allreduce of private buffers? W processes
// (one per core, alternating) allreduce (float sum, in place) S MiB private buffers the way
// gradwire's zero-copy form does for gradwire_alloc buffers, but reaching the peers' memory
// with process_vm_readv / process_vm_writev (what Open MPI's vader calls CMA): rank r reads
// part r of every peer's buffer block by block into a scratch, reduces it into its own,
// and writes the block into every peer's buffer. Prints busbw; compare with
// `gradwire bench allreduce --transport shm` (staged form) in the same minute:
//   gcc -O3 -march=native benches/peers/cma_probe.c -o target/peers/cma_probe
//   target/peers/cma_probe 2 16 20 256   # W, MiB, iterations, block KiB
//   target/peers/cma_probe 2 16 20 256 copy
// With `copy`, the reduction is left out: only the kernel's copies of what a private-buffer
// allreduce must move between processes (each rank fetches its part of every peer's buffer
// and writes it back into every peer's), the ceiling of any allreduce that moves private
// buffers' bytes through cross-memory attach, as tcpring.c is for sockets.
// Measured here on an earlier host kernel (2 ranks, 16 and 64 MiB, alternating): 3.1-4.4
// GB/s with 64 KiB-4 MiB blocks against 6.4-7.0 for gradwire's staged form: the kernel
// pinned and walked the peer's pages for every call (follow_page_pte, __get_user_pages in
// `perf`). On kernel 6.18 (2026-11-22), 256 KiB blocks: 4 and 16 MiB 12.1-12.3 GB/s, 64
// MiB 6.9-7.0, 256 MiB 6.6-6.8, against 6.1-7.4, 5.7-5.9 and 5.4-5.6 staged; so gradwire
// now takes this form for private buffers wherever the kernel allows it (GRADWIRE_SHM_CMA).
#define _GNU_SOURCE
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct shared {
    _Atomic long phase[64];
    pid_t pid[64];
    float *addr[64];
};

static struct shared *sh;
static int world, me;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void barrier(long target) {
    sh->phase[me] = target;
    for (int p = 0; p < world; p++)
        while (sh->phase[p] < target) sched_yield();
}

static void cross(int write, int peer, float *local, float *remote, size_t len) {
    struct iovec l = {local, len}, r = {remote, len};
    ssize_t n = write ? process_vm_writev(sh->pid[peer], &l, 1, &r, 1, 0) : process_vm_readv(sh->pid[peer], &l, 1, &r, 1, 0);
    if (n != (ssize_t)len) {
        perror(write ? "process_vm_writev" : "process_vm_readv");
        exit(1);
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s W MiB iterations [block KiB (256) [copy]]\n", argv[0]);
        return 2;
    }
    world = atoi(argv[1]);
    size_t bytes = (size_t)atol(argv[2]) << 20, block = (argc > 4 ? (size_t)atol(argv[4]) : 256) << 10;
    int iters = atoi(argv[3]);
    int copy_only = argc > 5 && !strcmp(argv[5], "copy");
    if (world < 2 || world > 64 || bytes == 0 || block == 0 || iters <= 0 || (argc > 5 && !copy_only)) return 2;
    sh = mmap(NULL, sizeof *sh, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) return 1;
    for (me = 0; me < world - 1; me++)
        if (fork() == 0) break;
    cpu_set_t cpus;
    CPU_ZERO(&cpus);
    long ncpus = sysconf(_SC_NPROCESSORS_ONLN);
    CPU_SET(me % (ncpus > 0 ? ncpus : 1), &cpus);
    sched_setaffinity(0, sizeof cpus, &cpus);
    size_t n = bytes / 4, blk = block / 4;
    float *buf = malloc(bytes), *scratch = malloc(block * (world - 1));
    if (!buf || !scratch) return 1;
    for (size_t i = 0; i < n; i++) buf[i] = 1.0f;
    sh->pid[me] = getpid();
    sh->addr[me] = buf;
    long phase = 0;
    barrier(++phase);
    size_t lo = me * (n / world), hi = me == world - 1 ? n : lo + n / world;
    double started = 0;
    for (int it = -3; it < iters; it++) {  // 3 warm-up calls
        if (it == 0) started = now();
        barrier(++phase);  // every buffer ready
        for (size_t b = lo; b < hi; b += blk) {
            size_t e = b + blk < hi ? b + blk : hi, len = (e - b) * 4;
            for (int p = 0, k = 0; p < world; p++)
                if (p != me) cross(0, p, scratch + blk * k++, sh->addr[p] + b, len);
            for (int k = 0; k < world - 1 && !copy_only; k++)
                for (size_t i = 0; i < e - b; i++) buf[b + i] += scratch[blk * k + i];
            for (int p = 0; p < world; p++)
                if (p != me) cross(1, p, buf + b, sh->addr[p] + b, len);
        }
        barrier(++phase);  // every part written
    }
    double t = (now() - started) / iters;
    if (me == 0)
        printf("W=%d %zu MiB, %zu KiB blocks%s: busbw %.2f GB/s\n", world, bytes >> 20, block >> 10, copy_only ? ", copies only" : "",
               (double)bytes / t / 1e9 * 2 * (world - 1) / world);
    while (wait(NULL) > 0) {
    }
    return 0;
}
