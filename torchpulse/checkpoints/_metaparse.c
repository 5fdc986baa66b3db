/* A bounded, non-executing reader of DCP `.metadata` pickles (torchpulse.checkpoints._metaparse).
 *
 * The Python allow-list unpickler (unpickler.py) builds ~12 million stand-in objects for a
 * million-chunk `.metadata` and the reader then copies them into its model: seconds. This
 * module runs the pickle opcodes over compact handles instead (no Python object per pickled
 * value, nothing called, every read bounds-checked) and builds only the reader's model:
 * `Chunk` and `StorageEntry` tuples, the tensors' keys, dtypes and sizes.
 *
 * It answers exactly what the Python path would answer, or declines (returns None): any
 * opcode, global, shape or value outside the subset that DCP writes, and anything the
 * Python path would refuse or fail on, is a decline, and the caller then runs the Python
 * path, which stays the reference for every decision and every error message.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A handle is one pickled value: a tagged 64-bit word. */
typedef uint64_t H;
enum { T_INT = 0, T_REF = 1, T_STR = 2, T_CONST = 3, T_GLOBAL = 4 };
enum { C_NONE = 0, C_TRUE = 1, C_FALSE = 2 };
#define TAG(h) ((unsigned)((h) & 7u))
#define CONST_H(c) ((((H)(c)) << 3) | T_CONST)
#define REF_H(i) ((((H)(i)) << 3) | T_REF)
#define REF_OF(h) ((size_t)((h) >> 3))
/* Immediate ints are 61-bit; larger ones decline. */
#define IMM_LIMIT ((int64_t)1 << 60)
static inline H int_h(int64_t v) { return (((H)v) << 3) | T_INT; }
static inline int64_t int_of(H h) { return ((int64_t)h) >> 3; }
/* Strings point into the pickle: offset < 2**31, length < 2**30. */
static inline H str_h(uint64_t off, uint64_t len) { return (off << 33) | (len << 3) | T_STR; }
static inline size_t str_off(H h) { return (size_t)(h >> 33); }
static inline size_t str_len(H h) { return (size_t)((h >> 3) & ((1u << 30) - 1)); }
/* Globals: role in the low byte, index of the role's payload (a dtype name) above it. */
static inline H global_h(unsigned role, size_t payload) { return ((((H)payload << 8) | role) << 3) | T_GLOBAL; }
static inline unsigned global_role(H h) { return (unsigned)((h >> 3) & 0xff); }
static inline size_t global_payload(H h) { return (size_t)(h >> 11); }

/* Roles of allowed globals: the Python side maps each allow-list entry to one. */
enum {
    R_METADATA = 1, R_TENSOR_MD, R_BYTES_MD, R_STORAGE_META, /* dict stand-ins: BUILD is dict.update */
    R_CHUNK, R_INDEX, R_STORAGE_INFO,                        /* holders: BUILD appends the state */
    R_PROPS,                                                 /* TensorProperties: BUILD keeps the dtype */
    R_SIZE, R_LAYOUT, R_ENUM, R_PATH, R_ODICT,               /* callables */
    R_DTYPE,                                                 /* a dtype value */
    R_LAST
};
static int is_dict_role(unsigned r) { return r >= R_METADATA && r <= R_STORAGE_META; }
static int is_holder_role(unsigned r) { return r >= R_CHUNK && r <= R_STORAGE_INFO; }
static int is_class_role(unsigned r) { return is_dict_role(r) || is_holder_role(r) || r == R_PROPS; }

enum { K_TUPLE, K_LIST, K_DICT, K_OBJ, K_FLOAT, K_PATH };
typedef struct {
    uint8_t kind;
    uint8_t role;     /* K_OBJ: the class */
    uint8_t builds;   /* K_OBJ: BUILDs seen */
    uint8_t keyed;    /* K_OBJ: already a key of storage_data */
    uint32_t n;       /* K_TUPLE: items; K_LIST/K_DICT: handles (a dict's are key, value, ...) */
    uint64_t a;       /* K_TUPLE: first item; K_LIST/K_DICT: first segment + 1; K_OBJ: state; K_FLOAT: bits */
    uint64_t b;       /* K_LIST/K_DICT: last segment; K_OBJ: handles of a dict state seen at BUILD;
                         K_TUPLE: the tuple of Python ints made from it, once (a PyObject *) */
} Obj;

/* Lists and dicts grow in batches (APPENDS, SETITEMS); each batch is a segment of `items`. */
typedef struct { uint32_t start, count, next; } Seg;

typedef struct {
    const unsigned char *base, *p, *end;
    /* The end of the current FRAME: CPython's unpickler drops what is left of a frame when a read
       runs past its end and reads on after it, so such a read declines here. NULL: no frame. */
    const unsigned char *frame_end;
    H *stack; size_t sp, stack_cap;
    size_t *marks; size_t nmarks, marks_cap;
    H *memo; size_t nmemo, memo_cap;
    Obj *objs; size_t nobjs, objs_cap;
    H *items; size_t nitems, items_cap;
    Seg *segs; size_t nsegs, segs_cap;
    PyObject *allowed;  /* {(module, name): (role, payload)} */
    PyObject *payloads; /* list of payloads, indexed by global handles */
    PyObject *chunk_type, *entry_type;
    /* Extraction work (items looked at, Python objects made): shared containers must not turn a
       small hostile pickle into quadratic time or memory here. Past the limit, decline. */
    size_t work, work_limit;
    /* A direct-mapped cache of the str objects made for string handles (keys repeat a million times). */
    H cache_key[4096];
    PyObject *cache_val[4096];
} VM;

