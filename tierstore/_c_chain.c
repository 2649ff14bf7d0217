// Compiled page-key chain for tierstore.hashing (the pure-Python path there gives the same keys).
//
// chain:   h_i = sha256(h_{i-1} || page_i) for a run of pages of packed uint32 LE tokens.
// extend:  a prompt's keys from a remembered one's (shared pages reused, the rest chained).
// pack:    a token array's leading pages as bytes (the memo's key and record).
// narrow_i64 / pack_ints: token ids (int64 buffer, list or tuple of ints) into a uint32 buffer,
//          with the range check in the same pass.
// pack_prompt: a match's token array (int64 or uint32) checked and packed in one call.
//
// OpenSSL's low-level SHA256_* calls (deprecated in 3.0, still built by default): ~140 ns a
// 96-byte page here against ~260 ns through EVP with a prefetched digest and a reused context,
// and ~840 ns through the one-shot SHA256(), which fetches the digest on every call. Where
// OpenSSL is built without the deprecated calls (or CHAIN_EVP is defined) the EVP path is used.
//
// link: crypto

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/evp.h>
#include <openssl/sha.h>

#if defined(OPENSSL_NO_DEPRECATED_3_0) && !defined(CHAIN_EVP)
#define CHAIN_EVP 1
#endif

#define KEY_BYTES 32

#ifdef CHAIN_EVP
static EVP_MD *sha256_md = NULL;
static EVP_MD_CTX *sha256_ctx = NULL;

static int
digest_page(const unsigned char *prev, const unsigned char *page, Py_ssize_t step,
            unsigned char *out)
{
    return EVP_DigestInit_ex2(sha256_ctx, sha256_md, NULL)
        && EVP_DigestUpdate(sha256_ctx, prev, KEY_BYTES)
        && EVP_DigestUpdate(sha256_ctx, page, (size_t)step)
        && EVP_DigestFinal_ex(sha256_ctx, out, NULL);
}

static void
digest_free(void)
{
    EVP_MD_CTX_free(sha256_ctx);
    sha256_ctx = NULL;
    EVP_MD_free(sha256_md);
    sha256_md = NULL;
}

static int
digest_init(void)
{
    if (sha256_md == NULL) sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
    if (sha256_ctx == NULL) sha256_ctx = EVP_MD_CTX_new();
    if (sha256_md == NULL || sha256_ctx == NULL) {
        digest_free();
        return 0;
    }
    return 1;
}
#else
static int
digest_page(const unsigned char *prev, const unsigned char *page, Py_ssize_t step,
            unsigned char *out)
{
    SHA256_CTX ctx;
    return SHA256_Init(&ctx) && SHA256_Update(&ctx, prev, KEY_BYTES)
        && SHA256_Update(&ctx, page, (size_t)step) && SHA256_Final(out, &ctx);
}

static void digest_free(void) {}

static int digest_init(void) { return 1; }
#endif

// An int argument as a Py_ssize_t >= 0: TypeError for a non-int, ValueError when negative or
// too large (an OverflowError is not what a caller checking arguments expects).
static int
get_count(PyObject *obj, const char *fn, const char *name, Py_ssize_t *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s(): %s must be an int, got %s", fn, name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *out = PyLong_AsSsize_t(obj);
    if (*out == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        *out = -1;
    }
    if (*out < 0) {
        PyErr_Format(PyExc_ValueError, "%s(): %s must be in [0, %zd], got %R", fn, name,
                     PY_SSIZE_T_MAX, obj);
        return -1;
    }
    return 0;
}

