/* comm.c — the ring's messages. Every wait has a deadline: a peer that is
 * killed, hung or cut off makes the call fail with ATTN_ERR_COMM, never hang
 * (MPI's own blocking calls would wait forever for a stopped process). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ring_internal.h"

static void pause_briefly(void) { /* waiting: leave the core to others */
    const struct timespec ts = {0, 50 * 1000};
    nanosleep(&ts, NULL);
}

/* "ring step t", or, outside the steps (rc->step < 0: the agreement, the
 * buffers' check), "before the ring steps". */
static const char *phase(const ring_comm *rc, char *buf, size_t size) {
    if (rc->step < 0) return "before the ring steps";
    snprintf(buf, size, "ring step %d", rc->step);
    return buf;
}

static attn_status mpi_failed(const ring_comm *rc, int err, const char *what) {
    char text[MPI_MAX_ERROR_STRING], at[32];
    int len = 0;
    if (MPI_Error_string(err, text, &len) != MPI_SUCCESS) snprintf(text, sizeof text, "code %d", err);
    return attn_set_error(ATTN_ERR_COMM, NULL, "attn_ring: rank %d, %s: %s failed: %s", rc->rank,
                          phase(rc, at, sizeof at), what, text);
}

/* Tests `req` until it completes or `deadline` (MPI_Wtime) passes.
 * `peers` gives each request's peer (receives as -1 - peer), NULL for a
 * collective: a timeout then names the silent peer, a receive's first. */
static attn_status wait_until(const ring_comm *rc, int count, MPI_Request *req, double deadline,
                              const char *what, const int *peers) {
    for (;;) {
        int done = 0;
        const int err = MPI_Testall(count, req, &done, MPI_STATUSES_IGNORE);
        if (err != MPI_SUCCESS) return mpi_failed(rc, err, what);
        if (done) return ATTN_OK;
        if (MPI_Wtime() > deadline) break;
        pause_briefly();
    }
    if (peers == NULL) /* a collective's request cannot be cancelled */
        return attn_set_error(ATTN_ERR_COMM, NULL,
                              "attn_ring: rank %d: %s not complete within %g s; another rank is "
                              "dead, hung or not calling (params.timeout)",
                              rc->rank, what, rc->timeout);
    int from = -1, to = -1;
    for (int i = 0; i < count; i++) {
        int flag = 1;
        if (req[i] != MPI_REQUEST_NULL) MPI_Test(&req[i], &flag, MPI_STATUS_IGNORE);
        if (!flag && peers[i] < 0 && from < 0) from = -1 - peers[i];
        if (!flag && peers[i] >= 0 && to < 0) to = peers[i];
    }
    if (from < 0 && to < 0) return ATTN_OK; /* the last ones came in as time ran out */
    /* Withdraw what is open: the buffers are about to be freed. */
    for (int i = 0; i < count; i++)
        if (req[i] != MPI_REQUEST_NULL) MPI_Cancel(&req[i]);
    /* The peer waited on may itself be waiting on its own neighbour: a
     * message names the one this rank saw fall silent, not the culprit. */
    char at[32];
    if (from >= 0)
        return attn_set_error(ATTN_ERR_COMM, NULL,
                              "attn_ring: rank %d, %s: no %s from rank %d within %g s; rank %d, "
                              "or a rank it waits on in turn, is dead, hung or cut off "
                              "(params.timeout)",
                              rc->rank, phase(rc, at, sizeof at), what, from, rc->timeout, from);
    return attn_set_error(ATTN_ERR_COMM, NULL,
                          "attn_ring: rank %d, %s: rank %d took no %s within %g s; it, or a rank "
                          "it waits on in turn, is dead, hung or cut off (params.timeout)",
                          rc->rank, phase(rc, at, sizeof at), to, what, rc->timeout);
}

/* ---- the ring's own communicator, one per caller's communicator ---- */

/* The duplicate is made on the first call on a communicator and cached on it
 * (an attribute), so later calls start with point-to-point waits that name
 * the silent peer: a duplication is collective, and a rank that hangs between
 * two calls would leave the next one's MPI_Comm_idup unable to say who. */
