/*
 * test_core.c — the pieces under everything: Philox against Random123's
 * known answers, CPU-feature decoding (including feature sets this machine
 * lacks), the kernel-path switch, the allocator hook, threads and views.
 */
#include "core/internal.h"
#include "testutil.h"

static void philox_known_answers(void) {
    /* Random123 tests/kat_vectors, "philox4x32 10" lines. */
    static const uint32_t kat[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1}};
    for (int i = 0; i < 3; i++) {
        uint32_t lib[4], own[4];
        attn__philox4x32_10(kat[i], kat[i] + 4, lib);
        oracle_philox(kat[i], kat[i] + 4, own);
        for (int w = 0; w < 4; w++) {
            CHECK(lib[w] == kat[i][6 + w], "library vector %d word %d: %08x", i, w, lib[w]);
            CHECK(own[w] == kat[i][6 + w], "test oracle vector %d word %d: %08x", i, w, own[w]);
        }
    }
    CHECK(attn__dropout_threshold(0) == 0, "p = 0 keeps every word");
    CHECK(attn__dropout_threshold(1) == 4294967296ull, "p = 1 keeps none");
    CHECK(attn__dropout_threshold(0.5) == 2147483648ull, "p = 0.5");
}

static void cpu_feature_decoding(void) {
    const uint32_t ecx_avx_fma = (1u << 29) | (1u << 28) | (1u << 12) | (1u << 27); /* +F16C */
    const uint32_t ebx_avx2 = 1u << 5, ebx_avx512 = (1u << 5) | (1u << 16);
    attn__cpu_features f = attn__cpu_decode(ecx_avx_fma, ebx_avx512, 0, 0xE7, true);
    CHECK(f.avx2_fma && f.avx512f && !f.avx512_core, "AVX-512F alone (Knights Landing)");
    const uint32_t ebx_skx = ebx_avx512 | (1u << 17) | (1u << 30) | (1u << 31); /* DQ BW VL */
    f = attn__cpu_decode(ecx_avx_fma, ebx_skx, 0, 0xE7, true);
    CHECK(f.avx512f && f.avx512_core, "F+DQ+BW+VL: the AVX-512 core set OpenBLAS SkylakeX needs");
    f = attn__cpu_decode(ecx_avx_fma, ebx_skx & ~(1u << 30), 0, 0xE7, true);
    CHECK(f.avx512f && !f.avx512_core, "no AVX-512BW: not the core set");
    f = attn__cpu_decode(ecx_avx_fma, ebx_skx, 0, 0x07, true);
    CHECK(!f.avx512f && !f.avx512_core, "core set without OS ZMM support must not be used");
    f = attn__cpu_decode(ecx_avx_fma, ebx_avx512, 0, 0x07, true); /* OS saves no ZMM */
    CHECK(f.avx2_fma && !f.avx512f, "AVX-512 without OS ZMM support must not be used");
    f = attn__cpu_decode(ecx_avx_fma, ebx_avx512, 0, 0x03, true); /* OS saves no YMM */
    CHECK(!f.avx2_fma && !f.avx512f, "no YMM state: no AVX2");
    f = attn__cpu_decode(ecx_avx_fma, ebx_avx2, 0, 0xE7, false); /* OSXSAVE off */
    CHECK(!f.avx2_fma, "xgetbv unusable: no AVX");
    f = attn__cpu_decode(1u << 29 | 1u << 28 | 1u << 27, ebx_avx2, 0, 0x07, true); /* no FMA */
    CHECK(!f.avx2_fma, "AVX2 without FMA is not the avx2 path");
    f = attn__cpu_decode(ecx_avx_fma & ~(1u << 29), ebx_avx2, 0, 0x07, true); /* no F16C */
    CHECK(!f.avx2_fma, "AVX2 without F16C is not the avx2 path (its float16 loads)");
    f = attn__cpu_decode(ecx_avx_fma, ebx_skx, 1u << 5, 0xE7, true);
    CHECK(f.avx512_core && f.avx512_bf16, "AVX512-BF16 (leaf 7.1 EAX bit 5) on the core set");
    f = attn__cpu_decode(ecx_avx_fma, ebx_avx512, 1u << 5, 0xE7, true);
    CHECK(!f.avx512_bf16, "AVX512-BF16 without BW/DQ/VL is not the bf16 path");
    f = attn__cpu_decode(ecx_avx_fma, ebx_skx, 1u << 5, 0x07, true);
    CHECK(!f.avx512_bf16, "AVX512-BF16 without OS ZMM support must not be used");
    f = attn__cpu_decode(0, 0, 0, 0, false);
    CHECK(!f.avx2_fma && !f.avx512f, "bare machine");
    /* AMX: AMX-TILE (leaf 7 EDX bit 24) and AMX-BF16 (bit 22), and the OS
     * saving XTILECFG and XTILEDATA (XCR0 bits 17, 18) */
    const uint32_t edx_amx = 1u << 24 | 1u << 22;
    CHECK(attn__amx_decode(edx_amx, 0x600E7), "AMX with the tile state saved");
    CHECK(!attn__amx_decode(edx_amx, 0xE7) && !attn__amx_decode(edx_amx, 0x400E7),
          "AMX without both tile state bits in XCR0 must not be used");
    CHECK(!attn__amx_decode(1u << 24, 0x600E7) && !attn__amx_decode(1u << 22, 0x600E7),
          "AMX-TILE without AMX-BF16 (or the reverse) is not the amx path");
    /* Streamed K/V rows are requested ahead only where that was measured
     * faster (cpu.c): Zen 5 and later on every walk, Zen 3 on the walk one
     * head at a time and four times as far, Emerald Rapids on that walk at
     * the kernels' distance, not Zen 4, not other Intel CPUs yet. The
     * ganged walk's whole rows: everywhere but rows of a page or more on
     * Zen 3. */
    const unsigned rows = ATTN__AHEAD_ROWS;
    const unsigned both = ATTN__AHEAD_HEADS | ATTN__AHEAD_GANG | rows;
    CHECK(attn__stream_prefetch_for(true, 0x1A, 0x02) == both &&
              attn__stream_prefetch_for(true, 0x1B, 0x00) == both,
          "Zen 5 and later request streamed rows ahead on every walk");
    const unsigned zen3 =
        ATTN__AHEAD_HEADS | ATTN__AHEAD_FAR | ATTN__AHEAD_SHORT_ROWS | ATTN__AHEAD_V_BLOCK;
    CHECK(attn__stream_prefetch_for(true, 0x19, 0x01) == zen3 &&
              attn__stream_prefetch_for(true, 0x19, 0x21) == zen3 &&
              attn__stream_prefetch_for(true, 0x19, 0x50) == zen3,
          "Zen 3 (Milan, Vermeer, Cezanne) requests ahead on the per-head walk only, far, "
          "with each block's V rows whole, and on the ganged walk whole rows under a page only");
    CHECK(attn__stream_prefetch_for(true, 0x19, 0x11) == rows &&
              attn__stream_prefetch_for(true, 0x19, 0x61) == rows &&
              attn__stream_prefetch_for(true, 0x17, 0x31) == rows,
          "Zen 4 and Zen 2 keep their own prefetchers but for the ganged walk's whole rows");
    CHECK(attn__stream_prefetch_for(false, 6, 0x8F) == rows &&
              attn__stream_prefetch_for(false, 6, 0x55) == rows &&
              attn__stream_prefetch_for(false, 0x1A, 0) == rows,
          "Intel CPUs not measured: only the ganged walk's whole rows");
    CHECK(attn__stream_prefetch_for(false, 6, 0xCF) ==
              (ATTN__AHEAD_HEADS | ATTN__AHEAD_SHORT_ROWS),
          "Emerald Rapids requests ahead on the per-head walk, and whole rows under a page");
    CHECK(attn__gang_rows_ahead_for(zen3, 4095) && !attn__gang_rows_ahead_for(zen3, 4096) &&
              !attn__gang_rows_ahead_for(zen3, 16384),
          "Zen 3 requests whole rows shorter than a 4 KiB page only");
    CHECK(attn__gang_rows_ahead_for(rows, 512) && attn__gang_rows_ahead_for(rows, 16384) &&
              attn__gang_rows_ahead_for(both, 4096) && !attn__gang_rows_ahead_for(0, 512),
          "elsewhere every row, whatever its size; none with every request off");
    /* What this machine reports is consistent with the public query. */
    const attn__cpu_features *here = attn__cpu();
    CHECK(attn_isa_supported(ATTN_ISA_AVX512) == here->avx512f, "isa_supported(avx512)");
    CHECK(attn_isa_supported(ATTN_ISA_AVX2) == here->avx2_fma, "isa_supported(avx2)");
    /* (a compiler without -mavx512bf16 leaves the path out on any CPU) */
    CHECK(!attn_isa_supported(ATTN_ISA_AVX512_BF16) || here->avx512_bf16,
          "isa_supported(avx512_bf16) only where the CPU has it");
    CHECK(!attn_isa_supported(ATTN_ISA_AMX) || (here->amx && here->avx512_bf16),
          "isa_supported(amx) only where the CPU has it and the OS granted the tiles");
    CHECK(attn_isa_supported(ATTN_ISA_REF) && attn_isa_supported(ATTN_ISA_GENERIC),
          "portable paths always run");
    printf("  this CPU: avx2+fma %s, avx512f %s, avx512-bf16 %s, amx %s, streamed rows "
           "requested ahead %s\n", here->avx2_fma ? "yes" : "no", here->avx512f ? "yes" : "no",
           here->avx512_bf16 ? "yes" : "no", here->amx ? "yes" : "no",
           attn__stream_prefetch() ? "yes" : "no");
}

