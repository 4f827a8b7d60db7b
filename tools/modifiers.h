/* modifiers.h — the score modifiers as options (--window, --alibi-slopes,
 * --softcap, --sinks), shared by `attn sdpa`, `attn varlen` and `attn
 * kvcache`, and the int32 index files (cu_seqlens, cache_seqlens,
 * block_table) that varlen and kvcache read. */
#ifndef ATTN_MODIFIERS_H
#define ATTN_MODIFIERS_H

#include <stdbool.h>
#include <stddef.h>

#include "attn.h"

/* The files of --alibi-slopes and --sinks, and what was loaded from them. */
typedef struct cli_modifiers {
    const char *alibi_path, *sinks_path;
    attn_tensor alibi, sinks;
} cli_modifiers;

/* The options' help lines, a literal to splice into each command's help. */
#define CLI_MODIFIER_OPTIONS                                                        \
    "  --window L,R            sliding window (FlashAttention's window_size): query\n" \
    "                          i sees keys i+S-Lq-L .. i+S-Lq+R; -1 leaves a side\n"   \
    "                          unbounded (default -1,-1: no window)\n"                 \
    "  --alibi-slopes A.npy    ALiBi slopes, (H,) or (B, H) float: -slope*|i+S-Lq-j|\n" \
    "                          is added to each scaled score\n"                        \
    "  --softcap X             soft-capping: each scaled score s becomes\n"            \
    "                          X*tanh(s/X) (default 0: none)\n"                        \
    "  --sinks S.npy           attention sinks, one logit per query head (H,) float,\n" \
    "                          added to each row's softmax denominator\n"

/* Whether opt is a modifier option that takes a value (all four do). */
bool cli_modifier_takes_value(const char *opt);

/* Parses one option: 1 when opt is a modifier option with a good value
 * (--window and --softcap go into p, the paths into m), 0 when opt is not
 * a modifier option, -1 for a bad value, with the reason in why. */
int cli_modifier_option(const char *opt, const char *val, attn_sdpa_params *p,
                        cli_modifiers *m, char *why, size_t why_size);

/* Loads the files given into m and points p at them: CLI_OK, or
 * CLI_RUNTIME with the reason printed. */
int cli_modifiers_load(cli_modifiers *m, attn_sdpa_params *p);
void cli_modifiers_free(cli_modifiers *m);
/* Registers the files given as inputs no output may replace
 * (outputs_input): CLI_OK or CLI_USAGE. */
int cli_modifiers_inputs(const cli_modifiers *m);

/* An index file as a C-contiguous int32 tensor (free it with
 * attn_npy_free): .npy int32, or int64 whose values fit. CLI_OK, or
 * CLI_RUNTIME with the reason printed ("attn: reading OPTION: ..."). */
int cli_load_index(const char *option, const char *path, attn_tensor *t);

#endif
