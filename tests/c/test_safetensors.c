/*
 * test_safetensors.c — the safetensors reader and writer: files the
 * reference implementation wrote (tests/data/safetensors, made by
 * tests/data/make_safetensors_fixtures.py), the 16-bit conversions against
 * an independent formula for every bit pattern, round trips of every dtype
 * and rank 0..8 from strided sources, empty tensors, metadata, many
 * tensors, and hostile files: every truncation, malformed JSON, lengths,
 * offsets and shapes out of range, duplicate names, invalid UTF-8.
 */
#define _GNU_SOURCE /* mkdtemp, RLIMIT_FSIZE */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "io/io.h" /* attn__safetensors_open_read: the path without mmap */
#include "testutil.h"

#ifndef ATTN_TEST_DATA
#error "ATTN_TEST_DATA must name tests/data"
#endif

#define CHECK_MESSAGE(needle)                                                             \
    CHECK(strstr(attn_last_error(), needle) != NULL, "message '%s' lacks '%s'", \
          attn_last_error(), needle)

static const char *fixture(const char *name) {
    static char path[512];
    snprintf(path, sizeof path, "%s/safetensors/%s", ATTN_TEST_DATA, name);
    return path;
}

/* ---- test-side tensors of any dtype, rank 0 and empty included ---- */

/* A strided view over its own block: dims permuted in memory, some
 * reversed, gaps (rank >= 1; rank 0 is one element). Elements get
 * pseudo-random bits (bool: 0/1). */
typedef struct any_tensor {
    attn_tensor t;
    unsigned char *block;
} any_tensor;

static void any_make(any_tensor *x, rng *r, attn_dtype dt, int rank, const int64_t *shape,
                     bool strided) {
    memset(x, 0, sizeof *x);
    attn_tensor *t = &x->t;
    t->dtype = dt;
    t->rank = rank;
    const size_t es = attn_dtype_size(dt);
    int order[ATTN_MAX_RANK];
    for (int d = 0; d < rank; d++) order[d] = d;
    for (int d = rank - 1; strided && d > 0; d--) {
        int j = (int)rng_int(r, 0, d), tmp = order[d];
        order[d] = order[j];
        order[j] = tmp;
    }
    int64_t span = 1, base = 0;
    for (int i = rank - 1; i >= 0; i--) {
        const int d = order[i];
        t->shape[d] = shape[d];
        t->strides[d] = span * (strided && rng_int(r, 0, 2) == 0 ? 2 : 1);
        span = t->strides[d] * (shape[d] > 0 ? shape[d] : 1);
    }
    for (int d = 0; strided && d < rank; d++)
        if (rng_int(r, 0, 3) == 0 && shape[d] > 1) {
            base += t->strides[d] * (shape[d] - 1);
            t->strides[d] = -t->strides[d];
        }
    x->block = malloc((size_t)span * es);
    for (size_t i = 0; i < (size_t)span * es; i++) x->block[i] = (unsigned char)rng_next(r);
    if (dt == ATTN_DTYPE_BOOL)
        for (int64_t i = 0; i < span; i++) x->block[i] &= 1;
    t->data = x->block + base * (int64_t)es;
}

static int64_t shape_numel(int rank, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    return n;
}

/* The elements in C order, packed (caller frees). */
static unsigned char *packed(const attn_tensor *t) {
    const size_t es = attn_dtype_size(t->dtype);
    const int64_t n = shape_numel(t->rank, t->shape);
    unsigned char *out = malloc(n > 0 ? (size_t)n * es : 1);
    int64_t idx[ATTN_MAX_RANK] = {0};
    for (int64_t i = 0; i < n; i++) {
        int64_t off = 0;
        for (int d = 0; d < t->rank; d++) off += idx[d] * t->strides[d];
        memcpy(out + i * (int64_t)es, (const unsigned char *)t->data + off * (int64_t)es, es);
        for (int d = t->rank - 1; d >= 0; d--) {
            if (++idx[d] < t->shape[d]) break;
            idx[d] = 0;
        }
    }
    return out;
}

static bool same_shape(const attn_tensor *a, int rank, const int64_t *shape) {
    if (a->rank != rank) return false;
    for (int d = 0; d < rank; d++)
        if (a->shape[d] != shape[d]) return false;
    return true;
}

static unsigned char *read_file(const char *path, size_t *size) {
    unsigned char *b = tt_read_file(path, size);
    CHECK(b != NULL, "cannot read %s", path);
    return b;
}

/* ---- the 16-bit conversions, every bit pattern ---- */

/* binary16 by its definition: (-1)^s * 2^(e-15) * (1 + m/1024), or
 * 2^-14 * m/1024 for e = 0. */
static float f16_by_definition(uint16_t h) {
    const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -24);
    else v = ldexp(1.0 + m / 1024.0, e - 15);
    return (float)(s ? -v : v);
}

static float bf16_by_definition(uint16_t h) {
    const int s = h >> 15, e = (h >> 7) & 255, m = h & 127;
    double v;
    if (e == 255) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, -133);
    else v = ldexp(1.0 + m / 128.0, e - 127);
    return (float)(s ? -v : v);
}

