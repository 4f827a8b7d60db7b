/*
 * _attn.c — the CPython extension attn._attn: libattn behind the buffer
 * protocol. Written against the CPython C API only (no NumPy C API).
 *
 * Inputs are any objects that export a strided buffer (NumPy arrays, torch
 * CPU tensors viewed through NumPy, memoryviews), or plain CPU torch tensors
 * read through their own methods (_attn_tensors.c). Their strides become
 * attn_tensor element strides, so transposed, sliced, reversed (negative
 * stride) and broadcast (zero stride) inputs are read where they lie. Only a
 * buffer that cannot be described in elements — a stride that is not a
 * multiple of the item size, or a misaligned base address — is copied first.
 *
 * Outputs are allocated by a callable the Python layer passes in (numpy.empty),
 * after the library has validated the inputs and computed the output shapes,
 * and are written through their buffers. The GIL is released while kernels run.
 *
 * The thin Python layer (attn/__init__.py and friends) normalises arguments
 * and gives PyTorch's signatures; this file maps statuses to exceptions:
 * ATTN_ERR_DTYPE -> TypeError, ATTN_ERR_NOMEM -> MemoryError,
 * ATTN_ERR_UNSUPPORTED and ATTN_ERR_COMM (ring attention: a peer or the
 * communicator failed) -> RuntimeError, everything else -> ValueError; a
 * SIGINT during a call stops it (ATTN_ERR_CANCELLED) -> KeyboardInterrupt.
 * A library failure carries its fields, not only its text: the exception
 * has `status` (the attn_status), `status_name` ("ATTN_ERR_SHAPE") and
 * `arg` (attn_last_error_arg(), the C name), which the Python layer maps to
 * its own argument names.
 *
 * The helpers every C file of the extension uses (buffer views, outputs,
 * errors, Ctrl-C, the score modifiers) live in _attn_shared.c; the serving
 * entry points (varlen batches, KV caches) in _attn_serving.c, ring
 * attention over MPI in _attn_ring.c, compiled in when CMake found MPI.
 */
#include "_attn_shared.h" /* Python.h first, as CPython asks */

#include <string.h>

/* ------------------------------------------------------------------------ */
/* sdpa                                                                      */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(sdpa_doc,
             "sdpa(query, key, value, *, empty, attn_mask=None, causal=0, scale=None,\n"
             "     enable_gqa=False, dropout_p=0.0, seed=0, rng_offset=0, want_weights=False,\n"
             "     want_lse=False, lse_for_backward=False, window_left=-1, window_right=-1,\n"
             "     softcap=0.0, alibi_slopes=None, sinks=None) -> (out, weights, lse)\n\n"
             "attn_sdpa() on buffers. causal: 0 none, 1 top-left, 2 bottom-right;\n"
             "scale: None or a float; empty(shape, dtype_name) allocates the outputs.\n"
             "weights and lse are None unless asked for. A library failure's exception\n"
             "has status, status_name and arg; arg and the message name the operands\n"
             "as Python does (query, key, value), the parameters as attn.h does\n"
             "(params.dropout_p, ...). lse_for_backward: the lse of the kernels' own\n"
             "scores (attn_sdpa_params.lse_for_backward), in float64, for sdpa_backward.");

static PyObject *py_sdpa(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"query", "key", "value", "empty", "attn_mask", "causal", "scale",
                             "enable_gqa", "dropout_p", "seed", "rng_offset", "want_weights",
                             "want_lse", "lse_for_backward", "window_left", "window_right",
                             "softcap", "alibi_slopes", "sinks", NULL};
    PyObject *oq, *ok, *ov, *empty = NULL;
    sdpa_options o = {Py_None, Py_None, 0, 0, 0.0, 0, 0};
    modifiers m = MODIFIERS_DEFAULT;
    int want_w = 0, want_lse = 0, lse_for_backward = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$OOiOpdO&O&pppLLdOO:sdpa", kwlist, &oq,
                                     &ok, &ov, &empty, &o.mask, &o.causal, &o.scale, &o.gqa,
                                     &o.dropout_p, convert_u64, &o.seed, convert_u64,
                                     &o.rng_offset, &want_w, &want_lse, &lse_for_backward,
                                     &m.window_left, &m.window_right, &m.softcap, &m.alibi,
                                     &m.sinks) ||
        require_empty(empty, "sdpa") < 0)
        return NULL;
    attn_sdpa_params p;
    if (sdpa_params_from(&o, &p) < 0) return NULL;
    p.lse_for_backward = lse_for_backward;

    buffer_view q, k, v, mask, out, w, lse;
    int has_mask = 0;
    memset(&out, 0, sizeof out);
    memset(&w, 0, sizeof w);
    memset(&lse, 0, sizeof lse);
    PyObject *r_out = NULL, *r_w = NULL, *r_lse = NULL, *result = NULL;
    if (view_get(oq, "query", 0, &q) < 0) return NULL;
    if (view_get(ok, "key", 0, &k) < 0) {
        view_release(&q);
        return NULL;
    }
    if (view_get(ov, "value", 0, &v) < 0) {
        view_release(&q);
        view_release(&k);
        return NULL;
    }
    if (view_get_optional(o.mask, "attn_mask", &mask, &has_mask) < 0) goto done;
    if (has_mask) p.attn_mask = &mask.t;
    if (modifiers_apply(&m, &p) < 0) goto done;

    /* Validate everything and learn the shapes before allocating. */
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    attn_status st = attn_sdpa_out_shape(&q.t, &k.t, &v.t, &p, &rank, shape);
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    const attn_dtype dt = q.t.dtype;
    r_out = new_output(empty, rank, shape, dt, "out", &out);
    if (r_out == NULL) goto done;
    if (want_w) {
        int64_t ws[ATTN_MAX_RANK];
        memcpy(ws, shape, sizeof ws);
        ws[rank - 1] = k.t.shape[k.t.rank - 2]; /* S */
        r_w = new_output(empty, rank, ws, dt, "weights", &w);
        if (r_w == NULL) goto done;
    }
    if (want_lse) {
        /* for the backward: float64, whose digits float32 would round off
         * and every weight the backward recomputes would inherit */
        const attn_dtype lse_dt = lse_dtype_of(dt, lse_for_backward);
        r_lse = new_output(empty, rank - 1, shape, lse_dt, "lse", &lse);
        if (r_lse == NULL) goto done;
    }
    /* multiply-adds: out's elements times S times (E + Ev) / Ev */
    double work = (double)k.t.shape[k.t.rank - 2] *
                  (double)(q.t.shape[q.t.rank - 1] + v.t.shape[v.t.rank - 1]);
    for (int d = 0; d < rank - 1; d++) work *= (double)shape[d];
    interrupt_guard guard;
    interrupt_guard_arm_for(&guard, work);
    Py_BEGIN_ALLOW_THREADS
    st = attn_sdpa(&q.t, &k.t, &v.t, &p, &out.t, want_w ? &w.t : NULL, want_lse ? &lse.t : NULL);
    Py_END_ALLOW_THREADS
    if (interrupt_guard_disarm(&guard, st) < 0) goto done;
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    result = Py_BuildValue("(OOO)", r_out, r_w ? r_w : Py_None, r_lse ? r_lse : Py_None);
done:
    view_release(&q);
    view_release(&k);
    view_release(&v);
    view_release(&mask);
    modifiers_release(&m);
    view_release(&out);
    view_release(&w);
    view_release(&lse);
    Py_XDECREF(r_out);
    Py_XDECREF(r_w);
    Py_XDECREF(r_lse);
    return result;
}

/* ------------------------------------------------------------------------ */
/* sdpa_backward                                                             */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(sdpa_backward_doc,
             "sdpa_backward(dout, query, key, value, out, lse, *, empty, attn_mask=None,\n"
             "     causal=0, scale=None, enable_gqa=False, dropout_p=0.0, seed=0,\n"
             "     rng_offset=0, want_dq=True, want_dk=True, want_dv=True, want_dmask=False,\n"
             "     window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, sinks=None)\n"
             "     -> (dq, dk, dv, dmask)\n\n"
             "attn_sdpa_backward() on buffers: the gradients of sdpa(query, key, value,\n"
             "...) given dout, and that call's out and lse (the same options, so that\n"
             "dropout replays its keep mask). Each gradient is shaped like its input\n"
             "(dmask like attn_mask, which must then be float) and is None unless asked\n"
             "for. Errors as sdpa's; the gradients and dout keep the C names.");

