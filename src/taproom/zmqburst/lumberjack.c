/* The Lumberjack window kernel (issue 32), appended to burst.c by _build.py.
 *
 * lw_run takes a run of J frames from the bytes the decoder is parsing (a socket read, or what
 * a C frame inflated to) and writes their journal records, byte for byte as the Python J path
 * of protocols/lumberjack/decoder.py: one pass over each payload checks it is JSON orjson
 * certainly accepts (tb_json_valid's rules) and finds the stream and topic along the configured
 * dotted paths and the @timestamp, with JSON's rules (the last of duplicate keys wins, lengths
 * in characters). It takes only what it is certain of and stops before anything else: another
 * frame type or version, an incomplete frame, a payload it is not certain of (escaped keys or
 * names, long numbers, a time outside its fast forms, not JSON at all), no room, a record
 * larger than its output buffer (1 MiB), or the end of the sender's window or of the batch;
 * the Python decoder then handles that frame itself (its refusals, stalls, resend recognition
 * and window bookkeeping stay one implementation) and calls again after it.
 * tests/protocols/test_lumberjack_kernel.py holds it to the Python path with fuzzed windows.
 */

#define LW_PATHS 16 /* configured stream and topic paths, and @timestamp */
#define LW_PARTS 8  /* components of one dotted path */

typedef struct {
    int npaths;  /* stream paths, then topic paths, then @timestamp */
    int nstream;
    int ntopic;
    int nparts[LW_PATHS];
    size_t part_at[LW_PATHS][LW_PARTS];
    size_t part_len[LW_PATHS][LW_PARTS];
    char *text;
} lw_paths;

/* Paths as the decoder compiles them: nstream + ntopic paths, path i of parts[i] components,
 * the k-th component being text[ends[k-1]:ends[k]]. NULL when they do not fit the kernel
 * (the decoder then parses every payload in Python). */
lw_paths *lw_paths_new(int nstream, int ntopic, const int *parts, const char *text,
                       const size_t *ends) {
    int npaths = nstream + ntopic;
    if (nstream < 0 || ntopic < 0 || npaths + 1 > LW_PATHS)
        return NULL;
    size_t total = 0;
    int components = 0;
    for (int i = 0; i < npaths; i++) {
        if (parts[i] < 1 || parts[i] > LW_PARTS)
            return NULL;
        components += parts[i];
    }
    total = components ? ends[components - 1] : 0;
    lw_paths *paths = calloc(1, sizeof *paths);
    if (paths == NULL)
        return NULL;
    paths->text = malloc(total + sizeof "@timestamp");
    if (paths->text == NULL) {
        free(paths);
        return NULL;
    }
    memcpy(paths->text, text, total);
    memcpy(paths->text + total, "@timestamp", 10);
    int k = 0;
    for (int i = 0; i < npaths; i++) {
        paths->nparts[i] = parts[i];
        for (int j = 0; j < parts[i]; j++, k++) {
            size_t start = k ? ends[k - 1] : 0;
            paths->part_at[i][j] = start;
            paths->part_len[i][j] = ends[k] - start;
        }
    }
    paths->nparts[npaths] = 1;
    paths->part_at[npaths][0] = total;
    paths->part_len[npaths][0] = 10;
    paths->npaths = npaths + 1;
    paths->nstream = nstream;
    paths->ntopic = ntopic;
    return paths;
}

void lw_paths_free(lw_paths *paths) {
    if (paths == NULL)
        return;
    free(paths->text);
    free(paths);
}

/* What a path led to in one document: nothing (absent, or not a string), or a string's bytes
 * between its quotes. */
typedef struct {
    const unsigned char *at;
    size_t len;
} lw_found;

/* One pass over a JSON text: 1 when it is an object orjson certainly accepts, with found[i] the
 * string path i leads to (at == NULL: none); 0 when it is not, or not certainly (Python
 * decides). Keys along a configured path must be plain (no escapes) to be compared. */
