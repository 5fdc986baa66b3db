/* Which CPU gradients hold a NaN or an Inf (torchpulse.probes._gradscan: the scan).
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
 */
#include "_gradscan.h"
#include <stdint.h>
#include <string.h>

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

/* Bytes per element of each format. */
const size_t WIDTH[4] = {2, 2, 4, 8};

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

void run_job(Job *job, int threads) {
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
PyObject *nonfinite(PyObject *self, PyObject *args) {
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
PyObject *use_openmp(PyObject *self, PyObject *arg) {
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

PyObject *last_threads(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromLong(last_team);
}