static int grow(void **ptr, size_t *cap, size_t need, size_t size) {
    if (need <= *cap) return 0;
    size_t cap2 = *cap ? *cap : 64;
    while (cap2 < need) {
        if (cap2 > ((size_t)1 << 40) / size) return -1;
        cap2 *= 2;
    }
    void *p2 = PyMem_RawRealloc(*ptr, cap2 * size);
    if (!p2) return -1;
    *ptr = p2;
    *cap = cap2;
    return 0;
}
#define GROW(vm, arr, n, cap, extra) grow((void **)&(vm)->arr, &(vm)->cap, (vm)->n + (extra), sizeof(*(vm)->arr))

static inline int push(VM *vm, H h) {
    if (GROW(vm, stack, sp, stack_cap, 1)) return -1;
    vm->stack[vm->sp++] = h;
    return 0;
}
static inline size_t fence(const VM *vm) { return vm->nmarks ? vm->marks[vm->nmarks - 1] : 0; }
static inline int pop(VM *vm, H *out) {
    if (vm->sp <= fence(vm)) return -1;
    *out = vm->stack[--vm->sp];
    return 0;
}
/* Pop the last MARK: the items above it are stack[*start, sp). */
static int pop_mark(VM *vm, size_t *start) {
    if (!vm->nmarks) return -1;
    *start = vm->marks[--vm->nmarks];
    return 0;
}
static inline int new_obj(VM *vm, uint8_t kind, H *out) {
    if (GROW(vm, objs, nobjs, objs_cap, 1)) return -1;
    if (vm->nobjs >= ((size_t)1 << 60)) return -1;
    Obj *o = &vm->objs[vm->nobjs];
    memset(o, 0, sizeof(*o));
    o->kind = kind;
    *out = REF_H(vm->nobjs++);
    return 0;
}
static inline Obj *obj_of(VM *vm, H h, int kind) {
    if (TAG(h) != T_REF) return NULL;
    Obj *o = &vm->objs[REF_OF(h)];
    return (kind < 0 || o->kind == kind) ? o : NULL;
}
/* A tuple of stack[start, sp): its items move to `items`. */
static int make_tuple(VM *vm, size_t start, H *out) {
    size_t n = vm->sp - start;
    if (GROW(vm, items, nitems, items_cap, n) || vm->nitems + n >= UINT32_MAX) return -1;
    memcpy(vm->items + vm->nitems, vm->stack + start, n * sizeof(H));
    if (new_obj(vm, K_TUPLE, out)) return -1;
    Obj *o = &vm->objs[REF_OF(*out)];
    o->a = vm->nitems;
    o->n = (uint32_t)n;
    vm->nitems += n;
    vm->sp = start;
    return 0;
}
/* Python would raise TypeError hashing these as dict keys (tuples are declined, not recursed into). */
static int hashable_key(VM *vm, H key) {
    if (TAG(key) != T_REF) return 1;
    Obj *o = &vm->objs[REF_OF(key)];
    if (o->kind == K_FLOAT || o->kind == K_PATH) return 1;
    return o->kind == K_OBJ && o->role == R_INDEX;
}
/* Append stack[start, sp) to a list or dict as one segment. */
static int extend(VM *vm, Obj *o, size_t start) {
    size_t n = vm->sp - start;
    if (o->kind == K_DICT) {
        if (n % 2) return -1;
        for (size_t i = start; i < vm->sp; i += 2)
            if (!hashable_key(vm, vm->stack[i])) return -1;
    }
    if ((uint64_t)o->n + n >= UINT32_MAX) return -1;
    if (GROW(vm, items, nitems, items_cap, n) || vm->nitems + n >= UINT32_MAX) return -1;
    if (GROW(vm, segs, nsegs, segs_cap, 1) || vm->nsegs + 1 >= UINT32_MAX) return -1;
    memcpy(vm->items + vm->nitems, vm->stack + start, n * sizeof(H));
    Seg *s = &vm->segs[vm->nsegs];
    s->start = (uint32_t)vm->nitems;
    s->count = (uint32_t)n;
    s->next = 0;
    if (o->a) vm->segs[o->b].next = (uint32_t)(vm->nsegs + 1);
    else o->a = vm->nsegs + 1;
    o->b = vm->nsegs;
    o->n += (uint32_t)n;
    vm->nsegs++;
    vm->nitems += n;
    vm->sp = start;
    return 0;
}
/* APPEND(S), SETITEM(S): the container sits just below `start`, above the fence. */
static int add_to_container(VM *vm, size_t start, int kind) {
    if (start > vm->sp || start <= fence(vm)) return -1;
    if (start == vm->sp) return 0; /* nothing to add: Python does not look at the target */
    Obj *o = obj_of(vm, vm->stack[start - 1], kind);
    if (!o) return -1;
    return extend(vm, o, start);
}

/* ---- reading the pickle ---- */

