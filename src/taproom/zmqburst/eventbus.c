/* The Event BUS collector's compiled kernels (issue 32), appended to burst.c by _build.py.
 *
 * They work on a received Burst (one buffer, frame ends, true frame counts: tb_recv's shape,
 * and the ZMTP reader's), like lj_build. eb_scan validates a run of the seed's PUB commands as
 * protocols/eventbus/commands.parse_pub does, accepting only what it is certain parse_pub
 * accepts (anything else stops the run: Python handles that message, with parse_pub's own
 * refusal and reason, and calls again after it). Python then deduplicates, admits and numbers
 * the run; eb_emit writes the journal records of the admitted ones, byte for byte as
 * servers/eventbus/state.seed_record, and their BROADCASTs as one burst for tb_send.
 * tests/protocols/test_eventbus_kernel.py holds both to the Python code with fuzzed input.
 */

/* strict UTF-8 as Python's decoder: no overlong forms, no surrogates, nothing past U+10FFFF;
 * every ASCII byte (controls and NUL too) is a character. */
static int eb_utf8(const unsigned char *p, size_t n) {
    const unsigned char *e = p + n;
    while (p < e) {
        unsigned char c = *p;
        if (c < 0x80) {
            p++;
        } else if (c >= 0xC2 && c <= 0xDF) {
            if (e - p < 2 || (p[1] & 0xC0) != 0x80)
                return 0;
            p += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (e - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80)
                return 0;
            if ((c == 0xE0 && p[1] < 0xA0) || (c == 0xED && p[1] >= 0xA0))
                return 0;
            p += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (e - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 ||
                (p[3] & 0xC0) != 0x80)
                return 0;
            if ((c == 0xF0 && p[1] < 0x90) || (c == 0xF4 && p[1] >= 0x90))
                return 0;
            p += 4;
        } else {
            return 0;
        }
    }
    return 1;
}

static int eb_digits(const unsigned char *p, int n, int *value) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9')
            return 0;
        v = v * 10 + (p[i] - '0');
    }
    *value = v;
    return 1;
}

