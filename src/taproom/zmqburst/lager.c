/* The Lager forwarder's compiled kernel (issue 32), appended to burst.c by _build.py.
 *
 * lg_run works on a received Burst (one buffer, frame ends, true frame counts: the ZMTP
 * reader's shape) and takes a run of tap data messages the forwarder's Python path would take
 * as they are: the header of both framings (uuid 16 bytes, version 1-8, flags 1-2, timestamp 8),
 * a (uuid, flags, version) the Python path has already resolved to a tap's record parts
 * (servers/lager/forwarder.DataRecords, handed over with lg_taps_add), and either one frame per
 * item with the format's sizes or the seed's one frame of the row size. For each it writes the
 * journal record, byte for byte as DataRecords.parts, the message's frames as received in ZMTP
 * wire form (what the forwarder publishes to the counted output) and the message as a real Mug
 * reads it (the plain output: a seed-framed row of several items split into one frame per
 * item, as forwarder._plain_rows does). Anything else stops the run at that message: the
 * Python path handles it (refusing it with its own reason, holding it) and calls again after.
 * tests/protocols/test_lager_kernel.py holds it to the Python path with fuzzed bursts.
 */

#define LG_KEY_MAX 27 /* uuid 16 + flags length 1 + flags up to 2 + version up to 8 */

typedef struct {
    int used;
    int key_len;
    unsigned char key[LG_KEY_MAX];
    unsigned char *tail; /* the record after ts_ns: DataRecords.tail */
    size_t tail_len;
    uint32_t length;   /* the record's u32 length field */
    uint32_t row_size; /* payload bytes */
    int nitems;
    uint32_t *items; /* item sizes, in row order */
} lg_tap;

typedef struct lg_taps {
    lg_tap *slots;
    size_t mask;
    int used, limit;
} lg_taps;

typedef struct {
    int next;          /* the first message not taken */
    size_t next_frame; /* its first frame */
    int stop;          /* LG_END, LG_PYTHON (message `next` is Python's) or LG_FULL */
    int rows;          /* messages taken by this call */
    size_t out_bytes;  /* records written in out (from where the call started) */
    size_t wire_bytes; /* wire written */
    int runs;          /* runs of one uuid written to run_uuid / run_rows */
    int out_of_range;  /* rows whose timestamp is 2^63 ns or later (stored as 0) */
    size_t need;       /* LG_FULL with no row taken: the bytes the next row needs (each buffer) */
    int reframed;      /* seed-framed rows of several items: plain differs from wire */
    size_t plain_bytes; /* plain written */
} lg_ran;

enum { LG_END = 0, LG_PYTHON = 1, LG_FULL = 2 };

static uint64_t lg_hash(const unsigned char *p, size_t n) {
    uint64_t h = 1469598103934665603ULL; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ULL;
    return h;
}

#define LG_INITIAL 64 /* slots of a new or cleared table; it doubles at half full */

static int lg_alloc(lg_taps *t, size_t cap) {
    t->slots = calloc(cap, sizeof *t->slots);
    t->mask = t->slots ? cap - 1 : 0;
    return t->slots ? 0 : -1;
}

lg_taps *lg_taps_new(int limit) {
    if (limit < 1 || limit > (1 << 24))
        return NULL;
    lg_taps *t = calloc(1, sizeof *t);
    if (!t)
        return NULL;
    if (lg_alloc(t, LG_INITIAL)) {
        free(t);
        return NULL;
    }
    t->limit = limit;
    return t;
}

/* Forget every tap (the hashmap changed): back to a small table, so memory follows the taps
 * in use, not the limit. */
void lg_taps_clear(lg_taps *t) {
    if (t->slots) {
        for (size_t i = 0; i <= t->mask; i++) {
            if (t->slots[i].used) {
                free(t->slots[i].tail);
                free(t->slots[i].items);
            }
        }
        free(t->slots);
    }
    t->used = 0;
    lg_alloc(t, LG_INITIAL); /* on failure no slots: lg_find finds nothing, lg_taps_add keeps
                                nothing, every row is the Python path's */
}

void lg_taps_free(lg_taps *t) {
    if (!t)
        return;
    lg_taps_clear(t);
    free(t->slots);
    free(t);
}

static lg_tap *lg_find(const lg_taps *t, const unsigned char *key, int key_len) {
    if (!t->slots)
        return NULL;
    size_t i = lg_hash(key, (size_t)key_len) & t->mask;
    for (;;) {
        lg_tap *e = &t->slots[i];
        if (!e->used)
            return NULL;
        if (e->key_len == key_len && memcmp(e->key, key, (size_t)key_len) == 0)
            return e;
        i = (i + 1) & t->mask;
    }
}

