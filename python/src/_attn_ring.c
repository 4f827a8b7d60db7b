/*
 * _attn_ring.c — ring attention over MPI (attn_ring.h) for attn.distributed.
 * Compiled into attn._attn only when CMake found MPI (ATTN_HAVE_RING).
 *
 * The communicator arrives as the integer mpi4py's MPI._handleof(comm)
 * gives: the C handle itself (a pointer for Open MPI, an int for MPICH).
 * That handle only means something to the MPI library mpi4py runs, so the
 * Python layer first compares mpi4py's MPI_Get_library_version with
 * mpi_library_version() here, and every call checks that this library is
 * initialised (a second libmpi in the process would not be).
 *
 * Buffers, outputs, errors and Ctrl-C are _attn_shared.c's: the
 * ring calls take and give what sdpa / sdpa_backward do, plus the comm and
 * the ring's own parameters, and release the GIL while they run.
 */
#include "_attn_shared.h" /* Python.h first, as CPython asks */

#include <string.h>

#include <mpi.h>

#include "attn_ring.h"

/* The ring's options on top of attn_sdpa's. */
typedef struct ring_options {
    sdpa_options sdpa; /* sdpa.mask is the key mask (the ring takes no attn_mask) */
    PyObject *comm;    /* the handle as an int; required */
    int layout;        /* attn_ring_layout */
    double timeout;
} ring_options;

#define RING_OPTIONS_INIT {{Py_None, Py_None, 0, 0, 0.0, 0, 0}, NULL, ATTN_RING_ZIGZAG, 60.0}

/* MPI_Comm from MPI._handleof(comm): the handle's bits, whatever its type. */
static int comm_from(PyObject *obj, MPI_Comm *comm) {
    if (obj == NULL) {
        PyErr_SetString(PyExc_TypeError, "missing required keyword-only argument: 'comm'");
        return -1;
    }
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "comm must be the int MPI._handleof(comm) gives, not %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    /* Masked: an MPICH handle is an int that may be negative. */
    const unsigned long long h = PyLong_AsUnsignedLongLongMask(obj);
    if (PyErr_Occurred()) return -1;
    *comm = (MPI_Comm)(uintptr_t)h;
    if (*comm == MPI_COMM_NULL) {
        PyErr_SetString(PyExc_ValueError, "comm is MPI.COMM_NULL");
        return -1;
    }
    return 0;
}

/* The handle is only valid in an initialised, not yet finalised MPI. */
static int mpi_ready(void) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) return 0;
    PyErr_SetString(PyExc_RuntimeError,
                    finalized ? "MPI has been finalised: ring attention needs a running MPI"
                              : "MPI is not initialised in the MPI library attn was built with "
                                "(import mpi4py's MPI first; if it is imported, mpi4py runs "
                                "another MPI library than attn)");
    return -1;
}

static int ring_params_from(const ring_options *o, MPI_Comm *comm, attn_ring_params *p) {
    if (comm_from(o->comm, comm) < 0 || mpi_ready() < 0) return -1;
    attn_ring_params_init(p);
    if (sdpa_params_from(&o->sdpa, &p->sdpa) < 0) return -1;
    p->layout = (attn_ring_layout)o->layout;
    p->timeout = o->timeout;
    return 0;
}

/* ------------------------------------------------------------------------ */
/* One ring call: its buffers                                                */
/* ------------------------------------------------------------------------ */

/* Inputs first (the forward uses Q, K, V and the key mask), then the
 * outputs: out and lse for the forward, dq, dk, dv for the backward. */
enum { RC_DOUT, RC_Q, RC_K, RC_V, RC_OUT, RC_LSE, RC_MASK, RC_NIN };
enum { RC_NRES = 3 };

typedef struct ring_call {
    buffer_view in[RC_NIN];
    buffer_view res[RC_NRES];
    PyObject *result[RC_NRES];
    int has_mask;
} ring_call;

static void ring_call_release(ring_call *c) {
    for (int i = 0; i < RC_NIN; i++) view_release(&c->in[i]);
    for (int r = 0; r < RC_NRES; r++) {
        view_release(&c->res[r]);
        Py_CLEAR(c->result[r]);
    }
}

