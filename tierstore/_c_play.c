// The miss-ratio shadow played whole in C: tierstore.mrc.Shadow hands its events to a Core (the
// store calls its match and insert directly) when it has no L1/L2 overlap to keep (no L2, or no
// L1 curve), and reads its tallies back for the curves. The state lives in C memory
// (tierstore/_play.h). Events are queued with their keys copied while hot and played `batch`
// at a time as Shadow._reference / Shadow._insert play them, the stack as
// tierstore/_play_stack.c moves it: the same tables and curves to the bit as the pure Shadow
// (tests/tierstore/test_mrc_play.py). Keys must be exact bytes of 8 to 32 bytes (page keys are
// 32 or 16); an event with any other goes to on_refuse, and the Shadow takes the state back
// (export) to play on in Python.
//   Core(state, page, page_bytes, end_bytes, threshold, end_threshold, max_tracked, nslots,
//        edges, kinds, batch)  kinds: (kv, swa, state) present
//   match(keys, n_tokens)  insert(keys, checkpoint)  drain()  trim()  tallies()  export()
//   on_refuse: a callable (is_match, keys, arg), or None
// sources: _play_stack.c _play_type.c
#include "_play.h"

static inline const Key *key_at(const Core *c, Py_ssize_t i) { return &c->cur[i]; }

static int same_key(const Key *a, const Key *b) {
    return a->len == b->len && !memcmp(a->w, b->w, sizeof a->w);
}

// Shadow._scan into c->ends, c->low, c->sampled; known: the same for its first known->n pages.
static int scan(Core *c, Py_ssize_t n, const Pending *known, int *has_ends) {
    Vec *ends = &c->ends, *low = &c->low, *sampled = &c->sampled;
    Py_ssize_t k = 0;
    if (known != NULL) {
        *has_ends = known->has_ends;
        k = known->n;
        if (vec_copy(low, &known->low) < 0) return -1;
        if (*has_ends && vec_copy(ends, &known->ends) < 0) return -1;
    } else {
        *has_ends = c->state;
        low->n = ends->n = 0;
    }
    for (Py_ssize_t i = k; i < n; i++) {
        const Key *key = key_at(c, i);
        if (below(key, c->threshold) && vec_push(low, i) < 0) return -1;
        if (*has_ends && is_end(c, key) && vec_push(ends, i) < 0) return -1;
    }
    sampled->n = 0;
    if (!*has_ends || ends->n == 0) return vec_copy(sampled, low);
    // sorted(low without the ends + the sampled ends): both runs are sorted, merged
    Py_ssize_t a = 0, b = 0;
    while (a < low->n || b < ends->n) {
        if (b < ends->n && (a >= low->n || ends->v[b] <= low->v[a])) {
            Py_ssize_t e = ends->v[b++];
            if (a < low->n && low->v[a] == e) a++;
            if ((c->end_threshold >= P_SPACE || end_sampled(key_at(c, e), c->end_threshold))
                && vec_push(sampled, e) < 0)
                return -1;
        } else if (vec_push(sampled, low->v[a++]) < 0) {
            return -1;
        }
    }
    return 0;
}

static int push_touched(Pending *p, const Key *k, Py_ssize_t i) {
    if (vec_push(&p->at, i) < 0) return -1;
    if (grow((void **)&p->touched, &p->cap_touched, p->ntouched + 1, sizeof(Key)) < 0)
        return -1;
    p->touched[p->ntouched++] = *k;
    return 0;
}

static Py_ssize_t bisect_left(const double *a, Py_ssize_t n, double x) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (a[mid] < x) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

static void count_kinds(Core *c, int mask, Py_ssize_t b, double weight) {
    for (int k = 0; k < P_KINDS; k++)
        if (mask >> k & 1) c->khist[k][b] += weight;
}

