#!/usr/bin/env bash
# faults.sh — the ring under faults, through tests/ring/ring_driver.
#
# Usage: tests/ring/faults.sh [--net] [--np N] DRIVER CASE
#   kill       SIGKILL one rank mid-ring: the job must end non-zero within
#              DEADLINE seconds of the kill, with a message naming the rank
#   stop       SIGSTOP one rank mid-ring (a hung peer; params.timeout 3 s):
#              the others must fail with ATTN_ERR_COMM naming the peer, the
#              step and the timeout, and the job end (the driver then calls
#              MPI_Abort); the stopped process is killed afterwards. Where
#              the stop lands (a K/V wait, the final status) varies: every
#              wait must name the rank it waits on
#   stop-between  rank 1 stops itself (SIGSTOP) once its first call has
#              returned: the others' next call must fail the same way, its
#              first wait naming rank 1 (the ring's communicator is cached,
#              so no collective stands before that wait)
#   mismatch-seq | mismatch-heads | mismatch-E | mismatch-causal
#              one rank calls with a different shard length / head count /
#              feature size / causal flag: every rank must be refused
#              (ATTN_ERR_SHAPE or ATTN_ERR_INVALID) before any compute
# --net runs the job on two network namespaces (scripts/ring_netns.sh, one
# rank in each, TCP over a veth); without it, mpirun -np N (default 3) on
# this host. Exit 0: passed; 1: failed; 77: cannot run here (skipped).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
net=0 np=3
while [ $# -gt 0 ]; do
    case $1 in
        --net) net=1; np=2; shift ;;
        --np) np=$2; shift 2 ;;
        *) break ;;
    esac
