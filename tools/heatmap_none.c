/* heatmap_none.c — `attn heatmap` in a build without cairo: a clear error
 * instead of the command (tools/CMakeLists.txt picks this file then). */
#include <stdio.h>

#include "cli.h"

const char cli_heatmap_options[] =
    "heatmap: not in this build (cairo was not found when attn was built;\n"
    "install libcairo2-dev, e.g. with scripts/bootstrap.sh build, and rebuild)\n";

const char cli_heatmap_support[] = "no (built without cairo)";

int cli_heatmap(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "attn heatmap: this attn was built without heatmap support (cairo was not "
                    "found at build time: install libcairo2-dev, e.g. with scripts/bootstrap.sh "
                    "build, and rebuild)\n");
    return CLI_RUNTIME;
}