// mrc_loops.reference: a match's distances into the histograms, its touch into the pending.
static int reads(Core *c, int has_ends, Py_ssize_t last) {
    const Vec *s = &c->sampled, *ends = &c->ends;
    Py_ssize_t kb = 0, n_page = 0, n_end = 0;
    for (Py_ssize_t j = 0; j < s->n; j++) {
        Py_ssize_t i = s->v[j];
        double weight, hit;
        int mask;
        while (has_ends && kb < ends->n && ends->v[kb] < i) kb++;  // (bisect_left: both sorted)
        if (has_ends && !(kb < ends->n && ends->v[kb] == i)) {
            weight = c->w_page;
            hit = 0.0;
            mask = c->page_kinds;
            n_page++;
        } else if (has_ends) {  // a candidate: the tokens since the one before it
            Py_ssize_t prev = kb ? ends->v[kb - 1] + 1 : 0;
            weight = c->w_end;
            hit = (double)((long long)(i + 1 - prev) * c->page) * weight;
            mask = c->end_kinds;
            n_end++;
        } else {  // every page is a candidate
            weight = c->w_page;
            hit = (double)c->page * weight;
            mask = c->page_kinds;
            n_page++;
        }
        const Entry *e = tab_get(&c->pages, key_at(c, i));
        if (e == NULL) continue;
        double dist = suffix(c, (Py_ssize_t)(e->code >> 1), c->clock);
        Py_ssize_t b = bisect_left(c->edges, c->nedges, dist);
        if (b == c->nedges) continue;
        if (i <= last && push_touched(&c->p, key_at(c, i), i) < 0) return -1;
        c->hist[b] += hit;
        count_kinds(c, mask, b, weight);
    }
    for (int k = 0; k < P_KINDS; k++) {
        if (n_page && c->page_kinds >> k & 1) c->refs[k] += (double)n_page * c->w_page;
        if (n_end && c->end_kinds >> k & 1) c->refs[k] += (double)n_end * c->w_end;
    }
    return 0;
}

static int flush(Core *c) {  // Shadow._flush: the touch a match left
    return c->p.ntouched ? touch(c, c->p.touched, NULL, c->p.ntouched, NULL, 0) : 0;
}

static int reference(Core *c, Py_ssize_t n, long long n_tokens) {  // Shadow._reference
    c->tokens += n_tokens;
    c->requests++;
    if (c->p.on) {
        c->p.on = 0;
        if (flush(c) < 0) return -1;
    }
    if (n == 0) return 0;
    int has_ends;
    if (scan(c, n, NULL, &has_ends) < 0) return -1;
    Pending *p = &c->p;
    p->on = 1;
    p->n = n;
    p->last = *key_at(c, n - 1);
    p->has_ends = has_ends;
    p->threshold = c->threshold;
    p->ntouched = p->at.n = 0;
    if (vec_copy(&p->low, &c->low) < 0 || vec_copy(&p->ends, &c->ends) < 0) return -1;
    if (c->sampled.n == 0 || (has_ends && c->ends.n == 0)) return 0;
    return reads(c, has_ends, has_ends ? c->ends.v[c->ends.n - 1] : n - 1);
}

static void mark_end(Core *c, const Key *k) {
    long b = end_bit(k, c->end_bits);
    c->bits[b >> 3] |= (unsigned char)(1 << (b & 7));
}

static void mark_ends(Core *c, const Table *t) {
    for (size_t i = 0; i < t->cap; i++)
        if (t->e[i].used) mark_end(c, (const Key *)t->e[i].w);
}