/* The backward's operands: inputs first, then the gradients it writes. */
enum { BW_DOUT, BW_Q, BW_K, BW_V, BW_OUT, BW_LSE, BW_MASK, BW_NIN };
enum { BW_DQ, BW_DK, BW_DV, BW_DMASK, BW_NGRAD };

typedef struct backward_call {
    buffer_view in[BW_NIN];
    buffer_view grad[BW_NGRAD];
    PyObject *result[BW_NGRAD];
    int want[BW_NGRAD];
    int has_mask;
} backward_call;

static void backward_call_release(backward_call *c) {
    for (int i = 0; i < BW_NIN; i++) view_release(&c->in[i]);
    for (int g = 0; g < BW_NGRAD; g++) {
        view_release(&c->grad[g]);
        Py_CLEAR(c->result[g]);
    }
}

/* Views of every input; -1 with an exception set (nothing else held). */
static int backward_inputs(backward_call *c, PyObject *const objs[BW_NIN]) {
    static const char *const names[BW_NIN] = {"dout", "query", "key", "value",
                                              "out", "lse", "attn_mask"};
    for (int i = 0; i < BW_MASK; i++)
        if (view_get(objs[i], names[i], 0, &c->in[i]) < 0) return -1;
    return view_get_optional(objs[BW_MASK], names[BW_MASK], &c->in[BW_MASK], &c->has_mask);
}

/* Each wanted gradient, allocated like the input it belongs to. dmask is
 * only allocated for a float mask: for anything else the library's own
 * check says why there is no such gradient. */
static int backward_outputs(backward_call *c, PyObject *empty) {
    static const char *const names[BW_NGRAD] = {"dq", "dk", "dv", "dmask"};
    static const int input_of[BW_NGRAD] = {BW_Q, BW_K, BW_V, BW_MASK};
    for (int g = 0; g < BW_NGRAD; g++) {
        const attn_tensor *like = &c->in[input_of[g]].t;
        if (!c->want[g] || (g == BW_DMASK && (!c->has_mask || like->dtype == ATTN_DTYPE_BOOL)))
            continue;
        c->result[g] = new_output(empty, like->rank, like->shape, like->dtype, names[g],
                                  &c->grad[g]);
        if (c->result[g] == NULL) return -1;
    }
    return 0;
}

/* The library call, GIL released and Ctrl-C honoured as in sdpa. */
static attn_status backward_run(backward_call *c, const attn_sdpa_params *p) {
    attn_tensor *g[BW_NGRAD];
    for (int i = 0; i < BW_NGRAD; i++) g[i] = c->result[i] != NULL ? &c->grad[i].t : NULL;
    /* A wanted dmask without a float mask to allocate it from: pass a
     * one-element placeholder so the library refuses it with its own
     * message (it names the mask's dtype, or says there is none). */
    double scratch = 0.0;
    const int64_t one = 1;
    attn_tensor none;
    attn_tensor_init(&none, &scratch, ATTN_DTYPE_F64, 1, &one);
    if (c->want[BW_DMASK] && g[BW_DMASK] == NULL) g[BW_DMASK] = &none;
    attn_status st;
    Py_BEGIN_ALLOW_THREADS
    st = attn_sdpa_backward(&c->in[BW_DOUT].t, &c->in[BW_Q].t, &c->in[BW_K].t, &c->in[BW_V].t,
                            &c->in[BW_OUT].t, &c->in[BW_LSE].t, p, g[BW_DQ], g[BW_DK],
                            g[BW_DV], g[BW_DMASK]);
    Py_END_ALLOW_THREADS
    return st;
}

static PyObject *py_sdpa_backward(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"dout", "query", "key", "value", "out", "lse", "empty",
                             "attn_mask", "causal", "scale", "enable_gqa", "dropout_p",
                             "seed", "rng_offset", "want_dq", "want_dk", "want_dv",
                             "want_dmask", "window_left", "window_right", "softcap",
                             "alibi_slopes", "sinks", NULL};
    PyObject *objs[BW_NIN], *empty = NULL;
    sdpa_options o = {Py_None, Py_None, 0, 0, 0.0, 0, 0};
    modifiers m = MODIFIERS_DEFAULT;
    backward_call c;
    memset(&c, 0, sizeof c);
    c.want[BW_DQ] = c.want[BW_DK] = c.want[BW_DV] = 1;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOOOOO|$OOiOpdO&O&ppppLLdOO:sdpa_backward", kwlist, &objs[BW_DOUT],
            &objs[BW_Q], &objs[BW_K], &objs[BW_V], &objs[BW_OUT], &objs[BW_LSE], &empty,
            &o.mask, &o.causal, &o.scale, &o.gqa, &o.dropout_p, convert_u64, &o.seed,
            convert_u64, &o.rng_offset, &c.want[BW_DQ], &c.want[BW_DK], &c.want[BW_DV],
            &c.want[BW_DMASK], &m.window_left, &m.window_right, &m.softcap, &m.alibi,
            &m.sinks) ||
        require_empty(empty, "sdpa_backward") < 0)
        return NULL;
    objs[BW_MASK] = o.mask;
    attn_sdpa_params p;
    if (sdpa_params_from(&o, &p) < 0) return NULL;
    PyObject *result = NULL;
    if (backward_inputs(&c, objs) < 0 || modifiers_apply(&m, &p) < 0) goto done;
    if (c.has_mask) p.attn_mask = &c.in[BW_MASK].t;
    /* The forward's own validation first, so a bad query or option is
     * reported before any gradient is allocated. */
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    attn_status st = attn_sdpa_out_shape(&c.in[BW_Q].t, &c.in[BW_K].t, &c.in[BW_V].t, &p,
                                         &rank, shape);
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    if (backward_outputs(&c, empty) < 0) goto done;
    interrupt_guard guard;
    interrupt_guard_arm(&guard);
    st = backward_run(&c, &p);
    if (interrupt_guard_disarm(&guard, st) < 0) goto done;
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    result = PyTuple_New(BW_NGRAD);
    for (int g = 0; result != NULL && g < BW_NGRAD; g++) {
        PyObject *r = c.result[g] != NULL ? c.result[g] : Py_None;
        Py_INCREF(r);
        PyTuple_SET_ITEM(result, g, r);
    }
done:
    backward_call_release(&c);
    modifiers_release(&m);
    return result;
}

/* ------------------------------------------------------------------------ */
/* sdpa_sinks_backward                                                       */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(sdpa_sinks_backward_doc,
             "sdpa_sinks_backward(dout, out, lse, sinks, *, empty, causal=0, scale=None,\n"
             "     enable_gqa=False, dropout_p=0.0, seed=0, rng_offset=0, window_left=-1,\n"
             "     window_right=-1, softcap=0.0, alibi_slopes=None) -> dsinks\n\n"
             "attn_sdpa_sinks_backward() on buffers: the gradient of the sinks of an sdpa\n"
             "call (its out and lse, the same options), shaped like sinks.");

/* attn_sdpa_sinks_backward on ctx's views (dout, out, lse). */
static attn_status sinks_backward_run(void *ctx, const attn_sdpa_params *p, attn_tensor *dsinks) {
    const buffer_view *in = ctx;
    return attn_sdpa_sinks_backward(&in[0].t, &in[1].t, &in[2].t, p, dsinks);
}

