/* Fast accepts for the per-chunk metadata rules (torchpulse.checkpoints._rulekernels).
 *
 * A million-chunk checkpoint spends seconds in Python loops that almost always find
 * nothing. Each kernel here answers True only when the Python rule would report
 * nothing; any other answer (False: something to look at; None: a value it does not
 * handle, such as an int past 64 bits) sends the caller to the Python rule, which stays
 * the reference for every finding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { int64_t start, end; } Span;
typedef struct { int64_t group, start, end; } GroupSpan;

static int cmp_span(const void *a, const void *b) {
    const Span *x = a, *y = b;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}
static int cmp_group_span(const void *a, const void *b) {
    const GroupSpan *x = a, *y = b;
    if (x->group != y->group) return x->group < y->group ? -1 : 1;
    if (x->start != y->start) return x->start < y->start ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

/* An int (or bool) within 2**61, so that a sum of two stays exact; else *ok = 0. A subclass of int
 * is declined: its arithmetic, which the Python rule uses, may be its own. */
static int64_t small_int(PyObject *o, int *ok) {
    if (!PyLong_CheckExact(o) && !PyBool_Check(o)) {
        *ok = 0;
        return 0;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || v > ((int64_t)1 << 61) || v < -((int64_t)1 << 61)) {
        *ok = 0;
        return 0;
    }
    return (int64_t)v;
}

/* Do the chunks' extents along `dim` never overlap? (Then no two chunks share an element.) */
static int disjoint_along(PyObject *chunks, Py_ssize_t dim, Span *spans) {
    Py_ssize_t n = PyTuple_GET_SIZE(chunks);
    int ok = 1, sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyTuple_GET_ITEM(chunks, i);
        int64_t o = small_int(PyTuple_GET_ITEM(PyTuple_GET_ITEM(c, 0), dim), &ok);
        int64_t s = small_int(PyTuple_GET_ITEM(PyTuple_GET_ITEM(c, 1), dim), &ok);
        spans[i] = (Span){o, o + s};
        if (i && cmp_span(&spans[i - 1], &spans[i]) > 0) sorted = 0;
    }
    if (!sorted) qsort(spans, (size_t)n, sizeof(Span), cmp_span); /* sharded layouts come in order */
    for (Py_ssize_t i = 0; i + 1 < n; i++)
        if (spans[i].end > spans[i + 1].start) return 0;
    return ok;
}

/* tiling_holds(chunks, size): True when every chunk lies in bounds, their volume equals numel and
 * their extents along some dim never overlap (one-dim sharding: FSDP rows, MoE experts, column
 * shards): then TP-CKPT-010 reports nothing. Grids sharded along two dims answer False. */
