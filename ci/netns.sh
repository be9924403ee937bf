#!/usr/bin/env bash
# netns.sh: hosts as network namespaces on one bridge, with link faults, for
# trying the README's two-host recipes on one machine. The same layout as the
# multi-host tests' harness (crates/kvlane-cli/tests/netns/mod.rs). Needs root.
#
#   ci/netns.sh up N                  hosts kvh1..kvhN at 10.231.0.1..N/24 (bridge in kvh-sw)
#   ci/netns.sh exec HOST CMD...      run CMD in HOST (keeps cwd and environment)
#   ci/netns.sh link HOST up|down     cut or restore HOST's cable (its bridge port)
#   ci/netns.sh loss HOST PCT|clear   drop PCT% of HOST's packets, both ways (nftables)
#   ci/netns.sh blackhole HOST PORT|clear   drop every TCP packet to PORT on HOST
#   ci/netns.sh down                  remove every namespace this script made
#
# PREFIX=name changes the kvh prefix. There is no delay command: this kernel
# has no sch_netem; the tests put a delaying proxy on a router host instead.
set -euo pipefail
P=${PREFIX:-kvh}
cmd=${1:-}; shift || true
[ "$(id -u)" = 0 ] || { echo "netns.sh: needs root (network namespaces)" >&2; exit 2; }
need() { command -v "$1" >/dev/null || { apt-get update -q && apt-get install -y -q "$2"; } >/dev/null; }
need ip iproute2
port_of() { echo "p${1#"$P"}"; }
case "$cmd" in
  up)
    n=${1:?N}
    ip netns add "$P-sw"
    ip -n "$P-sw" link add br0 type bridge
    ip -n "$P-sw" link set br0 up
    for i in $(seq 1 "$n"); do
      ip netns add "$P$i"
      ip -n "$P-sw" link add "p$i" type veth peer name eth0 netns "$P$i"
      ip -n "$P-sw" link set "p$i" master br0 up
      ip -n "$P$i" link set lo up
      ip -n "$P$i" addr add "10.231.0.$i/24" dev eth0
      ip -n "$P$i" link set eth0 up
      echo "$P$i 10.231.0.$i"
    done ;;
  exec) h=${1:?HOST}; shift; exec ip netns exec "$h" "$@" ;;
  link) ip -n "$P-sw" link set "$(port_of "${1:?HOST}")" "${2:?up|down}" ;;
  loss)
    need nft nftables; h=${1:?HOST}; pct=${2:?PCT|clear}
    ip netns exec "$h" nft -f - <<<"table inet kvloss
delete table inet kvloss"
    [ "$pct" = clear ] || ip netns exec "$h" nft -f - <<EOF
table inet kvloss {
  chain in { type filter hook input priority 0; iifname "eth0" numgen random mod 100 < $pct counter drop; }
  chain out { type filter hook output priority 0; oifname "eth0" numgen random mod 100 < $pct counter drop; }
}
EOF
    ;;
  blackhole)
    need nft nftables; h=${1:?HOST}; port=${2:?PORT|clear}
    if [ "$port" = clear ]; then
      ip netns exec "$h" nft -f - <<<"table inet kvbh
delete table inet kvbh"
    else
      ip netns exec "$h" nft -f - <<<"table inet kvbh {
  chain in { type filter hook input priority 0; tcp dport $port counter drop; }
}"
    fi ;;
  down)
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$P([0-9]+|-sw)$" || true); do
      for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
      ip netns del "$ns"
    done ;;
  *) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
