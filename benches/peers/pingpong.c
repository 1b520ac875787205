/*
 * pingpong.c -- this machine's loopback TCP round-trip time with *blocking*
 * reads (each hop wakes a sleeping process), printed beside the tables in
 * docs/benchmarks.md: it is the latency floor of any transport that sleeps in the
 * kernel while waiting (Gloo does), as opposed to one that busy-polls.
 *
 * Output: one CSV line (with -H, a header line first):  rtt_us_mean,rtt_us_min
 * Usage: pingpong [-H] [ROUNDS]
 */
#define _DEFAULT_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void nodelay(int fd) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static int xfer(int fd, char *b, int send_first) {
    if (send_first) {
        if (write(fd, b, 8) != 8 || read(fd, b, 8) != 8) return -1;
    } else {
        if (read(fd, b, 8) != 8 || write(fd, b, 8) != 8) return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    int header = 0, argi = 1;
    if (argi < argc && !strcmp(argv[argi], "-H")) { header = 1; argi++; }
    int rounds = argi < argc ? atoi(argv[argi]) : 5000;
    if (rounds < 1) return 2;
    const int warm = 200;

    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t al = sizeof a;
    if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1) ||
        getsockname(ls, (struct sockaddr *)&a, &al)) {
        perror("pingpong: listen");
        return 1;
    }
    pid_t pid = fork();
    if (pid == 0) {
        int c = socket(AF_INET, SOCK_STREAM, 0);
        if (connect(c, (struct sockaddr *)&a, sizeof a)) _exit(1);
        nodelay(c);
        char b[8];
        for (int i = 0; i < warm + rounds; i++)
            if (xfer(c, b, 0)) _exit(1);
        _exit(0);
    }
    int s = accept(ls, NULL, NULL);
    if (s < 0) { perror("pingpong: accept"); return 1; }
    nodelay(s);
    char b[8] = "pingpong";
    double best = 1e30, t0 = 0;
    for (int i = 0; i < warm + rounds; i++) {
        if (i == warm) t0 = now();
        double u = now();
        if (xfer(s, b, 1)) { fprintf(stderr, "pingpong: short read\n"); return 1; }
        double d = now() - u;
        if (i >= warm && d < best) best = d;
    }
    double mean = (now() - t0) / rounds;
    int st;
    waitpid(pid, &st, 0);
    if (header) printf("rtt_us_mean,rtt_us_min\n");
    printf("%.1f,%.1f\n", mean * 1e6, best * 1e6);
    return 0;
}
