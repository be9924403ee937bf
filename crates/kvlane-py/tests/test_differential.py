"""The same connector flow (flow.py) against the real NIXL (PyPI
``nixl-cu12``, UCX over tcp, no GPU) and against ``kvlane.nixl``: the
outcomes must be the same. ci/test-python.sh installs ``nixl-cu12`` and
sets ``KVLANE_REQUIRE_NIXL=1``, so there a missing NIXL fails the test
instead of skipping it."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_flow(module: str, env: dict) -> dict:
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "flow.py"), module],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("FLOW ")]
    assert lines, f"{module} flow failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(lines[-1][5:])


def test_connector_flow_has_the_same_outcomes_on_nixl_and_kvlane_nixl():
    if importlib.util.find_spec("nixl_cu12") is None:
        if os.environ.get("KVLANE_REQUIRE_NIXL") == "1":
            pytest.fail("nixl_cu12 is not installed (pip install --no-deps nixl-cu12)")
        pytest.skip("the real NIXL (pip install --no-deps nixl-cu12) is not installed")
    nixl = run_flow("nixl_cu12._api", {"UCX_TLS": "tcp"})
    ours = run_flow("kvlane.nixl", {"KVLANE_BACKEND": "tcp"})
    print("nixl:  ", nixl)
    print("kvlane:", ours)
    assert ours == nixl
    # And the outcomes are the right ones.
    assert nixl["read_state"] == nixl["write_state"] == "DONE"
    assert nixl["read_bytes_ok"] and nixl["write_notif_after_data"]
    assert nixl["local_outside"] == nixl["remote_outside"] == "raised"
    assert nixl["after_death"] == "ERR"
