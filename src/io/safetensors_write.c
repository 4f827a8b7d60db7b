/*
 * safetensors_write.c — writing safetensors files: every argument checked
 * before a byte is written, the header's JSON measured then written, the
 * tensors in C order, little-endian, through their strides.
 *
 * Layout: tensors with 8-byte elements first, then 4, 2 and 1, each group
 * in the caller's order, without gaps (the reference reader requires the
 * data buffer covered exactly). The header is padded with spaces so that
 * the buffer starts at a multiple of 8: every tensor is then aligned to its
 * element size in a file mapped at a page boundary (zero-copy reads).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "io.h"

typedef struct st_item {
    size_t index; /* into the caller's arrays */
    size_t elem;  /* bytes per element */
    int64_t numel;
    uint64_t begin; /* into the data buffer */
} st_item;

typedef struct st_plan {
    size_t count;
    const char *const *names;
    const attn_tensor *tensors;
    const char *const *metadata; /* key, value, ..., NULL */
    size_t npairs;
    st_item *items; /* in data order */
    char *header;   /* the JSON, padded */
    size_t header_len;
} st_plan;

/* ---- arguments ---- */

static attn_status check_string(const char *s, const char *arg, const char *what) {
    if (s == NULL) return attn__fail_arg(ATTN_ERR_NULL, arg, "%s (%s) is NULL", arg, what);
    if (!attn__utf8_valid((const unsigned char *)s, strlen(s)))
        return attn__fail_arg(ATTN_ERR_INVALID, arg, "%s (%s) is not valid UTF-8", arg, what);
    return ATTN_OK;
}