static void isa_switch(void) {
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++) {
        attn_isa isa = (attn_isa)i;
        if (attn_isa_supported(isa)) {
            CHECK_OK(attn_set_isa(isa));
            CHECK(attn_get_isa() == isa, "set %s, got %s", attn_isa_name(isa),
                  attn_isa_name(attn_get_isa()));
        } else {
            CHECK_STATUS(attn_set_isa(isa), ATTN_ERR_UNSUPPORTED);
        }
    }
    CHECK_OK(attn_set_isa(ATTN_ISA_AUTO));
    CHECK(attn_get_isa() != ATTN_ISA_AUTO, "AUTO resolves to a concrete path");
    CHECK(strcmp(attn_isa_name(ATTN_ISA_AVX512), "avx512") == 0, "names");
    CHECK(strcmp(attn_isa_name(ATTN_ISA_AVX512_BF16), "avx512_bf16") == 0, "names");
    CHECK(strcmp(attn_isa_name(ATTN_ISA_AMX), "amx") == 0, "names");
}

/* ---- the allocator hook ---- */

/* The counters are atomic: attn may allocate from its worker threads. */
typedef struct counting {
    _Atomic long allocs, frees;
    long fail_at; /* fail the fail_at-th allocation (1-based), 0 never */
} counting;

