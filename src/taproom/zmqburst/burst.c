/* taproom's compiled ZeroMQ hot paths: whole bursts per call (see zmqburst/__init__.py).
 *
 * Built by cffi in API mode (zmqburst/_build.py). Every function here runs without the GIL
 * (cffi releases it around each call) and touches no Python object: Python hands in buffers
 * and gets offsets and counts back.
 *
 * libzmq is never linked: the functions are looked up in the libzmq pyzmq already loaded
 * (tb_bind), so the socket handles pyzmq gives (Socket.underlying) belong to the very library
 * that is called, whatever pyzmq wheel or system libzmq is installed.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* dl_iterate_phdr, RTLD_NOLOAD */
#endif
#include <dlfcn.h>
#include <errno.h>
#include <link.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* ---- libzmq, resolved at run time ------------------------------------------------------- */

/* zmq_msg_t as zmq.h declares it since libzmq 4.1 (64 bytes, pointer aligned). */
typedef struct {
    unsigned char _[64];
} __attribute__((aligned(sizeof(void *)))) tb_zmq_msg;

#define TB_DONTWAIT 1 /* ZMQ_DONTWAIT */
#define TB_SNDMORE 2  /* ZMQ_SNDMORE */
#define TB_TYPE 16    /* ZMQ_TYPE */

static int (*z_msg_init)(tb_zmq_msg *);
static int (*z_msg_recv)(tb_zmq_msg *, void *, int);
static int (*z_msg_close)(tb_zmq_msg *);
static void *(*z_msg_data)(tb_zmq_msg *);
static size_t (*z_msg_size)(const tb_zmq_msg *);
static int (*z_msg_more)(const tb_zmq_msg *);
static int (*z_send)(void *, const void *, size_t, int);
static int (*z_errno)(void);
static int (*z_getsockopt)(void *, int, void *, size_t *);
static int (*z_setsockopt)(void *, int, const void *, size_t);
static void (*z_version)(int *, int *, int *);

static int tb_find_libzmq(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    const char *name = info->dlpi_name;
    const char *base = name ? strrchr(name, '/') : NULL;
    base = base ? base + 1 : name;
    if (base && strncmp(base, "libzmq", 6) == 0) {
        char **found = data;
        if (*found == NULL)
            *found = strdup(name);
        else if (strcmp(*found, name) != 0)
            **found = '\0'; /* two different libzmq: ambiguous, refuse */
    }
    return 0;
}

/* Find the one libzmq loaded in this process and resolve the functions used here.
 * 0: ready, with libzmq's version in major, minor, patch; -1: not found or ambiguous. */
int tb_bind(int *major, int *minor, int *patch) {
    char *path = NULL;
    dl_iterate_phdr(tb_find_libzmq, &path);
    if (path == NULL)
        return -1;
    void *lib = path[0] ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;
    free(path);
    if (lib == NULL)
        return -1;
#define TB_SYM(var, name)                                                                    \
    do {                                                                                     \
        *(void **)(&var) = dlsym(lib, name);                                                 \
        if (var == NULL)                                                                     \
            return -1;                                                                       \
    } while (0)
    TB_SYM(z_msg_init, "zmq_msg_init");
    TB_SYM(z_msg_recv, "zmq_msg_recv");
    TB_SYM(z_msg_close, "zmq_msg_close");
    TB_SYM(z_msg_data, "zmq_msg_data");
    TB_SYM(z_msg_size, "zmq_msg_size");
    TB_SYM(z_msg_more, "zmq_msg_more");
    TB_SYM(z_send, "zmq_send");
    TB_SYM(z_errno, "zmq_errno");
    TB_SYM(z_getsockopt, "zmq_getsockopt");
    TB_SYM(z_setsockopt, "zmq_setsockopt");
    TB_SYM(z_version, "zmq_version");
#undef TB_SYM
    z_version(major, minor, patch);
    return 0;
}

/* ZMQ_TYPE of a socket handle, or -1: lets Python check the handle is the socket it means. */
int tb_socket_type(void *sock) {
    int kind = -1;
    size_t size = sizeof kind;
    if (z_getsockopt(sock, TB_TYPE, &kind, &size) != 0)
        return -1;
    return kind;
}

/* ---- receiving bursts -------------------------------------------------------------------- */

#define TB_MAX_KEPT 65536 /* frames kept per message, at most (readers ask for fewer) */

typedef struct {
    void *sock;
    int max_frames;
    int carry_kept;    /* frames held from a message that did not fit (0: none) */
    int carry_count;   /* that message's true frame count */
    tb_zmq_msg *carry; /* max_frames of them */
} tb_reader;

typedef struct {
    int status;      /* TB_* below */
    int messages;    /* whole messages in the buffer */
    size_t frames;   /* frames kept in the buffer (frame_end entries) */
    size_t bytes;    /* bytes used in the buffer */
    size_t need;     /* TB_NEED: bytes the held message needs */
    int error;       /* TB_ERROR: errno */
} tb_result;

enum { TB_DRAINED = 0, TB_COUNT = 1, TB_BYTES = 2, TB_FULL = 3, TB_NEED = 4, TB_ERROR = -1 };

