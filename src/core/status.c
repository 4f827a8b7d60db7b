/* status.c — version, status strings and the per-thread error message. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

const char *attn_version(void) { return ATTN_VERSION_STRING; }
int attn_version_number(void) { return ATTN_VERSION_NUMBER; }

const char *attn_strerror(attn_status status) {
    switch (status) {
    case ATTN_OK: return "success";
    case ATTN_ERR_NULL: return "a required pointer is NULL";
    case ATTN_ERR_INVALID: return "an argument has an invalid value";
    case ATTN_ERR_SHAPE: return "tensor shapes do not fit together";
    case ATTN_ERR_DTYPE: return "unsupported or mismatched element type";
    case ATTN_ERR_OVERFLOW: return "a size does not fit in 64 bits";
    case ATTN_ERR_NOMEM: return "out of memory";
    case ATTN_ERR_IO: return "input/output error";
    case ATTN_ERR_FORMAT: return "malformed file";
    case ATTN_ERR_UNSUPPORTED: return "not supported by this build or CPU";
    case ATTN_ERR_CANCELLED: return "cancelled";
    case ATTN_ERR_OVERLAP: return "an output overlaps another operand in memory";
    case ATTN_ERR_COMM: return "a peer or the communicator failed";
    }
    return "unknown status code";
}

/* One message per thread: concurrent calls never see each other's errors. */
/* Room for a message that quotes a full path (PATH_MAX is 4096 on Linux)
 * and still says what went wrong after it. */
static _Thread_local char last_error[ATTN__MESSAGE_SIZE];
/* The argument the message is about: bindings map it to their own names. */
static _Thread_local char last_arg[64];

const char *attn_last_error(void) { return last_error; }
const char *attn_last_error_arg(void) { return last_arg; }

void attn__clear_error(void) {
    last_error[0] = '\0';
    last_arg[0] = '\0';
}

attn_status attn__fail(attn_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    last_arg[0] = '\0';
    return status;
}

attn_status attn__fail_arg(attn_status status, const char *arg, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    snprintf(last_arg, sizeof last_arg, "%s", arg != NULL ? arg : "");
    return status;
}

attn_status attn_set_error(attn_status status, const char *arg, const char *fmt, ...) {
    /* Through copies: a caller may pass attn_last_error() or
     * attn_last_error_arg() itself, to add to the message. */
    char msg[ATTN__MESSAGE_SIZE], name[sizeof last_arg];
    snprintf(name, sizeof name, "%s", arg != NULL ? arg : "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    memcpy(last_error, msg, sizeof last_error);
    memcpy(last_arg, name, sizeof last_arg);
    return status;
}

void attn_clear_error(void) { attn__clear_error(); }

attn_status attn__read_params(void *dst, size_t dst_size, size_t first_size, const void *src,
                              const char *name, const char *init_name) {
    size_t size;
    memcpy(&size, src, sizeof size); /* every parameter struct starts with it */
    char arg[64]; /* the field errors are about (formatted only for one: 3% of a 16-token call) */
    /* 0, or garbage, is a struct never initialised: refused before a byte
     * past the library's own fields is read (a garbage size would make the
     * zero check below read far beyond the caller's struct). */
    if (size < first_size || size > ATTN__MAX_STRUCT_SIZE) {
        snprintf(arg, sizeof arg, "%s.struct_size", name);
        return attn__fail_arg(ATTN_ERR_INVALID, arg,
                              "%s.struct_size is %zu: initialise %s with %s() before setting "
                              "its fields",
                              name, size, name, init_name);
    }
    if (size > dst_size) {
        /* From a newer attn.h: fine as long as the fields this library does
         * not know are left at zero, their "unset" value. */
        const unsigned char *extra = (const unsigned char *)src + dst_size;
        for (size_t i = 0; i < size - dst_size; i++)
            if (extra[i] != 0) {
                snprintf(arg, sizeof arg, "%s.struct_size", name);
                return attn__fail_arg(ATTN_ERR_UNSUPPORTED, arg,
                                      "%s sets fields that libattn %s does not know (its struct "
                                      "has %zu bytes, this library's %zu): link a newer libattn",
                                      name, ATTN_VERSION_STRING, size, dst_size);
            }
        size = dst_size;
    }
    memcpy(dst, src, size); /* the fields an older caller lacks keep dst's defaults */
    memcpy(dst, &dst_size, sizeof dst_size);
    return ATTN_OK;
}

attn_status attn__prefix_error(attn_status status, const char *prefix) {
    size_t n = strlen(prefix), len = strlen(last_error);
    if (n > sizeof last_error - 1) n = sizeof last_error - 1;
    if (len > sizeof last_error - 1 - n) len = sizeof last_error - 1 - n;
    memmove(last_error + n, last_error, len);
    memcpy(last_error, prefix, n);
    last_error[n + len] = '\0';
    return status;
}

attn_status attn__rename_arg(attn_status status, const char *from, const char *to) {
    if (strcmp(last_arg, from) != 0) return status;
    snprintf(last_arg, sizeof last_arg, "%s", to);
    char prefix[160];
    snprintf(prefix, sizeof prefix, "%s (passed on as %s): ", to, from);
    return attn__prefix_error(status, prefix);
}

const char *attn__message_path(const char *path, char buf[ATTN__MESSAGE_PATH]) {
    const size_t len = strlen(path), keep = (ATTN__MESSAGE_PATH - 4) / 2;
    if (len < ATTN__MESSAGE_PATH) return path;
    snprintf(buf, ATTN__MESSAGE_PATH, "%.*s...%s", (int)keep, path, path + len - keep + 1);
    return buf;
}

attn_status attn__check_flags(const int *values, const char *const *names, int n) {
    for (int i = 0; i < n; i++)
        if (values[i] != 0 && values[i] != 1) {
            const char *field = strchr(names[i], '.');
            return attn__fail_arg(ATTN_ERR_INVALID, names[i], "%s is %d; expected 0 or 1",
                                  field ? field + 1 : names[i], values[i]);
        }
    return ATTN_OK;
}
