// The ghost index, compiled (tierstore/ghost.py's GhostIndex keeps the pure-Python path), and
// the attribution's per-match tally of its totals (tierstore/attribution.py keeps its loops).
//
// Two generations, as the pure one, but each is an open-addressing table of 64-bit words:
// a page key's 61-bit fingerprint shifted left by 3, or-ed with the tier that dropped it
// (1-4; 0 marks an empty slot). No Python object is kept per remembered page: the dropped
// keys die with their nodes, and a table is one dense array (2^18 slots, 2 MB, per
// generation at the default capacity: 16-32 bytes per remembered page). Both are allocated
// by __init__, so no drop allocates one.
//
// The fingerprint mixes every byte of the key (a multiply-rotate pass over its 8-byte words,
// then murmur3's finalizer), so it is uniform for the store's sha256/xxh3 keys and well spread
// for any other. Two keys with one fingerprint are one entry: a cold page may read as evicted
// (or an evicted page with another's tier) with probability at most n / 2^61 per lookup
// (n <= capacity remembered pages: < 1.2e-13 at 2^18). It moves a page between `cold` and
// `evicted`, never in or out of the prompt's sum.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#define TAG_BITS 3
#define MAX_TIER 4
#define MAX_BITS 61
#define STACK_KEYS 64
#define MAX_CAPACITY ((Py_ssize_t)1 << 40)

typedef struct {
    uint64_t *slots;  // NULL: an empty table of no slots
    size_t mask;      // slots - 1
    int shift;        // 64 - log2(slots): the top bits of a product pick the slot
    Py_ssize_t count; // entries held
} Table;

typedef struct {
    PyObject_HEAD
    Table young, old;
    Py_ssize_t capacity, half, forgotten;
    size_t base_slots;  // slots of a fresh young generation
    int bits;           // fingerprint bits (61; fewer only in tests, to force collisions)
} Ghost;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fmix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static uint64_t mix_bytes(const unsigned char *p, Py_ssize_t n) {
    uint64_t h = 0x9e3779b97f4a7c15ULL ^ (uint64_t)n;
    uint64_t w;
    for (; n >= 8; p += 8, n -= 8) {
        memcpy(&w, p, 8);
        h = rotl64((h ^ w) * 0x9fb21c651e98df25ULL, 29);
    }
    if (n > 0) {
        w = 0;
        memcpy(&w, p, (size_t)n);
        h = rotl64((h ^ w) * 0x9fb21c651e98df25ULL, 29);
    }
    return fmix64(h);
}

// The key's fingerprint, or -1 (TypeError set) when it is not bytes.
static inline int fingerprint(const Ghost *g, PyObject *key, uint64_t *out) {
    if (!PyBytes_Check(key)) {
        PyErr_Format(PyExc_TypeError, "ghost keys must be bytes, got %.100s",
                     Py_TYPE(key)->tp_name);
        return -1;
    }
    *out = mix_bytes((const unsigned char *)PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key))
           >> (64 - g->bits);
    return 0;
}

static inline size_t slot_of(const Table *t, uint64_t fp) {
    return (size_t)((fp * 0x9e3779b97f4a7c15ULL) >> t->shift);
}

// The slot holding `fp`, or the empty slot where it would go (tables are never full).
static inline uint64_t *probe(const Table *t, uint64_t fp) {
    size_t i = slot_of(t, fp);
    for (;;) {
        uint64_t e = t->slots[i];
        if (e == 0 || (e >> TAG_BITS) == fp) return &t->slots[i];
        i = (i + 1) & t->mask;
    }
}

// Fetch the keys' objects (header, hash and the first bytes of the key: one or two lines).
static inline void prefetch_keys(PyObject *const *items, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        __builtin_prefetch(items[i]);
        __builtin_prefetch((const char *)items[i] + 63);
    }
}

static inline void prefetch_slot(const Table *t, uint64_t fp) {
    if (t->count) __builtin_prefetch(&t->slots[slot_of(t, fp)]);
}

static inline int table_tier(const Table *t, uint64_t fp) {
    if (t->count == 0) return 0;
    return (int)(*probe(t, fp) & ((1u << TAG_BITS) - 1));
}

// Zeroed slots, every page of them faulted in now, at allocation (the store's start): left to
// the index's first drops, the page faults of its 2 x 2 MB cost ~1.7 ms spread over the first
// evictions' requests (`bench ops`, qwen3-next at 2k pages). (calloc would map them lazily.)
static uint64_t *slots_alloc(size_t slots) {
    size_t bytes = slots * sizeof(uint64_t);
    uint64_t *s = PyMem_Malloc(bytes);
    if (s != NULL) memset(s, 0, bytes);
    return s;
}