static void *count_alloc(void *ctx, size_t size) {
    counting *c = ctx;
    if (++c->allocs == c->fail_at) return NULL;
    return malloc(size);
}
static void count_release(void *ctx, void *p) {
    ((counting *)ctx)->frees++;
    free(p);
}

static void allocator_hook(void) {
    counting c = {0, 0, 0};
    attn_allocator a = {count_alloc, count_release, &c};
    attn_set_allocator(&a);
    double q[6] = {1, 2, 3, 4, 5, 6}, o[6];
    int64_t s[2] = {3, 2};
    attn_tensor t, out;
    attn_tensor_init(&t, q, ATTN_DTYPE_F64, 2, s);
    attn_tensor_init(&out, o, ATTN_DTYPE_F64, 2, s);
    CHECK_OK(attn_sdpa(&t, &t, &t, NULL, &out, NULL, NULL));
    CHECK(c.allocs > 0 && c.allocs == c.frees, "%ld allocations, %ld frees", c.allocs, c.frees);
    c.allocs = c.frees = 0;
    c.fail_at = 1;
    CHECK_STATUS(attn_sdpa(&t, &t, &t, NULL, &out, NULL, NULL), ATTN_ERR_NOMEM);
    CHECK(c.allocs - 1 == c.frees, "a failed call leaks: %ld allocations, %ld frees", c.allocs,
          c.frees);
    attn_set_allocator(NULL);
    long before = c.allocs;
    CHECK_OK(attn_sdpa(&t, &t, &t, NULL, &out, NULL, NULL));
    CHECK(c.allocs == before, "the hook is still called after reset");
}

