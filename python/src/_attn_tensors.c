/*
 * _attn_tensors.c — plain CPU torch tensors read in place, without NumPy.
 *
 * A 16-token attention from Python costs a few microseconds in the kernels,
 * and every torch tensor it reads went through `tensor.numpy()` first (about
 * 6,300 instructions each, counted with callgrind). The extension never
 * links against torch, so it reads a tensor through torch's own Python
 * properties and methods instead (is_cpu, layout, dtype, is_neg, shape,
 * stride, data_ptr), called through their descriptors on the class: no
 * NumPy object made, and no attribute of the tensor itself consulted. The
 * Python layer registers torch's types once (`_attn._torch_intake`) and
 * passes tensors only on its short route (attn/_torch.py plain), after its
 * own checks (exact class, no torch mode, no functorch wrapper).
 *
 * What `.numpy()` would refuse is refused here too: another device (meta
 * included), a layout other than strided, a nested tensor, a negated view
 * (its memory holds -x), a dtype attn does not read, a misaligned base or
 * more dimensions than ATTN_MAX_RANK. Such a tensor raises
 * _attn.NotReadInPlace (a TypeError naming the argument), on which the
 * short route hands the call to the checked one, which explains or copies.
 */
#include "_attn_shared.h"

#include <string.h>

/* Registered by _torch_intake; NULL until then (torch never loaded). */
static PyTypeObject *tensor_type;
static PyObject *strided_layout;
enum { T_F32, T_F64, T_F16, T_BF16, T_BOOL, T_NDTYPES };
static PyObject *dtypes[T_NDTYPES];
static const attn_dtype attn_dtypes[T_NDTYPES] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64,
                                                  ATTN_DTYPE_F16, ATTN_DTYPE_BF16,
                                                  ATTN_DTYPE_BOOL};
static PyObject *not_read_in_place; /* the exception class */
/* Each accessor's descriptor on torch.Tensor (a getset for the properties,
 * a method descriptor for the methods), found once when the types are
 * registered and then called directly. By name, obj.<name> looked the name
 * up in the class's MRO and in the tensor's own __dict__ at every read (a
 * quarter of a short call's tensor intake), and an instance attribute
 * shadowed a method: `t.data_ptr = lambda: 4096` crashed the process, and
 * `t.stride = ...` read the wrong elements. */
static PyObject *d_data_ptr, *d_stride, *d_is_neg, *d_shape, *d_dtype, *d_layout, *d_is_cpu;
/* ... and those that bound the storage: Tensor.storage_offset,
 * Tensor.untyped_storage, UntypedStorage.nbytes */
static PyObject *d_storage_offset, *d_untyped_storage, *d_nbytes;
static Py_ssize_t tensors_read; /* read by the tests through _tensors_read() */

static double empty_tensor_data; /* the data of a tensor with no elements */

int is_plain_tensor(PyObject *obj) { return tensor_type != NULL && Py_TYPE(obj) == tensor_type; }

/* Sets NotReadInPlace naming the argument, replacing any exception torch
 * raised while being read (a nested tensor has no sizes, a sparse one no
 * strides): the checked route says what is wrong. Always -1. */
static int refuse(const char *name, const char *why) {
    PyErr_Clear();
    PyErr_Format(not_read_in_place, "%s: %s, so attn cannot read the torch tensor in place",
                 name, why);
    return -1;
}

/* The accessor `d` of obj (call: a method without arguments), a new
 * reference or NULL. */
static PyObject *tensor_attr(PyObject *obj, PyObject *d, int call) {
    if (call) {
        PyObject *args[1] = {obj};
        return PyObject_Vectorcall(d, args, 1, NULL);
    }
    return Py_TYPE(d)->tp_descr_get(d, obj, (PyObject *)Py_TYPE(obj));
}

/* tensor_attr() is Py_True: 1, anything else 0, -1 on error. */
static int flag(PyObject *obj, PyObject *d, int call) {
    PyObject *r = tensor_attr(obj, d, call);
    if (r == NULL) return -1;
    const int on = r == Py_True;
    Py_DECREF(r);
    return on;
}

/* A property of obj into *found, borrowed (a dtype or a layout: torch keeps
 * them alive, and only their identity is compared); 0, or -1 on error. */
static int attr_of(PyObject *obj, PyObject *d, PyObject **found) {
    PyObject *r = tensor_attr(obj, d, 0);
    if (r == NULL) return -1;
    *found = r;
    Py_DECREF(r);
    return 0;
}

/* A tuple of at most ATTN_MAX_RANK ints into out[]; its length, or -1. */
static int int_tuple(PyObject *t, int64_t out[ATTN_MAX_RANK]) {
    if (t == NULL || !PyTuple_Check(t) || PyTuple_GET_SIZE(t) > ATTN_MAX_RANK) return -1;
    const int n = (int)PyTuple_GET_SIZE(t);
    for (int d = 0; d < n; d++) {
        out[d] = PyLong_AsLongLong(PyTuple_GET_ITEM(t, d));
        if (out[d] == -1 && PyErr_Occurred()) return -1;
    }
    return n;
}

