/* Which CPU gradients hold a NaN or an Inf (torchpulse.probes._gradscan).
 *
 * The autograd probe checks every parameter gradient after every backward pass. On a
 * CUDA device that is one asynchronous reduction; on a CPU it runs on the training
 * thread, and `torch._foreach_norm` there computes more than a finiteness check needs
 * (a float square and add per element, at ~10 GB/s). This scan only tests exponent
 * bits: an element is NaN or Inf exactly when all its exponent bits are set, that is
 * when (bits & ~sign) + (lowest exponent bit) carries into the sign bit. The OR of
 * those sums over a block has its top bit set when any element does. Integer AND,
 * ADD and OR vectorize on every x86-64 level; on x86-64 the loop is also built for
 * AVX2 and AVX-512 and the loader picks the widest the CPU has (gcc target_clones).
 *
 * The caller passes raw addresses and byte lengths of contiguous CPU tensors whose
 * storage it has checked to cover them, and keeps the tensors alive during the call.
 *
 * One core reads freshly written data at ~15 GB/s here, far below what the memory
 * delivers to several, so with more than one thread the scan splits the bytes across
 * the threads of torch's own OpenMP team (`use_openmp`): the job's thread setting
 * decides, as it does for torch's kernels, and no second pool of threads is started.
 *
 * A gradient read at the end of the pass comes from memory; read as the engine accumulates
 * it, much of it is still in cache (the scan alone: 418 us against 606 us on this host's benchmark model).
 * `Hook` is a post-accumulate-grad hook that scans the gradient there and leaves the answer
 * for the probe; `dense_span` is the one place that decides which tensors may be read raw.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#define HAVE_DLFCN 1
#endif

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__) && !defined(__clang__)
#define WIDEST __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define WIDEST
#endif

/* Elements per block and stream: a NaN stops the scan at the end of its block, not of the tensor. */
#define BLOCK 4096

/* A span is read as STREAMS equal parts in lockstep: a freshly written gradient comes from
 * memory, not cache, and one core's bandwidth from memory grows with the streams in flight
 * (four read 10% faster than one in place after a real backward pass; eight no faster).
 *
 * Elements are loaded with memcpy: a tensor made by torch.frombuffer may start at any byte,
 * and reading a float's bytes through an integer pointer would break C's aliasing rules. gcc
 * turns each memcpy into one (vector) load. */
#define STREAMS 4
#define SCANNER(NAME, T, MAGNITUDE, LOWEST_EXPONENT, TOP)                          \
    WIDEST static int NAME(const unsigned char *p, size_t n) {                   \
        size_t part = n / STREAMS;                                               \
        T acc = 0;                                                               \
        for (size_t start = 0; start < part; start += BLOCK) {                   \
            size_t end = part - start < BLOCK ? part : start + BLOCK;            \
            for (size_t i = start; i < end; i++)                                 \
                for (size_t s = 0; s < STREAMS; s++) {                           \
                    T v;                                                         \
                    memcpy(&v, p + (s * part + i) * sizeof(T), sizeof(T));      \
                    acc |= (T)((T)(v & (MAGNITUDE)) + (LOWEST_EXPONENT));        \
                }                                                                \
            if (acc & (TOP)) return 1;                                           \
        }                                                                        \
        for (size_t i = STREAMS * part; i < n; i++) {                            \
            T v;                                                                 \
            memcpy(&v, p + i * sizeof(T), sizeof(T));                            \
            acc |= (T)((T)(v & (MAGNITUDE)) + (LOWEST_EXPONENT));                \
        }                                                                        \
        return (acc & (TOP)) != 0;                                               \
    }

SCANNER(scan_f16, uint16_t, 0x7fffu, 0x0400u, 0x8000u)
SCANNER(scan_bf16, uint16_t, 0x7fffu, 0x0080u, 0x8000u)
SCANNER(scan_f32, uint32_t, 0x7fffffffu, 0x00800000u, 0x80000000u)
SCANNER(scan_f64, uint64_t, 0x7fffffffffffffffull, 0x0010000000000000ull, 0x8000000000000000ull)

/* Format codes, as torchpulse.probes.autograd_nonfinite._SCAN_FORMATS names them. */
enum { F16 = 0, BF16 = 1, F32 = 2, F64 = 3 };
static const size_t WIDTH[] = {2, 2, 4, 8};

static int scan(int format, const unsigned char *p, size_t n) {
    switch (format) {
    case F16: return scan_f16(p, n);
    case BF16: return scan_bf16(p, n);
    case F32: return scan_f32(p, n);
    default: return scan_f64(p, n);
    }
}

/* The OpenMP runtime's entry points, found in the one torch loaded (see use_openmp). GOMP_parallel
 * is what gcc compiles `#pragma omp parallel` to; LLVM's and Intel's runtimes export it as well. */