/* Days from 1970-01-01 to y-m-d (proleptic Gregorian; Howard Hinnant's days_from_civil). */
static int64_t eb_days(int y, int m, int d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

/* The timestamp forms EventTimes.iso reads on its fast path, for years 1970..2261 (always in
 * the journal's range): YYYY-MM-DD(T|t| )HH:MM:SS[.1-9 digits](Z|z|+00:00). 1 and the
 * nanoseconds in *ns, else 0 (Python decides: other forms, zones, years, or not a date). */
static int eb_timestamp(const unsigned char *t, size_t n, int64_t *ns) {
    if (n < 20 || n > 35)
        return 0;
    int year, month, day, hour, minute, second;
    if (!eb_digits(t, 4, &year) || t[4] != '-' || !eb_digits(t + 5, 2, &month) ||
        t[7] != '-' || !eb_digits(t + 8, 2, &day) ||
        !(t[10] == 'T' || t[10] == 't' || t[10] == ' ') || !eb_digits(t + 11, 2, &hour) ||
        t[13] != ':' || !eb_digits(t + 14, 2, &minute) || t[16] != ':' ||
        !eb_digits(t + 17, 2, &second))
        return 0;
    size_t end; /* where the zone starts */
    if (t[n - 1] == 'Z' || t[n - 1] == 'z')
        end = n - 1;
    else if (n >= 25 && memcmp(t + n - 6, "+00:00", 6) == 0)
        end = n - 6;
    else
        return 0;
    int64_t frac = 0;
    if (end > 19) {
        size_t digits = end - 20;
        if (t[19] != '.' || digits < 1 || digits > 9)
            return 0;
        for (size_t i = 20; i < end; i++) {
            if (t[i] < '0' || t[i] > '9')
                return 0;
            frac = frac * 10 + (t[i] - '0');
        }
        for (size_t i = digits; i < 9; i++)
            frac *= 10;
    } else if (end != 19) {
        return 0;
    }
    static const int month_days[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (year < 1970 || year > 2261 || month < 1 || month > 12 || day < 1 || hour > 23 ||
        minute > 59 || second > 59)
        return 0;
    int leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    if (day > month_days[month - 1] + (month == 2 && leap))
        return 0;
    int64_t seconds = eb_days(year, month, day) * 86400 + hour * 3600 + minute * 60 + second;
    *ns = seconds * 1000000000LL + frac;
    return 1;
}

static int eb_hex(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* An RFC 4122 v4 UUID in its 8-4-4-4-12 text form (commands._UUID4), lowercased into out. */
static int eb_uuid4(const unsigned char *u, size_t n, char *out) {
    if (n != 36)
        return 0;
    for (int i = 0; i < 36; i++) {
        unsigned char c = u[i];
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (c != '-')
                return 0;
        } else if (!eb_hex(c)) {
            return 0;
        }
        out[i] = (char)(c >= 'A' && c <= 'F' ? c + 32 : c);
    }
    return u[14] == '4' && (out[19] == '8' || out[19] == '9' || out[19] == 'a' || out[19] == 'b');
}

#define EB_MSGPACK_DEPTH 32

/* 1 when data is one complete MessagePack value msgpack.unpackb(raw=True, use_list=False,
 * strict_map_key=False) certainly accepts; 0 when it is not, or not certain here (ext types,
 * a map key that is not a scalar, nesting past EB_MSGPACK_DEPTH): Python decides. */
static int eb_msgpack(const unsigned char *p, size_t n) {
    const unsigned char *e = p + n;
    uint64_t left[EB_MSGPACK_DEPTH + 1]; /* items still to read in each open container */
    unsigned char map[EB_MSGPACK_DEPTH + 1];
    int depth = 0;
    left[0] = 1;
    map[0] = 0;
    while (depth > 0 || left[0] > 0) {
        if (left[depth] == 0) {
            depth--;
            continue;
        }
        /* a map's key is item 2k of its 2 * count items: it must be a scalar */
        int key = map[depth] && (left[depth] % 2 == 0);
        left[depth]--;
        if (p >= e)
            return 0;
        unsigned char c = *p++;
        uint64_t len = 0, items = 0;
        int container = 0, is_map = 0;
        if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) {
            continue;
        } else if (c >= 0x80 && c <= 0x8f) {
            items = (uint64_t)(c & 0x0f) * 2, container = is_map = 1;
        } else if (c >= 0x90 && c <= 0x9f) {
            items = c & 0x0f, container = 1;
        } else if (c >= 0xa0 && c <= 0xbf) {
            len = c & 0x1f;
        } else {
            size_t need;
            switch (c) {
            case 0xcc: case 0xd0: need = 1; break;
            case 0xcd: case 0xd1: need = 2; break;
            case 0xca: case 0xce: case 0xd2: need = 4; break;
            case 0xcb: case 0xcf: case 0xd3: need = 8; break;
            case 0xc4: case 0xd9: need = 1; break; /* bin8, str8: 1-byte length */
            case 0xc5: case 0xda: case 0xdc: case 0xde: need = 2; break;
            case 0xc6: case 0xdb: case 0xdd: case 0xdf: need = 4; break;
            default: return 0; /* 0xc1, ext types: Python decides */
            }
            if ((size_t)(e - p) < need)
                return 0;
            uint64_t v = 0;
            for (size_t k = 0; k < need; k++)
                v = v << 8 | p[k];
            p += need;
            if (c == 0xc4 || c == 0xc5 || c == 0xc6 || c == 0xd9 || c == 0xda || c == 0xdb)
                len = v;
            else if (c == 0xdc || c == 0xdd)
                items = v, container = 1;
            else if (c == 0xde || c == 0xdf)
                items = v * 2, container = is_map = 1;
            else
                continue; /* a number: its bytes are read */
        }
        if (container) {
            if (key)
                return 0; /* a tuple or dict key: hashable or not, Python decides */
            if (items > (uint64_t)(e - p))
                return 0; /* every item takes a byte at least: incomplete */
            if (items == 0)
                continue;
            if (depth == EB_MSGPACK_DEPTH)
                return 0;
            depth++;
            left[depth] = items;
            map[depth] = (unsigned char)is_map;
            continue;
        }
        if (len > (uint64_t)(e - p))
            return 0;
        p += len;
    }
    return p == e; /* extra bytes: ExtraData */
}

typedef struct {
    int next;          /* the first message not scanned */
    size_t next_frame; /* its first frame's index */
    int slow;          /* 1: message `next` is left to Python */
    int scanned;       /* messages [start, next) are valid: their items are filled */
} eb_scanned;

/* Validate messages [start, n) of a COLLECTOR burst (routing id, topic, sequence, producer,
 * timestamp, uuid, data), at most `cap` of them, until one Python must handle (res->slow).
 * For the k-th valid message: ts_ns[k], its lowercased uuid at uuids + 36 k. */
void eb_scan(const char *buf, const size_t *frame_end, const int *counts, int max_frames,
             int start, size_t start_frame, int n, size_t max_topic, size_t max_producer,
             size_t max_data, int64_t *ts_ns, char *uuids, int cap, eb_scanned *res) {
    size_t frame = start_frame;
    size_t pos = frame ? frame_end[frame - 1] : 0;
    int i, k = 0;
    res->slow = 0;
    for (i = start; i < n && k < cap; i++) {
        int count = counts[i];
        if (count != 7 || max_frames < 7) {
            res->slow = 1;
            break;
        }
        const unsigned char *f[7];
        size_t len[7];
        size_t p = pos;
        for (int j = 0; j < 7; j++) {
            f[j] = (const unsigned char *)buf + p;
            len[j] = frame_end[frame + j] - p;
            p = frame_end[frame + j];
        }
        /* topic: '/' first, UTF-8, bounded (and within records.py's u16 fields) */
        if (len[1] == 0 || len[1] > max_topic || len[1] > 0xFFFF || f[1][0] != '/' ||
            !eb_utf8(f[1], len[1]))
            goto slow;
        /* the producer's sequence: 8 bytes that are not all digits, or empty (as sent; the
         * bus numbers the event) */
        if (len[2] == 8) {
            int digits = 1;
            for (int j = 0; j < 8; j++)
                digits &= f[2][j] >= '0' && f[2][j] <= '9';
            if (digits)
                goto slow;
        } else if (len[2] != 0) {
            goto slow;
        }
        if (len[3] > max_producer || len[3] > 0xFFFF || !eb_utf8(f[3], len[3]))
            goto slow;
        if (!eb_timestamp(f[4], len[4], &ts_ns[k]))
            goto slow;
        if (!eb_uuid4(f[5], len[5], uuids + 36 * (size_t)k))
            goto slow;
        /* an empty data frame stands for nil (Python stores b"\xc0"): left to Python */
        if (len[6] == 0 || len[6] > max_data || !eb_msgpack(f[6], len[6]))
            goto slow;
        k++;
        frame += 7;
        pos = frame_end[frame - 1];
        continue;
    slow:
        res->slow = 1;
        break;
    }
    res->next = i;
    res->next_frame = frame;
    res->scanned = k;
}

typedef struct {
    size_t out_bytes;   /* in and out: bytes of records in out */
    size_t bc_frames;   /* in and out: BROADCAST frames in bc (6 a message) */
    size_t bc_bytes;    /* in and out: bytes in bc */
    int error;          /* 1: a buffer was too small (the caller sizes them: a bug) */
    int emitted;        /* messages written (all of them unless error) */
} eb_emitted;

#define EB_HEAD 46 /* records.RECORD_HEAD: <IqqQBBHHHHII */

static void eb_le(unsigned char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++, v >>= 8)
        p[i] = (unsigned char)v;
}

