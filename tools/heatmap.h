/* heatmap.h — what heatmap_cmd.c (options, weights, tokens), heatmap_text.c
 * (token files) and heatmap_draw.c (layout, cairo, PNG) share. */
#ifndef ATTN_HEATMAP_H
#define ATTN_HEATMAP_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>

#include "cli.h"

/* Token labels, one per line of a file, cleaned to valid UTF-8 without
 * control characters, each at most HM_TOKEN_BYTES bytes (longer ones are
 * cut and end in "…"). */
enum { HM_TOKEN_BYTES = 256 };
typedef struct hm_tokens {
    char **tok;
    int64_t n;
    char *buf; /* the cleaned text tok[] points into */
} hm_tokens;

/* Reads `path` (given as `option`), which must hold `want` tokens, the
 * weights' count of `what` ("queries (L)"): CLI_OK, or CLI_RUNTIME with a
 * message naming the option and the file. */
int hm_tokens_read(const char *option, const char *path, int64_t want, const char *what,
                   hm_tokens *t);
void hm_tokens_free(hm_tokens *t);

/* One picture: panels of L x S cells, one per head drawn, all in one colour
 * scale. The weights are C-contiguous float32/float64/float16 (N, H, L, S). */
typedef struct hm_plot {
    const void *data;
    attn_dtype dtype;
    int64_t heads_total, L, S; /* H of the file (1 for (L, S)) */
    int64_t batch;             /* element drawn of N (0 for rank < 4) */
    int64_t head0, nheads;     /* heads drawn: head0 .. head0 + nheads - 1 */
    bool titled;               /* the file has a head dimension: "head h" titles */
    bool grid;                 /* panels in a matrix (--grid) */
    const hm_tokens *rows, *cols; /* labels, or NULL */
    int cell;                  /* px per cell; 0 = automatic */
    double vmin, vmax;         /* the colour scale, vmin <= vmax */
    int64_t nonfinite[3];      /* NaN, +inf, -inf weights among those drawn */
    const char *cell_option;   /* "--cell" when the user chose the cell size */
} hm_plot;

/* The weight at (head, query i, key j) of the batch element drawn. */
static inline double hm_value(const hm_plot *p, int64_t head, int64_t i, int64_t j) {
    const int64_t at = ((p->batch * p->heads_total + head) * p->L + i) * p->S + j;
    if (p->dtype == ATTN_DTYPE_F64) return ((const double *)p->data)[at];
    if (p->dtype == ATTN_DTYPE_F32) return ((const float *)p->data)[at];
    const unsigned h = ((const uint16_t *)p->data)[at]; /* binary16 */
    const int e = (int)(h >> 10 & 31), m = (int)(h & 1023);
    const double mag = e == 31 ? (m ? NAN : INFINITY) : e == 0 ? ldexp(m, -24)
                                                              : ldexp(1024 + m, e - 25);
    return h >> 15 ? -mag : mag;
}

/* A drawn image (heatmap_draw.c). hm_draw lays out and draws the plot, and
 * with print_layout prints the geometry (docs in heatmap_cmd.c); CLI_OK, or
 * CLI_RUNTIME with the reason printed (an image above the size limit, no
 * memory). */
typedef struct hm_image hm_image;
int hm_draw(const hm_plot *p, bool print_layout, hm_image **img);
void hm_image_size(const hm_image *img, int *width, int *height, int *cell);
/* An output_writer (cli.h): the image as PNG to fd. */
const char *hm_write_png(int fd, const void *img);
/* Frees the image and the font library's caches (NULL: the caches only). */
void hm_image_free(hm_image *img);

#endif
