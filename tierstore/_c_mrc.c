// The miss-ratio shadow's per-event loops, compiled (tierstore/mrc.py keeps the pure-Python
// path, and calls these on the same objects: its lists of slot bytes, its page dict, its
// histograms). Each function does exactly what the Python loop it replaces does, in the same
// order, so the curves are the same to the last bit (tested side by side):
//   scan:      the positions under the page threshold, the checkpoint ends, the sample;
//   reference: a match's distances, histogram bins and the positions to touch;
//   touch, touch_overlap: the stack's moves (tierstore/_mrc_touch.c, built into this module:
//   the line below names it for setup.py; shared helpers in tierstore/_mrc.h).
// sources: _mrc_touch.c
#include "_mrc.h"

static PyObject *scan_with(PyObject *const *args, const unsigned char *bits);

// The end prefilter's bytes held for a call (an export: a bytearray cannot resize under it),
// or view->buf NULL for None. -1 (an error set) when it is neither None nor END_BYTES bytes.
static int end_bits_view(PyObject *o, Py_buffer *view, int writable) {
    view->buf = NULL;
    if (o == Py_None) return 0;
    if (PyObject_GetBuffer(o, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (view->len != END_BYTES) {
        PyBuffer_Release(view);
        view->buf = NULL;
        PyErr_Format(PyExc_ValueError, "end bits must be %d bytes", END_BYTES);
        return -1;
    }
    return 0;
}

// scan(keys, limit, end_set, end_threshold, space, known_n, known_ends, known_low[, end_bits])
// -> (ends, sampled, low), as Shadow._scan. end_set None: no state. known_n < 0: no known.
// end_bits (None: none): the end prefilter of end_set, every key of it marked (mark_end).
static PyObject *scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 8 && nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "scan takes 8 or 9 arguments");
        return NULL;
    }
    Py_buffer view;
    if (end_bits_view(nargs == 9 ? args[8] : Py_None, &view, 0) < 0) return NULL;
    PyObject *result = scan_with(args, view.buf);
    if (view.buf != NULL) PyBuffer_Release(&view);
    return result;
}

