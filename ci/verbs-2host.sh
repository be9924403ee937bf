#!/usr/bin/env bash
# ci/verbs-2host.sh -- kvlane over verbs between two hosts: two Soft-RoCE
# guests on one private link (ci/softroce-2host.sh), guest a = 10.232.0.1
# (target, servers), guest b = 10.232.0.2 (initiator, clients).  In ONE pair
# of VMs:
#   bench    a: kvlane bench --role target --listen 0.0.0.0:5555 --pool 256M --backend verbs
#            b: kvlane bench --role initiator --connect 10.232.0.1:5555 --backend verbs \
#                 --block-sizes 64K,1M --batch 16 --json
#            then ib_write_bw / ib_read_bw (server in a, client in b) at the
#            same message sizes, tx depth = the batch; prints both in GB/s
#            (1e9 B/s) and the ratio kvlane / perftest.
#   restart  a runs $RESTART_TARGET; b runs $RESTART_INITIATOR against it
#            (long transfers); after $RESTART_WARM s b asks a to SIGKILL the
#            target; a restarts it on the same port.  b must see the
#            initiator report the loss ($RESTART_LOST_RE) within
#            $RESTART_BUDGET s of the kill request; then, if set, report the
#            peer back ($RESTART_BACK_RE) and new transfers ($RESTART_OK_RE)
#            in the same output; then $RESTART_AFTER (a new initiator) must
#            succeed against the restarted target.
# The defaults use `kvlane bench` (an initiator that ends at the first failed
# transfer, so "back" is shown by a new process); a continuous initiator such
# as a `kvlane soak` is plugged in through the RESTART_* variables, e.g.
#   RESTART_INITIATOR='$KV soak --connect $A:$PORT --backend verbs ...' \
#   RESTART_BACK_RE='Restarted' RESTART_OK_RE='...' RESTART_AFTER= ci/verbs-2host.sh restart
# (commands run in the guest with bash; $KV = the kvlane binary, $A = guest
# a's address, $PORT, $POOL and $BATCH are set there).
#
# Known issue (measured here, TCG, Debian 6.1 rxe): with the ACK timeout both
# kvlane and perftest use (exponent 14 = 67 ms) rxe retransmits under TCG
# (completer_retry_err > 0) and then may fail a 1 MiB WRITE with "remote
# invalid request"; ib_write_bw -q 2 (kvlane's 2 QPs per peer) fails the same
# way about half the time, -u 18 (1.07 s) makes it go away.  kvlane has no
# knob for its QP timeout yet (VerbsConfig.qp.timeout).  The rxe counters
# of both guests are printed after each phase for this reason.
#
# Usage: ci/verbs-2host.sh [bench|restart|all]   (default all)
# Exit code: non-zero when the build, a transfer, a wait or a check fails.
# Bandwidth is reported, not asserted (TCG timing is noisy); set
# VERBS2_MIN_RATIO=0.5 to enforce kvlane >= 0.5 x perftest.
#
# Knobs: VERBS2_SIZES (64K,1M) VERBS2_OPS (read,write: the initiator's --op)
#        VERBS2_BATCH (16) VERBS2_POOL (256M) VERBS2_PORT (5555)
#        VERBS2_PERF_MB (32: MiB each perftest run moves)
#        VERBS2_PERF_QPS (1: perftest -q; kvlane stripes over 2 QPs per peer)
#        VERBS2_PERF_ARGS (more perftest options, e.g. '-u 18')
#        VERBS2_ENV (VAR=VALUE ... exported to every command in both guests,
#        e.g. RUST_LOG=debug)
#        RESTART_TARGET, RESTART_INITIATOR, RESTART_WARM (3), RESTART_BUDGET
#        (6: the agent's liveness budget, 3 pings x 1 s, plus the signal
#        between the guests and TCG slack), RESTART_LOST_RE
#        ('was lost|PeerLost'), RESTART_BACK_RE, RESTART_OK_RE, RESTART_AFTER,
#        KVLANE_BIN (a prebuilt kvlane with --features verbs: skips the build),
#        plus everything ci/softroce-2host.sh reads (SOFTROCE_LINK_MTU: this
#        script defaults it to 9000, i.e. RoCE MTU 4096, as RoCE fabrics run).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
SOFTROCE_LOG_TAG=verbs-2host
# shellcheck source=ci/softroce-lib.sh
. ci/softroce-lib.sh