/* Records and BROADCASTs of the admitted messages: the j-th has its first frame (the routing
 * id) at first_frames[j] in the burst, bus sequence seqs[j] and scan item items[j] (ts_ns and
 * uuid). Records are state.seed_record's bytes, appended to out from res->out_bytes; a
 * BROADCAST (topic, sequence as 8 bytes in network order, producer, timestamp, the lowercased
 * uuid, data) is appended to the burst in bc from res->bc_bytes / res->bc_frames, so one
 * buffer can gather the BROADCASTs of a whole journal batch for one tb_send. */
void eb_emit(const char *buf, const size_t *frame_end, const size_t *first_frames,
             const uint64_t *seqs, const int *items, int count, const int64_t *ts_ns,
             const char *uuids, int64_t received_ns, char *out, size_t out_cap, char *bc,
             size_t bc_cap, size_t *bc_end, size_t bc_end_cap, eb_emitted *res) {
    static const char middle[] = "eventbusmsgpack"; /* protocol, content type */
    size_t o = res->out_bytes, b = res->bc_bytes, fr = res->bc_frames;
    res->error = 0;
    res->emitted = 0;
    for (int j = 0; j < count; j++) {
        size_t frame = first_frames[j];
        size_t p = frame ? frame_end[frame - 1] : 0;
        const char *f[7];
        size_t len[7];
        for (int q = 0; q < 7; q++) {
            f[q] = buf + p;
            len[q] = frame_end[frame + q] - p;
            p = frame_end[frame + q];
        }
        const char *topic = f[1], *producer = f[3], *ts = f[4], *data = f[6];
        size_t lt = len[1], lp = len[3], lts = len[4], ld = len[6];
        /* stream: topic.split(b"/", 2)[1] */
        const char *stream = topic + 1;
        const char *slash = memchr(stream, '/', lt - 1);
        size_t ls = slash ? (size_t)(slash - stream) : lt - 1;
        size_t la = 14 + lts + 2; /* {"timestamp":"...."} */
        size_t size = EB_HEAD + 15 + ls + lt + lp + 36 + la + ld;
        size_t bsize = lt + 8 + lp + lts + 36 + ld;
        if (o + size > out_cap || b + bsize > bc_cap || fr + 6 > bc_end_cap) {
            res->error = 1;
            break;
        }
        const char *uuid = uuids + 36 * (size_t)items[j];
        unsigned char *h = (unsigned char *)out + o;
        eb_le(h, size - 4, 4);
        eb_le(h + 4, (uint64_t)received_ns, 8);
        eb_le(h + 12, (uint64_t)ts_ns[items[j]], 8);
        eb_le(h + 20, seqs[j], 8);
        h[28] = 8;
        h[29] = 7;
        eb_le(h + 30, ls, 2);
        eb_le(h + 32, lt, 2);
        eb_le(h + 34, lp, 2);
        eb_le(h + 36, 36, 2);
        eb_le(h + 38, la, 4);
        eb_le(h + 42, ld, 4);
        char *q = (char *)h + EB_HEAD;
        memcpy(q, middle, 15);
        q += 15;
        memcpy(q, stream, ls);
        q += ls;
        memcpy(q, topic, lt);
        q += lt;
        memcpy(q, producer, lp);
        q += lp;
        memcpy(q, uuid, 36);
        q += 36;
        memcpy(q, "{\"timestamp\":\"", 14);
        q += 14;
        memcpy(q, ts, lts);
        q += lts;
        memcpy(q, "\"}", 2);
        q += 2;
        memcpy(q, data, ld);
        o += size;
        /* the BROADCAST */
        char *c = bc + b;
        memcpy(c, topic, lt);
        c += lt;
        bc_end[fr++] = (size_t)(c - bc);
        for (int k = 0; k < 8; k++)
            c[k] = (char)(seqs[j] >> (8 * (7 - k)));
        c += 8;
        bc_end[fr++] = (size_t)(c - bc);
        memcpy(c, producer, lp);
        c += lp;
        bc_end[fr++] = (size_t)(c - bc);
        memcpy(c, ts, lts);
        c += lts;
        bc_end[fr++] = (size_t)(c - bc);
        memcpy(c, uuid, 36);
        c += 36;
        bc_end[fr++] = (size_t)(c - bc);
        memcpy(c, data, ld);
        c += ld;
        bc_end[fr++] = (size_t)(c - bc);
        b = (size_t)(c - bc);
        res->emitted = j + 1;
    }
    res->out_bytes = o;
    res->bc_frames = fr;
    res->bc_bytes = b;
}

