/* gpu_arena._c_slots's hot part (built into that extension: gpu_arena/_c_slots.c names
 * this file; shared declarations in gpu_arena/_slots.h): the hole heap, the loops over a
 * band (take, sweep, trim) and the methods a steady allocation and free call (take_bind,
 * bind, free). */
#include "_slots.h"

/* Room for `extra` more keys; -1 with MemoryError (nothing changed). */
int heap_reserve(Heap *h, Py_ssize_t extra) {
    if (extra <= h->cap - h->len) {
        return 0;
    }
    Py_ssize_t cap = h->cap > 0 ? h->cap : 64;
    while (cap - h->len < extra) {
        if (cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(int64_t)) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    int64_t *keys = PyMem_Realloc(h->keys, (size_t)cap * sizeof(int64_t));
    if (keys == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    h->keys = keys;
    h->cap = cap;
    return 0;
}

void heap_free(Heap *h) {
    PyMem_Free(h->keys);
    h->keys = NULL;
    h->len = h->cap = 0;
}

/* Push a key (room reserved). */
void heap_push(Heap *h, int64_t key) {
    int64_t *k = h->keys;
    Py_ssize_t i = h->len++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (k[up] <= key) {
            break;
        }
        k[i] = k[up];
        i = up;
    }
    k[i] = key;
}

/* Pop the smallest key (len > 0). */
int64_t heap_pop(Heap *h) {
    int64_t *k = h->keys, top = k[0];
    Py_ssize_t n = --h->len;
    if (n == 0) {
        return top;
    }
    int64_t key = k[n];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n) {
            break;
        }
        if (c + 1 < n && k[c + 1] < k[c]) {
            c++;
        }
        if (key <= k[c]) {
            break;
        }
        k[i] = k[c];
        i = c;
    }
    k[i] = key;
    return top;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Sort the keys ascending (a sorted array is a heap). */
void heap_sort(Heap *h) {
    if (h->len > 1) {
        qsort(h->keys, (size_t)h->len, sizeof(int64_t), cmp_i64);
    }
}


/* Whether slot is a hole of [lo, hi): free, and unfenced when fenced. Reads the tables only
 * for a slot inside [lo, hi), which the callers checked is inside [0, max_slots). */
static inline int is_hole(const SlotLoops *self, int64_t slot, int64_t lo, int64_t hi,
                          int fenced) {
    return lo <= slot && slot < hi && self->owner[slot] < 0 &&
           !(fenced && (self->readers[slot] > 0 || self->writers[slot] > 0));
}

/* Pop hole keys, smallest first, until `want` holes of [lo, hi) are in found[0..k) or the
 * heap is empty; stale and repeated entries popped on the way are dropped. Returns k; *used:
 * the entries popped. */
Py_ssize_t take_core(SlotLoops *self, int64_t lo, int64_t hi, Py_ssize_t want, int fenced,
                     int64_t *found, Py_ssize_t *used) {
    Py_ssize_t k = 0;
    int64_t last = -1; /* (a slot is never negative) */
    *used = 0;
    while (k < want && self->holes.len > 0) {
        int64_t slot = self->sign * heap_pop(&self->holes);
        (*used)++;
        if (slot == last) { /* a repeated entry: equal entries surface one after another */
            continue;
        }
        last = slot;
        if (is_hole(self, slot, lo, hi, fenced)) {
            found[k++] = slot;
        }
    }
    return k;
}

/* Keep only the distinct entries that are holes of [lo, hi) now, ascending (a heap); returns
 * the entries read. */
Py_ssize_t sweep_core(SlotLoops *self, int64_t lo, int64_t hi, int fenced) {
    Heap *h = &self->holes;
    Py_ssize_t read = h->len, kept = 0;
    heap_sort(h);
    for (Py_ssize_t i = 0; i < read; i++) {
        int64_t key = h->keys[i];
        if (i > 0 && key == h->keys[i - 1]) {
            continue; /* (i - 1 >= kept: not overwritten yet) */
        }
        if (is_hole(self, self->sign * key, lo, hi, fenced)) {
            h->keys[kept++] = key;
        }
    }
    h->len = kept;
    return read;
}

static inline int occupied_at(const SlotLoops *self, int64_t slot, int fenced) {
    return self->owner[slot] >= 0 ||
           (fenced && (self->readers[slot] > 0 || self->writers[slot] > 0));
}

/* Shrink [*lo, *hi) from its inner edge(s) (mode: the anchor) past free unfenced slots,
 * scanning outward from each edge in chunks growing 8x; *visited counts the slots scanned. */