// Fill keys[at .. at+count-1] (a fresh list's empty slots) with the keys of count pages of step
// bytes from page on, chained from the 32-byte key h (overwritten). -1 with an exception set.
static int
chain_into(PyObject *keys, Py_ssize_t at, unsigned char *h, const unsigned char *page,
           Py_ssize_t step, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++, page += step) {
        PyObject *key = PyBytes_FromStringAndSize(NULL, KEY_BYTES);
        if (key == NULL) return -1;
        unsigned char *out = (unsigned char *)PyBytes_AS_STRING(key);
        if (!digest_page(h, page, step, out)) {
            Py_DECREF(key);
            PyErr_SetString(PyExc_RuntimeError, "OpenSSL SHA-256 failed");
            return -1;
        }
        memcpy(h, out, KEY_BYTES);
        PyList_SET_ITEM(keys, at + i, key);  // steals the reference
    }
    return 0;
}

// A FASTCALL function's argument count: nonzero (TypeError set) when it is not want.
static int
wrong_nargs(Py_ssize_t nargs, Py_ssize_t want, const char *name)
{
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
    return 1;
}

PyDoc_STRVAR(chain_doc,
"chain(prev, packed, step, first, count) -> list[bytes]\n\n"
"The keys of pages first .. first+count-1 of packed (step bytes each), chained from the\n"
"32-byte key prev: h_i = sha256(h_{i-1} || packed[i*step:(i+1)*step]). Changes nothing.");

static PyObject *
chain(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 5, "chain")) return NULL;
    Py_ssize_t step, first, count;
    if (get_count(args[2], "chain", "step", &step) < 0
            || get_count(args[3], "chain", "first", &first) < 0
            || get_count(args[4], "chain", "count", &count) < 0)
        return NULL;
    if (step == 0) {
        PyErr_SetString(PyExc_ValueError, "chain(): step must be > 0");
        return NULL;
    }
    Py_buffer prev, packed;
    if (PyObject_GetBuffer(args[0], &prev, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(args[1], &packed, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&prev);
        return NULL;
    }
    PyObject *keys = NULL;
    unsigned char h[KEY_BYTES];
    Py_ssize_t pages = packed.len / step;
    if (prev.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "chain(): prev must be %d bytes, got %zd", KEY_BYTES,
                     prev.len);
        goto done;
    }
    if (first > pages || count > pages - first) {
        PyErr_Format(PyExc_ValueError,
                     "chain(): %zd pages from page %zd are past the %zd whole pages of %zd "
                     "bytes", count, first, pages, packed.len);
        goto done;
    }
    memcpy(h, prev.buf, KEY_BYTES);
    keys = PyList_New(count);
    if (keys == NULL) goto done;
    if (chain_into(keys, 0, h, (const unsigned char *)packed.buf + first * step, step, count) < 0)
        Py_CLEAR(keys);
done:
    PyBuffer_Release(&packed);
    PyBuffer_Release(&prev);
    return keys;
}

PyDoc_STRVAR(extend_doc,
"extend(root, seen, packed, step) -> (shared, keys)\n\n"
"The keys of the whole pages of packed (step bytes each), from a remembered prompt: seen is\n"
"None (then the chain starts from the 32-byte key root) or a (packed, keys) pair whose keys\n"
"are those of its whole pages. shared counts the leading pages packed has in common with\n"
"seen's (at most either's pages); keys reuses seen's keys for them and chains the rest.\n"
"Changes nothing.");