typedef void (*ParallelFn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*ThreadFn)(void);
static ParallelFn omp_parallel;
static ThreadFn omp_thread_num, omp_num_threads;

/* Below this many bytes per thread, waking the team costs more than the split saves. */
#define PARALLEL_MIN_BYTES (256u * 1024u)

typedef struct {
    int format;
    Py_ssize_t count;
    const unsigned char **address;
    size_t *elements;
    size_t total;          /* elements in all spans */
    unsigned char *found;  /* per span: 1 once any part of it holds a NaN or Inf */
    int team;              /* threads that ran the scan */
} Job;

/* Threads that ran the last scan, for the probe's status (1: the calling thread alone). */
static int last_team = 1;

/* Scan elements [lo, hi) of the spans laid end to end. */
static void scan_range(Job *job, size_t lo, size_t hi) {
    size_t width = WIDTH[job->format], start = 0;
    for (Py_ssize_t i = 0; i < job->count && start < hi; i++) {
        size_t end = start + job->elements[i];
        if (end > lo && !__atomic_load_n(&job->found[i], __ATOMIC_RELAXED)) {
            size_t from = lo > start ? lo - start : 0, to = (hi < end ? hi : end) - start;
            if (scan(job->format, job->address[i] + from * width, to - from))
                __atomic_store_n(&job->found[i], 1, __ATOMIC_RELAXED);
        }
        start = end;
    }
}

/* Runs on every thread of the team: each scans its equal share of the elements. */
static void scan_share(void *arg) {
    Job *job = arg;
    size_t thread = (size_t)omp_thread_num(), threads = (size_t)omp_num_threads();
    size_t share = job->total / threads;  /* the last thread also takes the remainder */
    if (thread == 0) job->team = (int)threads;
    scan_range(job, share * thread, thread + 1 == threads ? job->total : share * (thread + 1));
}

/* Scan the job's spans: across `threads` of the OpenMP team where that pays, else on this thread. */
static void run_job(Job *job, int threads) {
    if (threads > 1 && omp_parallel != NULL &&
        job->total * WIDTH[job->format] / (size_t)threads >= PARALLEL_MIN_BYTES)
        omp_parallel(scan_share, job, (unsigned)threads, 0);
    else
        scan_range(job, 0, job->total);
    last_team = job->team;
}

/* nonfinite(format, addresses, nbytes, threads=1) -> list of the indices whose span holds a NaN or
 * Inf. Raises ValueError for an unknown format, a length that is not whole elements or a span
 * without an address: the caller's checks decide what is scanned, and a mistake there must not
 * turn into a wrong answer. With threads > 1 and an OpenMP team to use, the spans are split
 * across that many threads of it. */
