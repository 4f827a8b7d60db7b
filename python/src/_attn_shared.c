/*
 * _attn_shared.c — the helpers the extension's C files share (declared in
 * _attn_shared.h): library failures as exceptions with their fields, Ctrl-C
 * during a call, buffers as attn_tensor views, outputs from the Python
 * allocator, and the parsing of attn_sdpa's options and score modifiers.
 * _attn.c (the module), _attn_serving.c and _attn_ring.c all use them; none
 * of them is used here, so the files form no circle.
 */
#include "_attn_shared.h" /* Python.h first, as CPython asks */

#include <string.h>

/* ------------------------------------------------------------------------ */
/* Errors                                                                    */
/* ------------------------------------------------------------------------ */

/* The enumerator's name, for exceptions that are printed or logged. */
static const char *status_name(attn_status st) {
    static const char *const names[] = {
        [ATTN_OK] = "ATTN_OK",
        [ATTN_ERR_NULL] = "ATTN_ERR_NULL",
        [ATTN_ERR_INVALID] = "ATTN_ERR_INVALID",
        [ATTN_ERR_SHAPE] = "ATTN_ERR_SHAPE",
        [ATTN_ERR_DTYPE] = "ATTN_ERR_DTYPE",
        [ATTN_ERR_OVERFLOW] = "ATTN_ERR_OVERFLOW",
        [ATTN_ERR_NOMEM] = "ATTN_ERR_NOMEM",
        [ATTN_ERR_IO] = "ATTN_ERR_IO",
        [ATTN_ERR_FORMAT] = "ATTN_ERR_FORMAT",
        [ATTN_ERR_UNSUPPORTED] = "ATTN_ERR_UNSUPPORTED",
        [ATTN_ERR_CANCELLED] = "ATTN_ERR_CANCELLED",
        [ATTN_ERR_OVERLAP] = "ATTN_ERR_OVERLAP",
        [ATTN_ERR_COMM] = "ATTN_ERR_COMM"};
    const int i = (int)st;
    const int n = (int)(sizeof names / sizeof names[0]);
    return i >= 0 && i < n && names[i] != NULL ? names[i] : "unknown";
}

/* Sets name = value (a new reference, NULL only on an earlier failure). */
static int set_field(PyObject *exc, const char *name, PyObject *value) {
    int rc = value != NULL ? PyObject_SetAttrString(exc, name, value) : -1;
    Py_XDECREF(value);
    return rc;
}

/* Raises the exception for a failed library call, with the message and the
 * structured fields (status, status_name, arg) of this thread's error. */