static int lw_walk(const unsigned char *p, const unsigned char *e, const lw_paths *paths,
                   lw_found *found) {
    unsigned char stack[TB_JSON_DEPTH]; /* open containers: 1 array, 2 object */
    /* match[d]: paths whose first d components are the keys leading to the object open at
     * depth d (match[1]: the top-level object, every path) */
    uint32_t match[TB_JSON_DEPTH + 1];
    uint32_t current = 0; /* paths the value being read completes or leads on to */
    int depth = 0;
    for (int i = 0; i < paths->npaths; i++)
        found[i].at = NULL;
    p = tb_ws(p, e);
    if (p >= e || *p != '{')
        return 0; /* not an object: Python refuses it (or decides) */
value:
    if (p >= e)
        return 0;
    switch (*p) {
    case '{':
        if (depth == TB_JSON_DEPTH)
            return 0;
        stack[depth++] = 2;
        /* members of this object continue the paths the key before it matched, as far as
         * they go deeper than this depth */
        {
            uint32_t deeper = 0;
            if (depth == 1) {
                deeper = (1u << paths->npaths) - 1;
            } else {
                for (uint32_t m = current; m; m &= m - 1) {
                    int i = __builtin_ctz(m);
                    if (paths->nparts[i] >= depth)
                        deeper |= 1u << i;
                }
            }
            match[depth] = deeper;
        }
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
        match[depth] = 0; /* a path never leads through an array */
        p = tb_ws(p + 1, e);
        if (p < e && *p == ']') {
            p++;
            depth--;
            goto after;
        }
        current = 0;
        goto value;
    case '"': {
        const unsigned char *start = p + 1;
        p = tb_string(start, e);
        if (p == NULL)
            return 0;
        /* a string completes the paths of exactly this depth */
        for (uint32_t m = current; m; m &= m - 1) {
            int i = __builtin_ctz(m);
            if (paths->nparts[i] == depth) {
                found[i].at = start;
                found[i].len = (size_t)(p - 1 - start);
            }
        }
        break;
    }
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
        if (stack[depth - 1] == 1) {
            current = 0;
            goto value;
        }
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
    {
        const unsigned char *start = p + 1;
        p = tb_string(start, e);
        if (p == NULL)
            return 0;
        size_t n = (size_t)(p - 1 - start);
        current = 0;
        uint32_t candidates = match[depth];
        if (candidates) {
            if (memchr(start, '\\', n) != NULL)
                return 0; /* an escaped key where a path leads: Python compares */
            for (uint32_t m = candidates; m; m &= m - 1) {
                int i = __builtin_ctz(m);
                if (paths->part_len[i][depth - 1] == n &&
                    memcmp(paths->text + paths->part_at[i][depth - 1], start, n) == 0) {
                    /* this member replaces what an earlier one of the same key led to */
                    found[i].at = NULL;
                    current |= 1u << i;
                }
            }
        }
    }
    p = tb_ws(p, e);
    if (p >= e || *p != ':')
        return 0;
    p = tb_ws(p + 1, e);
    goto value;
}

/* Characters of valid UTF-8 (the bytes that do not continue a sequence). */
static size_t lw_chars(const unsigned char *s, size_t n) {
    size_t chars = 0;
    for (size_t i = 0; i < n; i++)
        chars += (s[i] & 0xC0) != 0x80;
    return chars;
}

#define LW_MAX_NAME_CHARS 255 /* decoder._MAX_NAME_CHARS: longer is not a name */

/* The first of paths [first, first + count) that led to a usable name (a non-empty string of
 * at most 255 characters): 1 with *name set (at NULL: none of them did), 0 when one it must
 * look at is escaped (Python decides). */
static int lw_name(const lw_found *found, int first, int count, lw_found *name) {
    name->at = NULL;
    name->len = 0;
    for (int i = first; i < first + count; i++) {
        const lw_found *f = &found[i];
        if (f->at == NULL || f->len == 0)
            continue;
        if (memchr(f->at, '\\', f->len) != NULL)
            return 0;
        if (lw_chars(f->at, f->len) > LW_MAX_NAME_CHARS)
            continue;
        *name = *f;
        return 1;
    }
    return 1;
}

typedef struct {
    size_t pos;        /* in: where the run starts; out: the first frame not taken */
    int events;        /* J frames taken */
    int stop;          /* LW_* below: why it stopped */
    int count;         /* in and out: events of the sender's window before (the high rule) */
    uint32_t high;     /* in and out: the highest sequence number in serial order */
    size_t out_bytes;  /* record bytes written to out */
} lw_ran;

enum {
    LW_END = 0,   /* input ends, or the next frame is incomplete */
    LW_OTHER = 1, /* the next frame is not a J frame of this version */
    LW_SLOW = 2,  /* the next J frame is for Python (not certain, or refused) */
    LW_ROOM = 3,  /* its record does not fit the journal room */
    LW_OUT = 4,   /* its record does not fit out (none taken: the frame is Python's) */
    LW_LIMIT = 5, /* max_events taken, or batch_room reached */
};

#define LW_HEAD 46 /* records.RECORD_HEAD: <IqqQBBHHHHII */

/* Take J frames of `version` from buf[res->pos, end): at most max_events, stopping once the
 * records reach batch_room bytes, never past room or out_cap. tail is the producer then the
 * attrs of a record (producer_len, tail_len) as the decoder writes them. */
void lw_run(const lw_paths *paths, const char *buf, size_t end, int version, size_t max_event,
            const char *tail, size_t producer_len, size_t tail_len, int64_t received_ns,
            int max_events, size_t batch_room, size_t room, char *out, size_t out_cap,
            lw_ran *res) {
    const unsigned char *b = (const unsigned char *)buf;
    size_t pos = res->pos, o = 0;
    int events = 0, count = res->count;
    uint32_t high = res->high;
    lw_found found[LW_PATHS];
    int stop = LW_END;
    for (;;) {
        if (events >= max_events || (events && o >= batch_room)) {
            stop = LW_LIMIT;
            break;
        }
        if (end - pos < 10) {
            stop = (end - pos >= 2 && (b[pos] != version || b[pos + 1] != 'J')) ? LW_OTHER
                                                                                 : LW_END;
            break;
        }
        if (b[pos] != version || b[pos + 1] != 'J') {
            stop = LW_OTHER;
            break;
        }
        uint32_t seq = (uint32_t)b[pos + 2] << 24 | (uint32_t)b[pos + 3] << 16 |
                       (uint32_t)b[pos + 4] << 8 | b[pos + 5];
        size_t length = (size_t)b[pos + 6] << 24 | (size_t)b[pos + 7] << 16 |
                        (size_t)b[pos + 8] << 8 | b[pos + 9];
        if (length == 0 || length > max_event) {
            stop = LW_SLOW;
            break;
        }
        if (end - pos - 10 < length) {
            stop = LW_END;
            break;
        }
        if (LW_HEAD + 14 + tail_len + length > out_cap - o) {
            stop = LW_OUT; /* cannot fit even without names: not walked (Python's if first) */
            break;
        }
        const unsigned char *payload = b + pos + 10;
        if (!lw_walk(payload, payload + length, paths, found)) {
            stop = LW_SLOW;
            break;
        }
        lw_found stream, topic;
        if (!lw_name(found, 0, paths->nstream, &stream) ||
            !lw_name(found, paths->nstream, paths->ntopic, &topic)) {
            stop = LW_SLOW;
            break;
        }
        int64_t ts_ns = 0;
        const lw_found *when = &found[paths->npaths - 1];
        if (when->at != NULL) {
            /* a string: the forms eb_timestamp reads (years 1970..2261), else Python */
            if (memchr(when->at, '\\', when->len) != NULL ||
                !eb_timestamp(when->at, when->len, &ts_ns)) {
                stop = LW_SLOW;
                break;
            }
        }
        size_t size = LW_HEAD + 14 + stream.len + topic.len + tail_len + length;
        if (size > room - o) {
            stop = LW_ROOM;
            break;
        }
        if (size > out_cap - o) {
            stop = LW_OUT;
            break;
        }
        unsigned char *h = (unsigned char *)out + o;
        eb_le(h, size - 4, 4);
        eb_le(h + 4, (uint64_t)received_ns, 8);
        eb_le(h + 12, (uint64_t)ts_ns, 8);
        eb_le(h + 20, seq, 8);
        h[28] = 10; /* "lumberjack" */
        h[29] = 4;  /* "json" */
        eb_le(h + 30, stream.len, 2);
        eb_le(h + 32, topic.len, 2);
        eb_le(h + 34, producer_len, 2);
        eb_le(h + 36, 0, 2); /* no event id */
        eb_le(h + 38, tail_len - producer_len, 4);
        eb_le(h + 42, length, 4);
        unsigned char *q = h + LW_HEAD;
        memcpy(q, "lumberjackjson", 14);
        q += 14;
        if (stream.len)
            memcpy(q, stream.at, stream.len);
        q += stream.len;
        if (topic.len)
            memcpy(q, topic.at, topic.len);
        q += topic.len;
        memcpy(q, tail, tail_len);
        q += tail_len;
        memcpy(q, payload, length);
        o += size;
        /* the ack's sequence: the highest received, in serial-number order (RFC 1982) */
        if (count) {
            uint32_t ahead = seq - high;
            if (ahead > 0 && ahead < 0x80000000u)
                high = seq;
        } else {
            high = seq;
        }
        count++;
        events++;
        pos += 10 + length;
    }
    res->pos = pos;
    res->events = events;
    res->stop = stop;
    res->count = count;
    res->high = high;
    res->out_bytes = o;
}
