// The compiled shadow's type (built into tierstore._c_play, see tierstore/_play.h): its making,
// its methods, and its state read back as Python objects (the curves' tallies; the whole state
// for the Shadow to take back, and for the tests to compare with the pure twin's).
#include "_play.h"
#include <structmember.h>

static int core_traverse(Core *c, visitproc visit, void *arg) {
    Py_VISIT(c->on_refuse);  // (a Shadow's method: the Shadow holds the core)
    return 0;
}

static int core_clear(Core *c) {
    Py_CLEAR(c->on_refuse);
    return 0;
}

static void core_dealloc(Core *c) {
    PyObject_GC_UnTrack(c);
    core_clear(c);
    PyMem_Free(c->values);
    PyMem_Free(c->sums);
    PyMem_Free(c->order);
    PyMem_Free(c->bits);
    PyMem_Free(c->edges);
    PyMem_Free(c->hist);
    for (int k = 0; k < P_KINDS; k++) PyMem_Free(c->khist[k]);
    tab_free(&c->pages);
    tab_free(&c->young);
    tab_free(&c->old);
    PyMem_Free(c->events);
    PyMem_Free(c->qkeys);
    Vec *vecs[] = {&c->ends, &c->low, &c->sampled, &c->p.ends, &c->p.low, &c->p.at};
    for (size_t j = 0; j < sizeof vecs / sizeof *vecs; j++) PyMem_Free(vecs[j]->v);
    PyMem_Free(c->p.touched);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static void *zeros(size_t n, size_t size) {
    void *p = PyMem_Calloc(n ? n : 1, size);
    if (p == NULL) PyErr_NoMemory();
    return p;
}

static int read_edges(Core *c, PyObject *edges) {
    if (!PyList_CheckExact(edges) || PyList_GET_SIZE(edges) == 0) {
        PyErr_SetString(PyExc_TypeError, "edges must be a non-empty list of floats");
        return -1;
    }
    c->nedges = PyList_GET_SIZE(edges);
    if ((c->edges = zeros((size_t)c->nedges, sizeof(double))) == NULL) return -1;
    for (Py_ssize_t j = 0; j < c->nedges; j++) {
        PyObject *e = PyList_GET_ITEM(edges, j);
        if (!PyFloat_CheckExact(e) && !PyLong_CheckExact(e)) {
            PyErr_SetString(PyExc_TypeError, "edges must be floats");
            return -1;
        }
        c->edges[j] = PyFloat_AsDouble(e);
        if (c->edges[j] == -1.0 && PyErr_Occurred()) return -1;
        if (j && !(c->edges[j] >= c->edges[j - 1])) {
            PyErr_SetString(PyExc_ValueError, "edges must be sorted");
            return -1;
        }
    }
    return 0;
}

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    int state;
    long long page, page_bytes, end_bytes;
    unsigned long long thr, ethr;
    Py_ssize_t max_tracked, nslots, batch;
    PyObject *edges, *kinds;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Core takes positional arguments only");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "pLLLKKnnOOn:Core", &state, &page, &page_bytes, &end_bytes,
                          &thr, &ethr, &max_tracked, &nslots, &edges, &kinds, &batch))
        return NULL;
    if (thr < 1 || thr > P_SPACE || ethr < 1 || ethr > P_SPACE || max_tracked < 1 || nslots < 1
        || page < 0 || page_bytes < 0 || end_bytes < 0 || batch < 1) {
        PyErr_SetString(PyExc_ValueError, "Core: a threshold, size or count out of range");
        return NULL;
    }
    if (!PyTuple_CheckExact(kinds) || PyTuple_GET_SIZE(kinds) != P_KINDS) {
        PyErr_SetString(PyExc_TypeError, "kinds must be (kv, swa, state) flags");
        return NULL;
    }
    Core *c = (Core *)type->tp_alloc(type, 0);  // (zeroed: every pointer NULL)
    if (c == NULL) return NULL;
    c->state = state;
    c->page = page;
    c->page_bytes = (double)page_bytes;
    c->end_bytes = (double)end_bytes;
    c->threshold = thr;
    c->end_threshold = ethr;
    c->max_tracked = max_tracked;
    c->nslots = nslots;
    c->nblocks = (nslots + (1 << P_SHIFT) - 1) >> P_SHIFT;
    c->trim_at = P_TRIM_MIN;
    c->batch = batch;
    c->end_bits = P_END_BITS;
    if (read_edges(c, edges) < 0) goto fail;
    if ((c->values = zeros((size_t)nslots, sizeof(double))) == NULL
        || (c->sums = zeros((size_t)c->nblocks, sizeof(double))) == NULL
        || (c->order = zeros((size_t)nslots, sizeof(Entry *))) == NULL
        || (c->bits = zeros(P_END_BITS / 8, 1)) == NULL
        || (c->hist = zeros((size_t)c->nedges + 1, sizeof(double))) == NULL)
        goto fail;
    for (int k = 0; k < P_KINDS; k++) {
        int present = PyObject_IsTrue(PyTuple_GET_ITEM(kinds, k));
        if (present < 0) goto fail;
        if (!present) continue;
        if ((c->khist[k] = zeros((size_t)c->nedges + 1, sizeof(double))) == NULL) goto fail;
        c->end_kinds |= 1 << k;
        if (k < 2) c->page_kinds |= 1 << k;  // (kv, swa; a checkpoint adds state)
    }
    if (tab_init(&c->pages, 1024) < 0 || tab_init(&c->young, 64) < 0 || tab_init(&c->old, 64) < 0)
        goto fail;
    set_weights(c);
    return (PyObject *)c;