static _Atomic int g_keyval = MPI_KEYVAL_INVALID;

static int free_cached(MPI_Comm comm, int keyval, void *attr, void *extra) {
    (void)comm, (void)keyval, (void)extra;
    MPI_Comm *own = attr;
    if (*own != MPI_COMM_NULL) MPI_Comm_free(own);
    free(own);
    return MPI_SUCCESS;
}

static int cache_keyval(void) {
    int kv = atomic_load(&g_keyval);
    if (kv != MPI_KEYVAL_INVALID) return kv;
    if (MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, free_cached, &kv, NULL) != MPI_SUCCESS)
        return MPI_KEYVAL_INVALID;
    int none = MPI_KEYVAL_INVALID;
    if (!atomic_compare_exchange_strong(&g_keyval, &none, kv)) { /* another thread won */
        MPI_Comm_free_keyval(&kv);
        kv = none;
    }
    return kv;
}

attn_status ring_comm_open(MPI_Comm comm, double timeout, ring_comm *rc) {
    memset(rc, 0, sizeof *rc);
    rc->comm = MPI_COMM_NULL;
    rc->timeout = timeout;
    rc->step = -1; /* the steps set it */
    int init = 0, fin = 0;
    MPI_Initialized(&init);
    MPI_Finalized(&fin);
    if (!init || fin)
        return attn_set_error(ATTN_ERR_INVALID, "comm",
                              "attn_ring: MPI is %s; call MPI_Init first",
                              fin ? "finalized" : "not initialised");
    if (comm == MPI_COMM_NULL)
        return attn_set_error(ATTN_ERR_INVALID, "comm", "attn_ring: comm is MPI_COMM_NULL");
    int inter = 0;
    int err = MPI_Comm_test_inter(comm, &inter);
    if (err == MPI_SUCCESS && inter)
        return attn_set_error(ATTN_ERR_INVALID, "comm",
                              "attn_ring: comm is an intercommunicator; the ring runs over the "
                              "ranks of one group (an intracommunicator)");
    if (err == MPI_SUCCESS) err = MPI_Comm_rank(comm, &rc->rank);
    if (err == MPI_SUCCESS) err = MPI_Comm_size(comm, &rc->n);
    if (err != MPI_SUCCESS) return mpi_failed(rc, err, "MPI_Comm_rank");
    const int kv = cache_keyval();
    if (kv != MPI_KEYVAL_INVALID) {
        MPI_Comm *cached = NULL;
        int found = 0;
        if (MPI_Comm_get_attr(comm, kv, &cached, &found) == MPI_SUCCESS && found) {
            rc->comm = *cached;
            return ATTN_OK;
        }
    }
    MPI_Comm *own = malloc(sizeof *own);
    if (own == NULL)
        return attn_set_error(ATTN_ERR_NOMEM, NULL, "attn_ring: out of memory (communicator)");
    MPI_Request req;
    err = MPI_Comm_idup(comm, own, &req);
    if (err != MPI_SUCCESS) {
        free(own);
        return mpi_failed(rc, err, "MPI_Comm_idup");
    }
    attn_status st = wait_until(rc, 1, &req, MPI_Wtime() + timeout, "duplicating comm", NULL);
    if (st != ATTN_OK) /* own is not freed: the abandoned request may still write the new
                          communicator there (8 bytes, after an error that ends the job) */
        return st;
    /* Errors on our own communicator come back as codes, not aborts. */
    MPI_Comm_set_errhandler(*own, MPI_ERRORS_RETURN);
    rc->comm = *own;
    if (kv == MPI_KEYVAL_INVALID || MPI_Comm_set_attr(comm, kv, own) != MPI_SUCCESS)
        rc->owned = own; /* not cached: this call frees it */
    return ATTN_OK;
}

void ring_comm_close(ring_comm *rc) {
    if (rc->owned != NULL) {
        MPI_Comm_free(rc->owned);
        free(rc->owned);
        rc->owned = NULL;
    }
    rc->comm = MPI_COMM_NULL;
}

