"""The same connector flow (flow.py) against the real NIXL (PyPI
``nixl-cu12``, UCX over tcp, no GPU) and against ``kvlane.nixl``: the
outcomes must be the same. ci/test-python.sh installs ``nixl-cu12`` and
sets ``KVLANE_REQUIRE_NIXL=1``, so there a missing NIXL fails the test
instead of skipping it."""

import os
import sys

from conftest import require_nixl, run_flow

HERE = os.path.dirname(os.path.abspath(__file__))


def flow(module: str, env: dict) -> dict:
    return run_flow([sys.executable, os.path.join(HERE, "flow.py"), module], env)


def test_connector_flow_has_the_same_outcomes_on_nixl_and_kvlane_nixl():
    require_nixl()
    nixl = flow("nixl_cu12._api", {"UCX_TLS": "tcp"})
    ours = flow("kvlane.nixl", {"KVLANE_BACKEND": "tcp"})
    print("nixl:  ", nixl)
    print("kvlane:", ours)
    assert ours == nixl
    # And the outcomes are the right ones.
    assert nixl["read_state"] == nixl["write_state"] == "DONE"
    assert nixl["read_bytes_ok"] and nixl["write_notif_after_data"]
    assert nixl["local_outside"] == nixl["remote_outside"] == "raised"
    assert nixl["after_death"] == "ERR"