static PyObject *scan_with(PyObject *const *args, const unsigned char *bits) {
    PyObject *keys = args[0], *limit = args[1], *end_set = args[2];
    if (check_keys(keys) < 0) return NULL;
    if (!PyBytes_CheckExact(limit)) {
        PyErr_SetString(PyExc_TypeError, "limit must be bytes");
        return NULL;
    }
    if (end_set != Py_None && !PyDict_Check(end_set)) {
        PyErr_SetString(PyExc_TypeError, "end_set must be a dict or None");
        return NULL;
    }
    unsigned long long ethr = PyLong_AsUnsignedLongLong(args[3]);
    unsigned long long space = PyLong_AsUnsignedLongLong(args[4]);
    Py_ssize_t k = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    PyObject **items = PySequence_Fast_ITEMS(keys);
    const char *lim = PyBytes_AS_STRING(limit);
    Py_ssize_t nlim = PyBytes_GET_SIZE(limit);
    PyObject *ends = NULL, *low = NULL, *sampled = NULL, *picked = NULL, *result = NULL;
    if (k >= 0) {
        PyObject *kends = args[6], *klow = args[7];
        if (!is_int_list(klow, "known_low")) return NULL;
        if (kends != Py_None && !is_int_list(kends, "known_ends")) return NULL;
        if (k > n) {
            PyErr_SetString(PyExc_ValueError, "known_n is past the keys");
            return NULL;
        }
        if (n > k) {  // low + tail, ends + tail: new lists, as the Python concatenations
            low = PyList_GetSlice(klow, 0, PyList_GET_SIZE(klow));
            if (low == NULL || append_positions(low, keys, k, n, lim, nlim, NULL, NULL) < 0)
                goto fail;
            if (kends != Py_None) {
                ends = PyList_GetSlice(kends, 0, PyList_GET_SIZE(kends));
                if (ends == NULL || end_set == Py_None
                    || append_positions(ends, keys, k, n, NULL, 0, end_set, bits) < 0) {
                    if (ends != NULL && end_set == Py_None)
                        PyErr_SetString(PyExc_ValueError, "known ends without an end set");
                    goto fail;
                }
            } else {
                ends = Py_NewRef(Py_None);
            }
        } else {  // the known lists themselves
            low = Py_NewRef(klow);
            ends = Py_NewRef(kends);
        }
    } else {
        low = PyList_New(0);
        if (low == NULL || append_positions(low, keys, 0, n, lim, nlim, NULL, NULL) < 0)
            goto fail;
        if (end_set != Py_None) {
            ends = PyList_New(0);
            if (ends == NULL || append_positions(ends, keys, 0, n, NULL, 0, end_set, bits) < 0)
                goto fail;
        } else {
            ends = Py_NewRef(Py_None);
        }
    }
    if (ends == Py_None || PyList_GET_SIZE(ends) == 0) {
        result = PyTuple_Pack(3, ends, low, low);
        goto done;
    }
    if (PySequence_Fast_GET_SIZE(keys) != n) {  // (the end set's lookups may have run Python)
        PyErr_SetString(PyExc_RuntimeError, "scan: the keys changed during the call");
        goto fail;
    }
    items = PySequence_Fast_ITEMS(keys);
    Py_ssize_t ne = PyList_GET_SIZE(ends);
    if (ethr < space) {
        picked = PyList_New(0);
        if (picked == NULL) goto fail;
        for (Py_ssize_t j = 0; j < ne; j++) {
            PyObject *pos = PyList_GET_ITEM(ends, j);
            Py_ssize_t i = PyLong_AsSsize_t(pos);
            if (i < 0 || i >= n) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_IndexError, "an end position is out of the keys");
                goto fail;
            }
            if (!PyBytes_CheckExact(items[i])) {  // (replaced by an end set's lookup)
                PyErr_SetString(PyExc_RuntimeError, "scan: the keys changed during the call");
                goto fail;
            }
            if (end_sampled(items[i], ethr) && PyList_Append(picked, pos) < 0) goto fail;
        }
    } else if (PyList_GET_SIZE(low) == 0) {
        result = PyTuple_Pack(3, ends, ends, low);
        goto done;
    } else {
        picked = Py_NewRef(ends);
    }
    if (PyList_GET_SIZE(low) == 0) {
        sampled = Py_NewRef(picked);
    } else {
        sampled = PyList_New(0);
        if (sampled == NULL) goto fail;
        Py_ssize_t nl = PyList_GET_SIZE(low);
        for (Py_ssize_t j = 0; j < nl; j++) {  // [i for i in low if i not in ends]
            PyObject *pos = PyList_GET_ITEM(low, j);
            int in = int_in(ends, pos, "end");
            if (in < 0) goto fail;
            if (!in && PyList_Append(sampled, pos) < 0) goto fail;
        }
        Py_ssize_t np = PyList_GET_SIZE(picked);
        for (Py_ssize_t j = 0; j < np; j++)
            if (PyList_Append(sampled, PyList_GET_ITEM(picked, j)) < 0) goto fail;
    }
    if (PyList_Sort(sampled) < 0) goto fail;
    result = PyTuple_Pack(3, ends, sampled, low);
done:
fail:
    Py_XDECREF(ends);
    Py_XDECREF(low);
    Py_XDECREF(sampled);
    Py_XDECREF(picked);
    return result;
}

