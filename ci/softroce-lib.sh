# ci/softroce-lib.sh -- the machinery ci/softroce.sh (one guest) and
# ci/softroce-2host.sh (two guests on a private link) share.  Sourced, not
# run.  Knobs and pitfalls: ci/softroce.sh's header.
#
# A launcher calls, in this order:
#   softroce_prepare            packages, guest kernel, per-run dir $RUN (with
#                               $SHARE, mounted read-write in every guest),
#                               initramfs $INITRD, accelerator ${ACCEL_ARGS[@]}
#   softroce_cmd_file FILE PRELUDE ARG...
#                               a guest's command file
#   softroce_qemu_cmd NAME APPEND NETARGS...
#                               the QEMU command line of guest NAME in ${QEMU_CMD[@]}
#   softroce_guest_rc NAME CONSOLE_LOG
#                               the exit code guest NAME reported (or nothing)
# Build scripts use softroce_need_pkgs (apt) and cargo_exe alone.
# The run dir is removed, and every pid in SOFTROCE_PIDS is killed, on exit.
# shellcheck shell=bash
# Variables set here are read by the launchers that source this file.
# shellcheck disable=SC2034
# QEMU options are comma lists, not array separators.
# shellcheck disable=SC2054

WORK=${SOFTROCE_WORKDIR:-${TMPDIR:-/tmp}/softroce-work}
ACCEL=${SOFTROCE_ACCEL:-auto}
MEM=${SOFTROCE_MEM:-1024}
TIMEOUT=${SOFTROCE_TIMEOUT:-900}
PROBE_TIMEOUT=${SOFTROCE_KVM_PROBE_TIMEOUT:-20}
SOFTROCE_CI=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
SOFTROCE_PIDS=()

log() { echo "[${SOFTROCE_LOG_TAG:-softroce} $(date +%T)] $*" >&2; }
die() { log "ERROR: $*"; exit 125; }
# seconds since the epoch with fractions (for durations)
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }

# softroce_need_pkgs PKG...: installs the Debian packages that are missing
# (needs root), unless SOFTROCE_NO_INSTALL=1.
softroce_need_pkgs() {
  [ "${SOFTROCE_NO_INSTALL:-0}" = 1 ] && return 0
  local p missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" = 0 ] || die "need root to install: ${missing[*]}"
  log "installing: ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

# cargo_exe: the last executable a `cargo ... --message-format=json-render-diagnostics`
# on stdin produced.
cargo_exe() { grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | grep -v '^$' | tail -n1; }

softroce_cleanup() {
  local p
  for p in "${SOFTROCE_PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  [ -n "${RUN:-}" ] && rm -rf "$RUN"
}

# ---------------------------------------------------------------- kernel
softroce_kernel() {
  if [ -z "${SOFTROCE_KVER:-}" ]; then
    # shellcheck disable=SC2012 # kernel version directories have plain names
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
  local vmlinux=$WORK/vmlinux-$KVER pos
  if [ "${SOFTROCE_PVH:-1}" = 1 ] && [ ! -s "$vmlinux" ]; then
    pos=$(LC_ALL=C grep -abo -P '\xfd7zXZ\x00' "$KERNEL" | head -n1 | cut -d: -f1 || true)
    # (no pipefail here: tail gets SIGPIPE when xz stops after the first stream)
    if [ -n "$pos" ] && (set +o pipefail; tail -c +$((pos + 1)) "$KERNEL" | xz -dc --single-stream > "$vmlinux.$$" 2>/dev/null) &&
       [ "$(head -c4 "$vmlinux.$$" | od -An -c | tr -d ' ')" = '177ELF' ] &&
       # XEN_ELFNOTE_PHYS32_ENTRY (0x12) = PVH entry point
       [ "$(readelf -n "$vmlinux.$$" 2>/dev/null | grep -c 'Unknown note type: (0x00000012)')" -ge 1 ]; then
      mv -f "$vmlinux.$$" "$vmlinux"
    else
      rm -f "$vmlinux.$$"; log "could not extract a PVH-capable vmlinux, booting the bzImage"
    fi
  fi
  if [ "${SOFTROCE_PVH:-1}" = 1 ] && [ -s "$vmlinux" ]; then KERNEL=$vmlinux; fi
  log "guest kernel: $KVER ($KERNEL)"
}

# ---------------------------------------------------------------- initramfs
softroce_initramfs() {
  local stage=$RUN/initramfs m ko opt b
  BUSYBOX=$(command -v busybox || true)
  [ -x /bin/busybox ] && BUSYBOX=/bin/busybox
  if [ -z "$BUSYBOX" ] || ldd "$BUSYBOX" >/dev/null 2>&1; then die "need a static busybox (busybox-static)"; fi

  # modules needed in the guest, in load order (dependencies first).
  # rdma_rxe (6.1) does crypto_alloc_shash("crc32") when the device is created ->
  # needs a crc32 crypto module (normally auto-loaded via modprobe; there is no
  # modprobe/modules.dep in our initramfs, so load them explicitly).
  local want_mods=(virtio_pci 9pnet_virtio 9p overlay virtio_net dummy crc32_generic
                   rdma_rxe ib_uverbs rdma_ucm)
  local opt_mods=(crc32-pclmul)   # faster crc32; fails to load on CPUs without PCLMULQDQ
  rm -rf "$stage"
  mkdir -p "$stage"/{bin,dev,proc,sys,host,newroot,upper,lib/modules}
  cp "$BUSYBOX" "$stage/bin/busybox"
  : > "$stage/lib/modules/order"
  for m in "${want_mods[@]}"; do
    # prints "insmod /lib/modules/.../x.ko [params]" or "builtin x"
    modprobe -S "$KVER" --show-depends "$m" || die "module $m not found for $KVER"
  done | awk '$1=="insmod"{print $2}' | awk '!seen[$0]++' > "$stage/mods.req"
  for m in "${opt_mods[@]}"; do
    modprobe -S "$KVER" --show-depends "$m" 2>/dev/null || true
  done | awk '$1=="insmod"{print "opt:"$2}' > "$stage/mods.opt"
  cat "$stage/mods.req" "$stage/mods.opt" | awk '!seen[$0]++' | while read -r ko; do
    opt=; case "$ko" in opt:*) opt=opt:; ko=${ko#opt:} ;; esac
    b=$(basename "$ko")
    case "$ko" in
      *.ko) cp "$ko" "$stage/lib/modules/$b" ;;
      *.ko.xz) xz -dc "$ko" > "$stage/lib/modules/${b%.xz}"; b=${b%.xz} ;;
      *.ko.zst) zstd -qdc "$ko" > "$stage/lib/modules/${b%.zst}"; b=${b%.zst} ;;
      *.ko.gz) gzip -dc "$ko" > "$stage/lib/modules/${b%.gz}"; b=${b%.gz} ;;
    esac
    echo "$opt$b" >> "$stage/lib/modules/order"
  done
  rm -f "$stage/mods.req" "$stage/mods.opt"

  # Per-guest settings come on the kernel command line: softroce.share (the
  # shared dir), softroce.netdev (virtio|dummy), softroce.name (guest name:
  # cmd-NAME.sh / rc-NAME in the share; none = cmd.sh / rc), softroce.ip
  # (ADDR/PREFIX of the NIC rxe0 is bound to), softroce.mtu, softroce.ip2
  # (ADDR/PREFIX of a second NIC, which gets rxe1; absent: one NIC).
  cat > "$stage/init" <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
