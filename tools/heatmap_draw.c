/*
 * heatmap_draw.c — the heatmap's layout, pixels and text (cairo), and its
 * PNG (cairo through libpng). The layout's rules are in heatmap_cmd.c.
 *
 * Cells, the colour bar and the legend's swatches are written straight
 * into the image's pixels, so that every cell is exactly its colour-map
 * entry (no antialiasing, no rounding through cairo's paths) and an
 * L x S grid costs one store per pixel. Cairo draws only the text.
 */
#define _POSIX_C_SOURCE 200809L /* write, ssize_t */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cairo.h>
#include <fontconfig/fontconfig.h>

#include "colormap.h"
#include "heatmap.h"

enum {
    PAD = 8,           /* image edge to the panels and the colour bar       */
    GAP = 16,          /* between panels, and panels to the colour bar      */
    FONT = 12,         /* titles, ticks, legend; labels use min(FONT, cell)  */
    TITLE_H = 18,      /* a panel's title line                              */
    LABEL_MAX = 160,   /* the widest label; longer ones end in "…"           */
    LABEL_GAP = 4,     /* label to grid                                     */
    MIN_TEXT_CELL = 6, /* smaller cells get no labels                       */
    DEFAULT_CELL = 24,
    AUTO_GRID = 2048,  /* the automatic cell fits the grids in this         */
    BAR_W = 16,
    BAR_MIN_H = 64,
    TICK = 4,
    SWATCH = 12,
    LEGEND_ROW = 16,
    MAX_SIDE = 16384,
};
static const double max_pixels = 32.0 * 1024 * 1024;

struct hm_image {
    cairo_surface_t *surface;
    int width, height, cell;
};

/* The geometry, in pixels (int64 until checked against the limits). */
typedef struct layout {
    int64_t cell, font; /* font 0: no labels */
    int64_t title_h, row_w, col_h, panel_w, panel_h;
    int64_t gcols, grows;
    int64_t bar_x, bar_y, bar_h;
    int64_t width, height;
    char ticks[3][32]; /* the scale's top, middle and bottom values */
} layout;

static bool fonts_used; /* fontconfig's caches to free at the end */

static void use_font(cairo_t *cr, double px) {
    fonts_used = true;
    cairo_select_font_face(cr, "sans-serif", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, px);
}

static double text_width(cairo_t *cr, const char *s) {
    cairo_text_extents_t e;
    cairo_text_extents(cr, s, &e);
    return e.x_advance;
}

/* s, or its longest prefix of whole characters that fits in max_w with
 * "…" after it (in buf). */
static const char *fit(cairo_t *cr, const char *s, double max_w, char *buf, size_t size) {
    if (text_width(cr, s) <= max_w) return s;
    size_t ends[HM_TOKEN_BYTES + 8], n = 0; /* byte length of each prefix */
    for (size_t i = 1; s[i - 1] != '\0' && n < sizeof ends / sizeof ends[0]; i++)
        if ((s[i] & 0xc0) != 0x80) ends[n++] = i;
    size_t lo = 0, hi = n; /* prefixes of `lo` characters fit; of `hi + 1` do not */
    while (lo < hi) {
        size_t mid = (lo + hi + 1) / 2, len = ends[mid - 1];
        if (len + 4 > size) len = size - 4;
        memcpy(buf, s, len);
        memcpy(buf + len, "\xe2\x80\xa6", 4);
        if (text_width(cr, buf) <= max_w)
            lo = mid;
        else
            hi = mid - 1;
    }
    size_t len = lo > 0 ? ends[lo - 1] : 0;
    if (len + 4 > size) len = size - 4;
    memcpy(buf, s, len);
    memcpy(buf + len, "\xe2\x80\xa6", 4);
    return buf;
}

/* The widest label of a token list, ellipsized, + the gap; 0 without. */
static int64_t labels_width(cairo_t *cr, const hm_tokens *t, int64_t font) {
    if (t == NULL || font == 0) return 0;
    use_font(cr, (double)font);
    char buf[HM_TOKEN_BYTES + 8];
    double w = 0;
    for (int64_t k = 0; k < t->n; k++) {
        double tw = text_width(cr, fit(cr, t->tok[k], LABEL_MAX, buf, sizeof buf));
        w = tw > w ? tw : w;
    }
    return (int64_t)ceil(w) + LABEL_GAP;
}

static int64_t automatic_cell(const hm_plot *p, const layout *l) {
    int64_t c = DEFAULT_CELL;
    const int64_t across = AUTO_GRID / (l->gcols * p->S), down = AUTO_GRID / (l->grows * p->L);
    c = across < c ? across : c;
    c = down < c ? down : c;
    return c < 1 ? 1 : c;
}

