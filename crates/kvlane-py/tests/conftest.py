import hashlib
import json
import os
import subprocess
import sys
from typing import Optional, Sequence

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from target import LEN, pattern  # noqa: E402


class Target:
    """The target process: `ask({"op": ...})` sends a command and returns
    its JSON answer."""

    def __init__(self, mode: str, size: int = LEN, listen: str = "127.0.0.1:0",
                 seed: int = 7, prefix: Sequence[str] = ()) -> None:
        # `prefix` runs it elsewhere (`ip netns exec HOST`: another host).
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, os.path.join(HERE, "target.py"), mode, str(size), listen,
             str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.info = json.loads(self.proc.stdout.readline())

    def ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"target exited with {self.proc.wait()}"
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "quit"})
            except (AssertionError, BrokenPipeError):
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_flow(cmd: Sequence[str], env: Optional[dict] = None, timeout: float = 120) -> dict:
    """Runs a flow script (flow.py, native_flow.py) to its end and returns
    the outcomes it printed on its last ``FLOW`` line."""
    p = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                       env=None if env is None else {**os.environ, **env})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("FLOW ")]
    assert lines, f"{' '.join(cmd)} failed (rc {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return json.loads(lines[-1][5:])


def require_nixl() -> None:
    """Skips without the real NIXL, or fails where ci/test-python.sh
    installed it (``KVLANE_REQUIRE_NIXL=1``)."""
    import importlib.util

    if importlib.util.find_spec("nixl_cu12") is None:
        if os.environ.get("KVLANE_REQUIRE_NIXL") == "1":
            pytest.fail("nixl_cu12 is not installed (pip install --no-deps nixl-cu12)")
        pytest.skip("the real NIXL (pip install --no-deps nixl-cu12) is not installed")


def expected_sha(buf: np.ndarray) -> str:
    return hashlib.sha256(memoryview(buf)).hexdigest()


@pytest.fixture
def native_target():
    t = Target("native")
    yield t
    t.close()


@pytest.fixture
def nixl_target():
    t = Target("nixl")
    yield t
    t.close()


@pytest.fixture
def make_target():
    made = []

    def make(mode: str, size: int = LEN, listen: str = "127.0.0.1:0", seed: int = 7) -> Target:
        made.append(Target(mode, size, listen, seed))
        return made[-1]

    yield make
    for t in made:
        t.close()


__all__ = ["LEN", "Target", "expected_sha", "pattern"]
