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
# in the one guest, so all RDMA traffic is guest-local loopback.
#
# Pitfalls this script handles (learned the hard way):
#   - rdma_rxe needs a crc32 shash at device creation: crc32_generic is loaded
#     explicitly (there is no modprobe/modules.dep in the initramfs).
#   - under TCG the xz bzImage decompression costs ~4-5 s per boot: the ELF
#     vmlinux is extracted once, cached, and booted through its PVH entry.
#   - /dev/kvm may exist but be unusable at speed (nested/emulated hosts):
#     SOFTROCE_ACCEL=auto probes with a tiny boot, SOFTROCE_ACCEL=tcg skips it.
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
# netdev carries $SOFTROCE_IP (exported).
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

WORK=${SOFTROCE_WORKDIR:-${TMPDIR:-/tmp}/softroce-work}
ACCEL=${SOFTROCE_ACCEL:-auto}
NETDEV=${SOFTROCE_NETDEV:-virtio}
MEM=${SOFTROCE_MEM:-1024}
NCPU=$(nproc); [ "$NCPU" -gt 4 ] && NCPU=4
SMP=${SOFTROCE_SMP:-$NCPU}
TIMEOUT=${SOFTROCE_TIMEOUT:-900}
PROBE_TIMEOUT=${SOFTROCE_KVM_PROBE_TIMEOUT:-20}

