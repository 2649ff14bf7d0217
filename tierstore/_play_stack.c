// The compiled shadow's tables and stack (built into tierstore._c_play, see tierstore/_play.h).
// Each stack function does what its pure twin does, in the same order of float operations:
// touch (mrc_loops.touch), compact, reweigh, trim (mrc_stack), lower_rate (Shadow._lower_rate).
#include "_play.h"

// ---------------------------------------------------------------- tables
// Open addressing, linear probing, deletion by backward shift (no tombstones: a lookup stops at
// the first empty slot). Keys are uniform hashes: their words mixed once pick the home slot.
static inline size_t home(const uint64_t *w, size_t cap) {
    uint64_t h = (w[1] ^ (w[0] >> 29) ^ w[2] ^ (w[3] << 7)) * 0x9E3779B97F4A7C15ULL;
    return (size_t)(h >> 17) & (cap - 1);
}

int tab_init(Table *t, size_t cap) {
    t->e = PyMem_Calloc(cap, sizeof(Entry));
    if (t->e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->cap = cap;
    t->n = 0;
    return 0;
}

void tab_free(Table *t) {
    PyMem_Free(t->e);
    t->e = NULL;
    t->cap = t->n = 0;
}

Entry *tab_get(const Table *t, const Key *k) {
    size_t mask = t->cap - 1;
    for (size_t i = home(k->w, t->cap);; i = (i + 1) & mask) {
        Entry *e = &t->e[i];
        if (!e->used) return NULL;
        if (key_eq(k, e)) return e;
    }
}

static void put_entry(Table *t, const Entry *src) {
    size_t mask = t->cap - 1;
    size_t i = home(src->w, t->cap);
    while (t->e[i].used) i = (i + 1) & mask;
    t->e[i] = *src;
    t->n++;
}

// Rebuild at cap slots (entries keep their codes; pointers into the table go stale).
static int tab_resize(Table *t, size_t cap) {
    Table fresh;
    if (tab_init(&fresh, cap) < 0) return -1;
    for (size_t i = 0; i < t->cap; i++)
        if (t->e[i].used) put_entry(&fresh, &t->e[i]);
    tab_free(t);
    *t = fresh;
    return 0;
}

// Room for `more` new keys without a resize on the way (so an event allocates before it changes
// anything, and entry pointers stay good through it).
int tab_reserve(Table *t, size_t more) {
    size_t cap = t->cap;
    while (2 * (t->n + more) > cap) cap *= 2;
    return cap == t->cap ? 0 : tab_resize(t, cap);
}

Entry *tab_put(Table *t, const Key *k, int64_t code) {
    Entry e;
    memcpy(e.w, k->w, sizeof e.w);
    e.len = k->len;
    e.code = code;
    e.used = 1;
    size_t mask = t->cap - 1;
    size_t i = home(k->w, t->cap);
    while (t->e[i].used) i = (i + 1) & mask;
    t->e[i] = e;
    t->n++;
    return &t->e[i];
}

void tab_del(Table *t, Entry *e) {
    size_t mask = t->cap - 1;
    size_t i = (size_t)(e - t->e), j = i;
    t->e[i].used = 0;
    for (;;) {  // shift back the entries whose probe ran through slot i
        j = (j + 1) & mask;
        if (!t->e[j].used) break;
        size_t h = home(t->e[j].w, t->cap);
        if (i <= j ? (i < h && h <= j) : (i < h || h <= j)) continue;  // home in (i, j]: stays
        t->e[i] = t->e[j];
        t->e[j].used = 0;
        i = j;
    }
    t->n--;
}

// Keep the entries whose code `keep` accepts (a bulk drop: a trim, a rate halved), in place:
// deletion by backward shift, so no fresh table is allocated (and faulted in) and no kept entry
// is hashed again. A halving at 16k tracked pages took 1.7 ms as a rebuild, 1.1 so; the table
// keeps its size, which the 2 x max_tracked pages and ends it may track bound.
static void tab_filter(Table *t, int (*keep)(const Entry *, int64_t), int64_t arg,
                       Py_ssize_t *ends_dropped) {
    for (size_t i = 0; i < t->cap;) {
        Entry *e = &t->e[i];
        if (e->used && !keep(e, arg)) {
            *ends_dropped += e->code & 1;
            tab_del(t, e);  // a later entry may shift into slot i: look at it again
        } else {
            i++;
        }
    }
}

int grow(void **p, Py_ssize_t *cap, Py_ssize_t need, size_t size) {
    if (need <= *cap) return 0;
    Py_ssize_t to = *cap ? *cap : 64;
    while (to < need) to *= 2;
    void *q = PyMem_Realloc(*p, (size_t)to * size);
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    *p = q;
    *cap = to;
    return 0;
}

int vec_push(Vec *v, Py_ssize_t x) {
    if (grow((void **)&v->v, &v->cap, v->n + 1, sizeof *v->v) < 0) return -1;
    v->v[v->n++] = x;
    return 0;
}

int vec_copy(Vec *dst, const Vec *src) {
    dst->n = 0;
    for (Py_ssize_t j = 0; j < src->n; j++)
        if (vec_push(dst, src->v[j]) < 0) return -1;
    return 0;
}

// ---------------------------------------------------------------- the stack
void set_weights(Core *c) {  // Shadow._set_weights
    c->w_page = (double)P_SPACE / (double)c->threshold;
    c->w_end = (double)P_SPACE / (double)c->end_threshold;
    c->wb[0] = c->page_bytes * c->w_page;
    c->wb[1] = (c->page_bytes + c->end_bytes) * c->w_end;
}

static double add_range(const double *v, Py_ssize_t from, Py_ssize_t to) {
    double acc = 0.0;  // (Python's sum of floats: plain adds, left to right)
    for (Py_ssize_t j = from; j < to; j++) acc += v[j];
    return acc;
}

double suffix(const Core *c, Py_ssize_t i, Py_ssize_t end) {  // Slots.suffix
    Py_ssize_t b = i >> P_SHIFT, stop = (b + 1) << P_SHIFT;
    if (end <= stop) return add_range(c->values, i, end);
    return add_range(c->values, i, stop) + add_range(c->sums, b + 1, ((end - 1) >> P_SHIFT) + 1);
}

int is_end(const Core *c, const Key *k) {
    long b = end_bit(k, c->end_bits);
    if (!(c->bits[b >> 3] >> (b & 7) & 1)) return 0;
    return tab_get(&c->young, k) != NULL || tab_get(&c->old, k) != NULL;
}

static void block_sums(Core *c) {  // Slots(values): a sum per block, afresh
    for (Py_ssize_t b = 0; b < c->nblocks; b++) {
        Py_ssize_t to = (b + 1) << P_SHIFT;
        c->sums[b] = add_range(c->values, b << P_SHIFT, to < c->nslots ? to : c->nslots);
    }
}

// mrc_stack.compact: the live slots renumbered 0..n-1 in recency order. (A page on the move has
// a negative code: off the stack, as in the pure loop.) Each live page holds a slot of its own,
// so they are put in slot order by their slots, in one pass, not sorted: qsort's compares
// read the entries at random, ~3 ms a compaction at 16k tracked pages (`bench ops`, 500k).
int compact(Core *c) {
    set_weights(c);
    memset(c->order, 0, (size_t)c->nslots * sizeof *c->order);
    for (size_t i = 0; i < c->pages.cap; i++) {
        Entry *e = &c->pages.e[i];
        if (e->used && e->code >= 0) c->order[e->code >> 1] = e;
    }
    memset(c->values, 0, (size_t)c->nslots * sizeof *c->values);
    Py_ssize_t n = 0;
    for (Py_ssize_t slot = 0; slot < c->nslots; slot++) {
        Entry *e = c->order[slot];
        if (e == NULL) continue;
        e->code = (int64_t)n << 1 | (e->code & 1);
        c->values[n++] = c->wb[e->code & 1];
    }
    block_sums(c);
    c->clock = n;
    return 0;
}

void reweigh(Core *c) {  // mrc_stack.reweigh: every page keeps its slot, at the current weights
    set_weights(c);
    memset(c->values, 0, (size_t)c->nslots * sizeof *c->values);
    for (size_t i = 0; i < c->pages.cap; i++) {
        const Entry *e = &c->pages.e[i];
        if (e->used && e->code >= 0) c->values[e->code >> 1] = c->wb[e->code & 1];
    }
    block_sums(c);
}

static int keep_at_or_above(const Entry *e, int64_t cut) { return e->code < 0 || e->code >= cut; }

// mrc_stack.trim: drop the pages deeper than the last edge (their slots zeroed in slot order).
int trim(Core *c) {
    double bound = c->edges[c->nedges - 1];
    if (Py_IS_INFINITY(bound)) return 0;
    bound *= 1 + 1e-9;
    Py_ssize_t b = c->clock > 0 ? (c->clock - 1) >> P_SHIFT : -1;
    double acc = 0.0;
    while (b >= 0) {
        acc += c->sums[b];
        if (acc > bound) break;
        b -= 1;
    }
    if (b >= 0) {
        Py_ssize_t lo = b - 1 > 0 ? (b - 1) << P_SHIFT : 0;
        Py_ssize_t hi = (b + 2) << P_SHIFT;
        if (hi > c->clock) hi = c->clock;
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (suffix(c, mid, c->clock) > bound) lo = mid + 1;
            else hi = mid;
        }
        for (Py_ssize_t slot = 0; slot < lo; slot++) {  // (dead slots hold exactly 0.0)
            double v = c->values[slot];
            if (v != 0.0) {
                c->values[slot] = 0.0;
                c->sums[slot >> P_SHIFT] -= v;
            }
        }
        Py_ssize_t ends = 0;
        tab_filter(&c->pages, keep_at_or_above, (int64_t)lo << 1, &ends);
        c->num_ends -= ends;
    }
    Py_ssize_t twice = 2 * (Py_ssize_t)c->pages.n;
    c->trim_at = twice > P_TRIM_MIN ? twice : P_TRIM_MIN;
    return 0;
}