/* --- The CHP dialect: the Guide's kvmsg updates (key, sequence, uuid, properties, body) ------
 *
 * eb_kv_scan validates a run of kvmsg updates from the CHP collector (PULL or SUB: no routing
 * id) as protocols/eventbus/kvmsg.parse_update does, taking only what it is certain
 * parse_update accepts: a uuid of 16 bytes (an empty one, which the server replaces with one
 * of its own, is left to Python), properties that are only producer and timestamp lines and
 * one ttl in whole seconds (a fraction, a second ttl and every other property are left to
 * Python), a timestamp eb_timestamp reads (one the
 * journal cannot hold is left to Python, which counts it). Python deduplicates, admits and
 * numbers the run; eb_kv_emit writes the journal records as state.journal_event does for a
 * kvmsg event, and the seed's BROADCASTs and the CHP publisher's kvmsgs, each as one burst.
 */

typedef struct {
    size_t producer;      /* offset of the producer value in the burst's buffer */
    size_t producer_len;  /* 0: no producer */
    size_t timestamp;     /* offset of the timestamp value */
    size_t timestamp_len; /* 0: none, the server's receive time stands for it */
    size_t entry;         /* state.entry_bytes of the event (0: an empty body, a deletion) */
    size_t ttl;           /* offset of the ttl value (whole seconds) */
    size_t ttl_len;       /* 0: no ttl */
    int64_t expires_ms;   /* the ttl's deadline (0: none, or a ttl of 0) */
} eb_kv_item;

#define EB_MAX_TTL_S 315360000 /* kvmsg.MAX_TTL_S: ten years */

/* The properties frame at offset `base`: 1 when it holds only producer and timestamp lines
 * parse_update takes (the last of each wins, as there), their values' spans in *item and the
 * time in *ns; 0: Python decides. */
