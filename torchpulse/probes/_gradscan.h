/* What the units of torchpulse.probes._gradscan share: _gradscan_scan.c scans spans for NaN and
 * Inf, _gradscan_span.c decides which tensors may be read raw and where they lie,
 * _gradscan_answers.c keeps what the hooks found, and _gradscan.c has the end-of-pass check, the
 * post-accumulate-grad hook and the module itself. */
#ifndef TORCHPULSE_GRADSCAN_H
#define TORCHPULSE_GRADSCAN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

/* Shared between the units only: never exported from the module's shared object. */
#if defined(__GNUC__)
#define INTERNAL __attribute__((visibility("hidden")))
#else
#define INTERNAL
#endif

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#define HAVE_DLFCN 1
#endif

/* Format codes, as torchpulse.probes.autograd_nonfinite._SCAN_FORMATS names them. */
enum { F16 = 0, BF16 = 1, F32 = 2, F64 = 3 };
INTERNAL extern const size_t WIDTH[4];

typedef struct {
    int format;
    Py_ssize_t count;
    const unsigned char **address;
    size_t *elements;
    size_t total;          /* elements in all spans */
    unsigned char *found;  /* per span: 1 once any part of it holds a NaN or Inf */
    int team;              /* threads that ran the scan */
} Job;

/* Scan the job's spans: across `threads` of the OpenMP team where that pays, else on this thread. */
INTERNAL void run_job(Job *job, int threads);

/* A dense CPU tensor that may be read raw: where, how long, and in which scan format. */
typedef struct {
    const unsigned char *address; /* NULL where not held */
    size_t nbytes;
    int held; /* 0 where its storage no longer holds all of it: nothing may read it */
    int format;
    size_t itemsize;
} Span;

/* 1 and the span for a plain dense CPU tensor of a scan dtype (see _gradscan_span.c), 0 for any
 * other tensor, -1 with an exception set where torch raised. */
INTERNAL int span_of(PyObject *tensor, Span *span);
INTERNAL int span_init(void); /* at module import: 0, or -1 with an exception set */

/* What the hooks found during a pass (_gradscan_answers.c). */
typedef struct {
    void *param;    /* the parameter's address (its id); NULL for a free slot */
    PyObject *grad; /* the gradient scanned */
    int found;      /* it held a NaN or an Inf */
} Answer;
typedef struct {
    PyObject_HEAD
    Answer *slots;
    Py_ssize_t capacity; /* a power of two, or 0 */
    Py_ssize_t count;
} Answers;
INTERNAL extern PyTypeObject AnswersType;
INTERNAL Answer *answers_find(const Answers *answers, const void *param); /* NULL where none */
INTERNAL int answers_put(Answers *answers, void *param, PyObject *grad, int found); /* -1: MemoryError */

/* The module's functions, by unit (see each for what it does). */
INTERNAL PyObject *nonfinite(PyObject *self, PyObject *args);
INTERNAL PyObject *use_openmp(PyObject *self, PyObject *arg);
INTERNAL PyObject *last_threads(PyObject *self, PyObject *unused);
INTERNAL PyObject *configure(PyObject *self, PyObject *args);
INTERNAL PyObject *find_torch_shim(PyObject *self, PyObject *arg);
INTERNAL PyObject *shim_dtype(PyObject *self, PyObject *arg);
INTERNAL PyObject *use_torch_shim(PyObject *self, PyObject *codes);
INTERNAL PyObject *torch_shim_enabled(PyObject *self, PyObject *unused);
INTERNAL PyObject *dense_span(PyObject *self, PyObject *tensor);

#endif
