"""cffi (API mode) build of taproom's compiled ZeroMQ burst module, ``taproom.zmqburst._burst``.

Used by setup.py at ``pip install`` time (``make`` reinstalls when burst.c changes: an editable
install builds the module in place). The C source is burst.c beside this file; no libzmq is linked (burst.c looks
its functions up in the libzmq pyzmq loaded).
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

CDEF = """
typedef struct tb_reader tb_reader;
typedef struct {
    int status; int messages; size_t frames; size_t bytes; size_t need; int error;
} tb_result;
int tb_bind(int *major, int *minor, int *patch);
int tb_socket_type(void *sock);
tb_reader *tb_reader_new(void *sock, int max_frames);
void tb_reader_free(tb_reader *r);
void tb_recv(tb_reader *r, char *buf, size_t cap, size_t *frame_end, size_t frames_cap,
             int *counts, int max_messages, size_t max_bytes, tb_result *res);
int tb_send(void *sock, const char *buf, const size_t *frame_end, const int *counts, int n);
int tb_json_valid(const char *text, size_t len);

typedef struct lj_ingest lj_ingest;
typedef struct {
    int next; size_t next_frame; int slow; int budget_full; size_t out_bytes; int records;
    int acks; size_t ack_frames; size_t ack_bytes; int time_out_of_range;
} lj_built;
lj_ingest *lj_ingest_new(int router, int device_grammar, size_t max_body,
                         size_t max_decompressed, int max_entries, int meta_tag,
                         int meta_version, uint64_t max_created_ms);
void lj_ingest_free(lj_ingest *st);
void lj_ingest_learn(lj_ingest *st, int kind, const char *s, size_t n);
void lj_build(lj_ingest *st, const char *buf, const size_t *frame_end, const int *counts,
              int max_frames, int start, size_t start_frame, int n, int64_t received_ns,
              int64_t *budget, char *out, size_t out_cap, char *ack_buf, size_t ack_cap,
              size_t *ack_end, size_t ack_frames_cap, int *ack_counts, lj_built *res);

typedef struct {
    int meta_size; uint16_t meta_tag; uint8_t meta_version; uint32_t device; uint64_t wrap;
    int64_t now_ms;
} lj_pub;
typedef struct {
    size_t pos; int sent; uint64_t seq; int stop; int error; size_t out_bytes;
} lj_published;
void lj_pubwire(const char *body, size_t len, int count, int check_protocol, const lj_pub *cfg,
                char *out, size_t out_cap, size_t *ends, int ends_cap, lj_published *res);

typedef struct {
    int status; size_t pos; size_t complete; int messages; size_t partial; size_t want;
    size_t body; uint64_t size;
} zt_scanned;
void zt_scan(const unsigned char *buf, size_t pos, size_t end, size_t complete, size_t partial,
             uint64_t max_message, uint64_t max_command, zt_scanned *res);
typedef struct {
    int status; size_t pos; int messages; size_t frames; size_t bytes; size_t need;
    size_t need_frames;
} zt_taken;
void zt_take(const unsigned char *buf, size_t pos, size_t complete, const char *prefix,
             size_t prefix_len, int max_frames, int max_messages, size_t max_bytes, char *out,
             size_t out_cap, size_t *frame_end, size_t frames_cap, int *counts, zt_taken *res);
size_t zt_wire(const char *buf, const size_t *frame_end, const int *counts, int n, char *out,
               size_t out_cap, size_t *ends);

typedef struct { int next; size_t next_frame; int slow; int scanned; } eb_scanned;
void eb_scan(const char *buf, const size_t *frame_end, const int *counts, int max_frames,
             int start, size_t start_frame, int n, size_t max_topic, size_t max_producer,
             size_t max_data, int64_t *ts_ns, char *uuids, int cap, eb_scanned *res);
