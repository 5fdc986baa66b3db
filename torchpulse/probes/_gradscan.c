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
#include <stdint.h>
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

/* torch.Tensor and torch.strided (see configure): only tensors of exactly that type and layout
 * are read raw, since a subclass such as DTensor keeps its data elsewhere. */
static PyObject *tensor_type, *strided;
static PyObject *s_grad, *s_dtype, *s_is_cpu, *s_layout, *s_is_contiguous, *s_nbytes, *s_storage_offset,
    *s_untyped_storage, *s_data_ptr;

/* 1 with the span when `tensor` is a plain contiguous CPU tensor whose storage still holds all of
 * it; 2 when its storage no longer does (FSDP frees the storage under views of it, and a view
 * keeps its old address: nothing may read it); 0 for any other tensor; -1 with an exception set
 * when torch raised. */
static int span_of(PyObject *tensor, size_t itemsize, const unsigned char **address, size_t *nbytes) {
    if (tensor_type == NULL || (PyObject *)Py_TYPE(tensor) != tensor_type) return 0;
    int ok = 0;
    PyObject *is_cpu = NULL, *layout = NULL, *contiguous = NULL, *size = NULL, *offset = NULL,
             *storage = NULL, *held = NULL, *pointer = NULL;
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
    *address = data;
    *nbytes = n > 0 ? (size_t)n : 0;
    ok = n >= 0 && first >= 0 && capacity >= 0 && (size_t)first * itemsize + (size_t)n <= (size_t)capacity ? 1 : 2;
    goto done;
fail:
    ok = -1;
done:
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

/* configure(tensor_type, strided): what span_of accepts; the probe passes torch.Tensor, torch.strided. */
static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *type, *layout;
    if (!PyArg_ParseTuple(args, "O!O", &PyType_Type, &type, &layout)) return NULL;
    Py_INCREF(type);
    Py_INCREF(layout);
    Py_XSETREF(tensor_type, type);
    Py_XSETREF(strided, layout);
    Py_RETURN_NONE;
}

/* dense_span(tensor, itemsize) -> (address, nbytes, held) for a plain contiguous CPU tensor, else None;
 * held is False where its storage no longer holds it, and then nothing may read it. */
static PyObject *dense_span(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *tensor;
    Py_ssize_t itemsize;
    if (!PyArg_ParseTuple(args, "On", &tensor, &itemsize)) return NULL;
    if (itemsize <= 0) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be positive");
        return NULL;
    }
    const unsigned char *address;
    size_t nbytes;
    int ok = span_of(tensor, (size_t)itemsize, &address, &nbytes);
    if (ok < 0) return NULL;
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(NnO)", PyLong_FromVoidPtr((void *)address), (Py_ssize_t)nbytes,
                         ok == 1 ? Py_True : Py_False);
}

/* A post-accumulate-grad hook for parameters of one dtype. While armed, it scans the gradient
 * the engine has just accumulated and stores answers[id(parameter)] = (gradient, holds NaN/Inf).
 * It never raises into the engine (that would fail the job's backward pass): a gradient it
 * cannot read is left to the probe's scan at the end of the pass. */
typedef struct {
    PyObject_HEAD
    int format;
    Py_ssize_t itemsize;
    PyObject *dtype;
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
    PyObject *grad = PyObject_GetAttr(param, s_grad), *dtype = NULL;
    int ok = -1;
    if (grad == NULL) return -1;
    if (grad == Py_None) {
        ok = 0;
        goto done;
    }
    if ((dtype = PyObject_GetAttr(grad, s_dtype)) == NULL) goto done;
    const unsigned char *address;
    size_t nbytes;
    /* A model cast in place (`model.half()`) keeps its Parameter objects and hooks. */
    ok = dtype == self->dtype ? span_of(grad, (size_t)self->itemsize, &address, &nbytes) : 0;
    if (ok != 1) {
        ok = ok < 0 ? -1 : 0;
        goto done;
    }
    size_t elements = nbytes / WIDTH[self->format];
    unsigned char found = 0;
    Job job = {self->format, 1, &address, &elements, elements, &found, 1};
    run_job(&job, self->threads);
    PyObject *key = PyLong_FromVoidPtr(param);
    PyObject *answer = Py_BuildValue("(OO)", grad, found ? Py_True : Py_False);
    ok = key != NULL && answer != NULL && PyDict_SetItem(self->answers, key, answer) == 0 ? 1 : -1;
    Py_XDECREF(key);
    Py_XDECREF(answer);
done:
    Py_XDECREF(dtype);
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
    static char *keywords[] = {"format", "itemsize", "dtype", "answers", NULL};
    int format;
    Py_ssize_t itemsize;
    PyObject *dtype, *answers;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "inOO!", keywords, &format, &itemsize, &dtype,
                                     &PyDict_Type, &answers))
        return -1;
    if (format < F16 || format > F64 || itemsize <= 0 || (size_t)itemsize % WIDTH[format]) {
        PyErr_Format(PyExc_ValueError, "format %d with %zd-byte elements", format, itemsize);
        return -1;
    }
    self->format = format;
    self->itemsize = itemsize;
    Py_INCREF(dtype);
    Py_INCREF(answers);
    Py_XSETREF(self->dtype, dtype);
    Py_XSETREF(self->answers, answers);
    self->threads = 1;
    return 0;
}

static int Hook_traverse(Hook *self, visitproc visit, void *arg) {
    Py_VISIT(self->dtype);
    Py_VISIT(self->answers);
    return 0;
}

static int Hook_clear(Hook *self) {
    Py_CLEAR(self->dtype);
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
    .tp_doc = "Hook(format, itemsize, dtype, answers): scans each gradient as it is accumulated",
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

static PyMethodDef methods[] = {
    {"nonfinite", nonfinite, METH_VARARGS,
     "nonfinite(format, addresses, nbytes, threads=1) -> indices of the spans holding a NaN or an Inf"},
    {"use_openmp", use_openmp, METH_O,
     "use_openmp(library_path) -> whether scans can split across that loaded library's OpenMP team"},
    {"last_threads", last_threads, METH_NOARGS, "last_threads() -> how many threads ran the last scan"},
    {"configure", configure, METH_VARARGS, "configure(tensor_type, strided): the tensors dense_span accepts"},
    {"dense_span", dense_span, METH_VARARGS,
     "dense_span(tensor, itemsize) -> (address, nbytes, held) for a plain contiguous CPU tensor, else None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gradscan", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

static int intern(PyObject **name, const char *text) { return (*name = PyUnicode_InternFromString(text)) ? 0 : -1; }

PyMODINIT_FUNC PyInit__gradscan(void) {
    if (intern(&s_grad, "grad") || intern(&s_dtype, "dtype") || intern(&s_is_cpu, "is_cpu") ||
        intern(&s_layout, "layout") || intern(&s_is_contiguous, "is_contiguous") || intern(&s_nbytes, "nbytes") ||
        intern(&s_storage_offset, "storage_offset") || intern(&s_untyped_storage, "untyped_storage") ||
        intern(&s_data_ptr, "data_ptr") || PyType_Ready(&HookType) < 0)
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
