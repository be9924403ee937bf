#!/usr/bin/env bash
# ci/softroce.sh -- run a command inside a throw-away QEMU VM that has a
# Soft-RoCE (rdma_rxe) device "rxe0", so real libibverbs programs can be
# tested on machines without RDMA hardware or RDMA support in the host kernel.
#
# Usage:
#   ci/softroce.sh                      # built-in self test (ibv_devinfo, rc_pingpong, perftest)
#   ci/softroce.sh CMD [ARGS...]        # run CMD in the guest, exit with its rc
#   ci/softroce.sh -c 'shell code'      # run shell code in the guest (bash -c)
#
# Exit code: the guest command's exit code; 125 = this script failed (missing
# packages, no kernel, VM timeout), 126 = the guest could not set up rxe0.
#
# Networking stays inside the guest: the only NIC is a QEMU user-mode NIC with
# restrict=on (no host or outbound connectivity); rxe0 and its peer QPs live
# in the one guest, so all RDMA traffic is guest-local loopback.  For RDMA
# across a link between two guests, see ci/softroce-2host.sh (same machinery:
# ci/softroce-lib.sh).  The command runs after the helpers of
# ci/softroce-guest.sh are sourced (softroce_gid_index, bounded waits).
#
# Pitfalls this script handles (learned the hard way):
#   - rdma_rxe needs a crc32 shash at device creation: crc32_generic is loaded
#     explicitly (there is no modprobe/modules.dep in the initramfs).
#   - under TCG the xz bzImage decompression costs ~4-5 s per boot: the ELF
#     vmlinux is extracted once, cached, and booted through its PVH entry.
#   - /dev/kvm may exist but be unusable at speed (nested/emulated hosts):
#     SOFTROCE_ACCEL=auto probes with a tiny boot, SOFTROCE_ACCEL=tcg skips it.
#     (On a nested "kvm-pvm" host, qemu -cpu host aborts at once on MSR 0x10a,
#     and other CPU models boot for minutes: the probe says which, then TCG.)
#   - the rxe GID table has 1024 entries: the self test walks it with shell
#     builtins only (a fork per entry costs minutes under TCG).
#   - perftest cannot calibrate the TSC under TCG and may print 0.00 GB/s:
#     the transfer itself still completed (the self test says so).
#   - the IPv4-mapped RoCE v2 GID appears a moment after the port is ACTIVE:
#     init waits for it before the command starts.
#
# The guest sees the host's root file system read-only through virtio-9p with
# a tmpfs overlay on top (so /tmp, /var, ... are writable but changes are
# thrown away), i.e. every binary/library installed on the host can be run in
# the guest without collecting anything.  The guest starts in the caller's
# current directory.  A per-run host directory is mounted read-write at the
# same path in the guest ($SOFTROCE_SHARE inside the guest; it is deleted when
# the script exits -- copy results out of it inside your command if needed).
# When the command starts, rxe0 exists and its port is ACTIVE; the guest
# netdev carries $SOFTROCE_IP (10.77.0.1, exported).
#
# Environment knobs (all optional):
#   SOFTROCE_WORKDIR  work dir (default $TMPDIR/softroce-work; no spaces), holds the
#                     cached vmlinux, per-run dirs and console-last.log
#   SOFTROCE_ACCEL    auto | kvm | tcg   (default auto: short KVM probe, else TCG)
#   SOFTROCE_NETDEV   virtio | dummy     (netdev rxe0 is bound to, default virtio)
#   SOFTROCE_MEM      guest RAM MiB (default 1024)
#   SOFTROCE_SMP      guest vCPUs (default: number of host CPUs, max 4)
#   SOFTROCE_TIMEOUT  overall VM timeout in seconds (default 900)
#   SOFTROCE_KVER     guest kernel version (default: newest Debian kernel in /lib/modules with rdma_rxe)
#   SOFTROCE_NO_INSTALL=1  do not apt-get install anything
#   SOFTROCE_KVM_PROBE_TIMEOUT  seconds for the KVM probe boot (default 20)
#   SOFTROCE_PVH=0    boot the compressed bzImage instead of the extracted vmlinux
set -euo pipefail
SOFTROCE_LOG_TAG=softroce.sh
# shellcheck source=ci/softroce-lib.sh
. "$(dirname "$0")/softroce-lib.sh"
NETDEV=${SOFTROCE_NETDEV:-virtio}
NCPU=$(nproc); [ "$NCPU" -gt 4 ] && NCPU=4
SMP=${SOFTROCE_SMP:-$NCPU}

softroce_prepare