static int table_alloc(Table *t, size_t slots) {
    uint64_t *s = slots_alloc(slots);
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int log2 = 0;
    while (((size_t)1 << log2) < slots) log2++;
    t->slots = s;
    t->mask = slots - 1;
    t->shift = 64 - log2;
    t->count = 0;
    return 0;
}

static void table_free(Table *t) {
    PyMem_Free(t->slots);
    t->slots = NULL;
    t->mask = 0;
    t->shift = 64;
    t->count = 0;
}

static size_t table_size(const Table *t) { return t->slots ? t->mask + 1 : 0; }

// Make room for `more` new entries at a load of at most 3/4 (one add may overrun the half).
static int table_reserve(Table *t, Py_ssize_t more) {
    size_t size = table_size(t);
    size_t need = (size_t)t->count + (size_t)more;
    if (need * 4 <= size * 3) return 0;
    size_t grown = size ? size : 8;
    while (need * 4 > grown * 3) grown <<= 1;
    Table bigger;
    if (table_alloc(&bigger, grown) < 0) return -1;
    for (size_t i = 0; i < size; i++) {
        uint64_t e = t->slots[i];
        if (e) *probe(&bigger, e >> TAG_BITS) = e;
    }
    bigger.count = t->count;
    table_free(t);
    *t = bigger;
    return 0;
}

static int Ghost_init(Ghost *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", "bits", NULL};
    Py_ssize_t capacity = (Py_ssize_t)1 << 18;
    int bits = MAX_BITS;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|ni:GhostIndex", kwlist, &capacity, &bits))
        return -1;
    if (capacity < 2 || capacity > MAX_CAPACITY) {
        PyErr_Format(PyExc_ValueError, "ghost capacity must be >= 2 and <= %zd pages, got %zd",
                     MAX_CAPACITY, capacity);
        return -1;
    }
    if (bits < 1 || bits > MAX_BITS) {
        PyErr_Format(PyExc_ValueError, "fingerprint bits must be in [1, %d], got %d", MAX_BITS,
                     bits);
        return -1;
    }
    Py_ssize_t half = capacity / 2;
    size_t base = 8;
    while (base < 2 * (size_t)half) base <<= 1;  // a full generation at load <= 1/2
    // Both generations now, at their full size: aging reuses the old one's array, so no
    // request allocates or faults a table in (see slots_alloc).
    Table young, old;
    if (table_alloc(&young, base) < 0) return -1;
    if (table_alloc(&old, base) < 0) {
        table_free(&young);
        return -1;
    }
    table_free(&self->young);  // __init__ again starts over
    table_free(&self->old);
    self->young = young;
    self->old = old;
    self->capacity = capacity;
    self->half = half;
    self->forgotten = 0;
    self->base_slots = base;
    self->bits = bits;
    return 0;
}

static PyObject *Ghost_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    Ghost *self = (Ghost *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->young.shift = self->old.shift = 64;
        self->bits = MAX_BITS;
    }
    return (PyObject *)self;
}

static void Ghost_dealloc(Ghost *self) {
    table_free(&self->young);
    table_free(&self->old);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ensure_ready(const Ghost *self) {
    if (self->young.slots == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "GhostIndex.__init__ was not called");
        return -1;
    }
    return 0;
}

// Age when the young generation reached its half: the old one is forgotten whole.
static int age(Ghost *self) {
    Py_ssize_t dropped = self->old.count;
    Table fresh;
    if (table_size(&self->old) == self->base_slots) {  // reuse its array: no allocation
        fresh = self->old;
        memset(fresh.slots, 0, self->base_slots * sizeof(uint64_t));
        fresh.count = 0;
    } else {
        if (table_alloc(&fresh, self->base_slots) < 0) return -1;
        table_free(&self->old);
    }
    self->forgotten += dropped;
    self->old = self->young;
    self->young = fresh;
    return 0;
}

