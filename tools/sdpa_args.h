/* sdpa_args.h — `attn sdpa`'s options, shared by the single-process command
 * (sdpa_cmd.c) and the ring over MPI (ring_cmd.c, or ring_none.c when attn
 * is built without MPI). */
#ifndef ATTN_SDPA_ARGS_H
#define ATTN_SDPA_ARGS_H

#include <stddef.h>

#include "attn.h"
#include "modifiers.h"

typedef struct sdpa_args {
    const char *q, *k, *v, *mask, *out, *weights, *lse;
    attn_sdpa_params params;
    cli_modifiers mods; /* --alibi-slopes and --sinks (not with --ring) */
    int threads;
    int seed_given;
    /* --ring and its options (attn_ring_layout's values: 0 zigzag, 1
     * contiguous; a timeout of 0: the library's default). */
    int ring;
    int layout;
    double ring_timeout;
} sdpa_args;

/* sdpa_parse_args's answer to -h/--help. */
enum { SDPA_PARSED_HELP = -1 };

/* Parses the options after `attn sdpa`: CLI_OK, CLI_USAGE or
 * SDPA_PARSED_HELP. A usage error's text ("attn sdpa: ...\n(see attn sdpa
 * --help)") goes to stderr, or into err (err_size bytes, no final newline)
 * when err is not NULL: the ring prints it once for all ranks. */
int sdpa_parse_args(int argc, char **argv, sdpa_args *a, char *err, size_t err_size);

/* `attn sdpa --help`'s text, on stdout. */
void sdpa_print_help(void);

/* `attn sdpa --ring ...` (argc/argv: the options after `sdpa`). Built
 * without MPI, a usage error saying so. */
int cli_sdpa_ring(int argc, char **argv);

#endif
