import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from target import LEN, pattern  # noqa: E402


class Target:
    """The target process: `ask({"op": ...})` sends a command and returns
    its JSON answer."""

    def __init__(self, mode: str, size: int = LEN, listen: str = "127.0.0.1:0",
                 seed: int = 7) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "target.py"), mode, str(size), listen,
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