static PyObject *nonfinite(PyObject *self, PyObject *args) {
    (void)self;
    int format, threads = 1;
    PyObject *addresses, *lengths;
    if (!PyArg_ParseTuple(args, "iO!O!|i", &format, &PyList_Type, &addresses, &PyList_Type, &lengths,
                          &threads))
        return NULL;
    if (format < F16 || format > F64) {
        PyErr_Format(PyExc_ValueError, "unknown format %d", format);
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(addresses);
    if (PyList_GET_SIZE(lengths) != count) {
        PyErr_SetString(PyExc_ValueError, "addresses and nbytes differ in length");
        return NULL;
    }
    size_t width = WIDTH[format];
    Job job = {format, count, PyMem_Calloc((size_t)count + 1, sizeof(*job.address)),
               PyMem_Calloc((size_t)count + 1, sizeof(*job.elements)), 0, PyMem_Calloc((size_t)count + 1, 1), 1};
    PyObject *found = NULL;
    if (job.address == NULL || job.elements == NULL || job.found == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        uintptr_t address = (uintptr_t)PyLong_AsVoidPtr(PyList_GET_ITEM(addresses, i));
        Py_ssize_t nbytes = PyLong_AsSsize_t(PyList_GET_ITEM(lengths, i));
        if (PyErr_Occurred()) goto done;
        if (nbytes < 0 || (size_t)nbytes % width || (nbytes && address == 0)) {
            PyErr_Format(PyExc_ValueError, "span %zd: %zd bytes at %p is not whole %zu-byte elements",
                         i, nbytes, (void *)address, width);
            goto done;
        }
        job.address[i] = (const unsigned char *)address;
        job.elements[i] = (size_t)nbytes / width;
        job.total += job.elements[i];
    }
    run_job(&job, threads);
    found = PyList_New(0);
    for (Py_ssize_t i = 0; found != NULL && i < count; i++) {
        if (!job.found[i]) continue;
        PyObject *index = PyLong_FromSsize_t(i);
        if (index == NULL || PyList_Append(found, index) < 0) Py_CLEAR(found);
        Py_XDECREF(index);
    }
done:
    PyMem_Free(job.address);
    PyMem_Free(job.elements);
    PyMem_Free(job.found);
    return found;
}

/* use_openmp(library) -> whether the scan can split across the OpenMP team of that loaded library.
 * The caller passes torch's own extension (torch._C): symbols are looked up in it and the
 * libraries it loaded, so the scan joins the runtime and thread pool torch's kernels use and
 * never loads a second one (RTLD_NOLOAD). Without one, scans run on the calling thread. */
static PyObject *use_openmp(PyObject *self, PyObject *arg) {
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
#ifdef HAVE_DLFCN
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (library != NULL) {
        ParallelFn parallel = (ParallelFn)dlsym(library, "GOMP_parallel");
        ThreadFn thread_num = (ThreadFn)dlsym(library, "omp_get_thread_num");
        ThreadFn num_threads = (ThreadFn)dlsym(library, "omp_get_num_threads");
        if (parallel != NULL && thread_num != NULL && num_threads != NULL) {
            omp_thread_num = thread_num;
            omp_num_threads = num_threads;
            omp_parallel = parallel;
            Py_RETURN_TRUE;  /* the handle stays open: the library must outlive the pointers */
        }
        dlclose(library);
    }
#endif
    Py_RETURN_FALSE;
}

/* What span_of accepts (see configure): tensors of exactly torch.Tensor's type (a subclass such as
 * DTensor keeps its data elsewhere), strided, of a dtype in `formats` (dtype -> (format, itemsize)). */
static PyObject *tensor_type, *strided, *formats;
static PyObject *s_grad, *s_dtype, *s_is_cpu, *s_layout, *s_is_contiguous, *s_nbytes, *s_storage_offset,
    *s_untyped_storage, *s_data_ptr, *s_post_accumulate_grad_hooks, *s_cdata;

/* A dense CPU tensor that may be read raw: where, how long, and in which scan format. */
typedef struct {
    const unsigned char *address; /* NULL where not held */
    size_t nbytes;
    int held; /* 0 where its storage no longer holds all of it: nothing may read it */
    int format;
    size_t itemsize;
} Span;

/* Torch's stable C shim: the aoti_torch_* functions that AOTInductor's compiled models call, which
 * torch keeps stable across releases. Their handle is an at::Tensor*, and an at::Tensor is one
 * pointer to its TensorImpl, which a tensor's `_cdata` gives. A fact costs a short C call this
 * way, against a call into torch's Python bindings, whose code is cold in the middle of a pass:
 * per 8 big gradients of the benchmark model, 110-130 us against 185-200 us. That layout is not
 * a promise, so the probe enables the shim only once it gave the same spans as the bindings for
 * a set of sample tensors (use_torch_shim). */
#define SHIM_DTYPES 64 /* c10::ScalarType codes below this; torch 2.13 has 45 */
typedef int32_t (*ShimInt32)(void *, int32_t *);
typedef int32_t (*ShimInt64)(void *, int64_t *);
typedef int32_t (*ShimPointer)(void *, void **);
typedef int32_t (*ShimBool)(void *, bool *);
typedef int32_t (*ShimConstant)(void);
static struct {
    ShimInt32 dtype, device_type, layout;
    ShimInt64 numel, storage_offset, storage_size;
    ShimPointer data_ptr;
    ShimBool is_contiguous;
    int32_t cpu, strided;
    void *library;                  /* where they were found */
    int found;                      /* every function above resolved */
    int enabled;                    /* span_of reads through them */
    signed char format[SHIM_DTYPES]; /* by scalar type code: the scan format, or -1 */
    size_t itemsize[SHIM_DTYPES];
} shim;

/* 1 and the span for a plain dense CPU tensor of a scan dtype (not held where its storage no longer
 * holds all of it: FSDP frees the storage under views of it, and a view keeps its old address);
 * 0 for any other tensor, and where a shim call failed (torch logs why; the caller then reads the
 * tensor another way); -1 with an exception set where torch raised. */
static int span_by_shim(PyObject *tensor, Span *span) {
    PyObject *cdata = PyObject_GetAttr(tensor, s_cdata);
    if (cdata == NULL) return -1;
    void *impl = PyLong_AsVoidPtr(cdata); /* the tensor object keeps it alive */
    Py_DECREF(cdata);
    if (impl == NULL) return PyErr_Occurred() ? -1 : 0;
    void *handle = &impl;
    int32_t dtype, device, layout;
    int64_t numel, offset, held;
    bool contiguous;
    if (shim.dtype(handle, &dtype) || shim.device_type(handle, &device) || shim.layout(handle, &layout)) return 0;
    if (dtype < 0 || dtype >= SHIM_DTYPES || shim.format[dtype] < 0 || device != shim.cpu || layout != shim.strided)
        return 0;
    if (shim.is_contiguous(handle, &contiguous) || !contiguous) return 0;
    if (shim.numel(handle, &numel) || shim.storage_offset(handle, &offset) || shim.storage_size(handle, &held))
        return 0;
    span->format = shim.format[dtype];
    span->itemsize = shim.itemsize[dtype];
    span->nbytes = numel > 0 ? (size_t)numel * span->itemsize : 0;
    span->address = NULL;
    span->held = numel >= 0 && offset >= 0 && held >= 0 && (size_t)offset * span->itemsize + span->nbytes <= (size_t)held;
    void *data = NULL;
    if (span->held && shim.data_ptr(handle, &data)) return 0;
    span->address = data;
    return 1;
}

static int span_by_bindings(PyObject *tensor, Span *span) {
    int ok = -1;
    PyObject *dtype = NULL, *is_cpu = NULL, *layout = NULL, *contiguous = NULL, *size = NULL, *offset = NULL,
             *storage = NULL, *held = NULL, *pointer = NULL;
    if ((dtype = PyObject_GetAttr(tensor, s_dtype)) == NULL) goto done;
    PyObject *spec = PyDict_GetItemWithError(formats, dtype); /* borrowed: (format, itemsize) */
    Py_ssize_t itemsize;
    if (spec == NULL) {
        ok = PyErr_Occurred() ? -1 : 0;
        goto done;
    }
    if (!PyArg_ParseTuple(spec, "in", &span->format, &itemsize)) goto done;
    if (span->format < F16 || span->format > F64 || itemsize <= 0 || (size_t)itemsize % WIDTH[span->format]) {
        PyErr_Format(PyExc_ValueError, "format %d with %zd-byte elements", span->format, itemsize);
        goto done;
    }
    span->itemsize = (size_t)itemsize;
    ok = 0;
    if ((is_cpu = PyObject_GetAttr(tensor, s_is_cpu)) == NULL) goto fail;
    if (is_cpu != Py_True) goto done;
    if ((layout = PyObject_GetAttr(tensor, s_layout)) == NULL) goto fail;
    if (layout != strided) goto done;
    if ((contiguous = PyObject_CallMethodNoArgs(tensor, s_is_contiguous)) == NULL) goto fail;
    if (contiguous != Py_True) goto done;
    if ((size = PyObject_GetAttr(tensor, s_nbytes)) == NULL ||
        (offset = PyObject_CallMethodNoArgs(tensor, s_storage_offset)) == NULL ||
        (storage = PyObject_CallMethodNoArgs(tensor, s_untyped_storage)) == NULL ||
        (held = PyObject_CallMethodNoArgs(storage, s_nbytes)) == NULL ||
        (pointer = PyObject_CallMethodNoArgs(tensor, s_data_ptr)) == NULL)
        goto fail;
    Py_ssize_t n = PyLong_AsSsize_t(size), first = PyLong_AsSsize_t(offset), capacity = PyLong_AsSsize_t(held);
    const unsigned char *data = PyLong_AsVoidPtr(pointer);
    if (PyErr_Occurred()) goto fail;
    span->nbytes = n > 0 ? (size_t)n : 0;
    span->held = n >= 0 && first >= 0 && capacity >= 0 && (size_t)first * span->itemsize + span->nbytes <= (size_t)capacity;
    span->address = span->held ? data : NULL;
    ok = 1;
    goto done;
fail:
    ok = -1;
done:
    Py_XDECREF(dtype);
    Py_XDECREF(is_cpu);
    Py_XDECREF(layout);
    Py_XDECREF(contiguous);
    Py_XDECREF(size);
    Py_XDECREF(offset);
    Py_XDECREF(storage);
    Py_XDECREF(held);
    Py_XDECREF(pointer);
    return ok;
}

static int span_of(PyObject *tensor, Span *span) {
    if (tensor_type == NULL || (PyObject *)Py_TYPE(tensor) != tensor_type) return 0;
    return shim.enabled ? span_by_shim(tensor, span) : span_by_bindings(tensor, span);
}

/* configure(tensor_type, strided, formats): what span_of accepts; the probe passes torch.Tensor,
 * torch.strided and its table of scan formats by dtype. */
static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *type, *layout, *table;
    if (!PyArg_ParseTuple(args, "O!OO!", &PyType_Type, &type, &layout, &PyDict_Type, &table)) return NULL;
    Py_INCREF(type);
    Py_INCREF(layout);
    Py_INCREF(table);
    Py_XSETREF(tensor_type, type);
    Py_XSETREF(strided, layout);
    Py_XSETREF(formats, table);
    Py_RETURN_NONE;
}