static PyObject *
extend(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 4, "extend")) return NULL;
    PyObject *root = args[0], *seen = args[1];
    Py_ssize_t step;
    if (get_count(args[3], "extend", "step", &step) < 0) return NULL;
    if (step == 0) {
        PyErr_SetString(PyExc_ValueError, "extend(): step must be > 0");
        return NULL;
    }
    PyObject *seen_keys = NULL;
    if (seen != Py_None) {
        if (!PyTuple_CheckExact(seen) || PyTuple_GET_SIZE(seen) != 2
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(seen, 0))
                || !PyTuple_CheckExact(PyTuple_GET_ITEM(seen, 1))) {
            PyErr_SetString(PyExc_TypeError,
                            "extend(): seen must be None or a (bytes, tuple of keys) pair");
            return NULL;
        }
        seen_keys = PyTuple_GET_ITEM(seen, 1);
    } else if (!PyBytes_CheckExact(root) || PyBytes_GET_SIZE(root) != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "extend(): without seen, root must be %d bytes",
                     KEY_BYTES);
        return NULL;
    }
    Py_buffer packed;
    if (PyObject_GetBuffer(args[2], &packed, PyBUF_SIMPLE) < 0) return NULL;
    PyObject *keys = NULL, *result = NULL;
    Py_ssize_t n = packed.len / step, shared = 0;
    if (packed.len % step) {
        PyErr_Format(PyExc_ValueError, "extend(): %zd bytes are not whole pages of %zd",
                     packed.len, step);
        goto done;
    }
    unsigned char h[KEY_BYTES];
    if (seen_keys != NULL) {
        // (seen is an exact tuple of exact bytes and tuple: nothing below runs Python code)
        PyObject *seen_packed = PyTuple_GET_ITEM(seen, 0);
        Py_ssize_t count = PyTuple_GET_SIZE(seen_keys);
        Py_ssize_t limit = n < count ? n : count;
        if (limit > PyBytes_GET_SIZE(seen_packed) / step) {
            PyErr_SetString(PyExc_ValueError, "extend(): seen has more keys than pages");
            goto done;
        }
        const char *a = packed.buf, *b = PyBytes_AS_STRING(seen_packed);
        while (shared < limit && memcmp(a + shared * step, b + shared * step, (size_t)step) == 0)
            shared++;
        for (Py_ssize_t i = 0; i < shared; i++) {
            PyObject *key = PyTuple_GET_ITEM(seen_keys, i);
            if (!PyBytes_CheckExact(key) || PyBytes_GET_SIZE(key) != KEY_BYTES) {
                PyErr_Format(PyExc_ValueError, "extend(): seen's keys must be %d bytes",
                             KEY_BYTES);
                goto done;
            }
        }
        if (shared == 0 && n > 0) {  // nothing in common: the chain starts from root
            if (!PyBytes_CheckExact(root) || PyBytes_GET_SIZE(root) != KEY_BYTES) {
                PyErr_Format(PyExc_ValueError, "extend(): root must be %d bytes", KEY_BYTES);
                goto done;
            }
        }
    }
    keys = PyList_New(n);
    if (keys == NULL) goto done;
    for (Py_ssize_t i = 0; i < shared; i++)
        PyList_SET_ITEM(keys, i, Py_NewRef(PyTuple_GET_ITEM(seen_keys, i)));
    if (shared < n) {
        memcpy(h, shared ? PyBytes_AS_STRING(PyTuple_GET_ITEM(seen_keys, shared - 1))
                         : PyBytes_AS_STRING(root), KEY_BYTES);
        if (chain_into(keys, shared, h, (const unsigned char *)packed.buf + shared * step, step,
                       n - shared) < 0)
            goto done;
    }
    result = Py_BuildValue("(nO)", shared, keys);
done:
    Py_XDECREF(keys);
    PyBuffer_Release(&packed);
    return result;
}

// The item format of a buffer without its byte-order mark, which must be native or little
// (the module loads only on little-endian hosts).
static const char *
plain_format(const Py_buffer *view)
{
    const char *f = view->format ? view->format : "B";
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
    return f;
}

