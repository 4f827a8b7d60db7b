/*
 * flash.h — the fused (FlashAttention-2 style) forward pass.
 *
 * The driver (flash.c, portable) walks query blocks against key/value blocks
 * with an online softmax: a running row maximum m and sum l, one rescale of
 * the output accumulator per key block, one division at the end. It packs
 * what it needs per block, applies masks, causality and dropout, and
 * schedules threads. The arithmetic lives in the micro-kernels of one ISA,
 * which it reaches through that ISA's context (src/kernels/ukernel.h, the
 * contract), and the block sizes are that context's.
 */
#ifndef ATTN_SDPA_FLASH_H
#define ATTN_SDPA_FLASH_H

#include "../kernels/ukernel.h"
#include "sdpa.h"

/* Runs a problem with the given ISA context (attn__ukernel_for). */
attn_status attn__sdpa_flash(const attn__problem *problem, const attn__ukernel *ukernel);

/* The backward pass of a problem (FlashAttention-2's, see flash_backward.inc). */
attn_status attn__sdpa_flash_backward(const attn__problem *problem, const attn__ukernel *ukernel);

/* Key blocks computed by the fused kernels since the last call (all
 * threads, forward and backward); reading resets the count. For tests. */
int64_t attn__flash_blocks_visited(void);

#endif /* ATTN_SDPA_FLASH_H */
