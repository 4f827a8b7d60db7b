/*
 * safetensors.c — reading safetensors files: the header's JSON by a small
 * strict parser of our own, the tensors as zero-copy views, converted
 * copies or raw bytes.
 *
 *   u64 LE N | N bytes of JSON | data buffer (offsets relative to its start)
 *
 * Nothing is trusted: every length is checked against the bytes present
 * before use, the parser never reads past the header, every size is 64-bit
 * and overflow-checked, and every surprise is ATTN_ERR_FORMAT saying what
 * and where. The header's strings are decoded into one arena of the
 * header's size (a decoded string is never longer than its JSON form), so
 * the memory a hostile header can claim is bounded by its own length.
 */
#define _POSIX_C_SOURCE 200809L /* fstat, mmap */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io.h"

enum {
    MAX_HEADER = ATTN__ST_MAX_HEADER,
    MAX_DEPTH = 64, /* nesting in skipped values */
    SHOWN = 200     /* bytes of a name quoted in a message */
};

/* Every dtype the format names (as the reference spells them). */
static const attn__st_dtype DTYPES[] = {
    {"F64", 64, ATTN_DTYPE_F64},   {"F32", 32, ATTN_DTYPE_F32},
    {"F16", 16, ATTN_DTYPE_F16},   {"BF16", 16, ATTN_DTYPE_BF16},
    {"BOOL", 8, ATTN_DTYPE_BOOL},  {"I64", 64, 0},
    {"U64", 64, 0},                {"I32", 32, 0},
    {"U32", 32, 0},                {"I16", 16, 0},
    {"U16", 16, 0},                {"I8", 8, 0},
    {"U8", 8, 0},                  {"C64", 64, 0},
    {"F8_E4M3", 8, 0},             {"F8_E5M2", 8, 0},
    {"F8_E4M3FNUZ", 8, 0},         {"F8_E5M2FNUZ", 8, 0},
    {"F8_E8M0", 8, 0},             {"F6_E2M3", 6, 0},
    {"F6_E3M2", 6, 0},             {"F4", 4, 0},
};
enum { NDTYPES = sizeof DTYPES / sizeof DTYPES[0] };

const char *attn__st_dtype_name(attn_dtype dtype) {
    for (int i = 0; i < NDTYPES; i++)
        if (DTYPES[i].dtype == dtype && dtype != 0) return DTYPES[i].name;
    return NULL;
}

typedef struct st_entry {
    const char *name; /* in the arena */
    const attn__st_dtype *dtype;
    int rank;                     /* the file's; may exceed ATTN_MAX_RANK */
    int64_t shape[ATTN_MAX_RANK]; /* the first min(rank, ATTN_MAX_RANK) */
    int64_t numel;
    uint64_t begin, end; /* into the data buffer */
} st_entry;

typedef struct st_pair {
    const char *key, *value;
} st_pair;

struct attn_safetensors {
    const unsigned char *buffer; /* the data buffer */
    uint64_t buffer_size;
    st_entry *tensors;
    int64_t ntensors, tensor_cap;
    st_entry **by_name; /* sorted by name */
    st_pair *meta;
    int64_t nmeta, meta_cap;
    st_pair **meta_by_key;
    char *arena; /* the header's strings, decoded */
    size_t arena_used, arena_size;
    void *map; /* mmap'ed file, or NULL */
    size_t map_size;
    void *owned; /* the file read into memory, or NULL */
};

/* ---- UTF-8 ---- */

/* The length of the valid UTF-8 sequence at s (s < end), or 0. */
static size_t utf8_seq(const unsigned char *s, const unsigned char *end) {
    const unsigned c = s[0];
    size_t n;
    unsigned lo = 0x80, hi = 0xbf; /* the second byte's range */
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) n = 2;
    else if (c >= 0xe0 && c <= 0xef) n = 3;
    else if (c >= 0xf0 && c <= 0xf4) n = 4;
    else return 0; /* continuation, overlong lead (c0, c1) or beyond U+10FFFF */
    if (c == 0xe0) lo = 0xa0;      /* overlong */
    else if (c == 0xed) hi = 0x9f; /* surrogates */
    else if (c == 0xf0) lo = 0x90; /* overlong */
    else if (c == 0xf4) hi = 0x8f; /* above U+10FFFF */
    if ((size_t)(end - s) < n || s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < n; i++)
        if ((s[i] & 0xc0) != 0x80) return 0;
    return n;
}

bool attn__utf8_valid(const unsigned char *s, size_t n) {
    const unsigned char *end = s + n;
    while (s < end) {
        size_t k = utf8_seq(s, end);
        if (k == 0) return false;
        s += k;
    }
    return true;
}

static size_t utf8_put(char *out, uint32_t cp) {
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | cp >> 6);
        out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | cp >> 18);
    out[1] = (char)(0x80 | (cp >> 12 & 0x3f));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3f));
    out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* ---- the header's JSON ---- */

typedef struct parser {
    const unsigned char *p, *start, *end;
    attn_safetensors *f;
} parser;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static attn_status syntax(const parser *ps, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return attn__fail(ATTN_ERR_FORMAT, "safetensors header, byte %zu of %zu: %s",
                      (size_t)(ps->p - ps->start), (size_t)(ps->end - ps->start), what);
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end &&
           (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static bool accept(parser *ps, char ch) {
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == (unsigned char)ch) {
        ps->p++;
        return true;
    }
    return false;
}

static attn_status expect(parser *ps, char ch, const char *context) {
    if (accept(ps, ch)) return ATTN_OK;
    if (ps->p >= ps->end) return syntax(ps, "the header ends where '%c' %s should be", ch, context);
    return syntax(ps, "expected '%c' %s", ch, context);
}

static int hex4(const unsigned char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        const unsigned c = p[i];
        const int d = c >= '0' && c <= '9'   ? (int)c - '0'
                      : c >= 'a' && c <= 'f' ? (int)c - 'a' + 10
                      : c >= 'A' && c <= 'F' ? (int)c - 'A' + 10
                                             : -1;
        if (d < 0) return -1;
        v = v * 16 + d;
    }
    return v;
}

