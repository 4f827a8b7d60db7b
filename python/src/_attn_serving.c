/*
 * _attn_serving.c — attn_sdpa_varlen and attn_sdpa_kvcache for the Python
 * package (attn.varlen_attention, attn.attention_with_kvcache), with the
 * buffer views, output allocation, errors and Ctrl-C handling of _attn_shared.c.
 *
 * The operands keep their C names (q, k, v, k_cache, ...), which are also
 * the Python arguments' (FlashAttention's), so no arg_names are passed.
 * The Python layer checks ranks before these run: the output shapes are
 * read off q and v / v_cache.
 */
#include "_attn_shared.h" /* Python.h first, as CPython asks */

#include <string.h>

/* A rank the output shapes depend on; -1 with ValueError naming `name`. */
static int require_rank(const buffer_view *v, const char *name, int rank, const char *layout) {
    if (v->t.rank == rank) return 0;
    PyErr_Format(PyExc_ValueError, "%s has %d dimensions; expected %d %s", name, v->t.rank, rank,
                 layout);
    return -1;
}

/* The attention call with the GIL released and Ctrl-C honoured; the status
 * is raised as an exception when it is not ATTN_OK. 0 or -1. */
typedef attn_status (*serving_call)(void *ctx);

static int run_call(serving_call call, void *ctx) {
    attn_status st;
    interrupt_guard guard;
    interrupt_guard_arm(&guard);
    Py_BEGIN_ALLOW_THREADS
    st = call(ctx);
    Py_END_ALLOW_THREADS
    if (interrupt_guard_disarm(&guard, st) < 0) return -1;
    if (st != ATTN_OK) {
        raise_status(st);
        return -1;
    }
    return 0;
}

/* The scalar options both entry points share, parsed into params. */
static int serving_params(attn_sdpa_params *p, int causal, PyObject *scale, double dropout_p,
                          uint64_t seed, uint64_t rng_offset) {
    const sdpa_options o = {Py_None, scale, causal, 0, dropout_p, seed, rng_offset};
    if (sdpa_params_from(&o, p) < 0) return -1;
    p->arg_names = NULL; /* the C names are the Python ones */
    return 0;
}

/* ------------------------------------------------------------------------ */
/* sdpa_varlen                                                               */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(varlen_doc,
             "sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,\n"
             "     empty, causal=0, scale=None, dropout_p=0.0, seed=0, rng_offset=0,\n"
             "     window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None,\n"
             "     sinks=None, want_lse=False, lse_for_backward=False)\n"
             "     -> (out, lse or None)\n\n"
             "attn_sdpa_varlen() on buffers: q (total_q, Hq, E), k (total_k, Hkv, E),\n"
             "v (total_k, Hkv, Ev), cu_seqlens int32 (B + 1,). out (total_q, Hq, Ev) and\n"
             "lse (Hq, total_q) come from empty(shape, dtype_name); rows no sequence\n"
             "holds are left as empty made them. causal: 0 none, 1 top-left, 2\n"
             "bottom-right (FlashAttention's causal=True). lse_for_backward: the lse\n"
             "sdpa_varlen_backward recomputes the weights from, in float64.");

enum { VL_Q, VL_K, VL_V, VL_CUQ, VL_CUK, VL_NIN };

typedef struct varlen_call {
    buffer_view in[VL_NIN], out, lse;
    long long max_q, max_k;
    int want_lse;
    attn_sdpa_params p;
} varlen_call;

static attn_status varlen_run(void *ctx) {
    varlen_call *c = ctx;
    return attn_sdpa_varlen(&c->in[VL_Q].t, &c->in[VL_K].t, &c->in[VL_V].t, &c->in[VL_CUQ].t,
                            &c->in[VL_CUK].t, (int64_t)c->max_q, (int64_t)c->max_k, &c->p,
                            &c->out.t, c->want_lse ? &c->lse.t : NULL);
}

