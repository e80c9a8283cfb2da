/* The benches' own C loops on pyzmq's libzmq (bench/zmqloops.py builds them with cffi):
 * raw ceilings (receive, reply, publish, subscribe with no work) and load generators fast
 * enough that they are not what a figure measures on a 2-core machine. burst.c is included
 * before this file for tb_bind and the resolved libzmq functions.
 */

#include <stdio.h>

static void bl_meta(unsigned char *m, uint32_t device, uint64_t created, uint64_t seq) {
    m[0] = 0xCA; /* META_TAG 0xCABD, no compression, version 1: the 24-byte meta */
    m[1] = 0xBD;
    m[2] = 0;
    m[3] = 1;
    for (int k = 0; k < 4; k++)
        m[4 + k] = (unsigned char)(device >> (8 * (3 - k)));
    for (int k = 0; k < 8; k++) {
        m[8 + k] = (unsigned char)(created >> (8 * (7 - k)));
        m[16 + k] = (unsigned char)(seq >> (8 * (7 - k)));
    }
}

/* Receive and drop one whole message (blocking); its frame count, or -1. */
static int bl_drop_message(void *sock, tb_zmq_msg *keep, int keep_n) {
    int count = 0, more = 1;
    while (more) {
        tb_zmq_msg spare;
        tb_zmq_msg *m = count < keep_n ? &keep[count] : &spare;
        z_msg_init(m);
        if (z_msg_recv(m, sock, 0) < 0) {
            z_msg_close(m);
            return -1;
        }
        more = z_msg_more(m);
        if (m == &spare)
            z_msg_close(m);
        count++;
    }
    return count;
}

/* Logjam messages out: app-env, topic, body, a 24-byte meta numbered from 1. With `dealer`,
 * an empty frame first, and the 202s read as they come (all of them before returning: the
 * replies received). Without, the PUSH agent: returns n. -1 on an error. */
long bl_agent(void *sock, long n, int dealer, const char *app, size_t la, const char *topic,
              size_t lt, const char *body, size_t lb) {
    unsigned char meta[24];
    long replies = 0;
    for (long i = 0; i < n; i++) {
        bl_meta(meta, 0, 1700000000000ULL, (uint64_t)i + 1);
        if ((dealer && z_send(sock, "", 0, TB_SNDMORE) < 0) ||
            z_send(sock, app, la, TB_SNDMORE) < 0 || z_send(sock, topic, lt, TB_SNDMORE) < 0 ||
            z_send(sock, body, lb, TB_SNDMORE) < 0 || z_send(sock, meta, 24, 0) < 0)
            return -1;
        if (dealer && (i & 511) == 0) {
            for (;;) { /* read the replies that are there: app-env, status */
                tb_zmq_msg m;
                z_msg_init(&m);
                if (z_msg_recv(&m, sock, TB_DONTWAIT) < 0) {
                    z_msg_close(&m);
                    break;
                }
                int more = z_msg_more(&m);
                z_msg_close(&m);
                if (more && bl_drop_message(sock, NULL, 0) < 0)
                    return -1;
                replies++;
            }
        }
    }
    if (!dealer)
        return n;
    while (replies < n) {
        if (bl_drop_message(sock, NULL, 0) < 0)
            return -1; /* ZMQ_RCVTIMEO set by the caller ends a wait that never ends */
        replies++;
    }
    return replies;
}

/* The raw receiver: n messages in, nothing done with them; with `reply`, a ROUTER's 202 for
 * each (routing id, the app-env after the empty frame, "202 Accepted"), as logjam-device
 * answers. Returns the messages received (fewer: ZMQ_RCVTIMEO ran out). */
long bl_receiver(void *sock, long n, int reply) {
    long got = 0;
    while (got < n) {
        tb_zmq_msg keep[3];
        int count = bl_drop_message(sock, keep, 3);
        if (count < 0)
            break;
        int kept = count < 3 ? count : 3;
        if (reply && count >= 3) {
            z_send(sock, z_msg_data(&keep[0]), z_msg_size(&keep[0]), TB_SNDMORE | TB_DONTWAIT);
            z_send(sock, z_msg_data(&keep[2]), z_msg_size(&keep[2]), TB_SNDMORE | TB_DONTWAIT);
            z_send(sock, "202 Accepted", 12, TB_DONTWAIT);
        }
        for (int k = 0; k < kept; k++)
            z_msg_close(&keep[k]);
        got++;
    }
    return got;
}

