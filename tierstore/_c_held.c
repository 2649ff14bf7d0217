// A match that L1 serves whole, counted in one call (tierstore/held.py's PyHeld is the pure
// path, and its twin: tests/tierstore/test_held.py plays both).
//
// The store's usual match: the index walk ends at the prompt's usable prefix, all in L1, and
// the page after it is a new prompt's tail. Attribution.explain + settle made a list, two
// calls and ~25 lines of Python of it; here the ghost is asked about that page (its `in`), the
// namespace's counters grow in place and the warning window counts the match. When the ghost
// remembers the page, the Python fallback (explain + settle) says how much of the rest it
// remembers, and by which tier.
//   Held(ghost, counts, page, slots, fallback, on_full, window)
//     counts: {namespace: [int] * nslots}; slots: (nslots, l1, cold, partial_page) indices
//     fallback(namespace, n_tokens, keys, path, pages, sources): the general path
//     on_full(): called once `requests` reaches `window`
//   settle(namespace, n_tokens, keys, path, pages, sources) -> (lost, evicted_from)
//   requests, shared (pages of cached KV), window: the window's counts, Python's to read and
//   reset too
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

typedef struct {
    PyObject_HEAD
    PyObject *ghost, *counts, *fallback, *on_full;
    Py_ssize_t page, nslots, l1, cold, partial;
    Py_ssize_t requests, shared, window;
} Held;

static PyObject *s_cold, *s_partial;  // the reasons' names, interned

static int Held_init(Held *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"ghost", "counts", "page", "slots", "fallback", "on_full",
                             "window", NULL};
    PyObject *ghost, *counts, *fallback, *on_full;
    Py_ssize_t page, nslots, l1, cold, partial, window;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!n(nnnn)OOn:Held", kwlist, &ghost,
                                     &PyDict_Type, &counts, &page, &nslots, &l1, &cold,
                                     &partial, &fallback, &on_full, &window))
        return -1;
    if (page < 1 || window < 1) {
        PyErr_Format(PyExc_ValueError, "page and window must be >= 1, got %zd and %zd", page,
                     window);
        return -1;
    }
    if (l1 < 0 || l1 >= nslots || cold < 0 || cold >= nslots || partial < 0
        || partial >= nslots) {
        PyErr_Format(PyExc_ValueError, "slots (%zd, %zd, %zd) out of range [0, %zd)", l1, cold,
                     partial, nslots);
        return -1;
    }
    if (!PyCallable_Check(fallback) || !PyCallable_Check(on_full)) {
        PyErr_SetString(PyExc_TypeError, "fallback and on_full must be callable");
        return -1;
    }
    Py_XSETREF(self->ghost, Py_NewRef(ghost));
    Py_XSETREF(self->counts, Py_NewRef(counts));
    Py_XSETREF(self->fallback, Py_NewRef(fallback));
    Py_XSETREF(self->on_full, Py_NewRef(on_full));
    self->page = page;
    self->nslots = nslots;
    self->l1 = l1;
    self->cold = cold;
    self->partial = partial;
    self->window = window;
    self->requests = self->shared = 0;
    return 0;
}

static int Held_traverse(Held *self, visitproc visit, void *arg) {
    Py_VISIT(self->ghost);
    Py_VISIT(self->counts);
    Py_VISIT(self->fallback);
    Py_VISIT(self->on_full);
    return 0;
}

static int Held_clear(Held *self) {
    Py_CLEAR(self->ghost);
    Py_CLEAR(self->counts);
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->on_full);
    return 0;
}

static void Held_dealloc(Held *self) {
    PyObject_GC_UnTrack(self);
    Held_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

// c[i] += n, for a counter that is an exact int (no Python code runs).
static int add_at(PyObject *c, Py_ssize_t i, Py_ssize_t n) {
    PyObject *had = PyList_GET_ITEM(c, i);
    if (!PyLong_CheckExact(had)) {
        PyErr_Format(PyExc_TypeError, "counter %zd is not an int", i);
        return -1;
    }
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL) return -1;
    PyObject *sum = PyNumber_Add(had, v);
    Py_DECREF(v);
    if (sum == NULL) return -1;
    PyList_SET_ITEM(c, i, sum);
    Py_DECREF(had);
    return 0;
}

// The namespace's counters (a new reference), made on its first match.
static PyObject *counters(Held *self, PyObject *namespace) {
    PyObject *c = PyDict_GetItemWithError(self->counts, namespace);
    if (c != NULL) {
        if (!PyList_CheckExact(c) || PyList_GET_SIZE(c) != self->nslots) {
            PyErr_Format(PyExc_TypeError, "counters must be a list of %zd ints", self->nslots);
            return NULL;
        }
        return Py_NewRef(c);
    }
    if (PyErr_Occurred()) return NULL;
    c = PyList_New(self->nslots);
    if (c == NULL) return NULL;
    for (Py_ssize_t i = 0; i < self->nslots; i++) PyList_SET_ITEM(c, i, PyLong_FromLong(0));
    if (PyDict_SetItem(self->counts, namespace, c) < 0) Py_CLEAR(c);
    return c;
}

