/* colormap.h — the heatmap's colour map (colormap.c), shared with its test,
 * which inverts the colours of a decoded PNG through the same table. */
#ifndef ATTN_COLORMAP_H
#define ATTN_COLORMAP_H

enum { CMAP_SIZE = 256 };

/* viridis: index 0 (dark purple) for the smallest value, 255 (yellow) for
 * the largest; {r, g, b}. */
extern const unsigned char cmap_viridis[CMAP_SIZE][3];

/* The index of a finite value in [vmin, vmax]: floor((v - vmin) / (vmax -
 * vmin) * 256), clamped to 0..255 (values outside the range take the end
 * colours; vmax <= vmin gives 0). */
int cmap_index(double value, double vmin, double vmax);

/* Colours outside the map for weights that are not numbers: chosen to be
 * far from every viridis colour and from the white background. */
#define CMAP_NAN_RGB 0xff00ffu  /* magenta */
#define CMAP_PINF_RGB 0xff0000u /* red */
#define CMAP_NINF_RGB 0x000000u /* black */

#endif