log() { echo "[run-softroce $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 125; }

# ---------------------------------------------------------------- packages
PKGS=(qemu-system-x86 linux-image-amd64 rdma-core ibverbs-utils ibverbs-providers
      libibverbs-dev librdmacm-dev rdmacm-utils perftest busybox-static cpio kmod
      iproute2 gzip xz-utils binutils)
if [ "${SOFTROCE_NO_INSTALL:-0}" != 1 ]; then
  missing=()
  for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "need root to install: ${missing[*]}"
    log "installing: ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
fi

# ---------------------------------------------------------------- kernel
if [ -z "${SOFTROCE_KVER:-}" ]; then
  SOFTROCE_KVER=$(ls -d /lib/modules/*/kernel/drivers/infiniband/sw/rxe 2>/dev/null |
                  sed 's|^/lib/modules/||; s|/.*||' | while read -r v; do
                    [ -e "/boot/vmlinuz-$v" ] && echo "$v"; done | sort -V | tail -n1)
fi
KVER=$SOFTROCE_KVER
[ -n "$KVER" ] || die "no kernel with rdma_rxe.ko + /boot/vmlinuz-* found (install linux-image-amd64)"
KERNEL=/boot/vmlinuz-$KVER
[ -r "$KERNEL" ] || die "$KERNEL not readable"
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd -P)

# Under TCG, decompressing the xz bzImage costs ~4-5 s per boot.  Extract the
# ELF vmlinux once (cached) and let QEMU boot it directly via its PVH entry
# point (Debian kernels have CONFIG_PVH=y); fall back to the bzImage.
VMLINUX=$WORK/vmlinux-$KVER
if [ "${SOFTROCE_PVH:-1}" = 1 ] && [ ! -s "$VMLINUX" ]; then
  pos=$(LC_ALL=C grep -abo -P '\xfd7zXZ\x00' "$KERNEL" | head -n1 | cut -d: -f1 || true)
  # (no pipefail here: tail gets SIGPIPE when xz stops after the first stream)
  if [ -n "$pos" ] && (set +o pipefail; tail -c +$((pos + 1)) "$KERNEL" | xz -dc --single-stream > "$VMLINUX.$$" 2>/dev/null) &&
     [ "$(head -c4 "$VMLINUX.$$" | od -An -c | tr -d ' ')" = '177ELF' ] &&
     # XEN_ELFNOTE_PHYS32_ENTRY (0x12) = PVH entry point
     [ "$(readelf -n "$VMLINUX.$$" 2>/dev/null | grep -c 'Unknown note type: (0x00000012)')" -ge 1 ]; then
    mv -f "$VMLINUX.$$" "$VMLINUX"
  else
    rm -f "$VMLINUX.$$"; log "could not extract a PVH-capable vmlinux, booting the bzImage"
  fi
fi
[ "${SOFTROCE_PVH:-1}" = 1 ] && [ -s "$VMLINUX" ] && KERNEL=$VMLINUX
log "guest kernel: $KVER ($KERNEL)"

# ---------------------------------------------------------------- initramfs
# per-run directory (concurrent runs may share $WORK)
RUN=$(mktemp -d "$WORK/run.XXXXXX")
trap 'rm -rf "$RUN"' EXIT
SHARE=$RUN/share
mkdir -p "$SHARE"
INITRD=$RUN/initrd.img
STAGE=$RUN/initramfs
BUSYBOX=$(command -v busybox || true)
[ -x /bin/busybox ] && BUSYBOX=/bin/busybox
file_is_static() { ! ldd "$1" >/dev/null 2>&1; }
[ -n "$BUSYBOX" ] && file_is_static "$BUSYBOX" || die "need a static busybox (busybox-static)"

# modules needed in the guest, in load order (dependencies first).
# rdma_rxe (6.1) does crypto_alloc_shash("crc32") when the device is created ->
# needs a crc32 crypto module (normally auto-loaded via modprobe; there is no
# modprobe/modules.dep in our initramfs, so load them explicitly).
WANT_MODS=(virtio_pci 9pnet_virtio 9p overlay virtio_net dummy crc32_generic
           rdma_rxe ib_uverbs rdma_ucm)
OPT_MODS=(crc32-pclmul)   # faster crc32; fails to load on CPUs without PCLMULQDQ
rm -rf "$STAGE"
mkdir -p "$STAGE"/{bin,dev,proc,sys,host,newroot,upper,lib/modules}
cp "$BUSYBOX" "$STAGE/bin/busybox"
: > "$STAGE/lib/modules/order"
for m in "${WANT_MODS[@]}"; do
  # prints "insmod /lib/modules/.../x.ko [params]" or "builtin x"
  modprobe -S "$KVER" --show-depends "$m" || die "module $m not found for $KVER"
done | awk '$1=="insmod"{print $2}' | awk '!seen[$0]++' > "$STAGE/mods.req"
for m in "${OPT_MODS[@]}"; do
  modprobe -S "$KVER" --show-depends "$m" 2>/dev/null || true
done | awk '$1=="insmod"{print "opt:"$2}' > "$STAGE/mods.opt"
cat "$STAGE/mods.req" "$STAGE/mods.opt" | awk '!seen[$0]++' | while read -r ko; do
  opt=; case "$ko" in opt:*) opt=opt:; ko=${ko#opt:} ;; esac
  b=$(basename "$ko")
  case "$ko" in
    *.ko) cp "$ko" "$STAGE/lib/modules/$b" ;;
    *.ko.xz) xz -dc "$ko" > "$STAGE/lib/modules/${b%.xz}"; b=${b%.xz} ;;
    *.ko.zst) zstd -qdc "$ko" > "$STAGE/lib/modules/${b%.zst}"; b=${b%.zst} ;;
    *.ko.gz) gzip -dc "$ko" > "$STAGE/lib/modules/${b%.gz}"; b=${b%.gz} ;;
  esac
  echo "$opt$b" >> "$STAGE/lib/modules/order"
done
rm -f "$STAGE/mods.req" "$STAGE/mods.opt"

cat > "$STAGE/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
T0=$(cut -d' ' -f1 /proc/uptime)
say() { echo "softroce-init: $*"; }
finish() {
  [ "$1" = 126 ] && { say "kernel log tail:"; dmesg | tail -n 25; }
  echo "SOFTROCE_RESULT rc=$1"
  [ -d "/newroot$SHARE" ] && { echo "$1" > "/newroot$SHARE/rc"; sync; umount "/newroot$SHARE"; } 2>/dev/null
  sync
  poweroff -f
}
for a in $(cat /proc/cmdline); do
  case "$a" in
    softroce.share=*)  SHARE=${a#*=} ;;
    softroce.netdev=*) NETDEV=${a#*=} ;;
  esac
done
for m in $(cat /lib/modules/order); do
  p=; case "$m" in dummy.ko) p=numdummies=0 ;; esac   # no implicit dummy0
  case "$m" in
    opt:*) insmod "/lib/modules/${m#opt:}" 2>/dev/null || say "optional module ${m#opt:} not loaded" ;;
    *)     insmod "/lib/modules/$m" $p || { say "insmod $m failed"; finish 126; } ;;
  esac
done
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /host \
  || { say "cannot mount host root (9p)"; finish 126; }
mount -t tmpfs -o mode=0755 tmpfs /upper
mkdir -p /upper/u /upper/w
if ! mount -t overlay overlay -o lowerdir=/host,upperdir=/upper/u,workdir=/upper/w /newroot; then
  say "overlay failed, falling back to read-only root + tmpfs dirs (host /tmp not visible)"
  mount --bind /host /newroot
  for d in tmp var/tmp root; do mount -t tmpfs tmpfs "/newroot/$d"; done
fi
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount -t tmpfs tmpfs /newroot/run
mkdir -p "/newroot$SHARE"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 share "/newroot$SHARE" \
  || { say "cannot mount share"; finish 126; }
# hostname / resolver noise: keep it local
hostname softroce
ip link set lo up
case "$NETDEV" in
  dummy) ip link add rxenet0 type dummy; IF=rxenet0 ;;
  *)     IF=; for n in /sys/class/net/*; do   # first NIC backed by a (virtio) device
           [ -e "$n/device" ] && { IF=${n##*/}; break; }; done ;;