/* Views of the inputs objs[first..RC_MASK) and of the key mask (optional). */
static int ring_inputs(ring_call *c, PyObject *const objs[RC_NIN], int first) {
    static const char *const names[RC_NIN] = {"dout", "query", "key", "value",
                                              "out", "lse", "key_mask"};
    for (int i = first; i < RC_MASK; i++)
        if (objs[i] != NULL && view_get(objs[i], names[i], 0, &c->in[i]) < 0) return -1;
    return view_get_optional(objs[RC_MASK], names[RC_MASK], &c->in[RC_MASK], &c->has_mask);
}

/* The results as a tuple, None for those not computed. */
static PyObject *ring_results(ring_call *c, int n) {
    PyObject *t = PyTuple_New(n);
    for (int r = 0; t != NULL && r < n; r++) {
        PyObject *x = c->result[r] != NULL ? c->result[r] : Py_None;
        Py_INCREF(x);
        PyTuple_SET_ITEM(t, r, x);
    }
    return t;
}

static attn_tensor *result_or_null(ring_call *c, int r) {
    return c->result[r] != NULL ? &c->res[r].t : NULL;
}

/* ------------------------------------------------------------------------ */
/* ring_sdpa                                                                 */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(ring_sdpa_doc,
             "ring_sdpa(query, key, value, *, comm, empty, key_mask=None, causal=0,\n"
             "     scale=None, enable_gqa=False, dropout_p=0.0, seed=0, rng_offset=0,\n"
             "     layout=0, timeout=60.0, want_lse=False, lse_for_backward=False)\n"
             "     -> (out, lse)\n\n"
             "attn_ring_sdpa() on this rank's shards. comm: MPI._handleof(comm);\n"
             "key_mask: attn_ring_params.key_mask (bool: true = the key takes part);\n"
             "layout: 0 zigzag, 1 contiguous. Collective: every rank of comm calls it.\n"
             "Otherwise as sdpa(); lse is None unless asked for.");

/* out and, when wanted, lse, shaped for this rank's shards; none when the
 * shards do not fit together (the ring call then reports why, below). */
static int ring_forward_outputs(ring_call *c, const attn_ring_params *p, PyObject *empty,
                                int want_lse) {
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    /* The local shapes alone give the output's (the ring validates them
     * the same way). */
    attn_sdpa_params sp = p->sdpa;
    sp.attn_mask = p->key_mask;
    if (attn_sdpa_out_shape(&c->in[RC_Q].t, &c->in[RC_K].t, &c->in[RC_V].t, &sp, &rank,
                            shape) != ATTN_OK)
        return 0;
    const attn_dtype dt = c->in[RC_Q].t.dtype;
    c->result[0] = new_output(empty, rank, shape, dt, "out", &c->res[0]);
    if (c->result[0] == NULL) return -1;
    if (!want_lse) return 0;
    /* float64 for the backward, as sdpa's lse_for_backward */
    const attn_dtype lse_dt = lse_dtype_of(dt, p->sdpa.lse_for_backward);
    c->result[1] = new_output(empty, rank - 1, shape, lse_dt, "lse", &c->res[1]);
    return c->result[1] != NULL ? 0 : -1;
}