enum { PIECE = 1 << 30 }; /* bytes per message piece: counts are ints */

static attn_status post(ring_comm *rc, void *buf, size_t bytes, int peer, int tag, ring_msgs *m,
                        bool send) {
    for (size_t at = 0; at < bytes || (bytes == 0 && at == 0); at += PIECE) {
        if (m->count == (int)(sizeof m->req / sizeof m->req[0]))
            return attn_set_error(ATTN_ERR_UNSUPPORTED, NULL,
                                  "attn_ring: a shard of %zu bytes is too large for one message",
                                  bytes);
        const int n = (int)(bytes - at < PIECE ? bytes - at : PIECE);
        char *p = (char *)buf + at;
        const int err = send ? MPI_Isend(p, n, MPI_BYTE, peer, tag, rc->comm, &m->req[m->count])
                             : MPI_Irecv(p, n, MPI_BYTE, peer, tag, rc->comm, &m->req[m->count]);
        if (err != MPI_SUCCESS) return mpi_failed(rc, err, send ? "MPI_Isend" : "MPI_Irecv");
        m->peers[m->count] = send ? peer : -1 - peer;
        m->count++;
        if (bytes == 0) break;
    }
    return ATTN_OK;
}

attn_status ring_send(ring_comm *rc, const void *buf, size_t bytes, int peer, int tag,
                      ring_msgs *m) {
    return post(rc, (void *)buf, bytes, peer, tag, m, true);
}

attn_status ring_recv(ring_comm *rc, void *buf, size_t bytes, int peer, int tag, ring_msgs *m) {
    return post(rc, buf, bytes, peer, tag, m, false);
}

void ring_progress(ring_msgs *m) {
    int done;
    if (m->count > 0) MPI_Testall(m->count, m->req, &done, MPI_STATUSES_IGNORE);
}

attn_status ring_wait(ring_comm *rc, ring_msgs *m) {
    attn_status st = ATTN_OK;
    if (m->count > 0)
        st = wait_until(rc, m->count, m->req, MPI_Wtime() + rc->timeout, m->what, m->peers);
    m->count = 0;
    return st;
}

/* ---- agreement ---- */

static void put_kind(ring_desc *d, int *count, const char *name, int64_t value,
                     ring_value_kind kind) {
    if (*count >= RING_DESC_INTS) return; /* the callers stay below; see ring.c */
    d->v[*count] = value;
    d->kinds[*count] = (unsigned char)kind;
    snprintf(d->names[*count], sizeof d->names[0], "%s", name);
    (*count)++;
}

void ring_desc_put(ring_desc *d, int *count, const char *name, int64_t value) {
    put_kind(d, count, name, value, RING_INT);
}

void ring_desc_put_double(ring_desc *d, int *count, const char *name, double value) {
    int64_t bits; /* bit for bit: 0.1 and 0.1 + 1 ulp differ, and so do NaNs */
    memcpy(&bits, &value, sizeof bits);
    put_kind(d, count, name, bits, RING_DOUBLE);
}

void ring_desc_put_dtype(ring_desc *d, int *count, const char *name, const attn_tensor *t) {
    put_kind(d, count, name, t != NULL ? (int64_t)t->dtype : -1, RING_DTYPE);
}

/* An entry as the caller wrote it: 0.1, not its bits; float32, not 1. */
static const char *shown(const ring_desc *d, int i, char *buf, size_t cap) {
    double x;
    switch ((ring_value_kind)d->kinds[i]) {
    case RING_DOUBLE:
        memcpy(&x, &d->v[i], sizeof x);
        snprintf(buf, cap, "%.15g", x); /* the shortest of these that reads back as x */
        if (strtod(buf, NULL) != x) snprintf(buf, cap, "%.17g", x);
        break;
    case RING_DTYPE:
        snprintf(buf, cap, "%s", d->v[i] < 0 ? "not given" : attn_dtype_name((attn_dtype)d->v[i]));
        break;
    default:
        snprintf(buf, cap, "%lld", (long long)d->v[i]);
    }
    return buf;
}