// The prefilter grows with the end set, to keep P_BITS_PER_END bits an end (so it passes at
// most ~6% of other keys on to the tables). It starts at 2^18 bits (32 KB, near the CPU for the
// few thousand ends of a young store); fixed there, ~40% of keys went on to the tables once
// the two generations held their 131k ends at the default (2^21 bits now, 256 KB): ~2 us a
// request more after ~80k checkpoints (`bench ops`' loop over 160k requests, qwen3-next).
// It stops at all 24 bits of the key it reads (2 MB).
static int grow_end_bits(Core *c) {
    size_t ends = c->young.n + c->old.n, nbits = c->end_bits;
    while (ends * P_BITS_PER_END > nbits && nbits < P_END_BITS_MAX) nbits *= 2;
    if (nbits == c->end_bits) return 0;
    unsigned char *bits = PyMem_Calloc(nbits / 8, 1);
    if (bits == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    PyMem_Free(c->bits);
    c->bits = bits;
    c->end_bits = nbits;
    mark_ends(c, &c->young);
    mark_ends(c, &c->old);
    return 0;
}

static int add_end(Core *c, const Key *k) {
    if (tab_reserve(&c->young, 1) < 0) return -1;
    tab_put(&c->young, k, 0);
    mark_end(c, k);
    if ((c->young.n + c->old.n) * P_BITS_PER_END > c->end_bits) return grow_end_bits(c);
    return 0;
}

static int rotate(Core *c) {  // the older generation is forgotten
    Table fresh;
    if (tab_init(&fresh, 64) < 0) return -1;
    tab_free(&c->old);
    c->old = c->young;
    c->young = fresh;
    c->young_n = 0;
    c->rotated = 1;
    memset(c->bits, 0, c->end_bits / 8);
    mark_ends(c, &c->old);
    return 0;
}

static int insert(Core *c, Py_ssize_t n, int checkpoint) {  // Shadow._insert
    if (n == 0) return 0;
    Pending *p = &c->p;
    int had = p->on, known = had && n >= p->n && same_key(key_at(c, p->n - 1), &p->last);
    p->on = 0;
    if (had && !known && flush(c) < 0) return -1;
    if (checkpoint && c->state) {
        const Key *last = key_at(c, n - 1);
        if (!is_end(c, last)) {
            if (add_end(c, last) < 0) return -1;
            if (++c->young_n >= 4 * c->max_tracked) {
                if (rotate(c) < 0) return -1;
                if (known) {  // forgotten ends may not be sampled now: as matched
                    if (flush(c) < 0) return -1;
                    known = 0;
                }
            } else if (known && n == p->n && vec_push(&p->ends, n - 1) < 0) {
                return -1;
            }
            if (below(last, c->threshold) || c->rotated) {
                Entry *e = tab_get(&c->pages, last);
                if (e != NULL) {  // a tracked page becomes an end: tracked anew below
                    if (e->code >= 0) {
                        Py_ssize_t slot = (Py_ssize_t)(e->code >> 1);
                        double v = c->wb[e->code & 1];
                        c->values[slot] += -v;
                        c->sums[slot >> P_SHIFT] += -v;
                    }
                    c->num_ends -= e->code & 1;
                    tab_del(&c->pages, e);
                }
            }
        }
    }
    int has_ends;
    if (known && p->threshold == c->threshold) {
        if (!p->has_ends && n == p->n) {  // no state, the match's very pages: its sample
            if (p->low.n == 0) return 0;
            if (vec_copy(&c->sampled, &p->low) < 0) return -1;
            return touch(c, c->cur, c->sampled.v, c->sampled.n, NULL, 1);
        }
        if (scan(c, n, p, &has_ends) < 0) return -1;
    } else if (scan(c, n, NULL, &has_ends) < 0) {
        return -1;
    }
    return touch(c, c->cur, c->sampled.v, c->sampled.n, has_ends ? &c->ends : NULL, 1);
}

// An event's argument the queue takes: the tokens of a match an exact int (in range), a
// checkpoint flag an exact bool or int.
static int arg_ok(PyObject *arg, int match, long long *value) {
    if (match) {
        if (!PyLong_CheckExact(arg)) return 0;
        *value = PyLong_AsLongLong(arg);
        if (*value == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        return 1;
    }
    if (!PyLong_CheckExact(arg) && !PyBool_Check(arg)) return 0;
    *value = PyObject_IsTrue(arg);  // (an exact int or bool: no Python runs)
    return 1;
}

static inline void load_key(Key *k, PyObject *b) {
    const char *p = PyBytes_AS_STRING(b);
    Py_ssize_t len = PyBytes_GET_SIZE(b);
    k->len = (uint32_t)len;
    if (len == P_MAX_KEY) {  // (sha256 keys: one fixed-size copy)
        memcpy(k->w, p, P_MAX_KEY);
        return;
    }
    memset(k->w, 0, sizeof k->w);
    memcpy(k->w, p, (size_t)len);
}

// Copy an event's keys to the end of the queue's (not yet counted in): 1, or 0 for a key that
// is not exact bytes of P_MIN_KEY to P_MAX_KEY. An insert right after its match, with the same
// keys first (the engine's step), shares the match's copies: *at is then where they begin.
static int copy_keys(Core *c, PyObject *keys, int match, Py_ssize_t *at, Py_ssize_t *copied) {
    Py_ssize_t n = PyList_GET_SIZE(keys), from = 0;
    Key *q = &c->qkeys[c->nqkeys];
    *at = c->nqkeys;
    const Event *prev = c->nevents ? &c->events[c->nevents - 1] : NULL;
    int share = !match && prev != NULL && prev->match && prev->at + prev->n == c->nqkeys
        && prev->n <= n;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(keys, i);
        if (!PyBytes_CheckExact(b) || PyBytes_GET_SIZE(b) < P_MIN_KEY
            || PyBytes_GET_SIZE(b) > P_MAX_KEY)
            return 0;
        if (share && i < prev->n) {  // still the match's keys?
            const Key *m = &c->qkeys[prev->at + i];
            if (m->len == (uint32_t)PyBytes_GET_SIZE(b)
                && !memcmp(m->w, PyBytes_AS_STRING(b), m->len))
                continue;
            share = 0;
            for (Py_ssize_t j = 0; j < i; j++) load_key(&q[j], PyList_GET_ITEM(keys, j));
        }
        load_key(&q[share ? i - prev->n : i], b);
    }
    if (share) {
        *at = prev->at;
        from = prev->n;
    }
    *copied = n - from;
    return 1;
}

// Queue an event, its keys copied; play the queue once it holds `batch`. An event the core does
// not take goes to on_refuse (the Shadow takes the state back and plays it in Python); with no
// on_refuse, a ValueError. Either way nothing queued or played changes.
static PyObject *enqueue(Core *c, int match, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, match ? "match(keys, n_tokens)"
                                               : "insert(keys, checkpoint)");
        return NULL;
    }
    PyObject *keys = args[0];
    long long value;
    Py_ssize_t at, copied;
    if (enter(c) < 0) return NULL;  // (checked only: no Python runs until the play, or below)
    c->busy = 0;
    int ok = PyList_CheckExact(keys) && arg_ok(args[1], match, &value);
    if (ok && (grow((void **)&c->qkeys, &c->cap_qkeys, c->nqkeys + PyList_GET_SIZE(keys),
                    sizeof(Key)) < 0
               || grow((void **)&c->events, &c->cap_events, c->nevents + 1, sizeof(Event)) < 0))
        return NULL;
    if (!ok || !copy_keys(c, keys, match, &at, &copied)) {
        if (c->on_refuse == NULL || c->on_refuse == Py_None) {
            PyErr_Format(PyExc_ValueError, "the core takes a list of bytes of %d to %d and %s",
                         P_MIN_KEY, P_MAX_KEY, match ? "an int of tokens" : "a bool");
            return NULL;
        }
        return PyObject_CallFunctionObjArgs(c->on_refuse, match ? Py_True : Py_False, keys,
                                            args[1], NULL);
    }
    c->events[c->nevents++] = (Event){match, PyList_GET_SIZE(keys), at, value};
    c->nqkeys += copied;
    if (c->nevents >= c->batch) {
        c->busy = 1;
        int rc = drain(c);
        c->busy = 0;
        if (rc < 0) return NULL;
    }
    Py_RETURN_NONE;
}

