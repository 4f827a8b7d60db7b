/*
 * test_heatmap.c — `attn heatmap` looked at: the PNG is decoded (cairo,
 * through libpng) and read back through the colour map. For random weight
 * matrices with a clear maximum per row, every cell of the L x S grid at
 * the place --print-layout gives is one uniform colour that inverts to its
 * weight within the map's quantisation, the brightest cell of each row is
 * the row's argmax, the colour bar runs from the last colour to the first,
 * token labels put text beside every row and above every column, and NaN
 * and infinities get their own colours. Then hostile inputs: each a clear
 * error (exit 1 or 2) that names the argument, and no file written.
 *
 * In a build without cairo, the command must say so (and this is all).
 */
#define _GNU_SOURCE /* popen, mkdtemp */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "testutil.h"

#ifdef ATTN_TEST_HEATMAP
#include <cairo.h>

#include "colormap.h"
#endif

#ifndef ATTN_CLI
#error "ATTN_CLI must name the attn executable"
#endif

static char dir[64];
static char log_[1 << 16];

/* Runs `attn <args>` in the test folder; stdout+stderr in log_. */
static int run(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd %s && '%s' %s 2>&1", dir, ATTN_CLI, args);
    FILE *p = popen(cmd, "r");
    size_t n = p ? fread(log_, 1, sizeof log_ - 1, p) : 0;
    log_[n] = '\0';
    int status = p ? pclose(p) : -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void path_of(char *buf, size_t size, const char *name) {
    snprintf(buf, size, "%s/%s", dir, name);
}

static bool exists(const char *name) {
    char path[256];
    path_of(path, sizeof path, name);
    return access(path, F_OK) == 0;
}

#ifdef ATTN_TEST_HEATMAP

static void write_text(const char *name, const char *text) {
    char path[256];
    path_of(path, sizeof path, name);
    CHECK(tt_write_file(path, text, strlen(text)) == 0, "writing %s", name);
}

/* Saves n values as a C-order .npy of the given dtype and shape. */
static void save(const char *name, const double *v, attn_dtype dtype, int rank,
                 const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++) n *= shape[d];
    void *data = malloc((size_t)n * attn_dtype_size(dtype));
    for (int64_t i = 0; i < n; i++) {
        if (dtype == ATTN_DTYPE_F32)
            ((float *)data)[i] = (float)v[i];
        else
            ((double *)data)[i] = v[i];
    }
    attn_tensor t;
    char path[256];
    path_of(path, sizeof path, name);
    CHECK_OK(attn_tensor_init(&t, data, dtype, rank, shape));
    CHECK_OK(attn_npy_save(path, &t));
    free(data);
}

/* No temporary (".NAME.XXXXXXXX.tmp") left in the folder. */
static int temporaries(void) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d)) != NULL;)
        n += e->d_name[0] == '.' && strstr(e->d_name, ".tmp") != NULL;
    if (d) closedir(d);
    return n;
}

/* ---- the layout the tool prints, and the decoded image ---- */

enum { MAX_PANELS = 16, WHITE = 0xffffff };

typedef struct layout {
    int width, height, cell, font, row_w, col_h, bar_x, bar_y, bar_w, bar_h, panels;
    double vmin, vmax;
    int head[MAX_PANELS], x[MAX_PANELS], y[MAX_PANELS], rows[MAX_PANELS], cols[MAX_PANELS];
} layout;

static bool parse_layout(const char *out, layout *l) {
    memset(l, 0, sizeof *l);
    int found = 0;
    for (const char *s = strstr(out, "layout "); s; s = strstr(s + 1, "\nlayout ")) {
        if (*s == '\n') s++;
        int k, h, x, y, r, c;
        found += sscanf(s, "layout image %d %d", &l->width, &l->height) == 2;
        found += sscanf(s, "layout cell %d font %d", &l->cell, &l->font) == 2;
        found += sscanf(s, "layout labels %d %d", &l->row_w, &l->col_h) == 2;
        found += sscanf(s, "layout colorbar %d %d %d %d", &l->bar_x, &l->bar_y, &l->bar_w,
                        &l->bar_h) == 4;
        found += sscanf(s, "layout scale %lf %lf", &l->vmin, &l->vmax) == 2;
        if (sscanf(s, "layout panel %d head %d grid %d %d rows %d cols %d", &k, &h, &x, &y, &r,
                   &c) == 6 && k == l->panels && k < MAX_PANELS) {
            l->head[k] = h, l->x[k] = x, l->y[k] = y, l->rows[k] = r, l->cols[k] = c;
            l->panels++;
        }
    }
    return found == 5 && l->panels > 0;
}

typedef struct image {
    cairo_surface_t *s;
    int width, height, stride;
    const unsigned char *data;
} image;

