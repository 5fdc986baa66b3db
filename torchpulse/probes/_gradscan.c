/* Which CPU gradients hold a NaN or an Inf (torchpulse.probes._gradscan: the check, the hook, the module).
 *
 * The autograd probe checks every parameter gradient after every backward pass; on a CPU the
 * scan in _gradscan_scan.c reads them. A gradient read at the end of the pass comes from memory;
 * read as the engine accumulates it, much of it is still in cache (the scan alone: 418 us against
 * 606 us on this host's benchmark model). `Hook` is a post-accumulate-grad hook that scans the
 * gradient there and leaves the answer for the probe; `check` answers the end of the pass from
 * those answers and scans the rest, in one call.
 */
#include "_gradscan.h"
#include <structmember.h>
#include <time.h>

static PyObject *s_grad, *s_post_accumulate_grad_hooks;

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
static int hook_answer(const Answers *answers, PyObject *param, PyObject *grad) {
    const Answer *answer = answers_find(answers, param);
    if (answer == NULL || answer->grad != grad) return LEFT;
    int found = answer->found; /* read now: torch's code below may run Python that changes the table */
    PyObject *hooks = PyObject_GetAttr(param, s_post_accumulate_grad_hooks);
    if (hooks == NULL) return -1;
    Py_ssize_t count = hooks == Py_None ? 0 : PyObject_Length(hooks);
    Py_DECREF(hooks);
    if (count < 0) return -1;
    return count > 1 ? LEFT : found ? ANSWERED_NONFINITE : ANSWERED_FINITE;
}

/* What to do with one parameter's gradient; for SCAN, its span, and the gradient itself in *held
 * (a new reference: a raw read needs the tensor alive until it is done). */
static int classify(PyObject *param, const Answers *answers, Span *span, PyObject **held) {
    PyObject *grad = PyObject_GetAttr(param, s_grad);
    if (grad == NULL) return -1;
    int what = SKIP;
    if (grad != Py_None && (answers->count == 0 || (what = hook_answer(answers, param, grad)) == LEFT)) {
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
 * gradient a hook scanned this pass (its answer names that very tensor) is answered from
 * there; one span_of accepts is scanned, across `threads` as `nonfinite` does, unless its storage
 * no longer holds it (skipped, as are dead parameters and those without a gradient). Every other
 * parameter is left to the caller: gradients this module may not read raw, and answered ones with
 * other post-accumulate hooks beside the hook (the caller knows whether the hook ran last).
 * `checked` counts the gradients answered or scanned; `nonfinite` and `left` are indices into refs,
 * in order. */
static PyObject *check(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *refs;
    Answers *answers;
    int threads = 1;
    if (!PyArg_ParseTuple(args, "O!O!|i", &PyList_Type, &refs, &AnswersType, &answers, &threads)) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(refs);
    size_t slots = (size_t)count + 1;
    /* Per format, the spans to scan (up to count each) and the index in refs of each. */
    const unsigned char **address = PyMem_Calloc(4 * slots, sizeof(*address));
    size_t *elements = PyMem_Calloc(4 * slots, sizeof(*elements));
    Py_ssize_t *index = PyMem_Calloc(4 * slots, sizeof(*index));
    PyObject **held = PyMem_Calloc(slots, sizeof(*held)); /* the gradients to scan, kept alive */
    unsigned char *found = PyMem_Calloc(4 * slots, 1), *verdict = PyMem_Calloc(slots, 1);
    Job jobs[4];
    PyObject *result = NULL, *nonfinite = NULL, *left = NULL;
    Py_ssize_t checked = 0;
    if (address == NULL || elements == NULL || index == NULL || held == NULL || found == NULL || verdict == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (int f = F16; f <= F64; f++)
        jobs[f] = (Job){f, 0, address + f * slots, elements + f * slots, 0, found + f * slots, 1};
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
 * leaves (gradient, holds NaN/Inf) for the parameter in its Answers. It never raises into the
 * engine (that would fail the job's backward pass): a gradient it cannot read is left to the end
 * of the pass. */
typedef struct {
    PyObject_HEAD
    int format;
    Py_ssize_t itemsize;
    Answers *answers;
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
    if (self->answers == NULL) return 0; /* made without __init__: nowhere to answer */
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
        ok = answers_put(self->answers, param, grad, found) == 0 ? 1 : -1;
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
    Answers *answers;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "inO!", keywords, &format, &itemsize, &AnswersType, &answers))
        return -1;
    if (format < F16 || format > F64 || itemsize <= 0 || (size_t)itemsize % WIDTH[format]) {
        PyErr_Format(PyExc_ValueError, "format %d with %zd-byte elements", format, itemsize);
        return -1;
    }
    self->format = format;
    self->itemsize = itemsize;
    Py_INCREF((PyObject *)answers);
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
    if (intern(&s_grad, "grad") || intern(&s_post_accumulate_grad_hooks, "_post_accumulate_grad_hooks") ||
        span_init() < 0 || PyType_Ready(&HookType) < 0 || PyType_Ready(&AnswersType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &HookType) < 0 || PyModule_AddType(m, &AnswersType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