static int set_count(PyObject *d, PyObject *name, Py_ssize_t n) {
    PyObject *v = PyLong_FromSsize_t(n);
    if (v == NULL) return -1;
    int rc = PyDict_SetItem(d, name, v);
    Py_DECREF(v);
    return rc;
}

static PyObject *fall_back(Held *self, PyObject *const *args, Py_ssize_t nargs) {
    return PyObject_Vectorcall(self->fallback, args, (size_t)nargs, NULL);
}

static PyObject *Held_settle(Held *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "settle(namespace, n_tokens, keys, path, pages, sources)");
        return NULL;
    }
    if (self->counts == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Held.__init__ was not called");
        return NULL;
    }
    PyObject *namespace = args[0], *keys = args[2];
    Py_ssize_t n_tokens = PyLong_AsSsize_t(args[1]);
    if (n_tokens == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t pages = PyLong_AsSsize_t(args[4]);
    if (pages == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(keys)) return fall_back(self, args, nargs);  // (the store's: a list)
    Py_ssize_t n_full = PyList_GET_SIZE(keys);
    if (pages < 0 || pages > n_full) {
        PyErr_Format(PyExc_ValueError, "pages %zd out of range [0, %zd]", pages, n_full);
        return NULL;
    }
    if (pages < n_full) {  // the page after the prefix: remembered by the ghost?
        PyObject *next = Py_NewRef(PyList_GET_ITEM(keys, pages));
        int remembered = PySequence_Contains(self->ghost, next);
        Py_DECREF(next);
        if (remembered < 0) return NULL;
        if (remembered) return fall_back(self, args, nargs);
    }
    PyObject *c = counters(self, namespace);
    if (c == NULL) return NULL;
    PyObject *lost = NULL, *evicted = NULL, *out = NULL;
    if (add_at(c, self->l1, pages) < 0 || (lost = PyDict_New()) == NULL) goto done;
    if (pages < n_full) {
        Py_ssize_t cold = (n_full - pages) * self->page;
        if (set_count(lost, s_cold, cold) < 0 || add_at(c, self->cold, cold) < 0) goto done;
    }
    Py_ssize_t tail = n_tokens - n_full * self->page;
    if (tail && (set_count(lost, s_partial, tail) < 0 || add_at(c, self->partial, tail) < 0))
        goto done;
    self->shared += pages;
    self->requests += 1;
    if (self->requests >= self->window) {
        PyObject *r = PyObject_CallNoArgs(self->on_full);
        if (r == NULL) goto done;
        Py_DECREF(r);
    }
    if ((evicted = PyDict_New()) == NULL) goto done;
    out = PyTuple_Pack(2, lost, evicted);
done:
    Py_DECREF(c);
    Py_XDECREF(lost);
    Py_XDECREF(evicted);
    return out;
}

static PyMethodDef Held_methods[] = {
    {"settle", (PyCFunction)(void (*)(void))Held_settle, METH_FASTCALL,
     "settle(namespace, n_tokens, keys, path, pages, sources): lost tokens by reason and "
     "evicted ones by tier of a match whose walk L1 holds whole (pages long), counted."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Held_members[] = {
    {"requests", T_PYSSIZET, offsetof(Held, requests), 0, "matches in the window"},
    {"shared", T_PYSSIZET, offsetof(Held, shared), 0, "pages of cached KV in the window"},
    {"window", T_PYSSIZET, offsetof(Held, window), 0, "matches a window holds"},
    {"page", T_PYSSIZET, offsetof(Held, page), READONLY, "tokens per page"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HeldType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierstore._c_held.Held",
    .tp_doc = "Held(ghost, counts, page, slots, fallback, on_full, window): counts a match "
              "that L1 serves whole in one call.",
    .tp_basicsize = sizeof(Held),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Held_init,
    .tp_dealloc = (destructor)Held_dealloc,
    .tp_traverse = (traverseproc)Held_traverse,
    .tp_clear = (inquiry)Held_clear,
    .tp_methods = Held_methods,
    .tp_members = Held_members,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tierstore._c_held",
    "A match that L1 serves whole, counted in one call (tierstore.held).", -1,
    NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__c_held(void) {
    if (PyType_Ready(&HeldType) < 0) return NULL;
    if ((s_cold = PyUnicode_InternFromString("cold")) == NULL
        || (s_partial = PyUnicode_InternFromString("partial_page")) == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Held", (PyObject *)&HeldType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