PyObject *raise_status(attn_status st) {
    PyObject *type;
    switch (st) {
    case ATTN_ERR_DTYPE: type = PyExc_TypeError; break;
    case ATTN_ERR_NOMEM: type = PyExc_MemoryError; break;
    case ATTN_ERR_UNSUPPORTED: type = PyExc_RuntimeError; break;
    case ATTN_ERR_COMM: type = PyExc_RuntimeError; break; /* not the caller's arguments */
    default: type = PyExc_ValueError; break;
    }
    const char *msg = attn_last_error();
    PyObject *exc = PyObject_CallFunction(
        type, "s", (msg != NULL && msg[0] != '\0') ? msg : attn_strerror(st));
    if (exc == NULL) return NULL; /* that exception (MemoryError) is set instead */
    if (set_field(exc, "status", PyLong_FromLong((long)st)) == 0 &&
        set_field(exc, "status_name", PyUnicode_FromString(status_name(st))) == 0 &&
        set_field(exc, "arg", PyUnicode_FromString(attn_last_error_arg())) == 0)
        PyErr_SetObject(type, exc);
    Py_DECREF(exc);
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Ctrl-C during a call                                                      */
/* ------------------------------------------------------------------------ */

/* While the GIL is released, Python's SIGINT handler only records the
 * signal: KeyboardInterrupt would come when the call ends, many seconds later
 * for a large input. So on the main thread (the only one Python runs signal
 * handlers on), while Python's handler for SIGINT is the default one, a call
 * swaps in a C handler that sets the library's cancel flag; the library stops
 * between blocks with ATTN_ERR_CANCELLED. Afterwards the signal is raised
 * again under Python's own handler, which raises KeyboardInterrupt as usual.
 * A user's own SIGINT handler (or SIG_IGN) is left alone. */
static volatile int interrupt_flag;  /* the cancel flag the library reads */
static unsigned long main_thread_id; /* threading.main_thread().ident */
static PyObject *getsignal, *default_int_handler; /* from the signal module */

static void on_sigint(int sig) {
    (void)sig;
    interrupt_flag = 1;
}

/* With the GIL held, before the call. */
void interrupt_guard_arm(interrupt_guard *g) {
    g->armed = false;
    if (getsignal == NULL || PyThread_get_thread_ident() != main_thread_id) return;
    PyObject *h = PyObject_CallFunction(getsignal, "i", SIGINT);
    const bool python_default = h == default_int_handler;
    Py_XDECREF(h);
    if (h == NULL) PyErr_Clear(); /* no handler to honour: run uninterruptible */
    if (!python_default || sigaction(SIGINT, NULL, &g->saved) != 0) return;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    interrupt_flag = 0;
    if (sigaction(SIGINT, &sa, NULL) != 0) return;
    attn_set_cancel_flag(&interrupt_flag);
    g->armed = true;
}

void interrupt_guard_arm_for(interrupt_guard *g, double work) {
    if (work >= GUARD_MIN_WORK)
        interrupt_guard_arm(g);
    else
        g->armed = false;
}

/* With the GIL held, after the call: -1 with KeyboardInterrupt set when a
 * SIGINT came during it (whether or not it stopped the call early). */
int interrupt_guard_disarm(interrupt_guard *g, attn_status st) {
    if (!g->armed) return 0;
    attn_set_cancel_flag(NULL);
    sigaction(SIGINT, &g->saved, NULL);
    if (!interrupt_flag) return 0;
    raise(SIGINT); /* Python's C handler records it... */
    if (PyErr_CheckSignals() < 0) return -1; /* ...and its Python handler raises */
    if (st == ATTN_ERR_CANCELLED) { /* the handler was swapped out since: still stop */
        PyErr_SetNone(PyExc_KeyboardInterrupt);
        return -1;
    }
    return 0;
}

int interrupt_guard_init(void) {
    PyObject *signal_mod = PyImport_ImportModule("signal");
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main_thread = threading ? PyObject_CallMethod(threading, "main_thread", NULL) : NULL;
    PyObject *ident = main_thread ? PyObject_GetAttrString(main_thread, "ident") : NULL;
    if (ident != NULL) main_thread_id = PyLong_AsUnsignedLong(ident);
    if (signal_mod != NULL) {
        getsignal = PyObject_GetAttrString(signal_mod, "getsignal");
        default_int_handler = PyObject_GetAttrString(signal_mod, "default_int_handler");
    }
    Py_XDECREF(ident);
    Py_XDECREF(main_thread);
    Py_XDECREF(threading);
    Py_XDECREF(signal_mod);
    return PyErr_Occurred() ? -1 : 0;
}

/* ------------------------------------------------------------------------ */
/* Buffers as attn_tensor views                                              */
/* ------------------------------------------------------------------------ */

/* Stands in for the data pointer of a buffer that has none (an empty
 * buffer), so the library reports the empty shape rather than a NULL. */
static double empty_data;

/* Number of inputs copied because their layout could not be described in
 * elements; read by the tests through _copies(). */
static Py_ssize_t copies_made;

Py_ssize_t shared_copies_made(void) { return copies_made; }

static int host_is_little_endian(void) {
    const uint16_t one = 1;
    return *(const unsigned char *)&one == 1;
}

/* The attn dtype of a struct-module format string, or 0. */
static attn_dtype dtype_from_format(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL) return 0; /* plain bytes */
    if (*fmt == '@' || *fmt == '=') {
        fmt++;
    } else if (*fmt == '<' || *fmt == '>' || *fmt == '!') {
        int little = *fmt == '<';
        if (little != host_is_little_endian()) return 0; /* foreign byte order */
        fmt++;
    }
    if (fmt[0] == '\0' || fmt[1] != '\0') return 0;
    switch (fmt[0]) {
    case 'f': return itemsize == 4 ? ATTN_DTYPE_F32 : 0;
    case 'd': return itemsize == 8 ? ATTN_DTYPE_F64 : 0;
    case '?': return itemsize == 1 ? ATTN_DTYPE_BOOL : 0;
    case 'e': return itemsize == 2 ? ATTN_DTYPE_F16 : 0; /* a KV cache's storage dtype */
    case 'i': /* int32 index tensors (cu_seqlens, cache_seqlens, block_table) */
    case 'l': return itemsize == 4 ? ATTN_DTYPE_I32 : 0;
    }
    return 0;
}

