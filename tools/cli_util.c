/* cli_util.c — helpers the attn tool's commands share. */
#include <stdio.h>

#include "cli.h"

int cli_fail(const char *what, attn_status status) {
    const char *detail = attn_last_error();
    fprintf(stderr, "attn: %s: %s\n", what, detail[0] ? detail : attn_strerror(status));
    return CLI_RUNTIME;
}

const char *cli_shape(const attn_tensor *t, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int d = 0; d < t->rank && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ", %lld" : "%lld",
                                 (long long)t->shape[d]);
    if (used < size) snprintf(buf + used, size - used, ")");
    return buf;
}