static bool load_png(const char *name, image *im) {
    char path[256];
    path_of(path, sizeof path, name);
    im->s = cairo_image_surface_create_from_png(path);
    if (cairo_surface_status(im->s) != CAIRO_STATUS_SUCCESS) return false;
    im->width = cairo_image_surface_get_width(im->s);
    im->height = cairo_image_surface_get_height(im->s);
    im->stride = cairo_image_surface_get_stride(im->s);
    im->data = cairo_image_surface_get_data(im->s);
    /* An RGB PNG decodes as RGB24; an alpha channel would mean we wrote one. */
    return cairo_image_surface_get_format(im->s) == CAIRO_FORMAT_RGB24;
}

/* Draws weights into png with the default options; the layout printed and
 * the image read back (false, and the log in log_, when any step fails). */
static bool draw(const char *weights, const char *png, layout *l, image *im) {
    char args[256];
    snprintf(args, sizeof args, "heatmap -w %s -o %s --print-layout", weights, png);
    return run(args) == 0 && parse_layout(log_, l) && load_png(png, im);
}

static uint32_t pixel(const image *im, int x, int y) {
    if (x < 0 || y < 0 || x >= im->width || y >= im->height) return 0xdeadbeef;
    return ((const uint32_t *)(const void *)(im->data + (size_t)y * (size_t)im->stride))[x] &
           0xffffff;
}

/* The colour-map indices painted rgb: [*lo, *hi] (neighbours can share a
 * colour); false when rgb is no colour of the map. */
static bool invert(uint32_t rgb, int *lo, int *hi) {
    *lo = *hi = -1;
    for (int i = 0; i < CMAP_SIZE; i++) {
        const unsigned char *c = cmap_viridis[i];
        if (((uint32_t)c[0] << 16 | (uint32_t)c[1] << 8 | c[2]) != rgb) continue;
        if (*lo < 0) *lo = i;
        *hi = i;
    }
    return *lo >= 0;
}

/* Every pixel of the c x c cell at (x, y) has one colour: returned, or
 * 0xdeadbeef when it is not uniform. */
static uint32_t cell_colour(const image *im, int x, int y, int c) {
    const uint32_t first = pixel(im, x, y);
    for (int r = y; r < y + c; r++)
        for (int q = x; q < x + c; q++)
            if (pixel(im, q, r) != first) return 0xdeadbeef;
    return first;
}

/* Pixels darker than mid-grey in a rectangle: text. */
static int dark_pixels(const image *im, int x0, int y0, int x1, int y1) {
    int n = 0;
    for (int y = y0; y < y1; y++)
        for (int x = x0; x < x1; x++) {
            uint32_t p = pixel(im, x, y);
            n += ((p >> 16 & 255) + (p >> 8 & 255) + (p & 255)) < 3 * 128;
        }
    return n;
}

/* ---- random weights with a clear maximum per row ---- */

typedef struct weights {
    int rank;
    int64_t shape[4], N, H, L, S; /* shape as saved; N, H = 1 when absent */
    double *v;                    /* (N, H, L, S), as stored (float32-rounded) */
} weights;

/* Softmax rows (random sizes where L, S are 0) whose largest weight leads
 * the next by 0.04: the picture's scale is at most 1 wide, so that is ten
 * colour bins or more. */
static void make_weights(weights *w, rng *r, int rank, attn_dtype dtype, int64_t L, int64_t S) {
    w->rank = rank;
    w->N = rank == 4 ? rng_int(r, 1, 2) : 1;
    w->H = rank >= 3 ? rng_int(r, 1, 4) : 1;
    w->L = L > 0 ? L : rng_int(r, 1, 12);
    w->S = S > 0 ? S : rng_int(r, 2, 14);
    const int64_t all[4] = {w->N, w->H, w->L, w->S};
    for (int d = 0; d < rank; d++) w->shape[d] = all[4 - rank + d];
    w->v = malloc(sizeof(double) * (size_t)(w->N * w->H * w->L * w->S));
    for (int64_t row = 0; row < w->N * w->H * w->L; row++) {
        double *x = w->v + row * w->S, sum = 0, top, second;
        do {
            sum = 0;
            for (int64_t j = 0; j < w->S; j++) sum += x[j] = exp(2 * rng_normal(r));
            top = second = 0;
            /* Through a volatile float: GCC 12.2 at -O3 vectorized
             * "x[j] = (float)x[j]" here and left the loop's tail unrounded
             * (with S = 6 known after inlining). */
            for (int64_t j = 0; j < w->S; j++) {
                volatile float f = (float)(x[j] / sum);
                x[j] = dtype == ATTN_DTYPE_F32 ? (double)f : x[j] / sum;
            }
            for (int64_t j = 0; j < w->S; j++) {
                if (x[j] > top) second = top, top = x[j];
                else if (x[j] > second) second = x[j];
            }
        } while (top - second < 0.04);
    }
}

static double at(const weights *w, int64_t n, int64_t h, int64_t i, int64_t j) {
    return w->v[((n * w->H + h) * w->L + i) * w->S + j];
}