/* Where the bytes readable in one piece end: the frame's end inside a frame, else the pickle's. */
static inline const unsigned char *limit(const VM *vm) {
    return (vm->frame_end && vm->p < vm->frame_end) ? vm->frame_end : vm->end;
}
static inline int need(VM *vm, size_t n) { return (size_t)(limit(vm) - vm->p) >= n ? 0 : -1; }
static uint64_t le(const unsigned char *s, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | s[i];
    return v;
}
/* An opcode's little-endian argument of n bytes, read as CPython reads it: one read. */
static inline int arg(VM *vm, int n, uint64_t *out) {
    if (need(vm, (size_t)n)) return -1;
    *out = le(vm->p, n);
    vm->p += n;
    return 0;
}
/* Python decodes every string at load time ("surrogatepass"): one that does not decode fails it. */
static int check_utf8(const unsigned char *s, size_t n) {
    size_t i = 0;
    for (; i < n; i++)
        if (s[i] & 0x80) break;
    if (i == n) return 0;
    PyObject *u = PyUnicode_DecodeUTF8((const char *)s, (Py_ssize_t)n, "surrogatepass");
    if (!u) {
        PyErr_Clear();
        return -1;
    }
    Py_DECREF(u);
    return 0;
}
static int push_str(VM *vm, size_t n) {
    if (need(vm, n) || n >= ((size_t)1 << 30) || (size_t)(vm->p - vm->base) >= ((size_t)1 << 31)) return -1;
    if (check_utf8(vm->p, n)) return -1;
    H h = str_h((uint64_t)(vm->p - vm->base), n);
    vm->p += n;
    return push(vm, h);
}
static int lookup_global(VM *vm, PyObject *module, PyObject *name, H *out) {
    PyObject *key = PyTuple_Pack(2, module, name);
    if (!key) return -1;
    PyObject *entry = PyDict_GetItemWithError(vm->allowed, key);
    Py_DECREF(key);
    if (!entry || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 2) return -1; /* refused: Python's finding */
    long role = PyLong_AsLong(PyTuple_GET_ITEM(entry, 0));
    if (role <= 0 || role >= R_LAST) return -1;
    Py_ssize_t index = PyList_GET_SIZE(vm->payloads);
    if (PyList_Append(vm->payloads, PyTuple_GET_ITEM(entry, 1))) return -1;
    *out = global_h((unsigned)role, (size_t)index);
    return 0;
}
static PyObject *str_of(VM *vm, H h) {
    return PyUnicode_DecodeUTF8((const char *)vm->base + str_off(h), (Py_ssize_t)str_len(h), "surrogatepass");
}
static int stack_global(VM *vm) {
    H name, module;
    if (pop(vm, &name) || pop(vm, &module) || TAG(name) != T_STR || TAG(module) != T_STR) return -1;
    PyObject *m = str_of(vm, module), *n = m ? str_of(vm, name) : NULL;
    int rc = n ? lookup_global(vm, m, n, &name) : -1;
    Py_XDECREF(m);
    Py_XDECREF(n);
    return rc ? -1 : push(vm, name);
}
/* GLOBAL: "module\nname\n" (protocols 0-3). */
static int text_global(VM *vm) {
    const unsigned char *start = vm->p;
    const unsigned char *nl1 = memchr(start, '\n', (size_t)(limit(vm) - start));
    if (!nl1) return -1;
    vm->p = nl1 + 1; /* the name is a read of its own: past a frame's end it is read after it */
    const unsigned char *nl2 = memchr(vm->p, '\n', (size_t)(limit(vm) - vm->p));
    if (!nl2) return -1;
    PyObject *m = PyUnicode_DecodeUTF8((const char *)start, nl1 - start, "strict");
    PyObject *n = m ? PyUnicode_DecodeUTF8((const char *)nl1 + 1, nl2 - nl1 - 1, "strict") : NULL;
    H g;
    int rc = n ? lookup_global(vm, m, n, &g) : -1;
    Py_XDECREF(m);
    Py_XDECREF(n);
    vm->p = nl2 + 1;
    return rc ? -1 : push(vm, g);
}
static int reduce(VM *vm) {
    H args, fn, out;
    if (pop(vm, &args) || pop(vm, &fn) || TAG(fn) != T_GLOBAL) return -1;
    Obj *t = obj_of(vm, args, K_TUPLE);
    if (!t) return -1;
    size_t n = t->n, first = t->a;
    switch (global_role(fn)) {
    case R_SIZE: /* torch.Size(t) is rebuilt as tuple(t): t itself. Size(list) copies: declined. */
        if (n == 0) return push(vm, REF_H(0));
        if (n == 1 && obj_of(vm, vm->items[first], K_TUPLE)) return push(vm, vm->items[first]);
        return -1;
    case R_LAYOUT:
        return (n == 1 && TAG(vm->items[first]) == T_STR) ? push(vm, vm->items[first]) : -1;
    case R_ENUM:
        return n == 1 ? push(vm, vm->items[first]) : -1;
    case R_PATH:
        for (size_t i = 0; i < n; i++)
            if (TAG(vm->items[first + i]) != T_STR) return -1;
        return new_obj(vm, K_PATH, &out) ? -1 : push(vm, out);
    case R_ODICT:
        return (n == 0 && !new_obj(vm, K_DICT, &out)) ? push(vm, out) : -1;
    default:
        return -1;
    }
}
static int newobj(VM *vm) {
    H args, cls, out;
    if (pop(vm, &args) || pop(vm, &cls) || TAG(cls) != T_GLOBAL || !is_class_role(global_role(cls))) return -1;
    Obj *t = obj_of(vm, args, K_TUPLE);
    if (!t || t->n || new_obj(vm, K_OBJ, &out)) return -1;
    vm->objs[REF_OF(out)].role = (uint8_t)global_role(cls);
    return push(vm, out);
}
static int build(VM *vm) {
    H state;
    if (pop(vm, &state) || vm->sp <= fence(vm)) return -1;
    Obj *o = obj_of(vm, vm->stack[vm->sp - 1], K_OBJ);
    if (!o || o->builds) return -1;
    Obj *d = obj_of(vm, state, K_DICT);
    if (is_dict_role(o->role) && !d) return -1;
    o->builds = 1;
    o->a = state;
    /* dict.update copies: later SETITEMS on the state dict must not show through. */
    o->b = d ? d->n : 0;
    return 0;
}
static inline int memo_put(VM *vm, uint64_t index) {
    if (vm->sp <= fence(vm)) return -1;
    /* Real pickles number the memo densely; a sparse index would let a few bytes allocate gigabytes. */
    if (index > vm->nmemo) return -1;
    if (index == vm->nmemo) {
        if (GROW(vm, memo, nmemo, memo_cap, 1)) return -1;
        vm->nmemo++;
    }
    vm->memo[index] = vm->stack[vm->sp - 1];
    return 0;
}
static inline int memo_get(VM *vm, uint64_t index) {
    return index < vm->nmemo ? push(vm, vm->memo[index]) : -1;
}