/* The code point of "\uXXXX" (with its low surrogate when it is a high
 * one) at ps->p, which points after the backslash. */
static attn_status parse_u_escape(parser *ps, uint32_t *cp) {
    int hi = (ps->end - ps->p) >= 5 ? hex4(ps->p + 1) : -1;
    if (hi < 0) return syntax(ps, "\\u needs four hex digits");
    ps->p += 5;
    if (hi >= 0xdc00 && hi <= 0xdfff) return syntax(ps, "a lone low surrogate \\u%04X", hi);
    if (hi >= 0xd800 && hi <= 0xdbff) {
        int lo = (ps->end - ps->p) >= 6 && ps->p[0] == '\\' && ps->p[1] == 'u' ? hex4(ps->p + 2)
                                                                              : -1;
        if (lo < 0xdc00 || lo > 0xdfff)
            return syntax(ps, "the high surrogate \\u%04X is not followed by a low one", hi);
        ps->p += 6;
        *cp = 0x10000 + (((uint32_t)hi - 0xd800) << 10) + ((uint32_t)lo - 0xdc00);
        return ATTN_OK;
    }
    if (hi == 0) return syntax(ps, "a string holds U+0000, which attn's C strings cannot");
    *cp = (uint32_t)hi;
    return ATTN_OK;
}

/* One escape sequence at ps->p (the backslash), decoded into out. */
static attn_status parse_escape(parser *ps, char *out, size_t *n) {
    if (ps->end - ps->p < 2) return syntax(ps, "the header ends inside an escape");
    const unsigned char c = ps->p[1];
    static const char from[] = "\"\\/bfnrt", to[] = "\"\\/\b\f\n\r\t";
    const char *hit = c != 0 ? strchr(from, c) : NULL;
    if (hit != NULL) {
        out[(*n)++] = to[hit - from];
        ps->p += 2;
        return ATTN_OK;
    }
    if (c != 'u') return syntax(ps, "an unknown escape '\\%c'", c >= 0x20 && c < 0x7f ? c : '?');
    ps->p++;
    uint32_t cp = 0;
    attn_status st = parse_u_escape(ps, &cp);
    if (st == ATTN_OK) *n += utf8_put(out + *n, cp);
    return st;
}

/* A JSON string, decoded (NUL-terminated) at the arena's free end. The
 * arena is not advanced: keep() does that for strings that are kept. */
static attn_status parse_string(parser *ps, const char **out) {
    skip_ws(ps);
    if (ps->p >= ps->end || *ps->p != '"') return syntax(ps, "expected a string");
    ps->p++;
    attn_safetensors *f = ps->f;
    char *dst = f->arena + f->arena_used;
    size_t n = 0;
    /* Room: the kept strings, each decoded with its NUL, took no more bytes
     * than their JSON forms (quotes included) before this one, and decoding
     * never lengthens; so arena_used + n + 1 <= the offset of ps->p, which
     * is below the arena's size (the header's length + 1). */
    for (;;) {
        if (ps->p >= ps->end) return syntax(ps, "the header ends inside a string");
        const unsigned char c = *ps->p;
        if (c == '"') break;
        attn_status st = ATTN_OK;
        if (c < 0x20) {
            return syntax(ps, "a control character (0x%02x) in a string must be escaped", c);
        } else if (c == '\\') {
            st = parse_escape(ps, dst, &n);
        } else {
            size_t k = utf8_seq(ps->p, ps->end);
            if (k == 0) return syntax(ps, "a string is not valid UTF-8");
            memcpy(dst + n, ps->p, k);
            n += k;
            ps->p += k;
        }
        if (st != ATTN_OK) return st;
    }
    ps->p++;
    dst[n] = '\0';
    *out = dst;
    return ATTN_OK;
}

static void keep(attn_safetensors *f, const char *s) { f->arena_used += strlen(s) + 1; }

/* A non-negative integer that fits in 64 bits. */
static attn_status parse_uint(parser *ps, uint64_t *v, const char *what) {
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == '-') return syntax(ps, "%s is negative", what);
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
        return syntax(ps, "%s is not a non-negative integer", what);
    if (*ps->p == '0' && ps->end - ps->p > 1 && ps->p[1] >= '0' && ps->p[1] <= '9')
        return syntax(ps, "%s has a leading zero", what);
    uint64_t x = 0;
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        if (__builtin_mul_overflow(x, 10, &x) || __builtin_add_overflow(x, *ps->p - '0', &x))
            return syntax(ps, "%s does not fit in 64 bits", what);
        ps->p++;
    }
    if (ps->p < ps->end && (*ps->p == '.' || *ps->p == 'e' || *ps->p == 'E'))
        return syntax(ps, "%s is not an integer", what);
    *v = x;
    return ATTN_OK;
}

/* A JSON number's grammar, value unused. */
static attn_status skip_number(parser *ps) {
    const unsigned char *p = ps->p, *e = ps->end;
#define DIGITS(p) ((p) < e && *(p) >= '0' && *(p) <= '9')
    if (p < e && *p == '-') p++;
    if (!DIGITS(p)) return syntax(ps, "a malformed number");
    if (*p == '0') p++;
    else while (DIGITS(p)) p++;
    if (p < e && *p == '.') {
        p++;
        if (!DIGITS(p)) return syntax(ps, "a malformed number");
        while (DIGITS(p)) p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        if (!DIGITS(p)) return syntax(ps, "a malformed number");
        while (DIGITS(p)) p++;
    }
#undef DIGITS
    ps->p = p;
    return ATTN_OK;
}