tb_reader *tb_reader_new(void *sock, int max_frames) {
    if (max_frames < 1 || max_frames > TB_MAX_KEPT)
        return NULL;
    tb_reader *r = calloc(1, sizeof *r);
    if (r == NULL)
        return NULL;
    r->carry = calloc((size_t)max_frames, sizeof(tb_zmq_msg));
    if (r->carry == NULL) {
        free(r);
        return NULL;
    }
    r->sock = sock;
    r->max_frames = max_frames;
    return r;
}

void tb_reader_free(tb_reader *r) {
    if (r == NULL)
        return;
    for (int i = 0; i < r->carry_kept; i++)
        z_msg_close(&r->carry[i]);
    free(r->carry);
    free(r);
}

/* Read one whole message into r->carry (frames past max_frames are read and dropped).
 * 0: read; 1: nothing queued; -1: error (errno in *error). */
static int tb_read_message(tb_reader *r, int *error) {
    tb_zmq_msg *m = r->carry;
    z_msg_init(&m[0]);
    if (z_msg_recv(&m[0], r->sock, TB_DONTWAIT) < 0) {
        int e = z_errno();
        z_msg_close(&m[0]);
        if (e == EAGAIN)
            return 1;
        *error = e;
        return -1;
    }
    int kept = 1, count = 1;
    int more = z_msg_more(&m[0]);
    while (more) {
        /* a message arrives whole: its other frames are already queued */
        tb_zmq_msg spare;
        tb_zmq_msg *into = kept < r->max_frames ? &m[kept] : &spare;
        z_msg_init(into);
        if (z_msg_recv(into, r->sock, 0) < 0) {
            z_msg_close(into);
            *error = z_errno();
            for (int i = 0; i < kept; i++)
                z_msg_close(&m[i]);
            return -1;
        }
        more = z_msg_more(into);
        count++;
        if (into == &spare)
            z_msg_close(&spare);
        else
            kept++;
    }
    r->carry_kept = kept;
    r->carry_count = count;
    return 0;
}

/* Receive every whole message that is ready, up to max_messages and until max_bytes are in
 * the buffer. Message i's true frame count goes to counts[i] (only min(count, max_frames)
 * frames are kept); kept frame j ends at frame_end[j] in buf (frame 0 starts at 0). A message
 * that does not fit the buffer or the arrays is held for the next call (TB_FULL), or, when it
 * alone is too big for the buffer, reported as TB_NEED with its size (frames_cap must be at
 * least max_frames). */
void tb_recv(tb_reader *r, char *buf, size_t cap, size_t *frame_end, size_t frames_cap,
             int *counts, int max_messages, size_t max_bytes, tb_result *res) {
    size_t used = 0, frames = 0;
    int n = 0;
    res->status = TB_DRAINED;
    res->error = 0;
    res->need = 0;
    while (n < max_messages) {
        if (r->carry_kept == 0) {
            int got = tb_read_message(r, &res->error);
            if (got == 1)
                break;
            if (got < 0) {
                res->status = TB_ERROR;
                break;
            }
        }
        size_t size = 0;
        for (int i = 0; i < r->carry_kept; i++)
            size += z_msg_size(&r->carry[i]);
        if (used + size > cap || frames + (size_t)r->carry_kept > frames_cap) {
            res->status = n ? TB_FULL : TB_NEED;
            res->need = size;
            break;
        }
        for (int i = 0; i < r->carry_kept; i++) {
            size_t s = z_msg_size(&r->carry[i]);
            memcpy(buf + used, z_msg_data(&r->carry[i]), s);
            used += s;
            frame_end[frames++] = used;
            z_msg_close(&r->carry[i]);
        }
        counts[n++] = r->carry_count;
        r->carry_kept = 0;
        if (used >= max_bytes) {
            res->status = TB_BYTES;
            break;
        }
    }
    if (n == max_messages && res->status == TB_DRAINED)
        res->status = TB_COUNT;
    res->messages = n;
    res->frames = frames;
    res->bytes = used;
}

/* ---- sending bursts ---------------------------------------------------------------------- */

/* Send messages[0..n) (frame j of the whole burst is buf[frame_end[j-1]..frame_end[j]),
 * message i has counts[i] frames), every frame with ZMQ_DONTWAIT. A message whose frame fails
 * is skipped (its peer went away; a ROUTER drops replies to unknown peers). Returns the
 * number of messages sent whole. */
int tb_send(void *sock, const char *buf, const size_t *frame_end, const int *counts, int n) {
    size_t frame = 0, start = 0;
    int sent = 0;
    for (int i = 0; i < n; i++) {
        int ok = 1;
        for (int j = 0; j < counts[i]; j++, frame++) {
            size_t end = frame_end[frame];
            if (ok) {
                int flags = TB_DONTWAIT | (j + 1 < counts[i] ? TB_SNDMORE : 0);
                if (z_send(sock, buf + start, end - start, flags) < 0)
                    ok = 0;
            }
            start = end;
        }
        sent += ok;
    }
    return sent;
}

/* ---- JSON: is a body certainly valid? ----------------------------------------------------- */

/* 1 when `s` is a JSON text orjson.loads certainly accepts; 0 when it is not, or when orjson's
 * answer is not certain from here (deep nesting, long numbers, \u surrogates, ...): the caller
 * then asks orjson. So this never says "valid" where orjson says no. */
#define TB_JSON_DEPTH 128