static int eb_kv_properties(const unsigned char *p0, size_t n, size_t base,
                            size_t max_producer, eb_kv_item *item, int64_t *ns) {
    const unsigned char *p = p0, *e = p0 + n;
    item->producer = item->producer_len = item->timestamp = item->timestamp_len = 0;
    item->ttl = item->ttl_len = 0;
    item->expires_ms = 0;
    if (!eb_utf8(p0, n))
        return 0;
    while (p < e) {
        const unsigned char *nl = memchr(p, '\n', (size_t)(e - p));
        const unsigned char *end = nl ? nl : e;
        if (end > p) { /* empty lines are skipped */
            const unsigned char *eq = memchr(p, '=', (size_t)(end - p));
            if (!eq)
                return 0;
            size_t name = (size_t)(eq - p), len = (size_t)(end - eq - 1);
            size_t at = base + (size_t)(eq + 1 - p0);
            if (name == 8 && memcmp(p, "producer", 8) == 0) {
                if (len > max_producer || len > 0xFFFF)
                    return 0;
                item->producer = at;
                item->producer_len = len;
            } else if (name == 3 && memcmp(p, "ttl", 3) == 0) {
                /* whole seconds within kvmsg.MAX_TTL_S, once (a second ttl line stays in
                 * the properties twice there: Python decides) */
                if (item->ttl_len || len < 1 || len > 12)
                    return 0;
                int64_t seconds = 0;
                for (size_t j = 0; j < len; j++) {
                    unsigned char c = eq[1 + j];
                    if (c < '0' || c > '9')
                        return 0;
                    seconds = seconds * 10 + (c - '0');
                }
                if (seconds > EB_MAX_TTL_S)
                    return 0;
                item->ttl = at;
                item->ttl_len = len;
                item->expires_ms = seconds * 1000; /* the scan adds the receive time */
            } else if (name == 9 && memcmp(p, "timestamp", 9) == 0) {
                if (!eb_timestamp(eq + 1, len, ns))
                    return 0;
                item->timestamp = at;
                item->timestamp_len = len;
            } else {
                return 0; /* any other property, a line that is not name=value */
            }
        }
        p = end + 1;
    }
    return 1;
}

/* The bytes of the seed's data frame for a body: a MessagePack bin (state.chp_data), or
 * nothing for a deletion. */
static size_t eb_bin_head(size_t len) {
    return len == 0 ? 0 : len < 0x100 ? 2 : len < 0x10000 ? 3 : 5;
}

#define EB_ENTRY_OVERHEAD 640 /* state.ENTRY_OVERHEAD */

/* Validate updates [start, n) of a CHP collector burst, at most `cap` of them, until one
 * Python must handle (res->slow). For the k-th valid one: ts_ns[k] (received_ns when it has
 * no timestamp), its uuid's text at uuids + 36 k, its spans and charge in items[k]; the
 * charge counts the receive time's text (received_len) when it has no timestamp. */
void eb_kv_scan(const char *buf, const size_t *frame_end, const int *counts, int max_frames,
                int start, size_t start_frame, int n, size_t max_topic, size_t max_producer,
                size_t max_data, size_t max_properties, int64_t received_ns,
                size_t received_len, int64_t *ts_ns, char *uuids, eb_kv_item *items, int cap,
                eb_scanned *res) {
    static const char hex[] = "0123456789abcdef";
    size_t frame = start_frame;
    size_t pos = frame ? frame_end[frame - 1] : 0;
    int i, k = 0;
    res->slow = 0;
    for (i = start; i < n && k < cap; i++) {
        if (counts[i] != 5 || max_frames < 5) {
            res->slow = 1;
            break;
        }
        const unsigned char *f[5];
        size_t len[5], at[5];
        size_t p = pos;
        for (int j = 0; j < 5; j++) {
            at[j] = p;
            f[j] = (const unsigned char *)buf + p;
            len[j] = frame_end[frame + j] - p;
            p = frame_end[frame + j];
        }
        /* key: '/' first, UTF-8, bounded (and within records.py's u16 fields) */
        if (len[0] == 0 || len[0] > max_topic || len[0] > 0xFFFF || f[0][0] != '/' ||
            !eb_utf8(f[0], len[0]))
            goto slow;
        if (len[1] != 8)
            goto slow;
        /* uuid: 16 bytes of an RFC 4122 version 4 UUID */
        if (len[2] != 16 || (f[2][6] >> 4) != 4 || (f[2][8] & 0xC0) != 0x80)
            goto slow;
        if (len[4] > max_data)
            goto slow;
        if (len[3] > max_properties)
            goto slow;
        eb_kv_item *item = &items[k];
        ts_ns[k] = received_ns;
        if (!eb_kv_properties(f[3], len[3], at[3], max_producer, item, &ts_ns[k]))
            goto slow;
        if (item->expires_ms) /* chp_event: the receive time's ms + the ttl's */
            item->expires_ms += received_ns / 1000000;
        char *u = uuids + 36 * (size_t)k;
        for (int b = 0, o = 0; b < 16; b++) {
            if (b == 4 || b == 6 || b == 8 || b == 10)
                u[o++] = '-';
            u[o++] = hex[f[2][b] >> 4];
            u[o++] = hex[f[2][b] & 15];
        }
        if (len[4]) {
            size_t ts_len = item->timestamp_len ? item->timestamp_len : received_len;
            /* entry_bytes: topic, producer, timestamp, data (the bin), chp (no other
             * properties, the body) */
            item->entry = EB_ENTRY_OVERHEAD + len[0] + item->producer_len + ts_len +
                          eb_bin_head(len[4]) + 2 * len[4] + (item->ttl_len ? 5 + item->ttl_len : 0);
        } else {
            item->entry = 0;
        }
        k++;
        frame += 5;
        pos = frame_end[frame - 1];
        continue;
    slow:
        res->slow = 1;
        break;
    }
    res->next = i;
    res->next_frame = frame;
    res->scanned = k;
}

