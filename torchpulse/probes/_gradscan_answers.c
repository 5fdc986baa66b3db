/* What the hooks found during a pass, by parameter (torchpulse.probes._gradscan: Answers).
 *
 * A table keyed by the parameter's address (its id), open addressing with linear probing, holding
 * the gradient a hook scanned (a strong reference: the end of the pass compares identities, and an
 * address alone could be a new tensor's) and whether it held NaN or Inf. A dict keyed by id cost
 * an int, a tuple and an insert per hook, all cold in the middle of a pass: ~3 us a hook.
 */
#include "_gradscan.h"
#include <stdint.h>
#include <string.h>

/* Slot of a parameter's address: its bits mixed (addresses share their low bits and their top). */
static size_t home(const Answers *answers, const void *param) {
    uint64_t bits = (uint64_t)(uintptr_t)param;
    bits ^= bits >> 29;
    bits *= 0x9E3779B97F4A7C15ull;
    return (size_t)(bits >> 32) & (size_t)(answers->capacity - 1);
}

Answer *answers_find(const Answers *answers, const void *param) {
    if (answers->capacity == 0 || param == NULL) return NULL;
    for (size_t i = home(answers, param);; i = (i + 1) & (size_t)(answers->capacity - 1)) {
        Answer *slot = &answers->slots[i];
        if (slot->param == param) return slot;
        if (slot->param == NULL) return NULL;
    }
}

/* Room for one more at a load of at most one half; -1 with MemoryError set. */
static int reserve(Answers *answers) {
    if ((answers->count + 1) * 2 <= answers->capacity) return 0;
    Py_ssize_t capacity = answers->capacity ? answers->capacity * 2 : 32;
    Answer *old = answers->slots, *slots = PyMem_Calloc((size_t)capacity, sizeof(*slots));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t old_capacity = answers->capacity;
    answers->slots = slots;
    answers->capacity = capacity;
    for (Py_ssize_t i = 0; i < old_capacity; i++) {
        if (old[i].param == NULL) continue;
        size_t j = home(answers, old[i].param);
        while (slots[j].param != NULL) j = (j + 1) & (size_t)(capacity - 1);
        slots[j] = old[i];
    }
    PyMem_Free(old);
    return 0;
}

int answers_put(Answers *answers, void *param, PyObject *grad, int found) {
    if (reserve(answers) < 0) return -1;
    size_t i = home(answers, param);
    while (answers->slots[i].param != NULL && answers->slots[i].param != param)
        i = (i + 1) & (size_t)(answers->capacity - 1);
    Answer *slot = &answers->slots[i];
    PyObject *old = slot->grad; /* a second pass inside this one (reentrant) scanned it again */
    Py_INCREF(grad);
    answers->count += slot->param == NULL;
    slot->param = param;
    slot->grad = grad;
    slot->found = found;
    Py_XDECREF(old);
    return 0;
}

/* Forget every answer; a gradient let go here may run arbitrary code, so the table is empty first. */
static void forget(Answers *answers) {
    Py_ssize_t capacity = answers->capacity;
    Answer *slots = answers->slots;
    if (answers->count == 0) return;
    PyObject **grads = PyMem_Calloc((size_t)answers->count, sizeof(*grads));
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < capacity; i++) {
        if (slots[i].param == NULL) continue;
        if (grads != NULL)
            grads[n++] = slots[i].grad;
        else
            Py_XDECREF(slots[i].grad); /* no memory for the list: let go in place (still correct) */
        slots[i].param = NULL;
        slots[i].grad = NULL;
    }
    answers->count = 0;
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(grads[i]);
    PyMem_Free(grads);
}

static PyObject *Answers_clear(Answers *self, PyObject *unused) {
    (void)unused;
    forget(self);
    Py_RETURN_NONE;
}

static PyObject *Answers_get(Answers *self, PyObject *param) {
    Answer *slot = answers_find(self, param);
    if (slot == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(OO)", slot->grad, slot->found ? Py_True : Py_False);
}

static Py_ssize_t Answers_length(Answers *self) { return self->count; }

static int Answers_traverse(Answers *self, visitproc visit, void *arg) {
    for (Py_ssize_t i = 0; i < self->capacity; i++) Py_VISIT(self->slots[i].grad);
    return 0;
}

static int Answers_tp_clear(Answers *self) {
    forget(self);
    return 0;
}

static void Answers_dealloc(Answers *self) {
    PyObject_GC_UnTrack(self);
    forget(self);
    PyMem_Free(self->slots);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Answers_methods[] = {
    {"clear", (PyCFunction)Answers_clear, METH_NOARGS, "clear(): forget every answer and let go of the gradients"},
    {"get", (PyCFunction)Answers_get, METH_O, "get(param) -> (gradient, holds NaN/Inf) a hook left for it, or None"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Answers_sequence = {.sq_length = (lenfunc)Answers_length};

PyTypeObject AnswersType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "torchpulse.probes._gradscan.Answers",
    .tp_basicsize = sizeof(Answers),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Answers(): what the hooks found this pass, by parameter",
    .tp_new = PyType_GenericNew,
    .tp_traverse = (traverseproc)Answers_traverse,
    .tp_clear = (inquiry)Answers_tp_clear,
    .tp_dealloc = (destructor)Answers_dealloc,
    .tp_methods = Answers_methods,
    .tp_as_sequence = &Answers_sequence,
};