static const unsigned char *tb_ws(const unsigned char *p, const unsigned char *e) {
    while (p < e && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t'))
        p++;
    return p;
}

static int tb_hex(unsigned char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    c |= 0x20;
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* Bytes a JSON string takes as they are: printable ASCII but the quote and the backslash. */
static const unsigned char tb_plain[256] = {
    [0x20 ... 0x7E] = 1,
    ['"'] = 0,
    ['\\'] = 0,
};

/* p is just past the opening quote; returns just past the closing quote, or NULL. */
static const unsigned char *tb_string(const unsigned char *p, const unsigned char *e) {
    for (;;) {
#if defined(__SSE2__)
        /* 16 bytes at a time up to the first that is not plain ASCII: a quote, a backslash,
         * a control character, or (signed: negative) a byte of a multi-byte character */
        while (e - p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            __m128i special = _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(v, _mm_set1_epi8('"')),
                             _mm_cmpeq_epi8(v, _mm_set1_epi8('\\'))),
                _mm_cmplt_epi8(v, _mm_set1_epi8(0x20)));
            int mask = _mm_movemask_epi8(special);
            if (mask) {
                p += __builtin_ctz((unsigned)mask);
                break;
            }
            p += 16;
        }
#endif
        /* the bulk of a string: one table look-up a byte */
        while (e - p >= 4 && tb_plain[p[0]] && tb_plain[p[1]] && tb_plain[p[2]] && tb_plain[p[3]])
            p += 4;
        while (p < e && tb_plain[*p])
            p++;
        if (p >= e)
            return NULL;
        unsigned char c = *p;
        if (c == '"')
            return p + 1;
        if (c < 0x20)
            return NULL;
        if (c == '\\') {
            if (++p >= e)
                return NULL;
            c = *p;
            if (c == 'u') {
                if (e - p < 5)
                    return NULL;
                int v = 0;
                for (int k = 1; k <= 4; k++) {
                    int h = tb_hex(p[k]);
                    if (h < 0)
                        return NULL;
                    v = v << 4 | h;
                }
                if (v >= 0xD800 && v <= 0xDFFF)
                    return NULL; /* surrogates: orjson decides */
                p += 5;
                continue;
            }
            if (c != '"' && c != '\\' && c != '/' && c != 'b' && c != 'f' && c != 'n' &&
                c != 'r' && c != 't')
                return NULL;
            p++;
            continue;
        }
        if (c < 0x80) {
            p++;
            continue;
        }
        /* strict UTF-8: no overlong forms, no surrogates, nothing past U+10FFFF */
        if (c >= 0xC2 && c <= 0xDF) {
            if (e - p < 2 || (p[1] & 0xC0) != 0x80)
                return NULL;
            p += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (e - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80)
                return NULL;
            if (c == 0xE0 && p[1] < 0xA0)
                return NULL;
            if (c == 0xED && p[1] >= 0xA0)
                return NULL;
            p += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (e - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 ||
                (p[3] & 0xC0) != 0x80)
                return NULL;
            if (c == 0xF0 && p[1] < 0x90)
                return NULL;
            if (c == 0xF4 && p[1] >= 0x90)
                return NULL;
            p += 4;
        } else {
            return NULL;
        }
    }
}

/* A number with at most 15 significant digits and a 1- or 2-digit exponent: exactly what any
 * JSON parser reads as an ordinary int or double. Longer ones go to orjson. */
static const unsigned char *tb_number(const unsigned char *p, const unsigned char *e) {
    int digits = 0;
    if (p < e && *p == '-')
        p++;
    if (p >= e)
        return NULL;
    if (*p == '0') {
        p++;
        digits = 1;
    } else if (*p >= '1' && *p <= '9') {
        while (p < e && *p >= '0' && *p <= '9') {
            p++;
            digits++;
        }
    } else {
        return NULL;
    }
    if (p < e && *p == '.') {
        p++;
        int frac = 0;
        while (p < e && *p >= '0' && *p <= '9') {
            p++;
            frac++;
        }
        if (frac == 0)
            return NULL;
        digits += frac;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-'))
            p++;
        int exp = 0;
        while (p < e && *p >= '0' && *p <= '9') {
            p++;
            exp++;
        }
        if (exp == 0 || exp > 2)
            return NULL;
    }
    return digits > 15 ? NULL : p;
}

int tb_json_valid(const char *text, size_t len) {
    const unsigned char *p = (const unsigned char *)text, *e = p + len;
    /* the open containers: 1 array, 2 object */
    unsigned char stack[TB_JSON_DEPTH];
    int depth = 0;
    p = tb_ws(p, e);
value:
    if (p >= e)
        return 0;
    switch (*p) {
    case '{':
        if (depth == TB_JSON_DEPTH)
            return 0;
        stack[depth++] = 2;
        p = tb_ws(p + 1, e);
        if (p < e && *p == '}') {
            p++;
            depth--;
            goto after;
        }
        goto key;
    case '[':
        if (depth == TB_JSON_DEPTH)
            return 0;
        stack[depth++] = 1;
        p = tb_ws(p + 1, e);
        if (p < e && *p == ']') {
            p++;
            depth--;
            goto after;
        }
        goto value;
    case '"':
        p = tb_string(p + 1, e);
        break;
    case 't':
        p = (e - p >= 4 && memcmp(p, "true", 4) == 0) ? p + 4 : NULL;
        break;
    case 'f':
        p = (e - p >= 5 && memcmp(p, "false", 5) == 0) ? p + 5 : NULL;
        break;
    case 'n':
        p = (e - p >= 4 && memcmp(p, "null", 4) == 0) ? p + 4 : NULL;
        break;
    default:
        p = tb_number(p, e);
    }
    if (p == NULL)
        return 0;
after:
    p = tb_ws(p, e);
    if (depth == 0)
        return p == e;
    if (p >= e)
        return 0;
    if (*p == ',') {
        p = tb_ws(p + 1, e);
        if (stack[depth - 1] == 1)
            goto value;
        goto key;
    }
    if (*p == (stack[depth - 1] == 1 ? ']' : '}')) {
        p++;
        depth--;
        goto after;
    }
    return 0;
key:
    if (p >= e || *p != '"')
        return 0;
    p = tb_string(p + 1, e);
    if (p == NULL)
        return 0;
    p = tb_ws(p, e);
    if (p >= e || *p != ':')
        return 0;
    p = tb_ws(p + 1, e);
    goto value;
}