/* Capacities from the pickle's length (a real `.metadata` needs about len/9 objects and memo
 * entries, len/5 items): one allocation each instead of a dozen reallocs that copy. Untouched
 * capacity costs address space only; a hostile file that needs more grows as usual. */
static int presize(VM *vm, size_t len) {
    return GROW(vm, stack, sp, stack_cap, 1024) || GROW(vm, memo, nmemo, memo_cap, len / 8)
           || GROW(vm, objs, nobjs, objs_cap, len / 8) || GROW(vm, items, nitems, items_cap, len / 4)
           || GROW(vm, segs, nsegs, segs_cap, len / 32);
}

/* Run to STOP; the result is the top of the stack. 0 on success, -1 to decline. */
static int run(VM *vm, H *result) {
    size_t start;
    uint64_t u;
    H out;
    while (vm->p < vm->end) {
        unsigned char op = *vm->p++;
        switch (op) {
        case 0x80: /* PROTO */
            if (arg(vm, 1, &u) || u > 5) return -1;
            break;
        case 0x95: /* FRAME */
            if (arg(vm, 8, &u)) return -1;
            /* Inside a frame a nested one must end within it; else it starts where this read ends. */
            if (u > (uint64_t)(limit(vm) - vm->p)) return -1;
            if (limit(vm) == vm->end) vm->frame_end = vm->p + u;
            break;
        case '.': /* STOP */
            return pop(vm, result);
        case '(': /* MARK */
            if (GROW(vm, marks, nmarks, marks_cap, 1)) return -1;
            vm->marks[vm->nmarks++] = vm->sp;
            break;
        case '0': /* POP: a MARK just below pops the mark */
            if (vm->nmarks && vm->marks[vm->nmarks - 1] == vm->sp) vm->nmarks--;
            else if (pop(vm, &out)) return -1;
            break;
        case '1': /* POP_MARK */
            if (pop_mark(vm, &start)) return -1;
            vm->sp = start;
            break;
        case '2': /* DUP */
            if (vm->sp <= fence(vm) || push(vm, vm->stack[vm->sp - 1])) return -1;
            break;
        case 'N':
            if (push(vm, CONST_H(C_NONE))) return -1;
            break;
        case 0x88:
            if (push(vm, CONST_H(C_TRUE))) return -1;
            break;
        case 0x89:
            if (push(vm, CONST_H(C_FALSE))) return -1;
            break;
        case 'J': /* BININT: signed */
            if (arg(vm, 4, &u) || push(vm, int_h((int32_t)(uint32_t)u))) return -1;
            break;
        case 'K': /* BININT1 */
            if (arg(vm, 1, &u) || push(vm, int_h((int64_t)u))) return -1;
            break;
        case 'M': /* BININT2 */
            if (arg(vm, 2, &u) || push(vm, int_h((int64_t)u))) return -1;
            break;
        case 0x8a: { /* LONG1: a length byte, then that many bytes of little-endian two's complement */
            uint64_t n;
            if (arg(vm, 1, &n) || n > 8 || (n && arg(vm, (int)n, &u))) return -1;
            if (n && n < 8 && (u >> (8 * n - 1)) & 1) u |= ~(uint64_t)0 << (8 * n);
            int64_t v = n ? (int64_t)u : 0;
            if (v >= IMM_LIMIT || v < -IMM_LIMIT || push(vm, int_h(v))) return -1;
            break;
        }
        case 'G': { /* BINFLOAT: big-endian double */
            if (need(vm, 8) || new_obj(vm, K_FLOAT, &out)) return -1;
            uint64_t bits = 0;
            for (int i = 0; i < 8; i++) bits = (bits << 8) | vm->p[i];
            vm->objs[REF_OF(out)].a = bits;
            vm->p += 8;
            if (push(vm, out)) return -1;
            break;
        }
        case 0x8c: /* SHORT_BINUNICODE */
            if (arg(vm, 1, &u) || push_str(vm, (size_t)u)) return -1;
            break;
        case 'X': /* BINUNICODE */
            if (arg(vm, 4, &u) || push_str(vm, (size_t)u)) return -1;
            break;
        case 0x8d: /* BINUNICODE8 */
            if (arg(vm, 8, &u) || u >= ((uint64_t)1 << 30) || push_str(vm, (size_t)u)) return -1;
            break;
        case ')': /* EMPTY_TUPLE: one shared, as in Python */
            if (push(vm, REF_H(0))) return -1;
            break;
        case 't': /* TUPLE */
            if (pop_mark(vm, &start) || make_tuple(vm, start, &out) || push(vm, out)) return -1;
            break;
        case 0x85: case 0x86: case 0x87: { /* TUPLE1..3 */
            size_t n = (size_t)(op - 0x84);
            if (vm->sp < fence(vm) + n || make_tuple(vm, vm->sp - n, &out) || push(vm, out)) return -1;
            break;
        }
        case ']': /* EMPTY_LIST */
            if (new_obj(vm, K_LIST, &out) || push(vm, out)) return -1;
            break;
        case '}': /* EMPTY_DICT */
            if (new_obj(vm, K_DICT, &out) || push(vm, out)) return -1;
            break;
        case 'l': case 'd': /* LIST, DICT: MARK items */
            if (pop_mark(vm, &start) || new_obj(vm, op == 'l' ? K_LIST : K_DICT, &out)) return -1;
            if (vm->sp > start && extend(vm, &vm->objs[REF_OF(out)], start)) return -1;
            if (push(vm, out)) return -1;
            break;
        case 'a': /* APPEND */
            if (add_to_container(vm, vm->sp - 1, K_LIST)) return -1;
            break;
        case 'e': /* APPENDS */
            if (pop_mark(vm, &start) || add_to_container(vm, start, K_LIST)) return -1;
            break;
        case 's': /* SETITEM */
            if (vm->sp < 2 || add_to_container(vm, vm->sp - 2, K_DICT)) return -1;
            break;
        case 'u': /* SETITEMS */
            if (pop_mark(vm, &start) || add_to_container(vm, start, K_DICT)) return -1;
            break;
        case 0x93: /* STACK_GLOBAL */
            if (stack_global(vm)) return -1;
            break;
        case 'c': /* GLOBAL */
            if (text_global(vm)) return -1;
            break;
        case 'R':
            if (reduce(vm)) return -1;
            break;
        case 0x81: /* NEWOBJ */
            if (newobj(vm)) return -1;
            break;
        case 'b':
            if (build(vm)) return -1;
            break;
        case 0x94: /* MEMOIZE */
            if (memo_put(vm, vm->nmemo)) return -1;
            break;
        case 'q': /* BINPUT: a 1-byte memo index */
        case 'r': /* LONG_BINPUT: a 4-byte one */
            if (arg(vm, op == 'q' ? 1 : 4, &u) || memo_put(vm, u)) return -1;
            break;
        case 'h': /* BINGET: a 1-byte memo index */
        case 'j': /* LONG_BINGET: a 4-byte one */
            if (arg(vm, op == 'h' ? 1 : 4, &u) || memo_get(vm, u)) return -1;
            break;
        default: /* everything else: the Python path decides */
            return -1;
        }
    }
    return -1; /* no STOP: truncated */
}