/* A file of one 1-D tensor of the given dtype and bytes, read to float32. */
static void every_half(attn_dtype dt, float (*definition)(uint16_t)) {
    uint16_t *bits = malloc(65536 * sizeof *bits);
    for (int i = 0; i < 65536; i++) bits[i] = (uint16_t)i;
    int64_t n = 65536;
    attn_tensor t;
    attn_tensor_init(&t, bits, dt, 1, &n);
    const char *name = "all";
    char path[] = "/tmp/attn_st_half_XXXXXX";
    int fd = mkstemp(path);
    CHECK_OK(attn_safetensors_write_fd(fd, 1, &name, &t, NULL));
    close(fd);
    attn_safetensors *f = NULL;
    CHECK_OK(attn_safetensors_open(path, &f));
    attn_tensor as32, as64, same;
    CHECK_OK(attn_safetensors_read(f, "all", ATTN_DTYPE_F32, &as32));
    CHECK_OK(attn_safetensors_read(f, "all", ATTN_DTYPE_F64, &as64));
    CHECK_OK(attn_safetensors_read(f, "all", 0, &same));
    long bad = 0, nan_bits = 0;
    for (int i = 0; as32.data && as64.data && i < 65536; i++) {
        const float want = definition((uint16_t)i), got = ((const float *)as32.data)[i];
        const double got64 = ((const double *)as64.data)[i];
        if (isnan(want)) {
            bad += !isnan(got) || !isnan(got64);
            /* the payload survives: the float's top 16 bits (bf16) or
             * mantissa bits (f16) are the pattern's */
            uint32_t u;
            memcpy(&u, &got, 4);
            nan_bits += dt == ATTN_DTYPE_BF16 ? (u >> 16) != (uint32_t)i
                                               : ((u >> 13) & 1023) != (uint32_t)(i & 1023);
        } else {
            bad += memcmp(&want, &got, 4) != 0 || got64 != (double)want ||
                   !signbit(got64) != !signbit(want);
        }
    }
    CHECK(bad == 0, "%s: %ld of 65536 patterns convert wrongly", attn_dtype_name(dt), bad);
    CHECK(nan_bits == 0, "%s: %ld NaN payloads lost", attn_dtype_name(dt), nan_bits);
    CHECK(same.dtype == dt && same.data && memcmp(same.data, bits, 65536 * 2) == 0,
          "%s: the copy in its own dtype differs", attn_dtype_name(dt));
    attn_safetensors_free(&as32);
    attn_safetensors_free(&as64);
    attn_safetensors_free(&same);
    CHECK(as32.data == NULL, "free leaves the pointer");
    attn_safetensors_close(f);
    remove(path);
    free(bits);
}

static void half_conversions(void) {
    every_half(ATTN_DTYPE_F16, f16_by_definition);
    every_half(ATTN_DTYPE_BF16, bf16_by_definition);
}

/* ---- files the reference wrote ---- */

/* Tensor `name` read as float64 must be i/8 - 1 in C order. */
static void check_ramp(attn_safetensors *f, const char *name, int rank, const int64_t *shape) {
    attn_tensor t;
    CHECK_OK(attn_safetensors_read(f, name, ATTN_DTYPE_F64, &t));
    CHECK(same_shape(&t, rank, shape), "%s: wrong shape", name);
    long bad = 0;
    for (int64_t i = 0; t.data && i < shape_numel(rank, shape); i++)
        bad += ((const double *)t.data)[i] != (double)i / 8 - 1;
    CHECK(bad == 0, "%s: %ld values differ", name, bad);
    attn_safetensors_free(&t);
}

/* Two tensors that must hold the same float32 bits (NaN: both NaN). */
static void check_same_f32(attn_safetensors *f, const char *a, const char *b) {
    attn_tensor x, y;
    CHECK_OK(attn_safetensors_read(f, a, ATTN_DTYPE_F32, &x));
    CHECK_OK(attn_safetensors_read(f, b, ATTN_DTYPE_F32, &y));
    int64_t n = attn_tensor_numel(&x);
    CHECK(n > 0 && n == attn_tensor_numel(&y), "%s, %s: sizes", a, b);
    for (int64_t i = 0; n > 0 && i < n; i++) {
        const float u = ((float *)x.data)[i], v = ((float *)y.data)[i];
        CHECK(isnan(u) ? isnan(v) : memcmp(&u, &v, 4) == 0, "%s[%lld] = %a, the reference: %a",
              a, (long long)i, u, v);
    }
    attn_safetensors_free(&x);
    attn_safetensors_free(&y);
}

static void numpy_fixture(attn_safetensors *f) {
    CHECK(attn_safetensors_count(f) == 12, "count %lld", (long long)attn_safetensors_count(f));
    const int64_t s234[3] = {2, 3, 4}, s35[2] = {3, 5}, s23[2] = {2, 3}, s2[1] = {2},
                  r8[8] = {1, 2, 1, 2, 1, 2, 1, 2};
    check_ramp(f, "f32", 3, s234);
    check_ramp(f, "f64", 2, s35);
    check_ramp(f, "f16", 2, s23);
    check_ramp(f, "rank8", 8, r8);
    check_ramp(f, "\xc3\xbcn\xc3\xaf/\xe5\x90\x8d\xe5\x89\x8d \"q\"\\", 1, s2);
    check_same_f32(f, "f16_special", "f16_special_as_f32");
    attn_tensor t;
    CHECK_OK(attn_safetensors_read(f, "bool", 0, &t));
    CHECK(t.dtype == ATTN_DTYPE_BOOL && t.rank == 2 && t.shape[0] == 4 && t.shape[1] == 5,
          "bool: dtype/shape");
    for (int i = 0; t.data && i < 20; i++)
        CHECK(((unsigned char *)t.data)[i] == (i % 3 == 0), "bool[%d]", i);
    attn_safetensors_free(&t);
    CHECK_OK(attn_safetensors_read(f, "scalar", 0, &t));
    CHECK(t.rank == 0 && t.dtype == ATTN_DTYPE_F64 && *(double *)t.data == -1.0, "scalar");
    attn_safetensors_free(&t);
    CHECK_OK(attn_safetensors_read(f, "empty", ATTN_DTYPE_F64, &t));
    CHECK(t.rank == 2 && t.shape[0] == 0 && t.shape[1] == 3 && t.data != NULL, "empty");
    attn_safetensors_free(&t);
    /* What attn cannot convert: listed, refused by read, given as bytes. */
    const char *fdt;
    attn_dtype dt = ATTN_DTYPE_F32;
    int rank = -1;
    int64_t shape[ATTN_MAX_RANK];
    const int64_t i64 = attn_safetensors_find(f, "i64");
    CHECK(i64 >= 0, "find i64");
    CHECK_OK(attn_safetensors_info(f, i64, NULL, &fdt, &dt, &rank, shape));
    CHECK(strcmp(fdt, "I64") == 0 && dt == 0 && rank == 1 && shape[0] == 3, "i64 info");
    CHECK_STATUS(attn_safetensors_read(f, "i64", ATTN_DTYPE_F64, &t), ATTN_ERR_DTYPE);
    CHECK_MESSAGE("I64");
    CHECK_STATUS(attn_safetensors_get(f, "u8", &t), ATTN_ERR_DTYPE);
    const void *bytes;
    uint64_t size;
    CHECK_OK(attn_safetensors_raw(f, "i64", &bytes, &size));
    const unsigned char want[8] = {0xfe, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}; /* -2 */
    CHECK(size == 24 && memcmp((const char *)bytes + 8, want, 8) == 0, "i64 bytes");
    CHECK(strcmp(attn_safetensors_metadata(f, "note"), "\xc3\xa9 \xc3\xbcn\xc3\xaf" "code") == 0,
          "metadata note");
    CHECK(attn_safetensors_metadata(f, "absent") == NULL, "absent metadata key");
    CHECK(attn_safetensors_metadata_count(f) == 2, "metadata count");
    /* Zero-copy views: the reference aligns every tensor too. */
    CHECK_OK(attn_safetensors_get(f, "f64", &t));
    CHECK(t.dtype == ATTN_DTYPE_F64 && ((double *)t.data)[14] == 14.0 / 8 - 1, "f64 view");
    CHECK_OK(attn_safetensors_get(f, "f16", &t));
    CHECK(t.dtype == ATTN_DTYPE_F16 && ((uint16_t *)t.data)[1] == 0xbb00, "f16 view (-0.875)");
}

