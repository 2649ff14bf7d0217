/* gpu_arena._c_slots, shared: the pool's loops object, its hole heap, and the argument
 * helpers of its methods (gpu_arena/_c_slots.c: the type, its small methods; gpu_arena/
 * _slots_loops.c: the heap, the band loops and the hot methods, built into the same
 * extension). Helpers are static inline: each file has its own copy. */
#ifndef GPU_ARENA_SLOTS_H
#define GPU_ARENA_SLOTS_H

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

enum { LOC, OWNER, READERS, WRITERS, FREE, NTABLES };
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


/* An int (or an object with __index__, e.g. a numpy integer) as int64; -1 with an exception. */
static inline int as_i64(PyObject *o, const char *what, int64_t *out) {
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

static inline int ready(SlotLoops *self) {
    if (self->held != (1 << NTABLES) - 1) {
        PyErr_SetString(PyExc_ValueError, "SlotLoops: not initialised");
        return 0;
    }
    return 1;
}

static inline int args_count(Py_ssize_t nargs, Py_ssize_t want, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return 0;
    }
    return 1;
}

/* A list of C ints as a Python list of ints (NULL on error). */
static inline PyObject *int_list(const int64_t *values, Py_ssize_t n) {
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
static inline PyObject *tuple_of(Py_ssize_t n, PyObject **items) {
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
static inline int64_t *scratch(int64_t *small, Py_ssize_t small_n, Py_ssize_t n) {
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

/* Parse a list of ints in [0, max_slots) into out; -1 with an exception otherwise. */
static inline int parse_slots(SlotLoops *self, PyObject *list, const char *what, int64_t *out) {
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
static inline int band_args(SlotLoops *self, PyObject *lo_o, PyObject *hi_o, PyObject *fenced_o,
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

/* _slots_loops.c: the hole heap */
int heap_reserve(Heap *h, Py_ssize_t extra);
void heap_free(Heap *h);
void heap_push(Heap *h, int64_t key);
int64_t heap_pop(Heap *h);
void heap_sort(Heap *h);
/* _slots_loops.c: the band loops */
Py_ssize_t take_core(SlotLoops *self, int64_t lo, int64_t hi, Py_ssize_t want, int fenced,
                     int64_t *found, Py_ssize_t *used);
Py_ssize_t sweep_core(SlotLoops *self, int64_t lo, int64_t hi, int fenced);
void trim_core(SlotLoops *self, int64_t *lo, int64_t *hi, int fenced, int64_t mode,
               Py_ssize_t *visited);
/* _slots_loops.c: the hot methods (in _c_slots.c's method table) */
PyObject *slotloops_take_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs);
PyObject *slotloops_bind(PyObject *op, PyObject *const *args, Py_ssize_t nargs);
PyObject *slotloops_free(PyObject *op, PyObject *const *args, Py_ssize_t nargs);

#endif /* GPU_ARENA_SLOTS_H */
