// The miss-ratio shadow's depth bound, compiled: drop the tracked pages below a slot
// (tierstore/mrc_stack.py, trim's loop; the pure path stays there and gives the same tables,
// tested side by side). In Python the loop cost ~0.7 us a dropped page (a dict comprehension over
// every tracked page, then a delete and two float writes each): at 2k cached pages ~3 us a
// request of bench ops, more than the halvings it saves.
//   drop(pages, values, sums, fl, cut) -> ends dropped
#include "_mrc.h"  // (SHIFT, set_float: the shadow's helpers, static inline)

// The pages to drop (0 <= code < cut << 1), each (code, key) in slot order (the order the block
// sums are lowered in, as the pure loop and tierstore/_play_stack.c do), checked first: keys
// exact bytes (no Python __hash__ / __eq__ runs while deleting), codes exact ints whose slot
// lies in the slots, their slot bytes exact floats, their copy bits exact ints.
static PyObject *doomed(PyObject *pages, Py_ssize_t cut, Py_ssize_t nslots, PyObject *values,
                        PyObject *sums, PyObject *fl) {
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(pages, &pos, &key, &value)) {
        if (!PyBytes_CheckExact(key) || !PyLong_CheckExact(value)) {
            PyErr_SetString(PyExc_TypeError, "pages must map bytes to int codes");
            goto fail;
        }
        long long code = PyLong_AsLongLong(value);
        if (code == -1 && PyErr_Occurred()) goto fail;
        if (code < 0 || (code >> 1) >= cut) continue;  // off the stack, or kept
        Py_ssize_t slot = (Py_ssize_t)(code >> 1);
        if (slot >= nslots || (fl != Py_None && slot >= PyList_GET_SIZE(fl))) {
            PyErr_SetString(PyExc_ValueError, "a page's slot is past the slots");
            goto fail;
        }
        if (!PyFloat_CheckExact(PyList_GET_ITEM(values, slot))
            || !PyFloat_CheckExact(PyList_GET_ITEM(sums, slot >> SHIFT))
            || (fl != Py_None && !PyLong_CheckExact(PyList_GET_ITEM(fl, slot)))) {
            PyErr_SetString(PyExc_TypeError, "slot bytes must be floats, copy bits ints");
            goto fail;
        }
        PyObject *pair = PyTuple_Pack(2, value, key);
        if (pair == NULL) goto fail;
        int rc = PyList_Append(out, pair);
        Py_DECREF(pair);
        if (rc < 0) goto fail;
    }
    if (PyList_Sort(out) < 0) goto fail;  // (exact ints first, all different: no Python runs)
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *drop(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "drop takes 5 arguments");
        return NULL;
    }
    PyObject *pages = args[0], *values = args[1], *sums = args[2], *fl = args[3];
    if (!PyDict_CheckExact(pages) || !PyList_CheckExact(values) || !PyList_CheckExact(sums)
        || (fl != Py_None && !PyList_CheckExact(fl))) {
        PyErr_SetString(PyExc_TypeError, "drop(pages: dict, values: list, sums: list, "
                                         "fl: list | None, cut: int)");
        return NULL;
    }
    if (!PyLong_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "cut must be an int");
        return NULL;
    }
    Py_ssize_t cut = PyLong_AsSsize_t(args[4]);
    if (cut == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t nslots = PyList_GET_SIZE(values);
    if (PyList_GET_SIZE(sums) != ((nslots + (1 << SHIFT) - 1) >> SHIFT)) {
        PyErr_SetString(PyExc_ValueError, "the slots and their sums disagree");
        return NULL;
    }
    PyObject *gone = doomed(pages, cut, nslots, values, sums, fl);
    if (gone == NULL) return NULL;
    // Only exact bytes, ints and floats from here on: no Python code runs, nothing else
    // changes the dict or the lists, and the checks above still hold.
    long long ends = 0;
    PyObject *zero = NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(gone); j++) {
        PyObject *pair = PyList_GET_ITEM(gone, j);
        long long code = PyLong_AsLongLong(PyTuple_GET_ITEM(pair, 0));
        Py_ssize_t slot = (Py_ssize_t)(code >> 1);
        double v = PyFloat_AS_DOUBLE(PyList_GET_ITEM(values, slot));
        double s = PyFloat_AS_DOUBLE(PyList_GET_ITEM(sums, slot >> SHIFT));
        if (PyDict_DelItem(pages, PyTuple_GET_ITEM(pair, 1)) < 0
            || set_float(values, slot, 0.0) < 0 || set_float(sums, slot >> SHIFT, s - v) < 0)
            goto fail;
        if (fl != Py_None) {
            if (zero == NULL && (zero = PyLong_FromLong(0)) == NULL) goto fail;
            PyObject *old = PyList_GET_ITEM(fl, slot);
            PyList_SET_ITEM(fl, slot, Py_NewRef(zero));
            Py_DECREF(old);  // (an exact int, checked)
        }
        ends += code & 1;
    }
    Py_XDECREF(zero);
    Py_DECREF(gone);
    return PyLong_FromLongLong(ends);
fail:
    Py_XDECREF(zero);
    Py_DECREF(gone);
    return NULL;
}

static PyMethodDef methods[] = {
    {"drop", (PyCFunction)(void (*)(void))drop, METH_FASTCALL,
     "drop(pages, values, sums, fl, cut): drop the tracked pages whose slot lies below cut "
     "(their slot bytes zeroed, their block sums lowered, their L2 copy bits cleared); the "
     "checkpoint ends among them"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_c_shadow", "The miss-ratio shadow's depth bound, compiled.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__c_shadow(void) { return PyModule_Create(&module); }
