/* cli.h — what the attn tool's commands share. */
#ifndef ATTN_CLI_H
#define ATTN_CLI_H

#include "attn.h"

/* Exit codes: 0 success, 1 runtime error (with the library's message),
 * 2 usage error. */
enum { CLI_OK = 0, CLI_RUNTIME = 1, CLI_USAGE = 2 };

int cli_demo(void);
int cli_sdpa(int argc, char **argv);

/* Prints "attn: <what>: <library message>" and returns CLI_RUNTIME. */
int cli_fail(const char *what, attn_status status);

/* "(3, 30, 128)" */
const char *cli_shape(const attn_tensor *t, char *buf, size_t size);

#endif
