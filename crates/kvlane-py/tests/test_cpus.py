"""``kvlane.Agent(cpus=...)`` and ``KVLANE_CPUS``: where kvlane's threads
run when the thread that builds the agent was pinned to one core (vLLM's
CPU worker does that before it builds the transport). Each case runs in a
fresh interpreter: the placement of the module's runtime and pools is
decided once per process."""

import json
import os
import subprocess
import sys

import pytest

import kvlane

CHILD = r"""
import json, os, sys, time
import kvlane
cpus = sorted(os.sched_getaffinity(0))
os.sched_setaffinity(0, {cpus[0]})
kw = json.loads(sys.argv[1])
a = kvlane.Agent(backend="tcp", **kw)
b = kvlane.Agent(backend="tcp", **kw)
b.connect(a.addr)

def masks():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("kvlane"):
                out[f"{name}/{tid}"] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:
            pass
    return out

# A new thread names itself, then applies the placement: look until the
# masks settle (bounded; the assertion is on the masks, not the time).
for _ in range(200):
    m = masks()
    want = cpus if "all" in (kw.get("cpus"), os.environ.get("KVLANE_CPUS")) else [cpus[0]]
    if m and all(v == want for v in m.values()):
        break
    time.sleep(0.02)
print(json.dumps({"process": cpus, "threads": m}))
a.close(); b.close()
"""


def placed(kw: dict, env: dict = None) -> dict:
    e = dict(os.environ)
    e.pop("KVLANE_CPUS", None)
    e.update(env or {})
    out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw)], env=e,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def kinds(threads: dict) -> set:
    return {name.split("/")[0] for name in threads}


def test_all_widens_every_kvlane_thread_past_a_pinned_builder():
    r = placed({"cpus": "all"})
    assert {"kvlane-py", "kvlane-progress", "kvlane-tcp-io-0", "kvlane-tcp-init"} <= kinds(r["threads"])
    for name, mask in r["threads"].items():
        assert mask == r["process"], name


def test_inherit_keeps_the_builders_core_and_the_env_var_decides_without_the_keyword():
    r = placed({})
    assert r["threads"]
    for name, mask in r["threads"].items():
        assert mask == [r["process"][0]], name
    r = placed({}, {"KVLANE_CPUS": "all"})
    for name, mask in r["threads"].items():
        assert mask == r["process"], name


@pytest.mark.parametrize("bad", ["bogus", "3-1", "0,,x", "99999"])
def test_a_bad_value_is_refused_naming_it(bad):
    with pytest.raises(kvlane.InvalidInputError, match=bad):
        kvlane.Agent(backend="tcp", cpus=bad)
