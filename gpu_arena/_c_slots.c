/* gpu_arena._c_slots: the compiled twin of gpu_arena/slots.py (SlotLoops).
 *
 * The per-id loops of a pool's alloc and free (take holes off the hole heap's sorted list,
 * bind ids to slots, release them) over the pool's tables, which it holds as buffers for its
 * lifetime (the tables are fixed-size numpy views of the pool's tensors). Same results as the
 * pure-Python loops for every input the pool gives; arguments are checked (TypeError or
 * ValueError, nothing changed), so bad input never writes outside a table.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum { LOC, OWNER, READERS, WRITERS, FREE, NTABLES };
static const char *const table_names[NTABLES] = {"loc", "owner", "readers", "writers",
                                                 "free_ids"};
static const Py_ssize_t table_itemsize[NTABLES] = {8, 8, 4, 4, 8};

typedef struct {
    PyObject_HEAD
    Py_buffer views[NTABLES];
    int held; /* tables whose buffer is held */
    int busy; /* calls running: __init__ from their callbacks would free the tables under them */
    Py_ssize_t max_slots;
    int64_t *loc, *owner, *free_ids;
    int32_t *readers, *writers;
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

static int slotloops_init(PyObject *op, PyObject *args, PyObject *kwds) {
    SlotLoops *self = (SlotLoops *)op;
    static char *kwlist[] = {"loc", "owner", "readers", "writers", "free_ids", NULL};
    PyObject *objs[NTABLES];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO:SlotLoops", kwlist, &objs[0], &objs[1],
                                     &objs[2], &objs[3], &objs[4])) {
        return -1;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "SlotLoops: __init__ while a call on it is running");
        return -1;
    }
    slotloops_release_views(self);
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
    self->loc = (int64_t *)self->views[LOC].buf;
    self->owner = (int64_t *)self->views[OWNER].buf;
    self->readers = (int32_t *)self->views[READERS].buf;
    self->writers = (int32_t *)self->views[WRITERS].buf;
    self->free_ids = (int64_t *)self->views[FREE].buf;
    return 0;
}

static void slotloops_dealloc(PyObject *op) {
    slotloops_release_views((SlotLoops *)op);
    Py_TYPE(op)->tp_free(op);
}