static int keep_sampled_page(const Entry *e, int64_t threshold) {
    return (e->code & 1) || below((const Key *)e->w, (uint64_t)threshold);
}

static int keep_sampled_end(const Entry *e, int64_t threshold) {
    return !(e->code & 1) || end_sampled((const Key *)e->w, (uint64_t)threshold);
}

// Shadow._lower_rate: halve a rate until at most max_tracked pages (and ends) are tracked.
int lower_rate(Core *c) {
    if (trim(c) < 0) return -1;
    Py_ssize_t dropped = 0;
    while ((Py_ssize_t)c->pages.n - c->num_ends > c->max_tracked && c->threshold > 1) {
        c->threshold /= 2;
        tab_filter(&c->pages, keep_sampled_page, (int64_t)c->threshold, &dropped);
    }
    while (c->num_ends > c->max_tracked && c->end_threshold > 1) {
        c->end_threshold /= 2;
        dropped = 0;
        tab_filter(&c->pages, keep_sampled_end, (int64_t)c->end_threshold, &dropped);
        c->num_ends -= dropped;
    }
    reweigh(c);
    return 0;
}

static int contains(const Vec *v, Py_ssize_t x) {
    for (Py_ssize_t j = 0; j < v->n; j++)
        if (v->v[j] == x) return 1;
    return 0;
}

