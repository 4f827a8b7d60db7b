/*
 * heatmap_cmd.c — `attn heatmap`: a PNG of attention weights.
 *
 *   attn heatmap -w W.npy -o OUT.png [--tokens FILE] [--key-tokens FILE]
 *                [--head N | --grid] [--batch N] [--cell PX]
 *                [--vmin X] [--vmax X] [--print-layout]
 *
 * W is what `attn sdpa --weights` writes: float32, float64 or float16, (L, S),
 * (H, L, S) or (N, H, L, S). One panel per head drawn: rows are queries,
 * columns keys, cell (i, j) painted in viridis by its weight; one colour bar
 * for all panels with its minimum, middle and maximum. The scale is the
 * smallest to the largest finite weight drawn unless --vmin/--vmax fix it
 * (values beyond take the end colours; a constant picture is all the first
 * colour). NaN is magenta, +inf red, -inf black, and a legend under the bar
 * names those present. Query tokens label the rows, key tokens the columns
 * (read upwards); without --key-tokens the keys take the query tokens when
 * L == S, and are not labelled otherwise.
 *
 * The layout, in whole pixels (what --print-layout prints and the tests
 * rely on): cells are `cell` px squares (--cell, or 24 px made smaller until
 * the cells fit in 2048 px each way, at least 1). A panel is a title line
 * of 18 px ("head h", when the file has heads), the key labels above the
 * grid and the query labels left of it (each as long as the longest label,
 * at most 160 px, + 4 px), and the L x S cells; it is as wide as labels and
 * cells, or its title if that is wider. Labels use a min(12, cell) px font
 * and are left out below 6 px cells. Panels start 8 px from the image's
 * top-left corner, 16 px apart; with --grid the n heads fill rows of
 * ceil(sqrt(n)) panels, in order. The colour bar, 16 px wide, is
 * 16 px right of the panels, from the first grid's top to the last grid's
 * bottom (at least 64 px); its pixel row r (0 at the top, h rows) shows
 * colour round(255 (h - 1 - r) / (h - 1)): the last colour at the top, the
 * first at the bottom (all the first for a constant picture). Images over
 * 16384 px a side or 32 Mpx in all are refused with the size they would
 * need (slice the weights, or choose a smaller --cell).
 *
 * Text comes from cairo (libcairo2-dev; fonts through fontconfig), which
 * also writes the PNG through libpng: no encoder or glyph code of our own. The
 * PNG goes through outputs.c: a temporary beside the target, renamed over
 * it once complete, removed on failure or SIGINT/SIGTERM/SIGHUP.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cairo.h>

#include "heatmap.h"

const char cli_heatmap_options[] =
    "heatmap options:\n"
    "  -w W.npy                attention weights (L, S), (H, L, S) or (N, H, L, S),\n"
    "                          float32/float64/float16, as attn sdpa --weights\n"
    "                          writes them\n"
    "  -o OUT.png              the image (required)\n"
    "  --tokens FILE           query tokens, one per line (L lines): row labels\n"
    "  --key-tokens FILE       key tokens (S lines): column labels; default: the\n"
    "                          query tokens when L == S\n"
    "  --head N                the head to draw (needed when H > 1 without --grid)\n"
    "  --grid                  every head of one batch element in one image\n"
    "  --batch N               the batch element of (N, H, L, S) weights (default 0)\n"
    "  --cell PX               cell size in pixels, 1 to 256 (default: 24, smaller\n"
    "                          for large L or S)\n"
    "  --vmin X, --vmax X      the colour scale's ends (default: the smallest and\n"
    "                          largest finite weight drawn)\n"
    "  --print-layout          print the image's geometry (cells, colour bar)\n"
    "\n"
    "Rows are queries, columns keys; viridis colours, NaN magenta, +inf red,\n"
    "-inf black. The PNG is written whole or not at all.\n";

const char cli_heatmap_support[] = "yes (cairo " CAIRO_VERSION_STRING ")";

typedef struct hm_args {
    const char *weights, *out, *tokens, *key_tokens;
    long long head, batch; /* -1: not given */
    int cell;              /* 0: automatic */
    bool grid, print_layout, has_vmin, has_vmax;
    double vmin, vmax;
} hm_args;

