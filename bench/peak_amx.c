/* peak_amx.c — the AMX-BF16 tile probe (compiled with -mamx-tile
 * -mamx-bf16 only): tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a
 * 32 x 16 one into 16 x 16 float32 sums, 8,192 multiply-adds an
 * instruction. Four independent C tiles from two A and two B tiles loaded
 * once, as the kernels' 2 x 2 blocks are. Only called where the library
 * said the path runs (attn_isa_supported(ATTN_ISA_AMX)), which also asked
 * Linux for the tile state. */
#include <immintrin.h>
#include <stdint.h>

#include "peak.h"

typedef struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* a constant in memory: see flash_amx.c on GCC and local configurations */
static const tile_config config = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

double peak_amx_bf16(int64_t iters) {
    static const uint16_t ones[16 * 32] __attribute__((aligned(64))) = {0};
    _tile_loadconfig(&config);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ones, 64);
    _tile_loadd(5, ones, 64);
    _tile_loadd(6, ones, 64);
    _tile_loadd(7, ones, 64);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float out[16 * 16];
    _tile_stored(0, out, 64);
    volatile float sink = out[0];
    (void)sink;
    _tile_release();
    return 2.0 * 16 * 16 * 32 * 4 * (double)iters;
}
