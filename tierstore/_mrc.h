// The shadow's compiled loops, shared: key tests, plain numbers and the slot tree's reads and
// writes. Used by the _c_mrc extension (tierstore/_c_mrc.c, the reads; tierstore/_mrc_touch.c,
// the stack's moves, built into it: setup.py compiles the files its "sources" line names) and
// by _c_shadow (the depth bound's drop). Every helper is static inline, so each file has its
// own copy and no symbol leaves a module.
#ifndef TIERSTORE_MRC_H
#define TIERSTORE_MRC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>


#define SHIFT 8  // slots per block: 2**SHIFT (mrc._SHIFT)

// key < limit, as bytes compare (lexicographic, a prefix sorts first)
static inline int below(PyObject *key, const char *lim, Py_ssize_t nlim) {
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    int c = memcmp(PyBytes_AS_STRING(key), lim, (size_t)(n < nlim ? n : nlim));
    return c < 0 || (c == 0 && n < nlim);
}

// The end prefilter (mrc_loops.END_BITS): one bit per value of a key's bytes 8-10 (18 low
// bits), set for every key in the end set. Keys are uniform hashes, so a clear bit rules a key
// out without hashing it for the end set's lookup; a set bit (or a key under 11 bytes) only
// says "look it up". No false negatives: the ends found are the same.
#define END_BITS (1 << 18)
#define END_BYTES (END_BITS / 8)

static inline long end_bit(PyObject *key) {
    if (PyBytes_GET_SIZE(key) < 11) return -1;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(key);
    return (long)((((unsigned long)p[8] << 16) | ((unsigned long)p[9] << 8) | p[10])
                  & (END_BITS - 1));
}

static inline int end_maybe(PyObject *key, const unsigned char *bits) {
    long b = end_bit(key);
    return b < 0 || (bits[b >> 3] >> (b & 7)) & 1;
}

// int.from_bytes(key[4:8], "big") < threshold
static inline int end_sampled(PyObject *key, unsigned long long threshold) {
    Py_ssize_t n = PyBytes_GET_SIZE(key);
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(key);
    unsigned long long v = 0;
    for (Py_ssize_t i = 4; i < 8 && i < n; i++) v = (v << 8) | p[i];
    return v < threshold;
}