static void reference_files(void) {
    for (int mapped = 0; mapped <= 1; mapped++) {
        attn_safetensors *f = NULL;
        const char *path = fixture("numpy.safetensors");
        CHECK_OK(mapped ? attn_safetensors_open(path, &f) : attn__safetensors_open_read(path, &f));
        if (f != NULL) numpy_fixture(f);
        attn_safetensors_close(f);
        path = fixture("torch_bf16.safetensors");
        CHECK_OK(mapped ? attn_safetensors_open(path, &f) : attn__safetensors_open_read(path, &f));
        if (f == NULL) continue;
        const int64_t s23[2] = {2, 3}, s22[2] = {2, 2};
        check_ramp(f, "bf16", 2, s23);
        check_ramp(f, "f32", 2, s22);
        check_same_f32(f, "bf16_special", "bf16_special_as_f32");
        CHECK(strcmp(attn_safetensors_metadata(f, "format"), "pt") == 0, "format pt");
        attn_safetensors_close(f);
    }
    /* The same bytes through attn_safetensors_parse (borrowed). */
    size_t size;
    unsigned char *b = read_file(fixture("numpy.safetensors"), &size);
    attn_safetensors *f = NULL;
    CHECK_OK(attn_safetensors_parse(b, size, &f));
    if (f != NULL) numpy_fixture(f);
    attn_safetensors_close(f);
    free(b);
    attn_safetensors_close(NULL);
}

/* ---- round trips ---- */

static const attn_dtype ALL[5] = {ATTN_DTYPE_F32, ATTN_DTYPE_F64, ATTN_DTYPE_BOOL,
                                  ATTN_DTYPE_F16, ATTN_DTYPE_BF16};

/* Saves the tensors, reads each back three ways (read, get, read_into a
 * transposed destination) and compares the packed bytes. */
static void round_trip(const char *path, int n, any_tensor *x, const char *const *names,
                       const char *const *meta) {
    attn_tensor *ts = malloc(sizeof *ts * (size_t)(n > 0 ? n : 1));
    for (int i = 0; i < n; i++) ts[i] = x[i].t;
    CHECK_OK(attn_safetensors_save(path, (size_t)n, names, ts, meta));
    attn_safetensors *f = NULL;
    CHECK_OK(attn_safetensors_open(path, &f));
    CHECK(attn_safetensors_count(f) == n, "count %lld, saved %d",
          (long long)attn_safetensors_count(f), n);
    for (int i = 0; f != NULL && i < n; i++) {
        const attn_tensor *src = &x[i].t;
        const int64_t numel = shape_numel(src->rank, src->shape);
        const size_t bytes = (size_t)numel * attn_dtype_size(src->dtype);
        unsigned char *want = packed(src);
        attn_tensor back, view;
        CHECK_OK(attn_safetensors_read(f, names[i], 0, &back));
        CHECK(back.dtype == src->dtype && same_shape(&back, src->rank, src->shape),
              "%s: dtype or shape changed", names[i]);
        CHECK(back.data && memcmp(back.data, want, bytes) == 0, "%s: read differs", names[i]);
        CHECK_OK(attn_safetensors_get(f, names[i], &view));
        CHECK(view.data && memcmp(view.data, want, bytes) == 0, "%s: view differs", names[i]);
        if (src->rank >= 2 && numel > 0) { /* into a Fortran-order destination */
            attn_tensor t = back;
            unsigned char *block = malloc(bytes);
            t.data = block;
            int64_t step = 1;
            for (int d = 0; d < t.rank; d++) {
                t.strides[d] = step;
                step *= t.shape[d];
            }
            CHECK_OK(attn_safetensors_read_into(f, names[i], &t));
            unsigned char *got = packed(&t);
            CHECK(memcmp(got, want, bytes) == 0, "%s: read_into a transposed view differs",
                  names[i]);
            free(got);
            free(block);
        }
        attn_safetensors_free(&back);
        free(want);
    }
    for (int j = 0; f != NULL && meta != NULL && meta[2 * j] != NULL; j++) {
        const char *v = attn_safetensors_metadata(f, meta[2 * j]);
        CHECK(v != NULL && strcmp(v, meta[2 * j + 1]) == 0, "metadata '%s'", meta[2 * j]);
    }
    attn_safetensors_close(f);
    free(ts);
}

