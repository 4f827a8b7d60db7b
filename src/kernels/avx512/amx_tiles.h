/*
 * amx_tiles.h — the one AMX tile configuration attn uses, for the files
 * compiled with -mamx-tile (flash_amx.c, and the benchmark's peak probe):
 * eight tiles of 16 rows x 64 bytes, tiles 0-3 accumulating (C), 4 and 5
 * the left operands (A), 6 and 7 the right ones (B).
 */
#ifndef ATTN_KERNELS_AVX512_AMX_TILES_H
#define ATTN_KERNELS_AVX512_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>

/* ldtilecfg's 64-byte operand: palette 1, per tile its rows and bytes a row. */
typedef struct attn__tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} attn__tile_config;

/* A constant in memory: GCC 12 drops stores to a configuration on the stack
 * as dead, for it does not know that ldtilecfg reads them (a #GP, seen as
 * SIGSEGV). */
static const attn__tile_config attn__tiles_16x64 = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static inline void attn__configure_tiles(void) { _tile_loadconfig(&attn__tiles_16x64); }

#endif /* ATTN_KERNELS_AVX512_AMX_TILES_H */
