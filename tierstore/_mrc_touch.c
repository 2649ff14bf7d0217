// The miss-ratio shadow's stack moves, compiled (part of the _c_mrc extension: setup.py
// builds it with tierstore/_c_mrc.c, which names it; helpers in tierstore/_mrc.h):
//   touch:         move (or add) the sampled pages to the top of the stack;
//   touch_overlap: the same with an L2, keeping L1's window and its L2 copy bits.
// Each does exactly what the Python loop it replaces does, in the same order (tested side
// by side with tierstore/mrc_loops.py and mrc_stack.py).
#include "_mrc.h"


// The loops' lists as long as when the call began (after a lookup that may have run Python).
#define SAME_SIZES()                                                                         \
    (PyList_GET_SIZE(values) == nslots && PyList_GET_SIZE(sums) == nsums                     \
     && PyList_GET_SIZE(sampled) == ns && PySequence_Fast_GET_SIZE(keys) == n)

// touch(pages, values, sums, wb_page, wb_end, keys, sampled, ends, create, clock)
// -> (clock, ends added), or None when the slots would run out on the way (the caller's
// Python path compacts then). As Shadow._touch without an L2 overlap.
PyObject *mrc_touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "touch takes 10 arguments");
        return NULL;
    }
    PyObject *pages = args[0], *values = args[1], *sums = args[2], *keys = args[5];
    PyObject *sampled = args[6], *ends = args[7];
    if (!PyDict_Check(pages)) {
        PyErr_SetString(PyExc_TypeError, "pages must be a dict");
        return NULL;
    }
    if (slot_lists(values, sums) < 0 || check_keys(keys) < 0 || !is_int_list(sampled, "sampled")
        || (ends != Py_None && !is_int_list(ends, "ends")))
        return NULL;
    double wb[2] = {PyFloat_AsDouble(args[3]), PyFloat_AsDouble(args[4])};
    int create = PyObject_IsTrue(args[8]);
    Py_ssize_t clock = PyLong_AsSsize_t(args[9]);
    if (PyErr_Occurred() || create < 0) return NULL;
    Py_ssize_t nslots = PyList_GET_SIZE(values), ns = PyList_GET_SIZE(sampled);
    if (PyList_GET_SIZE(sums) != ((nslots + (1 << SHIFT) - 1) >> SHIFT) || clock < 0
        || clock > nslots) {
        PyErr_SetString(PyExc_ValueError, "the slots, their sums and the clock disagree");
        return NULL;
    }
    if (clock + ns > nslots) Py_RETURN_NONE;  // may compact on the way: Python's path
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), nsums = PyList_GET_SIZE(sums);
    Py_ssize_t added = 0;
    PyObject *key = NULL;
    for (Py_ssize_t j = ns - 1; j >= 0; j--) {
        // A key stored in pages may compare by Python code, which could change the lists: the
        // key is held, and the lists' sizes checked after each lookup.
        if (!SAME_SIZES()) goto changed;
        Py_ssize_t i = pos_at(sampled, j, n);
        if (i < 0) return NULL;
        key = Py_NewRef(PySequence_Fast_ITEMS(keys)[i]);
        PyObject *cv = PyDict_GetItemWithError(pages, key);  // borrowed
        int is_end;
        if (!SAME_SIZES()) goto changed;
        if (cv == NULL) {
            if (PyErr_Occurred()) goto fail;
            if (!create) {
                Py_CLEAR(key);
                continue;
            }
            is_end = 0;
            if (ends != Py_None) {
                PyObject *pos = PyList_GET_ITEM(sampled, j);
                is_end = int_in(ends, pos, "end");
                if (is_end < 0) goto fail;
            }
            added += is_end;
        } else {
            long long code;
            if (code_of(cv, nslots, &code) < 0) goto fail;
            is_end = (int)(code & 1);
            Py_ssize_t slot = (Py_ssize_t)(code >> 1);
            if (slot >= 0) {
                if (add_float(values, slot, -wb[is_end]) < 0
                    || add_float(sums, slot >> SHIFT, -wb[is_end]) < 0)
                    goto fail;
            }
        }
        PyObject *nc = PyLong_FromSsize_t(clock << 1 | is_end);
        if (nc == NULL) goto fail;
        int rc = PyDict_SetItem(pages, key, nc);
        Py_DECREF(nc);
        Py_CLEAR(key);
        if (rc < 0) return NULL;
        if (!SAME_SIZES()) goto changed;
        if (set_float(values, clock, wb[is_end]) < 0) return NULL;
        if (add_float(sums, clock >> SHIFT, wb[is_end]) < 0) return NULL;
        clock++;
    }
    return Py_BuildValue("nn", clock, added);