fail:
    Py_DECREF(c);
    return NULL;
}

static PyObject *doubles(const double *v, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *f = PyFloat_FromDouble(v[j]);
        if (f == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, f);
    }
    return out;
}

static PyObject *positions(const Vec *v) {
    PyObject *out = PyList_New(v->n);
    if (out == NULL) return NULL;
    for (Py_ssize_t j = 0; j < v->n; j++) {
        PyObject *i = PyLong_FromSsize_t(v->v[j]);
        if (i == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, i);
    }
    return out;
}

static PyObject *key_bytes(const uint64_t *w, uint32_t len) {
    return PyBytes_FromStringAndSize((const char *)w, len);
}

static PyObject *key_list(const Table *t) {
    PyObject *out = PyList_New(0);
    for (size_t i = 0; out != NULL && i < t->cap; i++) {
        if (!t->e[i].used) continue;
        PyObject *k = key_bytes(t->e[i].w, t->e[i].len);
        if (k == NULL || PyList_Append(out, k) < 0) Py_CLEAR(out);
        Py_XDECREF(k);
    }
    return out;
}

static PyObject *kind_hists(const Core *c) {
    PyObject *out = PyList_New(P_KINDS);
    for (int k = 0; out != NULL && k < P_KINDS; k++) {
        PyObject *h = c->khist[k] ? doubles(c->khist[k], c->nedges + 1) : Py_NewRef(Py_None);
        if (h == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, k, h);
    }
    return out;
}

// (hist, kind hists (None: absent), refs, tokens, requests, threshold, end threshold,
// tracked pages and ends): what the curves read.
static PyObject *core_tallies(Core *c, PyObject *unused) {
    (void)unused;
    if (enter(c) < 0) return NULL;
    PyObject *out = Py_BuildValue(
        "(NNNLLKKnn)", doubles(c->hist, c->nedges + 1), kind_hists(c), doubles(c->refs, P_KINDS),
        c->tokens, c->requests, c->threshold, c->end_threshold,
        (Py_ssize_t)c->pages.n - c->num_ends, c->num_ends);
    c->busy = 0;
    return out;
}