// A list or dict item as a number: an exact float or int only. Converting any other object runs
// its __float__ / __index__, which could change the lists these loops hold item pointers into.
static inline int plain_double(PyObject *o, const char *what, double *out) {
    if (PyFloat_CheckExact(o)) {
        *out = PyFloat_AS_DOUBLE(o);
        return 0;
    }
    if (!PyLong_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be floats or ints, got %.100s", what,
                     Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsDouble(o);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

static inline int plain_ll(PyObject *o, const char *what, long long *out) {
    if (!PyLong_CheckExact(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be ints, got %.100s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = PyLong_AsLongLong(o);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

// pos in list, for exact ints only: PySequence_Contains would run an item's __eq__.
static inline int int_in(PyObject *list, PyObject *pos, const char *what) {
    if (!PyLong_CheckExact(pos)) {
        PyErr_Format(PyExc_TypeError, "%s positions must be ints", what);
        return -1;
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(list); k++) {
        PyObject *item = PyList_GET_ITEM(list, k);
        if (!PyLong_CheckExact(item)) {
            PyErr_Format(PyExc_TypeError, "%s positions must be ints", what);
            return -1;
        }
        int eq = PyObject_RichCompareBool(item, pos, Py_EQ);  // int == int: no Python code
        if (eq != 0) return eq;
    }
    return 0;
}

static inline int check_keys(PyObject *keys) {
    if (!PyList_Check(keys) && !PyTuple_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list or tuple of bytes");
        return -1;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyBytes_CheckExact(items[i])) {
            PyErr_Format(PyExc_TypeError, "keys[%zd] is not bytes", i);
            return -1;
        }
    return 0;
}

// Append positions [start, n) of keys passing a test to list out: under lim, or in set (with
// bits: only those the end prefilter lets through are looked up). (A key stored in set may
// compare by Python code, which could change keys: the key is held, its list read afresh.)
static inline int append_positions(PyObject *out, PyObject *keys, Py_ssize_t start, Py_ssize_t n,
                            const char *lim, Py_ssize_t nlim, PyObject *set,
                            const unsigned char *bits) {
    for (Py_ssize_t i = start; i < n; i++) {
        if (PySequence_Fast_GET_SIZE(keys) != n) {
            PyErr_SetString(PyExc_RuntimeError, "scan: the keys changed during the call");
            return -1;
        }
        PyObject *key = PySequence_Fast_ITEMS(keys)[i];
        int hit;
        if (set != NULL && bits != NULL && !end_maybe(key, bits)) {
            hit = 0;  // not in the end set: no hash, no probe
        } else if (set != NULL) {
            Py_INCREF(key);
            hit = PyDict_Contains(set, key);
            Py_DECREF(key);
            if (hit < 0) return -1;
        } else {
            hit = below(key, lim, nlim);
        }
        if (hit) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (v == NULL || PyList_Append(out, v) < 0) {
                Py_XDECREF(v);
                return -1;
            }
            Py_DECREF(v);
        }
    }
    return 0;
}

static inline int is_int_list(PyObject *o, const char *name) {
    if (!PyList_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list", name);
        return 0;
    }
    return 1;
}

// sum(values[i:end]) or sum(values[i:stop]) + sum(sums[b+1:...]), as _Slots.suffix, in the
// same order of additions. The caller checked the bounds; -1 (an error set) on a non-float.
static inline int add_items(PyObject **it, Py_ssize_t from, Py_ssize_t to, double *acc) {
    for (Py_ssize_t j = from; j < to; j++) {
        if (!PyFloat_CheckExact(it[j])) {
            PyErr_SetString(PyExc_TypeError, "the slots and their sums must hold floats");
            return -1;
        }
        *acc += PyFloat_AS_DOUBLE(it[j]);
    }
    return 0;
}

static inline int suffix(PyObject **values, PyObject **sums, Py_ssize_t i, Py_ssize_t end,
                  double *out) {
    Py_ssize_t b = i >> SHIFT, stop = (b + 1) << SHIFT;
    double a = 0.0, s = 0.0;
    if (end <= stop) {
        if (add_items(values, i, end, &a) < 0) return -1;
        *out = a;
        return 0;
    }
    if (add_items(values, i, stop, &a) < 0
        || add_items(sums, b + 1, ((end - 1) >> SHIFT) + 1, &s) < 0)
        return -1;
    *out = a + s;
    return 0;
}

static inline int slot_lists(PyObject *values, PyObject *sums) {
    if (!PyList_Check(values) || !PyList_Check(sums)) {
        PyErr_SetString(PyExc_TypeError, "values and sums must be lists of floats");
        return -1;
    }
    return 0;
}

// The slot of a tracked page code (slot << 1 | is_end), checked against the slots.
static inline int code_of(PyObject *v, Py_ssize_t nslots, long long *code) {
    long long c;
    if (plain_ll(v, "a page's code", &c) < 0) return -1;
    if ((c >> 1) >= nslots) {
        PyErr_SetString(PyExc_ValueError, "a page's slot is past the slots");
        return -1;
    }
    *code = c;
    return 0;
}

// list[i] = v, the old item an exact float (dropping another object could run its __del__).
static inline int set_float(PyObject *list, Py_ssize_t i, double v) {
    PyObject *old = PyList_GET_ITEM(list, i);
    if (!PyFloat_CheckExact(old)) {
        PyErr_SetString(PyExc_TypeError, "the slots and their sums must hold floats");
        return -1;
    }
    PyObject *f = PyFloat_FromDouble(v);
    if (f == NULL) return -1;
    PyList_SET_ITEM(list, i, f);  // steals f
    Py_DECREF(old);
    return 0;
}

static inline int add_float(PyObject *list, Py_ssize_t i, double delta) {
    PyObject *old = PyList_GET_ITEM(list, i);
    if (!PyFloat_CheckExact(old)) {
        PyErr_SetString(PyExc_TypeError, "the slots and their sums must hold floats");
        return -1;
    }
    PyObject *f = PyFloat_FromDouble(PyFloat_AS_DOUBLE(old) + delta);
    if (f == NULL) return -1;
    PyList_SET_ITEM(list, i, f);
    Py_DECREF(old);
    return 0;
}

static inline Py_ssize_t pos_at(PyObject *list, Py_ssize_t j, Py_ssize_t n) {
    PyObject *pos = PyList_GET_ITEM(list, j);
    if (!PyLong_CheckExact(pos)) {  // (an int subclass's __hash__ / __eq__ would run below)
        PyErr_SetString(PyExc_TypeError, "sampled positions must be ints");
        return -1;
    }
    Py_ssize_t i = PyLong_AsSsize_t(pos);
    if (i < 0 || i >= n) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "a position is out of the keys");
        return -1;
    }
    return i;
}

static inline double item_double(PyObject *list, Py_ssize_t j) {
    double v;
    return plain_double(PyList_GET_ITEM(list, j), "thresholds", &v) < 0 ? -1.0 : v;
}


// The stack's moves (_mrc_touch.c), in _c_mrc's method table.
PyObject *mrc_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *mrc_touch_overlap(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif  // TIERSTORE_MRC_H