/* ---- from handles to the reader's model ---- */

static int charge(VM *vm, size_t n) {
    vm->work += n;
    return vm->work > vm->work_limit ? -1 : 0;
}

/* The handles of a tuple, list or dict in order (a dict's: key, value, key, value, ...). */
typedef struct { uint64_t seg; size_t at, end; } Iter;
static Iter iter(const VM *vm, const Obj *o) {
    Iter it = {0, 0, 0};
    if (o->kind == K_TUPLE) {
        it.at = o->a;
        it.end = o->a + o->n;
    } else if (o->a) {
        it.seg = o->a;
        it.at = vm->segs[o->a - 1].start;
        it.end = it.at + vm->segs[o->a - 1].count;
    }
    return it;
}
static int iter_next(const VM *vm, Iter *it, H *out) {
    while (it->at == it->end) {
        if (!it->seg || !(it->seg = vm->segs[it->seg - 1].next)) return 0;
        it->at = vm->segs[it->seg - 1].start;
        it->end = it->at + vm->segs[it->seg - 1].count;
    }
    *out = vm->items[it->at++];
    return 1;
}
/* A tuple or list: the sequences the Python path iterates. */
static Obj *sequence_of(VM *vm, H h) {
    Obj *o = obj_of(vm, h, -1);
    return (o && (o->kind == K_TUPLE || o->kind == K_LIST)) ? o : NULL;
}

/* The value of `key` in a dict's first `limit` handles (the last assignment wins); 0 if absent. */
static int dict_get(VM *vm, Obj *d, uint64_t limit, const char *key, H *out) {
    size_t klen = strlen(key);
    int found = 0;
    H k, v;
    Iter it = iter(vm, d);
    for (uint64_t seen = 0; seen < limit && iter_next(vm, &it, &k) && iter_next(vm, &it, &v); seen += 2) {
        if (charge(vm, 1)) return 0;
        if (TAG(k) == T_STR && str_len(k) == klen && !memcmp(vm->base + str_off(k), key, klen)) {
            *out = v;
            found = 1;
        }
    }
    return found;
}
/* The state dict of a built stand-in, with the number of its handles the object sees. */
static Obj *state_dict(VM *vm, H h, int role, uint64_t *limit) {
    Obj *o = obj_of(vm, h, K_OBJ);
    if (!o || o->role != role || !o->builds) return NULL;
    Obj *d = obj_of(vm, o->a, K_DICT);
    if (!d) return NULL;
    *limit = is_holder_role(role) ? d->n : o->b;
    return d;
}