// A writable C-contiguous uint32 buffer of n items, else an exception.
static int
get_out(PyObject *obj, Py_buffer *out, Py_ssize_t n, const char *fn)
{
    if (PyObject_GetBuffer(obj, out, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    const char *f = plain_format(out);
    if (out->itemsize != 4 || !(strcmp(f, "I") == 0 || (strcmp(f, "L") == 0 && sizeof(long) == 4))
            || out->len != n * 4) {
        PyErr_Format(PyExc_ValueError, "%s(): out must be %zd uint32 items, got %zd bytes of %s",
                     fn, n, out->len, out->format ? out->format : "B");
        PyBuffer_Release(out);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(narrow_i64_doc,
"narrow_i64(src, out) -> bool\n\n"
"Writes the C-contiguous int64 ids of src into the uint32 buffer out (as many items); False\n"
"when an id is outside [0, 2**32) (out then holds a partial copy).");

static PyObject *
narrow_i64(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 2, "narrow_i64")) return NULL;
    Py_buffer src, out;
    if (PyObject_GetBuffer(args[0], &src, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    const char *f = plain_format(&src);
    if (src.itemsize != 8 || !(strcmp(f, "q") == 0 || (strcmp(f, "l") == 0 && sizeof(long) == 8))) {
        PyErr_Format(PyExc_TypeError, "narrow_i64(): src must hold int64 items, got %s",
                     src.format ? src.format : "B");
        PyBuffer_Release(&src);
        return NULL;
    }
    Py_ssize_t n = src.len / 8;
    if (get_out(args[1], &out, n, "narrow_i64") < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    const int64_t *in = src.buf;
    uint32_t *to = out.buf;
    // one branch-free pass: an id is in range iff its upper 32 bits (viewed unsigned) are 0
    uint64_t high = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v = (uint64_t)in[i];
        high |= v >> 32;
        to[i] = (uint32_t)v;
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&src);
    return PyBool_FromLong(high == 0);
}

PyDoc_STRVAR(pack_ints_doc,
"pack_ints(seq, out) -> bool\n\n"
"Writes the ids of a list or tuple of ints into the uint32 buffer out (as many items); False\n"
"when an item is not exactly an int (bool, numpy scalar, ...) or is outside [0, 2**32).");

static PyObject *
pack_ints(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 2, "pack_ints")) return NULL;
    PyObject *seq = args[0];
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) {
        PyErr_Format(PyExc_TypeError, "pack_ints(): seq must be a list or tuple, got %s",
                     Py_TYPE(seq)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer out;
    if (get_out(args[1], &out, n, "pack_ints") < 0) return NULL;
    // read the items only now (taking out's buffer might have run code that changed the list):
    // they are borrowed, and nothing below runs Python code
    if (PySequence_Fast_GET_SIZE(seq) != n) {
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "pack_ints(): seq changed size");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint32_t *to = out.buf;
    int ok = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = items[i];
        if (!PyLong_CheckExact(item)) {
            ok = 0;
            break;
        }
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (v == -1 && PyErr_Occurred()) {
            PyBuffer_Release(&out);
            return NULL;
        }
        if (overflow || v < 0 || v > (long long)UINT32_MAX) {
            ok = 0;
            break;
        }
        to[i] = (uint32_t)v;
    }
    PyBuffer_Release(&out);
    return PyBool_FromLong(ok);
}

PyDoc_STRVAR(pack_doc,
"pack(tokens, count) -> bytes | None\n\n"
"The first count items of a 1-D C-contiguous uint32 buffer (a token array) as bytes; None\n"
"when tokens holds other items, more dimensions or is not contiguous (the caller converts\n"
"it). Changes nothing.");

static PyObject *
pack(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 2, "pack")) return NULL;
    Py_ssize_t count;
    if (get_count(args[1], "pack", "count", &count) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) return NULL;
    PyObject *result = NULL;
    const char *f = plain_format(&view);
    if (view.ndim != 1 || view.itemsize != 4
            || !(strcmp(f, "I") == 0 || (strcmp(f, "L") == 0 && sizeof(long) == 4))
            || !PyBuffer_IsContiguous(&view, 'C')) {
        result = Py_NewRef(Py_None);
    } else if (count > view.len / 4) {
        PyErr_Format(PyExc_ValueError, "pack(): count %zd is past the %zd items", count,
                     view.len / 4);
    } else {
        result = PyBytes_FromStringAndSize(view.buf, count * 4);
    }
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(pack_prompt_doc,
"pack_prompt(tokens, page, limit) -> bytes | None\n\n"
"A prompt's whole pages of page tokens as packed uint32 LE bytes, from a 1-D int64 or uint32\n"
"buffer (any strides) of at most limit ids, every id (the partial page's too) in [0, 2**32);\n"
"None when tokens is anything else (the caller's checked path names what is wrong). Changes\n"
"nothing.");

static PyObject *
pack_prompt(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    if (wrong_nargs(nargs, 3, "pack_prompt")) return NULL;
    Py_ssize_t page, limit;
    if (get_count(args[1], "pack_prompt", "page", &page) < 0
            || get_count(args[2], "pack_prompt", "limit", &limit) < 0)
        return NULL;
    if (page == 0) {
        PyErr_SetString(PyExc_ValueError, "pack_prompt(): page must be > 0");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
        // not a buffer, or one that cannot be exported this way: not this path's input
        if (!PyErr_ExceptionMatches(PyExc_TypeError) && !PyErr_ExceptionMatches(PyExc_ValueError)
                && !PyErr_ExceptionMatches(PyExc_BufferError))
            return NULL;
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    PyObject *result = NULL;
    const char *f = plain_format(&view);
    int wide = view.itemsize == 8 && (strcmp(f, "q") == 0 || (strcmp(f, "l") == 0
                                                              && sizeof(long) == 8));
    int narrow = view.itemsize == 4 && (strcmp(f, "I") == 0 || (strcmp(f, "L") == 0
                                                                && sizeof(long) == 4));
    if (view.ndim != 1 || !(wide || narrow) || view.shape[0] > limit) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    Py_ssize_t n = view.shape[0], stride = view.strides[0];
    const char *in = view.buf;
    if (wide) {  // every id in range: its upper 32 bits (viewed unsigned) are 0
        uint64_t high = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t v;
            memcpy(&v, in + i * stride, 8);
            high |= v >> 32;
        }
        if (high) {
            result = Py_NewRef(Py_None);
            goto done;
        }
    }
    Py_ssize_t count = n / page * page;
    result = PyBytes_FromStringAndSize(NULL, count * 4);
    if (result == NULL) goto done;
    unsigned char *to = (unsigned char *)PyBytes_AS_STRING(result);
    if (!wide && stride == 4) {
        memcpy(to, in, (size_t)count * 4);
    } else {
        for (Py_ssize_t i = 0; i < count; i++) {
            uint32_t v;
            if (wide) {
                uint64_t w;
                memcpy(&w, in + i * stride, 8);
                v = (uint32_t)w;
            } else {
                memcpy(&v, in + i * stride, 4);
            }
            memcpy(to + i * 4, &v, 4);
        }
    }
done:
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"chain", (PyCFunction)(void (*)(void))chain, METH_FASTCALL, chain_doc},
    {"extend", (PyCFunction)(void (*)(void))extend, METH_FASTCALL, extend_doc},
    {"narrow_i64", (PyCFunction)(void (*)(void))narrow_i64, METH_FASTCALL, narrow_i64_doc},
    {"pack_ints", (PyCFunction)(void (*)(void))pack_ints, METH_FASTCALL, pack_ints_doc},
    {"pack", (PyCFunction)(void (*)(void))pack, METH_FASTCALL, pack_doc},
    {"pack_prompt", (PyCFunction)(void (*)(void))pack_prompt, METH_FASTCALL, pack_prompt_doc},
    {NULL, NULL, 0, NULL},
};

static void
module_free(void *Py_UNUSED(module))
{
    digest_free();
}

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_c_chain",
    "Compiled page-key chain and token packing for tierstore.hashing.", -1, methods,
    NULL, NULL, NULL, module_free,
};

PyMODINIT_FUNC
PyInit__c_chain(void)
{
    const uint32_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "_c_chain: needs a little-endian host");
        return NULL;
    }
    if (!digest_init()) {
        PyErr_SetString(PyExc_ImportError, "_c_chain: OpenSSL has no SHA-256");
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) digest_free();
    return module;
}
