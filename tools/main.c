/* main.c — the attn command-line tool: dispatches to demo, sdpa, info. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char usage[] =
    "usage: attn [demo]                 run the embedded demo (the default)\n"
    "       attn sdpa -q Q.npy -k K.npy -v V.npy -o OUT.npy [options]\n"
    "                                   scaled dot-product attention on .npy files\n"
    "       attn info                   version, kernel path, threads, BLAS\n"
    "       attn --help | --version\n"
    "\n"
    "sdpa options:\n"
    "  --mask M.npy            bool (true = attend) or float (added) mask,\n"
    "                          broadcastable to (..., L, S)\n"
    "  --causal[=top-left]     causal mask aligned to the first key (PyTorch)\n"
    "  --causal=bottom-right   causal mask aligned to the last key (KV cache)\n"
    "  --scale S               score scale (default 1/sqrt(E))\n"
    "  --gqa                   grouped-query attention (query heads share K/V heads)\n"
    "  --dropout P --seed N    reproducible dropout on the attention weights\n"
    "  -o OUT.npy              the output (required)\n"
    "  --weights W.npy         also write the attention weights (..., L, S)\n"
    "  --lse LSE.npy           also write the log-sum-exp per row (..., L)\n"
    "  --threads N             threads (default: ATTN_NUM_THREADS or all cores)\n"
    "\n"
    "Outputs are all written or none: each goes to a temporary file beside its\n"
    "target and is renamed over it only when every output is complete.\n"
    "Exit status: 0 success, 1 runtime error, 2 usage error.\n";

static int info(void) {
    attn_isa isa = attn_get_isa();
    printf("attn %s\nkernel path: %s\nthreads: %d\nsupported paths:", attn_version(),
           attn_isa_name(isa), attn_get_num_threads());
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_AVX512; i++)
        if (attn_isa_supported((attn_isa)i)) printf(" %s", attn_isa_name((attn_isa)i));
    const char *blas = attn_blas_info();
    printf("\nBLAS (MHA projections): %s\n", blas);
    /* An OpenBLAS older than the CPU falls back to SSE3 kernels. */
    const bool avx512 = attn_isa_supported(ATTN_ISA_AVX512);
    if (strstr(blas, "core Prescott") != NULL && (avx512 || attn_isa_supported(ATTN_ISA_AVX2)))
        printf("hint: this OpenBLAS does not know the CPU; OPENBLAS_CORETYPE=%s makes it use "
               "its %s kernels\n", avx512 ? "SkylakeX" : "Haswell", avx512 ? "AVX-512" : "AVX2");
    return CLI_OK;
}

int main(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "demo") == 0) {
        if (argc > 2) {
            fprintf(stderr, "attn: demo takes no arguments\n%s", usage);
            return CLI_USAGE;
        }
        return cli_demo();
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        fputs(usage, stdout);
        return CLI_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("attn %s\n", attn_version());
        return CLI_OK;
    }
    if (strcmp(argv[1], "sdpa") == 0) return cli_sdpa(argc - 2, argv + 2);
    if (strcmp(argv[1], "info") == 0 && argc == 2) return info();
    fprintf(stderr, "attn: unknown command '%s'\n%s", argv[1], usage);
    return CLI_USAGE;
}
