#!/usr/bin/env bash
# The project's test command (README): installs what the tests need on a
# fresh Debian machine, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

# Interop tests talk to a Python pyzmq peer; they fail (not skip) without it.
# It runs in the tests' venv (ci/py-venv.sh; Debian's python3 refuses a
# system-wide pip install), which KVLANE_PYTHON names to the tests.
# shellcheck source=ci/py-venv.sh
source ci/py-venv.sh
if ! "$venv/bin/python" -c 'import zmq, msgpack' 2>/dev/null; then
  echo "ci/test.sh: installing pyzmq and msgpack into $venv for the interop tests" >&2
  "${pip[@]}" install pyzmq msgpack
fi
export KVLANE_PYTHON="$venv/bin/python"

# The multi-host tests (crates/kvlane-cli/tests/multihost.rs) build network
# namespaces: they need root, install iproute2 and nftables if missing, and
# fail (not skip) without root. They run examples/prefill_decode from
# target/debug/examples, which only `cargo build` writes (not `cargo test`).
cargo build --workspace --examples --locked
cargo test --workspace --all-targets --locked --no-fail-fast
cargo test --workspace --doc --locked

# The Python package (kvlane-py): venv, maturin build, pytest.
ci/test-python.sh