// bisect_left(list, x); an exception set (and the search stopped) on an item not a number.
static Py_ssize_t bisect_left(PyObject *list, double x) {
    Py_ssize_t lo = 0, hi = PyList_GET_SIZE(list);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        double v;
        if (plain_double(PyList_GET_ITEM(list, mid), "histogram edges", &v) < 0) return lo;
        if (v < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static int bump(PyObject *hist, Py_ssize_t b, double v) {
    if (b >= PyList_GET_SIZE(hist) || !PyFloat_CheckExact(PyList_GET_ITEM(hist, b))) {
        PyErr_SetString(PyExc_ValueError, "a histogram is shorter than the edges or not floats");
        return -1;
    }
    return add_float(hist, b, v);
}

// A kind's histogram bin b gets weight (b < 0: none), and its reference count (refs NULL:
// none).
static int count_kind(PyObject *pair, PyObject *refs, Py_ssize_t b, double weight) {
    PyObject *kind = PyTuple_GET_ITEM(pair, 1);
    if (b >= 0 && bump(PyTuple_GET_ITEM(pair, 0), b, weight) < 0) return -1;
    if (refs == NULL) return 0;
    PyObject *r = PyDict_GetItemWithError(refs, kind);
    if (r == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, kind);
        return -1;
    }
    double had;
    if (plain_double(r, "reference counts", &had) < 0) return -1;
    PyObject *nr = PyFloat_FromDouble(had + weight);
    if (nr == NULL) return -1;
    int rc = PyDict_SetItem(refs, kind, nr);
    Py_DECREF(nr);
    return rc;
}

// The kinds a sampled page adds to: a list of (histogram, kind) pairs.
static int count_kinds(PyObject *kinds, PyObject *refs, Py_ssize_t b, double weight) {
    if (!PyList_Check(kinds)) {
        PyErr_SetString(PyExc_TypeError, "kinds must be a list of (histogram, kind)");
        return -1;
    }
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(kinds); j++) {
        PyObject *pair = PyList_GET_ITEM(kinds, j);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2
            || !PyList_Check(PyTuple_GET_ITEM(pair, 0))) {
            PyErr_SetString(PyExc_TypeError, "kinds must be a list of (histogram, kind)");
            return -1;
        }
        // Held over refs' lookups: a key stored there may compare by Python code.
        Py_INCREF(pair);
        int rc = count_kind(pair, refs, b, weight);
        Py_DECREF(pair);
        if (rc < 0) return -1;
    }
    return 0;
}

// L2's hits per multiple (a distance within C1 and thr[j]) and, without an unbounded tier
// below, L1's totals (within l1_thr[j]), as the Python loop adds them.
static int overlap_tallies(PyObject *thr, double top, double c1, PyObject *l2_hit,
                           PyObject *l2_kind, PyObject *l1_thr, PyObject *l1_total,
                           PyObject *kinds, double dist, double hit, double weight) {
    Py_ssize_t m = PyList_GET_SIZE(thr);
    if (c1 < dist && dist <= top) {
        for (Py_ssize_t j = 0; j < m && j < PyList_GET_SIZE(thr); j++) {
            double t = item_double(thr, j);
            if (t == -1.0 && PyErr_Occurred()) return -1;
            if (dist > t) continue;
            if (bump(l2_hit, j, hit) < 0) return -1;
            for (Py_ssize_t k = 0; k < PyList_GET_SIZE(kinds); k++) {
                PyObject *pair = PyList_GET_ITEM(kinds, k);
                if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
                    PyErr_SetString(PyExc_TypeError, "kinds must be a list of (histogram, kind)");
                    return -1;
                }
                // The kind held over the lookup (a key stored in l2_kind may run Python).
                PyObject *kind = Py_NewRef(PyTuple_GET_ITEM(pair, 1));
                PyObject *h = PyDict_GetItemWithError(l2_kind, kind);
                Py_DECREF(kind);
                if (h == NULL || !PyList_Check(h) || PyList_GET_SIZE(h) != m) {
                    if (!PyErr_Occurred())
                        PyErr_SetString(PyExc_ValueError, "l2_kind lacks a kind's tally");
                    return -1;
                }
                if (bump(h, j, weight) < 0) return -1;
            }
        }
    }
    if (l1_thr != Py_None) {
        for (Py_ssize_t j = 0; j < PyList_GET_SIZE(l1_thr); j++) {  // (sizes read afresh)
            double t = item_double(l1_thr, j);
            if (t == -1.0 && PyErr_Occurred()) return -1;
            if (dist <= t && bump(l1_total, j, hit) < 0) return -1;
        }
    }
    return 0;
}