/* Any JSON value (a field attn does not read), up to MAX_DEPTH levels. */
static attn_status skip_value(parser *ps, int depth) {
    skip_ws(ps);
    if (depth > MAX_DEPTH) return syntax(ps, "values nested deeper than %d levels", MAX_DEPTH);
    if (ps->p >= ps->end) return syntax(ps, "the header ends where a value should be");
    const unsigned char c = *ps->p;
    attn_status st = ATTN_OK;
    if (c == '"') {
        const char *s;
        return parse_string(ps, &s); /* not kept */
    }
    if (c == '-' || (c >= '0' && c <= '9')) return skip_number(ps);
    static const char *const words[3] = {"true", "false", "null"};
    for (int i = 0; i < 3; i++) {
        size_t n = strlen(words[i]);
        if ((size_t)(ps->end - ps->p) >= n && memcmp(ps->p, words[i], n) == 0) {
            ps->p += n;
            return ATTN_OK;
        }
    }
    if (c != '[' && c != '{') return syntax(ps, "expected a value");
    const char close = c == '[' ? ']' : '}';
    ps->p++;
    if (accept(ps, close)) return ATTN_OK;
    do {
        if (close == '}') {
            const char *key;
            if ((st = parse_string(ps, &key)) != ATTN_OK ||
                (st = expect(ps, ':', "after a key")) != ATTN_OK)
                return st;
        }
        if ((st = skip_value(ps, depth + 1)) != ATTN_OK) return st;
    } while (accept(ps, ','));
    return expect(ps, close, close == ']' ? "to end an array" : "to end an object");
}

static const attn__st_dtype *find_dtype(const char *name) {
    for (int i = 0; i < NDTYPES; i++)
        if (strcmp(DTYPES[i].name, name) == 0) return &DTYPES[i];
    return NULL;
}

/* "shape": [d0, d1, ...]. The product of the nonzero dimensions must fit
 * in 64 bits, whatever their order and even when a zero makes the tensor
 * empty: its C strides are those products. */
static attn_status parse_shape(parser *ps, st_entry *e) {
    attn_status st = expect(ps, '[', "to start 'shape'");
    if (st != ATTN_OK) return st;
    e->rank = 0;
    if (accept(ps, ']')) return ATTN_OK;
    int64_t nonzero = 1;
    bool empty = false;
    do {
        uint64_t d;
        if ((st = parse_uint(ps, &d, "a 'shape' entry")) != ATTN_OK) return st;
        if (d > INT64_MAX || attn__mul_overflows(nonzero, d > 0 ? (int64_t)d : 1, &nonzero))
            return syntax(ps, "tensor '%.*s': its dimensions' product overflows 64 bits", SHOWN,
                          e->name);
        empty = empty || d == 0;
        if (e->rank < ATTN_MAX_RANK) e->shape[e->rank] = (int64_t)d;
        e->rank++;
    } while (accept(ps, ','));
    e->numel = empty ? 0 : nonzero;
    return expect(ps, ']', "to end 'shape'");
}

static attn_status parse_offsets(parser *ps, st_entry *e) {
    attn_status st = expect(ps, '[', "to start 'data_offsets'");
    if (st == ATTN_OK) st = parse_uint(ps, &e->begin, "'data_offsets'[0]");
    if (st == ATTN_OK) st = expect(ps, ',', "between the two 'data_offsets'");
    if (st == ATTN_OK) st = parse_uint(ps, &e->end, "'data_offsets'[1]");
    if (st == ATTN_OK) st = expect(ps, ']', "after the two 'data_offsets'");
    return st;
}

/* One field of a tensor's entry; `seen` has a bit per known field. */
static attn_status parse_field(parser *ps, st_entry *e, const char *field, unsigned *seen) {
    static const char *const known[3] = {"dtype", "shape", "data_offsets"};
    int k = 0;
    while (k < 3 && strcmp(field, known[k]) != 0) k++;
    if (k == 3) return skip_value(ps, 3); /* a field the format may add later (level 3) */
    if (*seen & 1u << k)
        return syntax(ps, "tensor '%.*s' gives '%s' twice", SHOWN, e->name, known[k]);
    *seen |= 1u << k;
    if (k == 1) return parse_shape(ps, e);
    if (k == 2) return parse_offsets(ps, e);
    const char *dtype;
    attn_status st = parse_string(ps, &dtype);
    if (st != ATTN_OK) return st;
    e->dtype = find_dtype(dtype);
    if (e->dtype == NULL)
        return syntax(ps, "tensor '%.*s' has an unknown dtype '%.*s'", SHOWN, e->name, 40, dtype);
    return ATTN_OK;
}

/* The byte count the entry's dtype and shape make, against its offsets. */
static attn_status check_extent(const parser *ps, const st_entry *e) {
    uint64_t bits;
    if (__builtin_mul_overflow((uint64_t)e->numel, (uint64_t)e->dtype->bits, &bits))
        return syntax(ps, "tensor '%.*s': its byte count overflows 64 bits", SHOWN, e->name);
    if (bits % 8 != 0)
        return syntax(ps, "tensor '%.*s': %lld elements of %s are not a whole number of bytes",
                      SHOWN, e->name, (long long)e->numel, e->dtype->name);
    const uint64_t size = ps->f->buffer_size;
    if (e->begin > e->end || e->end > size)
        return syntax(ps,
                      "tensor '%.*s': data_offsets [%llu, %llu] are outside the %llu-byte data "
                      "buffer (or reversed)",
                      SHOWN, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                      (unsigned long long)size);
    if (e->end - e->begin != bits / 8)
        return syntax(ps,
                      "tensor '%.*s': data_offsets [%llu, %llu] span %llu bytes, but %lld "
                      "elements of %s take %llu",
                      SHOWN, e->name, (unsigned long long)e->begin, (unsigned long long)e->end,
                      (unsigned long long)(e->end - e->begin), (long long)e->numel,
                      e->dtype->name, (unsigned long long)(bits / 8));
    return ATTN_OK;
}