static PyObject *tiling_holds(PyObject *self, PyObject *args) {
    PyObject *chunks, *size;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!:tiling_holds", &PyTuple_Type, &chunks, &PyTuple_Type, &size)) return NULL;
    Py_ssize_t ndim = PyTuple_GET_SIZE(size), n = PyTuple_GET_SIZE(chunks);
    if (ndim == 0 || ndim > 64) Py_RETURN_NONE; /* scalars: the Python rule is one comparison */
    int ok = 1;
    int64_t dims[64];
    int64_t numel = 1;
    for (Py_ssize_t d = 0; d < ndim; d++) {
        dims[d] = small_int(PyTuple_GET_ITEM(size, d), &ok);
        if (!ok || dims[d] < 0) Py_RETURN_NONE;
        if (dims[d] && numel > INT64_MAX / dims[d]) Py_RETURN_NONE;
        numel *= dims[d];
    }
    int64_t volume = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *c = PyTuple_GET_ITEM(chunks, i);
        if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 2) Py_RETURN_NONE;
        PyObject *offs = PyTuple_GET_ITEM(c, 0), *sizes = PyTuple_GET_ITEM(c, 1);
        if (!PyTuple_Check(offs) || !PyTuple_Check(sizes)) Py_RETURN_NONE;
        if (PyTuple_GET_SIZE(offs) != ndim || PyTuple_GET_SIZE(sizes) != ndim) Py_RETURN_FALSE; /* out of bounds */
        int64_t prod = 1;
        for (Py_ssize_t d = 0; d < ndim; d++) {
            int64_t o = small_int(PyTuple_GET_ITEM(offs, d), &ok), s = small_int(PyTuple_GET_ITEM(sizes, d), &ok);
            if (!ok) Py_RETURN_NONE;
            if (o < 0 || s < 0 || o + s > dims[d]) Py_RETURN_FALSE;
            if (s && prod > INT64_MAX / s) Py_RETURN_NONE;
            prod *= s;
        }
        volume += prod;
        if (volume > numel) Py_RETURN_FALSE;
    }
    if (volume != numel) Py_RETURN_FALSE;
    Span *spans = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(Span));
    if (!spans) return PyErr_NoMemory();
    /* The longest dim first (the one sharded, most often), then the others. */
    Py_ssize_t longest = 0;
    for (Py_ssize_t d = 1; d < ndim; d++)
        if (dims[d] > dims[longest]) longest = d;
    int disjoint = disjoint_along(chunks, longest, spans);
    for (Py_ssize_t d = 0; d < ndim && !disjoint; d++)
        if (d != longest) disjoint = disjoint_along(chunks, d, spans);
    PyMem_RawFree(spans);
    return PyBool_FromLong(disjoint);
}

/* The (path, offset, length) of a StorageEntry; 0, or -1 for a shape this kernel does not handle. */
static int entry_span(PyObject *entry, PyObject **path, int64_t *offset, int64_t *length) {
    if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) < 5) return -1;
    *path = PyTuple_GET_ITEM(entry, 2);
    if (!PyUnicode_CheckExact(*path)) return -1;
    int ok = 1;
    *offset = small_int(PyTuple_GET_ITEM(entry, 3), &ok);
    *length = small_int(PyTuple_GET_ITEM(entry, 4), &ok);
    return ok ? 0 : -1;
}

/* A small int id per distinct str (dict lookups, skipped while the same object repeats). */
typedef struct { PyObject *ids, *last; int64_t last_id; } Interner;
static int64_t intern_id(Interner *in, PyObject *s) {
    if (s == in->last) return in->last_id;
    PyObject *id = PyDict_GetItemWithError(in->ids, s);
    int64_t v;
    if (id) {
        v = PyLong_AsLongLong(id);
    } else {
        if (PyErr_Occurred()) return -1;
        v = PyDict_GET_SIZE(in->ids);
        id = PyLong_FromLongLong(v);
        if (!id || PyDict_SetItem(in->ids, s, id)) {
            Py_XDECREF(id);
            return -1;
        }
        Py_DECREF(id);
    }
    in->last = s;
    in->last_id = v;
    return v;
}

/* items_disjoint(storage): True when, per file, no two items share a byte (sorted by offset, each
 * item ends before the next begins): then TP-CKPT-007 reports nothing. */
static PyObject *items_disjoint(PyObject *self, PyObject *args) {
    PyObject *storage;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!:items_disjoint", &PyTuple_Type, &storage)) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(storage);
    Interner in = {PyDict_New(), NULL, 0};
    GroupSpan *spans = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(GroupSpan));
    if (!in.ids || !spans) {
        Py_XDECREF(in.ids);
        PyMem_RawFree(spans);
        return PyErr_NoMemory();
    }
    PyObject *verdict = Py_True;
    int sorted = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *path;
        int64_t offset, length;
        if (entry_span(PyTuple_GET_ITEM(storage, i), &path, &offset, &length)) {
            verdict = Py_None;
            break;
        }
        int64_t group = intern_id(&in, path);
        if (group < 0) {
            PyErr_Clear();
            verdict = Py_None;
            break;
        }
        spans[i] = (GroupSpan){group, offset, offset + length};
        if (i && cmp_group_span(&spans[i - 1], &spans[i]) > 0) sorted = 0;
    }
    if (verdict == Py_True) {
        if (!sorted) qsort(spans, (size_t)n, sizeof(GroupSpan), cmp_group_span); /* DCP writes them in order */
        for (Py_ssize_t i = 0; i + 1 < n; i++)
            if (spans[i].group == spans[i + 1].group && spans[i].end > spans[i + 1].start) {
                verdict = Py_False;
                break;
            }
    }
    Py_DECREF(in.ids);
    PyMem_RawFree(spans);
    return Py_NewRef(verdict);
}