// reference(pages, values, sums, keys, sampled, ends, last, clock, edges, hist, page,
//           w_page, w_end, page_kinds, end_kinds, refs, touched, seen)
// As the loop of Shadow._reference without an L2 overlap: fills touched, seen, the
// histograms and the kinds' reference counts (every sampled position's, tracked or not). A
// distance past the last edge is read as untracked (mrc_stack.trim drops such pages).
static PyObject *reference(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 18 && nargs != 25) {
        PyErr_SetString(PyExc_TypeError, "reference takes 18 arguments (25 with an overlap)");
        return NULL;
    }
    // With an L2 overlap: thr (per multiple), top, c1, l2_hit, l2_kind, l1_thr (or None),
    // l1_total; as the Python loop's two extra tallies.
    PyObject *thr = NULL, *l2_hit = NULL, *l2_kind = NULL, *l1_thr = NULL, *l1_total = NULL;
    double top = 0.0, c1 = 0.0;
    if (nargs == 25) {
        thr = args[18], l2_hit = args[21], l2_kind = args[22], l1_thr = args[23];
        l1_total = args[24];
        top = PyFloat_AsDouble(args[19]);
        c1 = PyFloat_AsDouble(args[20]);
        if (PyErr_Occurred()) return NULL;
        if (!PyList_Check(thr) || !PyList_Check(l2_hit) || !PyDict_Check(l2_kind)
            || (l1_thr != Py_None && !PyList_Check(l1_thr)) || !PyList_Check(l1_total)
            || PyList_GET_SIZE(l2_hit) != PyList_GET_SIZE(thr)
            || (l1_thr != Py_None && PyList_GET_SIZE(l1_total) != PyList_GET_SIZE(l1_thr))) {
            PyErr_SetString(PyExc_TypeError, "bad overlap tallies");
            return NULL;
        }
    }
    PyObject *pages = args[0], *values = args[1], *sums = args[2], *keys = args[3];
    PyObject *sampled = args[4], *ends = args[5], *edges = args[8], *hist = args[9];
    PyObject *page_kinds = args[13], *end_kinds = args[14], *refs = args[15];
    PyObject *touched = args[16], *seen = args[17];
    if (!PyDict_Check(pages) || !PyDict_Check(refs) || !PyDict_Check(seen)) {
        PyErr_SetString(PyExc_TypeError, "pages, refs and seen must be dicts");
        return NULL;
    }
    if (slot_lists(values, sums) < 0 || check_keys(keys) < 0 || !is_int_list(sampled, "sampled")
        || (ends != Py_None && !is_int_list(ends, "ends")) || !is_int_list(edges, "edges")
        || !is_int_list(hist, "hist") || !is_int_list(touched, "touched"))
        return NULL;
    Py_ssize_t last = PyLong_AsSsize_t(args[6]), clock = PyLong_AsSsize_t(args[7]);
    long long page = PyLong_AsLongLong(args[10]);
    double w_page = PyFloat_AsDouble(args[11]), w_end = PyFloat_AsDouble(args[12]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t nslots = PyList_GET_SIZE(values);
    if (PyList_GET_SIZE(sums) != ((nslots + (1 << SHIFT) - 1) >> SHIFT) || clock < 0
        || clock > nslots) {
        PyErr_SetString(PyExc_ValueError, "the slots, their sums and the clock disagree");
        return NULL;
    }
    Py_ssize_t nsums = PyList_GET_SIZE(sums);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys), ns = PyList_GET_SIZE(sampled);
    Py_ssize_t n_page = 0, n_end = 0;  // every sampled reference counts in refs, by class
    for (Py_ssize_t j = 0; j < ns; j++) {
        // A key stored in pages or seen may compare by Python code, which could change the
        // lists: their items are read afresh after each lookup, and their sizes checked.
        if (PySequence_Fast_GET_SIZE(keys) != n || PyList_GET_SIZE(sampled) != ns) goto changed;
        Py_ssize_t i = pos_at(sampled, j, n);
        if (i < 0) return NULL;
        double weight, hit;
        PyObject *kinds;
        int is_end = 0;
        if (ends == Py_None) {
            weight = w_page;
            hit = (double)page * weight;
            kinds = page_kinds;
        } else {
            Py_ssize_t ne = PyList_GET_SIZE(ends), lo = 0, hi = ne;  // bisect_left(ends, i)
            while (lo < hi) {
                Py_ssize_t mid = (lo + hi) / 2;
                Py_ssize_t e = PyLong_AsSsize_t(PyList_GET_ITEM(ends, mid));
                if (e == -1 && PyErr_Occurred()) return NULL;
                if (e < i) lo = mid + 1;
                else hi = mid;
            }
            Py_ssize_t at = lo < ne ? PyLong_AsSsize_t(PyList_GET_ITEM(ends, lo)) : -1;
            if (lo < ne && at == i) {
                Py_ssize_t prev = lo ? PyLong_AsSsize_t(PyList_GET_ITEM(ends, lo - 1)) + 1 : 0;
                if (PyErr_Occurred()) return NULL;
                weight = w_end;
                long long tokens;
                if (__builtin_mul_overflow((long long)(i + 1 - prev), page, &tokens)) {
                    PyErr_SetString(PyExc_ValueError, "reference: page too large");
                    return NULL;
                }
                hit = (double)tokens * weight;
                kinds = end_kinds;
                is_end = 1;
            } else {
                if (PyErr_Occurred()) return NULL;
                weight = w_page;
                hit = 0.0;
                kinds = page_kinds;
            }
        }
        n_end += is_end;
        n_page += !is_end;
        PyObject *key = Py_NewRef(PySequence_Fast_ITEMS(keys)[i]);
        PyObject *cv = PyDict_GetItemWithError(pages, key);
        Py_DECREF(key);
        if (cv == NULL) {
            if (PyErr_Occurred()) return NULL;
            continue;
        }
        if (PyList_GET_SIZE(values) != nslots || PyList_GET_SIZE(sums) != nsums
            || PyList_GET_SIZE(sampled) != ns)
            goto changed;
        PyObject **vals = PySequence_Fast_ITEMS(values), **sm = PySequence_Fast_ITEMS(sums);
        long long code;
        if (code_of(cv, nslots, &code) < 0) return NULL;
        if (code < 0) {
            PyErr_SetString(PyExc_ValueError, "a page off the stack");
            return NULL;
        }
        double dist;
        if (suffix(vals, sm, (Py_ssize_t)(code >> 1), clock, &dist) < 0) return NULL;
        PyObject *pos = Py_NewRef(PyList_GET_ITEM(sampled, j));  // held over seen's lookup
        PyObject *d = PyFloat_FromDouble(dist);
        int rc = d == NULL ? -1 : PyDict_SetItem(seen, pos, d);
        Py_XDECREF(d);
        Py_ssize_t b = rc < 0 ? 0 : bisect_left(edges, dist);
        if (rc < 0 || PyErr_Occurred()) {
            Py_DECREF(pos);
            return NULL;
        }
        if (b >= PyList_GET_SIZE(edges)) {  // past every size a curve reads: as untracked
            Py_DECREF(pos);
            continue;
        }
        if (i <= last) rc = PyList_Append(touched, pos);
        Py_DECREF(pos);
        if (rc < 0) return NULL;
        if (bump(hist, b, hit) < 0 || count_kinds(kinds, NULL, b, weight) < 0) return NULL;
        if (thr != NULL && overlap_tallies(thr, top, c1, l2_hit, l2_kind, l1_thr, l1_total,
                                           kinds, dist, hit, weight) < 0)
            return NULL;
    }
    if ((n_page && count_kinds(page_kinds, refs, -1, (double)n_page * w_page) < 0)
        || (n_end && count_kinds(end_kinds, refs, -1, (double)n_end * w_end) < 0))
        return NULL;
    Py_RETURN_NONE;
