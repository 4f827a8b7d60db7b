#!/usr/bin/env bash
# ring_netns_agent.sh — mpirun's "ssh" for scripts/ring_netns.sh.
# mpirun calls it as `AGENT HOST COMMAND...` (plm_rsh_agent); like ssh it runs
# COMMAND through a shell, here inside HOST's network namespace and a UTS
# namespace of its own, so the remote orted reports a hostname of its own
# (Open MPI then treats the two namespaces as two nodes: no shared memory).
# The host table comes from ring_netns.sh in ATTN_NETNS_HOSTS:
#   "ADDR=NETNS=HOSTNAME ADDR=NETNS=HOSTNAME".
set -euo pipefail
# ssh options mpirun may put before the host (none by default); skip them.
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
host=${1:?usage: ring_netns_agent.sh HOST COMMAND...}
shift
for entry in ${ATTN_NETNS_HOSTS:?ATTN_NETNS_HOSTS is not set}; do
    IFS== read -r addr ns name <<<"$entry"
    if [ "$addr" = "$host" ] || [ "$name" = "$host" ]; then
        # "$*": ssh joins its arguments into one command line for the shell.
        exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname '$name' && exec /bin/sh -c \"\$0\"" "$*"
    fi
done
echo "ring_netns_agent.sh: unknown host '$host' (hosts: $ATTN_NETNS_HOSTS)" >&2
exit 255
