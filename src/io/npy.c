/*
 * npy.c — NumPy .npy files (format versions 1.0, 2.0, 3.0).
 *
 * The parser trusts nothing: every length is checked against the bytes
 * actually present before it is used, the header dictionary is parsed by a
 * small grammar (not by searching for substrings), and any surprise is an
 * ATTN_ERR_FORMAT with the offending detail in the message.
 *
 *   "\x93NUMPY" major minor  header_len (u16 LE for 1.x, u32 LE for 2.x/3.x)
 *   header: a Python dict literal {'descr': '<f4', 'fortran_order': False,
 *           'shape': (3, 4), } padded with spaces and ended by '\n'
 *   data:   numel * itemsize bytes
 */
#define _POSIX_C_SOURCE 200809L /* fstat, fileno, pread */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "io.h"

enum {
    MAGIC_LEN = 6,
    MAX_HEADER = 1 << 20 /* far more than any array attn reads needs */
};

typedef attn__npy_header npy_info; /* data_offset: set by the readers */

/* ---- header dictionary grammar ---- */

typedef struct cursor {
    const char *p, *end;
} cursor;

static void skip_space(cursor *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

static bool accept(cursor *c, char ch) {
    skip_space(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return true;
    }
    return false;
}

/* A quoted string ('...' or "...", no escapes needed for our keys/values). */
static bool parse_string(cursor *c, char *out, size_t size) {
    skip_space(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return false;
    char quote = *c->p++;
    size_t n = 0;
    while (c->p < c->end && *c->p != quote) {
        if (*c->p == '\\' || n + 1 >= size) return false;
        out[n++] = *c->p++;
    }
    if (c->p >= c->end) return false;
    c->p++;
    out[n] = '\0';
    return true;
}

static bool parse_word(cursor *c, const char *word) {
    skip_space(c);
    size_t n = strlen(word);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, word, n) != 0) return false;
    c->p += n;
    return true;
}

static attn_status parse_shape(cursor *c, npy_info *info) {
    if (!accept(c, '(')) return attn__fail(ATTN_ERR_FORMAT, ".npy header: 'shape' is not a tuple");
    info->rank = 0;
    for (;;) {
        skip_space(c);
        if (accept(c, ')')) break;
        if (c->p >= c->end || *c->p < '0' || *c->p > '9')
            return attn__fail(ATTN_ERR_FORMAT,
                              ".npy header: 'shape' holds something other than "
                              "non-negative integers");
        int64_t v = 0;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
            if (attn__mul_overflows(v, 10, &v) || attn__add_overflows(v, *c->p - '0', &v))
                return attn__fail(ATTN_ERR_FORMAT, ".npy header: a dimension overflows 64 bits");
            c->p++;
        }
        if (c->p < c->end && (*c->p == 'L' || *c->p == 'l')) c->p++; /* Python 2 longs */
        if (info->rank == ATTN_MAX_RANK)
            return attn__fail(ATTN_ERR_SHAPE, ".npy array has more than %d dimensions",
                              ATTN_MAX_RANK);
        info->shape[info->rank++] = v;
        if (accept(c, ')')) break;
        if (!accept(c, ','))
            return attn__fail(ATTN_ERR_FORMAT, ".npy header: malformed 'shape' tuple");
    }
    return ATTN_OK;
}