T0=$(cut -d' ' -f1 /proc/uptime)
say() { echo "softroce-init: $*"; }
NAME= IPNET=10.77.0.1/24 MTU= IPNET2=
for a in $(cat /proc/cmdline); do
  case "$a" in
    softroce.share=*)  SHARE=${a#*=} ;;
    softroce.netdev=*) NETDEV=${a#*=} ;;
    softroce.name=*)   NAME=${a#*=} ;;
    softroce.ip=*)     IPNET=${a#*=} ;;
    softroce.ip2=*)    IPNET2=${a#*=} ;;
    softroce.mtu=*)    MTU=${a#*=} ;;
  esac
done
SUFFIX=${NAME:+-$NAME}
finish() {
  [ "$1" = 126 ] && { say "kernel log tail:"; dmesg | tail -n 25; }
  echo "SOFTROCE_RESULT rc=$1"
  [ -d "/newroot$SHARE" ] && { echo "$1" > "/newroot$SHARE/rc$SUFFIX"; sync; umount "/newroot$SHARE"; } 2>/dev/null
  sync
  poweroff -f
}
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
hostname "softroce$SUFFIX"
ip link set lo up
IF= IF2=
case "$NETDEV" in
  dummy) ip link add rxenet0 type dummy; IF=rxenet0 ;;
  *)     for n in /sys/class/net/*; do   # the NICs backed by a (virtio) device, in order
           [ -e "$n/device" ] || continue
           if [ -z "$IF" ]; then IF=${n##*/}; elif [ -z "$IF2" ]; then IF2=${n##*/}; fi
         done ;;
esac
[ -n "$IF" ] || { say "no network device"; finish 126; }
[ -z "$IPNET2" ] || [ -n "$IF2" ] || { say "softroce.ip2 given but no second network device"; finish 126; }
IP=${IPNET%/*} IP2=${IPNET2%/*}
# rxe DEV IF ADDR/PREFIX: address, MTU, link up, an rxe device on it, its
# port ACTIVE and its IPv4-mapped GID registered
rxe() {
  ip addr add "$3" dev "$2"
  [ -n "$MTU" ] && { ip link set "$2" mtu "$MTU" || { say "cannot set mtu $MTU on $2"; finish 126; }; }
  ip link set "$2" up
  chroot /newroot rdma link add "$1" type rxe netdev "$2" || { say "rdma link add $1 failed"; finish 126; }
  i=0
  while [ "$(cat /sys/class/infiniband/$1/ports/1/state 2>/dev/null)" != "4: ACTIVE" ]; do
    i=$((i+1)); [ $i -gt 100 ] && { say "$1 port not ACTIVE"; finish 126; }
    sleep 0.1
  done
  i=0
  while ! grep -q '0000:0000:0000:0000:0000:ffff:' /sys/class/infiniband/$1/ports/1/gids/* 2>/dev/null; do
    i=$((i+1)); [ $i -gt 100 ] && break
    sleep 0.1
  done
}
rxe rxe0 "$IF" "$IPNET"
[ -n "$IPNET2" ] && rxe rxe1 "$IF2" "$IPNET2"
T1=$(cut -d' ' -f1 /proc/uptime)
say "rxe0 on $IF ($IPNET, mtu $(cat /sys/class/net/$IF/mtu))${IPNET2:+, rxe1 on $IF2 ($IPNET2)} ready, guest uptime ${T1}s (init took $(echo "$T0 $T1" | awk '{printf "%.2f", $2-$1}')s)"
echo "SOFTROCE_READY uptime=$T1"
CWD=$(cat "/newroot$SHARE/cwd" 2>/dev/null || echo /)
chroot /newroot /usr/bin/env -i HOME=/root TERM=dumb LANG=C.UTF-8 \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  SOFTROCE_SHARE="$SHARE" SOFTROCE_IP="$IP" SOFTROCE_NETDEV="$IF" SOFTROCE_CWD="$CWD" \
  SOFTROCE_IP2="$IP2" SOFTROCE_NETDEV2="$IF2" \
  SOFTROCE_NAME="$NAME" SOFTROCE_CMD="$SHARE/cmd$SUFFIX.sh" \
  /bin/bash -c 'cd "$SOFTROCE_CWD" 2>/dev/null || cd /; exec /bin/bash "$SOFTROCE_CMD"'
rc=$?
T2=$(cut -d' ' -f1 /proc/uptime)
say "command finished rc=$rc after $(echo "$T1 $T2" | awk '{printf "%.2f", $2-$1}')s (guest uptime ${T2}s)"
finish $rc
INIT
  chmod 755 "$stage/init"
  (cd "$stage" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -1) > "$INITRD"
  log "initramfs: $(du -h "$INITRD" | cut -f1), modules: $(tr '\n' ' ' < "$stage/lib/modules/order")"
  rm -rf "$stage"
}

# ---------------------------------------------------------------- accelerator
kvm_usable() {
  [ -w /dev/kvm ] || { log "/dev/kvm missing or not writable"; return 1; }
  local t0 out qrc
  t0=$(now)
  # tiny boot of the real kernel with a trivial init: proves KVM actually runs
  # an unmodified guest at usable speed (e.g. nested "PVM" hosts expose /dev/kvm
  # but emulate an unmodified guest kernel instruction by instruction).
  local pd; pd=$(mktemp -d); mkdir -p "$pd/bin"; cp "$BUSYBOX" "$pd/bin/busybox"
  printf '#!/bin/busybox sh\n/bin/busybox echo KVM_PROBE_OK\n/bin/busybox poweroff -f\n' > "$pd/init"; chmod 755 "$pd/init"
  (cd "$pd" && find . | cpio -o -H newc --quiet | gzip -1) > "$pd.img"
  out=$(timeout "$PROBE_TIMEOUT" qemu-system-x86_64 -nodefaults -no-user-config -vga none -display none \
        -no-reboot -accel kvm -cpu host -m 256 -kernel "$KERNEL" -initrd "$pd.img" \
        -append "console=ttyS0 panic=-1 quiet" -serial stdio </dev/null 2>&1) && qrc=0 || qrc=$?
  rm -rf "$pd" "$pd.img"
  if grep -q KVM_PROBE_OK <<<"$out"; then
    log "KVM probe boot OK ($(since "$t0")s)"; return 0
  fi
  if [ "$qrc" = 124 ]; then
    log "KVM probe boot did not finish within ${PROBE_TIMEOUT}s -> not usable"
  else
    log "KVM probe boot failed after $(since "$t0")s (qemu rc=$qrc: $(grep -v '^$' <<<"$out" | head -n1)) -> not usable"
  fi
  return 1
}

softroce_accel() {
  case "$ACCEL" in
    kvm)  ACCEL_ARGS=(-accel kvm -cpu host) ;;
    tcg)  ACCEL_ARGS=(-accel tcg,thread=multi -cpu max) ;;
    auto) if kvm_usable; then ACCEL_ARGS=(-accel kvm -cpu host); else ACCEL_ARGS=(-accel tcg,thread=multi -cpu max); fi ;;
    *) die "SOFTROCE_ACCEL must be auto, kvm or tcg" ;;
  esac
}

softroce_prepare() {
  softroce_need_pkgs qemu-system-x86 linux-image-amd64 rdma-core ibverbs-utils ibverbs-providers \
    libibverbs-dev librdmacm-dev rdmacm-utils perftest busybox-static cpio kmod \
    iproute2 gzip xz-utils binutils
  softroce_kernel
  # per-run directory (concurrent runs may share $WORK)
  RUN=$(mktemp -d "$WORK/run.XXXXXX")
  trap softroce_cleanup EXIT
  SHARE=$RUN/share
  INITRD=$RUN/initrd.img
  mkdir -p "$SHARE/marks"
  pwd -P > "$SHARE/cwd"
  softroce_initramfs
  softroce_accel
}

# ---------------------------------------------------------------- guests
# softroce_cmd_file FILE PRELUDE ARG...: writes a guest's command file:
# PRELUDE (shell code, may be empty), the helpers of ci/softroce-guest.sh,
# then `-c CODE` (bash code) or `[--] CMD ARGS...` (exec'd).
softroce_cmd_file() {
  local file=$1 prelude=$2; shift 2
  {
    [ -n "$prelude" ] && printf '%s\n' "$prelude"
    printf '. %q\n' "$SOFTROCE_CI/softroce-guest.sh"
    if [ "${1:-}" = "-c" ]; then
      shift; printf '%s\n' "$*"
    else
      [ "${1:-}" = "--" ] && shift
      [ $# -gt 0 ] || die "no guest command"
      printf 'exec'; printf ' %q' "$@"; printf '\n'
    fi
  } > "$file"
}

# softroce_qemu_cmd NAME APPEND NETARGS...: QEMU_CMD = the full command line
# of a guest (NAME may be empty); APPEND = extra kernel parameters.
softroce_qemu_cmd() {
  local name=$1 append=$2; shift 2
  QEMU_CMD=(qemu-system-x86_64 -nodefaults -no-user-config -vga none -display none
    -no-reboot -m "$MEM" -kernel "$KERNEL" -initrd "$INITRD"
    -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
    -virtfs "local,path=$SHARE,mount_tag=share,security_model=none"
    -device virtio-rng-pci "$@" "${ACCEL_ARGS[@]}" -smp "$SMP"
    -append "console=ttyS0 panic=-1 quiet loglevel=3 softroce.share=$SHARE${name:+ softroce.name=$name} $append"
    -serial stdio)
}

# softroce_guest_rc NAME CONSOLE_LOG: prints the exit code guest NAME
# reported (its rc file, else the console's SOFTROCE_RESULT line).
softroce_guest_rc() {
  local rc
  rc=$(tr -d '\r' < "$SHARE/rc${1:+-$1}" 2>/dev/null || true)
  [ -n "$rc" ] || rc=$(tr -d '\r' < "$2" 2>/dev/null | sed -n 's/.*SOFTROCE_RESULT rc=\([0-9]*\).*/\1/p' | tail -n1)
  echo "$rc"
}