/* ---- logjam ingest: records straight from a received burst --------------------------------- */

/* Strings (app-envs, topics) the Python side has validated against the grammar. */
#define LJ_SET_SLOTS 8192 /* a power of two, at least twice the entries */

typedef struct {
    uint64_t hash[LJ_SET_SLOTS];
    char *item[LJ_SET_SLOTS]; /* u16 length, then the bytes */
    int entries;
} lj_set;

static uint64_t lj_hash(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ULL;
    }
    return h | 1; /* 0 marks an empty slot */
}

static int lj_set_has(const lj_set *set, const char *s, size_t n) {
    uint64_t h = lj_hash(s, n);
    for (size_t i = h & (LJ_SET_SLOTS - 1);; i = (i + 1) & (LJ_SET_SLOTS - 1)) {
        if (set->hash[i] == 0)
            return 0;
        if (set->hash[i] == h) {
            const char *item = set->item[i];
            uint16_t len;
            memcpy(&len, item, 2);
            if (len == n && memcmp(item + 2, s, n) == 0)
                return 1;
        }
    }
}

/* logjam-device's own checks, as logjam-tools' src/logjam-util.c has them (and
 * protocols/logjam/messages.py, which the tests hold this to): well_formed_stream_name, every
 * byte 32..127 and at least one '-'; well_formed_topic, one of six prefixes, nothing after it
 * checked. Cheaper than a set lookup, and not limited to the strings seen first. */
static int lj_well_formed_stream_name(const unsigned char *s, size_t n) {
    int hyphens = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < 32 || s[i] > 127)
            return 0;
        hyphens |= s[i] == '-';
    }
    return hyphens;
}

static int lj_prefix(const char *s, size_t n, const char *prefix, size_t lp) {
    return n >= lp && memcmp(s, prefix, lp) == 0;
}

static int lj_well_formed_topic(const char *s, size_t n) {
    return lj_prefix(s, n, "logs", 4) || lj_prefix(s, n, "javascript", 10) ||
           lj_prefix(s, n, "events", 6) || lj_prefix(s, n, "frontend.page", 13) ||
           lj_prefix(s, n, "frontend.ajax", 13) || lj_prefix(s, n, "mobile", 6);
}

typedef struct {
    lj_set app_envs, topics; /* grammar "seed": what Python accepted (see lj_ingest_learn) */
    int device_grammar;      /* 1: grammar "device", checked here as logjam-device does */
    int max_entries;         /* per set, as the Python parser's caches */
    size_t max_body;        /* bodies over this (or max_decompressed) go to Python */
    size_t max_decompressed;
    uint16_t meta_tag;
    uint8_t meta_version;
    uint64_t max_created_ms;
    int router;             /* 1: ROUTER messages (routing id first), 0: PULL */
} lj_ingest;

lj_ingest *lj_ingest_new(int router, int device_grammar, size_t max_body,
                         size_t max_decompressed, int max_entries, int meta_tag,
                         int meta_version, uint64_t max_created_ms) {
    if (max_entries > LJ_SET_SLOTS / 2)
        return NULL;
    lj_ingest *st = calloc(1, sizeof *st);
    if (st) {
        st->router = router;
        st->device_grammar = device_grammar;
        st->max_body = max_body;
        st->max_decompressed = max_decompressed;
        st->max_entries = max_entries;
        st->meta_tag = (uint16_t)meta_tag;
        st->meta_version = (uint8_t)meta_version;
        st->max_created_ms = max_created_ms;
    }
    return st;
}

static void lj_set_clear(lj_set *set) {
    for (size_t i = 0; i < LJ_SET_SLOTS; i++)
        free(set->item[i]);
}

void lj_ingest_free(lj_ingest *st) {
    if (st == NULL)
        return;
    lj_set_clear(&st->app_envs);
    lj_set_clear(&st->topics);
    free(st);
}

/* Remember a validated app-env (kind 0) or topic (kind 1); beyond max_entries they stay with
 * Python (checked there each time, as its own caches do). */