changed:
    PyErr_SetString(PyExc_RuntimeError, "reference: the shadow's lists changed during the call");
    return NULL;
}

// suffix_of(values, sums, i, end): _Slots.suffix (for tests and the Python path's reads).
static PyObject *suffix_of(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "suffix_of takes 4 arguments");
        return NULL;
    }
    if (slot_lists(args[0], args[1]) < 0) return NULL;
    Py_ssize_t i = PyLong_AsSsize_t(args[2]), end = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t nslots = PyList_GET_SIZE(args[0]);
    if (PyList_GET_SIZE(args[1]) != ((nslots + (1 << SHIFT) - 1) >> SHIFT) || i < 0
        || end > nslots || i > end) {
        PyErr_SetString(PyExc_ValueError, "need 0 <= i <= end <= slots, and a sum per block");
        return NULL;
    }
    double out;
    if (suffix(PySequence_Fast_ITEMS(args[0]), PySequence_Fast_ITEMS(args[1]), i, end, &out) < 0)
        return NULL;
    return PyFloat_FromDouble(out);
}

// mark_end(bits, key) -> whether the key may already be in the end set: its bit in the end
// prefilter (a bytearray of END_BYTES) was set before, which it is now (or the key is under 11
// bytes: it has none, and scan always looks it up). As mrc_loops.mark_end.
static PyObject *mark_end(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "mark_end takes 2 arguments");
        return NULL;
    }
    if (!PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "the key must be bytes");
        return NULL;
    }
    Py_buffer view;
    if (args[0] == Py_None) {
        PyErr_SetString(PyExc_TypeError, "end bits must be a bytearray");
        return NULL;
    }
    if (end_bits_view(args[0], &view, 1) < 0) return NULL;
    long b = end_bit(args[1]);
    int was = 1;
    if (b >= 0) {
        unsigned char *byte = (unsigned char *)view.buf + (b >> 3);
        was = (*byte >> (b & 7)) & 1;
        *byte |= (unsigned char)(1u << (b & 7));
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(was);
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(keys, limit, end_set, end_threshold, space, known_n, known_ends, known_low"
     "[, end_bits])"},
    {"mark_end", (PyCFunction)(void (*)(void))mark_end, METH_FASTCALL,
     "mark_end(bits, key): set key's bit in the end prefilter; whether it was set"},
    {"touch", (PyCFunction)(void (*)(void))mrc_touch, METH_FASTCALL,
     "touch(pages, values, sums, wb_page, wb_end, keys, sampled, ends, create, clock)"},
    {"reference", (PyCFunction)(void (*)(void))reference, METH_FASTCALL,
     "reference(pages, values, sums, keys, sampled, ends, last, clock, edges, hist, page, "
     "w_page, w_end, page_kinds, end_kinds, refs, touched, seen)"},
    {"touch_overlap", (PyCFunction)(void (*)(void))mrc_touch_overlap, METH_FASTCALL,
     "touch_overlap(pages, values, sums, fl, d, carry, wb_page, wb_end, keys, sampled, ends, "
     "create, clock, lo, win, c1, thr, seen, force)"},
    {"suffix_of", (PyCFunction)(void (*)(void))suffix_of, METH_FASTCALL,
     "suffix_of(values, sums, i, end)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_c_mrc", "The miss-ratio shadow's per-event loops, compiled.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__c_mrc(void) { return PyModule_Create(&module); }