done
[ $# = 2 ] || { echo "usage: faults.sh [--net] [--np N] DRIVER CASE" >&2; exit 2; }
driver=$(cd "$(dirname "$1")" && pwd)/$(basename "$1") case=$2
[ -x "$driver" ] || { echo "faults.sh: no driver at $driver" >&2; exit 2; }
command -v mpirun >/dev/null || { echo "faults.sh: SKIP: no mpirun" >&2; exit 77; }
if [ "$net" = 1 ] && { [ "$(id -u)" != 0 ] || ! ip netns list >/dev/null 2>&1; }; then
    echo "faults.sh: SKIP: --net needs root and ip netns" >&2
    exit 77
fi
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1

tmp=$(mktemp -d "${TMPDIR:-/tmp}/attn-ring-faults.XXXXXX")
log=$tmp/log
job=''
cleanup() {
    local rc=$?
    set +e
    # Ranks this test started (their PID files) and the job itself: never
    # leave a stopped or orphaned process behind.
    for f in "$tmp"/rank*.pid; do
        [ -f "$f" ] && kill -KILL "$(cut -d' ' -f1 "$f")" 2>/dev/null
    done
    [ -n "$job" ] && kill -TERM "$job" 2>/dev/null && wait "$job" 2>/dev/null
    rm -rf "$tmp"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fail() {
    echo "faults.sh: FAIL ($case$([ "$net" = 1 ] && echo ", two namespaces")): $*" >&2
    echo "---- job output ----" >&2
    cat "$log" >&2 || true
    exit 1
}

# The job in the background, its output in $log.
start_job() {
    if [ "$net" = 1 ]; then
        "$root/scripts/ring_netns.sh" --timeout 120 -- "$driver" "$@" >"$log" 2>&1 &
    else
        timeout --kill-after=10 120 mpirun -np "$np" --oversubscribe --bind-to none \
            --mca btl tcp,vader,self "$driver" "$@" </dev/null >"$log" 2>&1 &
    fi
    job=$!
}

# Waits for the job up to $1 seconds; sets status, or returns 1 if still running.
wait_job() {
    local end=$((SECONDS + $1))
    while kill -0 "$job" 2>/dev/null; do
        [ $SECONDS -lt $end ] || return 1
        sleep 0.2
    done
    status=0
    wait "$job" || status=$?
    job=''
}

wait_pids() { # every rank has written its PID file: it is in the ring call
    local end=$((SECONDS + 60))
    for r in $(seq 0 $((np - 1))); do
        while [ ! -f "$tmp/rank$r.pid" ]; do
            kill -0 "$job" 2>/dev/null || fail "the job ended before rank $r reached the ring call"
            [ $SECONDS -lt $end ] || fail "rank $r did not reach the ring call in 60 s"
            sleep 0.1
        done
    done
}

# A problem that keeps the ranks in the ring for tens of seconds (repeated
# calls): a fault sent a second in lands mid-ring, whatever the load.
big=(check --no-check -H 4 -L 16384 -E 64 --repeat 40 --pid-dir "$tmp")
victim=1

# The big job with the options given, and a second after every rank is in
# the ring call, signal $1 to rank $victim: sets pid and t0.
signal_victim() {
    local sig=$1
    shift
    start_job "${big[@]}" "$@"
    wait_pids
    sleep 1
    pid=$(cut -d' ' -f1 "$tmp/rank$victim.pid")
    kill -"$sig" "$pid"
    t0=$SECONDS
}

# After rank $victim ($pid) was stopped at $t0: the job must end within 40 s,
# non-zero, with ATTN_ERR_COMM messages that name the stopped rank, a step
# and the 3 s timeout.
check_stopped_peer() {
    # 3 s timeout + at most one step's compute, then MPI_Abort ends the job.
    if ! wait_job 40; then
        kill -KILL "$pid" 2>/dev/null || true
        wait_job 20 || true
        fail "the job still ran 40 s after rank $victim was stopped (a hang)"
    fi
    # (a zombie answers kill -0: read its state)
    still=no
    if [ -r "/proc/$pid/stat" ] && [ "$(cut -d' ' -f3 "/proc/$pid/stat")" != Z ]; then
        still=yes
        kill -KILL "$pid"
    fi
    [ "$status" != 0 ] || fail "the job exited 0 although rank $victim hung"
    grep -q "ATTN_ERR_COMM" "$log" || fail "no rank failed with ATTN_ERR_COMM"
    # The rank after the hung one receives from it and so must name it, as
    # must any rank when that one's message did not make it out before the
    # abort; each message names a step and the 3 s timeout. (The message is
    # what follows the driver's "rank R: ... ATTN_ERR_COMM: ".)
    succ=$(((victim + 1) % np))
    line=$(grep "^rank $succ: .*ATTN_ERR_COMM" "$log" | head -1 || true)
    if [ -n "$line" ]; then
        echo "${line#*ATTN_ERR_COMM: }" | grep -Eq "rank $victim\b" ||
            fail "rank $succ's ATTN_ERR_COMM message does not name rank $victim, the peer it waits on"
    else
        grep "ATTN_ERR_COMM" "$log" | sed 's/.*ATTN_ERR_COMM: //' | grep -Eq "rank $victim\b" ||
            fail "no ATTN_ERR_COMM message names rank $victim"
        line=$(grep "ATTN_ERR_COMM" "$log" | head -1)
    fi
    echo "$line" | grep -Eqi "step" || fail "the ATTN_ERR_COMM message does not name the step"
    echo "$line" | grep -Eq "\b3(\.0+)? ?s" || fail "the ATTN_ERR_COMM message does not give the 3 s timeout"
    echo "faults.sh: the job ended with status $status $((SECONDS - t0)) s after the stop" \
        "(the stopped rank outlived the job: $still); the errors:"
    grep "ATTN_ERR_COMM" "$log"
}

case $case in
kill)
    signal_victim KILL --timeout 20
    echo "faults.sh: killed rank $victim (pid $pid) with SIGKILL"
    # Open MPI notices a dead rank at once; our timeout (20 s) is the bound.
    wait_job 45 || fail "the job still runs 45 s after rank $victim was killed (a hang)"
    [ "$status" != 0 ] || fail "the job exited 0 although rank $victim was killed"
    # mpirun's or attn's message (not the driver's own "rank R: ring call")
    named=$(grep -v "^rank [0-9]*: ring call" "$log" |
        grep -E "rank $victim\b|peer $victim\b|\[\[[0-9]+,1\],$victim\]" || true)
    [ -n "$named" ] || fail "no message names rank $victim"
    echo "faults.sh: the job ended with status $status $((SECONDS - t0)) s after the kill:"
    echo "$named" | head -5
    ;;
stop)
    signal_victim STOP --timeout 3
    echo "faults.sh: stopped rank $victim (pid $pid) with SIGSTOP"
    check_stopped_peer
    ;;
stop-between)
    start_job "${big[@]}" --timeout 3 --stop-after-call 1 --stop-rank $victim
    wait_pids
    pid=$(cut -d' ' -f1 "$tmp/rank$victim.pid")
    t0=$SECONDS
    echo "faults.sh: rank $victim (pid $pid) stops itself after its first call"
    check_stopped_peer
    ;;
mismatch-*)
    what=${case#mismatch-}
    # attn_ring.h: a shape that differs is ATTN_ERR_SHAPE, a parameter INVALID
    expect=SHAPE
    [ "$what" = causal ] && expect=INVALID
    # big enough that one step's compute (~0.2 s) dwarfs a refusal
    start_job check --no-check -H 8 -L 8192 -E 64 --mismatch "$what" --mismatch-rank $((np - 1)) \
        --expect-error "$expect" --timeout 20
    wait_job 60 || fail "the job still runs after 60 s"
    n=$(grep -c "refused as expected" "$log" || true)
    [ "$status" = 0 ] && [ "$n" = "$np" ] ||
        fail "expected all $np ranks refused with ATTN_ERR_$expect before compute, $n were (status $status)"
    cat "$log"
    ;;
*)
    echo "faults.sh: unknown case '$case'" >&2
    exit 2
    ;;
esac
echo "faults.sh: PASS ($case, $([ "$net" = 1 ] && echo "two namespaces over TCP" || echo "$np ranks on one host"))"