/* items_within(storage, sizes): True when every item lies inside its file (files missing from
 * `sizes` are TP-CKPT-005's): then TP-CKPT-006 reports nothing. */
static PyObject *items_within(PyObject *self, PyObject *args) {
    PyObject *storage, *sizes, *last = NULL;
    int64_t limit = 0;
    int bounded = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!:items_within", &PyTuple_Type, &storage, &PyDict_Type, &sizes)) return NULL;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(storage); i++) {
        PyObject *path;
        int64_t offset, length;
        if (entry_span(PyTuple_GET_ITEM(storage, i), &path, &offset, &length)) Py_RETURN_NONE;
        if (path != last) {
            PyObject *size = PyDict_GetItemWithError(sizes, path);
            if (!size && PyErr_Occurred()) return NULL;
            int ok = 1;
            bounded = size != NULL;
            limit = bounded ? small_int(size, &ok) : 0;
            if (!ok) Py_RETURN_NONE;
            last = path;
        }
        if (offset < 0 || length < 0 || (bounded && offset + length > limit)) Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

/* ---- TP-CKPT-009: storage entries against chunks, by value ---- */

/* One (key, offsets) pair; ndim -1 for a bytes item's None. */
typedef struct { int64_t key, ndim, at; uint64_t hash; int matched; } Pair;
typedef struct { Interner keys; int64_t *values; size_t nvalues, cap; } Values;
/* Per key, a table of that key's entries (small: it stays in cache); `stamp` tells this key's slots. */
typedef struct { uint32_t stamp, pair; } Slot;

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9E3779B97F4A7C15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}
/* Read `offsets` (None or a tuple of ints) into *out, its values appended to v->values. -1: decline. */
static int read_offsets(Values *v, PyObject *offsets, Pair *out) {
    out->at = (int64_t)v->nvalues;
    out->ndim = -1;
    out->matched = 0;
    uint64_t h = 0;
    if (offsets != Py_None) {
        if (!PyTuple_Check(offsets)) return -1;
        Py_ssize_t nd = PyTuple_GET_SIZE(offsets);
        if (v->nvalues + (size_t)nd > v->cap) {
            size_t cap = v->cap ? v->cap * 2 : 1024;
            while (cap < v->nvalues + (size_t)nd) cap *= 2;
            int64_t *grown = PyMem_RawRealloc(v->values, cap * sizeof(int64_t));
            if (!grown) return -1;
            v->values = grown;
            v->cap = cap;
        }
        for (Py_ssize_t d = 0; d < nd; d++) {
            int ok = 1;
            int64_t x = small_int(PyTuple_GET_ITEM(offsets, d), &ok);
            if (!ok) return -1;
            v->values[v->nvalues++] = x;
            h = mix(h, (uint64_t)x);
        }
        out->ndim = nd;
    }
    out->hash = mix(h, (uint64_t)out->ndim);
    return 0;
}
static int same(const Values *v, const Pair *a, const Pair *b) {
    return a->hash == b->hash && a->ndim == b->ndim
           && (a->ndim <= 0 || !memcmp(v->values + a->at, v->values + b->at, (size_t)a->ndim * sizeof(int64_t)));
}

typedef struct {
    Values v;
    Pair *pairs;
    Py_ssize_t npairs;
    size_t *order, *group_start; /* entries by key id: order[group_start[k] .. group_start[k + 1]) */
    Py_ssize_t *tensor_of;       /* key id -> index in `tensors`, -1 */
    char *is_bytes;
    Slot *table;
    size_t mask;
} Match;

