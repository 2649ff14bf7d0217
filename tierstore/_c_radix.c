// Compiled index reads for tierstore.rule and tierstore.radix (the pure-Python twins there give
// the same answers; tests compare them).
//
// held:  rule.held_in_l1's scan of a path's L1 columns: whether L1 holds every kv entry (and the
//        swa entries of the last `window` pages), and both id runs packed as native int64.
// walk:  RadixIndex.walk: the longest run of keys present in the tree, as Segments.
//
// The index keeps every page entry an int >= 0 or exactly -1 (ABSENT); anything else in a column
// is refused (TypeError / OverflowError), never read past.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

static PyObject *s_node, *s_pages, *s_dpages, *s_kv, *s_swa, *s_children, *s_keys;

// The first `p` entries of `col` (a list or tuple of ints) appended to out[*at..] as int64.
// Returns 1 when one is ABSENT (-1), 0 when none is, -1 on error.
static int
append_column(PyObject *col, Py_ssize_t p, int64_t *out, Py_ssize_t *at, int stop_absent)
{
    if (!PyList_Check(col) && !PyTuple_Check(col)) {
        PyErr_Format(PyExc_TypeError, "held: a column must be a list or tuple, got %.80s",
                     Py_TYPE(col)->tp_name);
        return -1;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(col);
    if (p > len) p = len;  // (a slice past the end: the whole column)
    PyObject **items = PySequence_Fast_ITEMS(col);
    int absent = 0;
    for (Py_ssize_t j = 0; j < p; j++) {
        PyObject *v = items[j];
        if (!PyLong_Check(v)) {
            PyErr_Format(PyExc_TypeError, "held: an entry must be an int, got %.80s",
                         Py_TYPE(v)->tp_name);
            return -1;
        }
        long long x = PyLong_AsLongLong(v);
        if (x == -1) {
            if (PyErr_Occurred()) return -1;
            absent = 1;
            if (stop_absent) return 1;
        }
        out[(*at)++] = (int64_t)x;
    }
    return absent;
}

// A segment's node and pages (new reference to the node; pages >= 0).
static PyObject *
segment_parts(PyObject *seg, Py_ssize_t *pages)
{
    PyObject *p = PyObject_GetAttr(seg, s_pages);
    if (p == NULL) return NULL;
    *pages = PyLong_AsSsize_t(p);
    Py_DECREF(p);
    if (*pages == -1 && PyErr_Occurred()) return NULL;
    if (*pages < 0) {
        PyErr_SetString(PyExc_ValueError, "held: a segment has negative pages");
        return NULL;
    }
    return PyObject_GetAttr(seg, s_node);
}

// The node's L1 column of `kind` (borrowed from the node's tier dict, which `*cols` holds).
static PyObject *
l1_columns(PyObject *node)
{
    PyObject *tiers = PyObject_GetAttr(node, s_dpages);
    if (tiers == NULL) return NULL;
    if (!PyList_Check(tiers) || PyList_GET_SIZE(tiers) < 1) {
        Py_DECREF(tiers);
        PyErr_SetString(PyExc_TypeError, "held: a node's _pages must be a non-empty list");
        return NULL;
    }
    PyObject *cols = PyList_GET_ITEM(tiers, 0);
    Py_INCREF(cols);
    Py_DECREF(tiers);
    if (!PyDict_Check(cols)) {
        Py_DECREF(cols);
        PyErr_SetString(PyExc_TypeError, "held: a node's L1 columns must be a dict");
        return NULL;
    }
    return cols;
}

PyDoc_STRVAR(held_doc,
"held(path, window) -> (pages, kv, swa) | None\n\n"
"rule.held_in_l1's scan: None when an L1 kv entry of the non-empty `path` is absent (or, with\n"
"window >= 0, an L1 swa entry of its last `window` pages); else the path's length and its L1\n"
"kv and swa entries as native int64 bytearrays. Changes nothing.");

static PyObject *
held(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "held() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *path = args[0];
    if (!PyList_Check(path)) {
        PyErr_SetString(PyExc_TypeError, "held: path must be a list of segments");
        return NULL;
    }
    Py_ssize_t window = PyLong_AsSsize_t(args[1]);
    if (window == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t nseg = PyList_GET_SIZE(path);
    if (nseg == 0) Py_RETURN_NONE;
    // Pass 1: the total pages (bounds the buffers; a column shorter than its segment gives less).
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {
        Py_ssize_t p;
        PyObject *node = segment_parts(PyList_GET_ITEM(path, i), &p);
        if (node == NULL) return NULL;
        Py_DECREF(node);
        if (p > PY_SSIZE_T_MAX / 8 - total) return PyErr_NoMemory();
        total += p;
    }
    PyObject *kv = PyByteArray_FromStringAndSize(NULL, total * 8);
    PyObject *sw = PyByteArray_FromStringAndSize(NULL, total * 8);
    if (kv == NULL || sw == NULL) goto fail;
    int64_t *kvp = (int64_t *)PyByteArray_AS_STRING(kv), *swp = (int64_t *)PyByteArray_AS_STRING(sw);
    Py_ssize_t nk = 0, ns = 0;
    // (the list may have changed in pass 1's attribute reads: read its length each step)
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path) && i < nseg; i++) {
        Py_ssize_t p;
        PyObject *node = segment_parts(PyList_GET_ITEM(path, i), &p);
        if (node == NULL) goto fail;
        PyObject *cols = l1_columns(node);
        Py_DECREF(node);
        if (cols == NULL) goto fail;
        // (a column's items are read with no Python code running: it cannot change meanwhile)
        if (p > total - nk) p = total - nk;
        PyObject *col = PyDict_GetItemWithError(cols, s_kv);
        int r = -1;
        if (col != NULL) {
            Py_INCREF(col);
            r = append_column(col, p, kvp, &nk, 1);
            Py_DECREF(col);
        } else if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_KeyError, "kv");
        }
        if (r == 0) {
            r = -1;
            col = PyDict_GetItemWithError(cols, s_swa);
            if (col != NULL) {
                Py_INCREF(col);
                if (p > total - ns) p = total - ns;
                r = append_column(col, p, swp, &ns, 0) < 0 ? -1 : 0;
                Py_DECREF(col);
            } else if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_KeyError, "swa");
            }
        }
        Py_DECREF(cols);
        if (r < 0) goto fail;
        if (r == 1) {  // an absent kv entry: not held
            Py_DECREF(kv);
            Py_DECREF(sw);
            Py_RETURN_NONE;
        }
    }
    if (window >= 0) {  // outside the window swa entries may be tombstones
        for (Py_ssize_t j = ns > window ? ns - window : 0; j < ns; j++) {
            if (swp[j] == -1) {
                Py_DECREF(kv);
                Py_DECREF(sw);
                Py_RETURN_NONE;
            }
        }
    }
    if (PyByteArray_Resize(kv, nk * 8) < 0 || PyByteArray_Resize(sw, ns * 8) < 0) goto fail;
    PyObject *out = PyTuple_New(3);
    PyObject *n = PyLong_FromSsize_t(nk);
    if (out == NULL || n == NULL) {
        Py_XDECREF(out);
        Py_XDECREF(n);
        goto fail;
    }
    PyTuple_SET_ITEM(out, 0, n);
    PyTuple_SET_ITEM(out, 1, kv);
    PyTuple_SET_ITEM(out, 2, sw);
    return out;
