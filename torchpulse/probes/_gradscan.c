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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

/* Format codes, as torchpulse.probes.autograd_nonfinite._SCAN_FORMATS names them. */
enum { F16 = 0, BF16 = 1, F32 = 2, F64 = 3 };
static const size_t WIDTH[] = {2, 2, 4, 8};

/* nonfinite(format, addresses, nbytes) -> list of the indices whose span holds a NaN or Inf.
 * Raises ValueError for an unknown format, a length that is not whole elements or a span
 * without an address: the caller's checks decide what is scanned, and a mistake there
 * must not turn into a wrong answer. */
static PyObject *nonfinite(PyObject *self, PyObject *args) {
    (void)self;
    int format;
    PyObject *addresses, *lengths;
    if (!PyArg_ParseTuple(args, "iO!O!", &format, &PyList_Type, &addresses, &PyList_Type, &lengths))
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
    PyObject *found = PyList_New(0);
    if (found == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        uintptr_t address = (uintptr_t)PyLong_AsVoidPtr(PyList_GET_ITEM(addresses, i));
        Py_ssize_t nbytes = PyLong_AsSsize_t(PyList_GET_ITEM(lengths, i));
        if (PyErr_Occurred()) goto fail;
        if (nbytes < 0 || (size_t)nbytes % width || (nbytes && address == 0)) {
            PyErr_Format(PyExc_ValueError, "span %zd: %zd bytes at %p is not whole %zu-byte elements",
                         i, nbytes, (void *)address, width);
            goto fail;
        }
        size_t n = (size_t)nbytes / width;
        int bad;
        const unsigned char *bytes = (const unsigned char *)address;
        switch (format) {
        case F16: bad = scan_f16(bytes, n); break;
        case BF16: bad = scan_bf16(bytes, n); break;
        case F32: bad = scan_f32(bytes, n); break;
        default: bad = scan_f64(bytes, n); break;
        }
        if (bad) {
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL || PyList_Append(found, index) < 0) {
                Py_XDECREF(index);
                goto fail;
            }
            Py_DECREF(index);
        }
    }
    return found;
fail:
    Py_DECREF(found);
    return NULL;
}

static PyMethodDef methods[] = {
    {"nonfinite", nonfinite, METH_VARARGS,
     "nonfinite(format, addresses, nbytes) -> indices of the spans holding a NaN or an Inf"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_gradscan", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__gradscan(void) { return PyModule_Create(&module); }