enum { PARSED_HELP = -1, MAX_CELL = 256, MAX_SIDE_CELLS = 16384, MAX_CELLS = 32 << 20 };

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "attn heatmap: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, code == CLI_USAGE ? "\n(see attn heatmap --help)\n" : "\n");
    va_end(ap);
    return code;
}

/* An integer option in [lo, hi]; CLI_OK or a usage error naming it. */
static int int_option(const char *opt, const char *val, long long lo, long long hi,
                      long long *out) {
    unsigned long long v;
    if (!cli_parse_u64(val, &v) || v < (unsigned long long)lo || v > (unsigned long long)hi)
        return fail(CLI_USAGE, "%s: '%s' is not an integer from %lld to %lld", opt, val, lo, hi);
    *out = (long long)v;
    return CLI_OK;
}

static int parse_args(int argc, char **argv, hm_args *a) {
    memset(a, 0, sizeof *a);
    a->head = a->batch = -1;
    for (int i = 0; i < argc; i++) {
        const char *opt = argv[i];
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) return PARSED_HELP;
        const char **path = strcmp(opt, "-w") == 0             ? &a->weights
                            : strcmp(opt, "-o") == 0           ? &a->out
                            : strcmp(opt, "--tokens") == 0     ? &a->tokens
                            : strcmp(opt, "--key-tokens") == 0 ? &a->key_tokens
                                                               : NULL;
        bool takes_value = path != NULL || strcmp(opt, "--head") == 0 ||
                           strcmp(opt, "--batch") == 0 || strcmp(opt, "--cell") == 0 ||
                           strcmp(opt, "--vmin") == 0 || strcmp(opt, "--vmax") == 0;
        if (takes_value && i + 1 >= argc) return fail(CLI_USAGE, "%s needs a value", opt);
        const char *val = takes_value ? argv[++i] : NULL;
        int rc = CLI_OK;
        long long n = 0;
        if (path != NULL) {
            *path = val;
        } else if (strcmp(opt, "--head") == 0) {
            rc = int_option(opt, val, 0, INT64_MAX, &a->head);
        } else if (strcmp(opt, "--batch") == 0) {
            rc = int_option(opt, val, 0, INT64_MAX, &a->batch);
        } else if (strcmp(opt, "--cell") == 0) {
            rc = int_option(opt, val, 1, MAX_CELL, &n);
            a->cell = (int)n;
        } else if (strcmp(opt, "--vmin") == 0 || strcmp(opt, "--vmax") == 0) {
            bool lo = strcmp(opt, "--vmin") == 0;
            if (!cli_parse_double(val, lo ? &a->vmin : &a->vmax))
                return fail(CLI_USAGE, "%s: '%s' is not a finite number", opt, val);
            *(lo ? &a->has_vmin : &a->has_vmax) = true;
        } else if (strcmp(opt, "--grid") == 0) {
            a->grid = true;
        } else if (strcmp(opt, "--print-layout") == 0) {
            a->print_layout = true;
        } else {
            return fail(CLI_USAGE, "unknown option '%s'", opt);
        }
        if (rc != CLI_OK) return rc;
    }
    if (a->weights == NULL) return fail(CLI_USAGE, "-w WEIGHTS.npy is required");
    if (a->out == NULL) return fail(CLI_USAGE, "-o OUT.png is required");
    if (a->grid && a->head >= 0)
        return fail(CLI_USAGE, "--head and --grid exclude each other: one head, or all");
    if (a->has_vmin && a->has_vmax && !(a->vmin < a->vmax))
        return fail(CLI_USAGE, "--vmin %g must be below --vmax %g", a->vmin, a->vmax);
    return CLI_OK;
}

/* The file's header first: its rank, dtype and size are checked before its
 * data is read (an empty or huge array is refused without loading it). */