/* Room for one more element in a growing array (attn__alloc has no
 * realloc). NULL and the message set when out of memory. */
static bool grow(void **items, int64_t *cap, int64_t count, size_t size) {
    if (count < *cap) return true;
    const int64_t more = *cap > 0 ? *cap * 2 : 16;
    void *bigger = attn__alloc_array((size_t)more, size);
    if (bigger == NULL) return false;
    if (count > 0) memcpy(bigger, *items, (size_t)count * size);
    attn__free(*items);
    *items = bigger;
    *cap = more;
    return true;
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e], ...} */
static attn_status parse_tensor(parser *ps, const char *name) {
    attn_safetensors *f = ps->f;
    if (!grow((void **)&f->tensors, &f->tensor_cap, f->ntensors, sizeof(st_entry)))
        return ATTN_ERR_NOMEM;
    st_entry *e = &f->tensors[f->ntensors];
    memset(e, 0, sizeof *e);
    e->name = name;
    e->numel = 1;
    attn_status st = expect(ps, '{', "to start a tensor's entry");
    if (st != ATTN_OK) return st;
    unsigned seen = 0;
    if (!accept(ps, '}')) {
        do {
            const char *field;
            if ((st = parse_string(ps, &field)) != ATTN_OK ||
                (st = expect(ps, ':', "after a key")) != ATTN_OK ||
                (st = parse_field(ps, e, field, &seen)) != ATTN_OK)
                return st;
        } while (accept(ps, ','));
        if ((st = expect(ps, '}', "to end a tensor's entry")) != ATTN_OK) return st;
    }
    if (seen != 7)
        return syntax(ps, "tensor '%.*s' lacks '%s'", SHOWN, name,
                      !(seen & 1) ? "dtype" : !(seen & 2) ? "shape" : "data_offsets");
    if ((st = check_extent(ps, e)) != ATTN_OK) return st;
    f->ntensors++;
    return ATTN_OK;
}

/* "__metadata__": {"key": "value", ...} */
static attn_status parse_metadata(parser *ps) {
    attn_safetensors *f = ps->f;
    attn_status st = expect(ps, '{', "to start '__metadata__'");
    if (st != ATTN_OK || accept(ps, '}')) return st;
    do {
        const char *key, *value;
        if ((st = parse_string(ps, &key)) != ATTN_OK) return st;
        keep(f, key);
        if ((st = expect(ps, ':', "after a key")) != ATTN_OK) return st;
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p != '"')
            return syntax(ps, "__metadata__ value of '%.*s' is not a string", SHOWN, key);
        if ((st = parse_string(ps, &value)) != ATTN_OK) return st;
        keep(f, value);
        if (!grow((void **)&f->meta, &f->meta_cap, f->nmeta, sizeof(st_pair)))
            return ATTN_ERR_NOMEM;
        f->meta[f->nmeta++] = (st_pair){key, value};
    } while (accept(ps, ','));
    return expect(ps, '}', "to end '__metadata__'");
}

/* The whole header: one object of tensors and at most one __metadata__. */
static attn_status parse_header(parser *ps) {
    attn_status st = expect(ps, '{', "to start the header");
    if (st != ATTN_OK) return st;
    bool have_meta = false;
    if (!accept(ps, '}')) {
        do {
            const char *name;
            if ((st = parse_string(ps, &name)) != ATTN_OK ||
                (st = expect(ps, ':', "after a name")) != ATTN_OK)
                return st;
            if (strcmp(name, "__metadata__") == 0) {
                if (have_meta) return syntax(ps, "'__metadata__' appears twice");
                have_meta = true;
                st = parse_metadata(ps);
            } else {
                keep(ps->f, name);
                st = parse_tensor(ps, name);
            }
            if (st != ATTN_OK) return st;
        } while (accept(ps, ','));
        if ((st = expect(ps, '}', "to end the header")) != ATTN_OK) return st;
    }
    skip_ws(ps);
    if (ps->p != ps->end) return syntax(ps, "text after the header's object");
    return ATTN_OK;
}

/* ---- lookup: names sorted once, duplicates refused ---- */

static int by_name(const void *a, const void *b) {
    return strcmp((*(st_entry *const *)a)->name, (*(st_entry *const *)b)->name);
}
static int by_key(const void *a, const void *b) {
    return strcmp((*(st_pair *const *)a)->key, (*(st_pair *const *)b)->key);
}

static attn_status index_names(attn_safetensors *f) {
    f->by_name = attn__alloc_array((size_t)f->ntensors, sizeof *f->by_name);
    f->meta_by_key = attn__alloc_array((size_t)f->nmeta, sizeof *f->meta_by_key);
    if (f->by_name == NULL || f->meta_by_key == NULL) return ATTN_ERR_NOMEM;
    for (int64_t i = 0; i < f->ntensors; i++) f->by_name[i] = &f->tensors[i];
    for (int64_t i = 0; i < f->nmeta; i++) f->meta_by_key[i] = &f->meta[i];
    qsort(f->by_name, (size_t)f->ntensors, sizeof *f->by_name, by_name);
    qsort(f->meta_by_key, (size_t)f->nmeta, sizeof *f->meta_by_key, by_key);
    for (int64_t i = 1; i < f->ntensors; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0)
            return attn__fail(ATTN_ERR_FORMAT, "safetensors header names tensor '%.*s' twice",
                              SHOWN, f->by_name[i]->name);
    for (int64_t i = 1; i < f->nmeta; i++)
        if (strcmp(f->meta_by_key[i - 1]->key, f->meta_by_key[i]->key) == 0)
            return attn__fail(ATTN_ERR_FORMAT,
                              "safetensors header: __metadata__ gives key '%.*s' twice", SHOWN,
                              f->meta_by_key[i]->key);
    return ATTN_OK;
}

