#!/usr/bin/env bash
# netns.sh — ring attention on two hosts for real: each case runs
# tests/ring/ring_driver under scripts/ring_netns.sh (two network
# namespaces, one rank in each, Open MPI over TCP on a veth and nothing
# else) and on one host (mpirun -np 2, shared memory). Both must pass the
# driver's check against single-process attn_sdpa, give the same output bits
# rank by rank, and the veth must have carried at least the K/V bytes the
# ring sends each way.
# Usage: tests/ring/netns.sh DRIVER   (exit 77: cannot run here, skipped)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
[ $# = 1 ] || { echo "usage: netns.sh DRIVER" >&2; exit 2; }
driver=$1
command -v mpirun >/dev/null || { echo "netns.sh: SKIP: no mpirun" >&2; exit 77; }
if [ "$(id -u)" != 0 ] || ! ip netns list >/dev/null 2>&1; then
    echo "netns.sh: SKIP: needs root and ip netns" >&2
    exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
tmp=$(mktemp -d "${TMPDIR:-/tmp}/attn-ring-netns-test.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# The shorter zigzag shard of T over 2 ranks (chunks of T/4; attn_ring.h).
zigzag_min() {
    local T=$1 a b
    a=$(((1 * T / 4 - 0) + (4 * T / 4 - 3 * T / 4)))
    b=$(((2 * T / 4 - 1 * T / 4) + (3 * T / 4 - 2 * T / 4)))
    echo $((a < b ? a : b))
}

# name | driver arguments | B, K/V heads, S, E, Ev (for the bytes each rank sends)
cases=(
    "plain|-H 4 -L 2048 -E 64|1 4 2048 64 64"
    "causal zigzag|-H 4 -L 2048 -E 64 --causal|1 4 2048 64 64"
    "GQA, dropout, causal|-B 2 -H 8 --kv-heads 2 -L 1500 -S 1500 -E 32 --Ev 48 --causal --dropout 0.2 --seed 7|2 2 1500 32 48"
    "cross, contiguous, uneven|-H 2 -L 777 -S 1001 -E 64 --layout contiguous|1 2 1001 64 64"
)
repeat=2
failed=0
for c in "${cases[@]}"; do
    IFS='|' read -r name args geo <<<"$c"
    read -r B hkv S E Ev <<<"$geo"
    # (zigzag_min is below the contiguous split's shorter shard too)
    kv=$((B * hkv * $(zigzag_min "$S") * (E + Ev) * 4 * repeat))
    echo "== $name: $args"
    # shellcheck disable=SC2086 # $args is a list of words
    if ! "$root/scripts/ring_netns.sh" --timeout 120 --min-bytes "$kv" --counters "$tmp/counters" \
        -- "$driver" check $args --repeat $repeat >"$tmp/net" 2>&1; then
        cat "$tmp/net"
        echo "netns.sh: FAIL ($name): the two-host run failed" >&2
        failed=1
        continue
    fi
    # shellcheck disable=SC2086
    if ! timeout 120 mpirun -np 2 --bind-to none "$driver" check $args --repeat $repeat \
        </dev/null >"$tmp/local" 2>&1; then
        cat "$tmp/local"
        echo "netns.sh: FAIL ($name): the one-host run failed" >&2
        failed=1
        continue
    fi
    grep -E "PASS|FAIL|veth" "$tmp/net"
    . "$tmp/counters"
    echo "   veth: $tx_bytes bytes one way, $rx_bytes the other (K/V at least $kv each way)"
    for r in 0 1; do
        hn=$(sed -n "s/^rank $r of .*out fnv1a \([0-9a-f]*\).*/\1/p" "$tmp/net")
        hl=$(sed -n "s/^rank $r of .*out fnv1a \([0-9a-f]*\).*/\1/p" "$tmp/local")
        if [ -z "$hn" ] || [ "$hn" != "$hl" ]; then
            echo "netns.sh: FAIL ($name): rank $r's output differs between two hosts ($hn)" \
                "and one host ($hl)" >&2
            failed=1
        fi
    done
    echo "   output bits the same as on one host (mpirun -np 2, shared memory): rank 0, rank 1"
done
[ "$failed" = 0 ] || exit 1
echo "netns.sh: PASS (${#cases[@]} cases on two namespaces over TCP, same bits as on one host)"