/* Is every expected (key k, offsets) among k's entries, and is each entry expected? 1 yes, 0 no, -1 decline. */
static int match_key(Match *m, PyObject *tensors, size_t k, uint32_t stamp) {
    size_t from = m->group_start[k], to = m->group_start[k + 1];
    for (size_t i = from; i < to; i++) {
        Pair *e = &m->pairs[m->order[i]];
        size_t slot = e->hash & m->mask;
        for (; m->table[slot].stamp == stamp; slot = (slot + 1) & m->mask)
            if (same(&m->v, &m->pairs[m->table[slot].pair], e)) return 0; /* twice: the rule decides */
        m->table[slot] = (Slot){stamp, (uint32_t)m->order[i]};
    }
    size_t matched = 0, mark = m->v.nvalues;
    PyObject *chunks = m->tensor_of[k] < 0 ? NULL : PyTuple_GET_ITEM(PyList_GET_ITEM(tensors, m->tensor_of[k]), 1);
    Py_ssize_t nchunks = chunks ? PyTuple_GET_SIZE(chunks) : 0;
    for (Py_ssize_t c = 0; c <= nchunks; c++) {
        PyObject *offsets;
        if (c == nchunks) {
            if (!m->is_bytes[k]) break;
            offsets = Py_None;
        } else {
            PyObject *chunk = PyTuple_GET_ITEM(chunks, c);
            if (!PyTuple_Check(chunk) || PyTuple_GET_SIZE(chunk) < 1) return -1;
            offsets = PyTuple_GET_ITEM(chunk, 0);
        }
        Pair q;
        m->v.nvalues = mark; /* the probe's values are scratch */
        if (read_offsets(&m->v, offsets, &q)) return -1;
        size_t slot = q.hash & m->mask;
        Pair *hit = NULL;
        for (; m->table[slot].stamp == stamp; slot = (slot + 1) & m->mask)
            if (same(&m->v, &m->pairs[m->table[slot].pair], &q)) {
                hit = &m->pairs[m->table[slot].pair];
                break;
            }
        if (!hit) return 0; /* a chunk (or bytes item) without an entry */
        if (!hit->matched) {
            hit->matched = 1;
            matched++;
        }
    }
    return matched == to - from ? 1 : 0; /* else an entry matches no chunk */
}

/* storage_matches(storage, tensors, bytes_keys): True when the set of the entries' (key, chunk
 * offsets) equals the set of every chunk's (key, offsets) plus (key, None) per bytes item, with no
 * entry twice: then TP-CKPT-009 reports nothing. `tensors`: a list of (key, chunks). */
