/* peak_amx.c — the AMX-BF16 tile probe (compiled with -mamx-tile
 * -mamx-bf16 only): tdpbf16ps multiplies a 16 x 32 bfloat16 tile by a
 * 32 x 16 one into 16 x 16 float32 sums, 8,192 multiply-adds an
 * instruction. Four independent C tiles from two A and two B tiles loaded
 * once, as the kernels' 2 x 2 blocks are. Only called where the library
 * said the path runs (attn_isa_supported(ATTN_ISA_AMX)), which also asked
 * Linux for the tile state. */
#include <immintrin.h>
#include <stdint.h>

#include "kernels/avx512/amx_tiles.h"
#include "peak.h"

double peak_amx_bf16(int64_t iters) {
    static const uint16_t zeros[16 * 32] __attribute__((aligned(64))) = {0};
    attn__configure_tiles();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, zeros, 64);
    _tile_loadd(5, zeros, 64);
    _tile_loadd(6, zeros, 64);
    _tile_loadd(7, zeros, 64);
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