/* find_torch_shim(library) -> whether torch's C shim is in that loaded library or those it loaded
 * (the probe passes torch._C's file); it is not used before use_torch_shim. */
static PyObject *find_torch_shim(PyObject *self, PyObject *arg) {
    (void)self;
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    shim.enabled = shim.found = 0;
#ifdef HAVE_DLFCN
    void *library = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (library == NULL) Py_RETURN_FALSE;
    shim.dtype = (ShimInt32)dlsym(library, "aoti_torch_get_dtype");
    shim.device_type = (ShimInt32)dlsym(library, "aoti_torch_get_device_type");
    shim.layout = (ShimInt32)dlsym(library, "aoti_torch_get_layout");
    shim.numel = (ShimInt64)dlsym(library, "aoti_torch_get_numel");
    shim.storage_offset = (ShimInt64)dlsym(library, "aoti_torch_get_storage_offset");
    shim.storage_size = (ShimInt64)dlsym(library, "aoti_torch_get_storage_size");
    shim.data_ptr = (ShimPointer)dlsym(library, "aoti_torch_get_data_ptr");
    shim.is_contiguous = (ShimBool)dlsym(library, "aoti_torch_is_contiguous");
    ShimConstant cpu = (ShimConstant)dlsym(library, "aoti_torch_device_type_cpu");
    ShimConstant layout_strided = (ShimConstant)dlsym(library, "aoti_torch_layout_strided");
    if (shim.dtype && shim.device_type && shim.layout && shim.numel && shim.storage_offset && shim.storage_size &&
        shim.data_ptr && shim.is_contiguous && cpu && layout_strided) {
        shim.cpu = cpu();
        shim.strided = layout_strided();
        shim.library = library;
        shim.found = 1;
        Py_RETURN_TRUE;  /* the handle stays open: the library must outlive the pointers */
    }
    dlclose(library);
#endif
    Py_RETURN_FALSE;
}