static int ready(SlotLoops *self) {
    if (self->held != (1 << NTABLES) - 1) {
        PyErr_SetString(PyExc_ValueError, "SlotLoops: not initialised");
        return 0;
    }
    return 1;
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

/* Sort the hole-heap keys in entries and take off their front the first `want` (>= 1) that are
 * holes of [lo, hi): their slots into found[0..*k), the entries read (and deleted) in *used. */
static int take_core(SlotLoops *self, PyObject *entries, int64_t sign, int64_t lo, int64_t hi,
                     Py_ssize_t want, int fenced, int64_t *found, Py_ssize_t *k_out,
                     Py_ssize_t *used_out) {
    if (PyList_Sort(entries) < 0) {
        return -1;
    }
    const int64_t *owner = self->owner;
    const int32_t *readers = self->readers, *writers = self->writers;
    /* Keys beyond any slot cannot be holes; clamping them keeps sign * key in range. */
    const int64_t bound = (int64_t)self->max_slots + 1;
    Py_ssize_t used = 0, k = 0;
    int64_t last = 0;
    int has_last = 0;
    /* (The list's size is re-read: an entry's __index__ could change the list.) */
    while (used < PyList_GET_SIZE(entries) && k < want) {
        int64_t key;
        if (as_i64(PyList_GET_ITEM(entries, used), "a hole-heap entry", &key) < 0) {
            return -1;
        }
        used++;
        key = key > bound ? bound : (key < -bound ? -bound : key);
        int64_t slot = sign * key;
        if (has_last && slot == last) { /* a repeated entry: equal entries are adjacent */
            continue;
        }
        last = slot;
        has_last = 1;
        if (lo <= slot && slot < hi && owner[slot] < 0 &&
            !(fenced && (readers[slot] > 0 || writers[slot] > 0))) {
            found[k++] = slot;
        }
    }
    if (PyList_SetSlice(entries, 0, used, NULL) < 0) {
        return -1;
    }
    *k_out = k;
    *used_out = used;
    return 0;
}

/* Parse the take arguments (entries, sign, lo, hi, n, fenced); 0 on success. */
static int take_args(SlotLoops *self, PyObject *const *args, PyObject **entries, int64_t *sign,
                     int64_t *lo, int64_t *hi, int64_t *n, int *fenced) {
    *entries = args[0];
    if (!PyList_CheckExact(*entries)) {
        PyErr_SetString(PyExc_TypeError, "take: entries must be a list");
        return -1;
    }
    if (as_i64(args[1], "sign", sign) < 0 || as_i64(args[2], "lo", lo) < 0 ||
        as_i64(args[3], "hi", hi) < 0 || as_i64(args[4], "n", n) < 0) {
        return -1;
    }
    *fenced = PyObject_IsTrue(args[5]);
    if (*fenced < 0) {
        return -1;
    }
    if (*sign != 1 && *sign != -1) {
        PyErr_Format(PyExc_ValueError, "take: sign must be 1 or -1, got %lld", (long long)*sign);
        return -1;
    }
    if (*lo < *hi && (*lo < 0 || *hi > self->max_slots)) { /* (an empty band finds nothing) */
        PyErr_Format(PyExc_ValueError, "take: band [%lld, %lld) outside [0, %zd)",
                     (long long)*lo, (long long)*hi, self->max_slots);
        return -1;
    }
    return 0;
}

/* take(entries, sign, lo, hi, n, fenced) -> (slots, used) */
static PyObject *slotloops_take(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    PyObject *entries;
    int64_t sign, lo, hi, n;
    int fenced;
    if (!ready(self) || !args_count(nargs, 6, "take") ||
        take_args(self, args, &entries, &sign, &lo, &hi, &n, &fenced) < 0) {
        return NULL;
    }
    Py_ssize_t size = PyList_GET_SIZE(entries);
    if (n <= 0 || size == 0) {
        return Py_BuildValue("(Ni)", PyList_New(0), 0);
    }
    Py_ssize_t want = n < size ? (Py_ssize_t)n : size, k, used;
    int64_t small[SMALL];
    int64_t *found = scratch(small, SMALL, want);
    if (found == NULL) {
        return NULL;
    }
    PyObject *out = NULL;
    if (take_core(self, entries, sign, lo, hi, want, fenced, found, &k, &used) == 0) {
        out = Py_BuildValue("(Nn)", int_list(found, k), used);
    }
    if (found != small) {
        PyMem_Free(found);
    }
    return out;
}

/* take_bind(entries, sign, lo, hi, n, fenced, top) -> (ids or None, used, packed): packed is
 * the ids as native int64 bytes (a bytearray: torch.frombuffer makes the caller's tensor from
 * it without converting the ints again), None with ids */
static PyObject *slotloops_take_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    PyObject *entries;
    int64_t sign, lo, hi, n, top;
    int fenced;
    if (!ready(self) || !args_count(nargs, 7, "take_bind") ||
        take_args(self, args, &entries, &sign, &lo, &hi, &n, &fenced) < 0 ||
        as_i64(args[6], "top", &top) < 0) {
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
    Py_ssize_t size = PyList_GET_SIZE(entries);
    if (n == 0) {
        PyObject *none = PyList_New(0), *bytes = PyByteArray_FromStringAndSize(NULL, 0);
        if (none == NULL || bytes == NULL) {
            Py_XDECREF(none);
            Py_XDECREF(bytes);
            return NULL;
        }
        return Py_BuildValue("(NiN)", none, 0, bytes);
    }
    if (size == 0) {
        return Py_BuildValue("(OiO)", Py_None, 0, Py_None);
    }
    int64_t small[SMALL];
    int64_t *found = scratch(small, SMALL, (Py_ssize_t)n);
    if (found == NULL) {
        return NULL;
    }
    PyObject *out = NULL, *ids = NULL, *packed = NULL;
    Py_ssize_t k, used;
    if (take_core(self, entries, sign, lo, hi, (Py_ssize_t)n, fenced, found, &k, &used) < 0) {
        goto done;
    }
    if (k < n) {
        out = Py_BuildValue("(OnO)", Py_None, used, Py_None);
        goto done;
    }
    for (Py_ssize_t j = 0; j < (Py_ssize_t)n; j++) { /* an entry's __index__ may have run */
        int64_t id = self->free_ids[top - 1 - j];
        if (id < 0 || id >= self->max_slots) {
            PyErr_Format(PyExc_ValueError, "take_bind: free id %lld outside [0, %zd)",
                         (long long)id, self->max_slots);
            goto done;
        }
    }
    ids = PyList_New((Py_ssize_t)n);
    if (ids == NULL) {
        goto done;
    }
    packed = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)n * (Py_ssize_t)sizeof(int64_t));
    if (packed == NULL) {
        Py_CLEAR(ids);
        goto done;
    }
    int64_t *raw = (int64_t *)PyByteArray_AS_STRING(packed);
    for (Py_ssize_t j = 0; j < (Py_ssize_t)n; j++) {
        raw[j] = self->free_ids[top - 1 - j];
        PyObject *v = PyLong_FromLongLong(raw[j]);
        if (v == NULL) {
            Py_CLEAR(ids);
            Py_CLEAR(packed);
            goto done;
        }
        PyList_SET_ITEM(ids, j, v);
    }
    for (Py_ssize_t j = 0; j < (Py_ssize_t)n; j++) {
        self->loc[raw[j]] = found[j];
        self->owner[found[j]] = raw[j];
    }
    out = Py_BuildValue("(NnN)", ids, used, packed);
