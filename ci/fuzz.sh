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
  extra=()
  # control_listener drives a real ControlNode on a tokio runtime that
  # lives for the whole process: its zeromq tasks are still allocated when
  # libFuzzer exits, which LeakSanitizer reports as leaks (not a per-input
  # leak); its RSS is bounded by -rss_limit_mb instead.
  [ "$target" = control_listener ] && extra=(-detect_leaks=0)
  cargo fuzz run --fuzz-dir fuzz "$target" -- -max_total_time="$secs" -rss_limit_mb=2048 "${extra[@]}"
done
