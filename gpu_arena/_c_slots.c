/* gpu_arena._c_slots: the compiled twin of gpu_arena/slots.py (SlotLoops).
 *
 * One pool's hot loops over its tables, which it holds as buffers for its lifetime (the tables
 * are fixed-size numpy views of the pool's tensors), and the pool's hole heap, kept here as a
 * C array of keys (sign * slot): take the holes nearest the anchor, bind ids to them, unbind
 * and free ids (their slots join the heap), sweep stale entries, trim the band's free ends.
 * Same results as the pure-Python twin for every input the pool gives; arguments are checked
 * (TypeError or ValueError, nothing changed), so bad input never writes outside a table.
 * This file holds the type and its small methods; the heap, the band loops and the hot methods
 * are in gpu_arena/_slots_loops.c, built into this extension (the line below names it for
 * setup.py), with the shared declarations in gpu_arena/_slots.h.
 */
// sources: _slots_loops.c
#include "_slots.h"

static const char *const table_names[NTABLES] = {"loc", "owner", "readers", "writers",
                                                 "free_ids"};
static const Py_ssize_t table_itemsize[NTABLES] = {8, 8, 4, 4, 8};

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