fail:
    Py_XDECREF(kv);
    Py_XDECREF(sw);
    return NULL;
}

PyDoc_STRVAR(walk_doc,
"walk(root, keys, segment) -> list\n\n"
"RadixIndex.walk: from `root`, the longest run of `keys` (a list) present in the tree, as\n"
"`segment` instances (a type with slots node and pages, built without its __init__) along one\n"
"path. Changes nothing.");

// A new `type` instance with node and pages set (no __init__ call: the slots are all it has).
static PyObject *
new_segment(PyTypeObject *type, PyObject *node, Py_ssize_t pages)
{
    PyObject *seg = type->tp_alloc(type, 0);
    if (seg == NULL) return NULL;
    PyObject *n = PyLong_FromSsize_t(pages);
    if (n == NULL || PyObject_SetAttr(seg, s_node, node) < 0
            || PyObject_SetAttr(seg, s_pages, n) < 0) {
        Py_XDECREF(n);
        Py_DECREF(seg);
        return NULL;
    }
    Py_DECREF(n);
    return seg;
}

static PyObject *
walk(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "walk() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *keys = args[1];
    if (!PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "walk: keys must be a list");
        return NULL;
    }
    if (!PyType_Check(args[2]) || ((PyTypeObject *)args[2])->tp_alloc == NULL) {
        PyErr_SetString(PyExc_TypeError, "walk: segment must be a type");
        return NULL;
    }
    PyTypeObject *segment = (PyTypeObject *)args[2];
    PyObject *path = PyList_New(0);
    if (path == NULL) return NULL;
    PyObject *node = Py_NewRef(args[0]);
    Py_ssize_t pos = 0;
    // (comparisons may run Python code: the keys list's length is read at every step)
    while (pos < PyList_GET_SIZE(keys)) {
        PyObject *children = PyObject_GetAttr(node, s_children);
        if (children == NULL) goto fail;
        if (!PyDict_Check(children)) {
            Py_DECREF(children);
            PyErr_SetString(PyExc_TypeError, "walk: a node's children must be a dict");
            goto fail;
        }
        PyObject *key = Py_NewRef(PyList_GET_ITEM(keys, pos));
        PyObject *child = PyDict_GetItemWithError(children, key);
        Py_DECREF(key);
        Py_XINCREF(child);
        Py_DECREF(children);
        if (child == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        PyObject *ck = PyObject_GetAttr(child, s_keys);
        if (ck == NULL || !PyList_Check(ck)) {
            if (ck != NULL) PyErr_SetString(PyExc_TypeError, "walk: a node's keys must be a list");
            Py_XDECREF(ck);
            Py_DECREF(child);
            goto fail;
        }
        // the child's keys matched one by one (its first matched by the dict); stops where the
        // prompt's keys stop or part from them
        Py_ssize_t n = 1;
        int whole = 1;
        for (;; n++) {
            if (n >= PyList_GET_SIZE(ck)) break;
            if (pos + n >= PyList_GET_SIZE(keys)) {
                whole = 0;
                break;
            }
            PyObject *a = Py_NewRef(PyList_GET_ITEM(ck, n));
            PyObject *b = Py_NewRef(PyList_GET_ITEM(keys, pos + n));
            int eq = PyObject_RichCompareBool(a, b, Py_EQ);
            Py_DECREF(a);
            Py_DECREF(b);
            if (eq < 0) {
                Py_DECREF(ck);
                Py_DECREF(child);
                goto fail;
            }
            if (!eq) {
                whole = 0;
                break;
            }
        }
        Py_DECREF(ck);
        PyObject *seg = new_segment(segment, child, n);
        if (seg == NULL || PyList_Append(path, seg) < 0) {
            Py_XDECREF(seg);
            Py_DECREF(child);
            goto fail;
        }
        Py_DECREF(seg);
        pos += n;
        Py_SETREF(node, child);
        if (!whole) break;
    }
    Py_DECREF(node);
    return path;
fail:
    Py_DECREF(node);
    Py_DECREF(path);
    return NULL;
}

static PyMethodDef methods[] = {
    {"held", (PyCFunction)(void (*)(void))held, METH_FASTCALL, held_doc},
    {"walk", (PyCFunction)(void (*)(void))walk, METH_FASTCALL, walk_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_c_radix",
    "Compiled index reads for tierstore.rule and tierstore.radix.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__c_radix(void)
{
    if (!(s_node = PyUnicode_InternFromString("node"))
        || !(s_pages = PyUnicode_InternFromString("pages"))
        || !(s_dpages = PyUnicode_InternFromString("_pages"))
        || !(s_kv = PyUnicode_InternFromString("kv"))
        || !(s_swa = PyUnicode_InternFromString("swa"))
        || !(s_children = PyUnicode_InternFromString("children"))
        || !(s_keys = PyUnicode_InternFromString("keys")))
        return NULL;
    return PyModule_Create(&module_def);
}