static int by_offsets(const void *a, const void *b) {
    const st_entry *x = *(st_entry *const *)a, *y = *(st_entry *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return x->end < y->end ? -1 : x->end > y->end;
}

/* The format's rule, as its reference reader applies it: the tensors' data
 * tile the buffer, each starting where the one before ended and the last
 * ending at the buffer's end. Two tensors over the same bytes (one then
 * aliasing the other) or bytes no tensor owns make a malformed file. */
static attn_status check_coverage(const attn_safetensors *f) {
    if (f->ntensors == 0) {
        if (f->buffer_size == 0) return ATTN_OK;
        return attn__fail(ATTN_ERR_FORMAT,
                          "safetensors header names no tensor, but %llu data bytes follow it",
                          (unsigned long long)f->buffer_size);
    }
    st_entry **order = attn__alloc_array((size_t)f->ntensors, sizeof *order);
    if (order == NULL) return ATTN_ERR_NOMEM;
    memcpy(order, f->by_name, (size_t)f->ntensors * sizeof *order);
    qsort(order, (size_t)f->ntensors, sizeof *order, by_offsets);
    attn_status st = ATTN_OK;
    uint64_t at = 0;
    for (int64_t i = 0; i < f->ntensors && st == ATTN_OK; i++) {
        const st_entry *e = order[i];
        if (e->begin != at)
            st = attn__fail(ATTN_ERR_FORMAT,
                            "safetensors tensor '%.*s': data_offsets [%llu, %llu] begin %s byte "
                            "%llu, where the tensor before it ends (the tensors must tile the "
                            "data buffer, sharing and skipping no byte)",
                            SHOWN, e->name, (unsigned long long)e->begin,
                            (unsigned long long)e->end, e->begin < at ? "before" : "past",
                            (unsigned long long)at);
        at = e->end;
    }
    if (st == ATTN_OK && at != f->buffer_size)
        st = attn__fail(ATTN_ERR_FORMAT,
                        "safetensors data buffer is %llu bytes, but its tensors cover %llu (the "
                        "header does not account for the rest)",
                        (unsigned long long)f->buffer_size, (unsigned long long)at);
    attn__free(order);
    return st;
}

static const st_entry *find_entry(const attn_safetensors *f, const char *name) {
    if (f == NULL || name == NULL || f->ntensors == 0) return NULL;
    st_entry key = {.name = name}, *pkey = &key;
    st_entry **hit = bsearch(&pkey, f->by_name, (size_t)f->ntensors, sizeof *f->by_name, by_name);
    return hit != NULL ? *hit : NULL;
}

/* ---- open, parse, close ---- */

void attn_safetensors_close(attn_safetensors *f) {
    if (f == NULL) return;
    if (f->map != NULL) munmap(f->map, f->map_size);
    attn__free(f->owned);
    attn__free(f->tensors);
    attn__free(f->by_name);
    attn__free(f->meta);
    attn__free(f->meta_by_key);
    attn__free(f->arena);
    attn__free(f);
}

/* Parses bytes[0, size) into a new handle that borrows them. */
static attn_status build(const unsigned char *b, size_t size, attn_safetensors **out) {
    if (size < 8)
        return attn__fail(ATTN_ERR_FORMAT,
                          "not a safetensors file: %zu bytes, fewer than the 8 of its header "
                          "length",
                          size);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    if (n > MAX_HEADER)
        return attn__fail(ATTN_ERR_FORMAT,
                          "safetensors header length %llu exceeds the %d-byte limit (a "
                          "corrupt or foreign file)",
                          (unsigned long long)n, MAX_HEADER);
    if (n > size - 8)
        return attn__fail(ATTN_ERR_FORMAT,
                          "safetensors file truncated: a header of %llu bytes, only %zu present",
                          (unsigned long long)n, size - 8);
    attn_safetensors *f = attn__alloc_array(1, sizeof *f);
    if (f == NULL) return ATTN_ERR_NOMEM;
    f->buffer = b + 8 + n;
    f->buffer_size = size - 8 - n;
    f->arena_size = (size_t)n + 1;
    f->arena = attn__alloc(f->arena_size);
    attn_status st = f->arena == NULL ? ATTN_ERR_NOMEM : ATTN_OK;
    if (st == ATTN_OK) {
        parser ps = {b + 8, b + 8, b + 8 + n, f};
        st = parse_header(&ps);
    }
    if (st == ATTN_OK) st = index_names(f);
    if (st == ATTN_OK) st = check_coverage(f);
    if (st != ATTN_OK) {
        attn_safetensors_close(f);
        return st;
    }
    *out = f;
    return ATTN_OK;
}

attn_status attn_safetensors_parse(const void *bytes, size_t size, attn_safetensors **file) {
    attn__clear_error();
    if (file == NULL) return attn__fail_arg(ATTN_ERR_NULL, "file", "file is NULL");
    *file = NULL;
    if (bytes == NULL) return attn__fail_arg(ATTN_ERR_NULL, "bytes", "bytes is NULL");
    return build(bytes, size, file);
}

/* read(2) until n bytes; 0, an errno value, or -1 when the file ended. */
static int read_all(int fd, unsigned char *buf, size_t n) {
    while (n > 0) {
        ssize_t r = read(fd, buf, n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) return -1;
        buf += r;
        n -= (size_t)r;
    }
    return 0;
}

static attn_status open_file(const char *path, bool use_map, attn_safetensors **file) {
    char shown[ATTN__MESSAGE_PATH];
    /* O_NONBLOCK: opening a FIFO with no writer would wait forever; it is
     * refused below like any file that is not regular */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return attn__fail(ATTN_ERR_IO, "cannot open '%s': %s", attn__message_path(path, shown),
                          strerror(errno));
    struct stat info;
    const char *why = NULL;
    if (fstat(fd, &info) != 0)
        why = strerror(errno);
    else if (!S_ISREG(info.st_mode))
        why = "not a regular file";
    else if ((uint64_t)info.st_size > SIZE_MAX)
        why = "larger than this machine's address space";
    if (why != NULL) {
        close(fd);
        return attn__fail(ATTN_ERR_IO, "cannot read '%s': %s", attn__message_path(path, shown),
                          why);
    }
    const size_t size = (size_t)info.st_size;
    void *map = NULL, *owned = NULL;
    if (use_map && size >= 8) {
        map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (map == MAP_FAILED) map = NULL; /* read it instead */
    }
    attn_status st = ATTN_OK;
    if (map == NULL) {
        /* The file's own size bounds the allocation. */
        owned = attn__alloc(size > 0 ? size : 1);
        int err = owned == NULL ? 0 : read_all(fd, owned, size);
        if (owned == NULL)
            st = ATTN_ERR_NOMEM;
        else if (err != 0)
            st = attn__fail(ATTN_ERR_IO, "cannot read '%s': %s", attn__message_path(path, shown),
                            err < 0 ? "the file shrank while it was read" : strerror(err));
    }
    close(fd);
    if (st == ATTN_OK) st = build(map != NULL ? map : owned, size, file);
    if (st != ATTN_OK) {
        if (map != NULL) munmap(map, size);
        attn__free(owned);
        if (st == ATTN_ERR_FORMAT) { /* "PATH: " before what is wrong */
            attn__prefix_error(st, ": ");
            attn__prefix_error(st, attn__message_path(path, shown));
        }
        return st;
    }
    (*file)->map = map;
    (*file)->map_size = size;
    (*file)->owned = owned;
    return ATTN_OK;
}

static attn_status open_checked(const char *path, bool use_map, attn_safetensors **file) {
    attn__clear_error();
    if (file == NULL) return attn__fail_arg(ATTN_ERR_NULL, "file", "file is NULL");
    *file = NULL;
    if (path == NULL) return attn__fail_arg(ATTN_ERR_NULL, "path", "path is NULL");
    return open_file(path, use_map, file);
}

attn_status attn_safetensors_open(const char *path, attn_safetensors **file) {
    return open_checked(path, true, file);
}

attn_status attn__safetensors_open_read(const char *path, attn_safetensors **file) {
    return open_checked(path, false, file);
}

/* ---- the listing ---- */

int64_t attn_safetensors_count(const attn_safetensors *f) { return f == NULL ? 0 : f->ntensors; }

attn_status attn_safetensors_info(const attn_safetensors *f, int64_t index, const char **name,
                                  const char **file_dtype, attn_dtype *dtype, int *rank,
                                  int64_t shape[ATTN_MAX_RANK]) {
    attn__clear_error();
    if (f == NULL) return attn__fail_arg(ATTN_ERR_NULL, "file", "file is NULL");
    if (index < 0 || index >= f->ntensors)
        return attn__fail_arg(ATTN_ERR_INVALID, "index",
                              "index %lld is outside 0..%lld (the file holds %lld tensors)",
                              (long long)index, (long long)f->ntensors - 1,
                              (long long)f->ntensors);
    const st_entry *e = &f->tensors[index];
    if (name != NULL) *name = e->name;
    if (file_dtype != NULL) *file_dtype = e->dtype->name;
    if (dtype != NULL) *dtype = e->dtype->dtype;
    if (rank != NULL) *rank = e->rank;
    if (shape != NULL)
        memcpy(shape, e->shape,
               sizeof(int64_t) * (size_t)(e->rank < ATTN_MAX_RANK ? e->rank : ATTN_MAX_RANK));
    return ATTN_OK;
}

int64_t attn_safetensors_find(const attn_safetensors *f, const char *name) {
    const st_entry *e = find_entry(f, name);
    return e != NULL ? e - f->tensors : -1;
}

int64_t attn_safetensors_metadata_count(const attn_safetensors *f) {
    return f == NULL ? 0 : f->nmeta;
}

attn_status attn_safetensors_metadata_at(const attn_safetensors *f, int64_t index,
                                         const char **key, const char **value) {
    attn__clear_error();
    if (f == NULL) return attn__fail_arg(ATTN_ERR_NULL, "file", "file is NULL");
    if (index < 0 || index >= f->nmeta)
        return attn__fail_arg(ATTN_ERR_INVALID, "index",
                              "index %lld is outside 0..%lld (the file has %lld metadata pairs)",
                              (long long)index, (long long)f->nmeta - 1, (long long)f->nmeta);
    if (key != NULL) *key = f->meta[index].key;
    if (value != NULL) *value = f->meta[index].value;
    return ATTN_OK;
}

const char *attn_safetensors_metadata(const attn_safetensors *f, const char *key) {
    if (f == NULL || key == NULL || f->nmeta == 0) return NULL;
    st_pair k = {key, NULL}, *pk = &k;
    st_pair **hit = bsearch(&pk, f->meta_by_key, (size_t)f->nmeta, sizeof *f->meta_by_key, by_key);
    return hit != NULL ? (*hit)->value : NULL;
}

/* ---- views of the tensors ---- */

/* The entry called `name`, or the error naming what is missing. */
static attn_status lookup(const attn_safetensors *f, const char *name, const st_entry **e) {
    if (f == NULL) return attn__fail_arg(ATTN_ERR_NULL, "file", "file is NULL");
    if (name == NULL) return attn__fail_arg(ATTN_ERR_NULL, "name", "name is NULL");
    *e = find_entry(f, name);
    if (*e == NULL)
        return attn__fail_arg(ATTN_ERR_INVALID, "name", "the file has no tensor '%.*s'", SHOWN,
                              name);
    return ATTN_OK;
}

/* An entry attn can hold in a tensor: a dtype attn has, rank <= 8. */
static attn_status tensor_entry(const st_entry *e, const char *use) {
    if (e->dtype->dtype == 0)
        return attn__fail_arg(ATTN_ERR_DTYPE, "name",
                              "tensor '%.*s' is %s, a dtype attn does not %s (it reads F32, F64, "
                              "F16, BF16 and BOOL); attn_safetensors_raw gives its bytes",
                              SHOWN, e->name, e->dtype->name, use);
    if (e->rank > ATTN_MAX_RANK)
        return attn__fail_arg(ATTN_ERR_SHAPE, "name",
                              "tensor '%.*s' has %d dimensions; attn tensors have at most %d",
                              SHOWN, e->name, e->rank, ATTN_MAX_RANK);
    return ATTN_OK;
}

/* A C-contiguous description of entry e over `data`. */
static void c_view(const st_entry *e, attn_dtype dtype, void *data, attn_tensor *t) {
    memset(t, 0, sizeof *t);
    t->data = data;
    t->dtype = dtype;
    t->rank = e->rank;
    int64_t stride = 1;
    for (int d = e->rank - 1; d >= 0; d--) {
        t->shape[d] = e->shape[d];
        t->strides[d] = stride;
        stride *= e->shape[d] > 0 ? e->shape[d] : 1;
    }
}

static bool little_endian(void) { return *(const unsigned char *)&(uint16_t){1} == 1; }

attn_status attn_safetensors_get(const attn_safetensors *f, const char *name, attn_tensor *view) {
    attn__clear_error();
    if (view == NULL) return attn__fail_arg(ATTN_ERR_NULL, "view", "view is NULL");
    memset(view, 0, sizeof *view);
    const st_entry *e;
    attn_status st = lookup(f, name, &e);
    if (st == ATTN_OK) st = tensor_entry(e, "view");
    if (st != ATTN_OK) return st;
    const unsigned char *data = f->buffer + e->begin;
    const size_t es = attn_dtype_size(e->dtype->dtype);
    if (es > 1 && !little_endian())
        return attn__fail_arg(ATTN_ERR_UNSUPPORTED, "name",
                              "tensor '%.*s': this machine is big-endian and the file "
                              "little-endian; attn_safetensors_read converts",
                              SHOWN, e->name);
    if ((uintptr_t)data % es != 0)
        return attn__fail_arg(ATTN_ERR_UNSUPPORTED, "name",
                              "tensor '%.*s' is not aligned to its %zu-byte elements in the file "
                              "(data_offsets begin at %llu); attn_safetensors_read copies it",
                              SHOWN, e->name, es, (unsigned long long)e->begin);
    c_view(e, e->dtype->dtype, (void *)data, view);
    return ATTN_OK;
}

attn_status attn_safetensors_raw(const attn_safetensors *f, const char *name,
                                 const void **bytes, uint64_t *size) {
    attn__clear_error();
    if (bytes == NULL || size == NULL)
        return attn__fail_arg(ATTN_ERR_NULL, bytes == NULL ? "bytes" : "size", "%s is NULL",
                              bytes == NULL ? "bytes" : "size");
    *bytes = NULL;
    *size = 0;
    const st_entry *e;
    attn_status st = lookup(f, name, &e);
    if (st != ATTN_OK) return st;
    *bytes = f->buffer + e->begin;
    *size = e->end - e->begin;
    return ATTN_OK;
}

/* ---- conversion ---- */

static uint16_t le16(const unsigned char *p) { return (uint16_t)(p[0] | p[1] << 8); }
static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const unsigned char *p) { return (uint64_t)le32(p + 4) << 32 | le32(p); }