static PyObject *py_str(VM *vm, H h) {
    size_t slot = (size_t)((h >> 3) * 0x9E3779B97F4A7C15ull >> 52);
    if (vm->cache_key[slot] == h && vm->cache_val[slot]) {
        Py_INCREF(vm->cache_val[slot]);
        return vm->cache_val[slot];
    }
    PyObject *s = str_of(vm, h);
    if (!s) return NULL;
    Py_XDECREF(vm->cache_val[slot]);
    Py_INCREF(s);
    vm->cache_key[slot] = h;
    vm->cache_val[slot] = s;
    return s;
}

/* A Python tuple of `convert` applied to each handle of a tuple or list; NULL to decline. */
static PyObject *map_tuple(VM *vm, Obj *o, PyObject *(*convert)(VM *, H)) {
    if (charge(vm, o->n)) return NULL;
    PyObject *out = PyTuple_New(o->n);
    Iter it = iter(vm, o);
    H v;
    for (size_t at = 0; out && iter_next(vm, &it, &v); at++) {
        PyObject *x = convert(vm, v);
        if (!x) Py_CLEAR(out);
        else PyTuple_SET_ITEM(out, at, x);
    }
    return out;
}
static PyObject *int_of_handle(VM *vm, H h) {
    (void)vm;
    return TAG(h) == T_INT ? PyLong_FromLongLong(int_of(h)) : NULL;
}
static PyObject *str_of_handle(VM *vm, H h) { return TAG(h) == T_STR ? py_str(vm, h) : NULL; }

/* The tuple of Python ints a tuple of int handles makes (a list declines: DCP writes torch.Size);
 * NULL to decline. Made once per pickled tuple and shared wherever the pickle shares it. */
static PyObject *int_tuple(VM *vm, H h) {
    Obj *o = obj_of(vm, h, K_TUPLE);
    if (!o) return NULL;
    if (o->b) return Py_NewRef((PyObject *)(uintptr_t)o->b);
    PyObject *t = map_tuple(vm, o, int_of_handle);
    if (t) o->b = (uint64_t)(uintptr_t)Py_NewRef(t);
    return t;
}

