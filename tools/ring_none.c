/* ring_none.c — `attn sdpa --ring` in an attn built without MPI: says so. */
#include <stdio.h>

#include "cli.h"
#include "sdpa_args.h"

const char *cli_ring_support(void) { return "no (built without MPI)"; }

int cli_sdpa_ring(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "attn sdpa: --ring needs MPI, and this attn was built without MPI (install "
                    "an MPI such as Debian's libopenmpi-dev and rebuild; attn info tells)\n"
                    "(see attn sdpa --help)\n");
    return CLI_USAGE;
}
