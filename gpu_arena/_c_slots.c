/* gpu_arena._c_slots: the compiled twin of gpu_arena/slots.py (SlotLoops).
 *
 * One pool's hot loops over its tables, which it holds as buffers for its lifetime (the tables
 * are fixed-size numpy views of the pool's tensors), and the pool's hole heap, kept here as a
 * C array of keys (sign * slot): take the holes nearest the anchor, bind ids to them, unbind
 * and free ids (their slots join the heap), sweep stale entries, trim the band's free ends.
 * Same results as the pure-Python twin for every input the pool gives; arguments are checked
 * (TypeError or ValueError, nothing changed), so bad input never writes outside a table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The hole heap: a binary min-heap of int64 keys in a growable C array. */
typedef struct {
    int64_t *keys;
    Py_ssize_t len, cap;
} Heap;

/* Room for `extra` more keys; -1 with MemoryError (nothing changed). */
static int heap_reserve(Heap *h, Py_ssize_t extra) {
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

static void heap_free(Heap *h) {
    PyMem_Free(h->keys);
    h->keys = NULL;
    h->len = h->cap = 0;
}

/* Push a key (room reserved). */
static void heap_push(Heap *h, int64_t key) {
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
static int64_t heap_pop(Heap *h) {
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
static void heap_sort(Heap *h) {
    if (h->len > 1) {
        qsort(h->keys, (size_t)h->len, sizeof(int64_t), cmp_i64);
    }
}

enum { LOC, OWNER, READERS, WRITERS, FREE, NTABLES };
static const char *const table_names[NTABLES] = {"loc", "owner", "readers", "writers",
                                                 "free_ids"};
static const Py_ssize_t table_itemsize[NTABLES] = {8, 8, 4, 4, 8};
enum { ANCHOR_LOW, ANCHOR_FLOAT, ANCHOR_HIGH }; /* trim modes: which ends may shrink */

typedef struct {
    PyObject_HEAD
    Py_buffer views[NTABLES];
    int held; /* tables whose buffer is held */
    int busy; /* calls running: __init__ from their callbacks would free the tables under them */
    Py_ssize_t max_slots;
    int64_t *loc, *owner, *free_ids;
    int32_t *readers, *writers;
    int64_t sign; /* hole key = sign * slot: -1 for a pool anchored high */
    Heap holes;   /* every hole of the band, and stale entries (validated when they surface) */
    Py_ssize_t visited; /* heap entries and band slots read so far (a cost stat for tests) */
} SlotLoops;

/* Whether a buffer holds native-order integers of itemsize bytes ('@' or '=' prefix or none:
 * numpy writes 'l' for int64 and 'i' for int32; under '=' sizes are standard, 'l' is 4). */
static int format_ok(const Py_buffer *view, Py_ssize_t itemsize) {
    const char *f = view->format ? view->format : "B";
    int native = 1;
    if (*f == '@') {
        f++;
    } else if (*f == '=') {
        native = 0;
        f++;
    }
    if (f[0] == '\0' || f[1] != '\0' || view->itemsize != itemsize) {
        return 0;
    }
    char c = f[0];
    if (itemsize == 8) {
        return c == 'q' || (c == 'l' && native && sizeof(long) == 8);
    }
    return c == 'i' || (c == 'l' && (!native || sizeof(long) == 4));
}

static void slotloops_release_views(SlotLoops *self) {
    for (int t = 0; t < NTABLES; t++) {
        if (self->held & (1 << t)) {
            PyBuffer_Release(&self->views[t]);
        }
    }
    self->held = 0;
}

/* An int (or an object with __index__, e.g. a numpy integer) as int64; -1 with an exception. */
static int as_i64(PyObject *o, const char *what, int64_t *out) {
    long long v;
    if (PyLong_Check(o)) { /* no Python code runs for an int (or an int subclass) */
        v = PyLong_AsLongLong(o);
    } else {
        Py_INCREF(o); /* __index__ may run Python code: hold what we read */
        PyObject *index = PyNumber_Index(o);
        Py_DECREF(o);
        if (index == NULL) {
            PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", what,
                         Py_TYPE(o)->tp_name);
            return -1;
        }
        v = PyLong_AsLongLong(index);
        Py_DECREF(index);
    }
    if (v == -1 && PyErr_Occurred()) {
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

static int slotloops_init(PyObject *op, PyObject *args, PyObject *kwds) {
    SlotLoops *self = (SlotLoops *)op;
    static char *kwlist[] = {"loc", "owner", "readers", "writers", "free_ids", "sign", NULL};
    PyObject *objs[NTABLES], *sign_obj = NULL;
    int64_t sign = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|O:SlotLoops", kwlist, &objs[0],
                                     &objs[1], &objs[2], &objs[3], &objs[4], &sign_obj)) {
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "SlotLoops: __init__ while a call on it is running");
        return -1;
    }
    if (sign_obj != NULL && as_i64(sign_obj, "sign", &sign) < 0) {
        return -1;
    }
    if (sign != 1 && sign != -1) {
        PyErr_Format(PyExc_ValueError, "SlotLoops: sign must be 1 or -1, got %lld",
                     (long long)sign);
        return -1;
    }
    slotloops_release_views(self);
    self->holes.len = 0; /* new tables: no holes known */
    self->visited = 0;
    Py_ssize_t n = -1;
    for (int t = 0; t < NTABLES; t++) {
        Py_buffer *v = &self->views[t];
        if (PyObject_GetBuffer(objs[t], v, PyBUF_CONTIG | PyBUF_FORMAT) < 0) {
            slotloops_release_views(self);
            return -1;
        }
        self->held |= 1 << t;
        if (v->ndim != 1 || !format_ok(v, table_itemsize[t])) {
            PyErr_Format(PyExc_TypeError, "SlotLoops: %s must be a 1-D writable int%d buffer, "
                         "got format %s, %d dims", table_names[t],
                         (int)(8 * table_itemsize[t]), v->format ? v->format : "B", v->ndim);
            slotloops_release_views(self);
            return -1;
        }
        Py_ssize_t len = v->shape[0];
        if (n >= 0 && len != n) {
            PyErr_Format(PyExc_ValueError, "SlotLoops: %s has %zd entries, loc has %zd",
                         table_names[t], len, n);
            slotloops_release_views(self);
            return -1;
        }
        n = len;
    }
    self->max_slots = n;
    self->sign = sign;
    self->loc = (int64_t *)self->views[LOC].buf;
    self->owner = (int64_t *)self->views[OWNER].buf;
    self->readers = (int32_t *)self->views[READERS].buf;
    self->writers = (int32_t *)self->views[WRITERS].buf;
    self->free_ids = (int64_t *)self->views[FREE].buf;
    return 0;
}

static void slotloops_dealloc(PyObject *op) {
    SlotLoops *self = (SlotLoops *)op;
    slotloops_release_views(self);
    heap_free(&self->holes);
    Py_TYPE(op)->tp_free(op);
}

static int ready(SlotLoops *self) {
    if (self->held != (1 << NTABLES) - 1) {
        PyErr_SetString(PyExc_ValueError, "SlotLoops: not initialised");
        return 0;
    }
    return 1;
}

static int args_count(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return 0;
    }
    return 1;
}