/* Everything's place; CLI_RUNTIME with the sizes when over the limits. */
static int plan(cairo_t *cr, const hm_plot *p, layout *l) {
    memset(l, 0, sizeof *l);
    l->gcols = p->grid ? (int64_t)ceil(sqrt((double)p->nheads)) : 1;
    while (l->gcols * l->gcols < p->nheads) l->gcols++; /* sqrt's rounding */
    l->grows = (p->nheads + l->gcols - 1) / l->gcols;
    l->cell = p->cell > 0 ? p->cell : automatic_cell(p, l);
    l->font = l->cell >= MIN_TEXT_CELL ? (l->cell < FONT ? l->cell : FONT) : 0;
    if (l->font == 0 && (p->rows || p->cols))
        fprintf(stderr, "attn heatmap: token labels left out: %lld px cells are too small for "
                "text (--cell %d or more draws them)\n", (long long)l->cell, MIN_TEXT_CELL);
    l->row_w = labels_width(cr, p->rows, l->font);
    l->col_h = labels_width(cr, p->cols, l->font);
    l->title_h = p->titled ? TITLE_H : 0;
    use_font(cr, FONT);
    char title[64];
    snprintf(title, sizeof title, "head %lld", (long long)(p->head0 + p->nheads - 1));
    l->panel_w = l->row_w + p->S * l->cell;
    const int64_t title_w = p->titled ? (int64_t)ceil(text_width(cr, title)) : 0;
    l->panel_w = title_w > l->panel_w ? title_w : l->panel_w;
    l->panel_h = l->title_h + l->col_h + p->L * l->cell;
    const int64_t panels_w = l->gcols * l->panel_w + (l->gcols - 1) * GAP,
                  panels_h = l->grows * l->panel_h + (l->grows - 1) * GAP;
    l->bar_x = PAD + panels_w + GAP;
    l->bar_y = PAD + l->title_h + l->col_h;
    l->bar_h = PAD + panels_h - l->bar_y;
    l->bar_h = l->bar_h < BAR_MIN_H ? BAR_MIN_H : l->bar_h;
    const double values[3] = {p->vmax, p->vmin / 2 + p->vmax / 2, p->vmin}; /* (no overflow) */
    double right = 0;
    for (int k = 0; k < 3; k++) {
        snprintf(l->ticks[k], sizeof l->ticks[k], "%.4g", values[k]);
        double w = text_width(cr, l->ticks[k]);
        right = w > right ? w : right;
    }
    right += BAR_W + TICK + 2;
    const double legend_w = SWATCH + 4 + text_width(cr, "+inf");
    right = legend_w > right ? legend_w : right;
    int64_t legend = 0;
    for (int k = 0; k < 3; k++) legend += p->nonfinite[k] > 0;
    l->width = l->bar_x + (int64_t)ceil(right) + PAD;
    const int64_t bar_end = l->bar_y + l->bar_h + FONT / 2 + (legend ? 8 + legend * LEGEND_ROW : 0);
    l->height = (PAD + panels_h > bar_end ? PAD + panels_h : bar_end) + PAD;
    if (l->width <= MAX_SIDE && l->height <= MAX_SIDE &&
        (double)l->width * (double)l->height <= max_pixels)
        return CLI_OK;
    fprintf(stderr, "attn heatmap: the image would be %lld x %lld px (%lld head%s of %lld x %lld "
            "cells of %lld px); the limit is %d px a side and 32 Mpx in all: %s\n",
            (long long)l->width, (long long)l->height, (long long)p->nheads,
            p->nheads == 1 ? "" : "s", (long long)p->L,
            (long long)p->S, (long long)l->cell, MAX_SIDE,
            p->cell_option ? "choose a smaller --cell" : "slice the weights (fewer queries, "
            "keys or heads)");
    return CLI_RUNTIME;
}

static uint32_t colour_of(double v, double vmin, double vmax) {
    if (isnan(v)) return CMAP_NAN_RGB;
    if (isinf(v)) return v > 0 ? CMAP_PINF_RGB : CMAP_NINF_RGB;
    const unsigned char *c = cmap_viridis[cmap_index(v, vmin, vmax)];
    return (uint32_t)c[0] << 16 | (uint32_t)c[1] << 8 | c[2];
}

typedef struct pixels {
    unsigned char *data;
    int stride;
} pixels;

/* CAIRO_FORMAT_RGB24: one native uint32 0x00RRGGBB per pixel. */
static void fill(const pixels *px, int64_t x, int64_t y, int64_t w, int64_t h, uint32_t rgb) {
    for (int64_t r = y; r < y + h; r++) {
        uint32_t *row = (uint32_t *)(void *)(px->data + r * px->stride);
        for (int64_t c = x; c < x + w; c++) row[c] = rgb;
    }
}

