/* main.c — the attn command-line tool: dispatches to demo, sdpa (and sdpa
 * --ring), varlen, kvcache, mha, heatmap, info. */
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char usage[] =
    "usage: attn [demo]                 run the embedded demo (the default)\n"
    "       attn sdpa -q Q.npy -k K.npy -v V.npy -o OUT.npy [options]\n"
    "                                   scaled dot-product attention on .npy files\n"
    "       mpirun -np N attn sdpa --ring -q Q.npy -k K.npy -v V.npy -o OUT.npy [options]\n"
    "                                   the same, the sequence split over N MPI ranks\n"
    "       attn mha --weights M.safetensors [--prefix P] --num-heads H -q Q.npy -o OUT.npy\n"
    "                [options]          multi-head attention with a checkpoint's weights\n"
    "       attn varlen -q Q.npy -k K.npy -v V.npy --cu-seqlens-q CQ.npy\n"
    "                --cu-seqlens-k CK.npy -o OUT.npy [options]\n"
    "                                   packed sequences of different lengths\n"
    "       attn kvcache -q Q.npy --k-cache KC.npy --v-cache VC.npy -o OUT.npy [options]\n"
    "                                   decoding against a KV cache (paged or not)\n"
    "       attn heatmap -w WEIGHTS.npy -o OUT.png [options]\n"
    "                                   a PNG of attention weights\n"
    "       attn info                   version, kernel path, threads, BLAS\n"
    "       attn help | --help | --version\n"
    "\n";

static const char serving_options[] =
    "varlen and kvcache options: attn varlen --help, attn kvcache --help (the\n"
    "score modifiers --window, --alibi-slopes, --softcap, --sinks are sdpa's)\n";

static void print_usage(FILE *to) {
    /* varlen's and kvcache's options are in their own --help: the whole text
     * here stays short enough for a pipe reader with a modest buffer. */
    fprintf(to, "%s%s\n%s\n%s\n%s", usage, cli_sdpa_options, serving_options,
            cli_mha_options, cli_heatmap_options);
}

static int info(void) {
    attn_isa isa = attn_get_isa();
    printf("attn %s\nkernel path: %s\nthreads: %d\nsupported paths:", attn_version(),
           attn_isa_name(isa), attn_get_num_threads());
    for (int i = ATTN_ISA_REF; i <= ATTN_ISA_LAST; i++)
        if (attn_isa_supported((attn_isa)i)) printf(" %s", attn_isa_name((attn_isa)i));
    const char *blas = attn_blas_info();
    printf("\nBLAS (MHA projections): %s\n", blas);
    printf("heatmap: %s\n", cli_heatmap_support);
    printf("ring (sdpa --ring): %s\n", cli_ring_support());
    /* An OpenBLAS older than the CPU falls back to SSE3 kernels. */
    const bool avx512 = attn_isa_supported(ATTN_ISA_AVX512);
    if (strstr(blas, "core Prescott") != NULL && (avx512 || attn_isa_supported(ATTN_ISA_AVX2)))
        printf("hint: this OpenBLAS does not know the CPU; OPENBLAS_CORETYPE=%s makes it use "
               "its %s kernels\n", avx512 ? "SkylakeX" : "Haswell", avx512 ? "AVX-512" : "AVX2");
    return CLI_OK;
}

static int run_command(int argc, char **argv) {
    if (argc < 2 || strcmp(argv[1], "demo") == 0) {
        if (argc > 2) {
            fprintf(stderr, "attn: demo takes no arguments\n");
            print_usage(stderr);
            return CLI_USAGE;
        }
        return cli_demo();
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 ||
        strcmp(argv[1], "help") == 0) {
        print_usage(stdout);
        return CLI_OK;
    }
    if (strcmp(argv[1], "--version") == 0) {
        printf("attn %s\n", attn_version());
        return CLI_OK;
    }
    if (strcmp(argv[1], "sdpa") == 0) return cli_sdpa(argc - 2, argv + 2);
    if (strcmp(argv[1], "mha") == 0) return cli_mha(argc - 2, argv + 2);
    if (strcmp(argv[1], "varlen") == 0) return cli_varlen(argc - 2, argv + 2);
    if (strcmp(argv[1], "kvcache") == 0) return cli_kvcache(argc - 2, argv + 2);
    if (strcmp(argv[1], "heatmap") == 0) return cli_heatmap(argc - 2, argv + 2);
    if (strcmp(argv[1], "info") == 0) {
        if (argc == 2) return info();
        fprintf(stderr, "attn: info takes no arguments\n(see attn --help)\n");
        return CLI_USAGE;
    }
    fprintf(stderr, "attn: unknown command '%s'\n", argv[1]);
    print_usage(stderr);
    return CLI_USAGE;
}

int main(int argc, char **argv) {
    int rc = run_command(argc, argv);
    /* Output that never arrived (a full disk, a closed pipe) is a failure:
     * stdout is buffered, so the error shows at the flush — or earlier,
     * when a long text (the usage) filled the buffer: then errno still
     * holds that write's reason. */
    const int early = ferror(stdout) ? errno : 0;
    errno = 0;
    if (fflush(stdout) != 0 || ferror(stdout)) {
        const int why = errno != 0 ? errno : early;
        fprintf(stderr, "attn: cannot write to standard output: %s\n",
                why != 0 ? strerror(why) : "write error");
        if (rc == CLI_OK) rc = CLI_RUNTIME;
    }
    return rc;
}