PyObject *core_match(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    return enqueue(c, 1, args, nargs);
}

PyObject *core_insert(Core *c, PyObject *const *args, Py_ssize_t nargs) {
    return enqueue(c, 0, args, nargs);
}

// A finalizer run by the collector while the core builds Python objects (export) could call it
// back: refused while it is busy, so no table it walks changes under it.
int enter(Core *c) {
    if (c->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the shadow core is busy (a re-entrant call)");
        return -1;
    }
    c->busy = 1;
    return 0;
}

// Play the queue, in order, then drop the pages past the curves' depth once they doubled.
// (On an error, only memory running out, the rest of the queue is dropped.)
int drain(Core *c) {
    int rc = 0;
    for (Py_ssize_t j = 0; j < c->nevents && rc == 0; j++) {
        const Event *ev = &c->events[j];
        c->cur = &c->qkeys[ev->at];
        rc = ev->match ? reference(c, ev->n, ev->arg) : insert(c, ev->n, (int)ev->arg);
    }
    c->nevents = c->nqkeys = 0;
    c->cur = NULL;
    if (rc == 0 && (Py_ssize_t)c->pages.n > c->trim_at) rc = trim(c);
    return rc;
}

static PyMethodDef methods[] = {{NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_c_play", "The miss-ratio shadow played whole in C (Core).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__c_play(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