static void round_trips(void) {
    rng r = {harness_seed() ^ 0x5afe};
    char path[] = "/tmp/attn_st_rt_XXXXXX";
    close(mkstemp(path));
    /* Every dtype at every rank 0..8, strided and reversed, with empties. */
    enum { N = 5 * 9 * 2 };
    any_tensor x[N];
    char names[N][32];
    const char *name_ptr[N];
    int n = 0;
    for (int di = 0; di < 5; di++)
        for (int rank = 0; rank <= ATTN_MAX_RANK; rank++)
            for (int empty = 0; empty <= (rank > 0); empty++) {
                int64_t shape[ATTN_MAX_RANK];
                for (int d = 0; d < rank; d++) shape[d] = rng_int(&r, 1, rank > 5 ? 2 : 4);
                if (empty) shape[rng_int(&r, 0, rank - 1)] = 0;
                any_make(&x[n], &r, ALL[di], rank, shape, true);
                snprintf(names[n], sizeof names[n], "%s.r%d%s", attn_dtype_name(ALL[di]), rank,
                         empty ? ".empty" : "");
                name_ptr[n] = names[n];
                n++;
            }
    const char *meta[] = {"format", "pt", "quote\"back\\slash", "line\nfeed\ttab\x01", NULL};
    round_trip(path, n, x, name_ptr, meta);
    /* Names the JSON must escape, and code points of every UTF-8 length. */
    const char *odd[4] = {"", "a\"b\\c\n\x1f", "\xf0\x9f\x98\x80 \xe2\x82\xac \xc3\xa9", "x"};
    round_trip(path, 4, x, odd, NULL);
    /* No tensors at all: "{}" padded. */
    round_trip(path, 0, x, NULL, NULL);
    size_t size;
    unsigned char *b = read_file(path, &size);
    CHECK(b && size == 16 && memcmp(b + 8, "{}      ", 8) == 0, "empty file: %zu bytes", size);
    free(b);
    for (int i = 0; i < n; i++) free(x[i].block);
    remove(path);
}

/* Thousands of tensors: lookup by name stays right (and fast). */
static void many_tensors(void) {
    enum { N = 3000 };
    static char names[N][16];
    static const char *name_ptr[N];
    static attn_tensor ts[N];
    static float values[N];
    for (int i = 0; i < N; i++) {
        snprintf(names[i], sizeof names[i], "t%05d", (i * 7919) % N);
        name_ptr[i] = names[i];
        values[i] = (float)i;
        attn_tensor_init(&ts[i], &values[i], ATTN_DTYPE_F32, 1, &(int64_t){1});
    }
    char path[] = "/tmp/attn_st_many_XXXXXX";
    close(mkstemp(path));
    CHECK_OK(attn_safetensors_save(path, N, name_ptr, ts, NULL));
    attn_safetensors *f = NULL;
    CHECK_OK(attn_safetensors_open(path, &f));
    long bad = 0;
    for (int i = 0; f != NULL && i < N; i++) {
        attn_tensor v;
        const int64_t at = attn_safetensors_find(f, names[i]);
        const char *name = NULL;
        attn_safetensors_info(f, at, &name, NULL, NULL, NULL, NULL);
        bad += at < 0 || attn_safetensors_get(f, names[i], &v) != ATTN_OK ||
               *(float *)v.data != (float)i || strcmp(name, names[i]) != 0;
    }
    CHECK(bad == 0, "%ld of %d tensors not found or wrong", bad, N);
    CHECK(attn_safetensors_find(f, "t3000") == -1 && attn_safetensors_find(f, NULL) == -1,
          "find of an absent name");
    attn_safetensors_close(f);
    remove(path);
}

/* ---- conversions and destinations ---- */

static void conversions(void) {
    double d[4] = {1.0 / 3, -0.0, 1e300, 2.5};
    int64_t s4[1] = {4}, s22[2] = {2, 2};
    attn_tensor t;
    attn_tensor_init(&t, d, ATTN_DTYPE_F64, 1, s4);
    const char *name = "d";
    char path[] = "/tmp/attn_st_conv_XXXXXX";
    close(mkstemp(path));
    CHECK_OK(attn_safetensors_save(path, 1, &name, &t, NULL));
    attn_safetensors *f = NULL;
    CHECK_OK(attn_safetensors_open(path, &f));
    attn_tensor out;
    CHECK_OK(attn_safetensors_read(f, "d", ATTN_DTYPE_F32, &out));
    const float *o = out.data;
    CHECK(o && o[0] == (float)(1.0 / 3) && signbit(o[1]) && isinf(o[2]) && o[3] == 2.5f,
          "float64 -> float32 rounds to nearest (%a %a %a %a)", o ? o[0] : 0, o ? o[1] : 0,
          o ? o[2] : 0, o ? o[3] : 0);
    attn_safetensors_free(&out);
    CHECK_STATUS(attn_safetensors_read(f, "d", ATTN_DTYPE_BOOL, &out), ATTN_ERR_DTYPE);
    CHECK(strcmp(attn_last_error_arg(), "to") == 0, "arg %s", attn_last_error_arg());
    CHECK(out.data == NULL, "a failed read leaves data");
    CHECK_STATUS(attn_safetensors_read(f, "d", ATTN_DTYPE_F16, &out), ATTN_ERR_DTYPE);
    CHECK_MESSAGE("is F64; it converts to float32 or float64, not to float16"); /* each once */
    CHECK_STATUS(attn_safetensors_read(f, "d", (attn_dtype)42, &out), ATTN_ERR_DTYPE);
    CHECK_STATUS(attn_safetensors_read(f, "nope", 0, &out), ATTN_ERR_INVALID);
    CHECK_MESSAGE("nope");
    CHECK_STATUS(attn_safetensors_read(f, NULL, 0, &out), ATTN_ERR_NULL);
    CHECK_STATUS(attn_safetensors_read(NULL, "d", 0, &out), ATTN_ERR_NULL);
    CHECK_STATUS(attn_safetensors_read(f, "d", 0, NULL), ATTN_ERR_NULL);
    /* read_into: shape, overlap, dtype, strides. */
    double back[4];
    attn_tensor dst;
    attn_tensor_init(&dst, back, ATTN_DTYPE_F64, 2, s22);
    CHECK_STATUS(attn_safetensors_read_into(f, "d", &dst), ATTN_ERR_SHAPE);
    CHECK_MESSAGE("(2, 2)");
    attn_tensor_init(&dst, back, ATTN_DTYPE_F64, 1, s4);
    dst.strides[0] = 0;
    CHECK_STATUS(attn_safetensors_read_into(f, "d", &dst), ATTN_ERR_INVALID);
    dst.strides[0] = -1;
    dst.data = back + 3;
    CHECK_OK(attn_safetensors_read_into(f, "d", &dst));
    CHECK(back[3] == 1.0 / 3 && back[0] == 2.5, "reversed destination");
    dst.dtype = ATTN_DTYPE_BOOL;
    CHECK_STATUS(attn_safetensors_read_into(f, "d", &dst), ATTN_ERR_DTYPE);
    CHECK_STATUS(attn_safetensors_read_into(f, "d", NULL), ATTN_ERR_NULL);
    attn_safetensors_close(f);
    remove(path);
}