static PyObject *py_sdpa_sinks_backward(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"dout", "out", "lse", "sinks", "empty", "causal", "scale",
                             "enable_gqa", "dropout_p", "seed", "rng_offset", "window_left",
                             "window_right", "softcap", "alibi_slopes", NULL};
    PyObject *odout, *oout, *olse, *empty = NULL;
    sdpa_options o = {Py_None, Py_None, 0, 0, 0.0, 0, 0};
    modifiers m = MODIFIERS_DEFAULT;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOO|$OiOpdO&O&LLdO:sdpa_sinks_backward",
                                     kwlist, &odout, &oout, &olse, &m.sinks, &empty, &o.causal,
                                     &o.scale, &o.gqa, &o.dropout_p, convert_u64, &o.seed,
                                     convert_u64, &o.rng_offset, &m.window_left,
                                     &m.window_right, &m.softcap, &m.alibi) ||
        require_empty(empty, "sdpa_sinks_backward") < 0)
        return NULL;
    attn_sdpa_params p;
    if (sdpa_params_from(&o, &p) < 0) return NULL;
    buffer_view in[3];
    memset(in, 0, sizeof in);
    static const char *const names[3] = {"dout", "out", "lse"};
    PyObject *objs[3] = {odout, oout, olse}, *r = NULL;
    for (int i = 0; i < 3; i++)
        if (view_get(objs[i], names[i], 0, &in[i]) < 0) goto done;
    r = sinks_gradient(empty, &m, &p, sinks_backward_run, in);
done:
    for (int i = 0; i < 3; i++) view_release(&in[i]);
    modifiers_release(&m);
    return r;
}

/* ------------------------------------------------------------------------ */
/* MHA: the module object                                                    */
/* ------------------------------------------------------------------------ */

/*
 * _attn.MHA owns one attn_mha. Its parameters live in one contiguous block
 * of the module's storage, which the object exports through the buffer
 * protocol as a 1-D array; the Python layer slices it into parameter views
 * (param_layout() gives each one's name, shape and element offset), so
 * writing to m.in_proj_weight writes the module's own weights. A NumPy view
 * keeps the object, and so the storage, alive.
 */
typedef struct MHAObject {
    PyObject_HEAD
    attn_mha *mha;
    attn_mha_config cfg; /* derived fields filled in */
    void *base;          /* first parameter: the start of the storage */
    Py_ssize_t numel;    /* elements in all parameters */
} MHAObject;

static void mha_dealloc(MHAObject *self) {
    attn_mha_destroy(self->mha);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int mha_init(MHAObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"embed_dim", "num_heads", "head_dim", "kdim", "vdim",
                             "bias", "add_bias_kv", "add_zero_attn", "batch_first",
                             "dropout", "dtype", "init_seed", NULL};
    long long embed_dim, num_heads, head_dim = 0, kdim = 0, vdim = 0;
    int bias = 1, add_bias_kv = 0, add_zero_attn = 0, batch_first = 0;
    double dropout = 0.0;
    const char *dtype = "float32";
    uint64_t init_seed = 0;
    if (self->mha != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "MHA objects cannot be initialised twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL|LLLppppdsO&:MHA", kwlist, &embed_dim,
                                     &num_heads, &head_dim, &kdim, &vdim, &bias, &add_bias_kv,
                                     &add_zero_attn, &batch_first, &dropout, &dtype, convert_u64,
                                     &init_seed))
        return -1;
    attn_mha_config c;
    attn_mha_config_init(&c, embed_dim, num_heads);
    c.head_dim = head_dim;
    c.kdim = kdim;
    c.vdim = vdim;
    c.bias = bias;
    c.add_bias_kv = add_bias_kv;
    c.add_zero_attn = add_zero_attn;
    c.batch_first = batch_first;
    c.dropout = dropout;
    c.init_seed = init_seed;
    if (strcmp(dtype, "float32") == 0) {
        c.dtype = ATTN_DTYPE_F32;
    } else if (strcmp(dtype, "float64") == 0) {
        c.dtype = ATTN_DTYPE_F64;
    } else if (strcmp(dtype, "float16") == 0) {
        c.dtype = ATTN_DTYPE_F16;
    } else if (strcmp(dtype, "bfloat16") == 0) {
        c.dtype = ATTN_DTYPE_BF16;
    } else {
        PyErr_Format(PyExc_TypeError,
                     "dtype is %s; expected float32, float64, float16 or bfloat16", dtype);
        return -1;
    }
    attn_mha *m = NULL;
    attn_status st;
    Py_BEGIN_ALLOW_THREADS /* initialising a large module takes a while */
    st = attn_mha_create(&c, &m);
    Py_END_ALLOW_THREADS
    if (st != ATTN_OK) {
        raise_status(st);
        return -1;
    }
    self->mha = m;
    self->cfg.struct_size = sizeof self->cfg; /* how much get_config may write */
    attn_mha_get_config(m, &self->cfg);
    self->numel = 0;
    for (int i = 0; i < attn_mha_param_count(m); i++) {
        attn_tensor t;
        attn_mha_param_at(m, i, NULL, &t);
        if (i == 0) self->base = t.data;
        self->numel += (Py_ssize_t)attn_tensor_numel(&t);
    }
    return 0;
}

static int mha_ready(MHAObject *self) {
    if (self->mha != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "MHA object was not initialised");
    return 0;
}

static int mha_getbuffer(MHAObject *self, Py_buffer *view, int flags) {
    if (self->mha == NULL) {
        PyErr_SetString(PyExc_BufferError, "MHA object was not initialised");
        view->obj = NULL;
        return -1;
    }
    const Py_ssize_t item = (Py_ssize_t)attn_dtype_size(self->cfg.dtype);
    if (PyBuffer_FillInfo(view, (PyObject *)self, self->base, self->numel * item, 0, flags) < 0)
        return -1;
    /* bfloat16 as 16-bit integers holding its bits (NumPy has no bfloat16) */
    static char *const formats[] = {[ATTN_DTYPE_F32] = "f", [ATTN_DTYPE_F64] = "d",
                                    [ATTN_DTYPE_F16] = "e", [ATTN_DTYPE_BF16] = "h"};
    if (flags & PyBUF_FORMAT) view->format = formats[self->cfg.dtype];
    view->itemsize = item;
    if (flags & PyBUF_ND) view->shape = &self->numel;
    if ((flags & PyBUF_STRIDES) == PyBUF_STRIDES) view->strides = &view->itemsize;
    return 0;
}

static PyBufferProcs mha_as_buffer = {(getbufferproc)mha_getbuffer, NULL};

static PyObject *mha_param_layout(MHAObject *self, PyObject *noargs) {
    (void)noargs;
    if (!mha_ready(self)) return NULL;
    const int n = attn_mha_param_count(self->mha);
    const size_t item = attn_dtype_size(self->cfg.dtype);
    PyObject *list = PyList_New(n);
    if (list == NULL) return NULL;
    for (int i = 0; i < n; i++) {
        const char *name;
        attn_tensor t;
        attn_mha_param_at(self->mha, i, &name, &t);
        PyObject *shape = shape_tuple(t.rank, t.shape);
        Py_ssize_t offset = (Py_ssize_t)(((char *)t.data - (char *)self->base) / (ptrdiff_t)item);
        PyObject *entry = shape ? Py_BuildValue("(sNn)", name, shape, offset) : NULL;
        if (entry == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, entry);
    }
    return list;
}

static PyObject *mha_config(MHAObject *self, PyObject *noargs) {
    (void)noargs;
    if (!mha_ready(self)) return NULL;
    const attn_mha_config *c = &self->cfg;
    return Py_BuildValue("{sLsLsLsLsLsOsOsOsOsdss}", "embed_dim", (long long)c->embed_dim,
                         "num_heads", (long long)c->num_heads, "head_dim", (long long)c->head_dim,
                         "kdim", (long long)c->kdim, "vdim", (long long)c->vdim, "bias",
                         c->bias ? Py_True : Py_False, "add_bias_kv",
                         c->add_bias_kv ? Py_True : Py_False, "add_zero_attn",
                         c->add_zero_attn ? Py_True : Py_False, "batch_first",
                         c->batch_first ? Py_True : Py_False, "dropout", c->dropout, "dtype",
                         attn_dtype_name(c->dtype));
}

PyDoc_STRVAR(mha_forward_doc,
             "forward(query, key, value, *, empty, key_padding_mask=None, attn_mask=None,\n"
             "        need_weights=False, average_attn_weights=True, is_causal=False,\n"
             "        training=False, dropout=None, seed=0, rng_offset=0, batch_first=-1)\n"
             "        -> (out, weights or None)\n\n"
             "dropout: this call's probability, None for the module's (which may change\n"
             "after construction); batch_first: this call's layout, -1 for the module's.");