void lj_ingest_learn(lj_ingest *st, int kind, const char *s, size_t n) {
    lj_set *set = kind ? &st->topics : &st->app_envs;
    if (n > 0xFFFF || set->entries >= st->max_entries || lj_set_has(set, s, n))
        return;
    char *item = malloc(n + 2);
    if (item == NULL)
        return;
    uint16_t len = (uint16_t)n;
    memcpy(item, &len, 2);
    memcpy(item + 2, s, n);
    uint64_t h = lj_hash(s, n);
    size_t i = h & (LJ_SET_SLOTS - 1);
    while (set->hash[i] != 0)
        i = (i + 1) & (LJ_SET_SLOTS - 1);
    set->hash[i] = h;
    set->item[i] = item;
    set->entries++;
}

static uint64_t lj_be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

static void lj_le(unsigned char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++, v >>= 8)
        p[i] = (unsigned char)v;
}

#define LJ_HEAD 46 /* records.RECORD_HEAD: <IqqQBBHHHHII */

typedef struct {
    int next;          /* the first message not made a record here */
    size_t next_frame; /* its first frame's index */
    int slow;          /* 1: message `next` is left to Python (see lj_build) */
    int budget_full;   /* the byte budget was reached at message next - 1 */
    size_t out_bytes;  /* bytes of records written to out */
    int records;       /* records written to out */
    int acks;          /* 202s written to the ack burst */
    size_t ack_frames;
    size_t ack_bytes;
    int time_out_of_range; /* records whose created-ms the journal cannot hold: stored 0 */
} lj_built;

/* Records for messages [start, n) of a received burst (`start_frame`: the index of message
 * start's first frame), written in order to `out`, until one that Python must handle.
 *
 * A message in the usual shape (four frames; on a ROUTER the routing id first, then an empty
 * frame when it wants a reply), with a standard meta frame, no compression, not a ping, an
 * app-env and topic the grammar takes (grammar "device": logjam-device's checks above; "seed":
 * strings Python has validated), a body within bounds that is certainly JSON,
 * becomes a record here, byte for byte as IngestParser.push writes it, and, when it asked, a
 * 202 in the ack burst (routing id, app-env, "202 Accepted", as logjam-device replies). At
 * any other message the call stops with res->slow = 1 and res->next at it: Python handles it
 * (the same code as the pure-Python path) and calls again after it. `*budget` counts down the
 * bytes of bodies stored; once it reaches 0 the call stops after that message, as push does.
 */
void lj_build(lj_ingest *st, const char *buf, const size_t *frame_end, const int *counts,
              int max_frames, int start, size_t start_frame, int n, int64_t received_ns,
              int64_t *budget, char *out, size_t out_cap, char *ack_buf, size_t ack_cap,
              size_t *ack_end, size_t ack_frames_cap, int *ack_counts, lj_built *res) {
    static const char accepted[] = "202 Accepted";
    size_t frame = start_frame, o = 0, ack_frames = 0, ack_pos = 0;
    size_t pos = frame ? frame_end[frame - 1] : 0;
    int acks = 0, records = 0, out_of_range = 0, i;
    res->slow = 0;
    res->budget_full = 0;
    for (i = start; i < n; i++) {
        int count = counts[i];
        int kept = count < max_frames ? count : max_frames;
        const char *f[6];
        size_t len[6];
        size_t p = pos;
        for (int j = 0; j < kept && j < 6; j++) {
            f[j] = buf + p;
            len[j] = frame_end[frame + j] - p;
            p = frame_end[frame + j];
        }
        int first = 0, reply = 0;
        if (st->router) {
            if (count == 6 && len[1] == 0)
                first = 2, reply = 1;
            else if (count == 5 && len[1] != 0)
                first = 1;
            else
                goto slow;
        } else if (count != 4) {
            goto slow;
        }
        const unsigned char *app = (const unsigned char *)f[first];
        size_t la = len[first], lt = len[first + 1], lb = len[first + 2], lm = len[first + 3];
        const char *topic = f[first + 1], *body = f[first + 2];
        const unsigned char *meta = (const unsigned char *)f[first + 3];
        uint64_t device, created, seq;
        if (lm == 24) {
            device = lj_be(meta + 4, 4);
            created = lj_be(meta + 8, 8);
            seq = lj_be(meta + 16, 8);
        } else if (lm == 22) {
            device = lj_be(meta + 4, 2);
            created = lj_be(meta + 6, 8);
            seq = lj_be(meta + 14, 8);
        } else {
            goto slow;
        }
        if (lj_be(meta, 2) != st->meta_tag || meta[3] != st->meta_version || meta[2] != 0)
            goto slow; /* compressed, byte-swapped or bad meta */
        if (la == 4 && memcmp(app, "ping", 4) == 0)
            goto slow;
        if (lb > st->max_body || lb > st->max_decompressed)
            goto slow;
        if (la > 0xFFFF || lt > 0xFFFF) /* over records.py's u16 fields: Python refuses it */
            goto slow;
        if (st->device_grammar) {
            if (!lj_well_formed_stream_name(app, la) || !lj_well_formed_topic(topic, lt))
                goto slow; /* Python refuses it with its reason */
        } else if (!lj_set_has(&st->app_envs, (const char *)app, la) ||
                   !lj_set_has(&st->topics, topic, lt)) {
            goto slow;
        }
        char producer[24];
        int lr = 0;
        {
            char digits[24];
            uint64_t d = device;
            do {
                digits[lr++] = (char)('0' + d % 10);
                d /= 10;
            } while (d);
            for (int k = 0; k < lr; k++)
                producer[k] = digits[lr - 1 - k];
        }
        size_t size = LJ_HEAD + 6 + 4 + la + lt + (size_t)lr + lb;
        if (o + size > out_cap)
            goto slow;
        if (reply && (ack_frames + 3 > ack_frames_cap || ack_pos + len[0] + la + 12 > ack_cap))
            goto slow;
        if (!tb_json_valid(body, lb))
            goto slow;
        unsigned char *h = (unsigned char *)out + o;
        lj_le(h, size - 4, 4);
        lj_le(h + 4, (uint64_t)received_ns, 8);
        /* the event-time rule (taproom.eventtime): a time the journal's i64 nanoseconds
         * cannot hold is absent (0) and counted; created-ms 0 ("unknown") is 0 anyway */
        if (created > st->max_created_ms) {
            created = 0;
            out_of_range++;
        }
        lj_le(h + 12, created * 1000000ULL, 8);
        lj_le(h + 20, seq, 8);
        h[28] = 6;
        h[29] = 4;
        lj_le(h + 30, la, 2);
        lj_le(h + 32, lt, 2);
        lj_le(h + 34, (uint64_t)lr, 2);
        lj_le(h + 36, 0, 2);
        lj_le(h + 38, 0, 4);
        lj_le(h + 42, lb, 4);
        char *q = (char *)h + LJ_HEAD;
        memcpy(q, "logjamjson", 10);
        q += 10;
        memcpy(q, app, la);
        q += la;
        memcpy(q, topic, lt);
        q += lt;
        memcpy(q, producer, (size_t)lr);
        q += lr;
        memcpy(q, body, lb);
        o += size;
        records++;
        if (reply) {
            memcpy(ack_buf + ack_pos, f[0], len[0]);
            ack_pos += len[0];
            ack_end[ack_frames++] = ack_pos;
            memcpy(ack_buf + ack_pos, app, la);
            ack_pos += la;
            ack_end[ack_frames++] = ack_pos;
            memcpy(ack_buf + ack_pos, accepted, 12);
            ack_pos += 12;
            ack_end[ack_frames++] = ack_pos;
            ack_counts[acks++] = 3;
        }
        frame += (size_t)kept;
        pos = frame_end[frame - 1];
        *budget -= (int64_t)lb;
        if (*budget <= 0) {
            i++;
            res->budget_full = 1;
            break;
        }
        continue;
    slow:
        res->slow = 1;
        break;
    }
    res->next = i;
    res->next_frame = frame;
    res->out_bytes = o;
    res->records = records;
    res->acks = acks;
    res->ack_frames = ack_frames;
    res->ack_bytes = ack_pos;
    res->time_out_of_range = out_of_range;
}