/* ---- hostile files ---- */

/* A file from a header text and `data` bytes of buffer (zeros). */
static attn_status parse_header_text(const char *json, size_t data) {
    const size_t n = strlen(json), size = 8 + n + data;
    unsigned char *b = calloc(size, 1); /* exact size: ASan sees over-reads */
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)n >> (8 * i));
    memcpy(b + 8, json, n);
    attn_safetensors *f = (attn_safetensors *)b; /* must come back NULL on failure */
    attn_status st = attn_safetensors_parse(b, size, &f);
    CHECK(st == ATTN_OK ? f != NULL : f == NULL, "%s: handle %p with status %d", json,
          (void *)f, (int)st);
    attn_safetensors_close(f);
    free(b);
    return st;
}

/* Nested arrays `depth` deep as an unknown field's value. */
static attn_status nested(int depth) {
    char json[512];
    int n = snprintf(json, sizeof json, "{\"t\":{\"x\":");
    for (int i = 0; i < depth; i++) json[n++] = '[';
    for (int i = 0; i < depth; i++) json[n++] = ']';
    snprintf(json + n, sizeof json - (size_t)n,
             ",\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}");
    return parse_header_text(json, 4);
}

static void malformed_headers(void) {
    struct {
        const char *json;
        size_t data;
        attn_status want;
        const char *needle;
    } cases[] = {
        {"{}", 0, ATTN_OK, ""},
        {" {\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}  \n", 8, ATTN_OK, ""},
        {"{\"a\":{\"shape\":[],\"dtype\":\"F32\",\"data_offsets\":[0,4],\"future\":{\"k\":[1,"
         "-2.5e3,true,null,\"s\"]}}}",
         4, ATTN_OK, ""},
        {"{\"\\u00e9\\ud83d\\ude00\\n\":{\"dtype\":\"BOOL\",\"shape\":[0],\"data_offsets\":[0,0]}}",
         0, ATTN_OK, ""},
        {"", 0, ATTN_ERR_FORMAT, "ends where '{'"},
        {"[]", 0, ATTN_ERR_FORMAT, "expected '{'"},
        {"{", 0, ATTN_ERR_FORMAT, "expected a string"},
        {"{}x", 0, ATTN_ERR_FORMAT, "text after"},
        {"{\"a\" {}}", 0, ATTN_ERR_FORMAT, "expected ':'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},}", 8, ATTN_ERR_FORMAT,
         "expected a string"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}", 8, ATTN_ERR_FORMAT,
         "ends where '}'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, ATTN_ERR_FORMAT, "lacks 'data_offsets'"},
        {"{\"a\":{\"shape\":[2],\"data_offsets\":[0,8]}}", 8, ATTN_ERR_FORMAT, "lacks 'dtype'"},
        {"{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,8]}}", 8, ATTN_ERR_FORMAT, "lacks 'shape'"},
        {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
         ATTN_ERR_FORMAT, "twice"},
        {"{\"a\":{\"dtype\":\"F31\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, ATTN_ERR_FORMAT,
         "unknown dtype 'F31'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8, ATTN_ERR_FORMAT,
         "negative"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2.0],\"data_offsets\":[0,8]}}", 8,
         ATTN_ERR_FORMAT, "not an integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[02],\"data_offsets\":[0,8]}}", 8, ATTN_ERR_FORMAT,
         "leading zero"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[\"2\"],\"data_offsets\":[0,8]}}", 8,
         ATTN_ERR_FORMAT, "not a non-negative integer"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[18446744073709551616],\"data_offsets\":[0,8]}}", 8,
         ATTN_ERR_FORMAT, "64 bits"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[9223372036854775808],\"data_offsets\":[0,8]}}", 8,
         ATTN_ERR_FORMAT, "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}", 8,
         ATTN_ERR_FORMAT, "overflows"},
        /* empty, but its strides would overflow: refused in either order */
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0,1099511627776,1099511627776],\"data_offsets\":[0,0]}}",
         0, ATTN_ERR_FORMAT, "overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,1099511627776,0],\"data_offsets\":[0,0]}}",
         0, ATTN_ERR_FORMAT, "overflows"},
        {"{\"a\":{\"dtype\":\"F64\",\"shape\":[2305843009213693952],\"data_offsets\":[0,8]}}", 8,
         ATTN_ERR_FORMAT, "byte count overflows"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,9]}}", 9, ATTN_ERR_FORMAT,
         "take 8"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}", 8, ATTN_ERR_FORMAT,
         "outside"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[9,9]}}", 8, ATTN_ERR_FORMAT,
         "outside"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8, ATTN_ERR_FORMAT,
         "reversed"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0]}}", 8, ATTN_ERR_FORMAT,
         "between the two"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8,16]}}", 16,
         ATTN_ERR_FORMAT, "after the two"},
        {"{\"a\":{\"dtype\":\"F4\",\"shape\":[3],\"data_offsets\":[0,1]}}", 8, ATTN_ERR_FORMAT,
         "whole number of bytes"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"a\":{\"dtype\":\"F32\","
         "\"shape\":[1],\"data_offsets\":[0,4]}}",
         4, ATTN_ERR_FORMAT, "twice"},
        {"{\"__metadata__\":{},\"__metadata__\":{}}", 0, ATTN_ERR_FORMAT, "twice"},
        {"{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, ATTN_ERR_FORMAT, "key 'k' twice"},
        {"{\"__metadata__\":{\"k\":1}}", 0, ATTN_ERR_FORMAT, "not a string"},
        {"{\"__metadata__\":[]}", 0, ATTN_ERR_FORMAT, "'__metadata__'"},
        {"{\"a\":[]}", 0, ATTN_ERR_FORMAT, "tensor's entry"},
        {"{\"a\\q\":{}}", 0, ATTN_ERR_FORMAT, "unknown escape"},
        {"{\"a\\u12\":{}}", 0, ATTN_ERR_FORMAT, "four hex digits"},
        {"{\"\\ud800\":{}}", 0, ATTN_ERR_FORMAT, "high surrogate"},
        {"{\"\\ud800\\u0041\":{}}", 0, ATTN_ERR_FORMAT, "high surrogate"},
        {"{\"\\udc00\":{}}", 0, ATTN_ERR_FORMAT, "lone low surrogate"},
        {"{\"a\\u0000b\":{}}", 0, ATTN_ERR_FORMAT, "U+0000"},
        {"{\"a\tb\":{}}", 0, ATTN_ERR_FORMAT, "control character"},
        {"{\"\xff\":{}}", 0, ATTN_ERR_FORMAT, "UTF-8"},
        {"{\"\xc0\xaf\":{}}", 0, ATTN_ERR_FORMAT, "UTF-8"},         /* overlong '/' */
        {"{\"\xed\xa0\x80\":{}}", 0, ATTN_ERR_FORMAT, "UTF-8"},     /* a surrogate */
        {"{\"\xf4\x90\x80\x80\":{}}", 0, ATTN_ERR_FORMAT, "UTF-8"}, /* above U+10FFFF */
        {"{\"\xe2\x82\":{}}", 0, ATTN_ERR_FORMAT, "UTF-8"},         /* cut short */
        {"{\"a\":{\"x\":tru}}", 0, ATTN_ERR_FORMAT, "expected a value"},
        {"{\"a\":{\"x\":-}}", 0, ATTN_ERR_FORMAT, "malformed number"},
        {"{\"a\":{\"x\":1.}}", 0, ATTN_ERR_FORMAT, "malformed number"},
        {"{\"a\":{\"x\":[1 2]}}", 0, ATTN_ERR_FORMAT, "to end an array"},
        {"{\"a\":{\"x\":{\"k\" 1}}}", 0, ATTN_ERR_FORMAT, "expected ':'"},
        {"{\"a", 0, ATTN_ERR_FORMAT, "inside a string"},
        {"{\"a\\", 0, ATTN_ERR_FORMAT, "inside an escape"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        attn_status st = parse_header_text(cases[i].json, cases[i].data);
        CHECK(st == cases[i].want, "case %zu %s: status %d (%s), expected %d", i, cases[i].json,
              (int)st, attn_last_error(), (int)cases[i].want);
        CHECK_MESSAGE(cases[i].needle);
    }
    /* Empty tensors whose other dimensions fit, a zero first or last: read
     * as empty, the same either way (a zero first once overflowed the
     * reader's strides, UBSan) */
    const char *empties[2] = {
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[0,1048576,1048576],\"data_offsets\":[0,0]}}",
        "{\"a\":{\"dtype\":\"F32\",\"shape\":[1048576,1048576,0],\"data_offsets\":[0,0]}}"};
    for (int i = 0; i < 2; i++) {
        const size_t len = strlen(empties[i]);
        unsigned char *eb = calloc(8 + len, 1);
        eb[0] = (unsigned char)len;
        memcpy(eb + 8, empties[i], len);
        attn_safetensors *ef = NULL;
        CHECK_OK(attn_safetensors_parse(eb, 8 + len, &ef));
        attn_tensor et;
        CHECK_OK(attn_safetensors_read(ef, "a", 0, &et));
        CHECK(et.rank == 3 && et.shape[0] * et.shape[1] * et.shape[2] == 0 && et.shape[1] == 1048576,
              "empty tensor %d read with rank %d", i, et.rank);
        attn_safetensors_free(&et);
        attn_safetensors_close(ef);
        free(eb);
    }
    CHECK_OK(nested(62));
    CHECK_STATUS(nested(63), ATTN_ERR_FORMAT); /* levels: header 1, entry 2, arrays 3.. */
    CHECK_MESSAGE("deeper than 64");
    /* Rank 9: listed with its true rank, refused as a tensor, raw is fine. */
    const char *r9 = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,2],\"data_offsets\":[0,8]}}";
    const size_t n = strlen(r9);
    unsigned char b[256] = {(unsigned char)n};
    memcpy(b + 8, r9, n);
    attn_safetensors *f = NULL;
    CHECK_OK(attn_safetensors_parse(b, 8 + n + 8, &f));
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    attn_tensor t;
    const void *raw;
    uint64_t size;
    CHECK_OK(attn_safetensors_info(f, 0, NULL, NULL, NULL, &rank, shape));
    CHECK(rank == 9, "rank %d", rank);
    CHECK_STATUS(attn_safetensors_get(f, "a", &t), ATTN_ERR_SHAPE);
    CHECK_STATUS(attn_safetensors_read(f, "a", 0, &t), ATTN_ERR_SHAPE);
    CHECK_OK(attn_safetensors_raw(f, "a", &raw, &size));
    CHECK(size == 8, "raw size");
    CHECK_STATUS(attn_safetensors_info(f, 1, NULL, NULL, NULL, NULL, NULL), ATTN_ERR_INVALID);
    CHECK_STATUS(attn_safetensors_info(f, -1, NULL, NULL, NULL, NULL, NULL), ATTN_ERR_INVALID);
    CHECK_STATUS(attn_safetensors_metadata_at(f, 0, NULL, NULL), ATTN_ERR_INVALID);
    attn_safetensors_close(f);
}