/* out and lse from the inputs' shapes: a tuple (out, lse or None), or NULL. */
static PyObject *varlen_outputs(varlen_call *c, PyObject *empty) {
    const attn_tensor *q = &c->in[VL_Q].t, *v = &c->in[VL_V].t;
    const int64_t oshape[3] = {q->shape[0], q->shape[1], v->shape[2]};
    const int64_t lshape[2] = {q->shape[1], q->shape[0]};
    PyObject *out = new_output(empty, 3, oshape, q->dtype, "out", &c->out);
    if (out == NULL) return NULL;
    PyObject *lse = Py_None;
    Py_INCREF(lse);
    if (c->want_lse) {
        Py_DECREF(lse);
        lse = new_output(empty, 2, lshape, lse_dtype_of(q->dtype, c->p.lse_for_backward), "lse",
                         &c->lse);
        if (lse == NULL) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return Py_BuildValue("(NN)", out, lse);
}

static PyObject *py_sdpa_varlen(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                             "max_seqlen_k", "empty", "causal", "scale", "dropout_p", "seed",
                             "rng_offset", "window_left", "window_right", "softcap",
                             "alibi_slopes", "sinks", "want_lse", "lse_for_backward", NULL};
    static const char *const names[VL_NIN] = {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"};
    PyObject *objs[VL_NIN], *empty = NULL, *scale = Py_None;
    int causal = 0, for_backward = 0;
    double dropout_p = 0.0;
    uint64_t seed = 0, rng_offset = 0;
    modifiers m = MODIFIERS_DEFAULT;
    varlen_call c;
    memset(&c, 0, sizeof c);
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOOOOLL|$OiOdO&O&LLdOOpp:sdpa_varlen", kwlist, &objs[0], &objs[1],
            &objs[2], &objs[3], &objs[4], &c.max_q, &c.max_k, &empty, &causal, &scale,
            &dropout_p, convert_u64, &seed, convert_u64, &rng_offset, &m.window_left,
            &m.window_right, &m.softcap, &m.alibi, &m.sinks, &c.want_lse, &for_backward) ||
        require_empty(empty, "sdpa_varlen") < 0)
        return NULL;
    if (serving_params(&c.p, causal, scale, dropout_p, seed, rng_offset) < 0) return NULL;
    c.p.lse_for_backward = for_backward;
    PyObject *result = NULL;
    for (int i = 0; i < VL_NIN; i++)
        if (view_get(objs[i], names[i], 0, &c.in[i]) < 0) goto done;
    if (modifiers_apply(&m, &c.p) < 0 ||
        require_rank(&c.in[VL_Q], "q", 3, "(total_q, Hq, E)") < 0 ||
        require_rank(&c.in[VL_V], "v", 3, "(total_k, Hkv, Ev)") < 0)
        goto done;
    result = varlen_outputs(&c, empty);
    if (result != NULL && run_call(varlen_run, &c) < 0) Py_CLEAR(result);
done:
    for (int i = 0; i < VL_NIN; i++) view_release(&c.in[i]);
    view_release(&c.out);
    view_release(&c.lse);
    modifiers_release(&m);
    return result;
}

/* ------------------------------------------------------------------------ */
/* sdpa_kvcache                                                              */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(kvcache_doc,
             "sdpa_kvcache(q, k_cache, v_cache, *, empty, k=None, v=None, cache_seqlens=None,\n"
             "     block_table=None, cache_bf16=False, causal=0, scale=None, dropout_p=0.0,\n"
             "     seed=0, rng_offset=0, window_left=-1, window_right=-1, softcap=0.0,\n"
             "     alibi_slopes=None, sinks=None, want_lse=False) -> (out, lse or None)\n\n"
             "attn_sdpa_kvcache() on buffers: q (B, Lq, Hq, E); k_cache, v_cache\n"
             "(B, S_max, Hkv, E) or paged (num_blocks, block_size, Hkv, E) with an int32\n"
             "block_table (B, max_blocks); new rows k, v (B, Lnew, Hkv, E) are written\n"
             "into the caches IN PLACE (their buffers are taken writable and never\n"
             "copied); cache_seqlens int32 (B,). cache_bf16: the caches are 16-bit\n"
             "integer buffers holding bfloat16. out (B, Lq, Hq, Ev), lse (B, Hq, Lq).");

enum { KV_Q, KV_KC, KV_VC, KV_K, KV_V, KV_SEQ, KV_TABLE, KV_NIN };

typedef struct kvcache_call {
    buffer_view in[KV_NIN], out, lse;
    int present[KV_NIN];
    int want_lse;
    attn_sdpa_params p;
} kvcache_call;

static const attn_tensor *kv_optional(const kvcache_call *c, int i) {
    return c->present[i] ? &c->in[i].t : NULL;
}