/* A tuple subclass instance (Chunk, StorageEntry) without a call: tuple.__new__ in C. */
static PyObject *make_record(PyObject *type, PyObject **fields, Py_ssize_t n) {
    PyTypeObject *tp = (PyTypeObject *)type;
    PyObject *r = tp->tp_alloc(tp, n);
    if (!r) {
        for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(fields[i]);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(r, i, fields[i]);
    return r;
}

/* Plain data (planner_data, version) as Python objects, equal to what the unpickler makes. */
static PyObject *to_py(VM *vm, H h, int depth) {
    if (depth > 64 || charge(vm, 1)) return NULL;
    switch (TAG(h)) {
    case T_INT: return PyLong_FromLongLong(int_of(h));
    case T_STR: return py_str(vm, h);
    case T_CONST:
        if (h == CONST_H(C_NONE)) Py_RETURN_NONE;
        return PyBool_FromLong(h == CONST_H(C_TRUE));
    case T_REF: break;
    default: return NULL;
    }
    Obj *o = &vm->objs[REF_OF(h)];
    if (o->kind == K_FLOAT) {
        double d;
        memcpy(&d, &o->a, sizeof d);
        return PyFloat_FromDouble(d);
    }
    if (o->kind == K_TUPLE) {
        PyObject *t = PyTuple_New(o->n);
        for (uint32_t i = 0; t && i < o->n; i++) {
            PyObject *x = to_py(vm, vm->items[o->a + i], depth + 1);
            if (!x) Py_CLEAR(t);
            else PyTuple_SET_ITEM(t, i, x);
        }
        return t;
    }
    if (o->kind != K_LIST && o->kind != K_DICT) return NULL;
    PyObject *c = o->kind == K_LIST ? PyList_New(0) : PyDict_New();
    Iter it = iter(vm, o);
    H k, v;
    while (c && iter_next(vm, &it, &k)) {
        PyObject *x = to_py(vm, k, depth + 1), *y = NULL;
        int rc = -1;
        if (x && o->kind == K_LIST) rc = PyList_Append(c, x);
        else if (x && iter_next(vm, &it, &v) && (y = to_py(vm, v, depth + 1))) rc = PyDict_SetItem(c, x, y);
        Py_XDECREF(x);
        Py_XDECREF(y);
        if (rc) Py_CLEAR(c);
    }
    return c;
}

/* The dtype TensorProperties' __setstate__ keeps: str(state[0]) or str(state.get("dtype", "float32")). */
static PyObject *props_dtype(VM *vm, H props) {
    Obj *o = obj_of(vm, props, K_OBJ);
    if (!o || o->role != R_PROPS || !o->builds) return NULL;
    H v;
    Obj *t = obj_of(vm, o->a, K_TUPLE), *d = obj_of(vm, o->a, K_DICT);
    if (t && t->n) v = vm->items[t->a];
    else if (d && !dict_get(vm, d, o->b, "dtype", &v)) return PyUnicode_FromString("float32");
    else if (!d) return NULL;
    if (TAG(v) == T_STR) return py_str(vm, v);
    if (TAG(v) == T_GLOBAL && global_role(v) == R_DTYPE) {
        PyObject *name = PyList_GET_ITEM(vm->payloads, global_payload(v));
        if (!PyUnicode_Check(name)) return NULL;
        Py_INCREF(name);
        return name;
    }
    return NULL;
}

/* The Chunk of one built ChunkStorageMetadata. */
static PyObject *chunk_of(VM *vm, H c) {
    uint64_t limit;
    H offsets, sizes;
    Obj *st = state_dict(vm, c, R_CHUNK, &limit);
    PyObject *f[2] = {NULL, NULL};
    if (st && dict_get(vm, st, limit, "offsets", &offsets) && dict_get(vm, st, limit, "sizes", &sizes)) {
        f[0] = int_tuple(vm, offsets);
        f[1] = f[0] ? int_tuple(vm, sizes) : NULL;
    }
    if (f[1]) return make_record(vm->chunk_type, f, 2);
    Py_XDECREF(f[0]);
    return NULL;
}

/* One state_dict_metadata entry: (key, None) for a bytes item, (key, dtype, size, chunks) for a tensor. */
static PyObject *item_entry(VM *vm, H k, H v) {
    Obj *item = charge(vm, 1) ? NULL : obj_of(vm, v, K_OBJ);
    PyObject *entry = NULL, *key = TAG(k) == T_STR ? py_str(vm, k) : NULL;
    uint64_t limit;
    H props, size, chunks;
    Obj *st = state_dict(vm, v, R_TENSOR_MD, &limit);
    if (key && item && item->role == R_BYTES_MD) {
        entry = PyTuple_Pack(2, key, Py_None);
    } else if (key && st && dict_get(vm, st, limit, "properties", &props) && dict_get(vm, st, limit, "size", &size)
               && dict_get(vm, st, limit, "chunks", &chunks)) {
        PyObject *dtype = props_dtype(vm, props);
        PyObject *shape = dtype ? int_tuple(vm, size) : NULL;
        Obj *list = shape ? sequence_of(vm, chunks) : NULL;
        PyObject *pieces = list ? map_tuple(vm, list, chunk_of) : NULL;
        if (pieces) entry = PyTuple_Pack(4, key, dtype, shape, pieces);
        Py_XDECREF(dtype);
        Py_XDECREF(shape);
        Py_XDECREF(pieces);
    }
    Py_XDECREF(key);
    return entry;
}

/* The entries of a dict (state_dict_metadata, storage_data), each made by `entry`; NULL to decline. */
static PyObject *entries_of(VM *vm, Obj *d, PyObject *(*entry)(VM *, H, H)) {
    PyObject *out = PyList_New(0);
    Iter it = d ? iter(vm, d) : (Iter){0, 0, 0};
    H k, v;
    while (out && iter_next(vm, &it, &k) && iter_next(vm, &it, &v)) {
        PyObject *e = entry(vm, k, v);
        if (!e || PyList_Append(out, e)) Py_CLEAR(out);
        Py_XDECREF(e);
    }
    return out;
}

/* transform_descriptors: falsy -> (), a tuple or list of str -> that tuple. */
static PyObject *transforms_of(VM *vm, Obj *st, uint64_t limit) {
    H t;
    if (!dict_get(vm, st, limit, "transform_descriptors", &t) || t == CONST_H(C_NONE) || t == CONST_H(C_FALSE))
        return PyTuple_New(0);
    Obj *o = sequence_of(vm, t);
    return o ? map_tuple(vm, o, str_of_handle) : NULL;
}

/* One storage_data entry: StorageEntry(key, chunk_offsets, relative_path, offset, length, transforms). */
static PyObject *storage_entry(VM *vm, H k, H v) {
    H fqn, where, path, off, len;
    uint64_t klimit, vlimit;
    Obj *key = obj_of(vm, k, K_OBJ);
    Obj *ks = state_dict(vm, k, R_INDEX, &klimit), *vs = state_dict(vm, v, R_STORAGE_INFO, &vlimit);
    PyObject *f[6] = {NULL, NULL, NULL, NULL, NULL, NULL};
    /* A key object twice is one dict entry in Python: the Python path decides. */
    int ok = key && !key->keyed && ks && vs && dict_get(vm, ks, klimit, "fqn", &fqn) && TAG(fqn) == T_STR
             && dict_get(vm, vs, vlimit, "relative_path", &path) && TAG(path) == T_STR
             && dict_get(vm, vs, vlimit, "offset", &off) && TAG(off) == T_INT
             && dict_get(vm, vs, vlimit, "length", &len) && TAG(len) == T_INT;
    if (ok) {
        key->keyed = 1;
        f[0] = py_str(vm, fqn);
        if (!dict_get(vm, ks, klimit, "offset", &where) || where == CONST_H(C_NONE)) f[1] = Py_NewRef(Py_None);
        else f[1] = int_tuple(vm, where);
        f[2] = py_str(vm, path);
        f[3] = PyLong_FromLongLong(int_of(off));
        f[4] = PyLong_FromLongLong(int_of(len));
        f[5] = transforms_of(vm, vs, vlimit);
        ok = f[0] && f[1] && f[2] && f[3] && f[4] && f[5];
    }
    if (ok) return make_record(vm->entry_type, f, 6);
    for (int j = 0; j < 6; j++) Py_XDECREF(f[j]);
    return NULL;
}

/* (version, items, storage, planner_data or None) of the parsed Metadata; NULL to decline. */
static PyObject *extract(VM *vm, H root) {
    uint64_t limit = 0;
    Obj *o = obj_of(vm, root, K_OBJ);
    if (!o || o->role != R_METADATA) return NULL;
    Obj *md = o->builds ? obj_of(vm, o->a, K_DICT) : NULL;
    limit = o->b;
    H sdm_h, sd_h, planner_h, version_h;
    Obj *sdm = NULL, *sd = NULL;
    /* `md.get(...) or {}`: only a missing value, None or a dict is read the same way by both paths. */
    if (md && dict_get(vm, md, limit, "state_dict_metadata", &sdm_h) && sdm_h != CONST_H(C_NONE)
        && !(sdm = obj_of(vm, sdm_h, K_DICT)))
        return NULL;
    if (md && dict_get(vm, md, limit, "storage_data", &sd_h) && sd_h != CONST_H(C_NONE)
        && !(sd = obj_of(vm, sd_h, K_DICT)))
        return NULL;
    PyObject *version = NULL, *planner = NULL, *items = NULL, *storage = NULL, *result = NULL;
    if (md && dict_get(vm, md, limit, "version", &version_h)) version = to_py(vm, version_h, 0);
    else version = Py_NewRef(Py_None);
    Obj *standin = NULL;
    if (!md || !dict_get(vm, md, limit, "planner_data", &planner_h)) planner = Py_NewRef(Py_None);
    else if (obj_of(vm, planner_h, K_DICT)) planner = to_py(vm, planner_h, 0);
    /* The stand-ins of dict roles are dicts to the Python path's isinstance(): it reads them. */
    else if ((standin = obj_of(vm, planner_h, K_OBJ)) && (is_dict_role(standin->role) || standin->role == R_PROPS))
        planner = NULL;
    else planner = Py_NewRef(Py_None);
    if (version && planner) items = entries_of(vm, sdm, item_entry);
    if (items) storage = entries_of(vm, sd, storage_entry);
    if (storage) result = PyTuple_Pack(4, version, items, storage, planner);
    Py_XDECREF(version);
    Py_XDECREF(planner);
    Py_XDECREF(items);
    Py_XDECREF(storage);
    return result;
}

static void vm_free(VM *vm) {
    for (size_t i = 0; i < vm->nobjs; i++)
        if (vm->objs[i].kind == K_TUPLE && vm->objs[i].b) Py_DECREF((PyObject *)(uintptr_t)vm->objs[i].b);
    PyMem_RawFree(vm->stack);
    PyMem_RawFree(vm->marks);
    PyMem_RawFree(vm->memo);
    PyMem_RawFree(vm->objs);
    PyMem_RawFree(vm->items);
    PyMem_RawFree(vm->segs);
    for (size_t i = 0; i < 4096; i++) Py_XDECREF(vm->cache_val[i]);
    Py_XDECREF(vm->payloads);
}

static int is_plain_tuple_type(PyObject *t) {
    return PyType_Check(t) && PyType_IsSubtype((PyTypeObject *)t, &PyTuple_Type)
           && ((PyTypeObject *)t)->tp_basicsize == PyTuple_Type.tp_basicsize
           && ((PyTypeObject *)t)->tp_itemsize == PyTuple_Type.tp_itemsize;
}

static PyObject *parse(PyObject *self, PyObject *args) {
    Py_buffer buf;
    PyObject *allowed, *chunk_type, *entry_type;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*O!OO:parse", &buf, &PyDict_Type, &allowed, &chunk_type, &entry_type)) return NULL;
    if (!is_plain_tuple_type(chunk_type) || !is_plain_tuple_type(entry_type)) {
        PyBuffer_Release(&buf);
        PyErr_SetString(PyExc_TypeError, "record types must be tuple subclasses without instance fields");
        return NULL;
    }
    VM *vm = PyMem_RawCalloc(1, sizeof(VM));
    if (!vm) {
        PyBuffer_Release(&buf);
        return PyErr_NoMemory();
    }
    vm->base = vm->p = buf.buf;
    vm->end = vm->base + buf.len;
    vm->allowed = allowed;
    vm->chunk_type = chunk_type;
    vm->entry_type = entry_type;
    vm->payloads = PyList_New(0);
    /* A real `.metadata` needs about len / 4 (a million chunks: 29 M for 128 MB): 8x room. */
    vm->work_limit = 2 * (size_t)buf.len + ((size_t)1 << 20);
    PyObject *result = NULL;
    H root;
    if (vm->payloads && (presize(vm, (size_t)buf.len) || new_obj(vm, K_TUPLE, &root)))
        Py_CLEAR(vm->payloads); /* objs[0]: the empty tuple */
    if (vm->payloads && buf.len < ((Py_ssize_t)1 << 31) && !run(vm, &root)) result = extract(vm, root);
    if (result && vm->work > vm->work_limit) Py_CLEAR(result); /* a lookup gave up part way */
    vm_free(vm);
    PyMem_RawFree(vm);
    PyBuffer_Release(&buf);
    if (!result) {
        /* Every failure, an allocation one included, is a decline: the Python path answers. */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"parse", parse, METH_VARARGS,
     "parse(data, allowed, chunk_type, entry_type) -> (version, items, storage, planner_data) or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_metaparse", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__metaparse(void) { return PyModule_Create(&module); }
