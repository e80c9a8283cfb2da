/* The benches' own C loops on pyzmq's libzmq (bench/zmqloops.py builds them with cffi):
 * raw ceilings (receive, reply, publish, subscribe with no work) and load generators fast
 * enough that they are not what a figure measures on a 2-core machine. burst.c is included
 * before this file for tb_bind and the resolved libzmq functions.
 */

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