# ---------------------------------------------------------------- command
SELFTEST=$(cat <<'SELFTEST'
set -u
fail=0
step() { echo; echo "===== $*"; }
check() { local n=$1; shift; local t0=$EPOCHREALTIME; "$@"; local r=$?
  local dt=$(awk -v a=$t0 -v b=$EPOCHREALTIME 'BEGIN{printf "%.1f", b-a}')
  if [ $r -eq 0 ]; then echo "----- PASS $n (${dt}s)"; else echo "----- FAIL $n (rc=$r, ${dt}s)"; fail=1; fi; }
uname -r
step rdma link / ibv_devices / ibv_devinfo
rdma link show
check ibv_devices ibv_devices
check ibv_devinfo ibv_devinfo -d rxe0
GIDX=$(softroce_gid_index -v rxe0) || fail=1
GIDX=${GIDX:-1}
echo "using IPv4 RoCEv2 gid index $GIDX"
srv_cli() { # name server_cmd client_cmd
  local name=$1 s=$2 c=$3
  echo "+ server: $s"; echo "+ client: $c"
  timeout 120 $s > /tmp/$name.srv 2>&1 & local sp=$!
  sleep 1
  timeout 120 $c > /tmp/$name.cli 2>&1; local cr=$?
  wait $sp; local sr=$?
  echo "--- server output"; cat /tmp/$name.srv; echo "--- client output"; cat /tmp/$name.cli
  grep -q 'Correlation coefficient' /tmp/$name.cli /tmp/$name.srv &&
    echo "NOTE: perftest could not calibrate the TSC (noisy clock under TCG): bandwidth printed as 0.00; the transfer itself completed"
  [ $cr -eq 0 ] && [ $sr -eq 0 ]
}
step "ibv_rc_pingpong (RC QP send/recv, loopback)"
check rc_pingpong srv_cli rcpp "ibv_rc_pingpong -d rxe0 -g $GIDX -n 1000" "ibv_rc_pingpong -d rxe0 -g $GIDX -n 1000 $SOFTROCE_IP"
step "ib_write_bw (RC RDMA WRITE)"
check ib_write_bw srv_cli wbw "ib_write_bw -d rxe0 -x $GIDX -F -s 65536 -n 2000" "ib_write_bw -d rxe0 -x $GIDX -F -s 65536 -n 2000 $SOFTROCE_IP"
step "ib_read_bw (RC RDMA READ)"
check ib_read_bw srv_cli rbw "ib_read_bw -d rxe0 -x $GIDX -F -s 65536 -n 2000" "ib_read_bw -d rxe0 -x $GIDX -F -s 65536 -n 2000 $SOFTROCE_IP"
step "ib_write_lat (RC RDMA WRITE latency)"
check ib_write_lat srv_cli wlat "ib_write_lat -d rxe0 -x $GIDX -F -s 8 -n 2000" "ib_write_lat -d rxe0 -x $GIDX -F -s 8 -n 2000 $SOFTROCE_IP"
step "ib_read_lat (RC RDMA READ latency)"
check ib_read_lat srv_cli rlat "ib_read_lat -d rxe0 -x $GIDX -F -s 8 -n 2000" "ib_read_lat -d rxe0 -x $GIDX -F -s 8 -n 2000 $SOFTROCE_IP"
step "ib_write_bw over RDMA-CM (-R)"
check ib_write_bw_cm srv_cli wbwcm "ib_write_bw -d rxe0 -R -F -s 65536 -n 1000" "ib_write_bw -d rxe0 -R -F -s 65536 -n 1000 $SOFTROCE_IP"
echo
[ $fail -eq 0 ] && echo "SELFTEST: ALL PASSED" || echo "SELFTEST: FAILURES"
exit $fail
SELFTEST
)
if [ $# -eq 0 ]; then
  softroce_cmd_file "$SHARE/cmd.sh" "" -c "$SELFTEST"
else
  softroce_cmd_file "$SHARE/cmd.sh" "" "$@"
fi

# ---------------------------------------------------------------- qemu
netargs=()
# shellcheck disable=SC2054 # QEMU option lists
[ "$NETDEV" = virtio ] && netargs=(-netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0)
softroce_qemu_cmd "" "softroce.netdev=$NETDEV" "${netargs[@]}"
log "booting: ${ACCEL_ARGS[*]} -smp $SMP -m $MEM, netdev=$NETDEV"
start=$(now)
set +e
timeout "$TIMEOUT" "${QEMU_CMD[@]}" </dev/null 2>&1 | tee "$RUN/console.log"
qrc=${PIPESTATUS[0]}
set -e
LOG=$WORK/console-last.log
cp "$RUN/console.log" "$LOG" 2>/dev/null || true
log "qemu exited rc=$qrc after $(since "$start")s (console log: $LOG)"
[ "$qrc" = 124 ] && die "VM timed out after ${TIMEOUT}s"
rc=$(softroce_guest_rc "" "$RUN/console.log")
[ -n "$rc" ] || die "guest did not report an exit code (qemu rc=$qrc)"
exit "$rc"