done:
    if (found != small) {
        PyMem_Free(found);
    }
    return out;
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

/* release(ids, top, fenced, sign) -> (keys, pending, low, high) */
static PyObject *slotloops_release(PyObject *op, PyObject *const *args, Py_ssize_t nargs) {
    SlotLoops *self = (SlotLoops *)op;
    if (!ready(self) || !args_count(nargs, 4, "release")) {
        return NULL;
    }
    PyObject *list = args[0];
    int64_t top, sign;
    if (!PyList_CheckExact(list)) {
        PyErr_SetString(PyExc_TypeError, "release: ids must be a list");
        return NULL;
    }
    if (as_i64(args[1], "top", &top) < 0) {
        return NULL;
    }
    int fenced = PyObject_IsTrue(args[2]);
    if (fenced < 0 || as_i64(args[3], "sign", &sign) < 0) {
        return NULL;
    }
    if (sign != 1 && sign != -1) {
        PyErr_Format(PyExc_ValueError, "release: sign must be 1 or -1, got %lld",
                     (long long)sign);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (top < 0 || top > self->max_slots - n) { /* (top + n could overflow) */
        PyErr_Format(PyExc_ValueError, "release: %zd ids onto a free stack of %lld (of %zd)",
                     n, (long long)top, self->max_slots);
        return NULL;
    }
    int64_t small[2 * SMALL];
    int64_t *buf = scratch(small, 2 * SMALL, 2 * n);
    if (buf == NULL) {
        return NULL;
    }
    int64_t *ids = buf, *keys = buf + n;
    PyObject *out = NULL, *key_list = NULL;
    int64_t low = -1, high = -1;
    if (parse_slots(self, list, "release: id", ids) < 0) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < n; k++) { /* checked before anything changes */
        int64_t slot = self->loc[ids[k]];
        if (slot < 0 || slot >= self->max_slots) {
            PyErr_Format(PyExc_ValueError, "release: id %lld is not live", (long long)ids[k]);
            goto done;
        }
        keys[k] = sign * slot;
        low = k == 0 || slot < low ? slot : low;
        high = k == 0 || slot > high ? slot : high;
    }
    key_list = int_list(keys, n);
    if (key_list == NULL) {
        goto done;
    }
    Py_ssize_t pending = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t slot = sign * keys[k];
        self->loc[ids[k]] = -1;
        self->owner[slot] = -1;
        /* Pushed in reverse: the next pops hand them out in this order. */
        self->free_ids[top + n - 1 - k] = ids[k];
        if (fenced && (self->readers[slot] > 0 || self->writers[slot] > 0)) {
            pending++;
        }
    }
    out = Py_BuildValue("(NnLL)", key_list, pending, (long long)low, (long long)high);
done:
    if (buf != small) {
        PyMem_Free(buf);
    }
    return out;
}

/* Each call holds the loops busy: a callback on the way (an item's __index__, a sort's __lt__)
 * that calls __init__ is refused, instead of releasing the tables under the running loop. */
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
GUARDED(slotloops_release)

static PyMethodDef slotloops_methods[] = {
    {"take", (PyCFunction)(void (*)(void))slotloops_take_guarded, METH_FASTCALL,
     "take(entries, sign, lo, hi, n, fenced) -> (slots, used): sort the hole-heap keys and "
     "take off their front the first n holes of [lo, hi)."},
    {"take_bind", (PyCFunction)(void (*)(void))slotloops_take_bind_guarded, METH_FASTCALL,
     "take_bind(entries, sign, lo, hi, n, fenced, top) -> (ids, used, packed): take n holes "
     "and bind ids to them; ids is None (nothing bound) when fewer than n were found; packed: "
     "the ids as native int64 bytes (a bytearray), None with ids."},
    {"bind", (PyCFunction)(void (*)(void))slotloops_bind_guarded, METH_FASTCALL,
     "bind(slots, top) -> ids: pop ids off the free stack and bind them to slots."},
    {"release", (PyCFunction)(void (*)(void))slotloops_release_guarded, METH_FASTCALL,
     "release(ids, top, fenced, sign) -> (keys, pending, low, high): unbind live ids, push "
     "them on the free stack; their slots as hole-heap keys (sign * slot), how many a fence "
     "holds, the lowest and highest slot (-1 for none)."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SlotLoopsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpu_arena._c_slots.SlotLoops",
    .tp_basicsize = sizeof(SlotLoops),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The per-id loops of one pool's alloc and free over its tables.",
    .tp_new = PyType_GenericNew,
    .tp_init = slotloops_init,
    .tp_dealloc = slotloops_dealloc,
    .tp_methods = slotloops_methods,
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
