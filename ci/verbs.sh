#!/usr/bin/env bash
# ci/verbs.sh -- build the verbs backend (cargo feature `verbs`), then in ONE
# Soft-RoCE VM (ci/softroce.sh):
#   1. run the ignored hardware tests of crates/kvlane-data/tests/verbs.rs on rxe0
#      (conformance suite, in host memory and in mock CUDA and ROCm memory
#      registered by device address; notifications, striping, SQ-full, remote
#      access error);
#   2. run perftest ib_write_bw / ib_read_bw at 64 KiB on rxe0;
#   3. run the kvlane verbs bench (examples/verbs_bench.rs) with the same
#      message size, iteration count, queue depth and QP count, and
#      `kvlane bench --backend verbs` (the CLI: batches of 128 blocks);
# and print the bandwidths and the ratio kvlane/perftest.
#
# Exit code: non-zero when the build or a test fails, when verbs_bench is
# below VERBS_MIN_RATIO x perftest in the same VM (default 0.8), when the
# CLI bench is below VERBS_CLI_MIN_RATIO x perftest (default 0.5), or when
# perftest measured nothing to compare with.
# Thresholds from measurements (TCG, rxe0, 64 KiB x 1000, depth 128, 1 QP):
#   idle host, best of 5: verbs_bench 1.05x WRITE / 1.09x READ (42.51 vs
#     40.38, 44.49 vs 40.69 MB/s), CLI bench 1.05x / 1.07x;
#   loaded host (2 cores shared with builds), best of 3: verbs_bench 1.40x /
#     1.39x, CLI bench 0.76x / 0.89x.
# verbs_bench runs interleaved with perftest, median of VERBS_REPS (until
# 2026-12-04 best of, see below the runs), so 0.8
# leaves room for TCG noise and still catches a real regression; the CLI
# bench is one 3 s run, not interleaved, and fell to 0.76x under load, so
# its floor is 0.5 (a halving is a regression, not noise). Unpinned runs
# swung 2x, which is why both sides run pinned. A ratio of 0 reports
# without enforcing.
#
# Knobs: VERBS_SIZE (65536) VERBS_ITERS (1000) VERBS_DEPTH (128) VERBS_QPS (1),
#        VERBS_REPS (5: interleaved runs, the median of each is compared),
#        VERBS_CLI=0 skips building/running the CLI bench (saves ~2 min cold),
#        VERBS_PEERS (1,10,100: `kvlane bench --peers` counts over verbs; empty skips),
#        SOFTROCE_ACCEL (auto|kvm|tcg), plus everything ci/softroce.sh reads.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
SOFTROCE_LOG_TAG=verbs.sh
# shellcheck source=ci/softroce-lib.sh
. ci/softroce-lib.sh   # softroce_need_pkgs, cargo_exe, log

SIZE=${VERBS_SIZE:-65536}
ITERS=${VERBS_ITERS:-1000}
REPS=${VERBS_REPS:-5}
DEPTH=${VERBS_DEPTH:-128}
QPS=${VERBS_QPS:-1}
MIN_RATIO=${VERBS_MIN_RATIO:-0.8}
CLI_MIN_RATIO=${VERBS_CLI_MIN_RATIO:-0.5}
PEERS=${VERBS_PEERS-1,10,100}

# ------------------------------------------------------------ build deps
# sideway -> rdma-mummy-sys builds a C shim with cmake and runs bindgen (libclang).
softroce_need_pkgs cmake libclang-dev clang make gcc libibverbs-dev pkg-config

# ------------------------------------------------------------ build
t0=$(date +%s)
log "building tests (debug) and the bench (release) with --features verbs"
TESTBIN=$(cargo test -p kvlane-data --features verbs --test verbs --no-run \
            --message-format=json-render-diagnostics | cargo_exe)
BENCHBIN=$(cargo build --release -p kvlane-data --features verbs --example verbs_bench \
             --message-format=json-render-diagnostics | cargo_exe)
AGENTBIN=$(cargo test -p kvlane --features verbs --test agent_verbs --no-run \
            --message-format=json-render-diagnostics | cargo_exe)
