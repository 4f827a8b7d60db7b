#!/usr/bin/env bash
# ring_netns.sh — runs an MPI program on two hosts for real: two network
# namespaces joined by a veth pair, ranks split between them, Open MPI over
# TCP on the veth only (btl tcp,self: no shared memory between the hosts).
#
# Usage: scripts/ring_netns.sh [options] -- PROGRAM [ARGS...]
#   --per-host N     ranks in each namespace (default 1; mapped by node, so
#                    with N = 1 every ring hop crosses the veth)
#   --timeout S      end the job after S seconds (default 300): exit 124
#   --min-bytes N    fail (exit 3) unless the veth carried >= N bytes each way
#   --counters FILE  write the veth's byte/packet counts (key=value) to FILE
#   --rate R         cap the veth at R each way (tc tbf), e.g. 1gbit: a
#                    slower link for the docs' model (no netem here, so no
#                    added latency)
#   --mca KEY VALUE  one more mpirun --mca (repeatable)
#   -x VAR           pass VAR to the ranks (repeatable; OMP_NUM_THREADS and
#                    ATTN_* are always passed when set)
# Exit status: mpirun's (the program's), 124 on timeout, 3 when the byte
# check fails. Root only (ip netns). Everything it creates carries a name
# unique to this run and is removed by the EXIT trap, on failure too.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
per_host=1 timeout_s=300 min_bytes=0 counters='' rate=''
mca=() xvars=()
while [ $# -gt 0 ]; do
    case $1 in
        --per-host) per_host=$2; shift 2 ;;
        --timeout) timeout_s=$2; shift 2 ;;
        --min-bytes) min_bytes=$2; shift 2 ;;
        --counters) counters=$2; shift 2 ;;
        --rate) rate=$2; shift 2 ;;
        --mca) mca+=(--mca "$2" "$3"); shift 3 ;;
        -x) xvars+=(-x "$2"); shift 2 ;;
        --) shift; break ;;
        *) echo "ring_netns.sh: unknown option '$1' (see the header for usage)" >&2; exit 2 ;;
    esac