static void hostile_lengths(void) {
    attn_safetensors *f = NULL;
    CHECK_STATUS(attn_safetensors_parse("", 0, &f), ATTN_ERR_FORMAT);
    CHECK_MESSAGE("fewer than the 8");
    CHECK_STATUS(attn_safetensors_parse("\x02\0\0\0\0\0\0", 7, &f), ATTN_ERR_FORMAT);
    /* A header length of 2^64 - 1, of 100 MB + 1, and one past the end. */
    unsigned char b[16] = {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, '{', '}'};
    CHECK_STATUS(attn_safetensors_parse(b, 16, &f), ATTN_ERR_FORMAT);
    CHECK_MESSAGE("limit");
    const uint64_t over = 100000001;
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(over >> (8 * i));
    CHECK_STATUS(attn_safetensors_parse(b, 16, &f), ATTN_ERR_FORMAT);
    CHECK_MESSAGE("100000000");
    memset(b, 0, 8);
    b[0] = 9;
    CHECK_STATUS(attn_safetensors_parse(b, 16, &f), ATTN_ERR_FORMAT);
    CHECK_MESSAGE("truncated");
    CHECK(f == NULL, "a failed parse leaves a handle");
    CHECK_STATUS(attn_safetensors_parse(NULL, 16, &f), ATTN_ERR_NULL);
    CHECK_STATUS(attn_safetensors_parse(b, 16, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_safetensors_open("/nonexistent/x.safetensors", &f), ATTN_ERR_IO);
    CHECK_MESSAGE("/nonexistent/x.safetensors");
    CHECK_STATUS(attn_safetensors_open("/", &f), ATTN_ERR_IO);
    CHECK_MESSAGE("not a regular file");
    CHECK_STATUS(attn_safetensors_open(NULL, &f), ATTN_ERR_NULL);
    /* Every truncation of a valid file fails (the writer leaves no unused
     * byte), and never over-reads (ASan: each copy is exactly sized). */
    size_t size;
    unsigned char *whole = read_file(fixture("torch_bf16.safetensors"), &size);
    long accepted = 0;
    for (size_t len = 0; whole != NULL && len < size; len++) {
        unsigned char *copy = malloc(len ? len : 1);
        memcpy(copy, whole, len);
        if (attn_safetensors_parse(copy, len, &f) == ATTN_OK) accepted++;
        attn_safetensors_close(f);
        free(copy);
    }
    CHECK(accepted == 0, "%ld truncations were accepted", accepted);
    /* A file's message names the file. */
    char path[] = "/tmp/attn_st_cut_XXXXXX";
    int fd = mkstemp(path);
    CHECK(whole != NULL && write(fd, whole, size / 2) == (ssize_t)(size / 2), "write");
    close(fd);
    CHECK_STATUS(attn_safetensors_open(path, &f), ATTN_ERR_FORMAT);
    CHECK_MESSAGE(path);
    CHECK_STATUS(attn__safetensors_open_read(path, &f), ATTN_ERR_FORMAT);
    CHECK_MESSAGE(path);
    remove(path);
    free(whole);
}

/* The tensors' data must tile the buffer, as the format's reference reader
 * demands: overlapping offsets (one tensor aliasing another), a hole, or
 * bytes past the last tensor make a malformed file. */
static void data_must_tile_the_buffer(void) {
    static const struct {
        const char *json;
        size_t data;
        const char *message;
    } cases[] = {
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
         "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
         16, "data_offsets [0, 16] begin before byte 4"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[12,16]}}",
         16, "data_offsets [12, 16] begin past byte 8"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 16,
         "its tensors cover 4"},
        {"{}", 4, "names no tensor, but 4 data bytes"},
        {"{\"x\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},"
         "\"y\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
         4, NULL}, /* an empty tensor where the one before ends: fine */
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const size_t n = strlen(cases[c].json), size = 8 + n + cases[c].data;
        unsigned char *b = calloc(1, size);
        b[0] = (unsigned char)n;
        memcpy(b + 8, cases[c].json, n);
        attn_safetensors *f = NULL;
        if (cases[c].message == NULL) {
            CHECK_OK(attn_safetensors_parse(b, size, &f));
        } else {
            CHECK_STATUS(attn_safetensors_parse(b, size, &f), ATTN_ERR_FORMAT);
            CHECK_MESSAGE(cases[c].message);
            CHECK(f == NULL, "case %zu: no handle", c);
        }
        attn_safetensors_close(f);
        free(b);
    }
}