/* ---- workspace kept between calls (alloc.c) ---- */

typedef struct tracking { /* atomic, as counting */
    _Atomic long live, big; /* blocks held now; requests of 64 KiB or more so far */
    _Atomic size_t bytes;   /* bytes requested so far */
} tracking;

static void *track_alloc(void *ctx, size_t size) {
    tracking *c = ctx;
    void *p = malloc(size);
    if (p) c->live++;
    if (size >= (64 << 10)) c->big++;
    c->bytes += size;
    return p;
}
static void track_release(void *ctx, void *p) {
    ((tracking *)ctx)->live--;
    free(p);
}

/* A call (its per-thread scratch is over 64 KiB) made twice takes no new
 * large block the second time, gives the same bits from the reused (dirty)
 * workspace, and attn_release_workspace hands every kept block back. */
static void workspace_kept(void) {
    tracking c = {0, 0, 0};
    attn_allocator a = {track_alloc, track_release, &c};
    attn_set_allocator(&a);
    rng r = {harness_seed() ^ 0x5eedULL};
    const int64_t qs[4] = {1, 2, 256, 256}, ks[4] = {1, 2, 256, 256};
    test_tensor q, k, v, o1, o2;
    tt_make(&q, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&k, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&v, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make_output(&o1, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS);
    tt_make_output(&o2, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS);
    CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, NULL, &o1.t, NULL, NULL));
    const long first = c.big;
    CHECK(first > 0, "the call took no large workspace; the test needs a larger shape");
    CHECK(c.live > 0, "nothing kept after the first call");
    CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, NULL, &o2.t, NULL, NULL));
    CHECK(c.big == first, "the second call allocated %ld large blocks again", c.big - first);
    CHECK(memcmp(o1.storage, o2.storage, sizeof(float) * 2 * 256 * 256) == 0,
          "reused workspace changed the result");
    attn_release_workspace();
    CHECK(c.live == 0, "%ld blocks still held after attn_release_workspace", c.live);
    CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, NULL, &o2.t, NULL, NULL));
    CHECK(c.big == 2 * first, "after the release the call allocates afresh");
    CHECK(memcmp(o1.storage, o2.storage, sizeof(float) * 2 * 256 * 256) == 0, "fresh workspace");
    attn_set_allocator(NULL); /* hands the kept blocks back to `a` first */
    CHECK(c.live == 0, "%ld blocks held after attn_set_allocator", c.live);

    /* The rules, through the internal door: at most 8 blocks and 64 MiB
     * kept, a block reused only for a request of at least half its size,
     * zeroed on request even when reused. */
    attn_set_allocator(&a);
    char *blocks[10];
    for (int i = 0; i < 10; i++) {
        blocks[i] = attn__work_alloc(1 << 20, 1, false);
        CHECK(blocks[i] != NULL, "1 MiB block %d", i);
    }
    for (int i = 0; i < 10; i++) attn__work_free(blocks[i]);
    CHECK(c.live == 8, "%ld of ten freed 1 MiB blocks kept; expected the 8 slots", c.live);
    long before = c.big;
    char *small = attn__work_alloc(300 << 10, 1, false); /* under half of 1 MiB: fresh */
    CHECK(c.big == before + 1, "a 1 MiB block served a 300 KiB request");
    char *reused = attn__work_alloc(600 << 10, 1, true);
    CHECK(c.big == before + 1, "a kept 1 MiB block did not serve a 600 KiB request");
    bool zero = true;
    for (int i = 0; i < (600 << 10); i++) zero = zero && reused[i] == 0;
    CHECK(zero, "a reused block asked for zeroed came back dirty");
    attn__work_free(small);
    attn__work_free(reused);
    attn_release_workspace();
    CHECK(c.live == 0, "%ld blocks after release", c.live);
    char *large[3];
    for (int i = 0; i < 3; i++) large[i] = attn__work_alloc((size_t)30 << 20, 1, false);
    for (int i = 0; i < 3; i++) attn__work_free(large[i]);
    CHECK(c.live == 2, "%ld blocks of 30 MiB kept; 64 MiB holds 2", c.live);
    char *huge = attn__work_alloc((size_t)65 << 20, 1, false);
    CHECK(huge != NULL, "65 MiB block");
    attn__work_free(huge);
    CHECK(c.live == 2, "a block over 64 MiB was kept");
    CHECK(attn__work_alloc(SIZE_MAX / 2, 4, false) == NULL, "count x size overflow");
    attn_set_allocator(NULL);
    CHECK(c.live == 0, "%ld blocks after attn_set_allocator", c.live);
    tt_free(&q), tt_free(&k), tt_free(&v), tt_free(&o1), tt_free(&o2);
}

