/* modifiers.c — the score modifier options and int32 index files (see
 * modifiers.h). */
#include "modifiers.h"

#include <ctype.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

bool cli_modifier_takes_value(const char *opt) {
    return strcmp(opt, "--window") == 0 || strcmp(opt, "--alibi-slopes") == 0 ||
           strcmp(opt, "--softcap") == 0 || strcmp(opt, "--sinks") == 0;
}

/* One side of --window: a decimal integer >= -1, ending at `stop`. */
static bool parse_side(const char *s, char stop, const char **next, int64_t *out) {
    if (isspace((unsigned char)*s) || *s == '+') return false; /* strtoll would skip them */
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != stop || errno != 0 || v < -1) return false;
    *out = (int64_t)v;
    *next = end;
    return true;
}

/* "L,R" into the window fields. */
static bool parse_window(const char *s, attn_sdpa_params *p) {
    const char *comma, *end;
    int64_t left, right;
    if (!parse_side(s, ',', &comma, &left) || !parse_side(comma + 1, '\0', &end, &right))
        return false;
    p->window_left = left;
    p->window_right = right;
    return true;
}

int cli_modifier_option(const char *opt, const char *val, attn_sdpa_params *p,
                        cli_modifiers *m, char *why, size_t why_size) {
    if (strcmp(opt, "--window") == 0) {
        if (parse_window(val, p)) return 1;
        snprintf(why, why_size,
                 "--window: '%s' is not L,R with each an integer >= 0, or -1 (unbounded)", val);
        return -1;
    }
    if (strcmp(opt, "--softcap") == 0) {
        if (cli_parse_double(val, &p->softcap) && p->softcap >= 0) return 1;
        snprintf(why, why_size, "--softcap: '%s' is not a finite number >= 0 (0: no capping)",
                 val);
        return -1;
    }
    if (strcmp(opt, "--alibi-slopes") == 0) {
        m->alibi_path = val;
        return 1;
    }
    if (strcmp(opt, "--sinks") == 0) {
        m->sinks_path = val;
        return 1;
    }
    return 0;
}

/* One float file; the library checks its shape and dtype against the call. */
static int load_float(const char *option, const char *path, attn_tensor *t) {
    char what[48];
    snprintf(what, sizeof what, "reading %s", option);
    attn_status st = attn_npy_load(path, t);
    return st == ATTN_OK ? CLI_OK : cli_fail(what, st);
}

int cli_modifiers_load(cli_modifiers *m, attn_sdpa_params *p) {
    if (m->alibi_path != NULL) {
        if (load_float("--alibi-slopes", m->alibi_path, &m->alibi) != CLI_OK) return CLI_RUNTIME;
        p->alibi_slopes = &m->alibi;
    }
    if (m->sinks_path != NULL) {
        if (load_float("--sinks", m->sinks_path, &m->sinks) != CLI_OK) return CLI_RUNTIME;
        p->sinks = &m->sinks;
    }
    return CLI_OK;
}

int cli_modifiers_inputs(const cli_modifiers *m) {
    const int rc = outputs_input("--alibi-slopes", m->alibi_path);
    return rc == CLI_OK ? outputs_input("--sinks", m->sinks_path) : rc;
}

void cli_modifiers_free(cli_modifiers *m) {
    attn_npy_free(&m->alibi);
    attn_npy_free(&m->sinks);
}

/* ---- int32 index files ---- */

/* The largest index file read: far above any real one (a block table of
 * 1,000 sequences of 1,000 blocks is 4 MB). */
#define MAX_INDEX_FILE ((size_t)1 << 30)

/* Reads a whole file into a new buffer (pipes too: no size is trusted);
 * NULL with errno set (EFBIG above MAX_INDEX_FILE). */
static unsigned char *read_file(const char *path, size_t *size) {
    FILE *f = cli_open_input(path);
    if (f == NULL) return NULL;
    unsigned char *buf = NULL;
    size_t used = 0, cap = 0;
    int err = 0;
    while (err == 0) {
        if (used == cap) {
            const size_t want = cap ? 2 * cap : 4096;
            unsigned char *grown = want <= MAX_INDEX_FILE ? realloc(buf, want) : NULL;
            if (grown == NULL) {
                err = want <= MAX_INDEX_FILE ? ENOMEM : EFBIG;
                break;
            }
            buf = grown;
            cap = want;
        }
        const size_t got = fread(buf + used, 1, cap - used, f);
        used += got;
        if (got == 0) {
            if (ferror(f)) err = EIO;
            break;
        }
    }
    fclose(f);
    if (err != 0) {
        free(buf);
        errno = err;
        return NULL;
    }
    *size = used;
    return buf;
}

/* Where the value of `key` begins in a .npy header, or NULL: the key in
 * either quote, then blanks and the colon, as NumPy's header parser (a
 * Python literal) allows ("descr" and tabs were refused once). Only the
 * header is searched (it ends at the first newline). */
