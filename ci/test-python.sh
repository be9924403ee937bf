#!/usr/bin/env bash
# The Python part of the tests: a virtual environment (Debian's python3
# refuses system-wide installs), the `kvlane` package built by maturin
# through pip (the README's install command), then pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=ci/py-venv.sh
source ci/py-venv.sh
export PATH="$venv/bin:$PATH"  # the maturin build backend runs `maturin`
"${pip[@]}" install 'maturin>=1.7,<2' numpy pytest
# The real NIXL, for the differential test (its Python API runs without a
# GPU over UCX tcp; --no-deps skips the CUDA stack it does not need here).
"${pip[@]}" install --no-deps nixl-cu12
export KVLANE_REQUIRE_NIXL=1
# The build reuses the workspace's target directory: in the dev profile
# (KVLANE_PY_PROFILE, default dev) it reuses what `cargo test` built.
export MATURIN_PEP517_ARGS="--profile ${KVLANE_PY_PROFILE:-dev}"
"${pip[@]}" install --no-build-isolation --force-reinstall --no-deps ./crates/kvlane-py
"$venv/bin/python" -c 'import kvlane, kvlane.nixl'
# Run from outside the source tree so the installed package is tested.
(cd crates/kvlane-py/tests && "$venv/bin/python" -m pytest -q -p no:cacheprovider . "$@")
# Benchmark smoke run (tiny sizes; timings are not checked).
"$venv/bin/python" crates/kvlane-py/bench/bench.py --impl native,kvlane.nixl \
  --block-sizes 4K --batch 4 --duration 0.05 --rounds 2
"$venv/bin/python" crates/kvlane-py/bench/bench.py --impl native --post batch \
  --block-sizes 4K --batch 4 --duration 0.05