/* The picture of batch element n: every panel against the weights. */
static void check_picture(const weights *w, const layout *l, const image *im, int64_t n,
                          bool ties, const char *what) {
    double lo_w = INFINITY, hi_w = -INFINITY;
    for (int k = 0; k < l->panels; k++)
        for (int64_t i = 0; i < w->L; i++)
            for (int64_t j = 0; j < w->S; j++) {
                const double v = at(w, n, l->head[k], i, j);
                lo_w = v < lo_w ? v : lo_w;
                hi_w = v > hi_w ? v : hi_w;
            }
    CHECK(l->vmin == lo_w && l->vmax == hi_w, "%s: scale %.17g..%.17g, weights %.17g..%.17g",
          what, l->vmin, l->vmax, lo_w, hi_w);
    CHECK(im->width == l->width && im->height == l->height, "%s: PNG %dx%d, layout %dx%d", what,
          im->width, im->height, l->width, l->height);
    const double bin = (l->vmax - l->vmin) / CMAP_SIZE, c = l->cell;
    int bad = 0, argmax_bad = 0;
    for (int k = 0; k < l->panels; k++) {
        CHECK(l->rows[k] == w->L && l->cols[k] == w->S, "%s: panel %d is %dx%d, weights %lldx%lld",
              what, k, l->rows[k], l->cols[k], (long long)w->L, (long long)w->S);
        for (int64_t i = 0; i < w->L; i++) {
            int brightest = -1, best = -1;
            int64_t want = 0;
            for (int64_t j = 0; j < w->S; j++) {
                const double v = at(w, n, l->head[k], i, j);
                if (v > at(w, n, l->head[k], i, want)) want = j;
                const uint32_t rgb = cell_colour(im, l->x[k] + (int)(j * c), l->y[k] + (int)(i * c),
                                                 l->cell);
                int a, b;
                if (!invert(rgb, &a, &b)) {
                    if (bad++ < 5) CHECK(0, "%s: cell (%lld, %lld) of panel %d: colour %06x is "
                                         "not one of the map (or not uniform)", what, (long long)i,
                                         (long long)j, k, rgb);
                    continue;
                }
                /* The weight lies in the bins of the colour (a float's width of slack). */
                const double lo = l->vmin + a * bin, hi = l->vmin + (b + 1) * bin,
                             eps = 1e-12 + 1e-7 * fabs(v);
                if (!(v >= lo - eps && v <= hi + eps) && bad++ < 5)
                    CHECK(0, "%s: cell (%lld, %lld) shows %.6g..%.6g, weight %.9g", what,
                          (long long)i, (long long)j, lo, hi, v);
                if (a > best) best = a, brightest = (int)j;
            }
            /* ties: real weights may have near-equal maxima, one bin apart. */
            const bool ok = brightest == (int)want ||
                            (ties && brightest >= 0 &&
                             at(w, n, l->head[k], i, brightest) >=
                                 at(w, n, l->head[k], i, want) - bin);
            if (!ok && argmax_bad++ < 5)
                CHECK(0, "%s: row %lld's brightest cell is %d, its argmax %lld", what,
                      (long long)i, brightest, (long long)want);
        }
        /* Exactly L x S cells: white just right of and below the grid. */
        CHECK(pixel(im, l->x[k] + (int)(w->S * c), l->y[k] + l->cell / 2) == WHITE &&
                  pixel(im, l->x[k] + l->cell / 2, l->y[k] + (int)(w->L * c)) == WHITE,
              "%s: panel %d: cells beyond %lldx%lld", what, k, (long long)w->L, (long long)w->S);
    }
    CHECK(bad == 0 && argmax_bad == 0, "%s: %d wrong cells, %d wrong argmaxes", what, bad,
          argmax_bad);
}

/* The colour bar: uniform rows, from the last colour down to the first. */
static void check_bar(const layout *l, const image *im, const char *what) {
    int prev = CMAP_SIZE, top = -1, bottom = -1, bad = 0;
    for (int r = 0; r < l->bar_h; r++) {
        const uint32_t rgb = pixel(im, l->bar_x, l->bar_y + r);
        int a, b;
        bool ok = invert(rgb, &a, &b) && pixel(im, l->bar_x + l->bar_w - 1, l->bar_y + r) == rgb;
        if (ok && a > prev) ok = false;
        bad += !ok;
        prev = a;
        if (r == 0) top = b;
        bottom = a;
    }
    CHECK(bad == 0 && top == CMAP_SIZE - 1 && bottom == 0,
          "%s: colour bar: %d bad rows, top %d, bottom %d", what, bad, top, bottom);
    CHECK(pixel(im, l->bar_x - 1, l->bar_y + 1) == WHITE &&
              pixel(im, l->bar_x + 1, l->bar_y - 1) == WHITE,
          "%s: colour bar not where the layout says", what);
}

/* The documented rules (heatmap_cmd.c): the first grid 8 px in, after the
 * labels and an 18 px title when there are heads; panels in rows of
 * ceil(sqrt(n)), 16 px apart, equally spaced; the colour bar 16 px right
 * of the panels, level with the first grid's top. */