changed:
    PyErr_SetString(PyExc_RuntimeError, "touch: the shadow's lists changed during the call");
fail:
    Py_XDECREF(key);
    return NULL;
}

// d[j] += v for each bit j of f (ascending, as the Python path's bit tuples)
static int add_bits(PyObject *d, long long f, double v) {
    Py_ssize_t m = PyList_GET_SIZE(d);
    if (f < 0) {
        PyErr_SetString(PyExc_ValueError, "copy bits must be >= 0");
        return -1;
    }
    for (Py_ssize_t j = 0; f != 0; j++, f >>= 1) {
        if (!(f & 1)) continue;
        if (j >= m) {
            PyErr_SetString(PyExc_ValueError, "a copy bit past the multiples");
            return -1;
        }
        if (add_float(d, j, v) < 0) return -1;
    }
    return 0;
}

static int set_int(PyObject *list, Py_ssize_t i, long long v) {
    PyObject *old = PyList_GET_ITEM(list, i);
    if (!PyLong_CheckExact(old)) {  // (dropping another object could run its __del__)
        PyErr_SetString(PyExc_TypeError, "the copy bits must be ints");
        return -1;
    }
    PyObject *o = PyLong_FromLongLong(v);
    if (o == NULL) return -1;
    PyList_SET_ITEM(list, i, o);
    Py_DECREF(old);
    return 0;
}

// touch_overlap(pages, values, sums, fl, d, carry, wb_page, wb_end, keys, sampled, ends,
//               create, clock, lo, win, c1, thr, seen, force)
// -> (clock, ends added, lo, win), or None when the slots would run out on the way. As
// Shadow._touch_overlap after its read of the distances (``seen`` holds every tracked
// position outside L1's window).
PyObject *mrc_touch_overlap(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 19) {
        PyErr_SetString(PyExc_TypeError, "touch_overlap takes 19 arguments");
        return NULL;
    }
    PyObject *pages = args[0], *values = args[1], *sums = args[2], *fl = args[3], *d = args[4];
    PyObject *carry = args[5], *keys = args[8], *sampled = args[9], *ends = args[10];
    PyObject *thr = args[16], *seen = args[17];
    if (!PyDict_Check(pages) || !PyDict_Check(carry) || !PyDict_Check(seen)) {
        PyErr_SetString(PyExc_TypeError, "pages, carry and seen must be dicts");
        return NULL;
    }
    if (slot_lists(values, sums) < 0 || check_keys(keys) < 0 || !is_int_list(sampled, "sampled")
        || (ends != Py_None && !is_int_list(ends, "ends")) || !is_int_list(fl, "fl")
        || !is_int_list(d, "d") || !is_int_list(thr, "thr"))
        return NULL;
    double wb[2] = {PyFloat_AsDouble(args[6]), PyFloat_AsDouble(args[7])};
    int create = PyObject_IsTrue(args[11]);
    Py_ssize_t clock = PyLong_AsSsize_t(args[12]), lo = PyLong_AsSsize_t(args[13]);
    double win = PyFloat_AsDouble(args[14]), c1 = PyFloat_AsDouble(args[15]);
    long long force = PyLong_AsLongLong(args[18]);  // bits every placed page gets
    if (PyErr_Occurred() || create < 0) return NULL;
    Py_ssize_t nslots = PyList_GET_SIZE(values), ns = PyList_GET_SIZE(sampled);
    if (PyList_GET_SIZE(sums) != ((nslots + (1 << SHIFT) - 1) >> SHIFT)
        || PyList_GET_SIZE(fl) != nslots || clock < 0 || clock > nslots || lo < 0
        || lo > clock) {
        PyErr_SetString(PyExc_ValueError, "the slots, their sums, bits and clock disagree");
        return NULL;
    }
    if (clock + ns > nslots) Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), nt = PyList_GET_SIZE(thr);
    Py_ssize_t nsums = PyList_GET_SIZE(sums);
    if (nt > 62) {  // (a copy bit per multiple in a long long)
        PyErr_SetString(PyExc_ValueError, "at most 62 multiples");
        return NULL;
    }
    Py_ssize_t added = 0;
    PyObject *key = NULL, *pos = NULL;
    // A key stored in pages, carry or seen may compare by Python code, which could change the
    // lists: the key and position are held, and the lists' sizes checked after each lookup.
