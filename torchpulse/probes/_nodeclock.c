/* Per-node timing hooks of one autograd pass in C (torchpulse.probes._nodeclock).
 *
 * The Python hooks of autograd_nodes.PassTimer cost ~1.7 us a node warm beyond the ~1.1 us torch
 * spends calling any hook (the graph-task lookup, the clock, list stores, a frame each), and several
 * times that cold, between a pass's kernels; on every pass that is most of the probe's price. These
 * hooks do the same work without a frame: a pre-hook notes when a node starts, a post-hook adds the
 * elapsed time and a call to that node's slot. Only the pass's own graph task is timed (the one that
 * ran a root first), exactly as PassTimer's Python hooks decide it; the detailed (logging) mode, which
 * also describes grad_outputs, stays in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <time.h>

typedef struct {
    double start, seconds;
    Py_ssize_t calls;
} Slot; /* one node's */

typedef struct {
    PyObject_HEAD
    PyObject *task_id; /* torch._C._current_graph_task_id, or a stand-in */
    Py_ssize_t roots;  /* the first `roots` slots are the pass's roots */
    Py_ssize_t count, capacity;
    Slot *slots;
    int has_task;
    long long task;   /* the pass's own graph task, once a root ran */
    PyObject *error;  /* the first exception a hook met, or NULL */
} Clock;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Clock *clock;
    Py_ssize_t index;
} Hook;

static double monotonic(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* time.perf_counter's clock: comparable with the pass time */
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Keep the first error for Clock.error (the probe then disables itself), never raise into the engine. */
static void keep_error(Clock *clock) {
#if PY_VERSION_HEX >= 0x030C0000
    PyObject *error = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    PyObject *error = value;
#endif
    if (clock->error == NULL)
        clock->error = error;
    else
        Py_XDECREF(error);
}

/* The graph task running this hook; 0 with an exception kept on failure. */
static int current_task(Clock *clock, long long *task) {
    PyObject *id = PyObject_CallNoArgs(clock->task_id);
    if (id == NULL) return 0;
    *task = PyLong_AsLongLong(id);
    Py_DECREF(id);
    return !(*task == -1 && PyErr_Occurred());
}

static PyObject *prehook_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    (void)args, (void)nargsf, (void)kwnames; /* grad_outputs: not looked at, never replaced */
    Clock *clock = self->clock;
    long long task;
    if (!current_task(clock, &task)) {
        keep_error(clock);
        Py_RETURN_NONE;
    }
    if (!clock->has_task || clock->task != task) {
        if (clock->has_task || self->index >= clock->roots) Py_RETURN_NONE; /* another pass running this node */
        clock->has_task = 1;
        clock->task = task;
    }
    clock->slots[self->index].start = monotonic();
    Py_RETURN_NONE;
}

static PyObject *posthook_call(Hook *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    (void)args, (void)nargsf, (void)kwnames;
    Clock *clock = self->clock;
    long long task;
    if (!clock->has_task) Py_RETURN_NONE;
    if (!current_task(clock, &task)) {
        keep_error(clock);
        Py_RETURN_NONE;
    }
    if (task == clock->task) {
        Slot *slot = &clock->slots[self->index];
        slot->seconds += monotonic() - slot->start;
        slot->calls += 1;
    }
    Py_RETURN_NONE;
}

static PyObject *make_hook(Clock *clock, PyObject *arg, PyTypeObject *type, vectorcallfunc call) {
    Py_ssize_t index = PyLong_AsSsize_t(arg);
    if (index == -1 && PyErr_Occurred()) return NULL;
    if (index < 0 || index >= clock->count) {
        PyErr_Format(PyExc_IndexError, "no node %zd (the clock has %zd)", index, clock->count);
        return NULL;
    }
    Hook *hook = PyObject_New(Hook, type);
    if (hook == NULL) return NULL;
    hook->vectorcall = call;
    Py_INCREF(clock);
    hook->clock = clock;
    hook->index = index;
    return (PyObject *)hook;
}

static void Hook_dealloc(Hook *self) {
    Py_XDECREF(self->clock);
    PyObject_Free(self);
}

#define HOOK_TYPE(NAME, DOC)                                                                \
    {                                                                                       \
        PyVarObject_HEAD_INIT(NULL, 0)                                                      \
        .tp_name = "torchpulse.probes._nodeclock." NAME,                                   \
        .tp_basicsize = sizeof(Hook),                                                       \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,                        \
        .tp_doc = DOC,                                                                      \
        .tp_vectorcall_offset = offsetof(Hook, vectorcall),                                 \
        .tp_call = PyVectorcall_Call,                                                       \
        .tp_dealloc = (destructor)Hook_dealloc,                                             \
    }

