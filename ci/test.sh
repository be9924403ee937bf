#!/usr/bin/env bash
# The project's test command (README): installs what the tests need on a
# fresh Debian machine, then runs every test of the workspace.
set -euo pipefail
cd "$(dirname "$0")/.."

# Interop tests talk to a Python pyzmq peer; they fail (not skip) without it.
if ! python3 -c 'import zmq, msgpack' 2>/dev/null; then
  echo "ci/test.sh: installing pyzmq and msgpack for the interop tests" >&2
  python3 -m pip install --quiet --disable-pip-version-check pyzmq msgpack
fi

# The multi-host tests (crates/kvlane-cli/tests/multihost.rs) build network
# namespaces: they need root, install iproute2 and nftables if missing, and
# fail (not skip) without root. They run examples/prefill_decode from
# target/debug/examples, which only `cargo build` writes (not `cargo test`).
cargo build --workspace --examples --locked
cargo test --workspace --all-targets --locked --no-fail-fast
cargo test --workspace --doc --locked

# The Python package (kvlane-py): venv, maturin build, pytest.
ci/test-python.sh