static PyObject *storage_matches(PyObject *self, PyObject *args) {
    PyObject *storage, *tensors, *bytes_keys, *verdict = Py_None;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!O!:storage_matches", &PyTuple_Type, &storage, &PyList_Type, &tensors,
                          &PyList_Type, &bytes_keys))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(storage), nt = PyList_GET_SIZE(tensors), nb = PyList_GET_SIZE(bytes_keys);
    size_t nkeys_max = (size_t)(n + nt + nb) + 1;
    Match m = {{{PyDict_New(), NULL, 0}, NULL, 0, 0}, NULL, 0, NULL, NULL, NULL, NULL, NULL, 0};
    m.pairs = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(Pair));
    m.order = PyMem_RawMalloc((size_t)(n ? n : 1) * sizeof(size_t));
    m.group_start = PyMem_RawCalloc(nkeys_max + 1, sizeof(size_t));
    m.tensor_of = PyMem_RawMalloc(nkeys_max * sizeof(Py_ssize_t));
    m.is_bytes = PyMem_RawCalloc(nkeys_max, 1);
    if (!m.v.keys.ids || !m.pairs || !m.order || !m.group_start || !m.tensor_of || !m.is_bytes || n >= UINT32_MAX)
        goto done;
    for (size_t k = 0; k < nkeys_max; k++) m.tensor_of[k] = -1;
    for (Py_ssize_t i = 0; i < n; i++, m.npairs++) {
        PyObject *e = PyTuple_GET_ITEM(storage, i);
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) < 2 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(e, 0))) goto done;
        Pair *p = &m.pairs[i];
        if ((p->key = intern_id(&m.v.keys, PyTuple_GET_ITEM(e, 0))) < 0) goto done;
        if (read_offsets(&m.v, PyTuple_GET_ITEM(e, 1), p)) goto done;
        m.group_start[p->key + 1]++;
    }
    for (Py_ssize_t t = 0; t < nt; t++) {
        PyObject *pair = PyList_GET_ITEM(tensors, t);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyUnicode_CheckExact(PyTuple_GET_ITEM(pair, 0))
            || !PyTuple_Check(PyTuple_GET_ITEM(pair, 1)))
            goto done;
        int64_t k = intern_id(&m.v.keys, PyTuple_GET_ITEM(pair, 0));
        if (k < 0 || m.tensor_of[k] >= 0) goto done; /* a key twice: the rule decides */
        m.tensor_of[k] = t;
    }
    for (Py_ssize_t b = 0; b < nb; b++) {
        PyObject *key = PyList_GET_ITEM(bytes_keys, b);
        int64_t k = PyUnicode_CheckExact(key) ? intern_id(&m.v.keys, key) : -1;
        if (k < 0) goto done;
        m.is_bytes[k] = 1;
    }
    size_t nkeys = (size_t)PyDict_GET_SIZE(m.v.keys.ids), largest = 0;
    for (size_t k = 0; k < nkeys; k++) {
        size_t size = m.group_start[k + 1];
        if (size > largest) largest = size;
        m.group_start[k + 1] += m.group_start[k];
    }
    size_t *fill = PyMem_RawMalloc((nkeys + 1) * sizeof(size_t));
    if (!fill) goto done;
    memcpy(fill, m.group_start, (nkeys + 1) * sizeof(size_t));
    for (Py_ssize_t i = 0; i < n; i++) m.order[fill[m.pairs[i].key]++] = (size_t)i;
    PyMem_RawFree(fill);
    size_t cap = 16;
    while (cap < 2 * largest + 2) cap *= 2;
    m.table = PyMem_RawCalloc(cap, sizeof(Slot));
    m.mask = cap - 1;
    if (!m.table) goto done;
    verdict = Py_True;
    for (size_t k = 0; k < nkeys && verdict == Py_True; k++) {
        int r = match_key(&m, tensors, k, (uint32_t)k + 1);
        verdict = r > 0 ? Py_True : r == 0 ? Py_False : Py_None;
    }
done:
    if (PyErr_Occurred()) PyErr_Clear(); /* a lookup failed: undecided, the rule decides */
    Py_XDECREF(m.v.keys.ids);
    PyMem_RawFree(m.v.values);
    PyMem_RawFree(m.pairs);
    PyMem_RawFree(m.order);
    PyMem_RawFree(m.group_start);
    PyMem_RawFree(m.tensor_of);
    PyMem_RawFree(m.is_bytes);
    PyMem_RawFree(m.table);
    return Py_NewRef(verdict);
}

static PyMethodDef methods[] = {
    {"tiling_holds", tiling_holds, METH_VARARGS,
     "tiling_holds(chunks, size) -> True when TP-CKPT-010 has nothing to report, else False or None"},
    {"items_disjoint", items_disjoint, METH_VARARGS,
     "items_disjoint(storage) -> True when TP-CKPT-007 has nothing to report, else False or None"},
    {"items_within", items_within, METH_VARARGS,
     "items_within(storage, sizes) -> True when TP-CKPT-006 has nothing to report, else False or None"},
    {"storage_matches", storage_matches, METH_VARARGS,
     "storage_matches(storage, tensors, bytes_keys) -> True when TP-CKPT-009 has nothing to report"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rulekernels", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__rulekernels(void) { return PyModule_Create(&module); }