esac
[ -n "$IF" ] || { say "no network device"; finish 126; }
IP=10.77.0.1
ip addr add $IP/24 dev "$IF"
ip link set "$IF" up
chroot /newroot rdma link add rxe0 type rxe netdev "$IF" || { say "rdma link add failed"; finish 126; }
i=0
while [ "$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)" != "4: ACTIVE" ]; do
  i=$((i+1)); [ $i -gt 100 ] && { say "rxe0 port not ACTIVE"; finish 126; }
  sleep 0.1
done
# wait for the IPv4-mapped GID to show up (needs the address to be registered)
i=0
while ! grep -q '0000:0000:0000:0000:0000:ffff:' /sys/class/infiniband/rxe0/ports/1/gids/* 2>/dev/null; do
  i=$((i+1)); [ $i -gt 100 ] && break
  sleep 0.1
done
T1=$(cut -d' ' -f1 /proc/uptime)
say "rxe0 on $IF ($IP) ready, guest uptime ${T1}s (init took $(echo "$T0 $T1" | awk '{printf "%.2f", $2-$1}')s)"
echo "SOFTROCE_READY uptime=$T1"
CWD=$(cat "/newroot$SHARE/cwd" 2>/dev/null || echo /)
chroot /newroot /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  SOFTROCE_SHARE="$SHARE" SOFTROCE_IP="$IP" SOFTROCE_NETDEV="$IF" SOFTROCE_CWD="$CWD" \
  /bin/bash -c 'cd "$SOFTROCE_CWD" 2>/dev/null || cd /; exec /bin/bash "$SOFTROCE_SHARE/cmd.sh"'
rc=$?
T2=$(cut -d' ' -f1 /proc/uptime)
say "command finished rc=$rc after $(echo "$T1 $T2" | awk '{printf "%.2f", $2-$1}')s (guest uptime ${T2}s)"
finish $rc
INIT
chmod 755 "$STAGE/init"
(cd "$STAGE" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -1) > "$INITRD"
log "initramfs: $(du -h "$INITRD" | cut -f1), modules: $(tr '\n' ' ' < "$STAGE/lib/modules/order")"
rm -rf "$STAGE"

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
# GID table has 1024 entries: use shell builtins only (a fork per entry costs minutes under TCG)
GIDX=
P=/sys/class/infiniband/rxe0/ports/1
for g in $P/gids/*; do
  read -r v < "$g" || continue
  [ "$v" = "0000:0000:0000:0000:0000:0000:0000:0000" ] && continue
  i=${g##*/}; read -r ty < "$P/gid_attrs/types/$i" 2>/dev/null || ty=?
  echo "gid[$i] = $v ($ty)"
  [ -z "$GIDX" ] && [[ $v == 0000:0000:0000:0000:0000:ffff:* ]] && GIDX=$i
done
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
  printf '%s\n' "$SELFTEST" > "$SHARE/cmd.sh"
elif [ "$1" = "-c" ]; then
  shift; printf '%s\n' "$*" > "$SHARE/cmd.sh"