/* The raw publisher: n logjam messages numbered from 1 on a PUB/XPUB. Returns n or -1. */
long bl_publisher(void *sock, long n, const char *app, size_t la, const char *topic, size_t lt,
                  const char *body, size_t lb) {
    unsigned char meta[24];
    for (long i = 0; i < n; i++) {
        bl_meta(meta, 1, 1700000000000ULL, (uint64_t)i + 1);
        if (z_send(sock, app, la, TB_SNDMORE) < 0 || z_send(sock, topic, lt, TB_SNDMORE) < 0 ||
            z_send(sock, body, lb, TB_SNDMORE) < 0 || z_send(sock, meta, 24, 0) < 0)
            return -1;
    }
    return n;
}

/* Event BUS PUB commands out of a DEALER: topic "/bench/<i mod topics>", an 8-byte zero
 * sequence, producer, timestamp, a distinct v4 UUID (``salt`` keeps runs apart: the bus
 * drops a UUID it has seen), and the data. Returns n or -1. */
long bl_bus_publisher(void *sock, long n, long topics, uint32_t salt, const char *producer,
                      size_t lp, const char *ts, size_t lts, const char *data, size_t ld) {
    static const unsigned char zero[8] = {0};
    char topic[32], uuid[40];
    for (long i = 0; i < n; i++) {
        int lt = snprintf(topic, sizeof topic, "/bench/%ld", i % topics);
        snprintf(uuid, sizeof uuid, "%08x-%04x-4%03x-8%03x-%012lx", salt,
                 (unsigned)((i >> 48) & 0xffff), (unsigned)((i >> 36) & 0xfff),
                 (unsigned)((i >> 24) & 0xfff), (unsigned long)(i & 0xffffffffffffUL));
        if (z_send(sock, topic, (size_t)lt, TB_SNDMORE) < 0 ||
            z_send(sock, zero, 8, TB_SNDMORE) < 0 || z_send(sock, producer, lp, TB_SNDMORE) < 0 ||
            z_send(sock, ts, lts, TB_SNDMORE) < 0 || z_send(sock, uuid, 36, TB_SNDMORE) < 0 ||
            z_send(sock, data, ld, 0) < 0)
            return -1;
    }
    return n;
}

/* Count n whole messages (a SUB's BROADCASTs); fewer when ZMQ_RCVTIMEO runs out. */
long bl_count(void *sock, long n) {
    long got = 0;
    while (got < n && bl_drop_message(sock, NULL, 0) >= 0)
        got++;
    return got;
}

/* The Event BUS's raw ceiling: n PUB commands in on a ROUTER (routing id + 6 frames), each
 * out on a PUB as a BROADCAST numbered from 1 (its sequence frame replaced), nothing else
 * done. Returns the commands relayed (fewer: ZMQ_RCVTIMEO ran out). */
long bl_bus_relay(void *router, void *pub, long n) {
    long got = 0;
    while (got < n) {
        tb_zmq_msg f[7];
        int count = bl_drop_message(router, f, 7);
        if (count < 0)
            break;
        int kept = count < 7 ? count : 7;
        if (count == 7) {
            unsigned char seq[8];
            uint64_t s = (uint64_t)got + 1;
            for (int k = 0; k < 8; k++)
                seq[k] = (unsigned char)(s >> (8 * (7 - k)));
            for (int k = 1; k < 7; k++) {
                const void *d = k == 2 ? (const void *)seq : z_msg_data(&f[k]);
                size_t len = k == 2 ? 8 : z_msg_size(&f[k]);
                z_send(pub, d, len, k < 6 ? TB_SNDMORE : 0);
            }
        }
        for (int k = 0; k < kept; k++)
            z_msg_close(&f[k]);
        got++;
    }
    return got;
}

/* nasa/lager data rows out of an XPUB, as the bench's Tap sends them: uuid (16 bytes),
 * version, flags, an 8-byte timestamp, then `items` 8-byte items, one frame each. Waits for
 * the first subscription (the path is up) first. Returns n or -1. */
long bl_lager_tap(void *sock, long n, const char *uuid16, int items) {
    static const unsigned char zero[8] = {0};
    unsigned char ts[8];
    tb_zmq_msg sub;
    z_msg_init(&sub);
    int rc = z_msg_recv(&sub, sock, 0);
    z_msg_close(&sub);
    if (rc < 0)
        return -1;
    for (long i = 0; i < n; i++) {
        for (int k = 0; k < 8; k++)
            ts[k] = (unsigned char)((uint64_t)i >> (8 * (7 - k)));
        if (z_send(sock, uuid16, 16, TB_SNDMORE) < 0 ||
            z_send(sock, "BEERR01", 7, TB_SNDMORE) < 0 || z_send(sock, zero, 1, TB_SNDMORE) < 0 ||
            z_send(sock, ts, 8, TB_SNDMORE) < 0)
            return -1;
        for (int k = 0; k < items; k++)
            if (z_send(sock, zero, 8, k + 1 < items ? TB_SNDMORE : 0) < 0)
                return -1;
    }
    return n;
}

