#!/usr/bin/env bash
# ci/gpu.sh -- kvlane on GPU memory, on a machine with one NVIDIA GPU (CUDA
# driver, PyTorch, CuPy) and no RDMA NIC and no network, from release
# binaries and a wheel built elsewhere. Steps:
#
#   ci/gpu.sh build DIR   # build machine, no GPU needed: stripped release
#                         # binaries, the wheel and the Python flow into DIR
#                         # (about 17 MB: it fits the 64 MiB a device
#                         # machine is sent; the build fails past 60 MiB)
#   ci/gpu.sh run DIR     # GPU machine: the checks below (about a minute)
#   ci/gpu.sh DIR         # both, on a GPU machine that can build
#   ci/gpu.sh rehearse DIR  # build, then run every step below against the
#                         # MOCK CUDA driver (crates/kvlane-data/testdata/
#                         # mock_cuda.c: host memory behind the driver API)
#                         # instead of a GPU, and the Python flow's `mock`
#                         # mode instead of torch. It proves the script, the
#                         # binaries and the wheel work together before a GPU
#                         # machine's minutes are spent; it says nothing
#                         # about a GPU, and every line it prints says MOCK.
#                         # .ci/run runs it.
#
# On the device machine of this project (DIR inside the repository, ignored
# by git, named in `carry`; results come back through $OUT):
#   ci/gpu.sh build target/gpu                  # here
#   set -o pipefail; GPU_RESULTS=$OUT ci/gpu.sh run target/gpu 2>&1 | tee $OUT/gpu.log
#
# run:
#   1. a GPU must be there (nvidia-smi, `kvlane devices`): without one this
#      fails at once, loudly (exit 1);
#   2. the ignored GPU tests (crates/kvlane-data/tests/gpu.rs,
#      KVLANE_TEST_GPU=cuda:0): the conformance suite over loopback and tcp
#      with every region in GPU memory, byte-checked; registration by
#      pointer; dma-buf export (supported or the typed Unsupported); what
#      verbs registration does without a NIC;
#   2b. GPU memory served by the shm backend through CUDA IPC handles
#      (crates/kvlane-data/tests/shm_gpu.rs, ignored test `real_gpu_...`):
#      two processes, READ and WRITE from host and GPU memory, byte-checked;
#   3. the Python package (crates/kvlane-py/tests/gpu_flow.py torch): torch
#      CUDA tensors and a CuPy array registered, WRITE over tcp in one
#      process and between two processes (sha256-checked in the target
#      after its notification), kvlane.nixl with "VRAM". The wheel is
#      installed with `pip --target` beside the machine's own python3 (the
#      one with torch; a venv made from it would not see its packages);
#   4. `kvlane bench` over tcp and loopback with --memory cuda:0 beside
#      --memory host at 1 MiB and 16 MiB, and a two-process tcp bench from
#      and to GPU memory; prints GPU vs host tcp GB/s and the ratio (the
#      target is >= 0.8x; GPU_MIN_RATIO=0.8 enforces it).
# Steps 2-4 each run to the end, under a time limit, whatever the others
# did (a device machine's minutes are few: one run says all it can); the
# exit status is 1 when any failed, and the last lines name them.
#
# Knobs: GPU_DEVICE (cuda:0), GPU_DURATION (1s per bench point),
#        GPU_VERBS (1: build with --features verbs; needs cmake, libclang,
#        libibverbs-dev on the build machine), PYTHON (python3 on the GPU
#        machine; it needs torch, numpy and, optionally, cupy),
#        GPU_RESULTS (a folder the logs and bench rows are copied to).
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "ci/gpu.sh: $*" >&2; }
die() { log "FAIL: $*"; exit 1; }
cargo_exe() { grep -o '"executable":"[^"]*"' | cut -d'"' -f4 | grep -v '^$' | tail -n1; }

build() {
  local out=$1 feat=() exe
  mkdir -p "$out"
  [ "${GPU_VERBS:-1}" = 1 ] && feat=(--features verbs)
  command -v strip >/dev/null || die "strip (binutils) is needed to make the binaries small enough to carry"
  log "building release binaries ${feat[*]}"
  exe=$(cargo build --release -p kvlane-cli "${feat[@]}" --message-format=json-render-diagnostics | cargo_exe)
  # Without debug info: 64 MB -> 10 MB for `kvlane` (a device machine is
  # sent 64 MiB in all).
  strip --strip-debug -o "$out/kvlane" "$exe"
  exe=$(cargo test --release -p kvlane-data "${feat[@]}" --test gpu --no-run \
          --message-format=json-render-diagnostics | cargo_exe)
  strip --strip-debug -o "$out/gpu-tests" "$exe"
  exe=$(cargo test --release -p kvlane-data "${feat[@]}" --test shm_gpu --no-run \
          --message-format=json-render-diagnostics | cargo_exe)
  strip --strip-debug -o "$out/shm-gpu-tests" "$exe"
  log "building the wheel (maturin, release, stripped)"
  local venv=target/py-venv
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/python" -m pip -q --disable-pip-version-check install 'maturin>=1.7,<2'
  rm -f "$out"/kvlane-*.whl
  "$venv/bin/maturin" build --release --strip -q -m crates/kvlane-py/Cargo.toml -o "$out"
  cp crates/kvlane-py/tests/gpu_flow.py "$out/"
  local kib
  kib=$(du -sk "$out/kvlane" "$out/gpu-tests" "$out/shm-gpu-tests" "$out"/kvlane-*.whl "$out/gpu_flow.py" | awk '{s += $1} END {print s}')
  log "built into $out: $(cd "$out" && echo kvlane gpu-tests shm-gpu-tests kvlane-*.whl gpu_flow.py) ($((kib / 1024)) MiB)"
  [ "$kib" -le $((60 * 1024)) ] || die "$out holds $((kib / 1024)) MiB: too much to carry to a device machine (64 MiB with the repository)"
}