/* Element i of the stored data as a double (float dtypes only). */
static double stored_value(attn_dtype from, const unsigned char *src) {
    switch (from) {
    case ATTN_DTYPE_F64: {
        uint64_t bits = le64(src);
        double d;
        memcpy(&d, &bits, sizeof d);
        return d;
    }
    case ATTN_DTYPE_F32: return (double)attn__bits_to_float(le32(src));
    case ATTN_DTYPE_F16: return (double)attn__f16_to_float(le16(src));
    case ATTN_DTYPE_BF16: return (double)attn__bf16_to_float(le16(src));
    case ATTN_DTYPE_BOOL: return src[0] != 0;
    case ATTN_DTYPE_I32: return (double)(int32_t)le32(src);
    }
    return __builtin_nan("");
}

/* One element from the file's bytes to dst (dtype to) at `at` elements. */
static void convert_one(attn_dtype from, attn_dtype to, const unsigned char *src,
                        unsigned char *dst) {
    if (from == to) { /* the same bits, in native order; bool as 0/1 */
        switch (attn_dtype_size(to)) {
        case 1: dst[0] = src[0] != 0; return;
        case 2: {
            uint16_t v = le16(src);
            memcpy(dst, &v, 2);
            return;
        }
        case 4: {
            uint32_t v = le32(src);
            memcpy(dst, &v, 4);
            return;
        }
        default: {
            uint64_t v = le64(src);
            memcpy(dst, &v, 8);
            return;
        }
        }
    }
    const double x = stored_value(from, src);
    if (to == ATTN_DTYPE_F32) {
        /* 16-bit floats straight to float: through double, a signaling NaN
         * would come back quieted. */
        const float v = from == ATTN_DTYPE_F16    ? attn__f16_to_float(le16(src))
                        : from == ATTN_DTYPE_BF16 ? attn__bf16_to_float(le16(src))
                                                  : (float)x;
        memcpy(dst, &v, 4);
    } else {
        memcpy(dst, &x, 8);
    }
}

