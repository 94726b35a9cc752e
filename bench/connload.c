// connload: one new TCP connection per request, as fast as C can, for the latency part (bench/latency.py).
//
//   connload serve PORT
//       An epoll HTTP/1.0-ish server on 0.0.0.0:PORT: answers the first bytes of every connection with a fixed
//       38-byte response and closes (so the server side holds TIME_WAIT and the client's ports are free at
//       once). Prints "ready" when it listens; runs until killed.
//   connload load TARGETS THREADS SECONDS WARMUP RATE [SOURCE/COUNT FIRST]
//       TARGETS: ip:port[,ip:port...]; THREADS client threads, each one blocking connection at a time:
//       socket, connect, send a request, read the reply to EOF, close; the time of that whole sequence is the
//       request's latency. RATE 0: closed loop (every thread starts its next request at once: the rate the
//       path sustains at that concurrency). RATE > 0: paced, RATE requests/s in all, spread evenly over the
//       threads (a thread that falls behind skips the slots it missed and counts them as late). Requests
//       started in the WARMUP seconds are not recorded; then SECONDS are measured. Each thread walks the
//       targets round-robin. With SOURCE/COUNT FIRST, connection k (counted over all threads, from FIRST)
//       is bound to source address SOURCE + k % COUNT and port 1024 + (k / COUNT) % 64000, so no
//       source address and port comes back before COUNT x 64,000 connections (the caller carries FIRST
//       over from run to run). Behind a NAT, a source port the kernel reuses for another ClusterIP can
//       meet the server's TIME_WAIT (or the NAT's conntrack entry) of an earlier connection to the same
//       backend, and its SYN is then answered wrongly or dropped and resent a second later: that would
//       measure the generator, not the dataplane. The JSON's "tuples_used" is how far k went. Prints "window-start" and "window-end" as the measured window opens and
//       closes (so a caller can read other processes' CPU time over the same window), then one JSON object:
//       counts, rate, latency percentiles (us), and the process's own CPU time over the window
//       (CLOCK_PROCESS_CPUTIME_ID, ns-exact; user/system split from getrusage).
//
// Built by `make bench-tools` (bench/build/connload).

#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static const char REQUEST[] = "GET / HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n";
static const char RESPONSE[] = "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok";

static void die(const char *what) {
    perror(what);
    exit(2);
}

static uint64_t now_ns(clockid_t clock) {
    struct timespec ts;
    clock_gettime(clock, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

// ------------------------------------------------------------------------------------------------ server

static int serve(int port) {
    int lfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    if (lfd < 0) die("socket");
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    if (bind(lfd, (struct sockaddr *)&a, sizeof a) < 0) die("bind");
    if (listen(lfd, 4096) < 0) die("listen");
    int ep = epoll_create1(0);
    if (ep < 0) die("epoll_create1");
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd};
    if (epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev) < 0) die("epoll_ctl");
    printf("ready\n");
    fflush(stdout);
    struct epoll_event events[256];
    char buf[4096];
    for (;;) {
        int n = epoll_wait(ep, events, 256, -1);
        if (n < 0) {
            if (errno == EINTR) continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            int fd = events[i].data.fd;
            if (fd == lfd) {
                for (;;) {
                    int c = accept4(lfd, NULL, NULL, SOCK_NONBLOCK);
                    if (c < 0) break;  // EAGAIN: all accepted; anything else: the client's problem
                    // The request is usually there already (the client sends right after connect).
                    ssize_t r = read(c, buf, sizeof buf);
                    if (r > 0) {
                        (void)!write(c, RESPONSE, sizeof RESPONSE - 1);
                        close(c);
                    } else if (r < 0 && errno == EAGAIN) {
                        struct epoll_event cev = {.events = EPOLLIN | EPOLLRDHUP, .data.fd = c};
                        if (epoll_ctl(ep, EPOLL_CTL_ADD, c, &cev) < 0) close(c);
                    } else {
                        close(c);
                    }
                }
            } else {
                ssize_t r = read(fd, buf, sizeof buf);
                if (r > 0) (void)!write(fd, RESPONSE, sizeof RESPONSE - 1);
                if (r > 0 || r == 0 || errno != EAGAIN) close(fd);  // close also leaves the epoll set
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------ client

struct target {
    struct sockaddr_in addr;
};

struct worker {
    pthread_t thread;
    int index;
    uint32_t *lat_ns;  // one entry per recorded request (capped at ~4.29 s)
    size_t count, cap;
    uint64_t errors, late;
    uint64_t err_connect, err_io, err_short;
};

static struct target *targets;
static int ntargets, nthreads;
static uint32_t source_first;  // host order; nsources 0: no bind
static int nsources;
static atomic_uint_fast64_t tuple_next;  // the next connection's k
static uint64_t tuple_first;
static double rate;
static atomic_int phase;  // 0 warm-up, 1 measuring, 2 stop
static uint64_t window_start, window_end;

static int one_request(const struct target *t, struct worker *w) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) {
        w->err_connect++;
        return -1;
    }
    if (nsources) {
        uint64_t k = atomic_fetch_add(&tuple_next, 1);
        struct sockaddr_in src = {.sin_family = AF_INET,
                                  .sin_addr.s_addr = htonl(source_first + (uint32_t)(k % (uint64_t)nsources)),
                                  .sin_port = htons((uint16_t)(1024 + (k / (uint64_t)nsources) % 64000))};
        if (bind(fd, (struct sockaddr *)&src, sizeof src) < 0) {
            w->err_connect++;
            close(fd);
            return -1;
        }
    }
    struct timeval tv = {.tv_sec = 2};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);  // also bounds connect()
    if (connect(fd, (const struct sockaddr *)&t->addr, sizeof t->addr) < 0) {
        w->err_connect++;
        close(fd);
        return -1;
    }
    if (send(fd, REQUEST, sizeof REQUEST - 1, MSG_NOSIGNAL) != (ssize_t)(sizeof REQUEST - 1)) {
        w->err_io++;
        close(fd);
        return -1;
    }
    char buf[256];
    size_t got = 0;
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r == 0) break;
        if (r < 0) {
            if (errno == EINTR) continue;
            w->err_io++;
            close(fd);
            return -1;
        }
        got += (size_t)r;
    }
    close(fd);
    if (got != sizeof RESPONSE - 1) {
        w->err_short++;
        return -1;
    }
    return 0;
}

