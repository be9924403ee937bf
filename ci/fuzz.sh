#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (seconds per target, default 30).
# cargo-fuzz needs nightly features; RUSTC_BOOTSTRAP=1 enables them on the
# stable toolchain this project uses.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-30}
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "ci/fuzz.sh: installing cargo-fuzz" >&2
  cargo install cargo-fuzz --locked --quiet
fi
export RUSTC_BOOTSTRAP=1
for target in $(cargo fuzz list --fuzz-dir fuzz); do
  echo "--- fuzz $target for ${secs}s"
  cargo fuzz run --fuzz-dir fuzz "$target" -- -max_total_time="$secs" -rss_limit_mb=2048
done