/* Whether a format names a 16-bit integer: how bfloat16 arrives (NumPy has
 * no bfloat16, so the Python layer passes torch.bfloat16 and ml_dtypes'
 * bfloat16 viewed as int16/uint16, and says so with a dtype override). */
static int is_16bit_integer(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL || itemsize != 2) return 0;
    if (*fmt == '@' || *fmt == '=') fmt++;
    return (fmt[0] == 'h' || fmt[0] == 'H') && fmt[1] == '\0';
}

void view_release(buffer_view *v) {
    if (v->held) PyBuffer_Release(&v->buf);
    v->held = 0;
    PyMem_Free(v->copy);
    v->copy = NULL;
}

/* Copies a byte-strided buffer into a C-contiguous block, element by
 * element (memcpy, so misaligned sources are fine). */
static int copy_contiguous(buffer_view *v, Py_ssize_t numel) {
    const Py_buffer *b = &v->buf;
    const Py_ssize_t item = b->itemsize;
    if (numel > PY_SSIZE_T_MAX / item) {
        PyErr_NoMemory();
        return -1;
    }
    char *dst = PyMem_Malloc((size_t)(numel * item));
    if (dst == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t idx[ATTN_MAX_RANK] = {0};
    for (Py_ssize_t n = 0; n < numel; n++) {
        const char *src = b->buf;
        for (int d = 0; d < b->ndim; d++) src += idx[d] * v->strides[d];
        memcpy(dst + n * item, src, (size_t)item);
        for (int d = b->ndim - 1; d >= 0; d--) {
            if (++idx[d] < b->shape[d]) break;
            idx[d] = 0;
        }
    }
    v->copy = dst;
    copies_made++;
    return 0;
}

/*
 * Fills *v from `obj`. Inputs are read-only requests and may be copied when
 * their layout cannot be expressed in elements; outputs (writable) never are,
 * so a write through a writable view always lands in the caller's memory.
 * `as`: 0, ATTN_DTYPE_BF16 for a buffer that must be 16-bit integers
 * holding bfloat16 bit patterns, or VIEW_BF16_BITS: 16-bit integers hold
 * bfloat16, any other format is what it says (view_get's rule: NumPy has
 * no bfloat16, so the Python layer passes one as its bits). On failure an
 * exception is set and nothing is held.
 */
int view_get_as(PyObject *obj, const char *name, int writable, attn_dtype as,
                buffer_view *v) {
    /* a torch tensor on the short route: read, never written, in place */
    if (!writable && as != ATTN_DTYPE_BF16 && is_plain_tensor(obj))
        return tensor_view(obj, name, as == VIEW_BF16_BITS, v);
    memset(v, 0, sizeof *v);
    if (PyObject_GetBuffer(obj, &v->buf, writable ? PyBUF_RECORDS : PyBUF_RECORDS_RO) < 0) {
        PyErr_Clear();
        if (writable && PyObject_GetBuffer(obj, &v->buf, PyBUF_RECORDS_RO) == 0) {
            PyBuffer_Release(&v->buf); /* readable: only the write is refused */
            PyErr_Format(PyExc_ValueError, "%s is read-only; it is written in place", name);
            return -1;
        }
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "%s must be an array (a NumPy array or another object with the strided "
                     "buffer protocol), not %.200s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    v->held = 1;
    const Py_buffer *b = &v->buf;
    const int bits = (as == ATTN_DTYPE_BF16 || as == VIEW_BF16_BITS) &&
                     is_16bit_integer(b->format, b->itemsize);
    attn_dtype dt = bits ? ATTN_DTYPE_BF16 : dtype_from_format(b->format, b->itemsize);
    if (dt == 0 || (as == ATTN_DTYPE_BF16 && dt != as)) {
        PyErr_Format(PyExc_TypeError,
                     "%s has element format '%s' (%zd bytes); expected native float32 ('f'), "
                     "float64 ('d'), bool ('?'), float16 ('e') or int32 ('i')%s",
                     name, b->format ? b->format : "B", b->itemsize,
                     as != 0 ? ", or 16-bit integers holding bfloat16" : "");
        goto fail;
    }
    if (b->ndim > ATTN_MAX_RANK) {
        PyErr_Format(PyExc_ValueError, "%s has %d dimensions; attn supports at most %d", name,
                     b->ndim, ATTN_MAX_RANK);
        goto fail;
    }
    if (b->suboffsets != NULL) { /* never granted without PyBUF_INDIRECT */
        PyErr_Format(PyExc_TypeError, "%s is an indirect (PIL-style) buffer", name);
        goto fail;
    }
    attn_tensor *t = &v->t;
    memset(t, 0, sizeof *t);
    t->dtype = dt;
    t->rank = b->ndim;
    t->data = b->buf != NULL ? b->buf : (void *)&empty_data;

    const Py_ssize_t item = b->itemsize;
    if (b->strides == NULL) { /* an exporter may leave C-contiguous strides out */
        Py_ssize_t stride = item;
        for (int d = b->ndim - 1; d >= 0; d--) {
            v->strides[d] = stride;
            stride *= b->shape[d];
        }
    } else {
        memcpy(v->strides, b->strides, sizeof(Py_ssize_t) * (size_t)b->ndim);
    }
    Py_ssize_t numel = 1;
    int huge = 0; /* numel overflowed: a broadcast view too large to copy */
    int exact = ((uintptr_t)b->buf % (uintptr_t)item) == 0;
    for (int d = 0; d < b->ndim; d++) {
        t->shape[d] = (int64_t)b->shape[d];
        if (b->shape[d] <= 0) numel = 0;
        else if (__builtin_mul_overflow(numel, b->shape[d], &numel)) huge = 1;
        /* A stride on a dimension of size 1 is never used. */
        if (b->shape[d] > 1 && v->strides[d] % item != 0) exact = 0;
    }
    if (numel == 0) exact = 1; /* nothing to read; the library rejects it */
    if (exact) {
        for (int d = 0; d < b->ndim; d++)
            t->strides[d] = b->shape[d] > 1 ? (int64_t)(v->strides[d] / item) : 0;
        return 0;
    }
    if (writable) {
        PyErr_Format(PyExc_ValueError,
                     "%s is written in place, so it must be aligned to its items (a copy would "
                     "not be the caller's memory)",
                     name);
        goto fail;
    }
    if (huge) {
        PyErr_Format(PyExc_MemoryError, "%s is misaligned and too large to copy", name);
        goto fail;
    }
    if (copy_contiguous(v, numel) < 0) goto fail;
    t->data = v->copy;
    int64_t stride = 1;
    for (int d = b->ndim - 1; d >= 0; d--) {
        t->strides[d] = stride;
        stride *= t->shape[d];
    }
    return 0;
fail:
    view_release(v);
    return -1;
}

int view_get(PyObject *obj, const char *name, int writable, buffer_view *v) {
    return view_get_as(obj, name, writable, VIEW_BF16_BITS, v);
}

/* An optional input: Py_None leaves *present at 0. */
int view_get_optional(PyObject *obj, const char *name, buffer_view *v, int *present) {
    *present = 0;
    memset(v, 0, sizeof *v);
    if (obj == Py_None) return 0;
    if (view_get(obj, name, 0, v) < 0) return -1;
    *present = 1;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Outputs                                                                   */
/* ------------------------------------------------------------------------ */

PyObject *shape_tuple(int rank, const int64_t *shape) {
    PyObject *t = PyTuple_New(rank);
    if (t == NULL) return NULL;
    for (int d = 0; d < rank; d++) {
        PyObject *n = PyLong_FromLongLong((long long)shape[d]);
        if (n == NULL) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, d, n);
    }
    return t;
}

/* attn_dtype_name(dt) as a Python string, made once per dtype: every
 * output of every call passes one to the allocator (a 16-token call is
 * counted in tenths of a microsecond). A new reference, NULL with an
 * exception set. */
static PyObject *dtype_name_object(attn_dtype dt) {
    static PyObject *names[8];
    const size_t i = (size_t)dt;
    if (i >= sizeof names / sizeof *names) return PyUnicode_FromString(attn_dtype_name(dt));
    if (names[i] == NULL) names[i] = PyUnicode_InternFromString(attn_dtype_name(dt));
    Py_XINCREF(names[i]);
    return names[i];
}

/* Calls empty(shape, dtype_name) and takes a writable view of the result. */
PyObject *new_output(PyObject *empty, int rank, const int64_t *shape, attn_dtype dt,
                     const char *name, buffer_view *v) {
    PyObject *shp = shape_tuple(rank, shape);
    if (shp == NULL) return NULL;
    PyObject *dtn = dtype_name_object(dt);
    PyObject *arr = dtn != NULL ? PyObject_CallFunctionObjArgs(empty, shp, dtn, NULL) : NULL;
    Py_DECREF(shp);
    Py_XDECREF(dtn);
    if (arr == NULL) return NULL;
    if (view_get(arr, name, 1, v) < 0) {
        Py_DECREF(arr);
        return NULL;
    }
    int ok = v->t.dtype == dt && v->t.rank == rank;
    for (int d = 0; ok && d < rank; d++) ok = v->t.shape[d] == shape[d];
    if (!ok) {
        view_release(v);
        Py_DECREF(arr);
        PyErr_Format(PyExc_RuntimeError, "the output allocator returned a wrong %s buffer", name);
        return NULL;
    }
    return arr;
}

/* ------------------------------------------------------------------------ */
/* Argument converters                                                       */
/* ------------------------------------------------------------------------ */

/* `empty`, the output allocator every call takes as a required keyword. */
int require_empty(PyObject *empty, const char *fn) {
    if (empty != NULL) return 0;
    PyErr_Format(PyExc_TypeError, "%s() missing required keyword-only argument: 'empty'", fn);
    return -1;
}

/* A uint64 from any Python int in [0, 2**64). */
int convert_u64(PyObject *obj, void *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "expected an int, not %.200s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(obj);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_ValueError, "expected an int in [0, 2**64)");
        return 0;
    }
    *(uint64_t *)out = (uint64_t)x;
    return 1;
}

/* What the library's messages call attn_sdpa's operands: Python's names. */
static const char *const SDPA_ARG_NAMES[6] = {"query", "key", "value", "out", "weights", "lse"};

int sdpa_params_from(const sdpa_options *o, attn_sdpa_params *p) {
    attn_sdpa_params_init(p);
    p->causal = (attn_causal)o->causal;
    p->enable_gqa = o->gqa;
    p->dropout_p = o->dropout_p;
    p->seed = o->seed;
    p->rng_offset = o->rng_offset;
    p->arg_names = SDPA_ARG_NAMES;
    if (o->scale == Py_None) return 0;
    p->has_scale = 1;
    p->scale = PyFloat_AsDouble(o->scale);
    return p->scale == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* Views of the slopes and sinks, and every field into *p; -1 with an
 * exception set. modifiers_release undoes it either way. */
PyObject *sinks_gradient(PyObject *empty, modifiers *m, attn_sdpa_params *p,
                         sinks_backward_fn run, void *ctx) {
    if (modifiers_apply(m, p) < 0) return NULL;
    if (p->sinks == NULL) {
        PyErr_SetString(PyExc_TypeError, "sinks must be an array, not None");
        return NULL;
    }
    buffer_view d;
    memset(&d, 0, sizeof d);
    PyObject *r = new_output(empty, p->sinks->rank, p->sinks->shape, p->sinks->dtype, "dsinks",
                             &d);
    if (r == NULL) return NULL;
    attn_status st;
    Py_BEGIN_ALLOW_THREADS
    st = run(ctx, p, &d.t);
    Py_END_ALLOW_THREADS
    view_release(&d);
    if (st != ATTN_OK) {
        raise_status(st);
        Py_CLEAR(r);
    }
    return r;
}

int modifiers_apply(modifiers *m, attn_sdpa_params *p) {
    int has_alibi, has_sinks;
    if (view_get_optional(m->alibi, "alibi_slopes", &m->alibi_v, &has_alibi) < 0 ||
        view_get_optional(m->sinks, "sinks", &m->sinks_v, &has_sinks) < 0)
        return -1;
    p->window_left = (int64_t)m->window_left;
    p->window_right = (int64_t)m->window_right;
    p->softcap = m->softcap;
    p->alibi_slopes = has_alibi ? &m->alibi_v.t : NULL;
    p->sinks = has_sinks ? &m->sinks_v.t : NULL;
    return 0;
}

void modifiers_release(modifiers *m) {
    view_release(&m->alibi_v);
    view_release(&m->sinks_v);
}