attn_status ring_agree(ring_comm *rc, const ring_desc *mine, int count, ring_desc *all) {
    /* A ring allgather, not MPI_Iallgather: hop h passes on the description
     * that arrived at hop h - 1, so every wait is on one peer, and a timeout
     * names it (a collective's cannot). */
    const int n = rc->n, next = (rc->rank + 1) % n, prev = (rc->rank + n - 1) % n;
    all[rc->rank] = *mine;
    for (int hop = 0; hop < n - 1; hop++) {
        ring_msgs m;
        memset(&m, 0, sizeof m);
        m.what = "call description";
        const int out = (rc->rank - hop + n) % n, in = (prev - hop + n) % n;
        attn_status st = ring_recv(rc, &all[in], sizeof *all, prev, 1 << 21 | hop, &m);
        if (st == ATTN_OK) st = ring_send(rc, &all[out], sizeof *all, next, 1 << 21 | hop, &m);
        if (st == ATTN_OK) st = ring_wait(rc, &m);
        if (st != ATTN_OK) return st;
    }
    if (mine->status != ATTN_OK) /* our own message is already set */
        return attn_set_error((attn_status)mine->status, mine->arg, "%s", mine->msg);
    for (int r = 0; r < rc->n; r++)
        if (all[r].status != ATTN_OK)
            return attn_set_error((attn_status)all[r].status, all[r].arg,
                                  "attn_ring: rank %d failed: %s", r, all[r].msg);
    for (int r = 0; r < rc->n; r++)
        for (int i = 0; i < count; i++) {
            if (all[r].v[i] == mine->v[i]) continue;
            char theirs[32], ours[32];
            return attn_set_error(all[r].kinds[i] == RING_DTYPE ? ATTN_ERR_DTYPE
                                  : strstr(all[r].names[i], "shape") != NULL ||
                                          strstr(all[r].names[i], ".rank") != NULL
                                      ? ATTN_ERR_SHAPE
                                      : ATTN_ERR_INVALID,
                                  all[r].names[i],
                                  "attn_ring: %s is %s on rank %d but %s on rank %d: "
                                  "every rank must make the same call on its shard",
                                  all[r].names[i], shown(&all[r], i, theirs, sizeof theirs), r,
                                  shown(mine, i, ours, sizeof ours), rc->rank);
        }
    return ATTN_OK;
}

attn_status ring_finish(ring_comm *rc, attn_status mine, const char *what) {
    /* the worst status and the first rank that failed, passed round the
     * ring (N - 1 hops): a wait that times out names the rank before */
    int acc[2] = {(int)mine, mine != ATTN_OK ? rc->rank : rc->n}, in[2];
    const int next = (rc->rank + 1) % rc->n, prev = (rc->rank + rc->n - 1) % rc->n;
    attn_status st = ATTN_OK;
    for (int hop = 0; hop < rc->n - 1 && st == ATTN_OK; hop++) {
        ring_msgs m;
        memset(&m, 0, sizeof m);
        m.what = what;
        st = ring_recv(rc, in, sizeof in, prev, 1 << 20 | hop, &m);
        if (st == ATTN_OK) st = ring_send(rc, acc, sizeof acc, next, 1 << 20 | hop, &m);
        if (st == ATTN_OK) st = ring_wait(rc, &m);
        if (st == ATTN_OK) {
            acc[0] = in[0] > acc[0] ? in[0] : acc[0];
            acc[1] = in[1] < acc[1] ? in[1] : acc[1];
        }
    }
    if (st != ATTN_OK || mine != ATTN_OK) return st != ATTN_OK ? st : mine;
    if (acc[0] != ATTN_OK)
        return attn_set_error((attn_status)acc[0], NULL,
                              "attn_ring: rank %d failed (%s); see its own message", acc[1],
                              attn_strerror((attn_status)acc[0]));
    return ATTN_OK;
}
