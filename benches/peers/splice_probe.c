// Does zero-copy sending help TCP on this host? Two processes stream S MiB buffers to each
// other over loopback at once (both directions, like a 2-rank ring), each with a sender
// and a receiver thread, sending either with write(2) (the kernel copies the buffer into
// socket memory) or with vmsplice(2) into a pipe and splice(2) to the socket (the socket
// references the buffer's pages: no send-side copy). Prints GB/s each way; alternate the
// two modes and compare ratios:
//   gcc -O2 -pthread benches/peers/splice_probe.c -o target/peers/splice_probe
//   for i in 1 2 3; do target/peers/splice_probe write; target/peers/splice_probe splice; done
// Measured here (6.18 guest kernel, 2 cores): write 0.98-1.20, splice 1.03-1.12 GB/s: the
// send copy disappears from `perf`, but pipe and page-pinning costs take its place, so
// gradwire's tcp transport keeps plain vectored writes.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static size_t buf_bytes = 16u << 20;
static int rounds = 64;
static int use_splice;

static void die(const char *what) {
    perror(what);
    exit(1);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

struct side {
    int fd;
    char *buf;
};

static void *send_all(void *p) {
    struct side *s = p;
    int pipefd[2];
    if (use_splice) {
        if (pipe(pipefd)) die("pipe");
        fcntl(pipefd[1], F_SETPIPE_SZ, 1 << 20);  // at most pipe-max-size; smaller is fine
    }
    for (int r = 0; r < rounds; r++) {
        for (size_t off = 0; off < buf_bytes;) {
            if (!use_splice) {
                ssize_t n = write(s->fd, s->buf + off, buf_bytes - off);
                if (n <= 0) die("write");
                off += n;
                continue;
            }
            size_t want = buf_bytes - off < (1u << 20) ? buf_bytes - off : (1u << 20);
            struct iovec iv = {s->buf + off, want};
            ssize_t n = vmsplice(pipefd[1], &iv, 1, 0);
            if (n <= 0) die("vmsplice");
            for (ssize_t left = n; left > 0;) {
                ssize_t m = splice(pipefd[0], NULL, s->fd, NULL, left, SPLICE_F_MOVE | SPLICE_F_MORE);
                if (m <= 0) die("splice");
                left -= m;
            }
            off += n;
        }
    }
    return NULL;
}

static void *recv_all(void *p) {
    struct side *s = p;
    for (int r = 0; r < rounds; r++) {
        for (size_t off = 0; off < buf_bytes;) {
            ssize_t n = read(s->fd, s->buf + off, buf_bytes - off);
            if (n <= 0) die("read");
            off += n;
        }
    }
    return NULL;
}

static void stream(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    struct side out = {fd, malloc(buf_bytes)}, in = {fd, malloc(buf_bytes)};
    if (!out.buf || !in.buf) die("malloc");
    memset(out.buf, 1, buf_bytes);
    memset(in.buf, 2, buf_bytes);
    pthread_t ts, tr;
    double t = now();
    pthread_create(&ts, NULL, send_all, &out);
    pthread_create(&tr, NULL, recv_all, &in);
    pthread_join(ts, NULL);
    pthread_join(tr, NULL);
    t = now() - t;
    printf("%s: %.2f GB/s each way (%zu MiB x %d)\n", use_splice ? "splice" : "write", (double)buf_bytes * rounds / t / 1e9, buf_bytes >> 20, rounds);
}

int main(int argc, char **argv) {
    if (argc < 2 || (strcmp(argv[1], "write") && strcmp(argv[1], "splice"))) {
        fprintf(stderr, "usage: %s write|splice [MiB per buffer (16)] [rounds (64)]\n", argv[0]);
        return 2;
    }
    use_splice = !strcmp(argv[1], "splice");
    if (argc > 2 && (buf_bytes = strtoul(argv[2], NULL, 10) << 20) == 0) return 2;
    if (argc > 3 && (rounds = atoi(argv[3])) <= 0) return 2;
    int listener = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = 0, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof addr;
    if (bind(listener, (void *)&addr, sizeof addr) || listen(listener, 1) || getsockname(listener, (void *)&addr, &len)) die("listen");
    pid_t child = fork();
    if (child < 0) die("fork");
    if (child == 0) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(fd, (void *)&addr, sizeof addr)) die("connect");
        stream(fd);
        return 0;
    }
    int fd = accept(listener, NULL, NULL);
    if (fd < 0) die("accept");
    stream(fd);
    int status;
    waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