/* The attn dtype of a tensor's dtype object, or 0. `bf16`: bfloat16 is
 * acceptable (view_get_as's rule). */
static attn_dtype dtype_of(PyObject *dt, int bf16) {
    for (int i = 0; i < T_NDTYPES; i++)
        if (dt == dtypes[i]) return i == T_BF16 && !bf16 ? 0 : attn_dtypes[i];
    return 0;
}

/* The tensor's shape and strides (in elements) into t; 0 or -1. */
static int sizes_of(PyObject *obj, attn_tensor *t) {
    PyObject *shape = tensor_attr(obj, d_shape, 0);
    const int rank = int_tuple(shape, t->shape);
    Py_XDECREF(shape);
    if (rank < 0) return -1;
    PyObject *stride = tensor_attr(obj, d_stride, 1);
    const int srank = int_tuple(stride, t->strides);
    Py_XDECREF(stride);
    if (srank != rank) return -1;
    t->rank = rank;
    return 0;
}

/* A method of obj without arguments (descriptor d) that returns an int,
 * into *out; 0, or -1 on error. */
static int int_attr(PyObject *obj, PyObject *d, int64_t *out) {
    PyObject *r = tensor_attr(obj, d, 1);
    if (r == NULL) return -1;
    *out = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* Whether every element t's sizes and strides reach (numel > 0) lies in
 * obj's storage. A storage resized behind its tensor's back
 * (untyped_storage().resize_(), as FSDP frees parameters) leaves the sizes
 * reaching past it: torch's own ops refuse such a tensor ("setStorage: ...
 * out of bound"), and attn read past the allocation. 1, 0, or -1. */
static int within_storage(PyObject *obj, const attn_tensor *t) {
    int64_t reach, nbytes;
    if (int_attr(obj, d_storage_offset, &reach) < 0) return -1;
    PyObject *storage = tensor_attr(obj, d_untyped_storage, 1);
    if (storage == NULL) return -1;
    const int got = int_attr(storage, d_nbytes, &nbytes);
    Py_DECREF(storage);
    if (got < 0) return -1;
    if (reach < 0) return 0;
    for (int d = 0; d < t->rank; d++) { /* reach = offset + sum (n - 1)·stride */
        const int64_t n = t->shape[d] - 1, s = t->strides[d];
        if (s < 0 || (s > 0 && n > (INT64_MAX - reach) / s)) return 0;
        reach += n * s;
    }
    const int64_t size = (int64_t)attn_dtype_size(t->dtype);
    return reach < INT64_MAX / size - 1 && (reach + 1) * size <= nbytes;
}

/* Fills v->t from a plain tensor (is_plain_tensor). 0, or -1 with
 * NotReadInPlace set where `.numpy()` would refuse it too (and where
 * reading it raised). Each read is a torch property or method, about 500
 * instructions, so only what decides safety is asked. */
int tensor_view(PyObject *obj, const char *name, int bf16, buffer_view *v) {
    memset(v, 0, sizeof *v);
    attn_tensor *t = &v->t;
    PyObject *layout = NULL, *dt = NULL;
    if (flag(obj, d_is_cpu, 0) != 1) return refuse(name, "it is not on the CPU");
    if (attr_of(obj, d_layout, &layout) < 0 || layout != strided_layout)
        return refuse(name, "its layout is not strided");
    if (attr_of(obj, d_dtype, &dt) < 0 || (t->dtype = dtype_of(dt, bf16)) == 0)
        return refuse(name, "attn does not read its dtype");
    if (flag(obj, d_is_neg, 1) != 0) return refuse(name, "it is a negated view");
    if (sizes_of(obj, t) < 0)
        return refuse(name, "its sizes and strides cannot be read (or it has over 8 dimensions)");
    PyObject *ptr = tensor_attr(obj, d_data_ptr, 1);
    void *data = ptr != NULL ? PyLong_AsVoidPtr(ptr) : NULL;
    Py_XDECREF(ptr);
    if (PyErr_Occurred()) return refuse(name, "its data pointer cannot be read");

    int64_t numel = 1;
    for (int d = 0; d < t->rank; d++)
        if (t->shape[d] <= 0) numel = 0;
    int within = 1;
    if (numel > 0 && (within = within_storage(obj, t)) != 1)
        return refuse(name, within < 0 ? "its storage cannot be read"
                                       : "its sizes and strides reach past its storage");
    for (int d = 0; d < t->rank; d++)
        if (t->shape[d] <= 1) t->strides[d] = 0; /* never used; as view_get_as does */
    if (numel == 0) {
        data = &empty_tensor_data; /* nothing to read; the library reports the shape */
    } else if (data == NULL) {
        return refuse(name, "it has no data");
    } else if ((uintptr_t)data % (uintptr_t)attn_dtype_size(t->dtype) != 0) {
        return refuse(name, "its data is not aligned to its items"); /* from_numpy of odd bytes */
    }
    t->data = data;
    tensors_read++;
    return 0;
}

PyDoc_STRVAR(torch_intake_doc,
             "_torch_intake(Tensor, UntypedStorage, strided, float32, float64, float16,\n"
             "              bfloat16, bool)\n\n"
             "Registers torch's tensor class, strided layout and dtypes, so that\n"
             "sdpa() reads plain CPU tensors of those dtypes in place (once, when\n"
             "attn._torch is imported). False when the class's accessors are not\n"
             "torch's C descriptors (a patched class): no tensor is read in place.");

/* type.<name> into *d (a new reference) when it is a getset (`call` 0) or
 * a method descriptor (`call` 1) of the type or a base; 1 if so, 0 if not
 * (another kind of attribute: a patched class), -1 on error. */
static int accessor(PyTypeObject *type, const char *name, int call, PyObject **d) {
    Py_CLEAR(*d);
    PyObject *found = PyObject_GetAttrString((PyObject *)type, name);
    if (found == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        return 0;
    }
    if (!Py_IS_TYPE(found, call ? &PyMethodDescr_Type : &PyGetSetDescr_Type) ||
        !PyType_IsSubtype(type, PyDescr_TYPE(found))) {
        Py_DECREF(found);
        return 0;
    }
    *d = found;
    return 1;
}

/* Every accessor tensor_view reads: 1 when all are descriptors, else 0
 * (the tensors then go to the checked route, through .numpy()); -1. */
static int find_accessors(PyTypeObject *type, PyTypeObject *storage) {
    static const struct {
        const char *name;
        int call; /* a method (1) or a property (0) */
        PyObject **slot;
    } accessors[] = {
        {"is_cpu", 0, &d_is_cpu},     {"layout", 0, &d_layout},
        {"dtype", 0, &d_dtype},       {"shape", 0, &d_shape},
        {"is_neg", 1, &d_is_neg},     {"stride", 1, &d_stride},
        {"data_ptr", 1, &d_data_ptr}, {"storage_offset", 1, &d_storage_offset},
        {"untyped_storage", 1, &d_untyped_storage},
    };
    int all = 1;
    for (size_t i = 0; i < sizeof accessors / sizeof *accessors; i++) {
        const int found = accessor(type, accessors[i].name, accessors[i].call, accessors[i].slot);
        if (found < 0) return -1;
        all &= found;
    }
    const int found = accessor(storage, "nbytes", 1, &d_nbytes);
    return found < 0 ? -1 : all & found;
}

static PyObject *py_torch_intake(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *type, *storage, *strided, *dt[T_NDTYPES];
    if (!PyArg_ParseTuple(args, "O!O!OOOOOO:_torch_intake", &PyType_Type, &type, &PyType_Type,
                          &storage, &strided, &dt[0], &dt[1], &dt[2], &dt[3], &dt[4]))
        return NULL;
    Py_CLEAR(tensor_type); /* no tensor read in place until every accessor is found */
    const int found = find_accessors((PyTypeObject *)type, (PyTypeObject *)storage);
    if (found < 0) return NULL;
    if (found) {
        Py_INCREF(type);
        tensor_type = (PyTypeObject *)type;
    }
    Py_INCREF(strided);
    Py_XSETREF(strided_layout, strided);
    for (int i = 0; i < T_NDTYPES; i++) {
        Py_INCREF(dt[i]);
        Py_XSETREF(dtypes[i], dt[i]);
    }
    return PyBool_FromLong(found);
}

static PyObject *py_tensors_read(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromSsize_t(tensors_read);
}

static PyMethodDef tensor_methods[] = {
    {"_torch_intake", py_torch_intake, METH_VARARGS, torch_intake_doc},
    {"_tensors_read", py_tensors_read, METH_NOARGS,
     "how many torch tensors were read in place (without NumPy)"},
    {NULL, NULL, 0, NULL}};

int tensor_intake_add(PyObject *module) {
    not_read_in_place = PyErr_NewExceptionWithDoc(
        "attn._attn.NotReadInPlace",
        "A torch tensor the extension cannot read in place (what tensor.numpy() "
        "refuses too); the Python layer then takes the checked route.",
        PyExc_TypeError, NULL);
    if (not_read_in_place == NULL) return -1;
    Py_INCREF(not_read_in_place);
    if (PyModule_AddObject(module, "NotReadInPlace", not_read_in_place) < 0) {
        Py_DECREF(not_read_in_place);
        return -1;
    }
    return PyModule_AddFunctions(module, tensor_methods);
}