static PyObject *pending(const Core *c) {
    const Pending *p = &c->p;
    if (!p->on) Py_RETURN_NONE;
    PyObject *touched = PyList_New(p->ntouched);
    for (Py_ssize_t j = 0; touched != NULL && j < p->ntouched; j++) {
        PyObject *k = key_bytes(p->touched[j].w, p->touched[j].len);
        if (k == NULL) Py_CLEAR(touched);
        else PyList_SET_ITEM(touched, j, k);
    }
    if (touched == NULL) return NULL;
    return Py_BuildValue("(nNNNKNN)", p->n, key_bytes(p->last.w, p->last.len),
                         p->has_ends ? positions(&p->ends) : Py_NewRef(Py_None),
                         positions(&p->low), p->threshold, touched, positions(&p->at));
}

// The whole state as Python objects (a dict; see Shadow._take_back).
static PyObject *export(Core *c);

static PyObject *core_export(Core *c, PyObject *unused) {
    (void)unused;
    if (enter(c) < 0) return NULL;
    PyObject *out = export(c);
    c->busy = 0;
    return out;
}

static PyObject *export(Core *c) {
    PyObject *pages = PyDict_New();
    for (size_t i = 0; pages != NULL && i < c->pages.cap; i++) {
        const Entry *e = &c->pages.e[i];
        if (!e->used) continue;
        PyObject *k = key_bytes(e->w, e->len), *v = PyLong_FromLongLong(e->code);
        if (k == NULL || v == NULL || PyDict_SetItem(pages, k, v) < 0) Py_CLEAR(pages);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    if (pages == NULL) return NULL;
    return Py_BuildValue(
        "{sNsNsNsnsnsNsNsnsisKsKsnsNsNsNsLsLsNsnsn}", "pages", pages,
        "values", doubles(c->values, c->nslots), "sums", doubles(c->sums, c->nblocks),
        "clock", c->clock, "num_ends", c->num_ends, "young", key_list(&c->young),
        "old", key_list(&c->old), "young_n", c->young_n, "rotated", c->rotated,
        "threshold", c->threshold, "end_threshold", c->end_threshold, "trim_at", c->trim_at,
        "hist", doubles(c->hist, c->nedges + 1), "kind_hist", kind_hists(c),
        "refs", doubles(c->refs, P_KINDS), "tokens", c->tokens, "requests", c->requests,
        "pending", pending(c), "queued", c->nevents, "end_bits", (Py_ssize_t)c->end_bits);
}

static PyObject *core_drain(Core *c, PyObject *unused) {
    (void)unused;
    if (enter(c) < 0) return NULL;
    int rc = drain(c);
    c->busy = 0;
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *core_trim(Core *c, PyObject *unused) {
    (void)unused;
    if (enter(c) < 0) return NULL;
    int rc = trim(c);
    c->busy = 0;
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

static PyMethodDef core_methods[] = {
    {"match", (PyCFunction)(void (*)(void))core_match, METH_FASTCALL,
     "match(keys, n_tokens): queue a match of n_tokens tokens whose full pages are keys (a list "
     "of bytes of 8 to 32; else on_refuse hears it, or a ValueError); played with the queue"},
    {"insert", (PyCFunction)(void (*)(void))core_insert, METH_FASTCALL,
     "insert(keys, checkpoint): queue an insert of a prompt's full pages, with a checkpoint at "
     "its end (a bool); played with the queue"},
    {"drain", (PyCFunction)core_drain, METH_NOARGS,
     "play the queued events, in order (then drop the pages past the curves' depth once they "
     "doubled)"},
    {"trim", (PyCFunction)core_trim, METH_NOARGS, "drop the pages past the curves' depth"},
    {"tallies", (PyCFunction)core_tallies, METH_NOARGS, "what the curves read"},
    {"export", (PyCFunction)core_export, METH_NOARGS, "the whole state as Python objects"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef core_members[] = {
    {"on_refuse", T_OBJECT, offsetof(Core, on_refuse), 0,
     "called with (is_match, keys, arg) of an event the core does not take; None: refused"},
    {NULL, 0, 0, 0, NULL},
};

PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierstore._c_play.Core",
    .tp_basicsize = sizeof(Core),
    .tp_dealloc = (destructor)core_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_members = core_members,
    .tp_doc = "The miss-ratio shadow's state and event loop in C (tierstore.mrc.Shadow's).",
    .tp_methods = core_methods,
    .tp_new = core_new,
};
