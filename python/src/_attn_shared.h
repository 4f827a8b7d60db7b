/*
 * _attn_shared.h — what the extension's C files share (_attn_shared.c):
 * buffers as attn_tensor views, outputs from the Python allocator, library
 * failures as exceptions, Ctrl-C during a call, and the parsing of
 * attn_sdpa's options. Internal to the extension: the symbols are hidden in
 * the module (CMake's C_VISIBILITY_PRESET hidden). _attn_shared.c says what
 * each one does.
 */
#ifndef ATTN_PY_SHARED_H
#define ATTN_PY_SHARED_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "attn.h"

/* An input or output buffer seen as an attn_tensor (see view_get). */
typedef struct buffer_view {
    Py_buffer buf;
    int held;                           /* buf must be released */
    void *copy;                         /* PyMem block when the buffer was copied */
    Py_ssize_t strides[ATTN_MAX_RANK];  /* byte strides (buf's, or C order) */
    attn_tensor t;
} buffer_view;

/* The lse an output allocator makes for a query of dtype q: float64 for
 * float64 queries and for the backward (whose weights would inherit a
 * float32 lse's rounding), float32 otherwise (16-bit queries included). */
static inline attn_dtype lse_dtype_of(attn_dtype q, int for_backward) {
    return for_backward || q == ATTN_DTYPE_F64 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
}

/* A buffer's view: its dtype from its format, where 16-bit integers hold
 * bfloat16 bit patterns (NumPy has no bfloat16). */
int view_get(PyObject *obj, const char *name, int writable, buffer_view *v);
/* view_get_as's `as` for view_get's rule. */
#define VIEW_BF16_BITS ((attn_dtype)0x100)
/* view_get with a dtype rule: as = ATTN_DTYPE_BF16 requires a buffer of
 * 16-bit integers holding bfloat16; VIEW_BF16_BITS is view_get's rule. */
int view_get_as(PyObject *obj, const char *name, int writable, attn_dtype as,
                buffer_view *v);
int view_get_optional(PyObject *obj, const char *name, buffer_view *v, int *present);
void view_release(buffer_view *v);

/* Plain CPU torch tensors read without NumPy (_attn_tensors.c): whether obj
 * is one (exactly torch.Tensor, once registered), its view (0, or -1 with
 * an exception: NotReadInPlace where .numpy() would refuse it too; `bf16`:
 * bfloat16 is acceptable), and the module's _torch_intake. */
int is_plain_tensor(PyObject *obj);
int tensor_view(PyObject *obj, const char *name, int bf16, buffer_view *v);
int tensor_intake_add(PyObject *module);
/* A tuple of the shape's sizes (new reference), NULL with an exception set. */
PyObject *shape_tuple(int rank, const int64_t *shape);
PyObject *new_output(PyObject *empty, int rank, const int64_t *shape, attn_dtype dt,
                     const char *name, buffer_view *v);

/* The pool of recycled output memory (_attn_blocks.c): output_block() and
 * output_blocks_kept() added to the module; release empties the pool. */
int output_blocks_add(PyObject *module);
void output_blocks_release(void);

/* Always NULL, with the exception for a failed library call set. */
PyObject *raise_status(attn_status st);

/* SIGINT during a call sets the library's cancel flag (main thread only). */
typedef struct interrupt_guard {
    bool armed;
    struct sigaction saved;
} interrupt_guard;

/* Once, at import: notes the main thread. 0, or -1 with an exception set. */
int interrupt_guard_init(void);
void interrupt_guard_arm(interrupt_guard *g);
/* Armed only for calls of at least GUARD_MIN_WORK multiply-adds: a shorter
 * one ends within a millisecond or so, after which Python raises the
 * KeyboardInterrupt anyway, and arming costs 2-3 us (a Python call and
 * three sigaction system calls), more than a 16-token attention. */
#define GUARD_MIN_WORK ((double)(1 << 22))
void interrupt_guard_arm_for(interrupt_guard *g, double work);
int interrupt_guard_disarm(interrupt_guard *g, attn_status st);

int require_empty(PyObject *empty, const char *fn);
/* Inputs copied so far (layouts not describable in elements): _copies(). */
Py_ssize_t shared_copies_made(void);
int convert_u64(PyObject *obj, void *out); /* a PyArg "O&" converter */

/* attn_sdpa's options as the entry points parse them. */
typedef struct sdpa_options {
    PyObject *mask, *scale;
    int causal, gqa;
    double dropout_p;
    uint64_t seed, rng_offset;
} sdpa_options;

int sdpa_params_from(const sdpa_options *o, attn_sdpa_params *p);

/* The score modifiers of attn_sdpa_params (FlashAttention's window_size,
 * alibi_slopes, softcap, sinks) as every attention entry point parses them:
 * keywords window_left, window_right ("L"), softcap ("d"), alibi_slopes and
 * sinks ("O"). MODIFIERS_DEFAULT is attn_sdpa_params_init's: no window, no
 * ALiBi, no softcap, no sinks. */
typedef struct modifiers {
    long long window_left, window_right;
    double softcap;
    PyObject *alibi, *sinks; /* Py_None for none */
    buffer_view alibi_v, sinks_v;
} modifiers;

#define MODIFIERS_DEFAULT \
    { .window_left = -1, .window_right = -1, .softcap = 0.0, .alibi = Py_None, .sinks = Py_None }

/* Views of the slopes and sinks, and every field into *p: 0, or -1 with an
 * exception set. modifiers_release releases the views either way. */
int modifiers_apply(modifiers *m, attn_sdpa_params *p);
void modifiers_release(modifiers *m);

/* The gradient of an sdpa or sdpa_varlen call's sinks (sdpa_sinks_backward,
 * sdpa_varlen_sinks_backward): m's modifiers into *p (sinks required, a
 * TypeError naming them when None), dsinks made by empty() like them, then
 * run(ctx, p, dsinks) without the GIL. dsinks, or NULL with an exception
 * set; the caller releases m and its own views. */
typedef attn_status (*sinks_backward_fn)(void *ctx, const attn_sdpa_params *p,
                                         attn_tensor *dsinks);
PyObject *sinks_gradient(PyObject *empty, modifiers *m, attn_sdpa_params *p,
                         sinks_backward_fn run, void *ctx);

/* attn.varlen / attn.kvcache (_attn_serving.c): adds sdpa_varlen and
 * sdpa_kvcache to the module. */
int serving_add_functions(PyObject *module);

#ifdef ATTN_HAVE_RING
/* Adds the ring functions (_attn_ring.c) to the module. */
int ring_add_functions(PyObject *module);
#endif

#endif /* ATTN_PY_SHARED_H */