static PyTypeObject PreHookType = HOOK_TYPE("PreHook", "a node's pre-hook: notes when it starts");
static PyTypeObject PostHookType = HOOK_TYPE("PostHook", "a node's post-hook: adds its time and a call");

static PyObject *Clock_prehook(Clock *self, PyObject *index) {
    return make_hook(self, index, &PreHookType, (vectorcallfunc)prehook_call);
}

static PyObject *Clock_posthook(Clock *self, PyObject *index) {
    return make_hook(self, index, &PostHookType, (vectorcallfunc)posthook_call);
}

static PyObject *Clock_add(Clock *self, PyObject *unused) {
    (void)unused;
    if (self->count == self->capacity) {
        Py_ssize_t capacity = self->capacity ? self->capacity * 2 : 64;
        Slot *slots = PyMem_Realloc(self->slots, (size_t)capacity * sizeof(Slot));
        if (slots == NULL) return PyErr_NoMemory();
        self->slots = slots;
        self->capacity = capacity;
    }
    self->slots[self->count] = (Slot){0.0, 0.0, 0};
    return PyLong_FromSsize_t(self->count++);
}

static PyObject *Clock_totals(Clock *self, PyObject *unused) {
    (void)unused;
    PyObject *calls = PyList_New(self->count), *seconds = PyList_New(self->count);
    if (calls == NULL || seconds == NULL) goto fail;
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyObject *n = PyLong_FromSsize_t(self->slots[i].calls), *s = PyFloat_FromDouble(self->slots[i].seconds);
        if (n == NULL || s == NULL) {
            Py_XDECREF(n);
            Py_XDECREF(s);
            goto fail;
        }
        PyList_SET_ITEM(calls, i, n);
        PyList_SET_ITEM(seconds, i, s);
    }
    return Py_BuildValue("(NN)", calls, seconds);
fail:
    Py_XDECREF(calls);
    Py_XDECREF(seconds);
    return NULL;
}

static PyObject *Clock_get_error(Clock *self, void *closure) {
    (void)closure;
    PyObject *error = self->error ? self->error : Py_None;
    Py_INCREF(error);
    return error;
}

static int Clock_init(Clock *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"roots", "task_id", NULL};
    Py_ssize_t roots;
    PyObject *task_id;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nO", keywords, &roots, &task_id)) return -1;
    if (!PyCallable_Check(task_id)) {
        PyErr_SetString(PyExc_TypeError, "task_id must be callable");
        return -1;
    }
    Py_INCREF(task_id);
    Py_XSETREF(self->task_id, task_id);
    self->roots = roots;
    return 0;
}

static void Clock_dealloc(Clock *self) {
    Py_XDECREF(self->task_id);
    Py_XDECREF(self->error);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Clock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    (void)args, (void)kwargs;
    Clock *self = (Clock *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    /* A stand-in until __init__ (`int()` is 0): every hook then runs in task 0. */
    Py_INCREF(&PyLong_Type);
    self->task_id = (PyObject *)&PyLong_Type;
    return (PyObject *)self;
}

static PyMethodDef Clock_methods[] = {
    {"add", (PyCFunction)Clock_add, METH_NOARGS, "add() -> the index of a new node's slot"},
    {"prehook", (PyCFunction)Clock_prehook, METH_O, "prehook(index) -> that node's pre-hook"},
    {"posthook", (PyCFunction)Clock_posthook, METH_O, "posthook(index) -> that node's post-hook"},
    {"totals", (PyCFunction)Clock_totals, METH_NOARGS, "totals() -> (calls, seconds), one entry per node"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Clock_getset[] = {
    {"error", (getter)Clock_get_error, NULL, "the first exception a hook met, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ClockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchpulse.probes._nodeclock.Clock",
    .tp_basicsize = sizeof(Clock),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Clock(roots, task_id): time per node of one pass, taken by its hooks",
    .tp_new = Clock_new,
    .tp_init = (initproc)Clock_init,
    .tp_dealloc = (destructor)Clock_dealloc,
    .tp_methods = Clock_methods,
    .tp_getset = Clock_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_nodeclock", NULL, -1, NULL,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__nodeclock(void) {
    if (PyType_Ready(&ClockType) < 0 || PyType_Ready(&PreHookType) < 0 || PyType_Ready(&PostHookType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddType(m, &ClockType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