static void check_rules(const layout *l, bool titled, const char *what) {
    int gcols = 1;
    while (gcols * gcols < l->panels) gcols++;
    const int c = l->cell, top = 8 + (titled ? 18 : 0) + l->col_h;
    CHECK(l->x[0] == 8 + l->row_w && l->y[0] == top, "%s: first grid at (%d, %d)", what, l->x[0],
          l->y[0]);
    const int dx = l->panels > 1 ? l->x[1] - l->x[0] : 0,
              dy = l->rows[0] * c + top - 8 + 16;
    for (int k = 1; k < l->panels; k++)
        CHECK(l->x[k] == l->x[0] + (k % gcols) * dx && l->y[k] == l->y[0] + (k / gcols) * dy &&
                  dx >= l->row_w + l->cols[0] * c + 16,
              "%s: panel %d at (%d, %d), spacing %d, %d", what, k, l->x[k], l->y[k], dx, dy);
    const int right = l->x[gcols - 1 < l->panels ? gcols - 1 : 0] + l->cols[0] * c;
    CHECK(l->bar_y == top && l->bar_x >= right + 16 && (l->panels > 1 || l->bar_x == right + 16 ||
                                                        titled),
          "%s: colour bar at (%d, %d), grids end at %d", what, l->bar_x, l->bar_y, right);
}

static void cells_show_the_weights(void) {
    rng r = {harness_seed() ^ 0x4ea7};
    for (int trial = 0; trial < 24; trial++) {
        const int rank = 2 + trial % 3;
        const attn_dtype dtype = trial % 2 ? ATTN_DTYPE_F64 : ATTN_DTYPE_F32;
        weights w;
        make_weights(&w, &r, rank, dtype, 0, 0);
        save("w.npy", w.v, dtype, rank, w.shape);
        const bool grid = rank >= 3 && rng_int(&r, 0, 1);
        const int64_t n = rank == 4 ? rng_int(&r, 0, w.N - 1) : 0;
        const int64_t head = rank >= 3 ? rng_int(&r, 0, w.H - 1) : 0;
        const int cell = trial % 4 == 0 ? 0 : (int)rng_int(&r, 1, 30);
        char args[256], what[300];
        int used = snprintf(args, sizeof args, "heatmap -w w.npy -o out.png --print-layout");
        if (grid) used += snprintf(args + used, sizeof args - (size_t)used, " --grid");
        if (rank >= 3 && !grid)
            used += snprintf(args + used, sizeof args - (size_t)used, " --head %lld",
                             (long long)head);
        if (rank == 4) used += snprintf(args + used, sizeof args - (size_t)used, " --batch %lld",
                                        (long long)n);
        if (cell) snprintf(args + used, sizeof args - (size_t)used, " --cell %d", cell);
        snprintf(what, sizeof what, "trial %d (%s, %lld x %lld)", trial, args, (long long)w.L,
                 (long long)w.S);
        int rc = run(args);
        layout l;
        image im = {0};
        CHECK(rc == 0 && parse_layout(log_, &l), "%s: exit %d:\n%s", what, rc, log_);
        if (rc == 0 && parse_layout(log_, &l)) {
            CHECK(l.panels == (grid ? w.H : 1) && (grid || l.head[0] == head),
                  "%s: %d panels, first head %d", what, l.panels, l.head[0]);
            CHECK(cell == 0 || l.cell == cell, "%s: cell %d", what, l.cell);
            check_rules(&l, rank >= 3, what);
            CHECK(load_png("out.png", &im), "%s: out.png does not decode as RGB", what);
            if (im.data) {
                check_picture(&w, &l, &im, n, false, what);
                check_bar(&l, &im, what);
            }
        }
        if (im.s) cairo_surface_destroy(im.s);
        free(w.v);
    }
    CHECK(temporaries() == 0, "temporaries left");
}

/* Tokens put text beside each row and above each column; without them the
 * margins are gone. */