static attn_status parse_descr(const char *d, npy_info *info) {
    char order = d[0];
    const char *type = d + 1;
    if (order != '<' && order != '>' && order != '|' && order != '=')
        return attn__fail(ATTN_ERR_FORMAT, ".npy header: descr '%s' has no byte-order mark", d);
    if (strcmp(type, "f4") == 0)
        info->dtype = ATTN_DTYPE_F32;
    else if (strcmp(type, "f8") == 0)
        info->dtype = ATTN_DTYPE_F64;
    else if (strcmp(type, "f2") == 0)
        info->dtype = ATTN_DTYPE_F16;
    else if (strcmp(type, "b1") == 0)
        info->dtype = ATTN_DTYPE_BOOL;
    else /* NumPy has no bfloat16: its files (ml_dtypes') carry an opaque '<V2' */
        return attn__fail(ATTN_ERR_DTYPE,
                          ".npy dtype '%s' is not supported; attn reads float32 ('<f4'), "
                          "float64 ('<f8'), float16 ('<f2') and bool ('|b1')",
                          d);
    if (info->dtype != ATTN_DTYPE_BOOL && order == '|')
        return attn__fail(ATTN_ERR_FORMAT, ".npy header: descr '%s' needs a byte order", d);
    const uint16_t probe = 1;
    bool native_big = *(const unsigned char *)&probe == 0;
    info->big_endian = order == '>' || (order == '=' && native_big);
    return ATTN_OK;
}

static attn_status parse_header_dict(const char *text, size_t len, npy_info *info) {
    cursor c = {text, text + len};
    bool have_descr = false, have_order = false, have_shape = false;
    if (!accept(&c, '{')) return attn__fail(ATTN_ERR_FORMAT, ".npy header is not a dictionary");
    for (;;) {
        if (accept(&c, '}')) break;
        char key[32], value[32];
        if (!parse_string(&c, key, sizeof key) || !accept(&c, ':'))
            return attn__fail(ATTN_ERR_FORMAT, ".npy header: expected a quoted key and ':'");
        attn_status st;
        if (strcmp(key, "descr") == 0 && !have_descr) {
            if (!parse_string(&c, value, sizeof value))
                return attn__fail(ATTN_ERR_FORMAT,
                                  ".npy header: 'descr' is not a simple type string "
                                  "(structured arrays are not supported)");
            if ((st = parse_descr(value, info)) != ATTN_OK) return st;
            have_descr = true;
        } else if (strcmp(key, "fortran_order") == 0 && !have_order) {
            if (parse_word(&c, "True"))
                info->fortran = true;
            else if (parse_word(&c, "False"))
                info->fortran = false;
            else
                return attn__fail(ATTN_ERR_FORMAT,
                                  ".npy header: 'fortran_order' is not True or False");
            have_order = true;
        } else if (strcmp(key, "shape") == 0 && !have_shape) {
            if ((st = parse_shape(&c, info)) != ATTN_OK) return st;
            have_shape = true;
        } else {
            return attn__fail(ATTN_ERR_FORMAT, ".npy header: unexpected or repeated key '%s'",
                              key);
        }
        if (accept(&c, '}')) break;
        if (!accept(&c, ','))
            return attn__fail(ATTN_ERR_FORMAT, ".npy header: expected ',' or '}' after '%s'",
                              key);
    }
    skip_space(&c);
    if (c.p != c.end)
        return attn__fail(ATTN_ERR_FORMAT, ".npy header: unexpected text after the dictionary");
    if (!have_descr || !have_order || !have_shape)
        return attn__fail(ATTN_ERR_FORMAT, ".npy header lacks '%s'",
                          !have_descr ? "descr" : !have_order ? "fortran_order" : "shape");
    info->numel = 1;
    for (int d = 0; d < info->rank; d++) {
        if (info->shape[d] == 0)
            return attn__fail(ATTN_ERR_SHAPE,
                              ".npy array is empty (shape[%d] is 0); attn needs every "
                              "dimension >= 1",
                              d);
        if (attn__mul_overflows(info->numel, info->shape[d], &info->numel) ||
            attn__mul_overflows(info->numel, 8, &(int64_t){0}))
            return attn__fail(ATTN_ERR_FORMAT, ".npy shape overflows 64 bits");
    }
    return ATTN_OK;
}

/* Parses the preamble in bytes[0, size). On success *data_offset is where the
 * array data starts. Needs only the preamble, not the data. */
