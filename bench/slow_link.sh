#!/usr/bin/env bash
# `moray bench collectives` with a real slow inter-host link on one Linux machine (needs root).
#
# On a single CPU box every gloo connection, inside a process or across processes, runs over the same
# loopback, so there is no slow level for a hierarchical collective to spare. This script puts the two
# processes of a 2 x N mesh into two network namespaces ("hosts") joined by a veth pair whose egress is
# shaped with tbf to RATE; inside each namespace the process's own devices still talk over loopback.
# Each namespace gets its own hostname (gloo binds to the address the hostname resolves to).
#
# usage: bench/slow_link.sh RATE [bench collectives args...]   e.g. bench/slow_link.sh 1gbit --json out.json
set -euo pipefail
RATE=${1:?usage: bench/slow_link.sh RATE [bench collectives args...]}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-$ROOT/.venv/bin/python}
PORT=${PORT:-23999}
NS=(moray-host0 moray-host1)
ADDR=(10.77.0.1 10.77.0.2)

cleanup() {
  for i in 0 1; do ip netns del "${NS[$i]}" 2>/dev/null || true; rm -rf "/etc/netns/${NS[$i]}"; done
}
trap cleanup EXIT
cleanup

ip link add veth-moray0 type veth peer name veth-moray1
for i in 0 1; do
  ns=${NS[$i]}
  ip netns add "$ns"
  ip link set "veth-moray$i" netns "$ns"
  ip -n "$ns" addr add "${ADDR[$i]}/24" dev "veth-moray$i"
  ip -n "$ns" link set lo up
  ip -n "$ns" link set "veth-moray$i" up
  tc -n "$ns" qdisc add dev "veth-moray$i" root tbf rate "$RATE" burst 256kb latency 50ms
  mkdir -p "/etc/netns/$ns"  # `ip netns exec` bind-mounts these files over /etc
  printf '127.0.0.1 localhost\n%s %s\n%s %s\n' "${ADDR[0]}" "${NS[0]}" "${ADDR[1]}" "${NS[1]}" > "/etc/netns/$ns/hosts"
done

pids=()
for i in 0 1; do
  ip netns exec "${NS[$i]}" unshare --uts sh -c "hostname ${NS[$i]}; cd '$ROOT'; exec env \
    MORAY_COORDINATOR_ADDRESS=${ADDR[0]}:$PORT MORAY_NUM_PROCESSES=2 MORAY_PROCESS_ID=$i MORAY_BENCH_LINK='veth, tbf $RATE' MORAY_BENCH_LINK_DEV=veth-moray$i \
    JAX_PLATFORMS=cpu JAX_NUM_CPU_DEVICES=\${DEVICES_PER_HOST:-4} '$PY' -m bench.collectives $*" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
for i in 0 1; do echo "${NS[$i]} link: $(ip -n "${NS[$i]}" -s link show "veth-moray$i" | awk '/TX:/{getline; print $1 " bytes sent"}')" >&2; done
exit $rc