static int by_string(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A string given twice among n (every `step`-th of list), or NULL. */
static attn_status find_repeat(const char *const *list, size_t n, size_t step,
                               const char **repeat) {
    *repeat = NULL;
    if (n < 2) return ATTN_OK;
    const char **sorted = attn__alloc_array(n, sizeof *sorted);
    if (sorted == NULL) return ATTN_ERR_NOMEM;
    for (size_t i = 0; i < n; i++) sorted[i] = list[i * step];
    qsort(sorted, n, sizeof *sorted, by_string);
    for (size_t i = 1; i < n && *repeat == NULL; i++)
        if (strcmp(sorted[i - 1], sorted[i]) == 0) *repeat = sorted[i];
    attn__free(sorted);
    return ATTN_OK;
}

static attn_status check_tensors(st_plan *p) {
    if (p->count > 0 && (p->names == NULL || p->tensors == NULL))
        return attn__fail_arg(ATTN_ERR_NULL, p->names == NULL ? "names" : "tensors",
                              "%s is NULL but count is %zu", p->names == NULL ? "names" : "tensors",
                              p->count);
    for (size_t i = 0; i < p->count; i++) {
        char arg[48];
        snprintf(arg, sizeof arg, "names[%zu]", i);
        attn_status st = check_string(p->names[i], arg, "a tensor's name");
        if (st != ATTN_OK) return st;
        if (strcmp(p->names[i], "__metadata__") == 0)
            return attn__fail_arg(ATTN_ERR_INVALID, arg,
                                  "%s is \"__metadata__\", the name the format keeps for the "
                                  "metadata",
                                  arg);
        snprintf(arg, sizeof arg, "tensors[%zu]", i);
        int64_t numel;
        if ((st = attn__st_check_view(&p->tensors[i], arg, ATTN__INPUT, &numel)) != ATTN_OK)
            return st;
        if (attn__st_dtype_name(p->tensors[i].dtype) == NULL) /* int32: an index dtype */
            return attn__fail_arg(ATTN_ERR_DTYPE, arg,
                                  "%s is %s; a tensor is saved as float32, float64, float16, "
                                  "bfloat16 or bool",
                                  arg, attn_dtype_name(p->tensors[i].dtype));
    }
    const char *repeat;
    attn_status st = find_repeat(p->names, p->count, 1, &repeat);
    if (st == ATTN_OK && repeat != NULL)
        return attn__fail_arg(ATTN_ERR_INVALID, "names",
                              "names: '%.200s' is given twice; each tensor needs its own name",
                              repeat);
    return st;
}

static attn_status check_metadata(st_plan *p) {
    p->npairs = 0;
    if (p->metadata == NULL) return ATTN_OK;
    for (size_t j = 0; p->metadata[2 * j] != NULL; j++) {
        char arg[48];
        snprintf(arg, sizeof arg, "metadata[%zu]", 2 * j);
        attn_status st = check_string(p->metadata[2 * j], arg, "a key");
        if (st != ATTN_OK) return st;
        snprintf(arg, sizeof arg, "metadata[%zu]", 2 * j + 1);
        if ((st = check_string(p->metadata[2 * j + 1], arg, "a value")) != ATTN_OK) return st;
        p->npairs++;
    }
    const char *repeat;
    attn_status st = find_repeat(p->metadata, p->npairs, 2, &repeat);
    if (st == ATTN_OK && repeat != NULL)
        return attn__fail_arg(ATTN_ERR_INVALID, "metadata",
                              "metadata: the key '%.200s' is given twice", repeat);
    return st;
}

/* ---- layout ---- */

static int by_elem_size(const void *a, const void *b) {
    const st_item *x = a, *y = b;
    if (x->elem != y->elem) return x->elem > y->elem ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

static attn_status lay_out(st_plan *p) {
    p->items = attn__alloc_array(p->count > 0 ? p->count : 1, sizeof *p->items);
    if (p->items == NULL) return ATTN_ERR_NOMEM;
    for (size_t i = 0; i < p->count; i++) {
        const attn_tensor *t = &p->tensors[i];
        int64_t numel = 1;
        for (int d = 0; d < t->rank; d++) numel *= t->shape[d]; /* checked: fits */
        p->items[i] = (st_item){i, attn_dtype_size(t->dtype), numel, 0};
    }
    qsort(p->items, p->count, sizeof *p->items, by_elem_size);
    uint64_t at = 0;
    for (size_t i = 0; i < p->count; i++) {
        st_item *it = &p->items[i];
        uint64_t bytes;
        it->begin = at;
        if (__builtin_mul_overflow((uint64_t)it->numel, (uint64_t)it->elem, &bytes) ||
            __builtin_add_overflow(at, bytes, &at) || at > (uint64_t)INT64_MAX)
            return attn__fail_arg(ATTN_ERR_OVERFLOW, "tensors",
                                  "tensors: their bytes add up to more than 2^63");
    }
    return ATTN_OK;
}

/* ---- the header ---- */

/* Text appended to buf, or only counted while buf is NULL. */
typedef struct sink {
    char *buf;
    size_t len;
} sink;

static void put(sink *s, const char *text, size_t n) {
    if (s->buf != NULL) memcpy(s->buf + s->len, text, n);
    s->len += n;
}
static void puts_(sink *s, const char *text) { put(s, text, strlen(text)); }
static void put_u64(sink *s, uint64_t v) {
    char num[24];
    int n = snprintf(num, sizeof num, "%llu", (unsigned long long)v);
    put(s, num, (size_t)n);
}

/* A JSON string: '"' and '\' escaped, control characters as \u00XX, the
 * rest (valid UTF-8) as it is. */
static void put_string(sink *s, const char *text) {
    put(s, "\"", 1);
    for (const unsigned char *c = (const unsigned char *)text; *c != '\0'; c++) {
        char esc[8];
        if (*c == '"' || *c == '\\') {
            esc[0] = '\\';
            esc[1] = (char)*c;
            put(s, esc, 2);
        } else if (*c < 0x20) {
            snprintf(esc, sizeof esc, "\\u%04x", *c);
            put(s, esc, 6);
        } else {
            put(s, (const char *)c, 1);
        }
    }
    put(s, "\"", 1);
}

static void put_entry(sink *s, const st_plan *p, const st_item *it) {
    const attn_tensor *t = &p->tensors[it->index];
    put_string(s, p->names[it->index]);
    puts_(s, ":{\"dtype\":\"");
    puts_(s, attn__st_dtype_name(t->dtype));
    puts_(s, "\",\"shape\":[");
    for (int d = 0; d < t->rank; d++) {
        if (d > 0) put(s, ",", 1);
        put_u64(s, (uint64_t)t->shape[d]);
    }
    puts_(s, "],\"data_offsets\":[");
    put_u64(s, it->begin);
    put(s, ",", 1);
    put_u64(s, it->begin + (uint64_t)it->numel * it->elem);
    puts_(s, "]}");
}

/* The metadata first, as the reference writes it, then the tensors in data
 * order; spaces up to a multiple of 8 with the 8-byte length. */
static void put_header(sink *s, const st_plan *p) {
    put(s, "{", 1);
    if (p->npairs > 0) {
        puts_(s, "\"__metadata__\":{");
        for (size_t j = 0; j < p->npairs; j++) {
            if (j > 0) put(s, ",", 1);
            put_string(s, p->metadata[2 * j]);
            put(s, ":", 1);
            put_string(s, p->metadata[2 * j + 1]);
        }
        puts_(s, "}");
    }
    for (size_t i = 0; i < p->count; i++) {
        if (i > 0 || p->npairs > 0) put(s, ",", 1);
        put_entry(s, p, &p->items[i]);
    }
    put(s, "}", 1);
    while ((8 + s->len) % 8 != 0) put(s, " ", 1);
}

static attn_status make_header(st_plan *p) {
    sink s = {NULL, 0};
    put_header(&s, p); /* measures */
    if (s.len > ATTN__ST_MAX_HEADER)
        return attn__fail_arg(ATTN_ERR_INVALID, "names",
                              "the header would take %zu bytes, more than the %d that readers "
                              "accept (too many tensors or too long names)",
                              s.len, ATTN__ST_MAX_HEADER);
    p->header = attn__alloc(s.len);
    if (p->header == NULL) return ATTN_ERR_NOMEM;
    p->header_len = s.len;
    s = (sink){p->header, 0};
    put_header(&s, p);
    return ATTN_OK;
}

static attn_status plan_make(st_plan *p, size_t count, const char *const *names,
                             const attn_tensor *tensors, const char *const *metadata) {
    memset(p, 0, sizeof *p);
    p->count = count;
    p->names = names;
    p->tensors = tensors;
    p->metadata = metadata;
    attn_status st = check_tensors(p);
    if (st == ATTN_OK) st = check_metadata(p);
    if (st == ATTN_OK) st = lay_out(p);
    if (st == ATTN_OK) st = make_header(p);
    return st;
}

static void plan_free(st_plan *p) {
    attn__free(p->items);
    attn__free(p->header);
}

/* ---- the bytes ---- */

/* One tensor's elements in C order, little-endian, into fd through chunk.
 * Returns 0 or an errno value. */
static int write_tensor(int fd, const attn_tensor *t, int64_t numel, unsigned char *chunk,
                        size_t size, size_t *used) {
    const size_t es = attn_dtype_size(t->dtype);
    const bool big = *(const unsigned char *)&(uint16_t){1} == 0;
    int64_t idx[ATTN_MAX_RANK] = {0}, off = 0;
    for (int64_t i = 0; i < numel; i++) {
        if (*used + es > size) {
            int err = attn__write_all(fd, chunk, *used);
            if (err != 0) return err;
            *used = 0;
        }
        const unsigned char *src = (const unsigned char *)t->data + off * (int64_t)es;
        for (size_t k = 0; k < es; k++) chunk[*used + k] = src[big ? es - 1 - k : k];
        if (t->dtype == ATTN_DTYPE_BOOL) chunk[*used] = chunk[*used] != 0;
        *used += es;
        for (int d = t->rank - 1; d >= 0; d--) {
            off += t->strides[d];
            if (++idx[d] < t->shape[d]) break;
            off -= t->strides[d] * idx[d];
            idx[d] = 0;
        }
    }
    return 0;
}

/* The whole file to fd. Returns 0 or an errno value. */
static int write_plan(int fd, const void *ctx) {
    const st_plan *p = ctx;
    unsigned char chunk[1 << 14];
    for (int i = 0; i < 8; i++) chunk[i] = (unsigned char)((uint64_t)p->header_len >> (8 * i));
    int err = attn__write_all(fd, chunk, 8);
    if (err == 0) err = attn__write_all(fd, p->header, p->header_len);
    size_t used = 0;
    for (size_t i = 0; err == 0 && i < p->count; i++) {
        const st_item *it = &p->items[i];
        err = write_tensor(fd, &p->tensors[it->index], it->numel, chunk, sizeof chunk, &used);
    }
    if (err == 0 && used > 0) err = attn__write_all(fd, chunk, used);
    return err;
}

attn_status attn_safetensors_write_fd(int fd, size_t count, const char *const *names,
                                      const attn_tensor *tensors, const char *const *metadata) {
    attn__clear_error();
    if (fd < 0) return attn__fail_arg(ATTN_ERR_INVALID, "fd", "fd is %d, not an open file", fd);
    st_plan p;
    attn_status st = plan_make(&p, count, names, tensors, metadata);
    if (st == ATTN_OK) {
        int err = write_plan(fd, &p);
        if (err != 0)
            st = attn__fail(ATTN_ERR_IO, "cannot write the safetensors data: %s", strerror(err));
    }
    plan_free(&p);
    return st;
}

attn_status attn_safetensors_save(const char *path, size_t count, const char *const *names,
                                  const attn_tensor *tensors, const char *const *metadata) {
    attn__clear_error();
    if (path == NULL) return attn__fail_arg(ATTN_ERR_NULL, "path", "path is NULL");
    st_plan p;
    attn_status st = plan_make(&p, count, names, tensors, metadata);
    if (st == ATTN_OK) st = attn__save_atomic(path, write_plan, &p);
    plan_free(&p);
    return st;
}