static attn_status parse_preamble(const unsigned char *b, size_t size, npy_info *info,
                                  size_t *data_offset) {
    memset(info, 0, sizeof *info);
    if (size < MAGIC_LEN + 2 || memcmp(b, "\x93NUMPY", MAGIC_LEN) != 0)
        return attn__fail(ATTN_ERR_FORMAT, "not a .npy file (the magic string is missing)");
    unsigned major = b[6], minor = b[7];
    size_t len_bytes = major == 1 ? 2 : 4;
    if (major < 1 || major > 3 || minor != 0)
        return attn__fail(ATTN_ERR_FORMAT, ".npy format version %u.%u is not supported (1.0-3.0)",
                          major, minor);
    if (size < 8 + len_bytes) return attn__fail(ATTN_ERR_FORMAT, ".npy file truncated in its header");
    size_t hlen = (size_t)b[8] | (size_t)b[9] << 8;
    if (len_bytes == 4) hlen |= (size_t)b[10] << 16 | (size_t)b[11] << 24;
    size_t start = 8 + len_bytes;
    if (hlen > MAX_HEADER)
        return attn__fail(ATTN_ERR_FORMAT, ".npy header length %zu exceeds the %d-byte limit",
                          hlen, MAX_HEADER);
    if (hlen > size - start)
        return attn__fail(ATTN_ERR_FORMAT,
                          ".npy file truncated: header of %zu bytes, only %zu present", hlen,
                          size - start);
    const char *text = (const char *)b + start;
    if (hlen == 0 || text[hlen - 1] != '\n')
        return attn__fail(ATTN_ERR_FORMAT, ".npy header does not end with a newline");
    for (size_t i = 0; i < hlen; i++)
        if (text[i] == '\0')
            return attn__fail(ATTN_ERR_FORMAT, ".npy header contains a NUL byte");
    attn_status st = parse_header_dict(text, hlen, info);
    if (st != ATTN_OK) return st;
    *data_offset = start + hlen;
    return ATTN_OK;
}

/* Fills t (C order, native endian) from the raw data bytes. */
static attn_status decode_data(const npy_info *info, const unsigned char *raw, attn_tensor *t) {
    int64_t shape[ATTN_MAX_RANK] = {1};
    int rank = info->rank == 0 ? 1 : info->rank;
    if (info->rank > 0) memcpy(shape, info->shape, sizeof(int64_t) * (size_t)rank);
    size_t es = attn_dtype_size(info->dtype);
    void *data = attn__alloc_array((size_t)info->numel, es);
    if (data == NULL) return ATTN_ERR_NOMEM;
    attn_status st = attn_tensor_init(t, data, info->dtype, rank, shape);
    if (st != ATTN_OK) {
        attn__free(data);
        return st;
    }
    /* Source element i (file order) goes to destination index dst: the same
     * for C order, the transposed position for Fortran order. */
    int64_t idx[ATTN_MAX_RANK] = {0};
    unsigned char *out = data;
    for (int64_t i = 0; i < info->numel; i++) {
        int64_t dst = i;
        if (info->fortran && rank > 1) {
            dst = 0;
            for (int d = 0; d < rank; d++) dst += idx[d] * t->strides[d];
            for (int d = 0; d < rank; d++) { /* Fortran order: first index fastest */
                if (++idx[d] < shape[d]) break;
                idx[d] = 0;
            }
        }
        const unsigned char *src = raw + (size_t)i * es;
        unsigned char *to = out + (size_t)dst * es;
        if (info->dtype == ATTN_DTYPE_BOOL)
            to[0] = src[0] != 0;
        else if (info->big_endian != (*(const unsigned char *)&(uint16_t){1} == 0))
            for (size_t k = 0; k < es; k++) to[k] = src[es - 1 - k];
        else
            memcpy(to, src, es);
    }
    return ATTN_OK;
}

