#!/usr/bin/env bash
# ci/verbs.sh -- build the verbs backend (cargo feature `verbs`), then in ONE
# Soft-RoCE VM (ci/softroce.sh):
#   1. run the ignored hardware tests of crates/kvlane-data/tests/verbs.rs on rxe0
#      (conformance suite, notifications, striping, SQ-full, remote access error);
#   2. run perftest ib_write_bw / ib_read_bw at 64 KiB on rxe0;
#   3. run the kvlane verbs bench (examples/verbs_bench.rs) with the same
#      message size, iteration count, queue depth and QP count;
# and print both bandwidths and their ratio (target: kvlane >= 0.9x perftest).
#
# Exit code: non-zero when the build or a test fails. Bandwidth is reported,
# not asserted (TCG timing is noisy); set VERBS_MIN_RATIO=0.9 to enforce it.
#
# Knobs: VERBS_SIZE (65536) VERBS_ITERS (2000) VERBS_DEPTH (128) VERBS_QPS (1),
#        SOFTROCE_ACCEL (auto|kvm|tcg), plus everything ci/softroce.sh reads.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd -P)
log() { echo "[verbs.sh $(date +%T)] $*" >&2; }

SIZE=${VERBS_SIZE:-65536}
ITERS=${VERBS_ITERS:-2000}
DEPTH=${VERBS_DEPTH:-128}
QPS=${VERBS_QPS:-1}
MIN_RATIO=${VERBS_MIN_RATIO:-}

# ------------------------------------------------------------ build deps
# sideway -> rdma-mummy-sys builds a C shim with cmake and runs bindgen (libclang).
PKGS=(cmake libclang-dev clang make gcc libibverbs-dev pkg-config)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { log "need root to install: ${missing[*]}"; exit 125; }
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

# ------------------------------------------------------------ build
t0=$(date +%s)
log "building tests (debug) and the bench (release) with --features verbs"
exe_of() { grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | grep -v '^$' | tail -n1; }
TESTBIN=$(cargo test -p kvlane-data --features verbs --test verbs --no-run \
            --message-format=json-render-diagnostics | exe_of)
BENCHBIN=$(cargo build --release -p kvlane-data --features verbs --example verbs_bench \
             --message-format=json-render-diagnostics | exe_of)
[ -x "$TESTBIN" ] && [ -x "$BENCHBIN" ] || { log "build produced no binaries"; exit 1; }
log "built in $(( $(date +%s) - t0 ))s: $TESTBIN, $BENCHBIN"

# ------------------------------------------------------------ guest script
GUEST=$(cat <<EOF
set -u
rc=0
echo "===== verbs tests on rxe0"
KVLANE_TEST_VERBS_DEVICE=rxe0 "$TESTBIN" --ignored --test-threads=1 || rc=1

# IPv4-mapped RoCE v2 GID index (shell builtins only: 1024 entries under TCG)
GIDX=
P=/sys/class/infiniband/rxe0/ports/1
for g in \$P/gids/*; do
  read -r v < "\$g" || continue
  case "\$v" in 0000:0000:0000:0000:0000:ffff:*) GIDX=\${g##*/}; break ;; esac
done
GIDX=\${GIDX:-1}

perf() { # name tool -> prints average MB/s (column 4 of the result row) or 0
  local name=\$1 tool=\$2 args="-d rxe0 -x \$GIDX -F -s $SIZE -n $ITERS -t $DEPTH -q $QPS"
  timeout 300 \$tool \$args > /tmp/\$name.srv 2>&1 & local sp=\$!
  sleep 1
  timeout 300 \$tool \$args "\$SOFTROCE_IP" > /tmp/\$name.cli 2>&1; local cr=\$?
  wait \$sp; local sr=\$?
  echo "--- \$tool client output" >&2; cat /tmp/\$name.cli >&2
  if [ \$cr -ne 0 ] || [ \$sr -ne 0 ]; then echo "\$tool failed (client rc=\$cr server rc=\$sr)" >&2; echo 0; return; fi
  awk -v s=$SIZE '\$1 == s && NF >= 4 { v = \$4 } END { print (v == "" ? 0 : v) }' /tmp/\$name.cli
}
echo "===== perftest ($SIZE B x $ITERS, depth $DEPTH, $QPS qp)"
PW=\$(perf wbw ib_write_bw)
PR=\$(perf rbw ib_read_bw)

echo "===== kvlane verbs bench"
KVLANE_IB_DEVICE=rxe0 "$BENCHBIN" --op both --size $SIZE --iters $ITERS --depth $DEPTH --qps $QPS \
  | tee /tmp/kv.out || rc=1
KW=\$(awk '/^RESULT/ && /op=write/ { sub("MBps=", "", \$NF); print \$NF }' /tmp/kv.out)
KR=\$(awk '/^RESULT/ && /op=read/ { sub("MBps=", "", \$NF); print \$NF }' /tmp/kv.out)

echo
echo "===== bandwidth at $SIZE B (same VM, rxe0, MB/s)"
awk -v pw="\${PW:-0}" -v pr="\${PR:-0}" -v kw="\${KW:-0}" -v kr="\${KR:-0}" -v min="$MIN_RATIO" 'BEGIN {
  printf "%-6s %12s %12s %8s\n", "op", "perftest", "kvlane", "ratio"
  bad = 0
  n = split("WRITE READ", ops, " "); p[1] = pw; p[2] = pr; k[1] = kw; k[2] = kr
  for (i = 1; i <= 2; i++) {
    r = (p[i] > 0) ? k[i] / p[i] : -1
    printf "%-6s %12.2f %12.2f %8s\n", ops[i], p[i], k[i], (r < 0 ? "n/a" : sprintf("%.2f", r))
    if (min != "" && r >= 0 && r < min) bad = 1
  }
  if (pw == 0 || pr == 0) print "NOTE: perftest reported no bandwidth (TSC calibration fails under TCG); ratio n/a"
  exit bad
}' || { echo "kvlane is below VERBS_MIN_RATIO=$MIN_RATIO x perftest"; rc=1; }
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