static PyObject *Ghost_add(Ghost *self, PyObject *args) {
    PyObject *keys;
    long tier;
    if (!PyArg_ParseTuple(args, "Ol:add", &keys, &tier)) return NULL;
    if (tier < 1 || tier > MAX_TIER) {
        PyErr_Format(PyExc_ValueError, "tier must be in [1, %d], got %ld", MAX_TIER, tier);
        return NULL;
    }
    if (ensure_ready(self) < 0) return NULL;
    PyObject *seq = PySequence_Fast(keys, "ghost keys must be an iterable of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t stack[STACK_KEYS];
    uint64_t *fps = stack;
    if (n > STACK_KEYS) {
        fps = PyMem_Malloc((size_t)n * sizeof(uint64_t));
        if (fps == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    PyObject *result = NULL;
    // Every key is checked (and fingerprinted) before any is remembered: bad input changes
    // nothing. The dropped keys and their slots are cold: all are fetched at once first, so
    // their misses overlap instead of following one another.
    prefetch_keys(items, n);
    for (Py_ssize_t i = 0; i < n; i++)
        if (fingerprint(self, items[i], &fps[i]) < 0) goto done;
    if (table_reserve(&self->young, n) < 0) goto done;
    uint64_t tag = (uint64_t)tier;
    Table *young = &self->young;
    for (Py_ssize_t i = 0; i < n; i++)
        __builtin_prefetch(&young->slots[slot_of(young, fps[i])], 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t *slot = probe(young, fps[i]);
        young->count += (*slot == 0);
        *slot = (fps[i] << TAG_BITS) | tag;
    }
    if (young->count >= self->half && age(self) < 0) goto done;
    result = Py_NewRef(Py_None);
done:
    if (fps != stack) PyMem_Free(fps);
    Py_DECREF(seq);
    return result;
}

static inline int lookup(const Ghost *self, uint64_t fp) {
    prefetch_slot(&self->old, fp);  // both generations' slots are cold: fetch them together
    int t = table_tier(&self->young, fp);
    return t ? t : table_tier(&self->old, fp);
}

static PyObject *Ghost_tier(Ghost *self, PyObject *key) {
    uint64_t fp;
    if (fingerprint(self, key, &fp) < 0) return NULL;
    return PyLong_FromLong(lookup(self, fp));
}

static int Ghost_contains(Ghost *self, PyObject *key) {
    uint64_t fp;
    if (fingerprint(self, key, &fp) < 0) return -1;
    return lookup(self, fp) != 0;
}

static PyObject *Ghost_counts(Ghost *self, PyObject *args) {
    PyObject *keys;
    Py_ssize_t start = 0;
    if (!PyArg_ParseTuple(args, "O|n:counts", &keys, &start)) return NULL;
    if (start < 0) {
        PyErr_Format(PyExc_ValueError, "start must be >= 0, got %zd", start);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "ghost keys must be a sequence of bytes");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t counts[MAX_TIER + 1] = {0};
    uint64_t fps[STACK_KEYS];
    for (Py_ssize_t first = start; first < n; first += STACK_KEYS) {  // in chunks, prefetched
        Py_ssize_t m = n - first < STACK_KEYS ? n - first : STACK_KEYS;
        prefetch_keys(items + first, m);
        for (Py_ssize_t i = 0; i < m; i++) {
            if (fingerprint(self, items[first + i], &fps[i]) < 0) {
                Py_DECREF(seq);
                return NULL;
            }
            prefetch_slot(&self->young, fps[i]);
            prefetch_slot(&self->old, fps[i]);
        }
        for (Py_ssize_t i = 0; i < m; i++) counts[lookup(self, fps[i])]++;
    }
    Py_DECREF(seq);
    return Py_BuildValue("[nnnnn]", counts[0], counts[1], counts[2], counts[3], counts[4]);
}

static PyObject *Ghost_fingerprint(Ghost *self, PyObject *key) {
    uint64_t fp;
    if (fingerprint(self, key, &fp) < 0) return NULL;
    return PyLong_FromUnsignedLongLong(fp);
}

static Py_ssize_t Ghost_len(Ghost *self) { return self->young.count + self->old.count; }

static PyObject *Ghost_get_nbytes(Ghost *self, void *closure) {
    (void)closure;
    size_t slots = table_size(&self->young) + table_size(&self->old);
    return PyLong_FromSize_t(slots * sizeof(uint64_t) + sizeof(Ghost));
}

static PyMethodDef Ghost_methods[] = {
    {"add", (PyCFunction)Ghost_add, METH_VARARGS,
     "add(keys, tier): remember keys (a dropped node's pages) as dropped last from tier "
     "(1-4); the young generation ages once it holds capacity // 2 entries."},
    {"tier", (PyCFunction)Ghost_tier, METH_O,
     "tier(key): the tier that dropped key last, or 0 if not remembered."},
    {"counts", (PyCFunction)Ghost_counts, METH_VARARGS,
     "counts(keys, start=0): [not remembered, dropped by tier 1, 2, 3, 4] over keys[start:]."},
    {"fingerprint", (PyCFunction)Ghost_fingerprint, METH_O,
     "fingerprint(key): the key's fingerprint (bits wide) as the index stores it."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Ghost_members[] = {
    {"capacity", T_PYSSIZET, offsetof(Ghost, capacity), READONLY, "pages remembered at most"},
    {"forgotten", T_PYSSIZET, offsetof(Ghost, forgotten), READONLY,
     "entries dropped with a generation"},
    {"bits", T_INT, offsetof(Ghost, bits), READONLY, "fingerprint bits"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Ghost_getset[] = {
    {"nbytes", (getter)Ghost_get_nbytes, NULL, "bytes the index holds (tables and header)",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Ghost_as_sequence = {
    .sq_length = (lenfunc)Ghost_len,
    .sq_contains = (objobjproc)Ghost_contains,
};

static PyTypeObject GhostType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "tierstore._c_ghost.GhostIndex",
    .tp_doc = "GhostIndex(capacity=2**18, bits=61): page keys dropped from every tier, each "
              "with the tier that dropped it last, as fingerprints in two generations.",
    .tp_basicsize = sizeof(Ghost),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Ghost_new,
    .tp_init = (initproc)Ghost_init,
    .tp_dealloc = (destructor)Ghost_dealloc,
    .tp_methods = Ghost_methods,
    .tp_members = Ghost_members,
    .tp_getset = Ghost_getset,
    .tp_as_sequence = &Ghost_as_sequence,
};

// c[slot] += n for one (key, n) of `counts` (see add_into).
static int add_one(PyObject *c, PyObject *slots, PyObject *key, PyObject *n) {
    PyObject *slot = key;
    if (slots != Py_None) {
        slot = PyDict_GetItemWithError(slots, key);
        if (slot == NULL) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
    }
    Py_ssize_t i = PyNumber_AsSsize_t(slot, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) return -1;
    if (i < 0 || i >= PyList_GET_SIZE(c)) {
        PyErr_Format(PyExc_IndexError, "slot %zd out of range [0, %zd)", i, PyList_GET_SIZE(c));
        return -1;
    }
    // Held while adding: a non-int's __add__ could change the dict or the list.
    PyObject *had = Py_NewRef(PyList_GET_ITEM(c, i));
    PyObject *sum = PyNumber_Add(had, n);
    Py_DECREF(had);
    if (sum == NULL) return -1;
    if (i >= PyList_GET_SIZE(c)) {
        Py_DECREF(sum);
        PyErr_SetString(PyExc_RuntimeError, "counts list changed size during tally");
        return -1;
    }
    PyObject *old = PyList_GET_ITEM(c, i);
    PyList_SET_ITEM(c, i, sum);
    Py_DECREF(old);
    return 0;
}

// c[slot] += n for each (key, n) of `counts`, the slot being `slots[key]`, or the key itself
// when `slots` is None. Updates in the dict's order and stops at the first bad item, as the
// pure path's loop does.
static int add_into(PyObject *c, PyObject *slots, PyObject *counts) {
    if (!PyDict_Check(counts)) {
        PyErr_Format(PyExc_TypeError, "counts must be a dict, got %.100s",
                     Py_TYPE(counts)->tp_name);
        return -1;
    }
    Py_ssize_t pos = 0, size = PyDict_GET_SIZE(counts);
    PyObject *key, *n;
    while (PyDict_Next(counts, &pos, &key, &n)) {
        // Both held for the step: the slot lookup (a key's __hash__ / __eq__) or a slot's
        // __index__ may change the dict, which would free what it lent.
        Py_INCREF(key);
        Py_INCREF(n);
        int rc = add_one(c, slots, key, n);
        Py_DECREF(n);
        Py_DECREF(key);
        if (rc < 0) return -1;
        if (PyDict_GET_SIZE(counts) != size) {  // as the pure loop's next step would say
            PyErr_SetString(PyExc_RuntimeError, "counts dict changed size during tally");
            return -1;
        }
    }
    return 0;
}

static PyObject *tally(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "tally takes 6 arguments, got %zd", nargs);
        return NULL;
    }
    PyObject *lost_slots = args[0], *evicted_slots = args[1], *c = args[2];
    if (!PyDict_Check(lost_slots) || !PyDict_Check(evicted_slots) || !PyList_Check(c)) {
        PyErr_SetString(PyExc_TypeError, "tally(lost_slots: dict, evicted_slots: dict, "
                                         "counts: list, sources, lost, evicted: dict)");
        return NULL;
    }
    if (add_into(c, Py_None, args[3]) < 0 || add_into(c, lost_slots, args[4]) < 0 ||
        add_into(c, evicted_slots, args[5]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"tally", (PyCFunction)(void (*)(void))tally, METH_FASTCALL,
     "tally(lost_slots, evicted_slots, counts, sources, lost, evicted): add a match's pages "
     "by tier (sources: slot = tier), lost tokens by reason and evicted ones by tier (slot "
     "from the two maps) into the list counts."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tierstore._c_ghost",
    "Miss attribution, compiled: the ghost index as fingerprint tables (tierstore.ghost) and the "
    "per-match tally (tierstore.attribution).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__c_ghost(void) {
    if (PyType_Ready(&GhostType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "GhostIndex", (PyObject *)&GhostType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_BITS", MAX_BITS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
