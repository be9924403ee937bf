#!/usr/bin/env bash
# ci/softroce-2host.sh -- run two commands in two throw-away QEMU guests, "a"
# and "b", each with its own Soft-RoCE device rxe0, joined by a private
# virtual Ethernet link: RDMA traffic (RoCE v2, UDP 4791) leaves one guest
# kernel, crosses the link and is served by the other guest's kernel.
#
# Usage:
#   ci/softroce-2host.sh                  # self test across the link (ping,
#                                         # ibv_rc_pingpong, ib_write_bw, ib_read_bw)
#   ci/softroce-2host.sh CMD_A CMD_B      # bash code for guest a and for guest b
#
# Exit code: 0 when both commands exit 0, else guest a's non-zero exit code,
# else guest b's; 125 = this script failed (packages, kernel, VM timeout, a
# guest that reported nothing), 126 = a guest could not set up rxe0.
#
# The link: QEMU `-netdev stream` over a unix socket in the per-run dir
# (guest a's QEMU listens, b's connects once a's socket exists) -- a cable
# between two QEMU processes.  It opens no IP socket on the host and the
# guests have no other NIC: nothing leaves this machine.  Addresses:
# $SOFTROCE_SUBNET.1/24 on a, .2/24 on b; rxe0 is bound to that NIC.
# SOFTROCE_LINKS=2 adds a second link the same way (its own socket, its own
# NIC in each guest, $SOFTROCE_SUBNET2.1/24 and .2/24) with rxe1 bound to
# it: two rails per guest.
#
# Guest environment (besides what ci/softroce.sh's guests get):
#   SOFTROCE_NAME (a|b), SOFTROCE_PEER (b|a), SOFTROCE_IP (own address),
#   SOFTROCE_PEER_IP, SOFTROCE_IP_A, SOFTROCE_IP_B, and SOFTROCE_SHARE: one
#   directory both guests mount read-write (marks, each guest's rc file);
#   with two links also SOFTROCE_IP2, SOFTROCE_NETDEV2 (the second NIC),
#   SOFTROCE_PEER_IP2, SOFTROCE_IP2_A, SOFTROCE_IP2_B.
# Synchronisation: the helpers of ci/softroce-guest.sh, sourced before each
# command: softroce_mark / softroce_await (one guest tells the other),
# softroce_serve / softroce_client (one-shot servers such as perftest),
# softroce_wait_port (a server that takes a probe connection),
# softroce_await_peer (the other guest's command has finished).  All bounded.
# When one guest's command fails, the other gets $SOFTROCE_PEER_GRACE seconds
# to finish, then its VM is stopped (its waits would only time out).
#
# Knobs: everything ci/softroce.sh reads (SOFTROCE_ACCEL, _MEM, _TIMEOUT, ...,
# per guest; SOFTROCE_NETDEV does not apply), and
#   SOFTROCE_SMP          vCPUs per guest (default: host CPUs / 2, 1..4)
#   SOFTROCE_SUBNET       first three octets of the link (default 10.232.0)
#   SOFTROCE_LINKS        links between the guests, 1 or 2 (default 1)
#   SOFTROCE_SUBNET2      the second link's (default 10.233.0)
#   SOFTROCE_LINK_MTU     MTU of the link NICs (default 1500; rxe's RoCE MTU
#                         follows it: 1500 -> 1024, 4200 and up -> 4096)
#   SOFTROCE_PEER_GRACE   seconds (default 30)
set -euo pipefail
SOFTROCE_LOG_TAG=softroce-2host
# shellcheck source=ci/softroce-lib.sh
. "$(dirname "$0")/softroce-lib.sh"
NCPU=$(( $(nproc) / 2 )); [ "$NCPU" -lt 1 ] && NCPU=1; [ "$NCPU" -gt 4 ] && NCPU=4
SMP=${SOFTROCE_SMP:-$NCPU}
SUBNET=${SOFTROCE_SUBNET:-10.232.0}
LINKS=${SOFTROCE_LINKS:-1}
SUBNET2=${SOFTROCE_SUBNET2:-10.233.0}
LINK_MTU=${SOFTROCE_LINK_MTU:-1500}
GRACE=${SOFTROCE_PEER_GRACE:-30}