/* A call too small to split runs on one thread and takes one thread's
 * scratch, whatever the thread count (on a 64-core machine a decode step's
 * scratch is 0.5 MiB a thread). */
static void serial_call_scratch(void) {
    rng r = {harness_seed() ^ 0x5c7a7cULL};
    const int64_t qs[4] = {1, 1, 8, 64}, ks[4] = {1, 1, 128, 64};
    test_tensor q, k, v, o;
    tt_make(&q, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&k, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make(&v, &r, ATTN_DTYPE_F32, 4, ks, LAYOUT_CONTIGUOUS, 1, 0);
    tt_make_output(&o, &r, ATTN_DTYPE_F32, 4, qs, LAYOUT_CONTIGUOUS);
    size_t bytes[2];
    const int counts[2] = {1, attn_max_threads()};
    for (int i = 0; i < 2; i++) {
        tracking c = {0, 0, 0};
        attn_allocator a = {track_alloc, track_release, &c};
        attn_set_allocator(&a);
        attn_set_num_threads(counts[i]);
        CHECK_OK(attn_sdpa(&q.t, &k.t, &v.t, NULL, &o.t, NULL, NULL));
        bytes[i] = c.bytes;
        attn_set_allocator(NULL);
    }
    attn_set_num_threads(0);
    CHECK(bytes[1] == bytes[0], "a one-thread call took %zu bytes on %d threads, %zu on 1",
          bytes[1], counts[1], bytes[0]);
    tt_free(&q), tt_free(&k), tt_free(&v), tt_free(&o);
}

static void threads_setting(void) {
    attn_set_num_threads(3);
    CHECK(attn_get_num_threads() == 3, "set 3 threads");
    attn_set_num_threads(0);
    CHECK(attn_get_num_threads() >= 1, "default thread count");
    attn_set_num_threads(-5);
    CHECK(attn_get_num_threads() >= 1, "negative restores the default");
    /* Issue 9: 4096, 100000 and INT_MAX threads killed the process (libgomp
     * could not start them) or failed as a 100 GB allocation. */
    const int max = attn_max_threads();
    CHECK(max >= 1 && max <= 1024, "attn_max_threads() = %d", max);
    const int huge[] = {4096, 100000, 2147483647};
    for (int i = 0; i < 3; i++) {
        attn_set_num_threads(huge[i]);
        CHECK(attn_get_num_threads() == max, "%d threads: get gives %d, want the bound %d",
              huge[i], attn_get_num_threads(), max);
        double x[8] = {1, 2, 3, 4, 5, 6, 7, 8}, o[8];
        int64_t s[3] = {2, 2, 2};
        attn_tensor t, out;
        attn_tensor_init(&t, x, ATTN_DTYPE_F64, 3, s);
        attn_tensor_init(&out, o, ATTN_DTYPE_F64, 3, s);
        CHECK_OK(attn_sdpa(&t, &t, &t, NULL, &out, NULL, NULL));
    }
    attn_set_num_threads(0);
}

static void views(void) {
    double d[24];
    int64_t s[3] = {2, 3, 4};
    attn_tensor t;
    CHECK_OK(attn_tensor_init(&t, d, ATTN_DTYPE_F64, 3, s));
    CHECK(t.strides[0] == 12 && t.strides[1] == 4 && t.strides[2] == 1, "C strides");
    CHECK(attn_tensor_numel(&t) == 24, "numel");
    CHECK_OK(attn_tensor_permute(&t, (int[]){2, 0, 1}));
    CHECK(t.shape[0] == 4 && t.shape[1] == 2 && t.shape[2] == 3, "permuted shape");
    CHECK(t.strides[0] == 1 && t.strides[1] == 12 && t.strides[2] == 4, "permuted strides");
    CHECK_OK(attn_tensor_transpose(&t, -1, 0));
    CHECK(t.shape[0] == 3 && t.shape[2] == 4 && t.strides[2] == 1, "transposed");
    CHECK(attn_tensor_numel(NULL) == -1, "numel(NULL)");
}

/* float64 values written into float16 / bfloat16 (a KV cache's new rows)
 * are rounded once, to nearest even: every value of each format round
 * trips, and a point just off a midpoint goes to the nearer neighbour, not
 * through float32's rounding to the midpoint and then to even. */
static void rounding_to_16_bits(void) {
    uint16_t h;
    long bad = 0;
    for (uint32_t x = 0; x < 0x7bff; x++) { /* up to the largest finite pair */
        const double a = attn__f16_to_float((uint16_t)x), b = attn__f16_to_float((uint16_t)(x + 1));
        const double mid = (a + b) / 2, off = (b - a) * 0x1p-30;
        attn__store(&h, ATTN_DTYPE_F16, 0, a);
        bad += h != x;
        attn__store(&h, ATTN_DTYPE_F16, 0, mid - off);
        bad += h != x;
        attn__store(&h, ATTN_DTYPE_F16, 0, -(mid + off));
        bad += h != ((x + 1) | 0x8000u);
        attn__store(&h, ATTN_DTYPE_F16, 0, mid);
        bad += h != (x & 1 ? x + 1 : x);
    }
    for (uint32_t x = 0; x < 0x7f7f; x++) {
        const double a = attn__bf16_to_float((uint16_t)x), b = attn__bf16_to_float((uint16_t)(x + 1));
        const double mid = (a + b) / 2, off = (b - a) * 0x1p-30;
        attn__store(&h, ATTN_DTYPE_BF16, 0, a);
        bad += h != x;
        attn__store(&h, ATTN_DTYPE_BF16, 0, mid + off);
        bad += h != x + 1;
        attn__store(&h, ATTN_DTYPE_BF16, 0, mid);
        bad += h != (x & 1 ? x + 1 : x);
    }
    attn__store(&h, ATTN_DTYPE_F16, 0, -2.7099609374975353);
    CHECK(attn__f16_to_float(h) == -2.708984375f, "%.9g", (double)attn__f16_to_float(h));
    attn__store(&h, ATTN_DTYPE_F16, 0, 1e6);
    CHECK(h == 0x7c00, "1e6 -> %x, expected +inf", h);
    attn__store(&h, ATTN_DTYPE_BF16, 0, NAN);
    CHECK(attn__bf16_to_float(h) != attn__bf16_to_float(h), "NaN stays NaN");
    CHECK(bad == 0, "%ld values rounded wrongly", bad);
}

/* attn_tensor_convert: each value rounded once (2.7099609374975 in float64
 * is -2.708984375... in float16 only without a float32 step in between),
 * ties to even, overflow to infinity, any strides, and the refusals. */
static void tensor_convert(void) {
    /* per dtype: ties at its last bit (to even: down, then up), overflow,
     * -0, and a value below its range (float16) or exact (bfloat16) */
    const double vals[2][6] = {{2.7099609374975, 1.0 + 0x1p-11, 1.0 + 3 * 0x1p-11, 70000.0,
                                -0.0, 0x1p-30},
                               {2.7099609374975, 1.0 + 0x1p-8, 1.0 + 3 * 0x1p-8, 0x1p128,
                                -0.0, 0x1p-30}};
    const uint16_t wants[2][6] = {{0x416b, 0x3c00, 0x3c02, 0x7c00, 0x8000, 0x0000},
                                  {0x402d, 0x3f80, 0x3f82, 0x7f80, 0x8000, 0x3080}};
    double src[6];
    uint16_t dst[12];
    int64_t shape[1] = {6};
    attn_tensor ts, td;
    attn_tensor_init(&ts, src, ATTN_DTYPE_F64, 1, shape);
    for (int half = 0; half < 2; half++) {
        const attn_dtype dt = half ? ATTN_DTYPE_BF16 : ATTN_DTYPE_F16;
        const uint16_t *want = wants[half];
        memcpy(src, vals[half], sizeof src);
        attn_tensor_init(&td, dst + 11, dt, 1, shape);
        td.strides[0] = -2; /* every other element, backwards */
        CHECK_OK(attn_tensor_convert(&ts, &td));
        for (int i = 0; i < 6; i++)
            CHECK(dst[11 - 2 * i] == want[i], "%s[%d] = 0x%04x; expected 0x%04x",
                  attn_dtype_name(dt), i, dst[11 - 2 * i], want[i]);
        /* and back to float32: exact */
        float back[6];
        attn_tensor tb;
        attn_tensor_init(&tb, back, ATTN_DTYPE_F32, 1, shape);
        CHECK_OK(attn_tensor_convert(&td, &tb));
        for (int i = 0; i < 6; i++)
            CHECK(back[i] == (half ? attn__bf16_to_float(want[i]) : attn__f16_to_float(want[i])),
                  "%s -> float32 [%d] not exact", attn_dtype_name(dt), i);
    }
    unsigned char b[6] = {0, 1, 2, 0, 0, 1}, b2[6];
    attn_tensor tbool, tbool2;
    attn_tensor_init(&tbool, b, ATTN_DTYPE_BOOL, 1, shape);
    attn_tensor_init(&tbool2, b2, ATTN_DTYPE_BOOL, 1, shape);
    CHECK_OK(attn_tensor_convert(&tbool, &tbool2));
    CHECK(b2[1] == 1 && b2[2] == 1 && b2[3] == 0, "bool copied as 0/1");
    CHECK_STATUS(attn_tensor_convert(&tbool, &ts), ATTN_ERR_DTYPE);
    CHECK_STATUS(attn_tensor_convert(&ts, &tbool), ATTN_ERR_DTYPE);
    int64_t other[1] = {5};
    attn_tensor_init(&td, dst, ATTN_DTYPE_F16, 1, other);
    CHECK_STATUS(attn_tensor_convert(&ts, &td), ATTN_ERR_SHAPE);
    attn_tensor_init(&td, src, ATTN_DTYPE_F32, 1, shape); /* inside src */
    CHECK_STATUS(attn_tensor_convert(&ts, &td), ATTN_ERR_OVERLAP);
    attn_tensor_init(&td, dst, ATTN_DTYPE_F16, 1, shape);
    td.strides[0] = 0; /* six elements onto one */
    CHECK_STATUS(attn_tensor_convert(&ts, &td), ATTN_ERR_INVALID);
    CHECK_STATUS(attn_tensor_convert(NULL, &td), ATTN_ERR_NULL);
}

/* attn__views_overlap against the bytes each view's elements cover, on
 * random views of one 512-byte buffer: interleaved views (a paged buffer's
 * K and V halves, even and odd elements), negative, zero and nested
 * strides, every dtype size. The byte spans alone said "overlap" for
 * interleaved views that share no element. */
static void views_overlap_exactly(void) {
    rng r = {harness_seed() ^ 0x0e1a};
    static unsigned char buf[512];
    const attn_dtype dts[4] = {ATTN_DTYPE_BOOL, ATTN_DTYPE_BF16, ATTN_DTYPE_F32, ATTN_DTYPE_F64};
    int disjoint_in_span = 0;
    for (int c = 0; c < 20000; c++) {
        attn_tensor v[2];
        bool bytes[2][512] = {{false}};
        bool ok = true;
        for (int x = 0; x < 2 && ok; x++) {
            const attn_dtype dt = dts[rng_int(&r, 0, 3)];
            const int64_t es = (int64_t)attn_dtype_size(dt), cap = 512 / es;
            v[x].dtype = dt;
            v[x].rank = (int)rng_int(&r, 1, 3);
            int64_t lo = 0, hi = 0;
            for (int d = 0; d < v[x].rank; d++) {
                v[x].shape[d] = rng_int(&r, 1, 5);
                v[x].strides[d] = rng_int(&r, -12, 12);
                const int64_t reach = v[x].strides[d] * (v[x].shape[d] - 1);
                if (reach < 0) lo += reach;
                else hi += reach;
            }
            const int64_t base = rng_int(&r, -lo, cap - 1 - hi < -lo ? -lo : cap - 1 - hi);
            ok = base + lo >= 0 && base + hi < cap;
            v[x].data = buf + base * es;
            int64_t idx[ATTN_MAX_RANK] = {0};
            for (bool more = ok; more;) {
                int64_t off = base;
                for (int d = 0; d < v[x].rank; d++) off += idx[d] * v[x].strides[d];
                for (int64_t byte = 0; byte < es; byte++) bytes[x][off * es + byte] = true;
                more = false;
                for (int d = v[x].rank - 1; d >= 0 && !more; d--) {
                    if (++idx[d] < v[x].shape[d]) more = true;
                    else idx[d] = 0;
                }
            }
        }
        if (!ok) continue;
        bool shared = false;
        for (int i = 0; i < 512; i++) shared |= bytes[0][i] && bytes[1][i];
        const bool said = attn__views_overlap(&v[0], &v[1]);
        CHECK(said == shared, "case %d: said %d, the bytes say %d", c, said, shared);
        uintptr_t lo0 = 512, hi0 = 0, lo1 = 512, hi1 = 0;
        for (uintptr_t i = 0; i < 512; i++) {
            if (bytes[0][i]) lo0 = i < lo0 ? i : lo0, hi0 = i;
            if (bytes[1][i]) lo1 = i < lo1 ? i : lo1, hi1 = i;
        }
        disjoint_in_span += !shared && lo0 <= hi1 && lo1 <= hi0;
    }
    CHECK(disjoint_in_span > 1000, "only %d disjoint views with intersecting spans", disjoint_in_span);
    /* a FlashInfer-style paged KV buffer (pages, 2, page, H, E): K and V */
    static float kv[4 * 2 * 4 * 2 * 8];
    attn_tensor whole, k, vv;
    CHECK_OK(attn_tensor_init(&whole, kv, ATTN_DTYPE_F32, 5, (int64_t[]){4, 2, 4, 2, 8}));
    k = vv = whole;
    k.rank = vv.rank = 4;
    const int64_t shape[4] = {4, 4, 2, 8}, strides[4] = {128, 16, 8, 1};
    memcpy(k.shape, shape, sizeof shape), memcpy(vv.shape, shape, sizeof shape);
    memcpy(k.strides, strides, sizeof strides), memcpy(vv.strides, strides, sizeof strides);
    vv.data = kv + 64;
    CHECK(!attn__views_overlap(&k, &vv), "the K and V halves of a paged buffer overlap");
    CHECK(attn__views_overlap(&k, &whole), "K and the whole buffer do not overlap");
}

HARNESS_MAIN(T(philox_known_answers), T(cpu_feature_decoding), T(isa_switch), T(allocator_hook),
             T(workspace_kept), T(serial_call_scratch), T(threads_setting), T(views),
             T(rounding_to_16_bits), T(tensor_convert), T(views_overlap_exactly))
