/* cli_util.c — helpers the attn tool's commands share. */
#define _POSIX_C_SOURCE 200809L /* fdopen, O_CLOEXEC */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "cli.h"

attn_dtype cli_lse_dtype(attn_dtype q) {
    return q == ATTN_DTYPE_F64 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
}

FILE *cli_open_input(const char *path) {
    /* O_NONBLOCK for the open only: a FIFO with no writer then opens at
     * once, and reads as empty, instead of holding the tool forever */
    const int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return NULL;
    const int flags = fcntl(fd, F_GETFL);
    FILE *f = flags >= 0 && fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) == 0 ? fdopen(fd, "rb") : NULL;
    if (f == NULL) {
        const int err = errno;
        close(fd);
        errno = err;
    }
    return f;
}

int cli_fail(const char *what, attn_status status) {
    const char *detail = attn_last_error();
    fprintf(stderr, "attn: %s: %s\n", what, detail[0] ? detail : attn_strerror(status));
    return CLI_RUNTIME;
}

int cli_usage_error(const char *command, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "attn %s: ", command);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(see attn %s --help)\n", command);
    va_end(ap);
    return CLI_USAGE;
}

const char *cli_shape(const attn_tensor *t, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int d = 0; d < t->rank && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld",
                                 (long long)t->shape[d]);
    if (used < size) snprintf(buf + used, size - used, ")");
    return buf;
}

/* strtod reports ERANGE for subnormal results too (1e-310): those are
 * finite, usable values. Refused: overflow to infinity, and a nonzero
 * number that underflowed to 0 (1e-400). */
int cli_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    *out = strtod(s, &end);
    if (end == s || *end != '\0' || !isfinite(*out)) return 0;
    return errno != ERANGE || *out != 0;
}

int cli_parse_u64(const char *s, unsigned long long *out) {
    /* strtoull skips leading space and negates a '-': " -1" would be 2^64-1. */
    const char *p = s;
    while (isspace((unsigned char)*p)) p++;
    if (*p == '-') return 0;
    char *end;
    errno = 0;
    *out = strtoull(s, &end, 10);
    return end != s && *end == '\0' && errno == 0;
}