static int check_header(const hm_args *a, int *rank_out, int64_t dims[4]) {
    attn_dtype dtype;
    int rank;
    int64_t shape[ATTN_MAX_RANK];
    attn_status st = attn_npy_read_header(a->weights, &dtype, &rank, shape);
    if (st != ATTN_OK) return cli_fail("reading -w", st);
    if (rank < 2 || rank > 4)
        return fail(CLI_RUNTIME,
                    "-w '%s' holds an array of rank %d; heatmap takes (L, S), (H, L, S) or "
                    "(N, H, L, S) weights",
                    a->weights, rank);
    if (dtype != ATTN_DTYPE_F32 && dtype != ATTN_DTYPE_F64 && dtype != ATTN_DTYPE_F16)
        return fail(CLI_RUNTIME,
                    "-w '%s' holds %s; heatmap takes float32, float64 or float16 weights",
                    a->weights, attn_dtype_name(dtype));
    /* (attn_npy_read_header refuses a dimension of 0: "array is empty".) */
    for (int d = 0; d < 4; d++) dims[d] = d < 4 - rank ? 1 : shape[d - (4 - rank)];
    /* The image limits at 1 px a cell, before the data is read. */
    if (dims[2] > MAX_SIDE_CELLS || dims[3] > MAX_SIDE_CELLS || dims[2] * dims[3] > MAX_CELLS)
        return fail(CLI_RUNTIME,
                    "-w '%s' has L = %lld queries and S = %lld keys; a heatmap draws at "
                    "most %d a side and 32 Mi cells (1 px each): slice the weights",
                    a->weights, (long long)dims[2], (long long)dims[3], MAX_SIDE_CELLS);
    *rank_out = rank;
    return CLI_OK;
}

/* Which heads of which batch element: the options against the shape. */
static int select_heads(const hm_args *a, int rank, const int64_t dims[4], hm_plot *p) {
    if (a->batch >= 0 && rank < 4)
        return fail(CLI_USAGE, "--batch: the weights have no batch dimension (rank %d)", rank);
    if (a->batch >= dims[0])
        return fail(CLI_USAGE, "--batch %lld: the weights have N = %lld (0 to %lld)", a->batch,
                    (long long)dims[0], (long long)dims[0] - 1);
    if (a->head >= 0 && rank < 3)
        return fail(CLI_USAGE, "--head: the weights (L, S) have no head dimension");
    if (a->head >= dims[1])
        return fail(CLI_USAGE, "--head %lld: the weights have H = %lld heads (0 to %lld)",
                    a->head, (long long)dims[1], (long long)dims[1] - 1);
    if (dims[1] > 1 && a->head < 0 && !a->grid)
        return fail(CLI_USAGE,
                    "the weights have H = %lld heads: choose one with --head N (0 to %lld), "
                    "or draw them all with --grid",
                    (long long)dims[1], (long long)dims[1] - 1);
    p->heads_total = dims[1];
    p->L = dims[2];
    p->S = dims[3];
    p->batch = a->batch > 0 ? a->batch : 0;
    p->head0 = a->head > 0 ? a->head : 0;
    p->nheads = a->grid ? dims[1] : 1;
    p->titled = rank >= 3;
    p->grid = a->grid;
    return CLI_OK;
}

/* The colour scale, and the counts of weights that are not numbers. */
static int set_range(const hm_args *a, hm_plot *p) {
    double lo = INFINITY, hi = -INFINITY;
    for (int64_t h = p->head0; h < p->head0 + p->nheads; h++)
        for (int64_t i = 0; i < p->L; i++)
            for (int64_t j = 0; j < p->S; j++) {
                const double v = hm_value(p, h, i, j);
                if (isfinite(v)) {
                    lo = v < lo ? v : lo;
                    hi = v > hi ? v : hi;
                } else {
                    p->nonfinite[isnan(v) ? 0 : v > 0 ? 1 : 2]++;
                }
            }
    if (lo > hi) lo = 0, hi = 1; /* nothing finite: any scale will do */
    p->vmin = a->has_vmin ? a->vmin : lo;
    p->vmax = a->has_vmax ? a->vmax : hi;
    if (p->vmin > p->vmax)
        return fail(CLI_RUNTIME,
                    "%s %g is %s every finite weight drawn (%g to %g): give both --vmin and "
                    "--vmax",
                    a->has_vmin ? "--vmin" : "--vmax", a->has_vmin ? a->vmin : a->vmax,
                    a->has_vmin ? "above" : "below", lo, hi);
    return CLI_OK;
}