PyDoc_STRVAR(mha_forward_train_doc,
             "forward_train(query, key, value, *, empty, ...same keywords as forward)\n"
             "        -> (out, weights or None, saved)\n\n"
             "attn_mha_forward_train: the forward, and a Saved context holding what\n"
             "backward() needs (freed with the object).");

/* attn_mha_saved as a Python object: the context is freed when the object
 * is; it holds no pointer to Python memory. */
typedef struct SavedObject {
    PyObject_HEAD
    attn_mha_saved *saved;
} SavedObject;

static void saved_dealloc(SavedObject *self) {
    attn_mha_saved_destroy(self->saved);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject SavedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "attn._attn.Saved",
    .tp_basicsize = sizeof(SavedObject),
    .tp_dealloc = (destructor)saved_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What MHA.forward_train keeps for MHA.backward (an attn_mha_saved).",
};

/* forward and forward_train: the same arguments; `train` adds the Saved. */
static PyObject *mha_run(MHAObject *self, PyObject *args, PyObject *kwds, bool train) {
    static char *kwlist[] = {"query", "key", "value", "empty", "key_padding_mask",
                             "attn_mask", "need_weights", "average_attn_weights", "is_causal",
                             "training", "dropout", "seed", "rng_offset", "batch_first", NULL};
    PyObject *oq, *ok, *ov, *empty = NULL, *okpm = Py_None, *omask = Py_None;
    PyObject *odropout = Py_None;
    int need_w = 0;
    attn_mha_forward_params fp;
    attn_mha_forward_params_init(&fp);
    if (!mha_ready(self)) return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$OOOppppOO&O&i:forward", kwlist, &oq, &ok,
                                     &ov, &empty, &okpm, &omask, &need_w,
                                     &fp.average_attn_weights, &fp.is_causal, &fp.training,
                                     &odropout, convert_u64, &fp.seed, convert_u64,
                                     &fp.rng_offset, &fp.batch_first) ||
        require_empty(empty, "forward") < 0)
        return NULL;
    if (odropout != Py_None) {
        fp.has_dropout = 1;
        fp.dropout = PyFloat_AsDouble(odropout);
        if (fp.dropout == -1.0 && PyErr_Occurred()) return NULL;
    }

    buffer_view q, k, v, kpm, mask, out, w;
    int has_kpm = 0, has_mask = 0;
    memset(&k, 0, sizeof k);
    memset(&v, 0, sizeof v);
    memset(&kpm, 0, sizeof kpm);
    memset(&mask, 0, sizeof mask);
    memset(&out, 0, sizeof out);
    memset(&w, 0, sizeof w);
    PyObject *r_out = NULL, *r_w = NULL, *result = NULL;
    SavedObject *r_saved = NULL;
    attn_mha_saved *saved = NULL;
    if (view_get(oq, "query", 0, &q) < 0) return NULL;
    if (view_get(ok, "key", 0, &k) < 0 || view_get(ov, "value", 0, &v) < 0 ||
        view_get_optional(okpm, "key_padding_mask", &kpm, &has_kpm) < 0 ||
        view_get_optional(omask, "attn_mask", &mask, &has_mask) < 0)
        goto done;
    if (has_kpm) fp.key_padding_mask = &kpm.t;
    if (has_mask) fp.attn_mask = &mask.t;

    int orank, wrank = 0;
    int64_t oshape[ATTN_MAX_RANK], wshape[ATTN_MAX_RANK];
    attn_status st =
        attn_mha_out_shapes(self->mha, &q.t, &k.t, &fp, need_w, &orank, oshape, &wrank, wshape);
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    r_out = new_output(empty, orank, oshape, self->cfg.dtype, "out", &out);
    if (r_out == NULL) goto done;
    if (need_w) {
        r_w = new_output(empty, wrank, wshape, self->cfg.dtype, "weights", &w);
        if (r_w == NULL) goto done;
    }
    interrupt_guard guard;
    interrupt_guard_arm(&guard);
    Py_BEGIN_ALLOW_THREADS
    if (train)
        st = attn_mha_forward_train(self->mha, &q.t, &k.t, &v.t, &fp, &out.t,
                                    need_w ? &w.t : NULL, &saved);
    else
        st = attn_mha_forward(self->mha, &q.t, &k.t, &v.t, &fp, &out.t, need_w ? &w.t : NULL);
    Py_END_ALLOW_THREADS
    if (interrupt_guard_disarm(&guard, st) < 0) goto done;
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    if (!train) {
        result = Py_BuildValue("(OO)", r_out, r_w ? r_w : Py_None);
        goto done;
    }
    r_saved = PyObject_New(SavedObject, &SavedType);
    if (r_saved == NULL) goto done;
    r_saved->saved = saved;
    saved = NULL; /* the object owns it now */
    result = Py_BuildValue("(OOO)", r_out, r_w ? r_w : Py_None, (PyObject *)r_saved);
done:
    attn_mha_saved_destroy(saved);
    Py_XDECREF(r_saved);
    view_release(&q);
    view_release(&k);
    view_release(&v);
    view_release(&kpm);
    view_release(&mask);
    view_release(&out);
    view_release(&w);
    Py_XDECREF(r_out);
    Py_XDECREF(r_w);
    return result;
}

static PyObject *mha_forward(MHAObject *self, PyObject *args, PyObject *kwds) {
    return mha_run(self, args, kwds, false);
}

static PyObject *mha_forward_train(MHAObject *self, PyObject *args, PyObject *kwds) {
    return mha_run(self, args, kwds, true);
}

static PyTypeObject MHAType;

PyDoc_STRVAR(mha_backward_doc,
             "backward(saved, query, key, value, dout, *, empty, need_dquery=True,\n"
             "         need_dkey=True, need_dvalue=True, grads=None)\n"
             "        -> (dquery or None, dkey or None, dvalue or None)\n\n"
             "attn_mha_backward: the gradients of the inputs, new arrays shaped like\n"
             "them; grads (an MHA of the same configuration, or None) receives the\n"
             "parameters' gradients in its storage. query, key and value are those\n"
             "the forward_train that made `saved` was given.");

/* The gradients of the inputs as new outputs (NULL where not wanted). */
static int grad_outputs(PyObject *empty, const buffer_view in[3], const int want[3],
                        attn_dtype dt, buffer_view d[3], PyObject *r[3]) {
    static const char *const names[3] = {"dquery", "dkey", "dvalue"};
    for (int i = 0; i < 3; i++) {
        if (!want[i]) continue;
        r[i] = new_output(empty, in[i].t.rank, in[i].t.shape, dt, names[i], &d[i]);
        if (r[i] == NULL) return -1;
    }
    return 0;
}

static PyObject *mha_backward(MHAObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"saved", "query", "key", "value", "dout", "empty", "need_dquery",
                             "need_dkey", "need_dvalue", "grads", NULL};
    PyObject *osaved, *o[4], *empty = NULL, *ograds = Py_None;
    int want[3] = {1, 1, 1};
    if (!mha_ready(self)) return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OOOO|$OpppO:backward", kwlist, &SavedType,
                                     &osaved, &o[0], &o[1], &o[2], &o[3], &empty, &want[0],
                                     &want[1], &want[2], &ograds) ||
        require_empty(empty, "backward") < 0)
        return NULL;
    if (ograds != Py_None && !PyObject_TypeCheck(ograds, &MHAType)) {
        PyErr_Format(PyExc_TypeError, "grads must be an MHA or None, not %.200s",
                     Py_TYPE(ograds)->tp_name);
        return NULL;
    }
    attn_mha *grads = ograds == Py_None ? NULL : ((MHAObject *)ograds)->mha;
    if (ograds != Py_None && grads == NULL) return mha_ready((MHAObject *)ograds), NULL;
    static const char *const in_names[4] = {"query", "key", "value", "dout"};
    buffer_view in[4], d[3];
    PyObject *r[3] = {NULL, NULL, NULL}, *result = NULL;
    memset(in, 0, sizeof in);
    memset(d, 0, sizeof d);
    for (int i = 0; i < 4; i++)
        if (view_get(o[i], in_names[i], 0, &in[i]) < 0) goto done;
    if (grad_outputs(empty, in, want, self->cfg.dtype, d, r) < 0) goto done;
    const attn_mha_saved *saved = ((SavedObject *)osaved)->saved;
    attn_status st;
    interrupt_guard guard;
    interrupt_guard_arm(&guard);
    Py_BEGIN_ALLOW_THREADS
    st = attn_mha_backward(self->mha, saved, &in[0].t, &in[1].t, &in[2].t, &in[3].t,
                           want[0] ? &d[0].t : NULL, want[1] ? &d[1].t : NULL,
                           want[2] ? &d[2].t : NULL, grads);
    Py_END_ALLOW_THREADS
    if (interrupt_guard_disarm(&guard, st) < 0) goto done;
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    result = Py_BuildValue("(OOO)", r[0] ? r[0] : Py_None, r[1] ? r[1] : Py_None,
                           r[2] ? r[2] : Py_None);