static void labels_show(void) {
    rng r = {harness_seed() ^ 0x1abe1};
    weights w;
    make_weights(&w, &r, 2, ATTN_DTYPE_F32, 6, 6);
    save("sq.npy", w.v, ATTN_DTYPE_F32, 2, w.shape);
    char tokens[4096] = "";
    for (int64_t i = 0; i < w.L; i++) /* the last one far too long for the margin */
        snprintf(tokens + strlen(tokens), sizeof tokens - strlen(tokens), "%s\n",
                 i == w.L - 1 ? "an-extremely-long-token-that-cannot-fit-in-the-margin-"
                                "of-one-hundred-and-sixty-pixels-and-is-ellipsized"
                              : i % 2 ? "tok" : "Wörd");
    write_text("tokens.txt", tokens);
    layout plain, labelled;
    image a = {0}, b = {0};
    CHECK(run("heatmap -w sq.npy -o plain.png --print-layout") == 0 &&
              parse_layout(log_, &plain) && load_png("plain.png", &a),
          "plain: %s", log_);
    CHECK(run("heatmap -w sq.npy -o labelled.png --print-layout --tokens tokens.txt") == 0 &&
              parse_layout(log_, &labelled) && load_png("labelled.png", &b),
          "labelled: %s", log_);
    if (a.data && b.data) {
        CHECK(plain.row_w == 0 && plain.col_h == 0, "labels without tokens");
        CHECK(labelled.row_w > 0 && labelled.row_w <= 164 && labelled.col_h > 0 &&
                  labelled.col_h <= 164 && b.width == a.width + labelled.row_w &&
                  b.height == a.height + labelled.col_h,
              "label margins %d, %d (image %dx%d, without %dx%d)", labelled.row_w,
              labelled.col_h, b.width, b.height, a.width, a.height);
        check_picture(&w, &labelled, &b, 0, false, "labelled");
        const int x = labelled.x[0], y = labelled.y[0], c = labelled.cell;
        for (int64_t i = 0; i < w.L; i++)
            CHECK(dark_pixels(&b, x - labelled.row_w, y + (int)i * c, x, y + (int)(i + 1) * c) >= 5,
                  "no text left of row %lld", (long long)i);
        for (int64_t j = 0; j < w.S; j++)
            CHECK(dark_pixels(&b, x + (int)j * c, y - labelled.col_h, x + (int)(j + 1) * c, y) >= 5,
                  "no text above column %lld", (long long)j);
        /* Text stays out of the cells and the plain margins stay blank. */
        CHECK(dark_pixels(&a, 0, 0, plain.x[0], a.height) == 0, "text in the plain image");
    }
    if (a.s) cairo_surface_destroy(a.s);
    if (b.s) cairo_surface_destroy(b.s);
    /* L != S: --tokens labels the rows only, --key-tokens the columns. */
    const int64_t shape[2] = {2, 3};
    const double v[6] = {0.1, 0.6, 0.3, 0.5, 0.2, 0.3};
    save("rect.npy", v, ATTN_DTYPE_F64, 2, shape);
    write_text("q2.txt", "a\nb\n");
    write_text("k3.txt", "x\r\ny\r\nz"); /* CRLF, no final newline */
    CHECK(run("heatmap -w rect.npy -o r.png --print-layout --tokens q2.txt") == 0 &&
              parse_layout(log_, &labelled) && labelled.row_w > 0 && labelled.col_h == 0,
          "rows only: %s", log_);
    CHECK(run("heatmap -w rect.npy -o r.png --print-layout --key-tokens k3.txt") == 0 &&
              parse_layout(log_, &labelled) && labelled.row_w == 0 && labelled.col_h > 0,
          "columns only: %s", log_);
    /* Cells too small for text: labels left out, with a note. */
    CHECK(run("heatmap -w sq.npy -o tiny.png --print-layout --tokens tokens.txt --cell 3") == 0 &&
              parse_layout(log_, &labelled) && labelled.row_w == 0 && strstr(log_, "too small"),
          "3 px cells: %s", log_);
    free(w.v);
}

/* NaN, +inf and -inf cells in their colours, named in a legend; the
 * scale is the finite weights'. */
static void nonfinite_cells(void) {
    const int64_t shape[2] = {3, 4};
    const double v[12] = {NAN, 0.2, 0.3, 0.5, 0.1, INFINITY, 0.4, 0.5, 0.25, 0.25, -INFINITY, 0.5};
    save("nf.npy", v, ATTN_DTYPE_F32, 2, shape);
    layout l;
    image im = {0};
    CHECK(draw("nf.npy", "nf.png", &l, &im), "%s", log_);
    CHECK(strstr(log_, "1 NaN") && strstr(log_, "1 +inf") && strstr(log_, "1 -inf"),
          "summary: %s", log_);
    if (im.data) {
        CHECK(l.vmin == 0.1f && l.vmax == 0.5, "scale %g..%g", l.vmin, l.vmax);
        const int c = l.cell;
        CHECK(cell_colour(&im, l.x[0], l.y[0], c) == CMAP_NAN_RGB &&
                  cell_colour(&im, l.x[0] + c, l.y[0] + c, c) == CMAP_PINF_RGB &&
                  cell_colour(&im, l.x[0] + 2 * c, l.y[0] + 2 * c, c) == CMAP_NINF_RGB,
              "non-finite cells");
        int swatches[3] = {0, 0, 0};
        for (int y = l.bar_y + l.bar_h; y < im.height; y++)
            for (int x = l.bar_x; x < im.width; x++) {
                uint32_t p = pixel(&im, x, y);
                swatches[0] += p == CMAP_NAN_RGB, swatches[1] += p == CMAP_PINF_RGB,
                    swatches[2] += p == CMAP_NINF_RGB;
            }
        CHECK(swatches[0] >= 100 && swatches[1] >= 100 && swatches[2] >= 100,
              "legend swatches %d %d %d", swatches[0], swatches[1], swatches[2]);
        CHECK(dark_pixels(&im, l.bar_x + 14, l.bar_y + l.bar_h + 8, im.width, im.height) > 20,
              "legend text");
    }
    if (im.s) cairo_surface_destroy(im.s);
    /* --vmin/--vmax: weights beyond take the end colours. */
    CHECK(run("heatmap -w nf.npy -o nf.png --print-layout --vmin 0.25 --vmax 0.3") == 0 &&
              parse_layout(log_, &l) && load_png("nf.png", &im) && l.vmin == 0.25 &&
              l.vmax == 0.3,
          "%s", log_);
    if (im.data) {
        int a, b;
        CHECK(invert(cell_colour(&im, l.x[0] + l.cell, l.y[0], l.cell), &a, &b) && a == 0,
              "0.2 below --vmin 0.25: index %d", a);
        CHECK(invert(cell_colour(&im, l.x[0] + 3 * l.cell, l.y[0], l.cell), &a, &b) &&
                  b == CMAP_SIZE - 1,
              "0.5 above --vmax 0.3: index %d", b);
    }
    if (im.s) cairo_surface_destroy(im.s);
    /* A constant matrix: every cell the first colour. */
    const double same[4] = {0.5, 0.5, 0.5, 0.5};
    save("const.npy", same, ATTN_DTYPE_F64, 2, (const int64_t[]){2, 2});
    CHECK(draw("const.npy", "c.png", &l, &im), "%s", log_);
    if (im.data) {
        int a, b;
        CHECK(invert(cell_colour(&im, l.x[0] + l.cell, l.y[0] + l.cell, l.cell), &a, &b) && a == 0,
              "constant: index %d", a);
    }
    if (im.s) cairo_surface_destroy(im.s);
}