/* Token files against L and S; the keys default to the queries' tokens. */
static int read_tokens(const hm_args *a, hm_plot *p, hm_tokens *rows, hm_tokens *cols) {
    int rc = CLI_OK;
    if (a->tokens) rc = hm_tokens_read("--tokens", a->tokens, p->L, "queries (L)", rows);
    if (rc == CLI_OK && a->key_tokens)
        rc = hm_tokens_read("--key-tokens", a->key_tokens, p->S, "keys (S)", cols);
    p->rows = a->tokens ? rows : NULL;
    p->cols = a->key_tokens ? cols : a->tokens && p->L == p->S ? rows : NULL;
    return rc;
}

static void print_summary(const hm_args *a, const attn_tensor *w, const hm_plot *p,
                          const hm_image *img) {
    char shape[96], heads[64] = "";
    int width, height, cell;
    hm_image_size(img, &width, &height, &cell);
    if (w->rank == 4) snprintf(heads, sizeof heads, ", batch %lld", (long long)p->batch);
    size_t used = strlen(heads);
    if (p->grid && p->nheads > 1)
        snprintf(heads + used, sizeof heads - used, ", heads 0-%lld", (long long)p->nheads - 1);
    else if (w->rank >= 3)
        snprintf(heads + used, sizeof heads - used, ", head %lld", (long long)p->head0);
    printf("heatmap: weights %s %s%s, %d px cells, scale %.6g to %.6g", cli_shape(w, shape,
           sizeof shape), attn_dtype_name(w->dtype), heads, cell, p->vmin, p->vmax);
    static const char *const kinds[3] = {"NaN (magenta)", "+inf (red)", "-inf (black)"};
    for (int k = 0; k < 3; k++)
        if (p->nonfinite[k] > 0) printf(", %lld %s", (long long)p->nonfinite[k], kinds[k]);
    printf(" -> %s (%d x %d px)\n", a->out, width, height);
}

static int run(const hm_args *a, attn_tensor *w, hm_tokens *rows, hm_tokens *cols,
               hm_image **img) {
    int64_t dims[4] = {0, 0, 0, 0};
    int rank = 0;
    hm_plot p;
    memset(&p, 0, sizeof p);
    int rc = check_header(a, &rank, dims);
    if (rc == CLI_OK) rc = select_heads(a, rank, dims, &p);
    if (rc == CLI_OK) rc = outputs_input("-w", a->weights);
    if (rc == CLI_OK) rc = outputs_input("--tokens", a->tokens);
    if (rc == CLI_OK) rc = outputs_input("--key-tokens", a->key_tokens);
    if (rc == CLI_OK) rc = outputs_add("-o", a->out); /* a missing folder fails now */
    if (rc == CLI_OK) rc = read_tokens(a, &p, rows, cols);
    attn_status st = rc == CLI_OK ? attn_npy_load(a->weights, w) : ATTN_OK;
    if (st != ATTN_OK) rc = cli_fail("reading -w", st);
    if (rc != CLI_OK) return rc;
    p.data = w->data;
    p.dtype = w->dtype;
    p.cell = a->cell;
    p.cell_option = a->cell > 0 ? "--cell" : NULL;
    rc = set_range(a, &p);
    if (rc == CLI_OK) rc = hm_draw(&p, a->print_layout, img);
    if (rc == CLI_OK) rc = outputs_stage_with("-o", hm_write_png, *img);
    if (rc == CLI_OK) print_summary(a, w, &p, *img); /* before the commit, which checks it */
    if (rc == CLI_OK) rc = outputs_commit();
    return rc;
}

int cli_heatmap(int argc, char **argv) {
    hm_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc == PARSED_HELP) {
        printf("usage: attn heatmap -w WEIGHTS.npy -o OUT.png [options]\n\n%s",
               cli_heatmap_options);
        return CLI_OK;
    }
    if (rc != CLI_OK) return rc;
    attn_tensor w;
    memset(&w, 0, sizeof w);
    hm_tokens rows, cols;
    memset(&rows, 0, sizeof rows);
    memset(&cols, 0, sizeof cols);
    hm_image *img = NULL;
    rc = run(&a, &w, &rows, &cols, &img);
    if (rc != CLI_OK) outputs_abort(); /* removes any temporary */
    hm_image_free(img);
    hm_tokens_free(&rows);
    hm_tokens_free(&cols);
    attn_npy_free(&w);
    return rc;
}