static attn_status kvcache_run(void *ctx) {
    kvcache_call *c = ctx;
    return attn_sdpa_kvcache(&c->in[KV_Q].t, &c->in[KV_KC].t, &c->in[KV_VC].t,
                             kv_optional(c, KV_K), kv_optional(c, KV_V), kv_optional(c, KV_SEQ),
                             kv_optional(c, KV_TABLE), &c->p, &c->out.t,
                             c->want_lse ? &c->lse.t : NULL);
}

/* Views of every operand. The caches are taken writable when new rows come
 * (a writable view is never a copy, so the rows land in the caller's
 * arrays), read-only otherwise. */
static int kvcache_inputs(kvcache_call *c, PyObject *const objs[KV_NIN], int cache_bf16) {
    static const char *const names[KV_NIN] = {"q", "k_cache", "v_cache", "k",
                                              "v", "cache_seqlens", "block_table"};
    const int appending = objs[KV_K] != Py_None || objs[KV_V] != Py_None;
    const attn_dtype as = cache_bf16 ? ATTN_DTYPE_BF16 : 0;
    if (view_get(objs[KV_Q], names[KV_Q], 0, &c->in[KV_Q]) < 0) return -1;
    c->present[KV_Q] = 1;
    for (int i = KV_KC; i <= KV_VC; i++) {
        if (view_get_as(objs[i], names[i], appending, as, &c->in[i]) < 0) return -1;
        c->present[i] = 1;
    }
    for (int i = KV_K; i < KV_NIN; i++)
        if (view_get_optional(objs[i], names[i], &c->in[i], &c->present[i]) < 0) return -1;
    return 0;
}

/* out and lse from q's and v_cache's shapes: (out, lse or None), or NULL. */
static PyObject *kvcache_outputs(kvcache_call *c, PyObject *empty) {
    const attn_tensor *q = &c->in[KV_Q].t, *vc = &c->in[KV_VC].t;
    const int64_t oshape[4] = {q->shape[0], q->shape[1], q->shape[2], vc->shape[3]};
    const int64_t lshape[3] = {q->shape[0], q->shape[2], q->shape[1]};
    PyObject *out = new_output(empty, 4, oshape, q->dtype, "out", &c->out);
    if (out == NULL) return NULL;
    PyObject *lse = Py_None;
    Py_INCREF(lse);
    if (c->want_lse) {
        Py_DECREF(lse);
        lse = new_output(empty, 3, lshape, lse_dtype_of(q->dtype, 0), "lse", &c->lse);
        if (lse == NULL) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return Py_BuildValue("(NN)", out, lse);
}

static PyObject *py_sdpa_kvcache(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"q", "k_cache", "v_cache", "empty", "k", "v", "cache_seqlens",
                             "block_table", "cache_bf16", "causal", "scale", "dropout_p",
                             "seed", "rng_offset", "window_left", "window_right", "softcap",
                             "alibi_slopes", "sinks", "want_lse", NULL};
    PyObject *objs[KV_NIN], *empty = NULL, *scale = Py_None;
    int causal = 0, cache_bf16 = 0;
    double dropout_p = 0.0;
    uint64_t seed = 0, rng_offset = 0;
    modifiers m = MODIFIERS_DEFAULT;
    kvcache_call c;
    memset(&c, 0, sizeof c);
    for (int i = KV_K; i < KV_NIN; i++) objs[i] = Py_None;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOO|$OOOOOpiOdO&O&LLdOOp:sdpa_kvcache", kwlist, &objs[KV_Q],
            &objs[KV_KC], &objs[KV_VC], &empty, &objs[KV_K], &objs[KV_V], &objs[KV_SEQ],
            &objs[KV_TABLE], &cache_bf16, &causal, &scale, &dropout_p, convert_u64, &seed,
            convert_u64, &rng_offset, &m.window_left, &m.window_right, &m.softcap, &m.alibi,
            &m.sinks, &c.want_lse) ||
        require_empty(empty, "sdpa_kvcache") < 0)
        return NULL;
    if (serving_params(&c.p, causal, scale, dropout_p, seed, rng_offset) < 0) return NULL;
    PyObject *result = NULL;
    if (kvcache_inputs(&c, objs, cache_bf16) < 0 || modifiers_apply(&m, &c.p) < 0 ||
        require_rank(&c.in[KV_Q], "q", 4, "(B, Lq, Hq, E)") < 0 ||
        require_rank(&c.in[KV_VC], "v_cache", 4,
                     "(B, S_max, Hkv, Ev), or (num_blocks, block_size, Hkv, Ev) when paged") < 0)
        goto done;
    result = kvcache_outputs(&c, empty);
    if (result != NULL && run_call(kvcache_run, &c) < 0) Py_CLEAR(result);