typedef struct {
    size_t out_bytes; /* in and out: bytes of records in out */
    size_t bc_frames; /* in and out: BROADCAST frames in bc (6 a message) */
    size_t bc_bytes;  /* in and out: bytes in bc */
    size_t kv_frames; /* in and out: kvmsg frames in kv (5 a message) */
    size_t kv_bytes;  /* in and out: bytes in kv */
    int error;        /* 1: a buffer was too small (the caller sizes them: a bug) */
    int emitted;      /* messages written (all of them unless error) */
} eb_kv_emitted;

static char *eb_put(char *c, const void *src, size_t n) {
    memcpy(c, src, n);
    return c + n;
}

/* Records, BROADCASTs and kvmsgs of the admitted updates: the j-th has its first frame (the
 * key) at first_frames[j] in the burst, bus sequence seqs[j] and scan item items[j]. An
 * update without a timestamp takes the receive time's text (received, received_len).
 *
 * Record (state.journal_event of a kvmsg event): protocol "eventbus", content type "raw",
 * stream, topic, producer, uuid text, attrs {"timestamp":..,"dialect":"chp"} (and
 * "delete":true for an empty body, as orjson writes them), the body. BROADCAST: topic,
 * sequence, producer, timestamp, uuid text, the body as a MessagePack bin (empty: a
 * deletion). kvmsg (state.kv_frames): key, sequence, the 16-byte uuid, producer= (when not
 * empty) and timestamp= lines, the body. */
