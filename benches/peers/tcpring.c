// The socket ceiling of a ring allreduce over TCP: W processes in a ring, each streaming to
// the next and reading from the previous at once (one thread polling both sockets), with
// no reduction, no framing and no step-by-step synchronisation, timed as one stream and
// call by call, the faster kept. Per "call" of size S each link carries what a ring
// allreduce of S puts on it, 2(W-1) chunks of S/W, so its payload rate in GB/s is directly
// comparable with an allreduce's busbw (algbw * 2(W-1)/W). A ring allreduce over the same
// path should not beat it (beyond noise, or a tbf bucket that refills while an allreduce
// pauses between calls): it moves the same bytes and must also reduce them.
// benches/compare.sh runs it in its bound part, under `gradwire launch` (RANK, WORLD_SIZE,
// MASTER_PORT from its environment), and writes the same CSV as the allreduce benchmarks
// (time_us = the slowest rank's time per call, wrong = 0):
//   gcc -O2 benches/peers/tcpring.c -o target/peers/tcpring
//   gradwire launch -n 2 -- target/peers/tcpring -b 16M -e 256M -f 4 -n 20 -w 5
// --hosts A,B,... gives every rank's address in rank order (default: 127.0.0.1 for all);
// rank r listens on MASTER_PORT + 1 + r. --cold receives into an S-byte buffer, cycling
// through it, instead of a PIECE that stays in cache: what every collective must do with
// the bytes it receives (write them somewhere the size of the call), still without
// reducing them. Not the ceiling the goals are set against; it tells how much of a gap to
// it is the receive's own memory traffic (on 2 cores shared by 4 ranks, where copies are
// what bounds the rate).
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int rank, world, to_next, from_prev;
static size_t min_b = 16u << 20, max_b = 256u << 20, factor = 4;
static int iters = 20, warmup = 5; // warmup >= 1: it also lines the ranks up
static char *send_buf, *recv_buf;

static void die(const char *what) {
    fprintf(stderr, "tcpring rank %d: %s: %s\n", rank, what, strerror(errno));
    exit(1);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void usage_error(const char *what, const char *value) {
    fprintf(stderr, "tcpring: %s '%s'\n", what, value ? value : "");
    exit(2);
}

// A byte count: digits with an optional K, M or G suffix, 1 byte to 64 GiB.
static size_t parse_size(const char *s) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s || errno || *s == '-') usage_error("bad size", s);
    unsigned shift = 0;
    if (*end) {
        shift = *end == 'K' || *end == 'k' ? 10 : *end == 'M' || *end == 'm' ? 20 : *end == 'G' || *end == 'g' ? 30 : 99;
        if (shift == 99 || end[1]) usage_error("bad size (digits, then K, M or G)", s);
    }
    if (v < 1 || v > (64ull << 30) >> shift) usage_error("size out of range (1 byte to 64 GiB)", s);
    return (size_t)(v << shift);
}

// A whole number in [lo, hi].
static long parse_int(const char *what, const char *s, long lo, long hi) {
    char *end;
    errno = 0;
    long v = s ? strtol(s, &end, 10) : 0;
    if (!s || end == s || *end || errno || v < lo || v > hi) {
        fprintf(stderr, "tcpring: %s must be a whole number in [%ld, %ld], got '%s'\n", what, lo, hi, s ? s : "(unset)");
        exit(2);
    }
    return v;
}

static void write_all(int fd, const char *p, size_t n) {
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("write to next rank");
        p += k;
        n -= (size_t)k;
    }
}

static void read_all(int fd, char *p, size_t n) {
    while (n > 0) {
        ssize_t k = read(fd, p, n);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("read from previous rank");
        p += k;
        n -= (size_t)k;
    }
}