done:
    for (int i = 0; i < 4; i++) view_release(&in[i]);
    for (int i = 0; i < 3; i++) {
        view_release(&d[i]);
        Py_XDECREF(r[i]);
    }
    return result;
}

static PyMethodDef mha_methods[] = {
    {"param_layout", (PyCFunction)mha_param_layout, METH_NOARGS,
     "[(name, shape, element offset)] of the parameters, in state_dict() order"},
    {"config", (PyCFunction)mha_config, METH_NOARGS,
     "the configuration, with head_dim, kdim and vdim resolved"},
    {"forward", (PyCFunction)(void (*)(void))mha_forward, METH_VARARGS | METH_KEYWORDS,
     mha_forward_doc},
    {"forward_train", (PyCFunction)(void (*)(void))mha_forward_train,
     METH_VARARGS | METH_KEYWORDS, mha_forward_train_doc},
    {"backward", (PyCFunction)(void (*)(void))mha_backward, METH_VARARGS | METH_KEYWORDS,
     mha_backward_doc},
    {NULL, NULL, 0, NULL}};

static PyTypeObject MHAType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "attn._attn.MHA",
    .tp_basicsize = sizeof(MHAObject),
    .tp_dealloc = (destructor)mha_dealloc,
    .tp_as_buffer = &mha_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "MHA(embed_dim, num_heads, head_dim=0, kdim=0, vdim=0, bias=True,\n"
              "    add_bias_kv=False, add_zero_attn=False, batch_first=False, dropout=0.0,\n"
              "    dtype='float32', init_seed=0)\n\n"
              "An attn_mha. Exports its parameter storage as a 1-D buffer.",
    .tp_methods = mha_methods,
    .tp_init = (initproc)mha_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------ */
/* Transformer encoder layer                                                 */
/* ------------------------------------------------------------------------ */

/*
 * _attn.EncoderLayer owns one attn_encoder_layer. Its parameters live in
 * two blocks (the attention's and the layer's own), so they are not
 * exported as one buffer: load() copies a list of contiguous arrays in
 * param_layout() order into them (one memcpy each), params() copies them
 * out.
 */
typedef struct EncoderObject {
    PyObject_HEAD
    attn_encoder_layer *layer;
    attn_dtype dtype;
} EncoderObject;

static void encoder_dealloc(EncoderObject *self) {
    attn_encoder_layer_destroy(self->layer);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int activation_from(const char *name, attn_activation *act) {
    if (strcmp(name, "relu") == 0) {
        *act = ATTN_ACTIVATION_RELU;
    } else if (strcmp(name, "gelu") == 0) {
        *act = ATTN_ACTIVATION_GELU;
    } else if (strcmp(name, "gelu_tanh") == 0) {
        *act = ATTN_ACTIVATION_GELU_TANH;
    } else {
        PyErr_Format(PyExc_ValueError, "activation is '%s'; expected relu, gelu or gelu_tanh",
                     name);
        return -1;
    }
    return 0;
}

static int encoder_init(EncoderObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"d_model", "nhead", "dim_feedforward", "dropout", "activation",
                             "layer_norm_eps", "batch_first", "norm_first", "bias", "dtype",
                             "init_seed", NULL};
    long long d_model, nhead, dff = 2048;
    double dropout = 0.1, eps = 1e-5;
    const char *act = "relu", *dtype = "float32";
    int batch_first = 0, norm_first = 0, bias = 1;
    uint64_t init_seed = 0;
    if (self->layer != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "EncoderLayer objects cannot be initialised twice");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "LL|LdsdpppsO&:EncoderLayer", kwlist,
                                     &d_model, &nhead, &dff, &dropout, &act, &eps, &batch_first,
                                     &norm_first, &bias, &dtype, convert_u64, &init_seed))
        return -1;
    attn_encoder_layer_config c;
    attn_encoder_layer_config_init(&c, d_model, nhead);
    c.dim_feedforward = dff;
    c.dropout = dropout;
    c.layer_norm_eps = eps;
    c.batch_first = batch_first;
    c.norm_first = norm_first;
    c.bias = bias;
    c.init_seed = init_seed;
    if (activation_from(act, &c.activation) < 0) return -1;
    if (strcmp(dtype, "float32") == 0) {
        c.dtype = ATTN_DTYPE_F32;
    } else if (strcmp(dtype, "float64") == 0) {
        c.dtype = ATTN_DTYPE_F64;
    } else if (strcmp(dtype, "float16") == 0) {
        c.dtype = ATTN_DTYPE_F16;
    } else if (strcmp(dtype, "bfloat16") == 0) {
        c.dtype = ATTN_DTYPE_BF16;
    } else {
        PyErr_Format(PyExc_TypeError,
                     "dtype is %s; expected float32, float64, float16 or bfloat16", dtype);
        return -1;
    }
    attn_status st;
    Py_BEGIN_ALLOW_THREADS
    st = attn_encoder_layer_create(&c, &self->layer);
    Py_END_ALLOW_THREADS
    if (st != ATTN_OK) {
        raise_status(st);
        return -1;
    }
    self->dtype = c.dtype;
    return 0;
}

static int encoder_ready(EncoderObject *self) {
    if (self->layer != NULL) return 1;
    PyErr_SetString(PyExc_RuntimeError, "EncoderLayer object was not initialised");
    return 0;
}

/* [(name, shape)] in state_dict order. */
static PyObject *encoder_param_layout(EncoderObject *self, PyObject *noargs) {
    (void)noargs;
    if (!encoder_ready(self)) return NULL;
    const int n = attn_encoder_layer_param_count(self->layer);
    PyObject *list = PyList_New(n);
    for (int i = 0; list != NULL && i < n; i++) {
        const char *name;
        attn_tensor t;
        attn_encoder_layer_param_at(self->layer, i, &name, &t);
        PyObject *shape = shape_tuple(t.rank, t.shape);
        PyObject *entry = shape ? Py_BuildValue("(sN)", name, shape) : NULL;
        if (entry == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, i, entry);
    }
    return list;
}

/* load([arrays]): each C-contiguous, of the layer's dtype and its
 * parameter's element count. Checks every array before copying any. */
static PyObject *encoder_load(EncoderObject *self, PyObject *seq) {
    if (!encoder_ready(self)) return NULL;
    const int n = attn_encoder_layer_param_count(self->layer);
    PyObject *fast = PySequence_Fast(seq, "load() takes a sequence of arrays");
    if (fast == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(fast) != n) {
        PyErr_Format(PyExc_ValueError, "load() takes %d arrays, got %zd", n,
                     PySequence_Fast_GET_SIZE(fast));
        Py_DECREF(fast);
        return NULL;
    }
    Py_buffer *views = PyMem_Calloc((size_t)n, sizeof *views);
    int got = 0, ok = views != NULL;
    if (views == NULL) PyErr_NoMemory();
    const size_t item = attn_dtype_size(self->dtype);
    for (; ok && got < n; got++) {
        const char *name;
        attn_tensor t;
        attn_encoder_layer_param_at(self->layer, got, &name, &t);
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, got), &views[got],
                               PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            ok = 0;
            break;
        }
        const char *f = views[got].format ? views[got].format : "B";
        if (f[0] == '<' || f[0] == '=' || f[0] == '@') f++;
        /* the struct format of each dtype: bfloat16 as 16-bit integers (its bits) */
        static const char formats[] = {[ATTN_DTYPE_F32] = 'f', [ATTN_DTYPE_F64] = 'd',
                                       [ATTN_DTYPE_F16] = 'e', [ATTN_DTYPE_BF16] = 'h'};
        const bool right = views[got].itemsize == (Py_ssize_t)item &&
                           f[0] == formats[self->dtype] && f[1] == '\0' &&
                           views[got].len == (Py_ssize_t)(attn_tensor_numel(&t) * (int64_t)item);
        if (!right) {
            PyErr_Format(PyExc_ValueError, "load(): %s must be a contiguous %s array of %lld "
                         "elements", name, attn_dtype_name(self->dtype),
                         (long long)attn_tensor_numel(&t));
            ok = 0; /* (the loop's own step counts this view among those held) */
        }
    }
    for (int i = 0; ok && i < n; i++) {
        attn_tensor t;
        attn_encoder_layer_param_at(self->layer, i, NULL, &t);
        memcpy(t.data, views[i].buf, (size_t)views[i].len);
    }
    for (int i = 0; views != NULL && i < got && i < n; i++)
        if (views[i].obj != NULL) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    Py_DECREF(fast);
    if (!ok) return NULL;
    Py_RETURN_NONE;
}