static unsigned char *header_value(unsigned char *buf, size_t size, const char *key) {
    const size_t n = strlen(key);
    for (size_t i = 0; i + n + 2 < size && buf[i] != '\n'; i++) {
        if ((buf[i] != '\'' && buf[i] != '"') || memcmp(buf + i + 1, key, n) != 0 ||
            buf[i + n + 1] != buf[i])
            continue;
        size_t j = i + n + 2;
        while (j < size && (buf[j] == ' ' || buf[j] == '\t' || buf[j] == ':')) j++;
        return j < size ? buf + j : NULL;
    }
    return NULL;
}

/* The descr's value in a .npy header ('<i4'): where its type letter is,
 * or NULL. */
static unsigned char *descr_type(unsigned char *buf, size_t size) {
    unsigned char *v = header_value(buf, size, "descr");
    if (v == NULL || v + 4 >= buf + size || (v[0] != '\'' && v[0] != '"')) return NULL;
    return v + 2;
}

/* Whether a .npy header's shape is () (a 0-d array, which the library's
 * parser reads as shape (1,)). */
static bool shape_is_empty(unsigned char *buf, size_t size) {
    const unsigned char *v = header_value(buf, size, "shape"), *end = buf + size;
    if (v == NULL || *v != '(') return false;
    for (v++; v < end && (*v == ' ' || *v == '\t'); v++) {
    }
    return v < end && *v == ')';
}

/* Narrows an int64 tensor (read as float64 bits) to a new int32 one. */
static int narrow_int64(const char *option, const char *path, attn_tensor *t) {
    const int64_t n = attn_tensor_numel(t);
    int32_t *dst = attn_alloc((size_t)n * sizeof *dst);
    if (dst == NULL) return cli_fail("allocating an index tensor", ATTN_ERR_NOMEM);
    const unsigned char *src = t->data;
    for (int64_t i = 0; i < n; i++) {
        int64_t x;
        memcpy(&x, src + (size_t)i * sizeof x, sizeof x);
        if (x < INT32_MIN || x > INT32_MAX) {
            fprintf(stderr, "attn: reading %s: '%s' holds %lld, which does not fit in int32\n",
                    option, path, (long long)x);
            attn_free(dst);
            return CLI_RUNTIME;
        }
        dst[i] = (int32_t)x;
    }
    attn_free(t->data);
    t->data = dst;
    t->dtype = ATTN_DTYPE_I32;
    return CLI_OK;
}

/* attn_npy_load reads float32, float64 and bool only. An int32 or int64
 * .npy is read by the library's own parser all the same: its descr ('<i4',
 * '<i8') is renamed in memory to the float of the same size ('<f4', '<f8'),
 * which attn_npy_parse copies bit for bit (byte-swapping and reordering a
 * Fortran array move bytes, never values), and the bits are then taken as
 * the integers they are. */
static int load_integers(const char *option, const char *path, attn_tensor *t) {
    size_t size = 0;
    unsigned char *buf = read_file(path, &size);
    if (buf == NULL) {
        fprintf(stderr, "attn: reading %s: cannot read '%s': %s\n", option, path,
                strerror(errno));
        return CLI_RUNTIME;
    }
    unsigned char *type = descr_type(buf, size);
    /* exactly '<i4', '>i4', '<i8' or '>i8' (in either quote): '|i4' has no
     * byte order and '<i44' is no integer; both were read as the float
     * they became below, and NumPy's wording of a broken file then named
     * a float */
    const bool integer = type != NULL && (type[-1] == '<' || type[-1] == '>') &&
                         type[0] == 'i' && (type[1] == '4' || type[1] == '8') &&
                         type[2] == type[-2];
    if (!integer) {
        free(buf);
        fprintf(stderr, "attn: reading %s: '%s' is not an int32 or int64 .npy array (index "
                "files are int32, as FlashAttention takes them)\n", option, path);
        return CLI_RUNTIME;
    }
    if (shape_is_empty(buf, size)) { /* an index array has a rank: () is no (1,) */
        free(buf);
        fprintf(stderr, "attn: reading %s: '%s' holds a 0-d array; index files are 1-d "
                "(a block table 2-d)\n", option, path);
        return CLI_RUNTIME;
    }
    const bool wide = type[1] == '8';
    type[0] = 'f';
    attn_status st = attn_npy_parse(buf, size, t);
    free(buf);
    if (st != ATTN_OK) {
        char what[4160]; /* a path of up to 4,096 bytes and the option */
        snprintf(what, sizeof what, "reading %s '%s'", option, path);
        return cli_fail(what, st);
    }
    if (wide) return narrow_int64(option, path, t);
    t->dtype = ATTN_DTYPE_I32;
    return CLI_OK;
}

int cli_load_index(const char *option, const char *path, attn_tensor *t) {
    /* A library that reads int32 .npy files itself is asked first. */
    attn_status st = attn_npy_load(path, t);
    if (st == ATTN_OK && t->dtype == ATTN_DTYPE_I32) return CLI_OK;
    if (st == ATTN_OK) {
        fprintf(stderr, "attn: reading %s: '%s' holds %s; index files are int32 (or int64)\n",
                option, path, attn_dtype_name(t->dtype));
        attn_npy_free(t);
        return CLI_RUNTIME;
    }
    if (st != ATTN_ERR_DTYPE) {
        char what[48];
        snprintf(what, sizeof what, "reading %s", option);
        return cli_fail(what, st);
    }
    return load_integers(option, path, t);
}