/* A list of C ints as a Python list of ints (NULL on error). */
static PyObject *int_list(const int64_t *values, Py_ssize_t n) {
    PyObject *list = PyList_New(n);
    if (list == NULL) {
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *v = PyLong_FromLongLong(values[k]);
        if (v == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, k, v);
    }
    return list;
}

/* A tuple of n new references it steals (NULL, dropping them all, when one is NULL or the
 * tuple cannot be made): Py_BuildValue without parsing a format on the hot paths. */
static PyObject *tuple_of(Py_ssize_t n, PyObject **items) {
    PyObject *out = NULL;
    int ok = 1;
    for (Py_ssize_t k = 0; k < n; k++) {
        ok = ok && items[k] != NULL;
    }
    if (ok) {
        out = PyTuple_New(n);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if (out != NULL) {
            PyTuple_SET_ITEM(out, k, items[k]);
        } else {
            Py_XDECREF(items[k]);
        }
    }
    return out;
}

/* Scratch for up to n int64s: the stack buffer when it is big enough. */
static int64_t *scratch(int64_t *small, Py_ssize_t small_n, Py_ssize_t n) {
    if (n <= small_n) {
        return small;
    }
    int64_t *p = PyMem_Malloc((size_t)n * sizeof(int64_t));
    if (p == NULL) {
        PyErr_NoMemory();
    }
    return p;
}

