/*
 * test_schedule.c — the forward's work split when there are many cores.
 * Users run 16–128 threads; the machines that run these tests have 2.
 *
 *   - The bench's forward shapes, split for 16 and 64 threads and scheduled
 *     as the driver schedules them (each thread takes the next task when it
 *     frees; attn__flash_balance), keep every thread busy for at least
 *     BUSY_MIN of the time the busiest one works. The table printed (with
 *     128 threads) is the one in docs/design.md ("Many cores").
 *   - That the split changes no bit is tested elsewhere, as far as this
 *     machine can run it: test_sdpa scheduling_shapes_are_thread_independent
 *     and test_modifiers many_threads_same_bits compare runs on 1-4 threads
 *     and on attn_max_threads() (4 per processor: more than the cores) with
 *     the one-thread run on every path. The 16- and 64-thread splits above
 *     are checked for balance only: attn does not run more threads than
 *     that cap.
 */
#include "kernels/ukernel.h"
#include "problem/problem.h"
#include "sdpa/flash.h"
#include "testutil.h"

/* The share of the busiest thread's time the others must work, on average,
 * up to THREADS_PROMISED threads; 128 is printed, not promised (the small
 * causal and decode shapes have fewer tasks than threads there, see
 * docs/design.md). */
#define BUSY_MIN 0.90
enum { THREADS_PROMISED = 64 };

typedef struct shape {
    const char *name;
    int64_t B, H, Hkv, L, S, E;
    attn_causal causal;
    bool token_major; /* K/V rows hold every KV head: (B, S, Hkv, E) memory */
} shape;

/* The forward cases of `make bench` (bench/run.py) and the serving decode's
 * layout (8 sequences of a (B, S, H_kv, E) cache, one KV cache row read once). */
static const shape SHAPES[] = {
    {"(1,8,512,512,64)", 1, 8, 8, 512, 512, 64, ATTN_CAUSAL_NONE, false},
    {"(1,8,512,512,64) causal", 1, 8, 8, 512, 512, 64, ATTN_CAUSAL_TOP_LEFT, false},
    {"(1,16,2048,2048,64)", 1, 16, 16, 2048, 2048, 64, ATTN_CAUSAL_NONE, false},
    {"(1,16,2048,2048,64) causal", 1, 16, 16, 2048, 2048, 64, ATTN_CAUSAL_TOP_LEFT, false},
    {"(1,8,8192,8192,64)", 1, 8, 8, 8192, 8192, 64, ATTN_CAUSAL_NONE, false},
    {"(1,8,8192,8192,64) causal", 1, 8, 8, 8192, 8192, 64, ATTN_CAUSAL_TOP_LEFT, false},
    {"(4,12,512,512,64)", 4, 12, 12, 512, 512, 64, ATTN_CAUSAL_NONE, false},
    {"(4,12,512,512,64) causal", 4, 12, 12, 512, 512, 64, ATTN_CAUSAL_TOP_LEFT, false},
    {"(1,16,2048,2048,128)", 1, 16, 16, 2048, 2048, 128, ATTN_CAUSAL_NONE, false},
    {"(1,16,2048,2048,128) causal", 1, 16, 16, 2048, 2048, 128, ATTN_CAUSAL_TOP_LEFT, false},
    {"(1,32,1,4096,128) 8 KV heads", 1, 32, 8, 1, 4096, 128, ATTN_CAUSAL_NONE, false},
    {"(1,32,1,32768,128) 8 KV heads", 1, 32, 8, 1, 32768, 128, ATTN_CAUSAL_NONE, false},
    {"(8,32,1,32768,128) 8 KV heads, (B,S,H,E) cache", 8, 32, 8, 1, 32768, 128,
     ATTN_CAUSAL_NONE, true},
};

/* The problem attn_sdpa builds for a shape. Inputs are calloc'ed and never
 * touched (planning reads no element); token-major K/V are shared by the
 * batch (stride 0) so that 8 sequences of 32,768 rows take 128 MiB. */
typedef struct built {
    float *q, *k, *v, *out;
    attn__problem p;
} built;

static bool build(const shape *s, built *b) {
    const int64_t qs[4] = {s->B, s->H, s->L, s->E}, ks[4] = {s->B, s->Hkv, s->S, s->E};
    const int64_t kb = s->token_major ? 1 : s->B;
    b->q = calloc((size_t)(s->B * s->H * s->L * s->E), sizeof(float));
    b->out = calloc((size_t)(s->B * s->H * s->L * s->E), sizeof(float));
    b->k = calloc((size_t)(kb * s->Hkv * s->S * s->E), sizeof(float));
    b->v = calloc((size_t)(kb * s->Hkv * s->S * s->E), sizeof(float));
    if (!b->q || !b->out || !b->k || !b->v) return false;
    attn_tensor q, k, v, out;
    attn_tensor_init(&q, b->q, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&out, b->out, ATTN_DTYPE_F32, 4, qs);
    attn_tensor_init(&k, b->k, ATTN_DTYPE_F32, 4, ks);
    attn_tensor_init(&v, b->v, ATTN_DTYPE_F32, 4, ks);
    if (s->token_major) { /* (B, Hkv, S, E) view of (S, Hkv, E) memory */
        const int64_t st[4] = {0, s->E, s->Hkv * s->E, 1};
        memcpy(k.strides, st, sizeof st);
        memcpy(v.strides, st, sizeof st);
    }
    attn_sdpa_params prm;
    attn_sdpa_params_init(&prm);
    prm.causal = s->causal;
    prm.enable_gqa = s->Hkv != s->H;
    return attn__problem_from_sdpa(&b->p, &q, &k, &v, &prm, &out, NULL, NULL) == ATTN_OK;
}

