#!/usr/bin/env bash
# fuzz.sh — runs each libFuzzer target for a set time and prints its figures.
# Usage: scripts/fuzz.sh BUILD_DIR SECONDS TARGET...
# The checked-in seeds (tests/fuzz/corpus/<name>) are read, never written:
# new inputs go to BUILD_DIR/corpus/<name>, crashes to BUILD_DIR/artifacts/.
# Exit status 1 if any target finds a crash, a leak, a timeout or an
# invariant failure; the log tail says which input (replay it with
# BUILD_DIR/tests/fuzz/<target> <file>, then add it under tests/fuzz/corpus
# and a regression test to tests/c/).
set -uo pipefail
cd "$(dirname "$0")/.."
build=$1 seconds=$2
shift 2
mkdir -p "$build/logs" "$build/artifacts"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
printf '%-10s %8s %12s %10s %8s %8s\n' target seconds executions execs/s corpus cov
for t in "$@"; do
    name=${t#fuzz_}
    corpus=$build/corpus/$name
    mkdir -p "$corpus"
    dict=()
    [ -f "tests/fuzz/$name.dict" ] && dict=(-dict="tests/fuzz/$name.dict")
    log=$build/logs/$t.log
    start=$(date +%s)
    "$build/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
        -max_len=4096 -print_final_stats=1 -artifact_prefix="$build/artifacts/$t-" \
        "${dict[@]}" "$corpus" "tests/fuzz/corpus/$name" >"$log" 2>&1
    rc=$?
    elapsed=$(($(date +%s) - start))
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2)
    units=$(find "$corpus" -type f | wc -l)
    printf '%-10s %8s %12s %10s %8s %8s\n' "$name" "$elapsed" "${runs:-?}" "${rate:-?}" \
        "$units" "${cov:-?}"
    if [ $rc -ne 0 ]; then
        echo "fuzz: $t failed (exit $rc); the end of $log:"
        tail -40 "$log"
        status=1
    fi
done
exit $status
