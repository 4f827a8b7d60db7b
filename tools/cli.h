/* cli.h — what the attn tool's commands share. */
#ifndef ATTN_CLI_H
#define ATTN_CLI_H

#include <stdio.h>

#include "attn.h"

/* Exit codes: 0 success, 1 runtime error (with the library's message),
 * 2 usage error. */
enum { CLI_OK = 0, CLI_RUNTIME = 1, CLI_USAGE = 2 };

int cli_demo(void);
int cli_sdpa(int argc, char **argv);
int cli_mha(int argc, char **argv);
/* `attn varlen` and `attn kvcache` (serving_cmd.c). */
int cli_varlen(int argc, char **argv);
int cli_kvcache(int argc, char **argv);
/* The "sdpa options:" part of the usage text, shared by `attn --help` and
 * `attn sdpa --help`. */
extern const char cli_sdpa_options[];
/* The "mha options:" part, for `attn --help` and `attn mha --help`. */
extern const char cli_mha_options[];
/* `attn heatmap` (heatmap_cmd.c with cairo, heatmap_none.c without), its
 * options text, and a line for `attn info` saying whether it is built. */
int cli_heatmap(int argc, char **argv);
extern const char cli_heatmap_options[];
extern const char cli_heatmap_support[];

/* A line for `attn info` saying whether `attn sdpa --ring` is built, and
 * with which MPI (ring_cmd.c; ring_none.c without MPI). */
const char *cli_ring_support(void);

/* Prints "attn: <what>: <library message>" and returns CLI_RUNTIME. */
int cli_fail(const char *what, attn_status status);
/* fopen(path, "rb") that never waits for a writer: a FIFO with none reads
 * as empty (pipes with one, `<(...)`, read as usual). NULL with errno. */
FILE *cli_open_input(const char *path);
/* The dtype of an lse output for queries of dtype q (attn_sdpa's rule):
 * float64 for float64, else float32 (never 16-bit). */
attn_dtype cli_lse_dtype(attn_dtype q);

/* Prints "attn <command>: <message>" and where to find the command's help,
 * and returns CLI_USAGE. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
int cli_usage_error(const char *command, const char *fmt, ...);

/* Option values: 1 when s is all of a finite double (a subnormal is fine,
 * an overflow or a nonzero underflowing to 0 is not) / of a non-negative
 * decimal integer that fits; else 0. */
int cli_parse_double(const char *s, double *out);
int cli_parse_u64(const char *s, unsigned long long *out);

/* Output files, all or none (outputs.c). outputs_add resolves a target
 * and refuses one that another option already names (CLI_USAGE); the first
 * call installs the SIGINT/SIGTERM/SIGHUP handlers that remove staged
 * temporaries. outputs_stage writes an option's tensor to a temporary beside
 * its target (CLI_OK for an option never added); outputs_commit renames them
 * all over their targets; outputs_abort removes them. Each failure is
 * reported on stderr and returns CLI_RUNTIME. */
int outputs_add(const char *option, const char *path);
/* Registers an input file (NULL or not a regular file: nothing to keep);
 * an output naming it, added before or after, is refused (CLI_USAGE): the
 * run would replace what it reads. */
int outputs_input(const char *option, const char *path);
int outputs_stage(const char *option, const attn_tensor *t);
/* The same for any file format: write(fd, ctx) writes the whole file to fd
 * and returns NULL, or a message saying what failed. ctx must stay valid
 * until outputs_commit (a device or FIFO target is written then). */
typedef const char *(*output_writer)(int fd, const void *ctx);
int outputs_stage_with(const char *option, output_writer write, const void *ctx);
int outputs_commit(void);
void outputs_abort(void);
/* For a file that several processes write (attn sdpa --ring): one of them
 * stages it (outputs_stage_with: a header and the full size), tells the
 * others outputs_temp_name, and each opens that temporary in its own
 * resolution of the target's folder with outputs_open_temp (CLI_RUNTIME,
 * reported, when it cannot) to write its part by offset. outputs_in_place
 * says whether the target is an existing device or FIFO, which is written
 * in place and cannot be written by offset. */
const char *outputs_temp_name(const char *option);
int outputs_open_temp(const char *option, const char *temp, int *fd);
int outputs_in_place(const char *option);
/* Sends outputs.c's messages (each ending in a newline) to `report`
 * instead of stderr; NULL restores stderr. */
void outputs_set_reporter(void (*report)(const char *message));

/* "(3, 30, 128)" */
const char *cli_shape(const attn_tensor *t, char *buf, size_t size);

#endif