static PyObject *py_ring_sdpa(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"query", "key", "value", "comm", "empty", "key_mask", "causal",
                             "scale", "enable_gqa", "dropout_p", "seed", "rng_offset",
                             "layout", "timeout", "want_lse", "lse_for_backward", NULL};
    PyObject *objs[RC_NIN] = {NULL}, *empty = NULL;
    ring_options o = RING_OPTIONS_INIT;
    int want_lse = 0, lse_for_backward = 0;
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOO|$OOOiOpdO&O&idpp:ring_sdpa", kwlist, &objs[RC_Q], &objs[RC_K],
            &objs[RC_V], &o.comm, &empty, &o.sdpa.mask, &o.sdpa.causal, &o.sdpa.scale,
            &o.sdpa.gqa, &o.sdpa.dropout_p, convert_u64, &o.sdpa.seed, convert_u64,
            &o.sdpa.rng_offset, &o.layout, &o.timeout, &want_lse, &lse_for_backward) ||
        require_empty(empty, "ring_sdpa") < 0)
        return NULL;
    objs[RC_MASK] = o.sdpa.mask;
    MPI_Comm comm;
    attn_ring_params p;
    if (ring_params_from(&o, &comm, &p) < 0) return NULL;
    p.sdpa.lse_for_backward = lse_for_backward;
    ring_call c;
    memset(&c, 0, sizeof c);
    PyObject *result = NULL;
    if (ring_inputs(&c, objs, RC_Q) < 0) goto done;
    if (c.has_mask) p.key_mask = &c.in[RC_MASK].t;
    if (ring_forward_outputs(&c, &p, empty, want_lse) < 0) goto done;
    /* Even without an out (bad local shapes) the call goes to the ring: it
     * fails there on every rank together, where returning here would leave
     * the others waiting for this one until their timeout. */
    interrupt_guard guard;
    interrupt_guard_arm(&guard);
    attn_status st;
    Py_BEGIN_ALLOW_THREADS
    st = attn_ring_sdpa(comm, &c.in[RC_Q].t, &c.in[RC_K].t, &c.in[RC_V].t, &p,
                        result_or_null(&c, 0), result_or_null(&c, 1));
    Py_END_ALLOW_THREADS
    if (interrupt_guard_disarm(&guard, st) < 0) goto done;
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    if (c.result[0] == NULL) { /* cannot happen: the ring refuses a NULL out */
        PyErr_SetString(PyExc_RuntimeError, "ring_sdpa: the ring accepted shards without an out");
        goto done;
    }
    result = ring_results(&c, 2);
done:
    ring_call_release(&c);
    return result;
}

/* ------------------------------------------------------------------------ */
/* ring_sdpa_backward                                                        */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(ring_sdpa_backward_doc,
             "ring_sdpa_backward(dout, query, key, value, out, lse, *, comm, empty,\n"
             "     key_mask=None, causal=0, scale=None, enable_gqa=False, dropout_p=0.0,\n"
             "     seed=0, rng_offset=0, layout=0, timeout=60.0, want_dq=True,\n"
             "     want_dk=True, want_dv=True) -> (dq, dk, dv)\n\n"
             "attn_ring_sdpa_backward() on this rank's shards, given the ring_sdpa\n"
             "call's out and lse (best: lse_for_backward=True) and its options. Each\n"
             "gradient is shaped like its input, None unless asked for. Collective.");

/* The backward's gradients, each allocated like its input when wanted. */
static int ring_backward_outputs(ring_call *c, PyObject *empty, const int want[RC_NRES]) {
    static const char *const names[RC_NRES] = {"dq", "dk", "dv"};
    for (int r = 0; r < RC_NRES; r++) {
        if (!want[r]) continue;
        const attn_tensor *like = &c->in[RC_Q + r].t;
        c->result[r] = new_output(empty, like->rank, like->shape, like->dtype, names[r],
                                  &c->res[r]);
        if (c->result[r] == NULL) return -1;
    }
    return 0;
}