SELFTEST_A=$(cat <<'EOF'
set -u
fail=0
G=$(softroce_gid_index -v) || exit 1
softroce_serve rcpp 18515 60 ibv_rc_pingpong -d rxe0 -g "$G" -n 500 || fail=1
softroce_serve wbw 18516 120 ib_write_bw -d rxe0 -x "$G" -F -s 65536 -n 500 -p 18516 || fail=1
softroce_serve rbw 18517 120 ib_read_bw -d rxe0 -x "$G" -F -s 65536 -n 500 -p 18517 || fail=1
exit $fail
EOF
)
SELFTEST_B=$(cat <<'EOF'
set -u
fail=0
G=$(softroce_gid_index) || exit 1
busybox ping -c 3 -W 2 "$SOFTROCE_PEER_IP" || fail=1
softroce_client rcpp 60 ibv_rc_pingpong -d rxe0 -g "$G" -n 500 "$SOFTROCE_PEER_IP" || fail=1
softroce_client wbw 120 ib_write_bw -d rxe0 -x "$G" -F -s 65536 -n 500 -p 18516 "$SOFTROCE_PEER_IP" || fail=1
softroce_client rbw 120 ib_read_bw -d rxe0 -x "$G" -F -s 65536 -n 500 -p 18517 "$SOFTROCE_PEER_IP" || fail=1
[ $fail -eq 0 ] && echo "SELFTEST (two guests): ALL PASSED" || echo "SELFTEST (two guests): FAILURES"
exit $fail
EOF
)
case $# in
  0) CMD_A=$SELFTEST_A CMD_B=$SELFTEST_B ;;
  2) CMD_A=$1 CMD_B=$2 ;;
  *) echo "usage: $0 [CMD_A CMD_B]" >&2; exit 125 ;;
esac

case $LINKS in 1|2) ;; *) die "SOFTROCE_LINKS must be 1 or 2, not '$LINKS'" ;; esac
softroce_prepare
SOCK=$RUN/link.sock SOCK2=$RUN/link2.sock
[ ${#SOCK} -lt 100 ] || die "link socket path too long for a unix socket ($SOCK): set SOFTROCE_WORKDIR shorter"

ip_of() { case $1 in a) echo "$SUBNET.1" ;; b) echo "$SUBNET.2" ;; esac; }
ip2_of() { case $1 in a) echo "$SUBNET2.1" ;; b) echo "$SUBNET2.2" ;; esac; }
peer_of() { case $1 in a) echo b ;; b) echo a ;; esac; }

# start_guest NAME CODE SERVER(on|off) MAC: boots guest NAME in the
# background; its console goes to stdout prefixed "[NAME] " and to
# $RUN/console-NAME.log; sets PID[NAME] (the `timeout` wrapping QEMU).
start_guest() {
  local n=$1 code=$2 server=$3 mac=$4 p env append net2=()
  p=$(peer_of "$n")
  env=$(printf 'export SOFTROCE_PEER=%s SOFTROCE_PEER_IP=%s SOFTROCE_IP_A=%s SOFTROCE_IP_B=%s' \
    "$p" "$(ip_of "$p")" "$(ip_of a)" "$(ip_of b)")
  append="softroce.ip=$(ip_of "$n")/24 softroce.mtu=$LINK_MTU"
  if [ "$LINKS" = 2 ]; then
    env+=$(printf ' SOFTROCE_PEER_IP2=%s SOFTROCE_IP2_A=%s SOFTROCE_IP2_B=%s' "$(ip2_of "$p")" "$(ip2_of a)" "$(ip2_of b)")
    append+=" softroce.ip2=$(ip2_of "$n")/24"
    net2=(-netdev "stream,id=n1,server=$server,addr.type=unix,addr.path=$SOCK2"
          -device "virtio-net-pci,netdev=n1,mac=${mac%:*}:1${mac##*:0}")
  fi
  softroce_cmd_file "$SHARE/cmd-$n.sh" "$env" -c "$code"
  softroce_qemu_cmd "$n" "$append" \
    -netdev "stream,id=n0,server=$server,addr.type=unix,addr.path=$SOCK" \
    -device "virtio-net-pci,netdev=n0,mac=$mac" "${net2[@]}"
  timeout "$TIMEOUT" "${QEMU_CMD[@]}" </dev/null > >(tee "$RUN/console-$n.log" | sed -u "s/^/[$n] /") 2>&1 &
  PID[$n]=$!
  SOFTROCE_PIDS+=($!)
}