static bool convertible(attn_dtype from, attn_dtype to) {
    return to == from || ((to == ATTN_DTYPE_F32 || to == ATTN_DTYPE_F64) &&
                          (attn__is_float(from) || attn__is_half(from)));
}

/* Entry e's elements, in C order, into dst (checked: its shape, a dtype
 * convertible to, any non-overlapping strides). */
static void convert(const attn_safetensors *f, const st_entry *e, const attn_tensor *dst) {
    const unsigned char *src = f->buffer + e->begin;
    const attn_dtype from = e->dtype->dtype;
    const size_t ses = attn_dtype_size(from), des = attn_dtype_size(dst->dtype);
    int64_t idx[ATTN_MAX_RANK] = {0}, off = 0;
    for (int64_t i = 0; i < e->numel; i++) {
        convert_one(from, dst->dtype, src + (size_t)i * ses,
                    (unsigned char *)dst->data + off * (int64_t)des);
        for (int d = dst->rank - 1; d >= 0; d--) { /* next index, offset kept in step */
            off += dst->strides[d];
            if (++idx[d] < dst->shape[d]) break;
            off -= dst->strides[d] * idx[d];
            idx[d] = 0;
        }
    }
}

/* Whether entry e can be converted to `to`; the message names the tensor. */
static attn_status check_conversion(const st_entry *e, attn_dtype to, const char *arg) {
    const attn_dtype from = e->dtype->dtype;
    if (convertible(from, to)) return ATTN_OK;
    /* what convertible() allows, each dtype named once */
    const bool wide = attn__is_float(from), half = attn__is_half(from);
    return attn__fail_arg(ATTN_ERR_DTYPE, arg, "tensor '%.*s' is %s; it converts to %s%s, not to %s",
                          SHOWN, e->name, e->dtype->name, wide ? "" : attn_dtype_name(from),
                          wide ? "float32 or float64" : half ? ", float32 or float64" : " only",
                          attn_dtype_name(to));
}