void trim_core(SlotLoops *self, int64_t *lo, int64_t *hi, int fenced, int64_t mode,
               Py_ssize_t *visited) {
    if (mode != ANCHOR_HIGH) { /* hi: one past the highest occupied slot, or lo */
        int64_t l = *lo, h = *hi, chunk = 8, top = l - 1;
        while (h > l) {
            int64_t start = h - l > chunk ? h - chunk : l;
            *visited += (Py_ssize_t)(h - start);
            int64_t s = h - 1;
            while (s >= start && !occupied_at(self, s, fenced)) {
                s--;
            }
            if (s >= start) {
                top = s;
                break;
            }
            h = start;
            chunk = chunk < self->max_slots ? chunk * 8 : chunk; /* (past the table: all) */
        }
        *hi = top + 1;
    }
    if (mode != ANCHOR_LOW) { /* lo: the lowest occupied slot, or hi */
        int64_t l = *lo, h = *hi, chunk = 8, bottom = h;
        while (l < h) {
            int64_t stop = h - l > chunk ? l + chunk : h;
            *visited += (Py_ssize_t)(stop - l);
            int64_t s = l;
            while (s < stop && !occupied_at(self, s, fenced)) {
                s++;
            }
            if (s < stop) {
                bottom = s;
                break;
            }
            l = stop;
            chunk = chunk < self->max_slots ? chunk * 8 : chunk;
        }
        *lo = bottom;
    }
}

/* take_bind(lo, hi, n, fenced, top) -> (ids, packed) or None: packed is the ids as native
 * int64 bytes (a bytearray: torch.frombuffer makes the caller's tensor from it without
 * converting the ints again); None (nothing bound) when fewer than n holes were found */
PyObject *slotloops_take_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    int64_t lo, hi, n, top;
    int fenced;
    if (!ready(self) || !args_count(nargs, 5, "take_bind") ||
        band_args(self, args[0], args[1], args[3], "take_bind", 0, &lo, &hi, &fenced) < 0 ||
        as_i64(args[2], "n", &n) < 0 || as_i64(args[4], "top", &top) < 0) {
        return NULL;
    }
    if (n < 0 || top < n || top > self->max_slots) {
        PyErr_Format(PyExc_ValueError, "take_bind: %lld ids wanted from a free stack of %lld "
                     "(of %zd)", (long long)n, (long long)top, self->max_slots);
        return NULL;
    }
    for (int64_t k = 0; k < n; k++) { /* checked before anything changes */
        int64_t id = self->free_ids[top - 1 - k];
        if (id < 0 || id >= self->max_slots) {
            PyErr_Format(PyExc_ValueError, "take_bind: free id %lld outside [0, %zd)",
                         (long long)id, self->max_slots);
            return NULL;
        }
    }
    if (n > 0 && self->holes.len == 0) {
        Py_RETURN_NONE;
    }
    /* The results first (they may fail with MemoryError): then nothing fails once the heap
     * changes. */
    Py_ssize_t count = (Py_ssize_t)n;
    PyObject *packed = PyByteArray_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(int64_t));
    if (packed == NULL) {
        return NULL;
    }
    int64_t *raw = (int64_t *)PyByteArray_AS_STRING(packed);
    for (Py_ssize_t j = 0; j < count; j++) {
        raw[j] = self->free_ids[top - 1 - j];
    }
    PyObject *ids = int_list(raw, count), *out = NULL;
    if (ids != NULL) {
        out = PyTuple_Pack(2, ids, packed); /* (holds packed: raw stays valid) */
        Py_DECREF(ids);
    }
    Py_DECREF(packed);
    int64_t small[SMALL];
    int64_t *found = out == NULL ? NULL : scratch(small, SMALL, count);
    if (found == NULL) {
        Py_XDECREF(out);
        return NULL;
    }
    Py_ssize_t used, k = take_core(self, lo, hi, count, fenced, found, &used);
    self->visited += used;
    if (k < count) { /* (what was popped stays dropped: the caller asked for holes it lacks) */
        Py_SETREF(out, Py_NewRef(Py_None));
    } else {
        for (Py_ssize_t j = 0; j < count; j++) {
            self->loc[raw[j]] = found[j];
            self->owner[found[j]] = raw[j];
        }
    }
    if (found != small) {
        PyMem_Free(found);
    }
    return out;
}

/* bind(slots, top) -> ids */
PyObject *slotloops_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    if (!ready(self) || !args_count(nargs, 2, "bind")) {
        return NULL;
    }
    PyObject *list = args[0];
    int64_t top;
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "bind: slots must be a list");
        return NULL;
    }
    if (as_i64(args[1], "top", &top) < 0) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (top < n || top > self->max_slots) {
        PyErr_Format(PyExc_ValueError, "bind: %zd ids wanted from a free stack of %lld (of %zd)",
                     n, (long long)top, self->max_slots);
        return NULL;
    }
    int64_t small[2 * SMALL];
    int64_t *buf = scratch(small, 2 * SMALL, 2 * n);
    if (buf == NULL) {
        return NULL;
    }
    int64_t *slots = buf, *ids = buf + n;
    PyObject *out = NULL;
    if (parse_slots(self, list, "bind: slot", slots) < 0) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t id = self->free_ids[top - 1 - k];
        if (id < 0 || id >= self->max_slots) {
            PyErr_Format(PyExc_ValueError, "bind: free id %lld outside [0, %zd)",
                         (long long)id, self->max_slots);
            goto done;
        }
        ids[k] = id;
    }
    out = int_list(ids, n);
    if (out == NULL) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        self->loc[ids[k]] = slots[k];
        self->owner[slots[k]] = ids[k];
    }