static void record(struct worker *w, uint64_t ns) {
    if (w->count == w->cap) {
        w->cap = w->cap ? w->cap * 2 : 65536;
        w->lat_ns = realloc(w->lat_ns, w->cap * sizeof *w->lat_ns);
        if (!w->lat_ns) die("realloc");
    }
    w->lat_ns[w->count++] = ns > UINT32_MAX ? UINT32_MAX : (uint32_t)ns;
}

static void *worker_main(void *arg) {
    struct worker *w = arg;
    int next_target = w->index % ntargets;
    uint64_t period = rate > 0 ? (uint64_t)(1e9 * nthreads / rate) : 0;
    uint64_t slot = now_ns(CLOCK_MONOTONIC) + (rate > 0 ? (uint64_t)(1e9 * w->index / rate) : 0);
    while (atomic_load(&phase) != 2) {
        if (period) {
            uint64_t now = now_ns(CLOCK_MONOTONIC);
            if (now < slot) {
                struct timespec ts = {.tv_sec = (time_t)(slot / 1000000000ull), .tv_nsec = (long)(slot % 1000000000ull)};
                while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL) == EINTR) {
                }
            } else if (now > slot + period) {  // behind: skip the missed slots
                uint64_t missed = (now - slot) / period;
                if (atomic_load(&phase) == 1) w->late += missed;
                slot += missed * period;
            }
            slot += period;
        }
        int measuring = atomic_load(&phase) == 1;
        uint64_t t0 = now_ns(CLOCK_MONOTONIC);
        int rc = one_request(&targets[next_target], w);
        uint64_t t1 = now_ns(CLOCK_MONOTONIC);
        next_target = (next_target + 1) % ntargets;
        if (!measuring || t0 >= window_end) continue;
        if (rc == 0)
            record(w, t1 - t0);
        else
            w->errors++;
    }
    return NULL;
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

static double pct_us(const uint32_t *v, size_t n, double q) {
    if (n == 0) return 0;
    size_t i = (size_t)(q * (double)(n - 1) + 0.5);
    return v[i] / 1000.0;
}

static int parse_targets(char *spec) {
    int cap = 1;
    for (char *p = spec; *p; p++) cap += *p == ',';
    targets = calloc((size_t)cap, sizeof *targets);
    for (char *tok = strtok(spec, ","); tok; tok = strtok(NULL, ",")) {
        char *colon = strrchr(tok, ':');
        if (!colon) return -1;
        *colon = 0;
        struct sockaddr_in *a = &targets[ntargets].addr;
        a->sin_family = AF_INET;
        a->sin_port = htons((uint16_t)atoi(colon + 1));
        if (inet_pton(AF_INET, tok, &a->sin_addr) != 1) return -1;
        ntargets++;
    }
    return ntargets ? 0 : -1;
}

static double tv_s(struct timeval tv) { return (double)tv.tv_sec + tv.tv_usec / 1e6; }

static int parse_sources(const char *spec, const char *first) {
    char ip[64];
    int count;
    struct in_addr a;
    if (sscanf(spec, "%63[0-9.]/%d", ip, &count) != 2 || count < 1 || inet_pton(AF_INET, ip, &a) != 1) return -1;
    source_first = ntohl(a.s_addr);
    nsources = count;
    tuple_first = strtoull(first, NULL, 10);
    atomic_store(&tuple_next, tuple_first);
    return 0;
}