PHASES=${1:-all}
case $PHASES in all) PHASES="bench restart" ;; bench|restart) ;; *) die "usage: $0 [bench|restart|all]" ;; esac
# (the guests read these: they are passed on by name in $PRE)
# shellcheck disable=SC2034
{
  SIZES=${VERBS2_SIZES:-64K,1M}
  OPS=${VERBS2_OPS:-read,write}
  BATCH=${VERBS2_BATCH:-16}
  POOL=${VERBS2_POOL:-256M}
  PORT=${VERBS2_PORT:-5555}
  PERF_MB=${VERBS2_PERF_MB:-32}
  PERF_QPS=${VERBS2_PERF_QPS:-1}
  MIN_RATIO=${VERBS2_MIN_RATIO:-}
  EXTRA_ENV=${VERBS2_ENV:-}
  PERF_ARGS=${VERBS2_PERF_ARGS:-}
}
export SOFTROCE_LINK_MTU=${SOFTROCE_LINK_MTU:-9000}
export SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-600}
# shellcheck disable=SC2016 # expanded in the guest
RESTART_TARGET=${RESTART_TARGET-'"$KV" bench --role target --listen "0.0.0.0:$PORT" --pool 64M --backend verbs'}
# shellcheck disable=SC2016
RESTART_INITIATOR=${RESTART_INITIATOR-'"$KV" bench --role initiator --connect "$A:$PORT" --backend verbs --op write --block-sizes 64K --batch "$BATCH" --duration 120s --json'}
# shellcheck disable=SC2016
RESTART_AFTER=${RESTART_AFTER-'"$KV" bench --role initiator --connect "$A:$PORT" --backend verbs --op write,read --block-sizes 64K --batch "$BATCH" --duration 1s --json'}
RESTART_WARM=${RESTART_WARM:-3}
RESTART_BUDGET=${RESTART_BUDGET:-6}
RESTART_LOST_RE=${RESTART_LOST_RE:-was lost|PeerLost}
RESTART_BACK_RE=${RESTART_BACK_RE:-}
RESTART_OK_RE=${RESTART_OK_RE:-}

# ------------------------------------------------------------ build
t0=$(now)
KV=${KVLANE_BIN:-}
if [ -z "$KV" ]; then
  # sideway -> rdma-mummy-sys builds a C shim with cmake and runs bindgen (libclang).
  softroce_need_pkgs cmake libclang-dev clang make gcc libibverbs-dev pkg-config
  log "building the kvlane CLI (release, --features verbs)"
  KV=$(cargo build --release --locked -p kvlane-cli --features verbs \
         --message-format=json-render-diagnostics | cargo_exe)
fi
[ -x "$KV" ] || die "no kvlane binary (${KV:-the build produced none})"
log "kvlane: $KV (ready after $(since "$t0")s)"