/* A tensor at an offset not aligned to its elements (after a 1-byte one):
 * no view, a copy. */
static void misaligned(void) {
    const char *json = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[1,5]},"
                       "\"pad\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]}}";
    const size_t n = strlen(json);
    unsigned char b[128] = {0};
    b[0] = (unsigned char)n;
    memcpy(b + 8, json, n);
    const float one = 1.0f;
    uint32_t bits;
    memcpy(&bits, &one, 4);
    size_t at = 8 + n + 1;
    for (int i = 0; i < 4; i++) b[at + i] = (unsigned char)(bits >> (8 * i));
    /* Place the buffer so that byte `at` is not 4-aligned. */
    unsigned char *aligned = malloc(256), *base = aligned + 16 - (8 + n) % 16;
    memcpy(base, b, 8 + n + 5);
    attn_safetensors *f = NULL;
    CHECK_OK(attn_safetensors_parse(base, 8 + n + 5, &f));
    attn_tensor t;
    if ((uintptr_t)(base + at) % 4 != 0) {
        CHECK_STATUS(attn_safetensors_get(f, "a", &t), ATTN_ERR_UNSUPPORTED);
        CHECK_MESSAGE("attn_safetensors_read");
    }
    CHECK_OK(attn_safetensors_read(f, "a", 0, &t));
    CHECK(t.data && *(float *)t.data == 1.0f, "misaligned read");
    attn_safetensors_free(&t);
    attn_safetensors_close(f);
    free(aligned);
}

/* ---- the writer's arguments and its atomic replacement ---- */