declare -A PID=() QRC=() GRC=() TOOK=()
log "booting two guests: ${ACCEL_ARGS[*]} -smp $SMP -m $MEM each, link $SUBNET.0/24 mtu $LINK_MTU over $SOCK${SOCK2:+$([ "$LINKS" = 2 ] && echo ", link $SUBNET2.0/24 over $SOCK2")}"
start=$(now)
start_guest a "$CMD_A" on 52:54:00:e8:00:01
# b's QEMU connects once: wait until a's QEMU listens on the link socket
i=0
until [ -n "$(ss -Hxl src "$SOCK" 2>/dev/null)" ] && { [ "$LINKS" = 1 ] || [ -n "$(ss -Hxl src "$SOCK2" 2>/dev/null)" ]; }; do
  kill -0 "${PID[a]}" 2>/dev/null || die "guest a's QEMU exited before it listened on $SOCK"
  i=$((i + 1)); [ $i -gt 100 ] && die "guest a's QEMU does not listen on $SOCK after 10s"
  sleep 0.1
done
start_guest b "$CMD_B" off 52:54:00:e8:00:02

# Wait for both.  The first guest that ends with a failure gives the other
# GRACE seconds before its VM is stopped.
reap() { # NAME: collect a finished guest
  local n=$1
  wait "${PID[$n]}" && QRC[$n]=0 || QRC[$n]=$?
  TOOK[$n]=$(since "$start")
  GRC[$n]=$(softroce_guest_rc "$n" "$RUN/console-$n.log")
}
running=(a b) deadline=
while [ ${#running[@]} -gt 0 ]; do
  left=()
  for n in "${running[@]}"; do
    if kill -0 "${PID[$n]}" 2>/dev/null; then left+=("$n"); continue; fi
    reap "$n"
    if [ "${GRC[$n]:-}" != 0 ] && [ -z "$deadline" ]; then
      deadline=$(( SECONDS + GRACE ))
      log "guest $n failed (rc=${GRC[$n]:-none}); the other guest has ${GRACE}s to finish"
    fi
  done
  running=("${left[@]}")
  if [ -n "$deadline" ] && [ $SECONDS -ge "$deadline" ]; then
    for n in "${running[@]}"; do
      log "stopping guest $n (its peer failed ${GRACE}s ago)"
      kill "${PID[$n]}" 2>/dev/null || true
      reap "$n"; GRC[$n]=${GRC[$n]:-stopped}
    done
    running=()
  fi
  [ ${#running[@]} -gt 0 ] && sleep 0.2
done
wait   # the console pipes
for n in a b; do cp "$RUN/console-$n.log" "$WORK/console-last-$n.log" 2>/dev/null || true; done

status=0
for n in a b; do
  log "guest $n: rc=${GRC[$n]:-none} (qemu rc=${QRC[$n]}, ${TOOK[$n]}s; console log: $WORK/console-last-$n.log)"
  if [ "${QRC[$n]}" = 124 ]; then
    log "ERROR: guest $n timed out after ${TIMEOUT}s"; [ "$status" = 0 ] && status=125
  elif ! [[ ${GRC[$n]:-} =~ ^[0-9]+$ ]]; then
    log "ERROR: guest $n did not report an exit code"; [ "$status" = 0 ] && status=125
  elif [ "${GRC[$n]}" != 0 ] && [ "$status" = 0 ]; then
    status=${GRC[$n]}
  fi
done
log "both guests done after $(since "$start")s, rc=$status"
exit "$status"