done:
    for (int i = 0; i < KV_NIN; i++) view_release(&c.in[i]);
    view_release(&c.out);
    view_release(&c.lse);
    modifiers_release(&m);
    return result;
}

/* ------------------------------------------------------------------------ */
/* sdpa_varlen_backward                                                      */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(varlen_backward_doc,
             "sdpa_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,\n"
             "     max_seqlen_q, max_seqlen_k, *, empty, causal=0, scale=None, dropout_p=0.0,\n"
             "     seed=0, rng_offset=0, window_left=-1, window_right=-1, softcap=0.0,\n"
             "     alibi_slopes=None, sinks=None, want_dq=True, want_dk=True, want_dv=True)\n"
             "     -> (dq, dk, dv), None where not wanted\n\n"
             "attn_sdpa_varlen_backward() on buffers: the gradients of an sdpa_varlen call\n"
             "(its out and lse, made with lse_for_backward, and the same options), each\n"
             "shaped like its input and made by empty(shape, dtype_name).");

enum { VB_DOUT, VB_Q, VB_K, VB_V, VB_OUT, VB_LSE, VB_CUQ, VB_CUK, VB_NIN };

typedef struct varlen_backward_call {
    buffer_view in[VB_NIN], grad[3];
    int want[3];
    long long max_q, max_k;
    attn_sdpa_params p;
} varlen_backward_call;

static attn_status varlen_backward_run(void *ctx) {
    varlen_backward_call *c = ctx;
    attn_tensor *g[3];
    for (int i = 0; i < 3; i++) g[i] = c->want[i] ? &c->grad[i].t : NULL;
    return attn_sdpa_varlen_backward(&c->in[VB_DOUT].t, &c->in[VB_Q].t, &c->in[VB_K].t,
                                     &c->in[VB_V].t, &c->in[VB_OUT].t, &c->in[VB_LSE].t,
                                     &c->in[VB_CUQ].t, &c->in[VB_CUK].t, (int64_t)c->max_q,
                                     (int64_t)c->max_k, &c->p, g[0], g[1], g[2]);
}

/* The wanted gradients, each like its input (q, k, v): a tuple with None
 * for the others, or NULL. */
static PyObject *varlen_gradients(varlen_backward_call *c, PyObject *empty) {
    static const char *const names[3] = {"dq", "dk", "dv"};
    PyObject *result = PyTuple_New(3);
    for (int i = 0; result != NULL && i < 3; i++) {
        PyObject *g = Py_None;
        Py_INCREF(g);
        if (c->want[i]) {
            const attn_tensor *like = &c->in[VB_Q + i].t;
            Py_DECREF(g);
            g = new_output(empty, like->rank, like->shape, like->dtype, names[i], &c->grad[i]);
            if (g == NULL) Py_CLEAR(result);
        }
        if (result != NULL) PyTuple_SET_ITEM(result, i, g);
    }
    return result;
}

static PyObject *py_sdpa_varlen_backward(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"dout", "q", "k", "v", "out", "lse", "cu_seqlens_q",
                             "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "empty", "causal",
                             "scale", "dropout_p", "seed", "rng_offset", "window_left",
                             "window_right", "softcap", "alibi_slopes", "sinks", "want_dq",
                             "want_dk", "want_dv", NULL};
    static const char *const names[VB_NIN] = {"dout", "q", "k", "v", "out", "lse",
                                              "cu_seqlens_q", "cu_seqlens_k"};
    PyObject *objs[VB_NIN], *empty = NULL, *scale = Py_None;
    int causal = 0;
    double dropout_p = 0.0;
    uint64_t seed = 0, rng_offset = 0;
    modifiers m = MODIFIERS_DEFAULT;
    varlen_backward_call c;
    memset(&c, 0, sizeof c);
    c.want[0] = c.want[1] = c.want[2] = 1;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOOOOOOOLL|$OiOdO&O&LLdOOppp:sdpa_varlen_backward", kwlist, &objs[0],
            &objs[1], &objs[2], &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &c.max_q,
            &c.max_k, &empty, &causal, &scale, &dropout_p, convert_u64, &seed, convert_u64,
            &rng_offset, &m.window_left, &m.window_right, &m.softcap, &m.alibi, &m.sinks,
            &c.want[0], &c.want[1], &c.want[2]) ||
        require_empty(empty, "sdpa_varlen_backward") < 0)
        return NULL;
    if (serving_params(&c.p, causal, scale, dropout_p, seed, rng_offset) < 0) return NULL;
    PyObject *result = NULL;
    for (int i = 0; i < VB_NIN; i++)
        if (view_get(objs[i], names[i], 0, &c.in[i]) < 0) goto done;
    if (modifiers_apply(&m, &c.p) < 0 ||
        require_rank(&c.in[VB_Q], "q", 3, "(total_q, Hq, E)") < 0 ||
        require_rank(&c.in[VB_K], "k", 3, "(total_k, Hkv, E)") < 0 ||
        require_rank(&c.in[VB_V], "v", 3, "(total_k, Hkv, Ev)") < 0)
        goto done;
    result = varlen_gradients(&c, empty);
    if (result != NULL && run_call(varlen_backward_run, &c) < 0) Py_CLEAR(result);