/* The top-left corner of panel k's cell grid. */
static void grid_origin(const layout *l, int64_t k, int64_t *x, int64_t *y) {
    *x = PAD + (k % l->gcols) * (l->panel_w + GAP) + l->row_w;
    *y = PAD + (k / l->gcols) * (l->panel_h + GAP) + l->title_h + l->col_h;
}

static void draw_pixels(const hm_plot *p, const layout *l, const pixels *px) {
    const int64_t c = l->cell;
    for (int64_t k = 0; k < p->nheads; k++) {
        int64_t gx, gy;
        grid_origin(l, k, &gx, &gy);
        for (int64_t i = 0; i < p->L; i++)
            for (int64_t j = 0; j < p->S; j++)
                fill(px, gx + j * c, gy + i * c, c, c,
                     colour_of(hm_value(p, p->head0 + k, i, j), p->vmin, p->vmax));
    }
    for (int64_t r = 0; r < l->bar_h; r++) { /* the ends are the map's ends */
        const int64_t idx = p->vmax > p->vmin ? ((l->bar_h - 1 - r) * (CMAP_SIZE - 1) * 2 +
                                                 l->bar_h - 1) / (2 * (l->bar_h - 1))
                                              : 0;
        const unsigned char *rgb = cmap_viridis[idx];
        fill(px, l->bar_x, l->bar_y + r, BAR_W, 1,
             (uint32_t)rgb[0] << 16 | (uint32_t)rgb[1] << 8 | rgb[2]);
    }
    static const uint32_t swatches[3] = {CMAP_NAN_RGB, CMAP_PINF_RGB, CMAP_NINF_RGB};
    int64_t y = l->bar_y + l->bar_h + FONT / 2 + 8;
    for (int k = 0; k < 3; k++)
        if (p->nonfinite[k] > 0) {
            fill(px, l->bar_x, y, SWATCH, SWATCH, swatches[k]);
            y += LEGEND_ROW;
        }
}

/* Text whose middle line (half the digit height) is at y. */
static void text_at(cairo_t *cr, double x, double y, const char *s) {
    cairo_font_extents_t fe;
    cairo_font_extents(cr, &fe);
    cairo_move_to(cr, x, y + (fe.ascent - fe.descent) / 2);
    cairo_show_text(cr, s);
}

static void draw_labels(cairo_t *cr, const hm_plot *p, const layout *l, int64_t gx, int64_t gy) {
    char buf[HM_TOKEN_BYTES + 8];
    const double c = (double)l->cell;
    use_font(cr, (double)l->font);
    for (int64_t i = 0; p->rows && i < p->L; i++) {
        const char *s = fit(cr, p->rows->tok[i], LABEL_MAX, buf, sizeof buf);
        const double right = (double)(gx - LABEL_GAP); /* right-aligned at the grid */
        text_at(cr, right - text_width(cr, s), (double)gy + ((double)i + 0.5) * c, s);
    }
    for (int64_t j = 0; p->cols && j < p->S; j++) { /* read upwards, ending at the grid */
        const char *s = fit(cr, p->cols->tok[j], LABEL_MAX, buf, sizeof buf);
        cairo_save(cr);
        cairo_translate(cr, (double)gx + ((double)j + 0.5) * c, (double)(gy - LABEL_GAP));
        cairo_rotate(cr, -1.5707963267948966); /* -pi/2 */
        text_at(cr, 0, 0, s);
        cairo_restore(cr);
    }
}

static void draw_text(cairo_t *cr, const hm_plot *p, const layout *l) {
    cairo_set_source_rgb(cr, 0.1, 0.1, 0.1);
    for (int64_t k = 0; k < p->nheads; k++) {
        int64_t gx, gy;
        grid_origin(l, k, &gx, &gy);
        if (p->titled) {
            char title[64];
            snprintf(title, sizeof title, "head %lld", (long long)(p->head0 + k));
            use_font(cr, FONT);
            text_at(cr, (double)(gx - l->row_w), (double)(gy - l->col_h - TITLE_H / 2), title);
        }
        if (l->font > 0) draw_labels(cr, p, l, gx, gy);
    }
    use_font(cr, FONT);
    cairo_set_antialias(cr, CAIRO_ANTIALIAS_NONE);
    cairo_set_line_width(cr, 1);
    const double x = (double)(l->bar_x + BAR_W);
    for (int k = 0; k < 3; k++) { /* ticks at the top, middle and bottom rows */
        const double y = (double)l->bar_y + (k == 0 ? 0.5 : k == 1 ? (double)l->bar_h / 2
                                                                 : (double)l->bar_h - 0.5);
        cairo_move_to(cr, x, y);
        cairo_line_to(cr, x + TICK, y);
        cairo_stroke(cr);
        text_at(cr, x + TICK + 2, y, l->ticks[k]);
    }
    static const char *const names[3] = {"NaN", "+inf", "-inf"};
    double y = (double)(l->bar_y + l->bar_h + FONT / 2 + 8) + SWATCH / 2.0;
    for (int k = 0; k < 3; k++)
        if (p->nonfinite[k] > 0) {
            text_at(cr, (double)(l->bar_x + SWATCH + 4), y, names[k]);
            y += LEGEND_ROW;
        }
}