/* ---- logjam PUB: committed records out as logjam messages, ZMTP wire bytes ---------------- */

typedef struct {
    int meta_size; /* 24 (u32 device) or 22 (u16) */
    uint16_t meta_tag;
    uint8_t meta_version;
    uint32_t device;
    uint64_t wrap;  /* sequence numbers run 1..wrap */
    int64_t now_ms; /* created-ms of a record without a timestamp */
} lj_pub;

typedef struct {
    size_t pos;       /* the next record's position in the body */
    int sent;         /* records written */
    uint64_t seq;     /* the last sequence number handed out */
    int stop;         /* 0: `count` or the body done; 1: a record that is not logjam's, at pos;
                         2: out or ends full; -1: error */
    int error;
    size_t out_bytes; /* wire bytes written to out */
} lj_published;

/* One ZMTP frame (23/ZMTP): flags (MORE, LONG for 256 bytes and more), size, body; the
 * transport's publishers write these bytes to every subscriber (servers/zmtp/publisher.py). */
static size_t zt_put_frame(unsigned char *o, const void *body, size_t n, int more) {
    size_t head;
    if (n < 256) {
        o[0] = (unsigned char)(more ? 1 : 0);
        o[1] = (unsigned char)n;
        head = 2;
    } else {
        o[0] = (unsigned char)(2 | (more ? 1 : 0));
        for (int k = 0; k < 8; k++)
            o[1 + k] = (unsigned char)((uint64_t)n >> (8 * (7 - k)));
        head = 9;
    }
    memcpy(o + head, body, n);
    return head + n;
}

/* Up to `count` records of a batch body from res->pos as logjam messages in ZMTP wire form,
 * appended to out (from res->out_bytes): app-env, topic, payload and a meta frame numbered on
 * from res->seq; ends[i] is where message i ends. With check_protocol, stops at the first
 * record that is not logjam's (the caller maps it). The transport writes out to every
 * subscriber (servers/zmtp/publisher.py); protocols/logjam's Python twin builds the same. */