/* The record parts of one (uuid, flags, version), keyed as lg_key lays it out. Returns 0, or
 * -1 when it is not kept (table at its limit, a bad key, no memory): the Python path then
 * goes on taking that tap's rows. */
int lg_taps_add(lg_taps *t, const char *key, int key_len, const char *tail, size_t tail_len,
                uint32_t length, uint32_t row_size, const uint32_t *items, int nitems) {
    if (key_len < 1 || key_len > LG_KEY_MAX || nitems < 1 || t->used >= t->limit)
        return -1;
    uint64_t sum = 0;
    for (int k = 0; k < nitems; k++)
        sum += items[k];
    if (sum != row_size || (uint64_t)length != 16 + (uint64_t)tail_len + row_size)
        return -1; /* not DataRecords' shape: a bug on the Python side, the kernel stays out */
    if (!t->slots)
        return -1;
    lg_tap *e = lg_find(t, (const unsigned char *)key, key_len);
    if (!e && 2 * ((size_t)t->used + 1) > t->mask + 1) { /* half full: double, rehash */
        lg_tap *old = t->slots;
        size_t old_cap = t->mask + 1;
        if (lg_alloc(t, 2 * old_cap)) {
            t->slots = old;
            t->mask = old_cap - 1;
            return -1;
        }
        for (size_t k = 0; k < old_cap; k++) {
            if (!old[k].used)
                continue;
            size_t i = lg_hash(old[k].key, (size_t)old[k].key_len) & t->mask;
            while (t->slots[i].used)
                i = (i + 1) & t->mask;
            t->slots[i] = old[k];
        }
        free(old);
    }
    if (e) {
        free(e->tail);
        free(e->items);
    } else {
        size_t i = lg_hash((const unsigned char *)key, (size_t)key_len) & t->mask;
        while (t->slots[i].used)
            i = (i + 1) & t->mask;
        e = &t->slots[i];
        t->used++;
    }
    memset(e, 0, sizeof *e);
    e->tail = malloc(tail_len ? tail_len : 1);
    e->items = malloc(sizeof *e->items * (size_t)nitems);
    if (!e->tail || !e->items) {
        free(e->tail);
        free(e->items);
        /* a slot once used stays "used" with no parts: a probe chain must not break */
        e->used = 1;
        e->key_len = 0;
        e->tail = NULL;
        e->items = NULL;
        return -1;
    }
    e->used = 1;
    e->key_len = key_len;
    memcpy(e->key, key, (size_t)key_len);
    memcpy(e->tail, tail, tail_len);
    e->tail_len = tail_len;
    e->length = length;
    e->row_size = row_size;
    e->nitems = nitems;
    memcpy(e->items, items, sizeof *e->items * (size_t)nitems);
    return 0;
}

/* Messages start..n-1 of a burst (`start_frame`: message start's first frame; frames past
 * max_frames were not kept). Records go to out, the messages' wire to wire (ends[k]: where
 * the k-th taken message ends), and per run of consecutive rows of one uuid, that uuid and
 * its row count. */