static void print_layout(const hm_plot *p, const layout *l) {
    printf("layout image %lld %lld\n", (long long)l->width, (long long)l->height);
    printf("layout cell %lld font %lld\n", (long long)l->cell, (long long)l->font);
    printf("layout labels %lld %lld\n", (long long)l->row_w, (long long)l->col_h);
    printf("layout colorbar %lld %lld %d %lld\n", (long long)l->bar_x, (long long)l->bar_y, BAR_W,
           (long long)l->bar_h);
    printf("layout scale %.17g %.17g\n", p->vmin, p->vmax);
    for (int64_t k = 0; k < p->nheads; k++) {
        int64_t gx, gy;
        grid_origin(l, k, &gx, &gy);
        printf("layout panel %lld head %lld grid %lld %lld rows %lld cols %lld\n", (long long)k,
               (long long)(p->head0 + k), (long long)gx, (long long)gy, (long long)p->L,
               (long long)p->S);
    }
}

int hm_draw(const hm_plot *p, bool want_layout, hm_image **out) {
    *out = NULL;
    layout l;
    cairo_surface_t *scratch = cairo_image_surface_create(CAIRO_FORMAT_RGB24, 1, 1);
    cairo_t *cr = cairo_create(scratch);
    int rc = plan(cr, p, &l);
    cairo_destroy(cr);
    cairo_surface_destroy(scratch);
    if (rc != CLI_OK) return rc;
    hm_image *img = calloc(1, sizeof *img);
    cairo_surface_t *s = cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)l.width,
                                                    (int)l.height);
    if (img == NULL || cairo_surface_status(s) != CAIRO_STATUS_SUCCESS) {
        fprintf(stderr, "attn heatmap: cannot make a %lld x %lld px image: %s\n",
                (long long)l.width, (long long)l.height,
                cairo_status_to_string(img ? cairo_surface_status(s) : CAIRO_STATUS_NO_MEMORY));
        cairo_surface_destroy(s);
        free(img);
        return CLI_RUNTIME;
    }
    cairo_surface_flush(s);
    pixels px = {cairo_image_surface_get_data(s), cairo_image_surface_get_stride(s)};
    fill(&px, 0, 0, l.width, l.height, 0xffffffu);
    draw_pixels(p, &l, &px);
    cairo_surface_mark_dirty(s);
    cr = cairo_create(s);
    draw_text(cr, p, &l);
    cairo_status_t st = cairo_status(cr);
    cairo_destroy(cr);
    img->surface = s;
    img->width = (int)l.width;
    img->height = (int)l.height;
    img->cell = (int)l.cell;
    if (st != CAIRO_STATUS_SUCCESS) {
        fprintf(stderr, "attn heatmap: drawing the text: %s\n", cairo_status_to_string(st));
        hm_image_free(img);
        return CLI_RUNTIME;
    }
    if (want_layout) print_layout(p, &l);
    *out = img;
    return CLI_OK;
}

void hm_image_size(const hm_image *img, int *width, int *height, int *cell) {
    *width = img->width;
    *height = img->height;
    *cell = img->cell;
}

typedef struct sink {
    int fd, err;
} sink;

static cairo_status_t write_all(void *closure, const unsigned char *data, unsigned int n) {
    sink *k = closure;
    while (n > 0) {
        ssize_t w = write(k->fd, data, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            k->err = w < 0 ? errno : EIO;
            return CAIRO_STATUS_WRITE_ERROR;
        }
        data += w;
        n -= (unsigned int)w;
    }
    return CAIRO_STATUS_SUCCESS;
}

const char *hm_write_png(int fd, const void *image) {
    const hm_image *img = image;
    sink k = {fd, 0};
    cairo_status_t st = cairo_surface_write_to_png_stream(img->surface, write_all, &k);
    if (st == CAIRO_STATUS_SUCCESS) return NULL;
    return k.err != 0 ? strerror(k.err) : cairo_status_to_string(st);
}

void hm_image_free(hm_image *img) {
    if (img != NULL) {
        cairo_surface_destroy(img->surface);
        free(img);
    }
    /* Cairo's and fontconfig's caches would outlive the run; freed, so that
     * leak checkers (ASan, valgrind) see a clean exit. */
    if (fonts_used) {
        cairo_debug_reset_static_data();
        FcFini();
        fonts_used = false;
    }
}
