#!/usr/bin/env bash
# Two "nodes" on one machine, joined by a link of a chosen bandwidth, for measuring what
# crosses between nodes (hybrid sharding, int8 collectives) where the link, not memory
# copies, is the bottleneck. Each node is a network namespace with one end of a veth pair
# whose egress is rate-limited (tc tbf); one torch.distributed.run agent runs in each, they
# rendezvous over the link (c10d; node A hosts the store: its namespace address is not the
# machine's hostname, by which torch would otherwise decide), and gloo sends over it
# (GLOO_SOCKET_IFNAME).
#
#   sudo RATE=2gbit NPROC=1 bench/two_nodes.sh OUT.json -- ARGS...
#
# ARGS is a training script and its arguments, the same on both nodes, e.g. the shared
# benchmark (bench/compare.py --system zs_zero3 --regime memory --precision fp32)
# or bench/zs_bench.py with its own options; "--out OUT.json" is appended. Needs root
# (namespaces, tc); the namespaces and the link are removed on exit.
set -euo pipefail
out="$1"; shift
[ "${1:-}" = "--" ] && shift
rate="${RATE:-2gbit}" nproc="${NPROC:-1}" port="${PORT:-29611}"
py="${PYTHON:-$(command -v python)}"
a=zsnodeA b=zsnodeB
cleanup() { ip netns del "$a" 2>/dev/null || true; ip netns del "$b" 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add "$a"; ip netns add "$b"
ip link add zsveth0 type veth peer name zsveth1
ip link set zsveth0 netns "$a"; ip link set zsveth1 netns "$b"
ip -n "$a" addr add 10.231.0.1/24 dev zsveth0; ip -n "$b" addr add 10.231.0.2/24 dev zsveth1
for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
ip -n "$a" link set zsveth0 up; ip -n "$b" link set zsveth1 up
ip netns exec "$a" tc qdisc add dev zsveth0 root tbf rate "$rate" burst 4mb latency 100ms
ip netns exec "$b" tc qdisc add dev zsveth1 root tbf rate "$rate" burst 4mb latency 100ms

node() {  # node rank, namespace, interface, address, then the script and its arguments
  local rank="$1" ns="$2" iface="$3" addr="$4"; shift 4
  ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$iface" OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
    PYTHONUNBUFFERED=1 "$py" -m torch.distributed.run --nnodes 2 --node-rank "$rank" \
    --nproc-per-node "$nproc" --rdzv-backend c10d --rdzv-endpoint "10.231.0.1:$port" \
    --rdzv-conf "is_host=$([ "$rank" = 0 ] && echo 1 || echo 0)" --local-addr "$addr" \
    --rdzv-id two-nodes "$@" --out "$out"
}
node 0 "$a" zsveth0 10.231.0.1 "${@}" & first=$!
node 1 "$b" zsveth1 10.231.0.2 "${@}" & second=$!
status=0
wait "$first" || status=$?
wait "$second" || status=$?
exit "$status"