if ! [ -x "$TESTBIN" ] || ! [ -x "$BENCHBIN" ] || ! [ -x "$AGENTBIN" ]; then log "build produced no binaries"; exit 1; fi
KVBIN=
if [ "${VERBS_CLI:-1}" = 1 ]; then
  KVBIN=$(cargo build --release -p kvlane-cli --features verbs \
            --message-format=json-render-diagnostics | cargo_exe)
  [ -x "$KVBIN" ] || { log "the kvlane CLI did not build"; exit 1; }
fi
log "built in $(( $(date +%s) - t0 ))s: $TESTBIN, $BENCHBIN${KVBIN:+, $KVBIN}"

# ------------------------------------------------------------ guest script
GUEST=$(cat <<EOF
set -u
rc=0
echo "===== verbs tests on rxe0"
KVLANE_TEST_VERBS_DEVICE=rxe0 "$TESTBIN" --ignored --test-threads=1 || rc=1
echo "===== agents over verbs on rxe0 (control handshake + queue-pair exchange)"
KVLANE_TEST_VERBS_DEVICE=rxe0 "$AGENTBIN" --ignored --test-threads=1 || rc=1

GIDX=\$(softroce_gid_index) || { rc=1; GIDX=1; }

# Both benchmarks run pinned to the same vCPU: unpinned, the scheduler's
# placement against rxe's softirq work swings results by 2x (measured: kvlane
# WRITE 18-22 MB/s unpinned vs 37 MB/s pinned in the same VM).
PIN=
[ "\$(nproc)" -ge 2 ] && command -v taskset >/dev/null && PIN="taskset -c 1"
perf() { # tool port -> prints average MB/s (column 4 of the result row) or 0
  local tool=\$1 port=\$2
  local args="-d rxe0 -x \$GIDX -F -s $SIZE -n $ITERS -t $DEPTH -q $QPS -p \$port"
  timeout 120 \$PIN \$tool \$args > /tmp/\$tool.srv 2>&1 & local sp=\$!
  sleep 1
  timeout 120 \$PIN \$tool \$args "\$SOFTROCE_IP" > /tmp/\$tool.cli 2>&1; local cr=\$?
  wait \$sp; local sr=\$?
  if [ \$cr -ne 0 ] || [ \$sr -ne 0 ]; then
    echo "\$tool failed (client rc=\$cr server rc=\$sr)" >&2; cat /tmp/\$tool.cli >&2; echo 0; return
  fi
  awk -v s=$SIZE '\$1 == s && NF >= 4 { v = \$4 } END { print (v == "" ? 0 : v) }' /tmp/\$tool.cli
}
kv() { # op -> prints MB/s or 0
  KVLANE_IB_DEVICE=rxe0 timeout 120 \$PIN "$BENCHBIN" --op \$1 --size $SIZE --iters $ITERS --depth $DEPTH \
    --qps $QPS --warmup 100 > /tmp/kv.out 2>&1 || { cat /tmp/kv.out >&2; echo 0; return; }
  awk '/^RESULT/ { sub("MBps=", "", \$NF); print \$NF }' /tmp/kv.out
}
med() { printf '%s\n' "\$@" | sort -g | awk 'NF { a[++n] = \$1 } END { print n == 0 ? 0 : (n % 2) ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2 }'; }
pos() { awk -v v="\$1" 'BEGIN { exit !(v + 0 > 0) }'; }
# TCG timing swings with host load: interleave the runs and compare each
# side's median (a best-of compared one side's rare fast mode: perftest
# READ ran 53.8 MB/s in 2 of 5 reps and ~35 in 3, kvlane 36-38 in all 5,
# best-of ratio 0.71, median ratio 1.04; 2026-12-04 clean-clone CI).
echo "===== perftest vs kvlane verbs_bench ($SIZE B x $ITERS, depth $DEPTH, $QPS qp, median of $REPS)"
PWS= PRS= KWS= KRS=
for r in \$(seq $REPS); do
  # perftest's failed runs (no TSC calibration under TCG) are left out;
  # kvlane's count as 0.
  v=\$(perf ib_write_bw \$((18600 + 2 * r))); echo "rep \$r perftest WRITE \$v MB/s"; pos "\$v" && PWS="\$PWS \$v"
  v=\$(kv write); echo "rep \$r kvlane   WRITE \$v MB/s"; KWS="\$KWS \$v"
  v=\$(perf ib_read_bw \$((18601 + 2 * r))); echo "rep \$r perftest READ  \$v MB/s"; pos "\$v" && PRS="\$PRS \$v"
  v=\$(kv read); echo "rep \$r kvlane   READ  \$v MB/s"; KRS="\$KRS \$v"
done
PW=\$(med \$PWS) PR=\$(med \$PRS) KW=\$(med \$KWS) KR=\$(med \$KRS)
case " \$KWS \$KRS " in *" 0 "*) echo "a kvlane bench run failed (counted as 0 MB/s)" ;; esac
[ "\$KW" = 0 ] || [ "\$KR" = 0 ] && { echo "the kvlane bench failed"; rc=1; }