void lj_pubwire(const char *body, size_t len, int count, int check_protocol, const lj_pub *cfg,
                char *out, size_t out_cap, size_t *ends, int ends_cap, lj_published *res) {
    const unsigned char *b = (const unsigned char *)body;
    unsigned char *o = (unsigned char *)out;
    size_t pos = res->pos, w = res->out_bytes;
    uint64_t seq = res->seq;
    unsigned char meta[24];
    int ms = cfg->meta_size, dw = ms == 24 ? 4 : 2;
    res->stop = 0;
    while (res->sent < count && pos + LJ_HEAD <= len) {
        const unsigned char *h = b + pos;
        size_t rec = (h[0] | (size_t)h[1] << 8 | (size_t)h[2] << 16 | (size_t)h[3] << 24) + 4;
        int64_t ts_ns = 0;
        for (int k = 7; k >= 0; k--)
            ts_ns = (int64_t)((uint64_t)ts_ns << 8 | h[12 + k]);
        size_t lp = h[28], lc = h[29];
        size_t ls = h[30] | (size_t)h[31] << 8, lt = h[32] | (size_t)h[33] << 8;
        size_t ll = h[42] | (size_t)h[43] << 8 | (size_t)h[44] << 16 | (size_t)h[45] << 24;
        if (pos + rec > len || LJ_HEAD + lp + lc + ls + lt + ll > rec) {
            res->stop = -1;
            res->error = EINVAL;
            break;
        }
        const char *q = body + pos + LJ_HEAD;
        if (check_protocol && !(lp == 6 && memcmp(q, "logjam", 6) == 0)) {
            res->stop = 1;
            break;
        }
        if (res->sent >= ends_cap || w + 4 * 9 + ls + lt + ll + (size_t)ms > out_cap) {
            res->stop = 2;
            break;
        }
        q += lp + lc;
        seq = seq < cfg->wrap ? seq + 1 : 1;
        uint64_t created = ts_ns > 0 ? (uint64_t)(ts_ns / 1000000) : (uint64_t)cfg->now_ms;
        meta[0] = (unsigned char)(cfg->meta_tag >> 8);
        meta[1] = (unsigned char)cfg->meta_tag;
        meta[2] = 0;
        meta[3] = cfg->meta_version;
        for (int k = 0; k < dw; k++)
            meta[4 + k] = (unsigned char)(cfg->device >> (8 * (dw - 1 - k)));
        for (int k = 0; k < 8; k++) {
            meta[4 + dw + k] = (unsigned char)(created >> (8 * (7 - k)));
            meta[12 + dw + k] = (unsigned char)(seq >> (8 * (7 - k)));
        }
        w += zt_put_frame(o + w, q, ls, 1);
        w += zt_put_frame(o + w, q + ls, lt, 1);
        w += zt_put_frame(o + w, body + pos + rec - ll, ll, 1);
        w += zt_put_frame(o + w, meta, (size_t)ms, 0);
        ends[res->sent] = w;
        pos += rec;
        res->sent++;
    }
    res->pos = pos;
    res->seq = seq;
    res->out_bytes = w;
}

/* ---- ZMTP: taproom's own transport (servers/zmtp.py; protocols/zmtp/wire.py is the twin) -- */

/* Frame flags (23/ZMTP): MORE, LONG (8-octet size), COMMAND. */
#define ZT_MORE 1
#define ZT_LONG 2
#define ZT_COMMAND 4

typedef struct {
    int status;      /* ZT_NEED, ZT_COMMAND_AT, ZT_TOO_LARGE, ZT_BAD_COMMAND (wire.ScanStatus) */
    size_t pos;      /* where the walk stopped */
    size_t complete; /* end of the last whole message */
    int messages;    /* whole messages completed by this call */
    size_t partial;  /* wire bytes of the message in progress */
    size_t want;     /* NEED: end of the frame being received (pos + 9 when its header is not) */
    size_t body;     /* COMMAND_AT: its body's position */
    uint64_t size;   /* COMMAND_AT: its body's size; TOO_LARGE / BAD_COMMAND: the frame's */
} zt_scanned;

enum { ZT_NEED = 0, ZT_COMMAND_AT = 1, ZT_TOO_LARGE = 2, ZT_BAD_COMMAND = 3 };

/* Walk frame headers in buf[pos..end) (bodies are skipped by their sizes, never read); see
 * wire.scan: every size is checked against max_message (wire bytes of one message) or
 * max_command before the caller makes room for the body. */
void zt_scan(const unsigned char *buf, size_t pos, size_t end, size_t complete, size_t partial,
             uint64_t max_message, uint64_t max_command, zt_scanned *res) {
    int messages = 0;
    res->want = res->body = 0;
    res->size = 0;
    for (;;) {
        if (end - pos < 2) {
            res->status = ZT_NEED;
            res->want = pos + 9;
            break;
        }
        unsigned char flags = buf[pos];
        uint64_t size;
        size_t head;
        if (flags & ZT_LONG) {
            if (end - pos < 9) {
                res->status = ZT_NEED;
                res->want = pos + 9;
                break;
            }
            size = 0;
            for (int k = 1; k <= 8; k++)
                size = size << 8 | buf[pos + k];
            head = 9;
        } else {
            size = buf[pos + 1];
            head = 2;
        }
        if (flags & ZT_COMMAND) {
            if (size > max_command || (flags & ZT_MORE)) {
                res->status = ZT_BAD_COMMAND;
                res->size = size;
                break;
            }
            if (end - pos - head < size) {
                res->status = ZT_NEED;
                res->want = pos + head + (size_t)size;
                break;
            }
            res->status = ZT_COMMAND_AT;
            res->body = pos + head;
            res->size = size;
            break;
        }
        /* no overflow: partial <= max_message, and size is compared before it is added */
        if (size > max_message || partial + head + size > max_message) {
            res->status = ZT_TOO_LARGE;
            res->size = size;
            break;
        }
        if (end - pos - head < size) {
            res->status = ZT_NEED;
            res->want = pos + head + (size_t)size;
            break;
        }
        pos += head + (size_t)size;
        if (flags & ZT_MORE) {
            partial += head + (size_t)size;
        } else {
            complete = pos;
            partial = 0;
            messages++;
        }
    }
    res->pos = pos;
    res->complete = complete;
    res->messages = messages;
    res->partial = partial;
}