done:
    if (buf != small) {
        PyMem_Free(buf);
    }
    return out;
}

/* free(ids, top, fenced, lo, hi, occupied, slack, trim) -> None, or (pending, lo, hi) when
 * a fence holds some of the slots or the band was trimmed */
PyObject *slotloops_free(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    if (!ready(self) || !args_count(nargs, 8, "free")) {
        return NULL;
    }
    PyObject *list = args[0];
    int64_t top, lo, hi, occupied, slack, mode;
    int fenced;
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "free: ids must be a list");
        return NULL;
    }
    if (as_i64(args[1], "top", &top) < 0 ||
        band_args(self, args[3], args[4], args[2], "free", 1, &lo, &hi, &fenced) < 0 ||
        as_i64(args[5], "occupied", &occupied) < 0 || as_i64(args[6], "slack", &slack) < 0 ||
        as_i64(args[7], "trim", &mode) < 0) {
        return NULL;
    }
    if (mode < -1 || mode > ANCHOR_HIGH) {
        PyErr_Format(PyExc_ValueError, "free: trim must be -1 (none) or an anchor 0-2, got %lld",
                     (long long)mode);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (top < 0 || top > self->max_slots - n) { /* (top + n could overflow) */
        PyErr_Format(PyExc_ValueError, "free: %zd ids onto a free stack of %lld (of %zd)", n,
                     (long long)top, self->max_slots);
        return NULL;
    }
    const int64_t bound = (int64_t)1 << 40; /* (keeps the sweep's test clear of overflow) */
    if (occupied < n || occupied > bound || slack < 0 || slack > bound) {
        PyErr_Format(PyExc_ValueError, "free: %zd ids of %lld occupied slots, slack %lld", n,
                     (long long)occupied, (long long)slack);
        return NULL;
    }
    int64_t small[2 * SMALL];
    int64_t *buf = scratch(small, 2 * SMALL, 2 * n);
    if (buf == NULL) {
        return NULL;
    }
    int64_t *ids = buf, *slots = buf + n, low = -1, high = -1;
    PyObject *out = NULL;
    if (parse_slots(self, list, "free: id", ids) < 0) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) { /* checked before anything changes */
        int64_t slot = self->loc[ids[k]];
        if (slot < 0 || slot >= self->max_slots) {
            PyErr_Format(PyExc_ValueError, "free: id %lld is not live", (long long)ids[k]);
            goto done;
        }
        slots[k] = slot;
        low = k == 0 || slot < low ? slot : low;
        high = k == 0 || slot > high ? slot : high;
    }
    if (heap_reserve(&self->holes, n) < 0) {
        goto done;
    }
    Py_ssize_t pending = 0;
    int64_t was_lo = lo, was_hi = hi;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t slot = slots[k];
        self->loc[ids[k]] = -1;
        self->owner[slot] = -1;
        /* Pushed in reverse: the next pops hand them out in this order. */
        self->free_ids[top + n - 1 - k] = ids[k];
        if (fenced && (self->readers[slot] > 0 || self->writers[slot] > 0)) {
            pending++;
        }
    }
    if (n > 0) {
        /* Stale entries past twice the holes (these n about to join them) plus the slack:
         * sweep first, amortised O(1) per stale entry. */
        int64_t holes = (hi - lo) - (occupied - n + pending);
        if (self->holes.len > 2 * (holes + n) + slack) {
            self->visited += sweep_core(self, lo, hi, fenced);
        }
        for (Py_ssize_t k = 0; k < n; k++) {
            heap_push(&self->holes, self->sign * slots[k]);
        }
        if (mode >= 0 && (high == hi - 1 || low == lo)) { /* an end freed: it may shrink */
            trim_core(self, &lo, &hi, fenced, mode, &self->visited);
        }
    }
    if (pending == 0 && lo == was_lo && hi == was_hi) { /* the usual free: nothing to report */
        out = Py_NewRef(Py_None);
    } else {
        PyObject *items[3] = {PyLong_FromSsize_t(pending), PyLong_FromLongLong(lo),
                              PyLong_FromLongLong(hi)};
        out = tuple_of(3, items);
    }
done:
    if (buf != small) {
        PyMem_Free(buf);
    }
    return out;
}