void eb_kv_emit(const char *buf, const size_t *frame_end, const size_t *first_frames,
                const uint64_t *seqs, const int *items, int count, const int64_t *ts_ns,
                const char *uuids, const eb_kv_item *kv_items, const char *received,
                size_t received_len, int64_t received_ns, char *out, size_t out_cap, char *bc,
                size_t bc_cap, size_t *bc_end, size_t bc_end_cap, char *kv, size_t kv_cap,
                size_t *kv_end, size_t kv_end_cap, eb_kv_emitted *res) {
    static const char middle[] = "eventbusraw"; /* protocol, content type */
    static const char attrs_head[] = "{\"timestamp\":\"";
    static const char attrs_tail[] = "\",\"dialect\":\"chp\"";
    static const char attrs_delete[] = ",\"delete\":true";
    static const char attrs_ttl[] = ",\"properties\":\"ttl="; /* then the value, \\n" */
    static const char attrs_expires[] = ",\"expires_ms\":";
    size_t o = res->out_bytes, b = res->bc_bytes, fr = res->bc_frames;
    size_t v = res->kv_bytes, kfr = res->kv_frames;
    res->error = 0;
    res->emitted = 0;
    for (int j = 0; j < count; j++) {
        size_t frame = first_frames[j];
        size_t p = frame ? frame_end[frame - 1] : 0;
        const char *f[5];
        size_t len[5];
        for (int q = 0; q < 5; q++) {
            f[q] = buf + p;
            len[q] = frame_end[frame + q] - p;
            p = frame_end[frame + q];
        }
        const eb_kv_item *item = &kv_items[items[j]];
        const char *topic = f[0], *body = f[4];
        size_t lt = len[0], lb = len[4];
        const char *producer = buf + item->producer;
        size_t lp = item->producer_len;
        const char *ts = item->timestamp_len ? buf + item->timestamp : received;
        size_t lts = item->timestamp_len ? item->timestamp_len : received_len;
        /* stream: topic.split("/", 2)[1] */
        const char *stream = topic + 1;
        const char *slash = memchr(stream, '/', lt - 1);
        size_t ls = slash ? (size_t)(slash - stream) : lt - 1;
        const char *ttl = buf + item->ttl;
        size_t lv = item->ttl_len;
        char expires[24]; /* the deadline's decimal digits, as orjson writes an int */
        size_t le = 0;
        if (item->expires_ms) {
            char rev[24];
            for (uint64_t e = (uint64_t)item->expires_ms; e; e /= 10)
                rev[le++] = (char)('0' + e % 10);
            for (size_t d = 0; d < le; d++)
                expires[d] = rev[le - 1 - d];
        }
        size_t la = (sizeof attrs_head - 1) + lts + (sizeof attrs_tail - 1) +
                    (lv ? sizeof attrs_ttl - 1 + lv + 3 : 0) +
                    (lb ? 0 : sizeof attrs_delete - 1) + (le ? sizeof attrs_expires - 1 + le : 0) +
                    1;
        size_t size = EB_HEAD + 11 + ls + lt + lp + 36 + la + lb;
        size_t bin = eb_bin_head(lb);
        size_t bsize = lt + 8 + lp + lts + 36 + bin + lb;
        size_t props = (lp ? 10 + lp : 0) + 11 + lts + (lv ? 5 + lv : 0);
        size_t vsize = lt + 8 + 16 + props + lb;
        if (o + size > out_cap || b + bsize > bc_cap || fr + 6 > bc_end_cap ||
            v + vsize > kv_cap || kfr + 5 > kv_end_cap) {
            res->error = 1;
            break;
        }
        const char *uuid = uuids + 36 * (size_t)items[j];
        uint64_t seq = seqs[j];
        unsigned char *h = (unsigned char *)out + o;
        eb_le(h, size - 4, 4);
        eb_le(h + 4, (uint64_t)received_ns, 8);
        eb_le(h + 12, (uint64_t)ts_ns[items[j]], 8);
        eb_le(h + 20, seq, 8);
        h[28] = 8;
        h[29] = 3;
        eb_le(h + 30, ls, 2);
        eb_le(h + 32, lt, 2);
        eb_le(h + 34, lp, 2);
        eb_le(h + 36, 36, 2);
        eb_le(h + 38, la, 4);
        eb_le(h + 42, lb, 4);
        char *q = (char *)h + EB_HEAD;
        q = eb_put(q, middle, 11);
        q = eb_put(q, stream, ls);
        q = eb_put(q, topic, lt);
        q = eb_put(q, producer, lp);
        q = eb_put(q, uuid, 36);
        q = eb_put(q, attrs_head, sizeof attrs_head - 1);
        q = eb_put(q, ts, lts);
        q = eb_put(q, attrs_tail, sizeof attrs_tail - 1);
        if (lv) { /* the properties Python keeps: "ttl=<value>\n" as a JSON string */
            q = eb_put(q, attrs_ttl, sizeof attrs_ttl - 1);
            q = eb_put(q, ttl, lv);
            q = eb_put(q, "\\n\"", 3);
        }
        if (!lb)
            q = eb_put(q, attrs_delete, sizeof attrs_delete - 1);
        if (le) {
            q = eb_put(q, attrs_expires, sizeof attrs_expires - 1);
            q = eb_put(q, expires, le);
        }
        *q++ = '}';
        eb_put(q, body, lb);
        o += size;
        /* the BROADCAST */
        char seq_be[8];
        for (int k = 0; k < 8; k++)
            seq_be[k] = (char)(seq >> (8 * (7 - k)));
        char *c = bc + b;
        c = eb_put(c, topic, lt);
        bc_end[fr++] = (size_t)(c - bc);
        c = eb_put(c, seq_be, 8);
        bc_end[fr++] = (size_t)(c - bc);
        c = eb_put(c, producer, lp);
        bc_end[fr++] = (size_t)(c - bc);
        c = eb_put(c, ts, lts);
        bc_end[fr++] = (size_t)(c - bc);
        c = eb_put(c, uuid, 36);
        bc_end[fr++] = (size_t)(c - bc);
        if (bin == 2) {
            *c++ = (char)0xc4;
            *c++ = (char)lb;
        } else if (bin == 3) {
            *c++ = (char)0xc5;
            *c++ = (char)(lb >> 8);
            *c++ = (char)lb;
        } else if (bin == 5) {
            *c++ = (char)0xc6;
            for (int k = 3; k >= 0; k--)
                *c++ = (char)(lb >> (8 * k));
        }
        c = eb_put(c, body, lb);
        bc_end[fr++] = (size_t)(c - bc);
        b = (size_t)(c - bc);
        /* the kvmsg */
        char *w = kv + v;
        w = eb_put(w, topic, lt);
        kv_end[kfr++] = (size_t)(w - kv);
        w = eb_put(w, seq_be, 8);
        kv_end[kfr++] = (size_t)(w - kv);
        w = eb_put(w, f[2], 16);
        kv_end[kfr++] = (size_t)(w - kv);
        if (lp) {
            w = eb_put(w, "producer=", 9);
            w = eb_put(w, producer, lp);
            *w++ = '\n';
        }
        w = eb_put(w, "timestamp=", 10);
        w = eb_put(w, ts, lts);
        *w++ = '\n';
        if (lv) {
            w = eb_put(w, "ttl=", 4);
            w = eb_put(w, ttl, lv);
            *w++ = '\n';
        }
        kv_end[kfr++] = (size_t)(w - kv);
        w = eb_put(w, body, lb);
        kv_end[kfr++] = (size_t)(w - kv);
        v = (size_t)(w - kv);
        res->emitted = j + 1;
    }
    res->out_bytes = o;
    res->bc_frames = fr;
    res->bc_bytes = b;
    res->kv_frames = kfr;
    res->kv_bytes = v;
}