# sizes in bytes for perftest ("64K" -> 65536)
bytes() {
  local n=${1%[KkMmGg]}
  case $1 in *[Kk]) echo $((n << 10)) ;; *[Mm]) echo $((n << 20)) ;; *[Gg]) echo $((n << 30)) ;; *) echo "$n" ;; esac
}
SIZES_B=
for s in ${SIZES//,/ }; do SIZES_B+="$(bytes "$s") "; done

# what both guests get, then each guest's script (quoted: runs in the guest)
PRE=$(for v in KV PHASES SIZES SIZES_B OPS BATCH POOL PORT PERF_MB PERF_QPS PERF_ARGS EXTRA_ENV MIN_RATIO RESTART_TARGET \
               RESTART_INITIATOR RESTART_AFTER RESTART_WARM RESTART_BUDGET RESTART_LOST_RE \
               RESTART_BACK_RE RESTART_OK_RE; do printf 'export %s=%q\n' "$v" "${!v}"; done)
COMMON=$(cat <<'EOF'
set -u
rc=0
export KVLANE_IB_DEVICE=rxe0
for kv in $EXTRA_ENV; do export "${kv?}"; done
export A=$SOFTROCE_IP_A
G=$(softroce_gid_index) || exit 1
has() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }
gone() { ! kill -0 "$1" 2>/dev/null; }
# stop PID LOG: SIGINT, SIGKILL after 10 s; prints the exit code and LOG
stop() {
  kill -INT "$1" 2>/dev/null
  softroce_poll 10 "pid $1 to exit after SIGINT" gone "$1" || kill -KILL "$1" 2>/dev/null
  wait "$1"; echo "--- exited rc=$? ($2):"; cat "$2"
}
# perftest at one size: tool, size -> the arguments both sides take
perf_args() { echo "-d rxe0 -x $G -F -s $2 -n $(( (PERF_MB << 20) / $2 < 2 * BATCH ? 2 * BATCH : (PERF_MB << 20) / $2 )) -t $BATCH -q $PERF_QPS $PERF_ARGS --report_gbits -p $3"; }
EOF
)
GUEST_A=$(cat <<'EOF'
if has bench; then
  echo "===== [a] kvlane bench target (--pool $POOL), then perftest servers"
  "$KV" bench --role target --listen "0.0.0.0:$PORT" --pool "$POOL" --backend verbs > /tmp/target.log 2>&1 &
  tp=$!
  softroce_wait_listen "$PORT" 120 "$tp" || rc=1
  softroce_await bench-done 600 || rc=1
  stop "$tp" /tmp/target.log
  echo "rxe0 counters after the kvlane bench: $(softroce_rxe_counters)"
  port=18600
  for op in ${OPS//,/ }; do
    for s in $SIZES_B; do
      port=$((port + 1))
      # shellcheck disable=SC2046
      softroce_serve "perf-$op-$s" "$port" 120 "ib_${op}_bw" $(perf_args "$op" "$s" "$port") \
        > "/tmp/perf-$op-$s.log" 2>&1 || { rc=1; cat "/tmp/perf-$op-$s.log"; }
    done
  done
  echo "rxe0 counters after perftest: $(softroce_rxe_counters)"
fi
if has restart; then
  echo "===== [a] restart: target = $RESTART_TARGET"
  bash -c "exec $RESTART_TARGET" > /tmp/r1.log 2>&1 &
  tp=$!
  if softroce_wait_listen "$PORT" 120 "$tp"; then
    softroce_mark r-up
    if softroce_await r-kill 300; then
      kill -KILL "$tp"; wait "$tp"; echo "target pid $tp killed (SIGKILL, rc=$?) at guest uptime $(cut -d' ' -f1 /proc/uptime)s"
      cat /tmp/r1.log
      bash -c "exec $RESTART_TARGET" > /tmp/r2.log 2>&1 &
      tp=$!
      if softroce_wait_listen "$PORT" 120 "$tp"; then
        echo "target restarted on port $PORT (pid $tp) at guest uptime $(cut -d' ' -f1 /proc/uptime)s"
        softroce_mark r-restarted
        softroce_await_peer 600 || rc=1
      else
        cat /tmp/r2.log; rc=1
      fi
    else
      rc=1
    fi
  else
    rc=1
  fi
  stop "$tp" /tmp/r2.log
fi
exit $rc
EOF
)
GUEST_B=$(cat <<'EOF'
# jnum LINE KEY: a number field of a JSON row
jnum() { sed -n "s/.*\"$2\":\([-0-9.e+]*\).*/\1/p" <<<"$1"; }
if has bench; then
  echo "===== [b] kvlane bench initiator -> $A:$PORT, then perftest clients"
  softroce_wait_port "$A" "$PORT" 120 || exit 1
  set -- "$KV" bench --role initiator --connect "$A:$PORT" --backend verbs --block-sizes "$SIZES" --op "$OPS" --batch "$BATCH" --json
  echo "+ $*"
  t=$EPOCHREALTIME
  timeout 600 "$@" > /tmp/bench.json 2> /tmp/bench.err || { echo "the kvlane initiator failed (rc=$?)"; rc=1; }
  echo "kvlane bench took $(awk -v a="$t" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')s"
  cat /tmp/bench.json /tmp/bench.err
  c=$(softroce_rxe_counters)
  echo "rxe0 counters after the kvlane bench: $c"
  case "$c" in *completer_retry_err=*)
    echo "NOTE: rxe retransmitted (ACK timeout: exponent 14 = 67 ms, kvlane's and perftest's default, is short for rxe under TCG);"
    echo "      Debian 6.1 rxe can then fail a WRITE with 'remote invalid request' (seen with ib_write_bw -q 2 too; gone with -u 18)" ;;
  esac
  softroce_mark bench-done
  port=18600
  for op in ${OPS//,/ }; do
    for s in $SIZES_B; do
      port=$((port + 1))
      # shellcheck disable=SC2046
      softroce_client "perf-$op-$s" 120 "ib_${op}_bw" $(perf_args "$op" "$s" "$port") "$A" \
        > "/tmp/perf-$op-$s.out" 2>&1 || { rc=1; cat "/tmp/perf-$op-$s.out"; }
      echo "+ ib_${op}_bw $(perf_args "$op" "$s" "$port") $A"
    done
  done
  echo
  echo "===== two hosts over verbs: b $SOFTROCE_IP -> a $A, rxe0 on each, RoCE MTU $(ibv_devinfo -d rxe0 | awk '/active_mtu/ { print $2; exit }'), GB/s = 1e9 B/s"
  printf '%-6s %8s %14s %12s %12s %16s %8s\n' op block "kvlane GB/s" "lat avg us" "lat p99 us" "perftest GB/s" ratio
  bad=0
  for op in ${OPS//,/ }; do
    for s in $SIZES_B; do
      row=$(grep "\"op\":\"$op\"" /tmp/bench.json | grep "\"block_size\":$s," | head -n1)
      kg=$(jnum "$row" gbps); la=$(jnum "$row" lat_avg_us); lp=$(jnum "$row" lat_p99_us)
      pg=$(awk -v s="$s" '$1 == s && NF >= 4 { v = $4 } END { print v / 8 }' "/tmp/perf-$op-$s.cli" 2>/dev/null)
      [ -n "$kg" ] || { echo "no kvlane row for $op $s"; rc=1; }
      awk -v op="$op" -v s="$s" -v kg="${kg:-0}" -v la="${la:-0}" -v lp="${lp:-0}" -v pg="${pg:-0}" -v min="$MIN_RATIO" 'BEGIN {
        r = (pg > 0) ? kg / pg : -1
        printf "%-6s %8s %14.4f %12.0f %12.0f %16.4f %8s\n", op, (s >= 1048576 ? s / 1048576 "M" : s / 1024 "K"),
               kg, la, lp, pg, (r < 0 ? "n/a" : sprintf("%.2f", r))
        exit (min != "" && (r < 0 || r < min)) ? 1 : 0 }' || bad=1
    done
  done
  echo "(kvlane: batches of $BATCH blocks, each batch awaited, striped over its 2 QPs per peer;"
  echo " perftest: $PERF_MB MiB per run, tx depth $BATCH kept full, $PERF_QPS QP)"
  echo "rxe0 counters after perftest: $(softroce_rxe_counters)"
  [ $bad = 0 ] || { echo "kvlane is below VERBS2_MIN_RATIO=$MIN_RATIO x perftest"; rc=1; }
fi
if has restart; then
  echo "===== [b] restart: initiator = $RESTART_INITIATOR"
  softroce_await r-up 300 && softroce_wait_port "$A" "$PORT" 60 || exit 1
  bash -c "exec $RESTART_INITIATOR" > /tmp/ri.log 2>&1 &
  ip=$!
  sleep "$RESTART_WARM"
  if gone "$ip"; then
    wait "$ip"; echo "FAIL: the initiator ended (rc=$?) before the kill"; cat /tmp/ri.log; exit 1
  fi
  t=$EPOCHREALTIME
  softroce_mark r-kill
  echo "asked a to SIGKILL the target after ${RESTART_WARM}s of transfers"
  # elapsed: seconds since the kill request
  elapsed() { awk -v a="$t" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }'; }
  lost() { grep -Eq "$RESTART_LOST_RE" /tmp/ri.log; }
  if softroce_poll 60 "the initiator to report the loss (/$RESTART_LOST_RE/)" lost; then
    dt=$(elapsed)
    echo "loss reported ${dt}s after the kill request: $(grep -Em1 "$RESTART_LOST_RE" /tmp/ri.log)"
    if awk -v d="$dt" -v b="$RESTART_BUDGET" 'BEGIN { exit !(d <= b) }'; then
      echo "PASS: transfers failed within the budget (${dt}s <= ${RESTART_BUDGET}s)"
    else
      echo "FAIL: transfers failed after ${dt}s, over the budget of ${RESTART_BUDGET}s"; rc=1
    fi
  else
    echo "FAIL: no loss reported within 60s of the kill; initiator output:"; rc=1
  fi
  gone "$ip" && { wait "$ip"; echo "the initiator exited rc=$? $(elapsed)s after the kill request"; }
  softroce_await r-restarted 120 || rc=1
  if [ -n "$RESTART_BACK_RE" ]; then
    back() { grep -Eq "$RESTART_BACK_RE" /tmp/ri.log; }
    softroce_poll 60 "the initiator to see the peer back (/$RESTART_BACK_RE/)" back &&
      echo "PASS: peer back $(elapsed)s after the kill request" || rc=1
  fi
  if [ -n "$RESTART_OK_RE" ]; then
    # a success line after the back line
    ok() { awk -v b="$RESTART_BACK_RE" -v o="$RESTART_OK_RE" 'b == "" || $0 ~ b { s = 1; next } s && $0 ~ o { f = 1 } END { exit !f }' /tmp/ri.log; }
    softroce_poll 60 "a transfer after the restart (/$RESTART_OK_RE/)" ok &&
      echo "PASS: transfers succeed again $(elapsed)s after the kill request" || rc=1
  fi
  gone "$ip" || stop "$ip" /tmp/ri.log
  echo "--- initiator output:"; cat /tmp/ri.log
  if [ -n "$RESTART_AFTER" ]; then
    echo "+ $RESTART_AFTER"
    if timeout 300 bash -c "exec $RESTART_AFTER" > /tmp/ra.log 2>&1; then
      echo "PASS: a new initiator moves data to the restarted target:"; cat /tmp/ra.log
    else
      echo "FAIL: a new initiator against the restarted target failed (rc=$?):"; cat /tmp/ra.log; rc=1
    fi
  fi
fi
exit $rc
EOF
)

log "phases: $PHASES; starting the two guests"
t1=$(now)
set +e
"$ROOT/ci/softroce-2host.sh" "$PRE"$'\n'"$COMMON"$'\n'"$GUEST_A" "$PRE"$'\n'"$COMMON"$'\n'"$GUEST_B"
rc=$?
set -e
log "two-guest run took $(since "$t1")s, rc=$rc; total $(since "$t0")s"
exit $rc