/* The forwarder with no work: whole messages from `in` to `out` as they are. Returns n, or
 * fewer when ZMQ_RCVTIMEO runs out. */
long bl_forward(void *in, void *out, long n) {
    long got = 0;
    while (got < n) {
        int more = 1;
        while (more) {
            tb_zmq_msg m;
            z_msg_init(&m);
            if (z_msg_recv(&m, in, 0) < 0) {
                z_msg_close(&m);
                return got;
            }
            more = z_msg_more(&m);
            z_send(out, z_msg_data(&m), z_msg_size(&m), more ? TB_SNDMORE : 0);
            z_msg_close(&m);
        }
        got++;
    }
    return got;
}

/* Many SUB sockets read in one loop (zmq_poll): whole messages whose last frame starts with a
 * MessagePack [uint64, ...] (the fan-out bench's send time, ns) are counted per socket until
 * each has `expected` or nothing came for `quiet_ms`; others are read and dropped. Every
 * `sample`-th counted message of a socket adds its lag (now - that time, ns) to
 * lags[socket * max_samples + k]. Returns the time of the last message counted (ns,
 * CLOCK_REALTIME), or -1 when zmq_poll cannot be found. */
typedef struct {
    void *socket;
    int fd;
    short events;
    short revents;
} bl_pollitem;

#include <time.h>

static int (*z_poll)(bl_pollitem *, int, long);

static int64_t bl_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t bl_count_many(void **socks, int n, long expected, int quiet_ms, int sample,
                      long *received, int64_t *lags, int max_samples, int *samples) {
    if (z_poll == NULL) {
        char *path = NULL;
        dl_iterate_phdr(tb_find_libzmq, &path);
        void *lib = path && path[0] ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
        free(path);
        if (lib == NULL || (*(void **)(&z_poll) = dlsym(lib, "zmq_poll")) == NULL)
            return -1;
    }
    bl_pollitem *items = calloc((size_t)n, sizeof *items);
    if (items == NULL)
        return -1;
    for (int i = 0; i < n; i++) {
        items[i].socket = socks[i];
        items[i].events = 1; /* ZMQ_POLLIN */
    }
    int64_t last = bl_now_ns(), quiet_since = last;
    long done = 0;
    for (int i = 0; i < n; i++)
        done += received[i] >= expected;
    while (done < n && (bl_now_ns() - quiet_since) / 1000000 < quiet_ms) {
        int ready = z_poll(items, n, 100);
        if (ready <= 0)
            continue;
        quiet_since = bl_now_ns();
        for (int i = 0; i < n; i++) {
            if (!(items[i].revents & 1))
                continue;
            for (;;) {
                tb_zmq_msg m;
                int more = 1, first = 1;
                int64_t sent = 0;
                while (more) {
                    z_msg_init(&m);
                    if (z_msg_recv(&m, socks[i], first ? TB_DONTWAIT : 0) < 0) {
                        z_msg_close(&m);
                        goto next_socket;
                    }
                    first = 0;
                    more = z_msg_more(&m);
                    if (!more) {
                        const unsigned char *d = z_msg_data(&m);
                        if (z_msg_size(&m) >= 10 && d[0] == 0x92 && d[1] == 0xcf)
                            for (int k = 2; k < 10; k++)
                                sent = sent << 8 | d[k];
                    }
                    z_msg_close(&m);
                }
                if (!sent)
                    continue; /* not a stamped message (the bench's warm-ups): not counted */
                last = bl_now_ns();
                received[i]++;
                if (received[i] == expected)
                    done++;
                if (sent && received[i] % sample == 0 && samples[i] < max_samples)
                    lags[(size_t)i * (size_t)max_samples + (size_t)samples[i]++] = last - sent;
            }
        next_socket:;
        }
    }
    free(items);
    return last;
}

/* One snapshot read off a DEALER: whole messages until the one whose first frame is `end`
 * (SYNCEND, KTHXBAI), read too. Returns the messages before it (the keys), or -1 when
 * ZMQ_RCVTIMEO ran out first. The bench's reader must not be what a snapshot figure measures. */
long bl_count_until(void *sock, const char *end, size_t end_len) {
    long got = 0;
    for (;;) {
        tb_zmq_msg m;
        z_msg_init(&m);
        if (z_msg_recv(&m, sock, 0) < 0) {
            z_msg_close(&m);
            return -1;
        }
        int last = z_msg_size(&m) == end_len && memcmp(z_msg_data(&m), end, end_len) == 0;
        int more = z_msg_more(&m);
        z_msg_close(&m);
        if (more && bl_drop_message(sock, NULL, 0) < 0)
            return -1;
        if (last)
            return got;
        got++;
    }
}