// One size's traffic, `calls` calls of it: per link 2(W-1) chunks of S/W per call. One
// thread, both sockets polled, non-blocking calls, at most PIECE bytes per system call,
// sending from the S-byte buffer and receiving into a PIECE-sized one that stays in cache
// (with --cold, into an S-byte one):
// the socket work of a ring allreduce and nothing else (an allreduce also writes the
// received bytes somewhere cold and reduces them). Like gradwire's progress loop it spins
// briefly before it sleeps when every rank has a core (`spin`).
#define PIECE (1u << 20)
static int spin, cold;
static void stream_calls(size_t size, int calls) {
    size_t total = (size_t)calls * 2 * (size_t)(world - 1) * (size / (size_t)world);
    size_t sent = 0, got = 0;
    while (sent < total || got < total) {
        // A finished direction leaves the poll set (its hang-up would wake it forever).
        struct pollfd fds[2] = {{.fd = sent < total ? to_next : -1, .events = POLLOUT}, {.fd = got < total ? from_prev : -1, .events = POLLIN}};
        int ready;
        double spin_until = now() + (spin ? 50e-6 : 0);
        while ((ready = poll(fds, 2, 0)) == 0 && now() < spin_until) {
        }
        if (ready == 0) ready = poll(fds, 2, 120000);
        if (ready < 0 && errno == EINTR) continue;
        if (ready < 0) die("poll");
        if (ready == 0) {
            fprintf(stderr, "tcpring rank %d: no progress in 120 s (a neighbour died or stalled)\n", rank);
            exit(1);
        }
        if (fds[0].revents & POLLERR) { errno = EPIPE; die("next rank's link"); }
        if (fds[0].revents & POLLOUT) {
            size_t at = sent % size, n = total - sent;
            if (n > PIECE) n = PIECE;
            if (n > size - at) n = size - at;
            ssize_t k = send(to_next, send_buf + at, n, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (k < 0 && errno != EAGAIN && errno != EINTR) die("write to next rank");
            if (k > 0) sent += (size_t)k;
        }
        if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            size_t n = total - got;
            if (n > PIECE) n = PIECE;
            size_t at = cold ? got % size : 0;
            if (n > size - at) n = size - at;
            ssize_t k = recv(from_prev, recv_buf + at, n, MSG_DONTWAIT);
            if (k == 0) { errno = ECONNRESET; die("read from previous rank"); }
            if (k < 0 && errno != EAGAIN && errno != EINTR) die("read from previous rank");
            if (k > 0) got += (size_t)k;
        }
    }
}

