/*
 * ring_internal.h — the pieces of attn_ring: shard geometry and strided
 * copies (shard.c), messages with deadlines and the agreement (comm.c), and
 * the forward and backward rings (ring.c). Written on libattn's public API
 * only: attn_ring is a separate library, and libattn stays free of MPI.
 */
#ifndef ATTN_RING_INTERNAL_H
#define ATTN_RING_INTERNAL_H

#include <stdbool.h>

#include "attn_ring.h"

/* ---- shard.c ---- */

/* The runs of positions one rank holds: global start, length, and the row of
 * the rank's shard where the run begins. */
typedef struct ring_runs {
    int n;
    int64_t start[2], len[2], row[2];
} ring_runs;

/* The runs of `rank` for a sequence of `total` under `layout`, given every
 * rank's shard length (lens[N]; CONTIGUOUS runs follow them in rank order). */
void ring_runs_of(attn_ring_layout layout, int64_t total, int nranks, int rank,
                  const int64_t *lens, ring_runs *out);

/* dst = src element by element (same shape): bytes when the dtypes agree,
 * else attn_tensor_convert's conversion (each value rounded once). */
void ring_copy(const attn_tensor *src, const attn_tensor *dst);

/* dst += src element by element (same shape); dst is float64. */
void ring_add(const attn_tensor *src, const attn_tensor *dst);

/* A view of rows [r0, r0 + n) along dimension `dim` of t. */
attn_tensor ring_rows(const attn_tensor *t, int dim, int64_t r0, int64_t n);

/* A C-contiguous view of `data` with t's shape (and its own dtype). */
attn_tensor ring_dense_like(const attn_tensor *t, void *data, attn_dtype dtype);

/* Bytes of a C-contiguous tensor of t's shape in `dtype`. */
size_t ring_bytes(const attn_tensor *t, attn_dtype dtype);

/* ---- comm.c ---- */

typedef struct ring_comm {
    MPI_Comm comm;        /* the ring's own duplicate, MPI_ERRORS_RETURN */
    MPI_Comm *owned;      /* the duplicate when it could not be cached, else NULL */
    int rank, n;
    double timeout;       /* seconds per wait */
    int step;             /* for messages: the ring step under way; -1 before the steps */
} ring_comm;

/* A set of outstanding non-blocking operations. */
typedef struct ring_msgs {
    MPI_Request req[64];
    int peers[64]; /* each request's peer; receives are negative: -1 - peer */
    int count;
    const char *what;     /* "K/V shard", "dK/dV sums", ... for messages */
} ring_msgs;

/* The ring's duplicate of comm: made (non-blocking, within the timeout) on
 * the first call on comm and cached on it, freed with comm. */
attn_status ring_comm_open(MPI_Comm comm, double timeout, ring_comm *rc);
void ring_comm_close(ring_comm *rc);

/* Posts a send / receive of `bytes` bytes (split into pieces MPI's int
 * counts can carry). */
attn_status ring_send(ring_comm *rc, const void *buf, size_t bytes, int peer, int tag,
                      ring_msgs *m);
attn_status ring_recv(ring_comm *rc, void *buf, size_t bytes, int peer, int tag, ring_msgs *m);
/* Gives MPI a chance to move outstanding messages (between compute pieces). */
void ring_progress(ring_msgs *m);
/* Waits for every operation of m until the deadline: ATTN_ERR_COMM naming
 * the peer, step and timeout when it passes, or when MPI reports an error. */
attn_status ring_wait(ring_comm *rc, ring_msgs *m);

/* What a rank's call looks like, exchanged before any compute. */
enum { RING_DESC_INTS = 96, RING_MSG = 320, RING_ARG = 64 };
typedef struct ring_desc {
    int64_t status;             /* the rank's own validation: ATTN_OK or why not */
    int64_t L, S;               /* its shard lengths */
    int64_t v[RING_DESC_INTS];  /* everything that must agree */
    char names[RING_DESC_INTS][24]; /* what each entry is, for messages */
    unsigned char kinds[RING_DESC_INTS]; /* how a message shows it: ring_value_kind */
    char msg[RING_MSG], arg[RING_ARG];
} ring_desc;

/* What an entry holds: an integer, a double's bits (compared bit for bit),
 * or an attn_dtype (-1: that tensor was not given). */
typedef enum { RING_INT, RING_DOUBLE, RING_DTYPE } ring_value_kind;

/* Appends an entry that must agree over the ranks. */
void ring_desc_put(ring_desc *d, int *count, const char *name, int64_t value);
void ring_desc_put_double(ring_desc *d, int *count, const char *name, double value);
void ring_desc_put_dtype(ring_desc *d, int *count, const char *name, const attn_tensor *t);

/* Allgathers every rank's description (all[n]) and checks that they agree:
 * a rank that failed its own checks makes all fail with its message; an
 * entry that differs fails naming the first rank that differs. */
attn_status ring_agree(ring_comm *rc, const ring_desc *mine, int count, ring_desc *all);

/* Every rank's status, passed round the ring: all fail when one did.
 * `what` names the exchange in a timeout's message. */
attn_status ring_finish(ring_comm *rc, attn_status mine, const char *what);

#endif /* ATTN_RING_INTERNAL_H */