/* shim_dtype(name) -> the c10::ScalarType code of a dtype ("float32"), by the shim's own constants. */
static PyObject *shim_dtype(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    char symbol[64];
    ShimConstant constant = NULL;
#ifdef HAVE_DLFCN
    if (shim.found && strspn(name, "abcdefghijklmnopqrstuvwxyz0123456789_") == strlen(name) &&
        snprintf(symbol, sizeof(symbol), "aoti_torch_dtype_%s", name) < (int)sizeof(symbol))
        constant = (ShimConstant)dlsym(shim.library, symbol);
#endif
    if (constant == NULL) {
        PyErr_Format(PyExc_RuntimeError, "torch's C shim has no dtype %R", arg);
        return NULL;
    }
    return PyLong_FromLong(constant());
}

/* use_torch_shim(codes) reads spans through the shim from now on, with `codes` (scalar type code ->
 * (format, itemsize)) for the scan dtypes; use_torch_shim(None) goes back to the bindings. */
static PyObject *use_torch_shim(PyObject *self, PyObject *codes) {
    (void)self;
    if (codes == Py_None) {
        shim.enabled = 0;
        Py_RETURN_NONE;
    }
    if (!shim.found || !PyDict_Check(codes)) {
        PyErr_SetString(PyExc_RuntimeError, "use_torch_shim needs the shim found and a dict of codes");
        return NULL;
    }
    signed char format[SHIM_DTYPES];
    size_t itemsize[SHIM_DTYPES];
    memset(format, -1, sizeof(format));
    memset(itemsize, 0, sizeof(itemsize));
    PyObject *key, *value;
    Py_ssize_t position = 0;
    while (PyDict_Next(codes, &position, &key, &value)) {
        long code = PyLong_AsLong(key);
        int f;
        Py_ssize_t size;
        if (code == -1 && PyErr_Occurred()) return NULL;
        if (!PyArg_ParseTuple(value, "in", &f, &size)) return NULL;
        if (code < 0 || code >= SHIM_DTYPES || f < F16 || f > F64 || size <= 0 || (size_t)size % WIDTH[f]) {
            PyErr_Format(PyExc_ValueError, "scalar type %ld: format %d with %zd-byte elements", code, f, size);
            return NULL;
        }
        format[code] = (signed char)f;
        itemsize[code] = (size_t)size;
    }
    memcpy(shim.format, format, sizeof(format));
    memcpy(shim.itemsize, itemsize, sizeof(itemsize));
    shim.enabled = 1;
    Py_RETURN_NONE;
}

/* dense_span(tensor) -> (format, address, nbytes, held) for a plain dense CPU tensor of a scan dtype,
 * else None; held is False (and the address 0) where its storage no longer holds it, and then
 * nothing may read it. */