/* params(empty): copies of the parameters, in state_dict order. */
static PyObject *encoder_params(EncoderObject *self, PyObject *empty) {
    if (!encoder_ready(self)) return NULL;
    const int n = attn_encoder_layer_param_count(self->layer);
    PyObject *list = PyList_New(n);
    for (int i = 0; list != NULL && i < n; i++) {
        attn_tensor t;
        buffer_view v;
        attn_encoder_layer_param_at(self->layer, i, NULL, &t);
        PyObject *arr = new_output(empty, t.rank, t.shape, self->dtype, "param", &v);
        if (arr == NULL) {
            Py_CLEAR(list);
            break;
        }
        memcpy(v.t.data, t.data, (size_t)attn_tensor_numel(&t) * attn_dtype_size(t.dtype));
        view_release(&v);
        PyList_SET_ITEM(list, i, arr);
    }
    return list;
}

PyDoc_STRVAR(encoder_forward_doc,
             "forward(src, *, empty, src_mask=None, src_key_padding_mask=None,\n"
             "        is_causal=False, training=False, seed=0, rng_offset=0, batch_first=-1)\n"
             "        -> out\n\n"
             "attn_encoder_layer_forward; batch_first: this call's layout, -1 for the layer's.");

static PyObject *encoder_forward(EncoderObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"src", "empty", "src_mask", "src_key_padding_mask", "is_causal",
                             "training", "seed", "rng_offset", "batch_first", NULL};
    PyObject *osrc, *empty = NULL, *omask = Py_None, *okpm = Py_None;
    attn_encoder_forward_params fp;
    attn_encoder_forward_params_init(&fp);
    if (!encoder_ready(self)) return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|$OOOppO&O&i:forward", kwlist, &osrc, &empty,
                                     &omask, &okpm, &fp.is_causal, &fp.training, convert_u64,
                                     &fp.seed, convert_u64, &fp.rng_offset, &fp.batch_first) ||
        require_empty(empty, "forward") < 0)
        return NULL;
    buffer_view src, mask, kpm, out;
    int has_mask = 0, has_kpm = 0;
    memset(&mask, 0, sizeof mask);
    memset(&kpm, 0, sizeof kpm);
    memset(&out, 0, sizeof out);
    PyObject *r_out = NULL, *result = NULL;
    if (view_get(osrc, "src", 0, &src) < 0) return NULL;
    if (view_get_optional(omask, "src_mask", &mask, &has_mask) < 0 ||
        view_get_optional(okpm, "src_key_padding_mask", &kpm, &has_kpm) < 0)
        goto done;
    if (has_mask) fp.src_mask = &mask.t;
    if (has_kpm) fp.src_key_padding_mask = &kpm.t;
    r_out = new_output(empty, src.t.rank, src.t.shape, self->dtype, "out", &out);
    if (r_out == NULL) goto done;
    attn_status st;
    interrupt_guard guard;
    interrupt_guard_arm(&guard);
    Py_BEGIN_ALLOW_THREADS
    st = attn_encoder_layer_forward(self->layer, &src.t, &fp, &out.t);
    Py_END_ALLOW_THREADS
    if (interrupt_guard_disarm(&guard, st) < 0) goto done;
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    result = r_out;
    r_out = NULL;
done:
    view_release(&src);
    view_release(&mask);
    view_release(&kpm);
    view_release(&out);
    Py_XDECREF(r_out);
    return result;
}

static PyMethodDef encoder_methods[] = {
    {"param_layout", (PyCFunction)encoder_param_layout, METH_NOARGS,
     "[(name, shape)] of the parameters, in state_dict() order"},
    {"load", (PyCFunction)encoder_load, METH_O,
     "load(arrays): copy contiguous arrays, in param_layout() order, into the parameters"},
    {"params", (PyCFunction)encoder_params, METH_O,
     "params(empty): copies of the parameters, in param_layout() order"},
    {"forward", (PyCFunction)(void (*)(void))encoder_forward, METH_VARARGS | METH_KEYWORDS,
     encoder_forward_doc},
    {NULL, NULL, 0, NULL}};

static PyTypeObject EncoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "attn._attn.EncoderLayer",
    .tp_basicsize = sizeof(EncoderObject),
    .tp_dealloc = (destructor)encoder_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "EncoderLayer(d_model, nhead, dim_feedforward=2048, dropout=0.1,\n"
              "    activation='relu', layer_norm_eps=1e-5, batch_first=False,\n"
              "    norm_first=False, bias=True, dtype='float32', init_seed=0)\n\n"
              "An attn_encoder_layer (torch.nn.TransformerEncoderLayer).",
    .tp_methods = encoder_methods,
    .tp_init = (initproc)encoder_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------ */
/* Process-wide settings                                                     */
/* ------------------------------------------------------------------------ */

static PyObject *py_version(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(attn_version());
}

static PyObject *py_set_num_threads(PyObject *self, PyObject *arg) {
    (void)self;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    /* The library would clamp silently; a caller asking for more is told. */
    const int top = attn_max_threads();
    if (n < 0 || n > top) {
        PyErr_Format(PyExc_ValueError,
                     "num_threads is %ld; expected 1 to %d (attn.max_threads()), or 0 for the "
                     "default", n, top);
        return NULL;
    }
    attn_set_num_threads((int)n);
    Py_RETURN_NONE;
}

static PyObject *py_release_workspace(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    attn_release_workspace();
    output_blocks_release();
    Py_RETURN_NONE;
}

static PyObject *py_max_threads(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromLong(attn_max_threads());
}

static PyObject *py_get_num_threads(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromLong(attn_get_num_threads());
}

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(attn_isa_name(attn_get_isa()));
}

static PyObject *py_supported_isas(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    PyObject *list = PyList_New(0);
    if (list == NULL) return NULL;
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        if (!attn_isa_supported((attn_isa)i)) continue;
        PyObject *name = PyUnicode_FromString(attn_isa_name((attn_isa)i));
        if (name == NULL || PyList_Append(list, name) < 0) {
            Py_XDECREF(name);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(name);
    }
    return list;
}

static PyObject *py_blas_info(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyUnicode_FromString(attn_blas_info());
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    for (int i = ATTN_ISA_AUTO; i <= ATTN_ISA_LAST; i++)
        if (strcmp(name, attn_isa_name((attn_isa)i)) == 0) {
            attn_status st = attn_set_isa((attn_isa)i);
            if (st != ATTN_OK) return raise_status(st);
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_ValueError, "isa is '%s'; expected auto, ref, generic, avx2, avx512, avx512_bf16 or amx",
                 name);
    return NULL;
}

static PyObject *py_copies(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    return PyLong_FromSsize_t(shared_copies_made());
}

/* ------------------------------------------------------------------------ */
/* safetensors files                                                         */
/* ------------------------------------------------------------------------ */

