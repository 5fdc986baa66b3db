/* Which tensors the scan may read raw, and where they lie (torchpulse.probes._gradscan: spans).
 *
 * `dense_span` and the end-of-pass check and hook (see _gradscan.c) read a tensor raw only when it
 * is exactly a torch.Tensor (a subclass such as DTensor keeps its data elsewhere), on the CPU,
 * strided, contiguous, of a scan dtype, and whole in its storage. Those facts come from torch's
 * Python bindings, or, once the probe has checked that both agree, from torch's stable C shim.
 */
#include "_gradscan.h"
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* What span_of accepts (see configure): tensors of exactly torch.Tensor's type (a subclass such as
 * DTensor keeps its data elsewhere), strided, of a dtype in `formats` (dtype -> (format, itemsize)). */
static PyObject *tensor_type, *strided, *formats;
static PyObject *s_dtype, *s_is_cpu, *s_layout, *s_is_contiguous, *s_nbytes, *s_storage_offset,
    *s_untyped_storage, *s_data_ptr, *s_cdata;

static int intern(PyObject **name, const char *text) { return (*name = PyUnicode_InternFromString(text)) ? 0 : -1; }

int span_init(void) {
    return intern(&s_dtype, "dtype") || intern(&s_is_cpu, "is_cpu") || intern(&s_layout, "layout") ||
                   intern(&s_is_contiguous, "is_contiguous") || intern(&s_nbytes, "nbytes") ||
                   intern(&s_storage_offset, "storage_offset") || intern(&s_untyped_storage, "untyped_storage") ||
                   intern(&s_data_ptr, "data_ptr") || intern(&s_cdata, "_cdata")
               ? -1
               : 0;
}

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

int span_of(PyObject *tensor, Span *span) {
    if (tensor_type == NULL || (PyObject *)Py_TYPE(tensor) != tensor_type) return 0;
    return shim.enabled ? span_by_shim(tensor, span) : span_by_bindings(tensor, span);
}

/* configure(tensor_type, strided, formats): what span_of accepts; the probe passes torch.Tensor,
 * torch.strided and its table of scan formats by dtype. */
PyObject *configure(PyObject *self, PyObject *args) {
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
PyObject *find_torch_shim(PyObject *self, PyObject *arg) {
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
PyObject *shim_dtype(PyObject *self, PyObject *arg) {
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
PyObject *use_torch_shim(PyObject *self, PyObject *codes) {
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
PyObject *dense_span(PyObject *self, PyObject *tensor) {
    (void)self;
    Span span;
    int ok = span_of(tensor, &span);
    if (ok < 0) return NULL;
    if (!ok) Py_RETURN_NONE;
    return Py_BuildValue("(iNnO)", span.format, PyLong_FromVoidPtr((void *)span.address), (Py_ssize_t)span.nbytes,
                         span.held ? Py_True : Py_False);
}

PyObject *torch_shim_enabled(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyBool_FromLong(shim.enabled);
}