done:
    for (int i = 0; i < VB_NIN; i++) view_release(&c.in[i]);
    for (int i = 0; i < 3; i++) view_release(&c.grad[i]);
    modifiers_release(&m);
    return result;
}

/* ------------------------------------------------------------------------ */
/* sdpa_varlen_sinks_backward                                                */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(varlen_sinks_backward_doc,
             "sdpa_varlen_sinks_backward(dout, out, lse, cu_seqlens_q, sinks, *, empty)\n"
             "     -> dsinks\n\n"
             "attn_sdpa_varlen_sinks_backward() on buffers: the gradient of the sinks of an\n"
             "sdpa_varlen call (its out and lse, its cu_seqlens_q), shaped like sinks.");

/* attn_sdpa_varlen_sinks_backward on ctx's views (dout, out, lse, cu_seqlens_q). */
static attn_status varlen_sinks_run(void *ctx, const attn_sdpa_params *p, attn_tensor *dsinks) {
    const buffer_view *in = ctx;
    return attn_sdpa_varlen_sinks_backward(&in[0].t, &in[1].t, &in[2].t, &in[3].t, p, dsinks);
}

static PyObject *py_sdpa_varlen_sinks_backward(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"dout", "out", "lse", "cu_seqlens_q", "sinks", "empty", NULL};
    static const char *const names[4] = {"dout", "out", "lse", "cu_seqlens_q"};
    PyObject *objs[4], *empty = NULL;
    modifiers m = MODIFIERS_DEFAULT;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOO|$O:sdpa_varlen_sinks_backward", kwlist,
                                     &objs[0], &objs[1], &objs[2], &objs[3], &m.sinks, &empty) ||
        require_empty(empty, "sdpa_varlen_sinks_backward") < 0)
        return NULL;
    attn_sdpa_params p;
    attn_sdpa_params_init(&p);
    buffer_view in[4];
    memset(in, 0, sizeof in);
    PyObject *r = NULL;
    for (int i = 0; i < 4; i++)
        if (view_get(objs[i], names[i], 0, &in[i]) < 0) goto done;
    r = sinks_gradient(empty, &m, &p, varlen_sinks_run, in);
done:
    for (int i = 0; i < 4; i++) view_release(&in[i]);
    modifiers_release(&m);
    return r;
}

static PyMethodDef serving_methods[] = {
    {"sdpa_varlen", (PyCFunction)(void (*)(void))py_sdpa_varlen, METH_VARARGS | METH_KEYWORDS,
     varlen_doc},
    {"sdpa_kvcache", (PyCFunction)(void (*)(void))py_sdpa_kvcache,
     METH_VARARGS | METH_KEYWORDS, kvcache_doc},
    {"sdpa_varlen_backward", (PyCFunction)(void (*)(void))py_sdpa_varlen_backward,
     METH_VARARGS | METH_KEYWORDS, varlen_backward_doc},
    {"sdpa_varlen_sinks_backward", (PyCFunction)(void (*)(void))py_sdpa_varlen_sinks_backward,
     METH_VARARGS | METH_KEYWORDS, varlen_sinks_backward_doc},
    {NULL, NULL, 0, NULL}};

int serving_add_functions(PyObject *module) {
    return PyModule_AddFunctions(module, serving_methods);
}