else
  [ "$1" = "--" ] && shift
  { printf 'exec'; printf ' %q' "$@"; printf '\n'; } > "$SHARE/cmd.sh"
fi
pwd -P > "$SHARE/cwd"
rm -f "$SHARE/rc"

# ---------------------------------------------------------------- qemu
qemu_base=(qemu-system-x86_64 -nodefaults -no-user-config -vga none -display none
  -no-reboot -m "$MEM" -kernel "$KERNEL" -initrd "$INITRD"
  -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
  -virtfs "local,path=$SHARE,mount_tag=share,security_model=none"
  -device virtio-rng-pci)
APPEND="console=ttyS0 panic=-1 quiet loglevel=3 softroce.share=$SHARE softroce.netdev=$NETDEV"
if [ "$NETDEV" = virtio ]; then
  qemu_base+=(-netdev user,id=n0,restrict=on -device virtio-net-pci,netdev=n0)
fi

kvm_usable() {
  [ -w /dev/kvm ] || { log "/dev/kvm missing or not writable"; return 1; }
  local t0 t1 out
  t0=$(date +%s.%N)
  # tiny boot of the real kernel with a trivial init: proves KVM actually runs
  # an unmodified guest at usable speed (e.g. nested "PVM" hosts expose /dev/kvm
  # but emulate an unmodified guest kernel instruction by instruction).
  local pd; pd=$(mktemp -d); mkdir -p "$pd/bin"; cp "$BUSYBOX" "$pd/bin/busybox"
  printf '#!/bin/busybox sh\n/bin/busybox echo KVM_PROBE_OK\n/bin/busybox poweroff -f\n' > "$pd/init"; chmod 755 "$pd/init"
  (cd "$pd" && find . | cpio -o -H newc --quiet | gzip -1) > "$pd.img"
  out=$(timeout "$PROBE_TIMEOUT" qemu-system-x86_64 -nodefaults -no-user-config -vga none -display none \
        -no-reboot -accel kvm -cpu host -m 256 -kernel "$KERNEL" -initrd "$pd.img" \
        -append "console=ttyS0 panic=-1 quiet" -serial stdio </dev/null 2>&1 || true)
  rm -rf "$pd" "$pd.img"
  t1=$(date +%s.%N)
  if grep -q KVM_PROBE_OK <<<"$out"; then
    log "KVM probe boot OK ($(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.1f", b-a}')s)"; return 0
  fi
  log "KVM probe boot did not finish within ${PROBE_TIMEOUT}s -> not usable"
  return 1
}
case "$ACCEL" in
  kvm)  accel=(-accel kvm -cpu host) ;;
  tcg)  accel=(-accel tcg,thread=multi -cpu max) ;;
  auto) if kvm_usable; then accel=(-accel kvm -cpu host); else accel=(-accel tcg,thread=multi -cpu max); fi ;;
  *) die "SOFTROCE_ACCEL must be auto, kvm or tcg" ;;
esac
log "booting: ${accel[*]} -smp $SMP -m $MEM, netdev=$NETDEV"
LOG=$WORK/console-last.log
start=$(date +%s.%N)
set +e
timeout "$TIMEOUT" "${qemu_base[@]}" "${accel[@]}" -smp "$SMP" -append "$APPEND" \
  -serial stdio </dev/null 2>&1 | tee "$RUN/console.log"
qrc=${PIPESTATUS[0]}
set -e
cp "$RUN/console.log" "$LOG" 2>/dev/null || true
end=$(date +%s.%N)
log "qemu exited rc=$qrc after $(awk -v a="$start" -v b="$end" 'BEGIN{printf "%.1f", b-a}')s (console log: $LOG)"
[ "$qrc" = 124 ] && die "VM timed out after ${TIMEOUT}s"
rc=$(tr -d '\r' < "$SHARE/rc" 2>/dev/null || true)
[ -n "$rc" ] || rc=$(tr -d '\r' < "$RUN/console.log" | sed -n 's/^SOFTROCE_RESULT rc=\([0-9]*\).*/\1/p' | tail -n1)
[ -n "$rc" ] || die "guest did not report an exit code (qemu rc=$qrc)"
exit "$rc"