void lg_run(const lg_taps *t, const char *buf, const size_t *frame_end, const int *counts,
            int max_frames, int start, size_t start_frame, int n, int64_t received_ns,
            char *out, size_t out_cap, char *wire, size_t wire_cap, size_t *ends, int ends_cap,
            char *run_uuid, int *run_rows, int runs_cap, char *plain, size_t plain_cap,
            size_t *plain_ends, lg_ran *res) {
    const unsigned char *b = (const unsigned char *)buf;
    unsigned char *o = (unsigned char *)out, *w = (unsigned char *)wire;
    unsigned char *p = (unsigned char *)plain;
    size_t f = start_frame, ob = 0, wb = 0, pb = 0;
    int i = start, rows = 0, runs = 0, oor = 0, reframed = 0, stop = LG_END;
    const unsigned char *last_uuid = NULL;
    res->need = 0;
    for (; i < n; i++) {
        int count = counts[i];
        if (count > max_frames || count < 5) {
            stop = LG_PYTHON;
            break;
        }
        size_t s0 = f ? frame_end[f - 1] : 0;
        size_t e0 = frame_end[f], e1 = frame_end[f + 1], e2 = frame_end[f + 2],
               e3 = frame_end[f + 3];
        size_t lv = e1 - e0, lf = e2 - e1;
        if (e0 - s0 != 16 || lv < 1 || lv > 8 || lf < 1 || lf > 2 || e3 - e2 != 8) {
            stop = LG_PYTHON;
            break;
        }
        unsigned char key[LG_KEY_MAX];
        int key_len = 16 + 1 + (int)lf + (int)lv;
        memcpy(key, b + s0, 16);
        key[16] = (unsigned char)lf;
        memcpy(key + 17, b + e1, lf);
        memcpy(key + 17 + lf, b + e0, lv);
        const lg_tap *e = lg_find(t, key, key_len);
        if (!e || !e->key_len) {
            stop = LG_PYTHON;
            break;
        }
        int items = count - 4;
        size_t payload = frame_end[f + 3 + items] - e3;
        if (items == 1) {
            /* the seed's one payload frame (or nasa/lager's single item) */
            if (payload != e->row_size) {
                stop = LG_PYTHON;
                break;
            }
        } else {
            if (items != e->nitems) {
                stop = LG_PYTHON;
                break;
            }
            size_t a = e3;
            int k = 0;
            for (; k < items; k++) {
                size_t z = frame_end[f + 4 + k];
                if (z - a != e->items[k])
                    break;
                a = z;
            }
            if (k < items) {
                stop = LG_PYTHON;
                break;
            }
        }
        size_t rec = 4 + (size_t)e->length;
        size_t msg_bytes = frame_end[f + count - 1] - s0;
        size_t msg_wire = msg_bytes + 9 * ((size_t)count + (size_t)e->nitems);
        if (ob + rec > out_cap || wb + msg_wire > wire_cap || pb + msg_wire > plain_cap ||
            rows >= ends_cap || (runs >= runs_cap && last_uuid && memcmp(last_uuid, b + s0, 16))) {
            stop = LG_FULL;
            if (!rows)
                res->need = rec > msg_wire ? rec : msg_wire;
            break;
        }
        /* the record: [length, received_ns] | ts_ns | tail | payload (little-endian head) */
        unsigned char *r = o + ob;
        uint32_t len = e->length;
        for (int k = 0; k < 4; k++)
            r[k] = (unsigned char)(len >> (8 * k));
        for (int k = 0; k < 8; k++)
            r[4 + k] = (unsigned char)((uint64_t)received_ns >> (8 * k));
        const unsigned char *ts = b + e2;
        if (ts[0] >= 0x80) {
            /* 2^63 ns and on: the journal cannot hold it; stored absent, counted */
            memset(r + 12, 0, 8);
            oor++;
        } else {
            for (int k = 0; k < 8; k++)
                r[12 + k] = ts[7 - k];
        }
        memcpy(r + 20, e->tail, e->tail_len);
        memcpy(r + 20 + e->tail_len, b + e3, payload);
        ob += rec;
        /* the message as received, in ZMTP wire form */
        size_t a = s0;
        for (int k = 0; k < count; k++) {
            size_t z = frame_end[f + k];
            wb += zt_put_frame(w + wb, b + a, z - a, k + 1 < count);
            a = z;
        }
        ends[rows] = wb;
        /* as a real Mug reads it: one frame per item */
        a = s0;
        for (int k = 0; k < 4; k++) {
            size_t z = frame_end[f + k];
            pb += zt_put_frame(p + pb, b + a, z - a, 1);
            a = z;
        }
        if (items == 1 && e->nitems > 1) {
            for (int k = 0; k < e->nitems; k++) {
                pb += zt_put_frame(p + pb, b + a, e->items[k], k + 1 < e->nitems);
                a += e->items[k];
            }
            reframed++;
        } else {
            for (int k = 4; k < count; k++) {
                size_t z = frame_end[f + k];
                pb += zt_put_frame(p + pb, b + a, z - a, k + 1 < count);
                a = z;
            }
        }
        plain_ends[rows] = pb;
        if (last_uuid && memcmp(last_uuid, b + s0, 16) == 0) {
            run_rows[runs - 1]++;
        } else {
            memcpy(run_uuid + 16 * runs, b + s0, 16);
            run_rows[runs++] = 1;
            last_uuid = b + s0;
        }
        rows++;
        f += (size_t)count;
    }
    res->next = i;
    res->next_frame = f;
    res->stop = i >= n ? LG_END : stop;
    res->rows = rows;
    res->out_bytes = ob;
    res->wire_bytes = wb;
    res->runs = runs;
    res->out_of_range = oor;
    res->reframed = reframed;
    res->plain_bytes = pb;
}