/* The attn dtype a "F32"/... code names (the Python layer's choice), or 0. */
static attn_dtype st_dtype_code(const char *code) {
    static const struct {
        const char *code;
        attn_dtype dtype;
    } codes[] = {{"F32", ATTN_DTYPE_F32}, {"F64", ATTN_DTYPE_F64}, {"BOOL", ATTN_DTYPE_BOOL},
                 {"F16", ATTN_DTYPE_F16}, {"BF16", ATTN_DTYPE_BF16}};
    for (size_t i = 0; i < sizeof codes / sizeof codes[0]; i++)
        if (strcmp(code, codes[i].code) == 0) return codes[i].dtype;
    return 0;
}

/* A str as UTF-8 without NUL characters (C strings cannot hold them). */
static const char *st_utf8(PyObject *s, const char *what) {
    Py_ssize_t n;
    const char *u = PyUnicode_Check(s) ? PyUnicode_AsUTF8AndSize(s, &n) : NULL;
    if (u == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "%s must be a str, not %.200s", what,
                         Py_TYPE(s)->tp_name);
        return NULL;
    }
    if ((size_t)n != strlen(u)) {
        PyErr_Format(PyExc_ValueError, "%s %R holds a NUL character, which safetensors files "
                     "written by attn cannot", what, s);
        return NULL;
    }
    return u;
}

/* Tensor i as (name, file dtype, shape, value): a new array in `to` (float
 * tensors only; 0 keeps the file's dtype, bfloat16 as float32, since NumPy
 * has none), or the stored bytes for dtypes attn does not read. */
static PyObject *st_load_one(attn_safetensors *f, int64_t i, attn_dtype to, PyObject *empty) {
    const char *name, *fdt;
    attn_dtype dt;
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    attn_status st = attn_safetensors_info(f, i, &name, &fdt, &dt, &rank, shape);
    if (st != ATTN_OK) return raise_status(st);
    PyObject *shp = rank <= ATTN_MAX_RANK ? shape_tuple(rank, shape) : NULL;
    if (shp == NULL && rank <= ATTN_MAX_RANK) return NULL;
    PyObject *value = NULL;
    if (dt == 0 || rank > ATTN_MAX_RANK) { /* the stored bytes, for NumPy to view */
        const void *bytes;
        uint64_t size;
        if ((st = attn_safetensors_raw(f, name, &bytes, &size)) != ATTN_OK) {
            Py_XDECREF(shp);
            return raise_status(st);
        }
        value = PyBytes_FromStringAndSize(bytes, (Py_ssize_t)size);
    } else {
        if (to == 0 || !(dt == ATTN_DTYPE_F32 || dt == ATTN_DTYPE_F64 || dt == ATTN_DTYPE_F16 ||
                         dt == ATTN_DTYPE_BF16))
            to = dt == ATTN_DTYPE_BF16 ? ATTN_DTYPE_F32 : dt; /* NumPy has no bfloat16 */
        value = PyObject_CallFunction(empty, "Os", shp, attn_dtype_name(to));
        if (value == NULL && PyErr_ExceptionMatches(PyExc_ValueError)) {
            /* a legal empty shape NumPy cannot make, e.g. (2**61, 0): name it */
            PyObject *type, *why, *trace;
            PyErr_Fetch(&type, &why, &trace);
            PyErr_NormalizeException(&type, &why, &trace);
            PyErr_Format(PyExc_ValueError, "tensor '%s' of shape %R: NumPy cannot make it (%S)",
                         name, shp, why);
            Py_XDECREF(type);
            Py_XDECREF(why);
            Py_XDECREF(trace);
        }
        Py_buffer b;
        if (value != NULL && PyObject_GetBuffer(value, &b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) {
            attn_tensor t;
            memset(&t, 0, sizeof t);
            t.data = b.buf;
            t.dtype = to;
            t.rank = rank;
            int64_t stride = 1;
            for (int d = rank - 1; d >= 0; d--) {
                t.shape[d] = shape[d];
                t.strides[d] = stride;
                stride *= shape[d] > 0 ? shape[d] : 1;
            }
            if ((size_t)b.itemsize != attn_dtype_size(to)) {
                st = ATTN_ERR_DTYPE;
                PyErr_SetString(PyExc_RuntimeError, "the array allocator returned a wrong dtype");
            } else {
                Py_BEGIN_ALLOW_THREADS
                st = attn_safetensors_read_into(f, name, &t);
                Py_END_ALLOW_THREADS
            }
            PyBuffer_Release(&b);
            if (st != ATTN_OK) {
                Py_CLEAR(value);
                if (!PyErr_Occurred()) raise_status(st);
            }
        } else {
            Py_CLEAR(value);
        }
    }
    PyObject *item = value != NULL ? Py_BuildValue("(ssOO)", name, fdt, shp ? shp : Py_None, value)
                                   : NULL;
    Py_XDECREF(shp);
    Py_XDECREF(value);
    return item;
}

/* The metadata as a dict of str. */
static PyObject *st_metadata(const attn_safetensors *f) {
    PyObject *meta = PyDict_New();
    for (int64_t j = 0; meta != NULL && j < attn_safetensors_metadata_count(f); j++) {
        const char *k, *v;
        attn_safetensors_metadata_at(f, j, &k, &v);
        PyObject *pv = PyUnicode_FromString(v);
        if (pv == NULL || PyDict_SetItemString(meta, k, pv) < 0) Py_CLEAR(meta);
        Py_XDECREF(pv);
    }
    return meta;
}

PyDoc_STRVAR(st_load_doc,
             "safetensors_load(path, names, to, *, empty) -> ([(name, file_dtype, shape, value)],"
             " metadata)\n\n"
             "Reads tensors `names` (None: all, in the file's order) of a safetensors file.\n"
             "value: a new array from empty(shape, dtype_name) for F32, F64, F16, BF16 and\n"
             "BOOL (float tensors converted to `to` when it is 'float32' or 'float64';\n"
             "BF16 becomes float32 otherwise), else the stored bytes (little-endian), with\n"
             "shape None when the tensor has more than 8 dimensions.");

static PyObject *py_st_load(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"path", "names", "to", "empty", NULL};
    PyObject *path_bytes = NULL, *names = Py_None, *to_obj = Py_None, *empty = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|OO$O", kwlist, PyUnicode_FSConverter,
                                     &path_bytes, &names, &to_obj, &empty))
        return NULL;
    attn_dtype to = 0;
    if (to_obj != Py_None) {
        const char *s = PyUnicode_AsUTF8(to_obj);
        to = s == NULL ? 0 : strcmp(s, "float32") == 0 ? ATTN_DTYPE_F32
                         : strcmp(s, "float64") == 0   ? ATTN_DTYPE_F64
                                                       : 0;
        if (to == 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "to: 'float32' or 'float64'");
            Py_DECREF(path_bytes);
            return NULL;
        }
    }
    if (require_empty(empty, "safetensors_load") < 0) {
        Py_DECREF(path_bytes);
        return NULL;
    }
    attn_safetensors *f = NULL;
    attn_status st;
    const char *path = PyBytes_AS_STRING(path_bytes);
    Py_BEGIN_ALLOW_THREADS
    st = attn_safetensors_open(path, &f);
    Py_END_ALLOW_THREADS
    Py_DECREF(path_bytes);
    if (st != ATTN_OK) return raise_status(st);
    PyObject *list = PyList_New(0), *result = NULL;
    const int64_t n = names == Py_None ? attn_safetensors_count(f) : PySequence_Size(names);
    for (int64_t i = 0; list != NULL && i < n; i++) {
        int64_t at = i;
        if (names != Py_None) {
            PyObject *nm = PySequence_GetItem(names, (Py_ssize_t)i);
            const char *s = nm != NULL ? st_utf8(nm, "a name") : NULL;
            at = s != NULL ? attn_safetensors_find(f, s) : -1;
            if (s != NULL && at < 0)
                PyErr_Format(PyExc_KeyError, "%R: the file has no tensor of that name", nm);
            Py_XDECREF(nm);
            if (at < 0) Py_CLEAR(list);
        }
        PyObject *item = list != NULL ? st_load_one(f, at, to, empty) : NULL;
        if (item == NULL || PyList_Append(list, item) < 0) Py_CLEAR(list);
        Py_XDECREF(item);
    }
    if (list != NULL && !PyErr_Occurred()) {
        PyObject *meta = st_metadata(f);
        if (meta != NULL) result = Py_BuildValue("(NN)", list, meta);
        else Py_DECREF(list);
    } else {
        Py_XDECREF(list);
    }
    attn_safetensors_close(f);
    return result;
}

