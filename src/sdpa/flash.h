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

/* How the forward splits a problem for `threads` threads, and how evenly
 * its tasks fill them when each thread takes the next task as it frees
 * (the driver's schedule), a task costing the rows times keys it computes.
 * For tests and docs/design.md: the thread count may exceed the machine's. */
typedef struct attn__flash_split {
    int64_t tasks;          /* (group, query block, key chunk) tasks          */
    int64_t rows_per_block; /* query rows per block                          */
    int64_t chunks;         /* key chunks per block (1: keys not split)      */
    int64_t chunk;          /* keys per chunk (S when not split)             */
    int64_t most, fewest;   /* tasks the busiest and the idlest thread run   */
    double busy;            /* work / (threads x the longest thread's work)  */
} attn__flash_split;

attn_status attn__flash_balance(const attn__problem *problem, const attn__ukernel *ukernel,
                                int threads, attn__flash_split *split);

#endif /* ATTN_SDPA_FLASH_H */