static PyObject *dense_span(PyObject *self, PyObject *tensor) {
    (void)self;
    Span span;
    int ok = span_of(tensor, &span);
    if (ok < 0) return NULL;
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(iNnO)", span.format, PyLong_FromVoidPtr((void *)span.address), (Py_ssize_t)span.nbytes,
                         span.held ? Py_True : Py_False);
}

/* The parameter a weak reference points to (a new reference), or NULL (no exception) once it died. */
static PyObject *referent(PyObject *ref) {
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *object = NULL;
    return PyWeakref_GetRef(ref, &object) == 1 ? object : NULL;
#else
    PyObject *object = PyWeakref_GetObject(ref);
    if (object == Py_None) return NULL;
    Py_INCREF(object);
    return object;
#endif
}

/* What `check` does with one parameter. */
enum { SKIP, ANSWERED_FINITE, ANSWERED_NONFINITE, SCAN, LEFT };

/* A hook's answer for this parameter's gradient, or LEFT where none can be used: no answer, an
 * answer about another tensor, or other post-accumulate hooks beside ours (the caller then knows
 * whether ours ran last). -1 with an exception set where torch raised. */
static int hook_answer(PyObject *answers, PyObject *param, PyObject *grad) {
    PyObject *key = PyLong_FromVoidPtr(param);
    if (key == NULL) return -1;
    PyObject *answer = PyDict_GetItemWithError(answers, key); /* borrowed */
    Py_DECREF(key);
    if (answer == NULL) return PyErr_Occurred() ? -1 : LEFT;
    if (!PyTuple_Check(answer) || PyTuple_GET_SIZE(answer) != 2 || PyTuple_GET_ITEM(answer, 0) != grad) return LEFT;
    int found = PyTuple_GET_ITEM(answer, 1) == Py_True;
    PyObject *hooks = PyObject_GetAttr(param, s_post_accumulate_grad_hooks);
    if (hooks == NULL) return -1;
    Py_ssize_t count = hooks == Py_None ? 0 : PyObject_Length(hooks);
    Py_DECREF(hooks);
    if (count < 0) return -1;
    return count > 1 ? LEFT : found ? ANSWERED_NONFINITE : ANSWERED_FINITE;
}

/* What to do with one parameter's gradient; for SCAN, its span, and the gradient itself in *held
 * (a new reference: a raw read needs the tensor alive until it is done). */
static int classify(PyObject *param, PyObject *answers, Span *span, PyObject **held) {
    PyObject *grad = PyObject_GetAttr(param, s_grad);
    if (grad == NULL) return -1;
    int what = SKIP;
    if (grad != Py_None && (!PyDict_GET_SIZE(answers) || (what = hook_answer(answers, param, grad)) == LEFT)) {
        int ok = span_of(grad, span);
        /* Not held: the storage no longer holds the gradient (FSDP freed it), nothing to read. */
        what = ok < 0 ? -1 : ok == 0 ? LEFT : span->held ? SCAN : SKIP;
    }
    if (what == SCAN)
        *held = grad;
    else
        Py_DECREF(grad);
    return what;
}

/* check(refs, answers, threads=1) -> (checked, nonfinite, left): the end-of-pass check of the
 * parameters behind `refs` (weak references) in one call, for the probe's GradCheck.launch. A
 * gradient a hook scanned this pass (answers[id(param)] holds that very tensor) is answered from
 * there; one span_of accepts is scanned, across `threads` as `nonfinite` does, unless its storage
 * no longer holds it (skipped, as are dead parameters and those without a gradient). Every other
 * parameter is left to the caller: gradients this module may not read raw, and answered ones with
 * other post-accumulate hooks beside the hook (the caller knows whether the hook ran last).
 * `checked` counts the gradients answered or scanned; `nonfinite` and `left` are indices into refs,
 * in order. */