static PyObject *py_ring_sdpa_backward(PyObject *self, PyObject *args, PyObject *kwds) {
    (void)self;
    static char *kwlist[] = {"dout", "query", "key", "value", "out", "lse", "comm", "empty",
                             "key_mask", "causal", "scale", "enable_gqa", "dropout_p", "seed",
                             "rng_offset", "layout", "timeout", "want_dq", "want_dk",
                             "want_dv", NULL};
    PyObject *objs[RC_NIN] = {NULL}, *empty = NULL;
    ring_options o = RING_OPTIONS_INIT;
    int want[RC_NRES] = {1, 1, 1};
    if (!PyArg_ParseTupleAndKeywords(
            args, kwds, "OOOOOO|$OOOiOpdO&O&idppp:ring_sdpa_backward", kwlist, &objs[RC_DOUT],
            &objs[RC_Q], &objs[RC_K], &objs[RC_V], &objs[RC_OUT], &objs[RC_LSE], &o.comm,
            &empty, &o.sdpa.mask, &o.sdpa.causal, &o.sdpa.scale, &o.sdpa.gqa,
            &o.sdpa.dropout_p, convert_u64, &o.sdpa.seed, convert_u64, &o.sdpa.rng_offset,
            &o.layout, &o.timeout, &want[0], &want[1], &want[2]) ||
        require_empty(empty, "ring_sdpa_backward") < 0)
        return NULL;
    objs[RC_MASK] = o.sdpa.mask;
    MPI_Comm comm;
    attn_ring_params p;
    if (ring_params_from(&o, &comm, &p) < 0) return NULL;
    ring_call c;
    memset(&c, 0, sizeof c);
    PyObject *result = NULL;
    if (ring_inputs(&c, objs, RC_DOUT) < 0) goto done;
    if (c.has_mask) p.key_mask = &c.in[RC_MASK].t;
    if (ring_backward_outputs(&c, empty, want) < 0) goto done;
    interrupt_guard guard;
    interrupt_guard_arm(&guard);
    attn_status st;
    Py_BEGIN_ALLOW_THREADS
    st = attn_ring_sdpa_backward(comm, &c.in[RC_DOUT].t, &c.in[RC_Q].t, &c.in[RC_K].t,
                                 &c.in[RC_V].t, &c.in[RC_OUT].t, &c.in[RC_LSE].t, &p,
                                 result_or_null(&c, 0), result_or_null(&c, 1),
                                 result_or_null(&c, 2));
    Py_END_ALLOW_THREADS
    if (interrupt_guard_disarm(&guard, st) < 0) goto done;
    if (st != ATTN_OK) {
        raise_status(st);
        goto done;
    }
    result = ring_results(&c, RC_NRES);
done:
    ring_call_release(&c);
    return result;
}

/* ------------------------------------------------------------------------ */
/* Layouts and the MPI library                                               */
/* ------------------------------------------------------------------------ */

PyDoc_STRVAR(ring_shard_runs_doc,
             "ring_shard_runs(layout, total, nranks, rank) -> ((start, len), ...)\n\n"
             "attn_ring_shard_runs(): the runs of positions rank `rank` of `nranks`\n"
             "holds of a sequence of `total`, in the order its shard holds them.");

static PyObject *py_ring_shard_runs(PyObject *self, PyObject *args) {
    (void)self;
    int layout, nranks, rank;
    long long total;
    if (!PyArg_ParseTuple(args, "iLii:ring_shard_runs", &layout, &total, &nranks, &rank))
        return NULL;
    int nruns = 0;
    int64_t start[2], len[2];
    attn_status st = attn_ring_shard_runs((attn_ring_layout)layout, (int64_t)total, nranks, rank,
                                          &nruns, start, len);
    if (st != ATTN_OK) return raise_status(st);
    PyObject *runs = PyTuple_New(nruns);
    for (int i = 0; runs != NULL && i < nruns; i++) {
        PyObject *run = Py_BuildValue("(LL)", (long long)start[i], (long long)len[i]);
        if (run == NULL) Py_CLEAR(runs);
        else PyTuple_SET_ITEM(runs, i, run);
    }
    return runs;
}

/* MPI_Get_library_version needs no MPI_Init (MPI-3), so the Python layer can
 * compare it with mpi4py's before anything else. */
static PyObject *py_mpi_library_version(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    if (MPI_Get_library_version(version, &len) != MPI_SUCCESS) {
        PyErr_SetString(PyExc_RuntimeError, "MPI_Get_library_version failed");
        return NULL;
    }
    /* Open MPI counts the terminating NUL in len */
    const char *nul = memchr(version, '\0', (size_t)len);
    return PyUnicode_DecodeUTF8(version, nul != NULL ? nul - version : len, "replace");
}

static PyMethodDef ring_methods[] = {
    {"ring_sdpa", (PyCFunction)(void (*)(void))py_ring_sdpa, METH_VARARGS | METH_KEYWORDS,
     ring_sdpa_doc},
    {"ring_sdpa_backward", (PyCFunction)(void (*)(void))py_ring_sdpa_backward,
     METH_VARARGS | METH_KEYWORDS, ring_sdpa_backward_doc},
    {"ring_shard_runs", py_ring_shard_runs, METH_VARARGS, ring_shard_runs_doc},
    {"mpi_library_version", py_mpi_library_version, METH_NOARGS,
     "MPI_Get_library_version() of the MPI library attn was built with"},
    {NULL, NULL, 0, NULL}};

int ring_add_functions(PyObject *module) {
    return PyModule_AddFunctions(module, ring_methods);
}