/* The buffers a save holds while it writes. */
typedef struct st_save_call {
    Py_ssize_t n, held;
    Py_buffer *bufs;
    const char **names;
    attn_tensor *tensors;
    const char **meta;
} st_save_call;

static void st_save_release(st_save_call *c) {
    for (Py_ssize_t i = 0; i < c->held; i++) PyBuffer_Release(&c->bufs[i]);
    PyMem_Free(c->bufs);
    PyMem_Free(c->names);
    PyMem_Free(c->tensors);
    PyMem_Free(c->meta);
}

/* Item i of the list: (name, array, dtype code) as a view. */
static int st_save_item(st_save_call *c, PyObject *item, Py_ssize_t i) {
    PyObject *name, *arr;
    const char *code;
    if (!PyArg_ParseTuple(item, "OOs", &name, &arr, &code)) return -1;
    if ((c->names[i] = st_utf8(name, "a tensor's name")) == NULL) return -1;
    const attn_dtype dt = st_dtype_code(code);
    if (dt == 0) {
        PyErr_Format(PyExc_ValueError, "unknown dtype code '%s'", code);
        return -1;
    }
    Py_buffer *b = &c->bufs[i];
    if (PyObject_GetBuffer(arr, b, PyBUF_RECORDS_RO) < 0) return -1;
    c->held++;
    if ((size_t)b->itemsize != attn_dtype_size(dt) || b->ndim > ATTN_MAX_RANK) {
        PyErr_Format(PyExc_ValueError, "tensor %R: %zd-byte items or %d dimensions do not fit %s",
                     name, b->itemsize, b->ndim, code);
        return -1;
    }
    attn_tensor *t = &c->tensors[i];
    memset(t, 0, sizeof *t);
    t->data = b->buf;
    t->dtype = dt;
    t->rank = b->ndim;
    Py_ssize_t stride = b->itemsize;
    for (int d = b->ndim - 1; d >= 0; d--) {
        const Py_ssize_t s = b->strides != NULL ? b->strides[d] : stride;
        t->shape[d] = b->shape[d];
        if (s % b->itemsize != 0) {
            PyErr_Format(PyExc_ValueError, "tensor %R: a stride is not a multiple of its items",
                         name);
            return -1;
        }
        t->strides[d] = s / b->itemsize;
        stride *= b->shape[d];
    }
    return 0;
}

PyDoc_STRVAR(st_save_doc,
             "safetensors_save(path, items, metadata)\n\n"
             "attn_safetensors_save(): items is a list of (name, array, code) with code\n"
             "'F32', 'F64', 'BOOL', 'F16' or 'BF16' (the array's items are stored as they\n"
             "are: BF16 arrays are 16-bit integer views); metadata a list of (key, value).");

static PyObject *py_st_save(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *path_bytes = NULL, *items, *meta;
    if (!PyArg_ParseTuple(args, "O&O!O!", PyUnicode_FSConverter, &path_bytes, &PyList_Type,
                          &items, &PyList_Type, &meta))
        return NULL;
    st_save_call c = {0};
    c.n = PyList_GET_SIZE(items);
    const Py_ssize_t m = PyList_GET_SIZE(meta);
    c.bufs = PyMem_Calloc((size_t)c.n + 1, sizeof *c.bufs);
    c.names = PyMem_Calloc((size_t)c.n + 1, sizeof *c.names);
    c.tensors = PyMem_Calloc((size_t)c.n + 1, sizeof *c.tensors);
    c.meta = PyMem_Calloc(2 * (size_t)m + 1, sizeof *c.meta);
    int rc = c.bufs && c.names && c.tensors && c.meta ? 0 : (PyErr_NoMemory(), -1);
    for (Py_ssize_t i = 0; rc == 0 && i < c.n; i++)
        rc = st_save_item(&c, PyList_GET_ITEM(items, i), i);
    for (Py_ssize_t j = 0; rc == 0 && j < m; j++) {
        PyObject *k, *v;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(meta, j), "OO", &k, &v) ||
            (c.meta[2 * j] = st_utf8(k, "a metadata key")) == NULL ||
            (c.meta[2 * j + 1] = st_utf8(v, "a metadata value")) == NULL)
            rc = -1;
    }
    PyObject *result = NULL;
    if (rc == 0) {
        attn_status st;
        const char *path = PyBytes_AS_STRING(path_bytes);
        Py_BEGIN_ALLOW_THREADS
        st = attn_safetensors_save(path, (size_t)c.n, c.names, c.tensors, c.meta);
        Py_END_ALLOW_THREADS
        if (st == ATTN_OK) {
            Py_INCREF(Py_None);
            result = Py_None;
        } else {
            raise_status(st);
        }
    }
    st_save_release(&c);
    Py_DECREF(path_bytes);
    return result;
}

static PyMethodDef module_methods[] = {
    {"sdpa", (PyCFunction)(void (*)(void))py_sdpa, METH_VARARGS | METH_KEYWORDS, sdpa_doc},
    {"sdpa_backward", (PyCFunction)(void (*)(void))py_sdpa_backward,
     METH_VARARGS | METH_KEYWORDS, sdpa_backward_doc},
    {"sdpa_sinks_backward", (PyCFunction)(void (*)(void))py_sdpa_sinks_backward,
     METH_VARARGS | METH_KEYWORDS, sdpa_sinks_backward_doc},
    {"version", py_version, METH_NOARGS, "the linked library's version string"},
    {"set_num_threads", py_set_num_threads, METH_O, "attn_set_num_threads(n); 0 = default"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "attn_get_num_threads()"},
    {"max_threads", py_max_threads, METH_NOARGS, "attn_max_threads(): the bound on the count"},
    {"release_workspace", py_release_workspace, METH_NOARGS,
     "attn_release_workspace(), and the output memory kept for reuse: hand both back"},
    {"isa", py_isa, METH_NOARGS, "the kernel path calls take now"},
    {"supported_isas", py_supported_isas, METH_NOARGS, "the paths this CPU and OS can run"},
    {"blas_info", py_blas_info, METH_NOARGS, "attn_blas_info(): the CBLAS behind MHA"},
    {"set_isa", py_set_isa, METH_O, "force a kernel path by name ('auto' restores the best)"},
    {"_copies", py_copies, METH_NOARGS,
     "how many input buffers had to be copied (misaligned or odd strides)"},
    /* safetensors files */
    {"safetensors_load", (PyCFunction)(void (*)(void))py_st_load, METH_VARARGS | METH_KEYWORDS,
     st_load_doc},
    {"safetensors_save", py_st_save, METH_VARARGS, st_save_doc},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_attn",
    "libattn for Python: exact scaled dot-product and multi-head attention.", -1,
    module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__attn(void) {
    if (PyType_Ready(&MHAType) < 0 || PyType_Ready(&SavedType) < 0 ||
        PyType_Ready(&EncoderType) < 0 ||
        interrupt_guard_init() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    Py_INCREF(&MHAType);
    Py_INCREF(&SavedType);
    if (PyModule_AddObject(m, "Saved", (PyObject *)&SavedType) < 0) {
        Py_DECREF(&SavedType);
        Py_DECREF(&MHAType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&EncoderType);
    if (PyModule_AddObject(m, "EncoderLayer", (PyObject *)&EncoderType) < 0) {
        Py_DECREF(&EncoderType);
        Py_DECREF(&MHAType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddObject(m, "MHA", (PyObject *)&MHAType) < 0) {
        Py_DECREF(&MHAType);
        Py_DECREF(m);
        return NULL;
    }
    if (serving_add_functions(m) < 0 || output_blocks_add(m) < 0 || tensor_intake_add(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#ifdef ATTN_HAVE_RING
    const int has_ring = 1;
    if (ring_add_functions(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#else
    const int has_ring = 0; /* attn.distributed says so at its first call */
#endif
    if (PyModule_AddStringConstant(m, "__version__", attn_version()) < 0 ||
        PyModule_AddIntConstant(m, "has_ring", has_ring) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