run() {
  local dir dev=${GPU_DEVICE:-cuda:0} dur=${GPU_DURATION:-1s} py=${PYTHON:-python3}
  local mock=${MOCK:-0} flow=torch failed=()
  dir=$(realpath "$1")
  for f in kvlane gpu-tests shm-gpu-tests gpu_flow.py; do [ -e "$dir/$f" ] || die "$dir/$f missing: run ci/gpu.sh build $1 first"; done
  ls "$dir"/kvlane-*.whl >/dev/null 2>&1 || die "no wheel in $dir: run ci/gpu.sh build $1 first"
  local t0; t0=$(date +%s)
  # A step that fails is named at the end; the next one still runs.
  step() {
    local name=$1; shift
    if "$@"; then log "ok: $name"; else log "FAILED: $name"; failed+=("$name"); fi
  }

  if [ "$mock" = 1 ]; then
    echo "===== MOCK rehearsal: the mock CUDA driver (host memory), not a GPU"
    [ "$dev" = cuda:0 ] || die "the rehearsal mocks cuda:0 only (GPU_DEVICE=$dev)"
    mkdir -p "$dir/mock"
    "${CC:-cc}" -shared -fPIC -O2 -Wall -o "$dir/mock/libcuda.so.1" \
      crates/kvlane-data/testdata/mock_cuda.c -lpthread || die "cannot build the mock CUDA driver (cc)"
    export KVLANE_CUDA_LIBRARY="$dir/mock/libcuda.so.1" KVLANE_MOCK_CUDA_DEVICES=1
    flow=mock
    # The build machine's python3 has no numpy: a venv with it stands in
    # for the GPU machine's python3 (the wheel goes beside it as there).
    if [ ! -x "$dir/mock/py/bin/python" ]; then
      python3 -m venv "$dir/mock/py" || die "cannot make a venv for the rehearsal"
      "$dir/mock/py/bin/python" -m pip -q --disable-pip-version-check install numpy
    fi
    py="$dir/mock/py/bin/python"
  else
    echo "===== GPU present?"
    command -v nvidia-smi >/dev/null || die "no nvidia-smi: this machine has no NVIDIA driver (ci/gpu.sh needs a GPU)"
    nvidia-smi -L || die "nvidia-smi lists no GPU"
    nvidia-smi -L | grep -q '^GPU ' || die "nvidia-smi lists no GPU"
  fi
  # `kvlane devices` exits 2 without an RDMA device (expected here).
  "$dir/kvlane" devices | tee "$dir/devices.txt" || true
  grep -q "^gpu $dev " "$dir/devices.txt" || die "kvlane sees no $dev (see the lines above)"

  echo "===== Rust GPU tests on $dev (loopback, tcp, by pointer, dma-buf, verbs without a NIC)"
  step "Rust GPU tests" env KVLANE_TEST_GPU="$dev" timeout 240 "$dir/gpu-tests" --ignored \
    --test-threads=2 --nocapture

  echo "===== shm: GPU memory between two processes by IPC handle on $dev (crates/kvlane-data/tests/shm_gpu.rs)"
  step "shm GPU IPC" env KVLANE_TEST_GPU="$dev" timeout 120 "$dir/shm-gpu-tests" --ignored \
    --exact real_gpu_device_memory_moves_both_ways_across_processes --nocapture

  echo "===== Python ($flow): GPU arrays, two processes over tcp, kvlane.nixl VRAM"
  rm -rf "$dir/site"
  if "$py" -m pip -q --disable-pip-version-check install --no-deps --no-index --no-compile \
       --target "$dir/site" "$dir"/kvlane-*.whl; then
    export PYTHONPATH="$dir/site${PYTHONPATH:+:$PYTHONPATH}"
    if [ "$mock" = 1 ]; then
      step "Python flow (mock)" env KVLANE_TEST_GPU="$dev" timeout 150 "$py" "$dir/gpu_flow.py" mock
    elif "$py" -c 'import torch, numpy'; then
      step "Python flow (torch)" env KVLANE_TEST_GPU="$dev" timeout 150 "$py" "$dir/gpu_flow.py" torch
      if "$py" -c 'import cupy' 2>/dev/null; then
        step "Python flow (cupy)" env KVLANE_TEST_GPU="$dev" timeout 150 "$py" "$dir/gpu_flow.py" cupy
      else
        log "SKIPPED: Python flow (cupy): $py has no cupy (optional)"
      fi
    else
      log "FAILED: $py lacks torch or numpy"; failed+=("Python flow: $py lacks torch or numpy")
    fi
  else
    log "FAILED: cannot install the wheel with $py"; failed+=("Python: wheel install")
  fi

  echo "===== bench: tcp and loopback, GPU memory beside host memory"
  local json="$dir/bench.jsonl"
  : > "$json"
  bench_one() {
    timeout 120 "$dir/kvlane" bench --backend loopback,tcp --op write,read --block-sizes 1M,16M \
      --batch 16 --duration "$dur" --memory "$1" --json | tee -a "$json"
  }
  for mem in host "$dev"; do step "bench --memory $mem" bench_one "$mem"; done

  echo "===== bench: two processes over tcp, GPU memory on both sides"
  two_procs() {
    # Port 0: the system picks a free one, named by the `listening` line
    # (a random fixed port could be taken as some connection's local port).
    local addr tpid rc=0
    "$dir/kvlane" bench --role target --backend tcp --listen "127.0.0.1:0" --memory "$dev" \
      --pool 256M --no-baseline > "$dir/target.log" 2>&1 &
    tpid=$!
    # The target listens once its pool is filled (every page touched:
    # seconds where first touches are slow); its `listening` line says so.
    local waited=0
    until grep -q '^listening ' "$dir/target.log"; do
      if ! kill -0 "$tpid" 2>/dev/null || [ "$waited" -ge 1200 ]; then
        echo "FAIL: the bench target did not start listening within 120 s:"
        cat "$dir/target.log"
        kill "$tpid" 2>/dev/null || true
        return 1
      fi
      sleep 0.1
      waited=$((waited + 1))
    done
    addr=$(awk '/^listening /{print $2; exit}' "$dir/target.log")
    timeout 120 "$dir/kvlane" bench --role initiator --backend tcp --connect "$addr" \
      --op write,read --block-sizes 1M,16M --batch 16 --duration "$dur" --memory "$dev" \
      --no-baseline --json | tee "$dir/bench-2proc.jsonl" || { rc=1; cat "$dir/target.log"; }
    kill "$tpid" 2>/dev/null || true
    wait "$tpid" 2>/dev/null || true
    return "$rc"
  }
  step "two-process bench" two_procs

  echo "===== GPU vs host, tcp backend (same run)"
  local min=${GPU_MIN_RATIO:-} label=GPU
  [ "$mock" = 1 ] && { min=; label=MOCK; }
  ratio() {
    python3 - "$json" "$min" "$label" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
gb = {(r["backend"], r["memory"], r["op"], r["block_size"]): r["gbps"] for r in rows}
mins, label, bad = sys.argv[2], sys.argv[3], []
if label == "MOCK":
    print("MOCK: 'GPU' below is host memory behind the mock driver, copied through staging; not a GPU figure")
print(f"{'op':<6}{'block':>7}{'host GB/s':>11}{label + ' GB/s':>11}{'ratio':>7}")
for op in ("write", "read"):
    for block in (1 << 20, 16 << 20):
        h = gb.get(("tcp", "host", op, block))
        g = next((v for (b, m, o, s), v in gb.items() if b == "tcp" and m != "host" and o == op and s == block), None)
        if h is None or g is None:
            sys.exit(f"missing tcp rows for {op} {block}")
        ratio = g / h if h else 0.0
        print(f"{op:<6}{block >> 20:>6}M{h:>11.2f}{g:>11.2f}{ratio:>7.2f}")
        if mins and ratio < float(mins):
            bad.append(f"{op} {block >> 20}M: {ratio:.2f} < {mins}")
if bad:
    sys.exit("GPU/host ratio below GPU_MIN_RATIO: " + "; ".join(bad))
PY
  }
  step "GPU vs host table" ratio

  if [ -n "${GPU_RESULTS:-}" ]; then
    mkdir -p "$GPU_RESULTS"
    cp "$dir"/devices.txt "$dir"/*.jsonl "$GPU_RESULTS"/ 2>/dev/null || true
  fi
  local took=$(( $(date +%s) - t0 ))
  if [ "${#failed[@]}" -gt 0 ]; then
    log "FAIL after ${took}s: ${failed[*]}"
    exit 1
  fi
  if [ "$mock" = 1 ]; then
    log "MOCK rehearsal passed in ${took}s (the mock CUDA driver, no GPU: nothing here ran on a GPU)"
  else
    log "all GPU checks passed in ${took}s"
  fi
}

case "${1:-}" in
  build) [ $# = 2 ] || die "usage: ci/gpu.sh build DIR"; build "$2" ;;
  run) [ $# = 2 ] || die "usage: ci/gpu.sh run DIR"; run "$2" ;;
  rehearse) [ $# = 2 ] || die "usage: ci/gpu.sh rehearse DIR"; build "$2"; MOCK=1 run "$2" ;;
  ""|-h|--help) sed -n '2,55p' "$0"; exit 2 ;;
  *) build "$1"; run "$1" ;;
esac