attn_status attn_npy_parse(const void *bytes, size_t size, attn_tensor *out) {
    attn__clear_error();
    if (out == NULL) return attn__fail(ATTN_ERR_NULL, "out is NULL");
    memset(out, 0, sizeof *out);
    if (bytes == NULL) return attn__fail(ATTN_ERR_NULL, "bytes is NULL");
    npy_info info;
    size_t offset = 0;
    attn_status st = parse_preamble(bytes, size, &info, &offset);
    if (st != ATTN_OK) return st;
    size_t need = (size_t)info.numel * attn_dtype_size(info.dtype);
    if (size - offset != need)
        return attn__fail(ATTN_ERR_FORMAT, ".npy data is %zu bytes; the header promises %zu",
                          size - offset, need);
    return decode_data(&info, (const unsigned char *)bytes + offset, out);
}

/* Reads the first min(file size, limit) bytes of a regular file into *buf
 * (the caller frees it with attn__free). */
static attn_status read_start(const char *path, size_t limit, unsigned char **buf, size_t *got) {
    char shown[ATTN__MESSAGE_PATH]; /* a path too long to quote whole */
    *buf = NULL;
    /* O_NONBLOCK: opening a FIFO with no writer would wait forever; it is
     * refused below like any file that is not regular */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "rb");
    if (f == NULL) {
        const int err = errno;
        if (fd >= 0) close(fd);
        return attn__fail(ATTN_ERR_IO, "cannot open '%s': %s", attn__message_path(path, shown),
                          strerror(err));
    }
    attn_status st = ATTN_OK;
    struct stat info;
    long long file_size = -1;
    if (fstat(fileno(f), &info) == 0 && S_ISREG(info.st_mode)) file_size = info.st_size;
    if (file_size < 0) {
        st = attn__fail(ATTN_ERR_IO, "cannot read '%s': not a regular file",
                        attn__message_path(path, shown));
    } else {
        /* The file's own size bounds every allocation: a hostile header
         * length can at most make the parse fail, never size a buffer. */
        size_t want = (size_t)file_size < limit ? (size_t)file_size : limit;
        *buf = attn__alloc(want > 0 ? want : 1);
        if (*buf == NULL) {
            st = ATTN_ERR_NOMEM;
        } else if (fread(*buf, 1, want, f) != want) {
            st = attn__fail(ATTN_ERR_IO, "cannot read '%s': %s", attn__message_path(path, shown),
                            ferror(f) ? strerror(errno) : "file shrank while reading");
        }
        *got = want;
    }
    fclose(f);
    if (st != ATTN_OK) {
        attn__free(*buf);
        *buf = NULL;
    }
    return st;
}

/* "PATH: " before the parser's message. */
static attn_status name_the_file(attn_status st, const char *path) {
    char shown[ATTN__MESSAGE_PATH];
    attn__prefix_error(st, ": ");
    return attn__prefix_error(st, attn__message_path(path, shown));
}

attn_status attn_npy_load(const char *path, attn_tensor *out) {
    attn__clear_error();
    if (out == NULL) return attn__fail(ATTN_ERR_NULL, "out is NULL");
    memset(out, 0, sizeof *out);
    if (path == NULL) return attn__fail(ATTN_ERR_NULL, "path is NULL");
    unsigned char *buf;
    size_t size = 0;
    attn_status st = read_start(path, SIZE_MAX, &buf, &size);
    if (st == ATTN_OK && (st = attn_npy_parse(buf, size, out)) != ATTN_OK)
        name_the_file(st, path);
    attn__free(buf);
    return st;
}

attn_status attn_npy_read_header(const char *path, attn_dtype *dtype, int *rank,
                                 int64_t shape[ATTN_MAX_RANK]) {
    attn__clear_error();
    if (path == NULL || dtype == NULL || rank == NULL || shape == NULL)
        return attn__fail(ATTN_ERR_NULL, "%s is NULL",
                          !path ? "path" : !dtype ? "dtype" : !rank ? "rank" : "shape");
    unsigned char *buf;
    size_t size = 0, offset = 0;
    /* Magic, version and length (at most 12 bytes), then the header. */
    attn_status st = read_start(path, 12 + (size_t)MAX_HEADER, &buf, &size);
    npy_info info;
    if (st == ATTN_OK && (st = parse_preamble(buf, size, &info, &offset)) != ATTN_OK)
        name_the_file(st, path);
    attn__free(buf);
    if (st != ATTN_OK) return st;
    *dtype = info.dtype;
    *rank = info.rank;
    memcpy(shape, info.shape, sizeof(int64_t) * (size_t)info.rank);
    return ATTN_OK;
}