static void save_errors(void) {
    float v[2] = {1, 2};
    int64_t s2[1] = {2};
    attn_tensor t[2];
    attn_tensor_init(&t[0], v, ATTN_DTYPE_F32, 1, s2);
    t[1] = t[0];
    const char *path = "/tmp/attn_st_never_written.safetensors";
    const char *ok[2] = {"a", "b"}, *dup[2] = {"a", "a"}, *meta_name[2] = {"a", "__metadata__"};
    const char *bad_utf8[2] = {"a", "\xff"}, *null_name[2] = {"a", NULL};
    CHECK_STATUS(attn_safetensors_save(path, 2, dup, t, NULL), ATTN_ERR_INVALID);
    CHECK_MESSAGE("'a' is given twice");
    CHECK_STATUS(attn_safetensors_save(path, 2, meta_name, t, NULL), ATTN_ERR_INVALID);
    CHECK(strcmp(attn_last_error_arg(), "names[1]") == 0, "arg %s", attn_last_error_arg());
    CHECK_STATUS(attn_safetensors_save(path, 2, bad_utf8, t, NULL), ATTN_ERR_INVALID);
    CHECK_MESSAGE("UTF-8");
    CHECK_STATUS(attn_safetensors_save(path, 2, null_name, t, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_safetensors_save(path, 2, NULL, t, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, NULL, NULL), ATTN_ERR_NULL);
    CHECK_STATUS(attn_safetensors_save(NULL, 2, ok, t, NULL), ATTN_ERR_NULL);
    const char *meta_dup[] = {"k", "1", "k", "2", NULL}, *meta_null[] = {"k", NULL, NULL};
    const char *meta_bad[] = {"k", "\xc3", NULL};
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, meta_dup), ATTN_ERR_INVALID);
    CHECK_MESSAGE("'k' is given twice");
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, meta_null), ATTN_ERR_NULL);
    CHECK(strcmp(attn_last_error_arg(), "metadata[1]") == 0, "arg %s", attn_last_error_arg());
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, meta_bad), ATTN_ERR_INVALID);
    t[1].shape[0] = -1;
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, NULL), ATTN_ERR_SHAPE);
    CHECK(strcmp(attn_last_error_arg(), "tensors[1]") == 0, "arg %s", attn_last_error_arg());
    t[1] = t[0];
    t[1].dtype = (attn_dtype)9;
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, NULL), ATTN_ERR_DTYPE);
    t[1] = t[0]; /* int32 (index tensors): the file format has I32, the saver does not take it */
    t[1].dtype = ATTN_DTYPE_I32;
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, NULL), ATTN_ERR_DTYPE);
    CHECK(strcmp(attn_last_error_arg(), "tensors[1]") == 0, "arg %s", attn_last_error_arg());
    const int devnull = open("/dev/null", O_WRONLY);
    CHECK_STATUS(attn_safetensors_write_fd(devnull, 2, ok, t, NULL), ATTN_ERR_DTYPE);
    close(devnull);
    t[1] = t[0];
    t[1].rank = 9;
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, NULL), ATTN_ERR_SHAPE);
    t[1] = t[0];
    t[1].data = NULL;
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, NULL), ATTN_ERR_NULL);
    t[1].shape[0] = 0; /* empty: no data needed */
    CHECK_OK(attn_safetensors_save(path, 2, ok, t, NULL));
    remove(path);
    t[1] = t[0];
    t[1].strides[0] = INT64_MAX / 2;
    CHECK_STATUS(attn_safetensors_save(path, 2, ok, t, NULL), ATTN_ERR_OVERFLOW);
    t[1] = t[0];
    CHECK_STATUS(attn_safetensors_save("/nonexistent/dir/x.safetensors", 2, ok, t, NULL),
                 ATTN_ERR_IO);
    CHECK_MESSAGE("/nonexistent/dir/x.safetensors");
    CHECK_STATUS(attn_safetensors_write_fd(-1, 2, ok, t, NULL), ATTN_ERR_INVALID);
    FILE *f = fopen(path, "rb");
    CHECK(f == NULL, "a refused save created its file");
    if (f != NULL) fclose(f);
}

/* A save that fails part-way (here: a 64 KiB file-size limit, as a full
 * disk) leaves the old file as it was and no temporary. */
static void failed_save_keeps_old_file(void) {
    char dir[] = "/tmp/attn_st_atomic_XXXXXX", path[64], names[256];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(path, sizeof path, "%s/m.safetensors", dir);
    static float big[32768];
    int64_t n = 32768, one = 1;
    attn_tensor t;
    attn_tensor_init(&t, big, ATTN_DTYPE_F32, 1, &one);
    const char *name = "w";
    CHECK_OK(attn_safetensors_save(path, 1, &name, &t, NULL));
    size_t old_size = 0, new_size = 0;
    unsigned char *old = tt_read_file(path, &old_size);
    attn_tensor_init(&t, big, ATTN_DTYPE_F32, 1, &n);
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        struct rlimit lim = {64 * 1024, 64 * 1024};
        signal(SIGXFSZ, SIG_IGN);
        setrlimit(RLIMIT_FSIZE, &lim);
        attn_status st = attn_safetensors_save(path, 1, &name, &t, NULL);
        _exit(st == ATTN_ERR_IO && strstr(attn_last_error(), strerror(EFBIG)) ? 0 : 1);
    }
    int status = -1;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the limited save did not fail with EFBIG");
    unsigned char *now = tt_read_file(path, &new_size);
    CHECK(old && now && new_size == old_size && memcmp(old, now, old_size) == 0,
          "the old file changed");
    CHECK(tt_list_dir(dir, names, sizeof names) == 1 && strcmp(names, "m.safetensors") == 0,
          "left in the folder: %s", names);
    free(old);
    free(now);
    tt_remove_tree(dir);
}

HARNESS_MAIN(T(half_conversions), T(reference_files), T(round_trips), T(many_tensors),
             T(conversions), T(malformed_headers), T(hostile_lengths), T(misaligned),
             T(data_must_tile_the_buffer),
             T(save_errors), T(failed_save_keeps_old_file))