int main(int argc, char **argv) {
    const char *hosts = NULL, *csv = NULL;
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-b")) min_b = parse_size(v ? v : "");
        else if (!strcmp(a, "-e")) max_b = parse_size(v ? v : "");
        else if (!strcmp(a, "-f")) factor = (size_t)parse_int("-f", v, 2, 1024);
        else if (!strcmp(a, "-n")) iters = (int)parse_int("-n", v, 1, 1000000);
        else if (!strcmp(a, "-w")) warmup = (int)parse_int("-w", v, 1, 1000000);
        else if (!strcmp(a, "--hosts") && v) hosts = v;
        else if (!strcmp(a, "--csv") && v) csv = v;
        else if (!strcmp(a, "--cold")) cold = 1, i--;
        else usage_error("unknown argument or missing value (-b -e -f -n -w --hosts --csv --cold)", a);
    }
    world = (int)parse_int("WORLD_SIZE (from a launcher)", getenv("WORLD_SIZE"), 2, 4096);
    rank = (int)parse_int("RANK (from a launcher)", getenv("RANK"), 0, world - 1);
    int port0 = (int)parse_int("MASTER_PORT", getenv("MASTER_PORT") ? getenv("MASTER_PORT") : "29500", 1, 65534 - world) + 1;
    if (min_b > max_b || min_b < (size_t)world) {
        fprintf(stderr, "tcpring: needs W <= -b <= -e (got -b %zu, -e %zu, W %d)\n", min_b, max_b, world);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    spin = cores > 0 && world <= cores;

    // Where the next rank listens: --hosts gives all W addresses, default loopback.
    char next_host[64] = "127.0.0.1";
    if (hosts) {
        int named = 1;
        for (const char *c = hosts; *c; c++) named += *c == ',';
        if (named != world) { fprintf(stderr, "tcpring: --hosts names %d addresses for %d ranks\n", named, world); return 2; }
        const char *h = hosts;
        for (int r = 0; r < (rank + 1) % world; r++) h = strchr(h, ',') + 1;
        size_t n = strcspn(h, ",");
        if (n >= sizeof next_host) usage_error("address too long", h);
        memcpy(next_host, h, n);
        next_host[n] = 0;
    }

    // Rank r listens, connects to r+1 and accepts r-1. At W = 2 the two ranks share one
    // connection both ways, as gradwire's, Open MPI's and Gloo's links do (acknowledgements
    // ride on the data going back): rank 0 connects, rank 1 accepts.
    int connects = world > 2 || rank == 0, accepts = world > 2 || rank == 1;
    int listener = -1, one = 1;
    struct timeval limit = {.tv_sec = 120};
    if (accepts) {
        listener = socket(AF_INET, SOCK_STREAM, 0);
        if (listener < 0) die("socket");
        setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(port0 + rank), .sin_addr.s_addr = htonl(INADDR_ANY)};
        if (bind(listener, (struct sockaddr *)&me, sizeof me) || listen(listener, 1)) die("listen");
        // A deadline on the accept (and below on every read and write): a dead neighbour
        // ends the probe.
        setsockopt(listener, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
    }
    if (connects) {
        struct sockaddr_in next = {.sin_family = AF_INET, .sin_port = htons(port0 + (rank + 1) % world)};
        if (inet_pton(AF_INET, next_host, &next.sin_addr) != 1) usage_error("bad address", next_host);
        double give_up = now() + 30;
        for (;;) {
            to_next = socket(AF_INET, SOCK_STREAM, 0);
            if (to_next < 0) die("socket");
            if (!connect(to_next, (struct sockaddr *)&next, sizeof next)) break;
            close(to_next);
            if (now() > give_up) die("connect to next rank (30 s)");
            usleep(20000);
        }
    }
    if (accepts) {
        from_prev = accept(listener, NULL, NULL);
        if (from_prev < 0) die("accept from previous rank");
        close(listener);
    }
    if (!connects) to_next = from_prev;
    if (!accepts) from_prev = to_next;
    setsockopt(to_next, SOL_SOCKET, SO_SNDTIMEO, &limit, sizeof limit);
    setsockopt(from_prev, SOL_SOCKET, SO_RCVTIMEO, &limit, sizeof limit);
    setsockopt(to_next, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

    send_buf = mmap(NULL, max_b, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    size_t recv_len = cold ? max_b : PIECE;
    recv_buf = mmap(NULL, recv_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (send_buf == MAP_FAILED || recv_buf == MAP_FAILED) die("mmap");
    memset(send_buf, rank + 1, max_b);
    memset(recv_buf, 0, recv_len);

    FILE *out = NULL;
    if (rank == 0 && csv && !(out = fopen(csv, "w"))) die(csv);
    if (out) fprintf(out, "size_bytes,count,type,redop,time_us,algbw_gbs,busbw_gbs,wrong\n");
    if (rank == 0)
        printf("# tcpring W=%d: ring streams, no reduction (per call: 2(W-1) chunks of S/W per link), received into %s\n%12s %12s %12s\n", world,
               cold ? "an S-byte buffer (--cold)" : "a 1 MiB buffer", "size", "time_us", "busbw_GB/s");

    // A fresh connection starts slow (congestion window, socket buffer autotuning): one
    // untimed call of the largest size first, so the smallest size is not the warm-up.
    stream_calls(max_b, 1);
    for (size_t s = min_b; s <= max_b; s *= factor) {
        // Two ways to move the calls, the faster kept: as one stream (a call's sends may run
        // ahead into the next call) and call by call, as allreduce calls do (a rank starts
        // a call's sends once it has received all of the last one). The stream keeps the
        // link busiest; call by call keeps less data in flight, so more of it is still in
        // cache when it is read (2 ranks on loopback, 1-16 MiB).
        double best = 0;
        int best_mode = 0;
        for (int mode = 0; mode < 2; mode++) {
            int warm = mode == 0 ? warmup : 1, timed = mode == 0 ? iters : 1; // calls per stream
            for (int c = 0; c < warmup; c += warm) stream_calls(s, warm);
            double t0 = now();
            for (int c = 0; c < iters; c += timed) stream_calls(s, timed);
            double slowest = (now() - t0) / iters;
            // The slowest rank's time per call: a max passed once around the ring, after the
            // data (each link's byte stream is ordered). Rank 0 starts it and reads the result.
            if (rank == 0) {
                write_all(to_next, (char *)&slowest, sizeof slowest);
                read_all(from_prev, (char *)&slowest, sizeof slowest);
            } else {
                double seen;
                read_all(from_prev, (char *)&seen, sizeof seen);
                if (seen > slowest) slowest = seen;
                write_all(to_next, (char *)&slowest, sizeof slowest);
            }
            if (mode == 0 || slowest < best) best = slowest, best_mode = mode;
        }
        double link_bytes = 2.0 * (world - 1) * (double)(s / (size_t)world); // what moved
        double busbw = link_bytes / best / 1e9, algbw = (double)s / best / 1e9;
        if (rank == 0) {
            printf("%12zu %12.1f %12.3f  (%s)\n", s, best * 1e6, busbw, best_mode ? "call by call" : "one stream");
            if (out) fprintf(out, "%zu,%zu,float32,sum,%.3f,%.4f,%.4f,0\n", s, s / 4, best * 1e6, algbw, busbw);
        }
    }
    if (out) fclose(out);
    return 0;
}