attn_status attn_safetensors_read_into(const attn_safetensors *f, const char *name,
                                       const attn_tensor *dst) {
    attn__clear_error();
    const st_entry *e;
    int64_t numel = 0;
    attn_status st = lookup(f, name, &e);
    if (st == ATTN_OK) st = tensor_entry(e, "read");
    if (st == ATTN_OK) st = attn__st_check_view(dst, "dst", ATTN__OUTPUT, &numel);
    if (st != ATTN_OK) return st;
    bool same = dst->rank == e->rank;
    for (int d = 0; same && d < e->rank; d++) same = dst->shape[d] == e->shape[d];
    if (!same) {
        char want[160], got[160];
        return attn__fail_arg(ATTN_ERR_SHAPE, "dst", "dst has shape %s; tensor '%.*s' has %s",
                              attn__shape_str(got, sizeof got, dst->rank, dst->shape), SHOWN,
                              e->name, attn__shape_str(want, sizeof want, e->rank, e->shape));
    }
    if ((st = check_conversion(e, dst->dtype, "dst")) != ATTN_OK) return st;
    convert(f, e, dst);
    return ATTN_OK;
}

attn_status attn_safetensors_read(const attn_safetensors *f, const char *name, attn_dtype to,
                                  attn_tensor *out) {
    attn__clear_error();
    if (out == NULL) return attn__fail_arg(ATTN_ERR_NULL, "out", "out is NULL");
    memset(out, 0, sizeof *out);
    const st_entry *e;
    attn_status st = lookup(f, name, &e);
    if (st == ATTN_OK) st = tensor_entry(e, "read");
    if (st != ATTN_OK) return st;
    if (to == 0) to = e->dtype->dtype;
    if (attn_dtype_size(to) == 0)
        return attn__fail_arg(ATTN_ERR_DTYPE, "to", "to is an unknown dtype code %d", (int)to);
    if ((st = check_conversion(e, to, "to")) != ATTN_OK) return st;
    void *data = attn__alloc_array((size_t)e->numel, attn_dtype_size(to));
    if (data == NULL) return ATTN_ERR_NOMEM;
    c_view(e, to, data, out);
    convert(f, e, out);
    return ATTN_OK;
}

void attn_safetensors_free(attn_tensor *t) { attn_npy_free(t); }

/* ---- the views the safetensors calls take ---- */

attn_status attn__st_check_view(const attn_tensor *t, const char *name, attn__role role,
                                int64_t *numel) {
    if (t == NULL) return attn__fail_arg(ATTN_ERR_NULL, name, "%s is NULL", name);
    if (t->rank < 0 || t->rank > ATTN_MAX_RANK)
        return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s has rank %d; expected 0 to %d", name,
                              t->rank, ATTN_MAX_RANK);
    if (attn_dtype_size(t->dtype) == 0)
        return attn__fail_arg(ATTN_ERR_DTYPE, name, "%s has an unknown dtype code %d", name,
                              (int)t->dtype);
    int64_t nonzero = 1; /* the parser's rule (parse_shape): zeros aside, in any order */
    bool empty = false;
    for (int d = 0; d < t->rank; d++) {
        if (t->shape[d] < 0)
            return attn__fail_arg(ATTN_ERR_SHAPE, name, "%s.shape[%d] is %lld; it must be >= 0",
                                  name, d, (long long)t->shape[d]);
        if (attn__mul_overflows(nonzero, t->shape[d] > 0 ? t->shape[d] : 1, &nonzero))
            return attn__fail_arg(ATTN_ERR_OVERFLOW, name,
                                  "%s: its dimensions' product overflows 64 bits", name);
        empty = empty || t->shape[d] == 0;
    }
    *numel = empty ? 0 : nonzero;
    if (*numel == 0) return ATTN_OK; /* nothing is read or written */
    if (t->rank == 0)
        return t->data != NULL ? ATTN_OK
                               : attn__fail_arg(ATTN_ERR_NULL, name, "%s->data is NULL", name);
    attn_status st = attn__check_tensor(t, name, 1, role);
    if (st == ATTN_OK && role == ATTN__OUTPUT) st = attn__check_output_layout(t, name);
    return st;
}