static int load(char *spec, int threads, double seconds, double warmup, double r, const char *sources,
                const char *first) {
    if (parse_targets(spec) < 0 || threads < 1 || seconds <= 0 || (sources && parse_sources(sources, first) < 0)) {
        fprintf(stderr, "connload load: bad arguments\n");
        return 2;
    }
    nthreads = threads;
    rate = r;
    struct worker *w = calloc((size_t)threads, sizeof *w);
    for (int i = 0; i < threads; i++) {
        w[i].index = i;
        if (pthread_create(&w[i].thread, NULL, worker_main, &w[i]) != 0) die("pthread_create");
    }
    struct timespec ws = {.tv_sec = (time_t)warmup, .tv_nsec = (long)((warmup - (time_t)warmup) * 1e9)};
    nanosleep(&ws, NULL);
    struct rusage ru0, ru1;
    getrusage(RUSAGE_SELF, &ru0);
    uint64_t cpu0 = now_ns(CLOCK_PROCESS_CPUTIME_ID);
    window_start = now_ns(CLOCK_MONOTONIC);
    window_end = window_start + (uint64_t)(seconds * 1e9);
    atomic_store(&phase, 1);
    printf("window-start\n");
    fflush(stdout);
    struct timespec ms = {.tv_sec = (time_t)seconds, .tv_nsec = (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&ms, NULL);
    uint64_t cpu1 = now_ns(CLOCK_PROCESS_CPUTIME_ID);
    getrusage(RUSAGE_SELF, &ru1);
    double elapsed = (double)(now_ns(CLOCK_MONOTONIC) - window_start) / 1e9;
    printf("window-end\n");
    fflush(stdout);
    atomic_store(&phase, 2);
    size_t total = 0;
    uint64_t errors = 0, late = 0, ec = 0, ei = 0, es = 0;
    for (int i = 0; i < threads; i++) {
        pthread_join(w[i].thread, NULL);
        total += w[i].count;
        errors += w[i].errors;
        late += w[i].late;
        ec += w[i].err_connect;
        ei += w[i].err_io;
        es += w[i].err_short;
    }
    uint32_t *all = malloc((total ? total : 1) * sizeof *all);
    size_t k = 0;
    double sum = 0;
    for (int i = 0; i < threads; i++) {
        memcpy(all + k, w[i].lat_ns, w[i].count * sizeof *all);
        k += w[i].count;
    }
    qsort(all, total, sizeof *all, cmp_u32);
    for (size_t i = 0; i < total; i++) sum += all[i];
    printf("{\"requests\": %zu, \"errors\": %llu, \"errors_connect\": %llu, \"errors_io\": %llu, "
           "\"errors_short\": %llu, \"late\": %llu, \"seconds\": %.6f, \"rate\": %.1f, \"threads\": %d, "
           "\"target_rate\": %.1f, \"p50_us\": %.2f, \"p90_us\": %.2f, \"p99_us\": %.2f, \"p999_us\": %.2f, "
           "\"min_us\": %.2f, \"max_us\": %.2f, \"mean_us\": %.2f, \"cpu_s\": %.6f, \"user_s\": %.6f, "
           "\"sys_s\": %.6f, \"tuples_used\": %llu}\n",
           total, (unsigned long long)errors, (unsigned long long)ec, (unsigned long long)ei,
           (unsigned long long)es, (unsigned long long)late, elapsed, (double)total / elapsed, threads, r,
           pct_us(all, total, 0.50), pct_us(all, total, 0.90), pct_us(all, total, 0.99),
           pct_us(all, total, 0.999), total ? all[0] / 1000.0 : 0, total ? all[total - 1] / 1000.0 : 0,
           total ? sum / (double)total / 1000.0 : 0, (double)(cpu1 - cpu0) / 1e9,
           tv_s(ru1.ru_utime) - tv_s(ru0.ru_utime), tv_s(ru1.ru_stime) - tv_s(ru0.ru_stime),
           (unsigned long long)(atomic_load(&tuple_next) - tuple_first));
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "serve") == 0) return serve(atoi(argv[2]));
    if ((argc == 7 || argc == 9) && strcmp(argv[1], "load") == 0)
        return load(argv[2], atoi(argv[3]), atof(argv[4]), atof(argv[5]), atof(argv[6]), argc == 9 ? argv[7] : NULL,
                    argc == 9 ? argv[8] : NULL);
    fprintf(stderr,
            "usage: connload serve PORT\n"
            "       connload load IP:PORT[,IP:PORT...] THREADS SECONDS WARMUP_SECONDS RATE(0: closed loop) "
            "[SOURCE_IP/COUNT FIRST]\n");
    return 2;
}