/* How long the preamble in b[0, size) says it is (magic, version, length
 * and header), when it says so plausibly; else 0 (parse_preamble then
 * names what is wrong). */
static size_t preamble_length(const unsigned char *b, size_t size) {
    if (size < MAGIC_LEN + 2 || memcmp(b, "\x93NUMPY", MAGIC_LEN) != 0 || b[6] < 1 || b[6] > 3)
        return 0;
    size_t start = b[6] == 1 ? 10 : 12;
    if (size < start) return 0;
    size_t hlen = (size_t)b[8] | (size_t)b[9] << 8;
    if (start == 12) hlen |= (size_t)b[10] << 16 | (size_t)b[11] << 24;
    return hlen > MAX_HEADER ? 0 : start + hlen;
}

/* pread until n bytes or the end of the file; *got says how many. Returns
 * 0 or an errno value. */
static int pread_upto(int fd, unsigned char *buf, size_t n, off_t at, size_t *got) {
    *got = 0;
    while (*got < n) {
        ssize_t r = pread(fd, buf + *got, n - *got, at + (off_t)*got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return errno;
        if (r == 0) break;
        *got += (size_t)r;
    }
    return 0;
}

/* The preamble's bytes into *buf (attn__free), read in two steps: the
 * fixed part, then the length it states, never more. */
static attn_status read_preamble_fd(int fd, const char *path, unsigned char **buf, size_t *got) {
    char shown[ATTN__MESSAGE_PATH];
    unsigned char lead[12];
    int err = pread_upto(fd, lead, sizeof lead, 0, got);
    size_t want = err == 0 ? preamble_length(lead, *got) : 0;
    *buf = attn__alloc(want > *got ? want : sizeof lead);
    if (*buf == NULL) return ATTN_ERR_NOMEM;
    if (err == 0 && want > *got)
        err = pread_upto(fd, *buf, want, 0, got);
    else
        memcpy(*buf, lead, *got);
    if (err != 0) {
        attn__free(*buf);
        *buf = NULL;
        return attn__fail(ATTN_ERR_IO, "cannot read '%s': %s", attn__message_path(path, shown),
                          strerror(err));
    }
    return ATTN_OK;
}

attn_status attn__npy_read_header_fd(int fd, const char *path, attn__npy_header *h) {
    attn__clear_error();
    char shown[ATTN__MESSAGE_PATH];
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return attn__fail(ATTN_ERR_IO, "cannot read '%s': not a regular file",
                          attn__message_path(path, shown));
    unsigned char *buf;
    size_t size = 0, offset = 0;
    attn_status s = read_preamble_fd(fd, path, &buf, &size);
    if (s != ATTN_OK) return s;
    s = parse_preamble(buf, size, h, &offset);
    attn__free(buf);
    if (s != ATTN_OK) return name_the_file(s, path);
    h->data_offset = (int64_t)offset;
    /* numel * 8 fits in 64 bits (parse_header_dict checked). */
    const int64_t need = h->numel * (int64_t)attn_dtype_size(h->dtype);
    if ((int64_t)st.st_size - h->data_offset != need)
        return attn__fail(ATTN_ERR_FORMAT, "'%s': .npy data is %lld bytes; the header promises %lld",
                          attn__message_path(path, shown),
                          (long long)((int64_t)st.st_size - h->data_offset), (long long)need);
    return ATTN_OK;
}

void attn_npy_free(attn_tensor *t) {
    if (t == NULL) return;
    attn__free(t->data);
    memset(t, 0, sizeof *t);
}