KC=
if [ -n "$KVBIN" ]; then
  echo "===== kvlane devices / kvlane bench --backend verbs"
  "$KVBIN" devices || rc=1
  KVLANE_IB_DEVICE=rxe0 \$PIN "$KVBIN" bench --backend verbs --op write,read --block-sizes $SIZE \
    --batch $DEPTH --duration 3s --no-baseline --json > /tmp/cli.json || rc=1
  cat /tmp/cli.json
  # GB/s -> MB/s per op, from the JSON rows
  KCW=\$(sed -n 's/.*"op":"write".*"gbps":\([0-9.e+-]*\).*/\1/p' /tmp/cli.json | awk '{ printf "%.2f", \$1 * 1000 }')
  KCR=\$(sed -n 's/.*"op":"read".*"gbps":\([0-9.e+-]*\).*/\1/p' /tmp/cli.json | awk '{ printf "%.2f", \$1 * 1000 }')
  KC=1
  if [ -n "$PEERS" ]; then
    echo "===== kvlane bench --peers $PEERS --backend verbs (agents on rxe0, 2 worker processes)"
    KVLANE_IB_DEVICE=rxe0 "$KVBIN" bench --peers $PEERS --backend verbs --op write --block-sizes 64K \
      --batch 4 --duration 2s || rc=1
  fi
fi

echo
echo "===== bandwidth at $SIZE B (same VM, rxe0, MB/s)"
awk -v pw="\${PW:-0}" -v pr="\${PR:-0}" -v kw="\${KW:-0}" -v kr="\${KR:-0}" \
    -v cw="\${KCW:-0}" -v cr="\${KCR:-0}" -v kc="\$KC" -v min="$MIN_RATIO" -v cmin="$CLI_MIN_RATIO" 'BEGIN {
  printf "%-6s %12s %14s %8s %14s %8s\n", "op", "perftest", "verbs_bench", "ratio", "kvlane bench", "ratio"
  bad = 0
  n = split("WRITE READ", ops, " "); p[1] = pw; p[2] = pr; k[1] = kw; k[2] = kr; c[1] = cw; c[2] = cr
  for (i = 1; i <= 2; i++) {
    r = (p[i] > 0) ? k[i] / p[i] : -1
    q = (p[i] > 0 && kc != "") ? c[i] / p[i] : -1
    printf "%-6s %12.2f %14.2f %8s %14s %8s\n", ops[i], p[i], k[i], (r < 0 ? "n/a" : sprintf("%.2f", r)),
           (kc == "" ? "-" : sprintf("%.2f", c[i])), (q < 0 ? "n/a" : sprintf("%.2f", q))
    if (min + 0 > 0 && r < min) bad = 1
    if (cmin + 0 > 0 && kc != "" && q < cmin) bad = 1
  }
  if (pw == 0 || pr == 0) print "perftest reported no bandwidth (TSC calibration fails under TCG): no ratio to check"
  exit bad
}' || { echo "FAIL: verbs_bench is below VERBS_MIN_RATIO=$MIN_RATIO x perftest or the CLI bench below VERBS_CLI_MIN_RATIO=$CLI_MIN_RATIO x, or there was no perftest figure to compare with (a ratio of 0 only reports)"; rc=1; }
exit \$rc
EOF
)

log "starting the Soft-RoCE VM"
t1=$(date +%s)
set +e
SOFTROCE_TIMEOUT=${SOFTROCE_TIMEOUT:-600} "$ROOT/ci/softroce.sh" -c "$GUEST"
rc=$?
set -e
log "VM run took $(( $(date +%s) - t1 ))s, rc=$rc; total $(( $(date +%s) - t0 ))s"
exit $rc
