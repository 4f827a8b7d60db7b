#!/usr/bin/env bash
# valgrind_cli.sh — the attn tool under valgrind memcheck: the demo, and
# `attn sdpa` on the fixture .npy files (masks, weights, lse, GQA, causal,
# dropout), plus its error paths (a malformed file, a usage error), and
# `attn heatmap` on the weights it wrote.
# Each run must report zero errors and no definitely or indirectly lost
# block. Usage: scripts/valgrind_cli.sh BUILD_DIR
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1
attn=$build/tools/attn
data=tests/data/cli
out=$(mktemp -d /tmp/attn_valgrind_XXXXXX)
trap 'rm -rf "$out"' EXIT
vg=(valgrind --error-exitcode=99 --leak-check=full --errors-for-leak-kinds=definite,indirect
    --show-leak-kinds=definite,indirect --suppressions=tests/valgrind/attn.supp)
status=0
runs=0

check() { # check NAME EXPECTED_EXIT -- COMMAND...
    local name=$1 want=$2
    shift 3
    local log=$out/$name.log start=$SECONDS
    "${vg[@]}" --log-file="$log" "$@" >"$out/$name.stdout" 2>"$out/$name.stderr"
    local rc=$?
    local errors
    errors=$(sed -n 's/.*ERROR SUMMARY: \([0-9]*\) errors.*/\1/p' "$log" | tail -1)
    local definite indirect
    definite=$(sed -n 's/.*definitely lost: \([0-9,]*\) bytes.*/\1/p' "$log" | tail -1)
    indirect=$(sed -n 's/.*indirectly lost: \([0-9,]*\) bytes.*/\1/p' "$log" | tail -1)
    printf '  %-16s exit %d  errors %s  definitely lost %s B  indirectly lost %s B  (%ds)\n' \
        "$name" "$rc" "${errors:-?}" "${definite:-0}" "${indirect:-0}" $((SECONDS - start))
    runs=$((runs + 1))
    if [ "$rc" -ne "$want" ] || [ "${errors:-1}" != 0 ]; then
        echo "valgrind: $name: exit $rc (expected $want), ${errors:-?} errors; log:"
        cat "$log"
        status=1
    fi
}

echo "valgrind memcheck of $attn"
check demo 0 -- "$attn"
check sdpa_f32_mask 0 -- "$attn" sdpa -q $data/q_f32.npy -k $data/k_f32.npy -v $data/v_f32.npy \
    --mask $data/mask_bool.npy -o "$out/o1.npy" --weights "$out/w1.npy" --lse "$out/l1.npy"
check sdpa_f64_gqa 0 -- "$attn" sdpa -q $data/q_f64.npy -k $data/k_f64.npy -v $data/v_f64.npy \
    --mask $data/mask_f64.npy --gqa --causal=bottom-right --dropout 0.25 --seed 3 --threads 2 \
    -o "$out/o2.npy" --weights "$out/w2.npy" --lse "$out/l2.npy"
check sdpa_malformed 1 -- "$attn" sdpa -q tests/fuzz/corpus/npy/hand_truncated \
    -k $data/k_f32.npy -v $data/v_f32.npy -o "$out/o3.npy"
check sdpa_bad_shapes 1 -- "$attn" sdpa -q $data/q_f32.npy -k $data/k_f64.npy \
    -v $data/v_f32.npy -o "$out/o4.npy"
check usage_error 2 -- "$attn" sdpa -q $data/q_f32.npy
check info 0 -- "$attn" info
# attn heatmap (cairo, fontconfig, libpng) when this build has it.
if "$attn" info | grep -q '^heatmap: yes'; then
    printf 'a\nb\nc\nd\ne\nf\n' >"$out/six.txt"
    check heatmap_grid 0 -- "$attn" heatmap -w "$out/w2.npy" --grid -o "$out/w2.png" \
        --tokens "$out/six.txt"
    check heatmap_bad_tokens 1 -- "$attn" heatmap -w "$out/w1.npy" --head 0 -o "$out/w1.png" \
        --tokens docs/heatmap/tokens.txt
fi
if [ $status -eq 0 ]; then
    echo "valgrind: $runs runs, 0 errors, 0 bytes definitely or indirectly lost"
fi
exit $status
