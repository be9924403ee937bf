"""The Python package across two hosts: each host a Linux network namespace
with its own network stack, joined by a veth pair (addresses
10.232.K.1 and .2/24, only inside the namespaces). The connector flow
(flow.py) runs its initiator on one host and its target on the other, the
target bound to a wildcard address and naming its host's address in its
metadata (``KVLANE_NIXL_ADVERTISE``), as a server would run; the outcomes
must be those of the same flow on one host. The real NIXL runs the same
flow across the same hosts when it is installed (required under
ci/test-python.sh, as in test_differential.py).

Needs root and ``ip`` (iproute2): without them these tests fail with the
reason, they never skip (the Rust multi-host tests, run before these by
ci/test.sh, install iproute2 when it is missing)."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import require_nixl, run_flow

HERE = os.path.dirname(os.path.abspath(__file__))


def sh(*args: str) -> None:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, f"{' '.join(args)}: {r.stderr.strip()}"


class Hosts:
    """Two namespaces ``a`` (10.232.K.1) and ``b`` (10.232.K.2)."""

    def __init__(self) -> None:
        assert os.geteuid() == 0, "the two-host tests need root (network namespaces)"
        assert shutil.which("ip"), "the two-host tests need `ip` (apt-get install iproute2)"
        pid = os.getpid()
        self.a, self.b = f"kvpy{pid}a", f"kvpy{pid}b"
        k = pid % 250 + 1
        self.addr = {self.a: f"10.232.{k}.1", self.b: f"10.232.{k}.2"}
        self.close()  # what a killed earlier run with this pid left
        for ns in (self.a, self.b):
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", self.a, "type", "veth", "peer", "name", self.b)
        for ns in (self.a, self.b):
            sh("ip", "link", "set", ns, "netns", ns)
            sh("ip", "-n", ns, "link", "set", ns, "name", "eth0")
            sh("ip", "-n", ns, "addr", "add", f"{self.addr[ns]}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")

    def on(self, ns: str, **env: str) -> list:
        """The command prefix that runs a command on host `ns`."""
        return ["ip", "netns", "exec", ns, "env"] + [f"{k}={v}" for k, v in env.items()]

    def close(self) -> None:
        for ns in (self.a, self.b):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for p in pids.stdout.split():
                subprocess.run(["kill", "-9", p], capture_output=True)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.fixture
def hosts():
    h = Hosts()
    yield h
    h.close()


def flow_across(h: Hosts, module: str, env: dict) -> dict:
    """flow.py's initiator on host b, its target on host a (wildcard
    listen, host a's address advertised)."""
    target = h.on(h.a, KVLANE_NIXL_HOST="0.0.0.0", KVLANE_NIXL_ADVERTISE=h.addr[h.a], **env)
    cmd = h.on(h.b, KVLANE_NIXL_HOST=h.addr[h.b], FLOW_TARGET_PREFIX=" ".join(target), **env)
    return run_flow(cmd + [sys.executable, os.path.join(HERE, "flow.py"), module], timeout=150)


def test_connector_flow_across_hosts_matches_one_host(hosts):
    # Authenticated, as across hosts it should be (KVLANE_PSK on both).
    env = {"KVLANE_BACKEND": "tcp", "KVLANE_PSK": "flow-key"}
    across = flow_across(hosts, "kvlane.nixl", env)
    here = run_flow([sys.executable, os.path.join(HERE, "flow.py"), "kvlane.nixl"], env, 150)
    print("across hosts:", across)
    print("one host:    ", here)
    assert across == here
    assert across["read_state"] == across["write_state"] == "DONE"
    assert across["read_bytes_ok"] and across["write_notif_after_data"]
    assert across["read_notif_target_unchanged"]
    assert across["send_notif"] == [["initiator", "hello"]]
    assert across["local_outside"] == across["remote_outside"] == "raised"
    assert across["after_death"] == "ERR" and across["after_death_bounded"]


def test_real_nixl_runs_the_same_flow_across_the_same_hosts(hosts):
    require_nixl()
    nixl = flow_across(hosts, "nixl_cu12._api", {"UCX_TLS": "tcp"})
    ours = flow_across(hosts, "kvlane.nixl", {"KVLANE_BACKEND": "tcp", "KVLANE_PSK": "flow-key"})
    print("nixl:  ", nixl)
    print("kvlane:", ours)
    assert ours == nixl


def test_native_api_across_hosts_to_a_wildcard_target(hosts):
    """The native API: target.py bound to 0.0.0.0 on host a (its data plane
    dialed at the address the control connection reached), native_flow.py
    on host b."""
    target = hosts.on(hosts.a)
    cmd = hosts.on(hosts.b, FLOW_TARGET_PREFIX=" ".join(target), TARGET_HOST=hosts.addr[hosts.a])
    out = run_flow(cmd + [sys.executable, os.path.join(HERE, "native_flow.py")], timeout=150)
    print(out)
    assert out["target_listens"] == "0.0.0.0" and out["engine_id"] == "target"
    assert out["write"] == out["read"] == "done"
    assert out["write_note"] == ["init", "w1"] and out["write_note_after_data"]
    assert out["read_bytes_ok"] and out["read_note"] == ["init", "r1"]
    # Keep-alive 0.5 s x 3 on this side: lost well inside the 30 s bound.
    assert out["after_death"] == "PeerLostError", out