static void unbuild(built *b) {
    free(b->q);
    free(b->k);
    free(b->v);
    free(b->out);
}

static void many_threads_stay_busy(void) {
    static const int threads[] = {16, 64, 128};
    enum { NT = sizeof threads / sizeof threads[0] };
    const attn__ukernel *kern = attn__ukernel_for(attn_get_isa());
    printf("  path %s; busy = work / (threads x the busiest thread's work)\n", kern->name);
    printf("  | case | rows per block | key chunks | tasks | 16 threads | 64 threads "
           "| 128 threads |\n");
    for (size_t i = 0; i < sizeof SHAPES / sizeof SHAPES[0]; i++) {
        const shape *s = &SHAPES[i];
        built b;
        const bool ok = build(s, &b);
        CHECK(ok, "%s: %s", s->name, attn_last_error());
        if (!ok) {
            unbuild(&b);
            continue;
        }
        attn__flash_split at[NT];
        for (int t = 0; t < NT; t++) CHECK_OK(attn__flash_balance(&b.p, kern, threads[t], &at[t]));
        printf("  | %s | %lld–%lld | %lld | %lld–%lld |", s->name,
               (long long)at[NT - 1].rows_per_block, (long long)at[0].rows_per_block,
               (long long)at[0].chunks, (long long)at[0].tasks, (long long)at[NT - 1].tasks);
        for (int t = 0; t < NT; t++) {
            printf(" %.0f%% (%lld–%lld tasks) |", 100 * at[t].busy, (long long)at[t].fewest,
                   (long long)at[t].most);
            if (threads[t] <= THREADS_PROMISED)
                CHECK(at[t].busy >= BUSY_MIN, "%s on %d threads: busy %.3f < %.2f (%lld tasks)",
                      s->name, threads[t], at[t].busy, BUSY_MIN, (long long)at[t].tasks);
        }
        printf("\n");
        unbuild(&b);
    }
}

/* No key chunk holds more than 2^24 keys (flash.c, CHUNK_MAX: a float32
 * running sum of weights <= 1 stops growing there; flat weights over 2^25
 * keys gave 0.5 for 1), in either layout: a prefill of many query blocks,
 * which did not split its keys at all, and a decode step, whose 64 chunks
 * grew past 2^24 keys beyond 2^30. At most 2^24 keys, nothing changes.
 * Planned only: the inputs are one value read through zero strides. */
static void long_rows_split_into_chunks_of_at_most_2_24_keys(void) {
    static float one[1];
    static float out[4096];
    const attn__ukernel *kern = attn__ukernel_for(attn_get_isa());
    const struct {
        int64_t L, S, chunks;
    } cases[] = {
        {1024, ((int64_t)1 << 25) + 64, 3}, /* many query blocks: 2^24, 2^24 and 64 keys */
        {1024, (int64_t)1 << 24, 1},          /* at the bound: one chunk, as before */
        {1, (int64_t)1 << 31, (int64_t)1 << 7}, /* a decode step over 2^31 keys */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const int64_t qs[2] = {cases[i].L, 1}, ks[2] = {cases[i].S, 1};
        attn_tensor q, k, o;
        attn_tensor_init(&q, one, ATTN_DTYPE_F32, 2, qs);
        attn_tensor_init(&k, one, ATTN_DTYPE_F32, 2, ks);
        attn_tensor_init(&o, out, ATTN_DTYPE_F32, 2, qs);
        q.strides[0] = k.strides[0] = 0;
        attn__problem p;
        CHECK_OK(attn__problem_from_sdpa(&p, &q, &k, &k, NULL, &o, NULL, NULL));
        attn__flash_split at;
        CHECK_OK(attn__flash_balance(&p, kern, 2, &at));
        printf("  L %lld, S %lld: %lld chunks of %lld keys\n", (long long)cases[i].L,
               (long long)cases[i].S, (long long)at.chunks, (long long)at.chunk);
        CHECK(at.chunk <= (int64_t)1 << 24 && at.chunks * at.chunk >= cases[i].S,
              "L %lld S %lld: %lld chunks of %lld keys", (long long)cases[i].L,
              (long long)cases[i].S, (long long)at.chunks, (long long)at.chunk);
        CHECK(at.chunks == cases[i].chunks,
              "L %lld S %lld: %lld chunks", (long long)cases[i].L, (long long)cases[i].S,
              (long long)at.chunks);
    }
}

HARNESS_MAIN(T(many_threads_stay_busy), T(long_rows_split_into_chunks_of_at_most_2_24_keys))