#define SAME_ALL() (SAME_SIZES() && PyList_GET_SIZE(fl) == nslots && PyList_GET_SIZE(thr) == nt)
    for (Py_ssize_t j = ns - 1; j >= 0; j--) {
        if (!SAME_ALL()) goto changed;
        Py_ssize_t i = pos_at(sampled, j, n);
        if (i < 0) return NULL;
        key = Py_NewRef(PySequence_Fast_ITEMS(keys)[i]);
        pos = Py_NewRef(PyList_GET_ITEM(sampled, j));
        PyObject *cv = PyDict_GetItemWithError(pages, key);
        int is_end;
        long long f = 0;
        if (!SAME_ALL()) goto changed;
        if (cv == NULL) {
            if (PyErr_Occurred()) goto fail;
            if (!create) {
                Py_CLEAR(key);
                Py_CLEAR(pos);
                continue;
            }
            is_end = 0;
            if (ends != Py_None) {
                is_end = int_in(ends, pos, "end");
                if (is_end < 0) goto fail;
            }
            added += is_end;
            if (PyDict_GET_SIZE(carry)) {
                PyObject *cf = PyDict_GetItemWithError(carry, key);
                if (cf == NULL && PyErr_Occurred()) goto fail;
                if (cf != NULL && plain_ll(cf, "carried copy bits", &f) < 0) goto fail;
                if (!SAME_ALL()) goto changed;
            }
        } else {
            long long code;
            if (code_of(cv, nslots, &code) < 0) goto fail;
            is_end = (int)(code & 1);
            Py_ssize_t slot = (Py_ssize_t)(code >> 1);
            if (slot >= 0) {
                double v = wb[is_end];
                if (slot >= lo) {  // a hit in L1: its copy stays as it was
                    if (plain_ll(PyList_GET_ITEM(fl, slot), "the copy bits", &f) < 0)
                        goto fail;
                    win -= v;
                    if (add_bits(d, f, -v) < 0) goto fail;
                } else {
                    PyObject *dv = PyDict_GetItemWithError(seen, pos);
                    if (dv == NULL) {
                        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, pos);
                        goto fail;
                    }
                    if (!SAME_ALL()) goto changed;
                    double dist;
                    if (plain_double(dv, "distances", &dist) < 0) goto fail;
                    for (Py_ssize_t k = 0; k < nt; k++) {
                        double t = item_double(thr, k);
                        if (t == -1.0 && PyErr_Occurred()) goto fail;
                        if (dist <= t) f |= 1LL << k;
                    }
                }
                if (set_int(fl, slot, 0) < 0 || add_float(values, slot, -v) < 0
                    || add_float(sums, slot >> SHIFT, -v) < 0)
                    goto fail;
            }
        }
        PyObject *nc = PyLong_FromSsize_t(clock << 1 | is_end);
        if (nc == NULL) goto fail;
        int rc = PyDict_SetItem(pages, key, nc);
        Py_DECREF(nc);
        Py_CLEAR(key);
        Py_CLEAR(pos);
        if (rc < 0) return NULL;
        if (!SAME_ALL()) goto changed;
        f |= force;
        double v = wb[is_end];
        if (set_float(values, clock, v) < 0) return NULL;
        if (add_float(sums, clock >> SHIFT, v) < 0 || set_int(fl, clock, f) < 0) return NULL;
        win += v;
        if (add_bits(d, f, v) < 0) return NULL;
        clock++;
    }
    while (win > c1 && lo < clock) {  // the oldest of L1's window leave it
        PyObject *vo = PyList_GET_ITEM(values, lo);
        if (!PyFloat_CheckExact(vo)) {
            PyErr_SetString(PyExc_TypeError, "the slots must hold floats");
            return NULL;
        }
        double v = PyFloat_AS_DOUBLE(vo);
        if (v != 0.0) {
            win -= v;
            long long f;
            if (plain_ll(PyList_GET_ITEM(fl, lo), "the copy bits", &f) < 0
                || add_bits(d, f, -v) < 0)
                return NULL;
        }
        lo++;
    }
    return Py_BuildValue("nnnd", clock, added, lo, win);
changed:
    PyErr_SetString(PyExc_RuntimeError,
                    "touch_overlap: the shadow's lists changed during the call");
fail:
    Py_XDECREF(key);
    Py_XDECREF(pos);
    return NULL;
#undef SAME_ALL
}