static PyObject *check(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *refs, *answers;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O!O!|i", &PyList_Type, &refs, &PyDict_Type, &answers, &threads)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(refs);
    size_t slots = (size_t)count + 1;
    /* Per format, the spans to scan (up to count each) and the index in refs of each. */
    const unsigned char **address = PyMem_Calloc(4 * slots, sizeof(*address));
    size_t *elements = PyMem_Calloc(4 * slots, sizeof(*elements));
    Py_ssize_t *index = PyMem_Calloc(4 * slots, sizeof(*index));
    PyObject **held = PyMem_Calloc(slots, sizeof(*held)); /* the gradients to scan, kept alive */
    unsigned char *found = PyMem_Calloc(4 * slots, 1), *verdict = PyMem_Calloc(slots, 1);
    Job jobs[4];
    for (int f = F16; f <= F64; f++)
        jobs[f] = (Job){f, 0, address + f * slots, elements + f * slots, 0, found + f * slots, 1};
    PyObject *result = NULL, *nonfinite = NULL, *left = NULL;
    Py_ssize_t checked = 0;
    if (address == NULL || elements == NULL || index == NULL || held == NULL || found == NULL || verdict == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *ref = PyList_GET_ITEM(refs, i);
        if (!PyWeakref_Check(ref)) {
            PyErr_Format(PyExc_TypeError, "refs[%zd] is not a weak reference", i);
            goto done;
        }
        PyObject *param = referent(ref);
        if (param == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        Span span;
        int what = classify(param, answers, &span, &held[i]);
        Py_DECREF(param);
        if (what < 0) goto done;
        verdict[i] = (unsigned char)what;
        if (what == SCAN) {
            Job *job = &jobs[span.format];
            job->address[job->count] = span.address;
            job->elements[job->count] = span.nbytes / WIDTH[span.format];
            job->total += job->elements[job->count];
            index[(size_t)span.format * slots + (size_t)job->count++] = i;
        }
    }
    for (int f = F16; f <= F64; f++) {
        if (jobs[f].count == 0) continue;
        run_job(&jobs[f], threads);
        for (Py_ssize_t k = 0; k < jobs[f].count; k++)
            if (jobs[f].found[k]) verdict[index[(size_t)f * slots + (size_t)k]] = ANSWERED_NONFINITE;
    }
    if ((nonfinite = PyList_New(0)) == NULL || (left = PyList_New(0)) == NULL) goto done;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *list = verdict[i] == ANSWERED_NONFINITE ? nonfinite : verdict[i] == LEFT ? left : NULL;
        checked += verdict[i] == ANSWERED_FINITE || verdict[i] == ANSWERED_NONFINITE || verdict[i] == SCAN;
        if (list == NULL) continue;
        PyObject *position = PyLong_FromSsize_t(i);
        int failed = position == NULL || PyList_Append(list, position) < 0;
        Py_XDECREF(position);
        if (failed) goto done;
    }
    result = Py_BuildValue("(nOO)", checked, nonfinite, left);
done:
    Py_XDECREF(nonfinite);
    Py_XDECREF(left);
    PyMem_Free(address);
    PyMem_Free(elements);
    PyMem_Free(index);
    for (Py_ssize_t i = 0; held != NULL && i < count; i++) Py_XDECREF(held[i]);
    PyMem_Free(held);
    PyMem_Free(found);
    PyMem_Free(verdict);
    return result;
}

/* A post-accumulate-grad hook for parameters of one scan format and element size (which tell the
 * scan dtypes apart). While armed, it scans the gradient the engine has just accumulated and
 * stores answers[id(parameter)] = (gradient, holds NaN/Inf). It never raises into the engine (that
 * would fail the job's backward pass): a gradient it cannot read is left to the end of the pass. */
typedef struct {
    PyObject_HEAD
    int format;
    Py_ssize_t itemsize;
    PyObject *answers;
    int armed;
    int threads;
    int clock;       /* for benchmarks: 0 off, 1 thread CPU time, 2 wall clock */
    double seconds;  /* spent scanning while armed, by that clock */
} Hook;

static double now(int clock) {
    struct timespec t;
#ifdef CLOCK_THREAD_CPUTIME_ID
    clock_gettime(clock == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_MONOTONIC, &t);
#else
    (void)clock;
    clock_gettime(CLOCK_MONOTONIC, &t);
#endif
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static int hook_scan(Hook *self, PyObject *param) {
    PyObject *grad = PyObject_GetAttr(param, s_grad);
    if (grad == NULL) return -1;
    Span span;
    /* A model cast in place (`model.half()`) keeps its Parameter objects and hooks. */
    int ok = grad == Py_None ? 0 : span_of(grad, &span);
    if (ok == 1 && span.held && span.format == self->format && span.itemsize == (size_t)self->itemsize) {
        size_t elements = span.nbytes / WIDTH[self->format];
        unsigned char found = 0;
        Job job = {self->format, 1, &span.address, &elements, elements, &found, 1};
        run_job(&job, self->threads);
        PyObject *key = PyLong_FromVoidPtr(param);
        PyObject *answer = Py_BuildValue("(OO)", grad, found ? Py_True : Py_False);
        ok = key != NULL && answer != NULL && PyDict_SetItem(self->answers, key, answer) == 0 ? 1 : -1;
        Py_XDECREF(key);
        Py_XDECREF(answer);
    }
    Py_DECREF(grad);
    return ok;
}

static PyObject *Hook_call(Hook *self, PyObject *args, PyObject *kwargs) {
    PyObject *param;
    if (!PyArg_UnpackTuple(args, "Hook", 1, 1, &param)) return NULL;
    (void)kwargs;
    if (!self->armed) Py_RETURN_NONE;
    double start = self->clock ? now(self->clock) : 0.0;
    if (hook_scan(self, param) < 0) PyErr_Clear();
    if (self->clock) self->seconds += now(self->clock) - start;
    Py_RETURN_NONE;
}

static int Hook_init(Hook *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"format", "itemsize", "answers", NULL};
    int format;
    Py_ssize_t itemsize;
    PyObject *answers;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "inO!", keywords, &format, &itemsize, &PyDict_Type, &answers))
        return -1;
    if (format < F16 || format > F64 || itemsize <= 0 || (size_t)itemsize % WIDTH[format]) {
        PyErr_Format(PyExc_ValueError, "format %d with %zd-byte elements", format, itemsize);
        return -1;
    }
    self->format = format;
    self->itemsize = itemsize;
    Py_INCREF(answers);
    Py_XSETREF(self->answers, answers);
    self->threads = 1;
    return 0;
}

