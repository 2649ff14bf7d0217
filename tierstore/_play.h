// The miss-ratio shadow played whole in C (tierstore/_c_play.c, tierstore/_play_stack.c): its
// tables as C memory instead of Python objects. The pages dict becomes an open-addressing table
// of the keys' bytes (no key object kept alive, no hashing of a bytes object), the slot lists
// double arrays (no float object made per write), the end set two tables with a bit prefilter.
// The event loop, its pending match and its scratch lists make no Python object per event.
// The pure Shadow (tierstore/mrc.py, mrc_loops.py, mrc_stack.py) is its twin, to the bit
// (tests/tierstore/test_mrc_play.py plays both side by side).
#ifndef TIERSTORE_PLAY_H
#define TIERSTORE_PLAY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define P_SHIFT 8                 // slots per block: 2**P_SHIFT (mrc_stack.SHIFT)
#define P_SPACE (1ULL << 32)      // sampling thresholds are on 32 key bits (mrc_loops.SPACE)
#define P_MIN_KEY 8               // keys carry both thresholds' bytes (0-3 pages, 4-7 ends)
#define P_MAX_KEY 32              // ... and fit an entry (sha256: 32, xxh3-128: 16)
#define P_TRIM_MIN 1024           // mrc_stack.TRIM_MIN
#define P_END_BITS (1 << 18)      // the end prefilter's bits at first (on key bytes 8-10) ...
#define P_END_BITS_MAX (1 << 24)  // ... and at most (all 24 bits of them)
#define P_BITS_PER_END 16         // ... grown to keep at least this many bits per end
#define P_KINDS 3                 // kv, swa, state

// A page key's bytes, zero-padded, and its length.
typedef struct {
    uint64_t w[4];
    uint32_t len;
} Key;

// A table entry: a key, its code (slot << 1 | is_end; pages only) and whether it is used.
typedef struct {
    uint64_t w[4];
    int64_t code;
    uint32_t len;
    uint32_t used;
} Entry;

typedef struct {
    Entry *e;
    size_t cap;  // a power of two; at most half used
    size_t n;
} Table;

typedef struct {
    Py_ssize_t *v;
    Py_ssize_t n, cap;
} Vec;

// A match's touch, left to the next event (mrc._Pending without the objects).
typedef struct {
    int on;
    Py_ssize_t n;           // its pages
    Key last;               // its last key
    int has_ends;           // with state: its candidate ends (else every page is one)
    Vec ends, low;          // candidate end positions, positions under the page threshold
    uint64_t threshold;     // the page threshold it was scanned at
    Key *touched;           // the keys to touch, in position order
    Py_ssize_t ntouched, cap_touched;
    Vec at;                 // ... and their positions (for export)
} Pending;

// A queued event: a match (arg: its tokens) or an insert (arg: a checkpoint at its end), of n
// keys from qkeys[at].
typedef struct {
    int match;
    Py_ssize_t n, at;
    long long arg;
} Event;

typedef struct {
    PyObject_HEAD
    int state;                        // the model has recurrent state: ends are checkpoints
    long long page;                   // tokens per page
    Py_ssize_t max_tracked, nslots, nblocks, trim_at;
    double page_bytes, end_bytes;
    uint64_t threshold, end_threshold;
    double w_page, w_end, wb[2];      // 1/R of pages and ends; a slot's weighted bytes
    double *values, *sums;            // slot bytes, and their sums per block
    Py_ssize_t clock, num_ends;
    Table pages;                      // tracked pages: key -> code
    Table young, old;                 // candidate ends, two generations
    Py_ssize_t young_n;               // ends added to the young generation
    int rotated;                      // an older generation was forgotten
    unsigned char *bits;              // the ends' prefilter (both generations) ...
    size_t end_bits;                  // ... of this many bits (a power of two)
    double *edges;                    // the sizes the curves read
    Py_ssize_t nedges;
    double *hist;                     // hit tokens by distance bin (nedges + 1), weighted
    double *khist[P_KINDS];           // per kind, entries by bin (NULL: kind absent)
    double refs[P_KINDS];
    int page_kinds, end_kinds;        // the kinds a page, a candidate end adds to (bits)
    long long tokens, requests;
    Pending p;
    Event *events;                    // the queue: events heard, not yet played
    Py_ssize_t nevents, cap_events, batch;  // (played when batch are queued)
    Key *qkeys;                       // their keys, copied as they come (hot: the store just
    Py_ssize_t nqkeys, cap_qkeys;     // hashed them), so the play reads no key object
    const Key *cur;                   // the playing event's keys
    PyObject *on_refuse;              // called with an event the core does not take
    int busy;                         // playing or exporting: a re-entrant call is refused
    Vec ends, low, sampled;           // the event's scan
    Entry **order;                    // compaction's scratch: live entries in slot order
} Core;

static inline uint32_t key_be32(const Key *k, int at) {
    const unsigned char *p = (const unsigned char *)k->w + at;
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

// key < limit bytes (mrc._limit): its first 4 bytes under the threshold (every key at 1).
static inline int below(const Key *k, uint64_t threshold) {
    return threshold >= P_SPACE || key_be32(k, 0) < threshold;
}

// mrc_loops.end_sampled: bytes 4-7 under the end threshold.
static inline int end_sampled(const Key *k, uint64_t threshold) {
    return key_be32(k, 4) < threshold;
}

static inline int key_eq(const Key *a, const Entry *e) {
    return a->len == e->len && a->w[0] == e->w[0] && a->w[1] == e->w[1]
        && a->w[2] == e->w[2] && a->w[3] == e->w[3];
}

// A key's bit in a prefilter of `nbits` bits (its bytes 8-10, as _mrc.h's end_bit at 2^18).
static inline long end_bit(const Key *k, size_t nbits) {
    const unsigned char *p = (const unsigned char *)k->w;
    return (long)(((unsigned long)p[8] << 16 | (unsigned long)p[9] << 8 | p[10])
                  & (nbits - 1));
}

// tables (_play_stack.c)
int tab_init(Table *t, size_t cap);
void tab_free(Table *t);
Entry *tab_get(const Table *t, const Key *k);
int tab_reserve(Table *t, size_t more);
Entry *tab_put(Table *t, const Key *k, int64_t code);  // k absent; room reserved
void tab_del(Table *t, Entry *e);
int grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t size);  // room for need items
int vec_push(Vec *v, Py_ssize_t x);
int vec_copy(Vec *dst, const Vec *src);

// the stack (_play_stack.c)
void set_weights(Core *c);
double suffix(const Core *c, Py_ssize_t i, Py_ssize_t end);
int is_end(const Core *c, const Key *k);
int compact(Core *c);
void reweigh(Core *c);
int trim(Core *c);
int lower_rate(Core *c);
int touch(Core *c, const Key *keys, const Py_ssize_t *pos, Py_ssize_t npos, const Vec *ends,
          int create);

// the type and its events (_play_type.c, _c_play.c)
extern PyTypeObject CoreType;
PyObject *core_match(Core *c, PyObject *const *args, Py_ssize_t nargs);
PyObject *core_insert(Core *c, PyObject *const *args, Py_ssize_t nargs);
int drain(Core *c);
int enter(Core *c);  // -1 (RuntimeError) when busy


#endif