// mrc_loops.touch: move the pages at positions pos (NULL: 0..npos-1) of keys to the top, deepest
// first; with create, those not tracked join (as candidate ends where ends says so).
int touch(Core *c, const Key *keys, const Py_ssize_t *pos, Py_ssize_t npos, const Vec *ends,
          int create) {
    if (create && tab_reserve(&c->pages, (size_t)npos) < 0) return -1;
    double *values = c->values, *sums = c->sums;
    for (Py_ssize_t j = npos - 1; j >= 0; j--) {
        Py_ssize_t i = pos != NULL ? pos[j] : j;
        const Key *key = &keys[i];
        Entry *e = tab_get(&c->pages, key);
        int64_t end;
        if (e == NULL) {
            if (!create) continue;
            end = ends != NULL && contains(ends, i);
            c->num_ends += end;
            e = tab_put(&c->pages, key, -2 | end);  // (off the stack until placed below)
        } else {
            end = e->code & 1;
            if (e->code >= 0) {
                Py_ssize_t slot = (Py_ssize_t)(e->code >> 1);
                values[slot] -= c->wb[end];
                sums[slot >> P_SHIFT] -= c->wb[end];
            }
            e->code = -2 | end;
        }
        if (c->clock >= c->nslots && compact(c) < 0) return -1;
        e->code = (int64_t)c->clock << 1 | end;
        values[c->clock] = c->wb[end];  // slots at and past the clock are empty
        sums[c->clock >> P_SHIFT] += c->wb[end];
        c->clock++;
    }
    if ((Py_ssize_t)c->pages.n - c->num_ends > c->max_tracked || c->num_ends > c->max_tracked)
        return lower_rate(c);
    return 0;
}