done
[ $# -gt 0 ] || { echo "usage: ring_netns.sh [options] -- PROGRAM [ARGS...]" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "ring_netns.sh: needs root (ip netns)" >&2; exit 2; }
for tool in ip unshare mpirun timeout; do
    command -v "$tool" >/dev/null || { echo "ring_netns.sh: $tool not found" >&2; exit 2; }
done

# Unique per run (pid + random), short enough for 15-character link names.
id=$(printf '%x%04x' $$ $((RANDOM)))
ns_a=attn-ring-$id-a ns_b=attn-ring-$id-b
veth_a=ra$id veth_b=rb$id
host_a=ringa-$id host_b=ringb-$id
addr_a=10.77.0.1 addr_b=10.77.0.2 # private to this pair of namespaces

cleanup() {
    local rc=$?
    set +e
    # A stopped or orphaned rank would keep a namespace alive: kill what is
    # left inside (SIGKILL ends a SIGSTOPped process too).
    # Only what this run made: a name another run holds is not ours.
    for ns in ${made_ns[@]+"${made_ns[@]}"}; do
        pids=$(ip netns pids "$ns" 2>/dev/null)
        [ -n "$pids" ] && kill -KILL $pids 2>/dev/null
        ip netns del "$ns" 2>/dev/null # takes its end of the veth along
    done
    [ -n "$made_veth" ] && ip link del "$veth_a" 2>/dev/null # not moved yet
    exit "$rc"
}
job='' made_ns=() made_veth=''
on_signal() { # end the job first (timeout passes TERM on to mpirun), then clean up
    if [ -n "$job" ]; then
        kill -TERM "$job" 2>/dev/null || true
        for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$job" 2>/dev/null || break; sleep 0.5; done
    fi
    exit "$1"
}
trap cleanup EXIT
trap 'on_signal 130' INT
trap 'on_signal 143' TERM
trap 'on_signal 129' HUP

ip netns add "$ns_a"; made_ns+=("$ns_a") # (set -e: only once made)
ip netns add "$ns_b"; made_ns+=("$ns_b")
ip link add "$veth_a" type veth peer name "$veth_b"; made_veth=1
ip link set "$veth_a" netns "$ns_a"
ip link set "$veth_b" netns "$ns_b"
made_veth=''
ip -n "$ns_a" addr add "$addr_a/24" dev "$veth_a"
ip -n "$ns_b" addr add "$addr_b/24" dev "$veth_b"
for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
ip -n "$ns_a" link set "$veth_a" up
ip -n "$ns_b" link set "$veth_b" up
if [ -n "$rate" ]; then
    # Token bucket on each egress. The bucket must hold a whole GSO packet
    # (64 KiB on a veth) or tbf drops it; 96 KiB passes at line rate.
    for side in "$ns_a $veth_a" "$ns_b $veth_b"; do
        read -r ns dev <<<"$side"
        ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" burst 96kb latency 20ms
    done
fi

counter() { # NS DEV FIELD
    ip netns exec "$1" cat "/sys/class/net/$2/statistics/$3"
}
tx0=$(counter "$ns_a" "$veth_a" tx_bytes) rx0=$(counter "$ns_a" "$veth_a" rx_bytes)
txp0=$(counter "$ns_a" "$veth_a" tx_packets) rxp0=$(counter "$ns_a" "$veth_a" rx_packets)

export ATTN_NETNS_HOSTS="$addr_a=$ns_a=$host_a $addr_b=$ns_b=$host_b"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
for v in $(compgen -e | grep -E '^(OMP_NUM_THREADS|ATTN_[A-Z0-9_]+)$' | grep -v '^ATTN_NETNS_HOSTS$'); do
    xvars+=(-x "$v")
done

# mpirun (and rank 0) live in namespace A; rank 1's orted is started through
# the agent in namespace B. Both TCP channels (the BTL that carries MPI
# messages, and ORTE's out-of-band one) are held to the veth's subnet.
# In the background, so that a signal to this script is handled at once (bash
# runs traps only between commands, and `wait` is where it waits).
rc=0
timeout --kill-after=10 "$timeout_s" \
    ip netns exec "$ns_a" unshare --uts /bin/sh -c 'hostname "$0" && exec "$@"' "$host_a" \
    mpirun -np $((2 * per_host)) --host "$addr_a:$per_host,$addr_b:$per_host" --map-by node \
    --bind-to none \
    --mca plm_rsh_agent "$here/ring_netns_agent.sh" \
    --mca plm_rsh_no_tree_spawn 1 \
    --mca pml ob1 --mca btl tcp,self \
    --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
    ${mca[@]+"${mca[@]}"} ${xvars[@]+"${xvars[@]}"} \
    "$@" </dev/null &
job=$!
wait "$job" || rc=$?
job=''

tx=$(($(counter "$ns_a" "$veth_a" tx_bytes) - tx0)) rx=$(($(counter "$ns_a" "$veth_a" rx_bytes) - rx0))
txp=$(($(counter "$ns_a" "$veth_a" tx_packets) - txp0)) rxp=$(($(counter "$ns_a" "$veth_a" rx_packets) - rxp0))
echo "ring_netns.sh: veth $veth_a ($host_a $addr_a) <-> $veth_b ($host_b $addr_b):" \
    "sent $tx bytes ($txp packets), received $rx bytes ($rxp packets); mpirun exit $rc" >&2
if [ -n "$counters" ]; then
    printf 'tx_bytes=%s\nrx_bytes=%s\ntx_packets=%s\nrx_packets=%s\nexit=%s\n' \
        "$tx" "$rx" "$txp" "$rxp" "$rc" >"$counters"
fi
[ "$rc" = 124 ] && echo "ring_netns.sh: the job ran past ${timeout_s}s and was ended" >&2
if [ "$rc" = 0 ] && [ "$min_bytes" -gt 0 ] && { [ "$tx" -lt "$min_bytes" ] || [ "$rx" -lt "$min_bytes" ]; }; then
    echo "ring_netns.sh: FAIL: the veth carried less than $min_bytes bytes each way" \
        "(sent $tx, received $rx): the ranks did not talk over it" >&2
    rc=3
fi
exit "$rc"