static void hostile_inputs(void) {
    const int64_t s2[2] = {3, 4}, s3[3] = {2, 3, 4}, s4[4] = {2, 2, 3, 4}, s1[1] = {4},
                  s5[5] = {1, 1, 1, 3, 4}, wide[2] = {2, 20000}, mid[2] = {1500, 1500};
    double *v = calloc(2 * 20000, sizeof(double));
    for (int i = 0; i < 2 * 20000; i++) v[i] = 0.25;
    save("w2.npy", v, ATTN_DTYPE_F32, 2, s2);
    save("w3.npy", v, ATTN_DTYPE_F32, 3, s3);
    save("w4.npy", v, ATTN_DTYPE_F64, 4, s4);
    save("w1.npy", v, ATTN_DTYPE_F32, 1, s1);
    save("w5.npy", v, ATTN_DTYPE_F32, 5, s5);
    save("wide.npy", v, ATTN_DTYPE_F32, 2, wide);
    free(v);
    v = calloc(1500 * 1500, sizeof(double));
    save("mid.npy", v, ATTN_DTYPE_F32, 2, mid);
    free(v);
    unsigned char b[4] = {1, 0, 1, 1};
    attn_tensor bt;
    char path[256];
    path_of(path, sizeof path, "bool.npy");
    CHECK_OK(attn_tensor_init(&bt, b, ATTN_DTYPE_BOOL, 2, (const int64_t[]){2, 2}));
    CHECK_OK(attn_npy_save(path, &bt));
    /* (0, 3): NumPy writes it, attn_npy_save refuses it. 128 bytes in all. */
    char empty[128] = "\x93NUMPY\x01\x00\x76\x00{'descr': '<f4', 'fortran_order': False, "
                      "'shape': (0, 3), }";
    const size_t text = 10 + strlen(empty + 10);
    memset(empty + text, ' ', 127 - text);
    empty[127] = '\n';
    path_of(path, sizeof path, "empty.npy");
    CHECK(tt_write_file(path, empty, sizeof empty) == 0, "empty.npy");
    /* A header for (8192, 8192) float64 over 16 bytes of data: 512 MiB the
     * tool must refuse without reading. */
    char huge[128] = "\x93NUMPY\x01\x00\x76\x00{'descr': '<f8', 'fortran_order': False, "
                     "'shape': (8192, 8192), }";
    const size_t hlen = 10 + strlen(huge + 10);
    memset(huge + hlen, ' ', 127 - hlen);
    huge[127] = '\n';
    path_of(path, sizeof path, "huge.npy");
    CHECK(tt_write_file(path, huge, sizeof huge) == 0, "huge.npy");
    write_text("three.txt", "a\nb\nc\n");
    write_text("four.txt", "a\nb\nc\nd\n");
    write_text("two.txt", "a\nb");
    write_text("blank.txt", "");
    struct {
        const char *args;
        int code;
        const char *needle;
    } cases[] = {
        {"heatmap -o x.png", 2, "-w"},
        {"heatmap -w w2.npy", 2, "-o OUT.png is required"},
        {"heatmap -w w2.npy -o x.png --bogus", 2, "unknown option"},
        {"heatmap -w w2.npy -o x.png --cell", 2, "needs a value"},
        {"heatmap -w w2.npy -o x.png --cell 0", 2, "--cell"},
        {"heatmap -w w2.npy -o x.png --cell 257", 2, "--cell"},
        {"heatmap -w w2.npy -o x.png --head -1", 2, "--head"},
        {"heatmap -w w2.npy -o x.png --vmin inf", 2, "--vmin"},
        {"heatmap -w w2.npy -o x.png --vmin 1 --vmax 1", 2, "--vmin"},
        {"heatmap -w w2.npy -o x.png --vmin 0.5", 1, "--vmin"},
        {"heatmap -w w2.npy -o x.png --vmax 0.1", 1, "--vmax"},
        {"heatmap -w w3.npy -o x.png --grid --head 0", 2, "--grid"},
        {"heatmap -w missing.npy -o x.png", 1, "missing.npy"},
        {"heatmap -w w1.npy -o x.png", 1, "rank 1"},
        {"heatmap -w w5.npy -o x.png", 1, "rank 5"},
        {"heatmap -w bool.npy -o x.png", 1, "float32, float64 or float16"},
        {"heatmap -w empty.npy -o x.png", 1, "empty"},
        {"heatmap -w three.txt -o x.png", 1, "three.txt"},
        {"heatmap -w w3.npy -o x.png", 2, "--head N"},
        {"heatmap -w w3.npy -o x.png --head 2", 2, "H = 2"},
        {"heatmap -w w2.npy -o x.png --head 0", 2, "--head"},
        {"heatmap -w w3.npy -o x.png --head 0 --batch 0", 2, "--batch"},
        {"heatmap -w w4.npy -o x.png --grid --batch 2", 2, "N = 2"},
        {"heatmap -w w2.npy -o x.png --tokens nothere.txt", 1, "nothere.txt"},
        {"heatmap -w w2.npy -o x.png --tokens four.txt", 1, "--tokens 'four.txt' has 4 tokens"},
        {"heatmap -w w2.npy -o x.png --tokens two.txt", 1, "has 2 tokens"},
        {"heatmap -w w2.npy -o x.png --tokens blank.txt", 1, "has 0 tokens"},
        {"heatmap -w w2.npy -o x.png --key-tokens three.txt", 1, "--key-tokens 'three.txt'"},
        {"heatmap -w w2.npy -o x.png --tokens .", 1, "--tokens '.'"},
        {"heatmap -w w2.npy -o x.png --tokens /dev/zero", 1, "64 MiB"},
        {"heatmap -w w2.npy -o nodir/x.png", 1, "nodir/x.png"},
        {"heatmap -w w2.npy -o .", 1, "-o '.'"},
        {"heatmap -w wide.npy -o x.png", 1, "S = 20000"},
        {"heatmap -w huge.npy -o x.png", 1, "32 Mi cells"}, /* refused from its header */
        {"heatmap -w mid.npy -o x.png --cell 12", 1, "--cell"},
        {"heatmap -w w2.npy -o /dev/full", 1, NULL}, /* strerror(ENOSPC) */
        {"heatmap --help", 0, "--key-tokens"},
        {"--help", 0, "attn heatmap"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        int rc = run(cases[i].args);
        const char *needle = cases[i].needle ? cases[i].needle : strerror(ENOSPC);
        CHECK(rc == cases[i].code && strstr(log_, needle) != NULL,
              "attn %s: exit %d (expected %d), message lacks '%s':\n%s", cases[i].args, rc,
              cases[i].code, needle, log_);
    }
    CHECK(!exists("x.png") && temporaries() == 0, "a failed run left a file");
    /* The automatic cell fits 1500 x 1500 in 1 px cells. */
    CHECK(run("heatmap -w mid.npy -o mid.png") == 0 && strstr(log_, "1 px cells"), "%s", log_);
}

/* A failure after the target was resolved leaves the old file as it was. */
static void failed_run_keeps_the_old_file(void) {
    const double v[6] = {0.5, 0.25, 0.25, 0, 1, 0};
    save("keep.npy", v, ATTN_DTYPE_F32, 2, (const int64_t[]){2, 3});
    write_text("keep.txt", "a\nb\nc\n");
    write_text("keep.png", "old");
    CHECK(run("heatmap -w keep.npy -o keep.png --tokens keep.txt") == 1, "%s", log_);
    char path[256];
    path_of(path, sizeof path, "keep.png");
    size_t n = 0;
    unsigned char *bytes = tt_read_file(path, &n);
    CHECK(bytes && n == 3 && memcmp(bytes, "old", 3) == 0 && temporaries() == 0,
          "keep.png changed");
    free(bytes);
    CHECK(run("heatmap -w keep.npy -o keep.png") == 0, "%s", log_);
    bytes = tt_read_file(path, &n);
    CHECK(bytes && n > 8 && memcmp(bytes, "\x89PNG", 4) == 0, "keep.png is not a PNG");
    free(bytes);
    /* Hostile test: -o over -w or --tokens turned the input into the PNG. */
    CHECK(run("heatmap -w keep.npy -o keep.npy") == 2 && strstr(log_, "is the file of -w"),
          "%s", log_);
    CHECK(run("heatmap -w keep.npy -o keep.txt --tokens keep.txt") == 2 &&
              strstr(log_, "is the file of --tokens"),
          "%s", log_);
    path_of(path, sizeof path, "keep.txt");
    bytes = tt_read_file(path, &n);
    CHECK(bytes && n == 6 && memcmp(bytes, "a\nb\nc\n", 6) == 0 && temporaries() == 0,
          "keep.txt changed");
    free(bytes);
}

/* The README's example: attn sdpa on docs/heatmap's inputs, its weights
 * drawn with the tokens (docs/heatmap_example.png is this picture). */
/* A scale wider than the largest double (the width vmax - vmin overflows)
 * still spreads the colours: every cell came out in the first colour. */
static void scale_wider_than_a_double(void) {
    CHECK(cmap_index(0, -1e308, 1e308) == CMAP_SIZE / 2, "0 in -1e308..1e308: %d",
          cmap_index(0, -1e308, 1e308));
    CHECK(cmap_index(1.7e308, -1.7e308, 1.7e308) == CMAP_SIZE - 1, "the top");
    CHECK(cmap_index(-1.7e308, -1.7e308, 1.7e308) == 0, "the bottom");
    CHECK(cmap_index(0.25, 0, 1) == CMAP_SIZE / 4, "an ordinary scale");
    const int64_t shape[2] = {2, 2};
    const double v[4] = {-1.7e308, 0, 1e307, 1.7e308};
    save("wide.npy", v, ATTN_DTYPE_F64, 2, shape);
    layout l;
    image im = {0};
    CHECK(draw("wide.npy", "wide.png", &l, &im), "%s", log_);
    if (im.data) {
        const int c = l.cell;
        CHECK(cell_colour(&im, l.x[0], l.y[0], c) != cell_colour(&im, l.x[0] + c, l.y[0] + c, c),
              "the smallest and the largest weight have one colour");
    }
    if (im.s) cairo_surface_destroy(im.s);
}

static void readme_example(void) {
    char args[1024];
    snprintf(args, sizeof args,
             "sdpa -q %s/docs/heatmap/q.npy -k %s/docs/heatmap/k.npy -v %s/docs/heatmap/v.npy "
             "--causal -o out.npy --weights w.npy",
             ATTN_SOURCE_DIR, ATTN_SOURCE_DIR, ATTN_SOURCE_DIR);
    CHECK(run(args) == 0, "%s", log_);
    snprintf(args, sizeof args,
             "heatmap -w w.npy --tokens %s/docs/heatmap/tokens.txt --grid -o example.png "
             "--print-layout", ATTN_SOURCE_DIR);
    layout l;
    image im = {0};
    CHECK(run(args) == 0 && parse_layout(log_, &l) && load_png("example.png", &im), "%s", log_);
    attn_tensor t;
    char path[256];
    path_of(path, sizeof path, "w.npy");
    CHECK_OK(attn_npy_load(path, &t));
    if (im.data && t.data && t.rank == 4) {
        weights w = {4, {0}, t.shape[0], t.shape[1], t.shape[2], t.shape[3], NULL};
        const int64_t n = t.shape[0] * t.shape[1] * t.shape[2] * t.shape[3];
        w.v = malloc(sizeof(double) * (size_t)n);
        for (int64_t i = 0; i < n; i++) w.v[i] = ((const float *)t.data)[i];
        CHECK(l.panels == 2 && l.row_w > 0 && l.col_h > 0, "panels %d, labels %d %d", l.panels,
              l.row_w, l.col_h);
        check_rules(&l, true, "README example");
        check_picture(&w, &l, &im, 0, true, "README example");
        check_bar(&l, &im, "README example");
        free(w.v);
    }
    attn_npy_free(&t);
    if (im.s) cairo_surface_destroy(im.s);
}

static void info_says_built(void) {
    CHECK(run("info") == 0 && strstr(log_, "heatmap: yes (cairo"), "%s", log_);
}

#else /* built without cairo */

static void says_not_built(void) {
    CHECK(run("heatmap -w w.npy -o x.png") == 1 &&
              strstr(log_, "built without heatmap support") && strstr(log_, "libcairo2-dev"),
          "%s", log_);
    CHECK(!exists("x.png"), "x.png written");
    CHECK(run("info") == 0 && strstr(log_, "heatmap: no"), "%s", log_);
}

#endif

int main(int argc, char **argv) {
    snprintf(dir, sizeof dir, "/tmp/attn_heatmap_XXXXXX");
    if (mkdtemp(dir) == NULL) return 1;
    static const harness_test tests[] = {
#ifdef ATTN_TEST_HEATMAP
        T(cells_show_the_weights), T(labels_show), T(nonfinite_cells), T(hostile_inputs),
        T(failed_run_keeps_the_old_file), T(scale_wider_than_a_double), T(readme_example),
        T(info_says_built),
#else
        T(says_not_built),
#endif
    };
    int rc = harness_main(argc, argv, tests, (int)(sizeof tests / sizeof tests[0]));
#ifdef ATTN_TEST_HEATMAP
    cairo_debug_reset_static_data();
#endif
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return rc;
}