#define SMALL 128

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
static Py_ssize_t take_core(SlotLoops *self, int64_t lo, int64_t hi, Py_ssize_t want,
                            int fenced, int64_t *found, Py_ssize_t *used) {
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
static Py_ssize_t sweep_core(SlotLoops *self, int64_t lo, int64_t hi, int fenced) {
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
static void trim_core(SlotLoops *self, int64_t *lo, int64_t *hi, int fenced, int64_t mode,
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

/* Parse a list of ints in [0, max_slots) into out; -1 with an exception otherwise. */
static int parse_slots(SlotLoops *self, PyObject *list, const char *what, int64_t *out) {
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t v;
        if (PyList_GET_SIZE(list) != n) { /* an item's __index__ changed the list */
            PyErr_Format(PyExc_ValueError, "%s: the list changed while it was read", what);
            return -1;
        }
        if (as_i64(PyList_GET_ITEM(list, k), what, &v) < 0) {
            return -1;
        }
        if (v < 0 || v >= self->max_slots) {
            PyErr_Format(PyExc_ValueError, "%s %lld outside [0, %zd)", what, (long long)v,
                         self->max_slots);
            return -1;
        }
        out[k] = v;
    }
    return 0;
}

/* lo, hi and fenced. A band [lo, hi) must lie inside the table
 * unless it is empty (strict: always, with lo <= hi). 0 on success. */
static int band_args(SlotLoops *self, PyObject *lo_o, PyObject *hi_o, PyObject *fenced_o,
                     const char *name, int strict, int64_t *lo, int64_t *hi, int *fenced) {
    if (as_i64(lo_o, "lo", lo) < 0 || as_i64(hi_o, "hi", hi) < 0) {
        return -1;
    }
    *fenced = PyObject_IsTrue(fenced_o);
    if (*fenced < 0) {
        return -1;
    }
    int bad = strict ? (*lo < 0 || *lo > *hi || *hi > self->max_slots)
                     : (*lo < *hi && (*lo < 0 || *hi > self->max_slots));
    if (bad) {
        PyErr_Format(PyExc_ValueError, "%s: band [%lld, %lld) outside [0, %zd)", name,
                     (long long)*lo, (long long)*hi, self->max_slots);
        return -1;
    }
    return 0;
}

/* take(lo, hi, n, fenced) -> slots */
static PyObject *slotloops_take(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    int64_t lo, hi, n;
    int fenced;
    if (!ready(self) || !args_count(nargs, 4, "take") ||
        band_args(self, args[0], args[1], args[3], "take", 0, &lo, &hi, &fenced) < 0 ||
        as_i64(args[2], "n", &n) < 0) {
        return NULL;
    }
    Py_ssize_t size = self->holes.len;
    if (n <= 0 || size == 0) {
        return PyList_New(0);
    }
    Py_ssize_t want = n < size ? (Py_ssize_t)n : size, used;
    int64_t small[SMALL];
    int64_t *found = scratch(small, SMALL, want);
    if (found == NULL) {
        return NULL;
    }
    Py_ssize_t k = take_core(self, lo, hi, want, fenced, found, &used);
    self->visited += used;
    PyObject *out = int_list(found, k);
    if (found != small) {
        PyMem_Free(found);
    }
    return out;
}

/* take_bind(lo, hi, n, fenced, top) -> (ids, packed) or None: packed is the ids as native
 * int64 bytes (a bytearray: torch.frombuffer makes the caller's tensor from it without
 * converting the ints again); None (nothing bound) when fewer than n holes were found */
static PyObject *slotloops_take_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *slotloops_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
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
static PyObject *slotloops_free(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
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

/* add(slots): remember free slots as possible holes (validated when they surface). */
static PyObject *slotloops_add(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    if (!ready(self) || !args_count(nargs, 1, "add")) {
        return NULL;
    }
    PyObject *list = args[0];
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "add: slots must be a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    int64_t small[SMALL];
    int64_t *slots = scratch(small, SMALL, n);
    if (slots == NULL) {
        return NULL;
    }
    PyObject *out = NULL;
    if (parse_slots(self, list, "add: slot", slots) == 0 &&
        heap_reserve(&self->holes, n) == 0) {
        for (Py_ssize_t k = 0; k < n; k++) {
            heap_push(&self->holes, self->sign * slots[k]);
        }
        out = Py_NewRef(Py_None);
    }
    if (slots != small) {
        PyMem_Free(slots);
    }
    return out;
}

/* sweep(lo, hi, fenced) */
static PyObject *slotloops_sweep(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    int64_t lo, hi;
    int fenced;
    if (!ready(self) || !args_count(nargs, 3, "sweep") ||
        band_args(self, args[0], args[1], args[2], "sweep", 0, &lo, &hi, &fenced) < 0) {
        return NULL;
    }
    self->visited += sweep_core(self, lo, hi, fenced);
    Py_RETURN_NONE;
}

/* trim(lo, hi, fenced, anchor) -> (lo, hi) */
static PyObject *slotloops_trim(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    int64_t lo, hi, mode;
    int fenced;
    if (!ready(self) || !args_count(nargs, 4, "trim") ||
        band_args(self, args[0], args[1], args[2], "trim", 1, &lo, &hi, &fenced) < 0 ||
        as_i64(args[3], "anchor", &mode) < 0) {
        return NULL;
    }
    if (mode < ANCHOR_LOW || mode > ANCHOR_HIGH) {
        PyErr_Format(PyExc_ValueError, "trim: anchor must be 0-2, got %lld", (long long)mode);
        return NULL;
    }
    trim_core(self, &lo, &hi, fenced, mode, &self->visited);
    return Py_BuildValue("(LL)", (long long)lo, (long long)hi);
}

/* entries() -> the hole heap's entries, in heap order */
static PyObject *slotloops_entries(PyObject *op, PyObject *Py_UNUSED(ignored)) {
    SlotLoops *self = (SlotLoops *)op;
    return int_list(self->holes.keys, self->holes.len);
}

static Py_ssize_t slotloops_len(PyObject *op) {
    return ((SlotLoops *)op)->holes.len;
}

/* Each call holds the loops busy: a callback on the way (an item's __index__) that calls
 * __init__ is refused, instead of releasing the tables under the running loop. */
#define GUARDED(name)                                                                         \
    static PyObject *name##_guarded(PyObject *op, PyObject *const *args, Py_ssize_t nargs) { \
        SlotLoops *self = (SlotLoops *)op;                                                    \
        self->busy++;                                                                         \
        PyObject *out = name(op, args, nargs);                                                \
        self->busy--;                                                                         \
        return out;                                                                           \
    }
GUARDED(slotloops_take)
GUARDED(slotloops_take_bind)
GUARDED(slotloops_bind)
GUARDED(slotloops_free)
GUARDED(slotloops_add)
GUARDED(slotloops_sweep)
GUARDED(slotloops_trim)

#define FAST(name) (PyCFunction)(void (*)(void))name##_guarded, METH_FASTCALL
static PyMethodDef slotloops_methods[] = {
    {"take", FAST(slotloops_take),
     "take(lo, hi, n, fenced) -> slots: take off the hole heap the n holes of [lo, hi) "
     "nearest the anchor (stale entries read on the way are dropped)."},
    {"take_bind", FAST(slotloops_take_bind),
     "take_bind(lo, hi, n, fenced, top) -> (ids, packed) or None: take n holes and bind ids "
     "popped off the free stack at top to them (None, nothing bound, when fewer than n were "
     "found); packed: the ids as native int64 bytes (a bytearray)."},
    {"bind", FAST(slotloops_bind),
     "bind(slots, top) -> ids: pop ids off the free stack and bind them to slots."},
    {"free", FAST(slotloops_free),
     "free(ids, top, fenced, lo, hi, occupied, slack, trim) -> None or (pending, lo, hi): "
     "unbind live ids of the band [lo, hi) holding `occupied` live or pending slots, push them "
     "on the free stack, sweep the hole heap when stale entries pass twice the holes plus "
     "slack, add their slots to it, and when an end of the band was freed trim it (trim: the "
     "anchor 0-2, -1 for no trim); None unless a fence holds some (how many) or the band "
     "changed (the band)."},
    {"add", FAST(slotloops_add), "add(slots): remember free slots as possible holes."},
    {"sweep", FAST(slotloops_sweep),
     "sweep(lo, hi, fenced): keep only the entries that are holes of [lo, hi) now, each "
     "once."},
    {"trim", FAST(slotloops_trim),
     "trim(lo, hi, fenced, anchor) -> (lo, hi): shrink the band from its inner "
     "edge(s) past free unfenced slots (anchor 0 low, 1 float, 2 high)."},
    {"entries", slotloops_entries, METH_NOARGS,
     "entries() -> the hole heap's entries (sign * slot), in heap order."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef slotloops_members[] = {
    {"visited", T_PYSSIZET, offsetof(SlotLoops, visited), READONLY,
     "Heap entries and band slots read so far (takes, sweeps, trims)."},
    {NULL, 0, 0, 0, NULL},
};

static PySequenceMethods slotloops_as_sequence = {.sq_length = slotloops_len};

static PyTypeObject SlotLoopsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpu_arena._c_slots.SlotLoops",
    .tp_basicsize = sizeof(SlotLoops),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One pool's hole heap and the per-id loops of its alloc and free over its tables; "
              "len(): the heap's entries.",
    .tp_new = PyType_GenericNew,
    .tp_init = slotloops_init,
    .tp_dealloc = slotloops_dealloc,
    .tp_methods = slotloops_methods,
    .tp_members = slotloops_members,
    .tp_as_sequence = &slotloops_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_c_slots",
    .m_doc = "Compiled twin of gpu_arena.slots.SlotLoops (same results).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__c_slots(void) {
    if (PyType_Ready(&SlotLoopsType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    Py_INCREF(&SlotLoopsType);
    if (PyModule_AddObject(m, "SlotLoops", (PyObject *)&SlotLoopsType) < 0) {
        Py_DECREF(&SlotLoopsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