static int Hook_traverse(Hook *self, visitproc visit, void *arg) {
    Py_VISIT(self->answers);
    return 0;
}

static int Hook_clear(Hook *self) {
    Py_CLEAR(self->answers);
    return 0;
}

static void Hook_dealloc(Hook *self) {
    PyObject_GC_UnTrack(self);
    Hook_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Hook_members[] = {
    {"armed", T_INT, offsetof(Hook, armed), 0, "scan while nonzero (the probe arms it for one pass)"},
    {"threads", T_INT, offsetof(Hook, threads), 0, "threads of the OpenMP team a scan may use"},
    {"clock", T_INT, offsetof(Hook, clock), 0, "for benchmarks: 0 off, 1 thread CPU time, 2 wall clock"},
    {"seconds", T_DOUBLE, offsetof(Hook, seconds), 0, "time spent while armed, by that clock"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchpulse.probes._gradscan.Hook",
    .tp_basicsize = sizeof(Hook),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Hook(format, itemsize, answers): scans each gradient as it is accumulated",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Hook_init,
    .tp_call = (ternaryfunc)Hook_call,
    .tp_traverse = (traverseproc)Hook_traverse,
    .tp_clear = (inquiry)Hook_clear,
    .tp_dealloc = (destructor)Hook_dealloc,
    .tp_members = Hook_members,
};

static PyObject *last_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(last_team);
}

static PyObject *torch_shim_enabled(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(shim.enabled);
}

static PyMethodDef methods[] = {
    {"nonfinite", nonfinite, METH_VARARGS,
     "nonfinite(format, addresses, nbytes, threads=1) -> indices of the spans holding a NaN or an Inf"},
    {"use_openmp", use_openmp, METH_O,
     "use_openmp(library_path) -> whether scans can split across that loaded library's OpenMP team"},
    {"last_threads", last_threads, METH_NOARGS, "last_threads() -> how many threads ran the last scan"},
    {"configure", configure, METH_VARARGS,
     "configure(tensor_type, strided, formats): the tensors dense_span accepts, and their scan formats by dtype"},
    {"find_torch_shim", find_torch_shim, METH_O,
     "find_torch_shim(library_path) -> whether torch's C shim is there (not used before use_torch_shim)"},
    {"shim_dtype", shim_dtype, METH_O, "shim_dtype(name) -> the c10::ScalarType code of that dtype, by torch's C shim"},
    {"use_torch_shim", use_torch_shim, METH_O,
     "use_torch_shim(codes) reads spans through torch's C shim (codes: scalar type -> (format, itemsize)); None: not"},
    {"torch_shim_enabled", torch_shim_enabled, METH_NOARGS, "torch_shim_enabled() -> whether spans are read so"},
    {"dense_span", dense_span, METH_O,
     "dense_span(tensor) -> (format, address, nbytes, held) for a plain dense CPU tensor of a scan dtype, else None"},
    {"check", check, METH_VARARGS,
     "check(refs, answers, threads=1) -> (checked, nonfinite, left): the end-of-pass check in one call"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gradscan", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

static int intern(PyObject **name, const char *text) { return (*name = PyUnicode_InternFromString(text)) ? 0 : -1; }

PyMODINIT_FUNC PyInit__gradscan(void) {
    if (intern(&s_grad, "grad") || intern(&s_dtype, "dtype") || intern(&s_is_cpu, "is_cpu") ||
        intern(&s_layout, "layout") || intern(&s_is_contiguous, "is_contiguous") || intern(&s_nbytes, "nbytes") ||
        intern(&s_storage_offset, "storage_offset") || intern(&s_untyped_storage, "untyped_storage") ||
        intern(&s_data_ptr, "data_ptr") || intern(&s_post_accumulate_grad_hooks, "_post_accumulate_grad_hooks") ||
        intern(&s_cdata, "_cdata") || PyType_Ready(&HookType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&HookType);
    if (PyModule_AddObject(m, "Hook", (PyObject *)&HookType) < 0) {
        Py_DECREF(&HookType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