typedef struct {
    size_t out_bytes; size_t bc_frames; size_t bc_bytes; int error; int emitted;
} eb_emitted;
void eb_emit(const char *buf, const size_t *frame_end, const size_t *first_frames,
             const uint64_t *seqs, const int *items, int count, const int64_t *ts_ns,
             const char *uuids, int64_t received_ns, char *out, size_t out_cap, char *bc,
             size_t bc_cap, size_t *bc_end, size_t bc_end_cap, eb_emitted *res);
typedef struct {
    size_t producer; size_t producer_len; size_t timestamp; size_t timestamp_len; size_t entry;
    size_t ttl; size_t ttl_len; int64_t expires_ms;
} eb_kv_item;
void eb_kv_scan(const char *buf, const size_t *frame_end, const int *counts, int max_frames,
                int start, size_t start_frame, int n, size_t max_topic, size_t max_producer,
                size_t max_data, size_t max_properties, int64_t received_ns,
                size_t received_len, int64_t *ts_ns, char *uuids, eb_kv_item *items, int cap,
                eb_scanned *res);
typedef struct {
    size_t out_bytes; size_t bc_frames; size_t bc_bytes; size_t kv_frames; size_t kv_bytes;
    int error; int emitted;
} eb_kv_emitted;
void eb_kv_emit(const char *buf, const size_t *frame_end, const size_t *first_frames,
                const uint64_t *seqs, const int *items, int count, const int64_t *ts_ns,
                const char *uuids, const eb_kv_item *kv_items, const char *received,
                size_t received_len, int64_t received_ns, char *out, size_t out_cap, char *bc,
                size_t bc_cap, size_t *bc_end, size_t bc_end_cap, char *kv, size_t kv_cap,
                size_t *kv_end, size_t kv_end_cap, eb_kv_emitted *res);

typedef struct lw_paths lw_paths;
lw_paths *lw_paths_new(int nstream, int ntopic, const int *parts, const char *text,
                       const size_t *ends);
void lw_paths_free(lw_paths *paths);
typedef struct {
    size_t pos; int events; int stop; int count; uint32_t high; size_t out_bytes;
} lw_ran;
void lw_run(const lw_paths *paths, const char *buf, size_t end, int version, size_t max_event,
            const char *tail, size_t producer_len, size_t tail_len, int64_t received_ns,
            int max_events, size_t batch_room, size_t room, char *out, size_t out_cap,
            lw_ran *res);

typedef struct lg_taps lg_taps;
typedef struct {
    int next; size_t next_frame; int stop; int rows; size_t out_bytes; size_t wire_bytes;
    int runs; int out_of_range; size_t need; int reframed; size_t plain_bytes;
} lg_ran;
lg_taps *lg_taps_new(int limit);
void lg_taps_clear(lg_taps *t);
void lg_taps_free(lg_taps *t);
int lg_taps_add(lg_taps *t, const char *key, int key_len, const char *tail, size_t tail_len,
                uint32_t length, uint32_t row_size, const uint32_t *items, int nitems);
void lg_run(const lg_taps *t, const char *buf, const size_t *frame_end, const int *counts,
            int max_frames, int start, size_t start_frame, int n, int64_t received_ns,
            char *out, size_t out_cap, char *wire, size_t wire_cap, size_t *ends, int ends_cap,
            char *run_uuid, int *run_rows, int runs_cap, char *plain, size_t plain_cap,
            size_t *plain_ends, lg_ran *res);
"""

# burst.c, then the protocol kernels kept in files of their own (one translation unit)
SOURCES = [
    Path(__file__).with_name(name) for name in ("burst.c", "eventbus.c", "lumberjack.c", "lager.c")
]

ffibuilder = FFI()
ffibuilder.cdef(CDEF)
ffibuilder.set_source(
    "taproom.zmqburst._burst",
    "\n".join(source.read_text() for source in SOURCES),
    libraries=["dl"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    optional=True,  # no compiler: the install goes on, taproom takes the pure-Python path
)