/* ---- snapshot: a run of prepared messages to one ROUTER peer ------------------------------ */

/* Messages start..n-1 of a snapshot out of a ROUTER to the peer `identity`. `messages` is a
 * list of tuples of `per` bytes (per <= EB_SNAP_MAX_PER: the hashmap entries' frames, as a
 * snapshot takes them); each message is the identity frame, then `head` (the seed's SYNC; none
 * when head is NULL), then the tuple's frames, read from the tuple as the message goes: no copy
 * and no Python object made. One pass over the entries, fetched a few messages ahead: a
 * 100,000-key snapshot's entries are scattered over the heap, and a first pass that only
 * gathered where the frames were (eb_snap_frames, until issue 32) left most of them out of the
 * cache again by the time they were sent.
 *
 * Called through ctypes.PyDLL, so with the GIL held (the tuples are read with the C API), for a
 * run of keys the caller bounds (~0.55 us a key); the caller keeps the list alive for the call.
 * A message is checked whole before its first frame goes: an item that is not a tuple of `per`
 * bytes stops the run there with *error = -1. The identity goes with DONTWAIT: under
 * ROUTER_MANDATORY a peer whose pipe is at its high-water mark refuses it (EAGAIN), and libzmq
 * counts its mark in whole messages, so once the identity is taken the rest of the message is
 * too. Returns the index of the first message not sent (n: all); *error is 0, or EAGAIN (the
 * peer is full: try again from there later), or the errno of another failure (EHOSTUNREACH:
 * the peer went away), or -1 (a ragged item). */
#define EB_SNAP_MAX_PER 8
#define EB_SNAP_AHEAD 8 /* messages whose tuple (and, half as far, frames) are prefetched */

static int eb_snap_message(PyObject *messages, long i, int per, const char **ptrs,
                           size_t *lens) {
    PyObject *message = PyList_GetItem(messages, i);
    if (message == NULL || !PyTuple_Check(message) || PyTuple_Size(message) != per)
        return 0;
    for (int j = 0; j < per; j++) {
        char *data;
        Py_ssize_t size;
        PyObject *frame = PyTuple_GetItem(message, j);
        if (frame == NULL || !PyBytes_Check(frame) ||
            PyBytes_AsStringAndSize(frame, &data, &size) < 0)
            return 0;
        ptrs[j] = data;
        lens[j] = (size_t)size;
    }
    return 1;
}

long eb_snap_send(void *sock, const char *identity, size_t identity_len, const char *head,
                  size_t head_len, PyObject *messages, long start, long n, int per, int *error) {
    const char *ptrs[EB_SNAP_MAX_PER];
    size_t lens[EB_SNAP_MAX_PER];
    *error = 0;
    if (!PyList_Check(messages) || per < 1 || per > EB_SNAP_MAX_PER || start < 0 ||
        n > (long)PyList_Size(messages)) {
        *error = -1;
        return start;
    }
    for (long i = start; i < n; i++) {
        if (i + EB_SNAP_AHEAD < n)
            __builtin_prefetch(PyList_GetItem(messages, i + EB_SNAP_AHEAD));
        if (i + EB_SNAP_AHEAD / 2 < n) { /* its frames, once the tuple is in the cache */
            PyObject *ahead = PyList_GetItem(messages, i + EB_SNAP_AHEAD / 2);
            if (ahead != NULL && PyTuple_Check(ahead) && PyTuple_Size(ahead) == per)
                for (int j = 0; j < per; j++)
                    __builtin_prefetch(PyTuple_GetItem(ahead, j));
        }
        if (!eb_snap_message(messages, i, per, ptrs, lens)) {
            PyErr_Clear(); /* PyTuple_GetItem's IndexError and the like: a ragged item */
            *error = -1;
            return i;
        }
        if (z_send(sock, identity, identity_len, TB_DONTWAIT | TB_SNDMORE) < 0 ||
            (head != NULL && z_send(sock, head, head_len, TB_SNDMORE) < 0)) {
            *error = z_errno();
            return i;
        }
        for (int j = 0; j < per; j++) {
            if (z_send(sock, ptrs[j], lens[j], j + 1 < per ? TB_SNDMORE : 0) < 0) {
                *error = z_errno(); /* the router drops the part sent: go on after it */
                return i + 1;
            }
        }
    }
    return n;
}