typedef struct {
    int status;      /* ZT_TAKEN_* */
    size_t pos;      /* in the connection's buffer: after the last message taken */
    int messages;    /* in the burst (in and out) */
    size_t frames;   /* frame_end entries in the burst (in and out) */
    size_t bytes;    /* bytes of the burst's buffer used (in and out) */
    size_t need;     /* FULL: bytes and frames the next message needs */
    size_t need_frames;
} zt_taken;

enum { ZT_TAKEN_ALL = 0, ZT_TAKEN_COUNT = 1, ZT_TAKEN_BYTES = 2, ZT_TAKEN_FULL = 3 };

static size_t zt_header(const unsigned char *buf, size_t pos, uint64_t *size,
                        unsigned char *flags) {
    *flags = buf[pos];
    if (*flags & ZT_LONG) {
        uint64_t s = 0;
        for (int k = 1; k <= 8; k++)
            s = s << 8 | buf[pos + k];
        *size = s;
        return 9;
    }
    *size = buf[pos + 1];
    return 2;
}

/* Whole messages of buf[pos..complete) (zt_scan walked them: well formed) appended to a burst
 * in tb_recv's shape: kept frame j ends at frame_end[j] in out, message i's true frame count
 * in counts[i]. Commands are skipped; `prefix` (a ROUTER's routing id, or NULL) goes first in
 * each message; at most max_frames frames of a message are kept. Stops after max_messages in
 * the burst, once its bytes reach max_bytes, or (FULL) before a message out or its frames
 * would not hold (need / need_frames: what it takes). The twin is wire.take. */
void zt_take(const unsigned char *buf, size_t pos, size_t complete, const char *prefix,
             size_t prefix_len, int max_frames, int max_messages, size_t max_bytes, char *out,
             size_t out_cap, size_t *frame_end, size_t frames_cap, int *counts, zt_taken *res) {
    size_t mark = pos;
    res->status = ZT_TAKEN_ALL;
    res->need = res->need_frames = 0;
    while (pos < complete) {
        if (res->messages >= max_messages) {
            res->status = ZT_TAKEN_COUNT;
            break;
        }
        if (res->bytes >= max_bytes) {
            res->status = ZT_TAKEN_BYTES;
            break;
        }
        /* first pass, headers only: what the message keeps, where it ends */
        size_t p = pos, kept_bytes = prefix ? prefix_len : 0;
        int count = prefix ? 1 : 0, data = 0;
        uint64_t size;
        unsigned char flags;
        while (p < complete) {
            size_t head = zt_header(buf, p, &size, &flags);
            p += head + (size_t)size;
            if (flags & ZT_COMMAND) {
                if (!data)
                    mark = pos = p; /* a command between messages goes with them */
                continue;
            }
            data = 1;
            count++;
            if (count <= max_frames)
                kept_bytes += (size_t)size;
            if (!(flags & ZT_MORE))
                break;
        }
        if (!data)
            break; /* only commands were left */
        size_t kept_frames = (size_t)(count < max_frames ? count : max_frames);
        if (res->bytes + kept_bytes > out_cap || res->frames + kept_frames > frames_cap) {
            res->status = ZT_TAKEN_FULL;
            res->need = kept_bytes;
            res->need_frames = kept_frames;
            break;
        }
        /* second pass: copy */
        size_t used = res->bytes, frames = res->frames;
        int n = 0;
        if (prefix) {
            memcpy(out + used, prefix, prefix_len);
            used += prefix_len;
            frame_end[frames++] = used;
            n = 1;
        }
        while (pos < p) {
            size_t head = zt_header(buf, pos, &size, &flags);
            pos += head;
            if (!(flags & ZT_COMMAND)) {
                n++;
                if (n <= max_frames) {
                    memcpy(out + used, buf + pos, (size_t)size);
                    used += (size_t)size;
                    frame_end[frames++] = used;
                }
            }
            pos += (size_t)size;
        }
        counts[res->messages++] = count;
        res->bytes = used;
        res->frames = frames;
        mark = pos;
    }
    res->pos = mark;
}

/* A prepared burst (frame j is buf[frame_end[j-1]..frame_end[j]), message i has counts[i]
 * frames: what tb_send takes, as protocol kernels lay BROADCASTs out) as ZMTP wire bytes for
 * taproom's publishers: each frame with its header, MORE on all but a message's last;
 * ends[i] is where message i ends in out. Returns the bytes written, 0 if out_cap is short
 * (the caller sizes it: the frames' bytes plus 9 a frame). */
size_t zt_wire(const char *buf, const size_t *frame_end, const int *counts, int n, char *out,
               size_t out_cap, size_t *ends) {
    size_t w = 0, f = 0, start = 0;
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < counts[i]; j++, f++) {
            size_t end = frame_end[f], size = end - start;
            if (w + (size < 256 ? 2 : 9) + size > out_cap)
                return 0;
            w += zt_put_frame((unsigned char *)out + w, buf + start, size, j + 1 < counts[i]);
            start = end;
        }
        ends[i] = w;
    }
    return w;
}
