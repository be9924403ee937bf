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

cargo test --workspace --all-targets --locked --no-fail-fast
cargo test --workspace --doc --locked

# The Python package (kvlane-py): venv, maturin build, pytest.
ci/test-python.sh
