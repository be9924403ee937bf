"""GPU memory through the Python package. ``absent`` and ``mock`` run
everywhere (``mock`` against the MOCK CUDA driver, compiled with cc from
crates/kvlane-data/testdata/mock_cuda.c: host memory, not a GPU); the
torch test needs a GPU, is skipped unless ``KVLANE_TEST_GPU`` is set, and
then fails loudly without one (ci/gpu.sh sets it)."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MOCK_SRC = os.path.join(HERE, "..", "..", "kvlane-data", "testdata", "mock_cuda.c")


def flow(mode: str, env: dict) -> None:
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "gpu_flow.py"), mode],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0 and f"ok {mode}" in r.stdout, r.stdout + r.stderr


def test_vram_without_a_driver_is_unsupported_naming_the_device():
    flow("absent", {"KVLANE_CUDA_LIBRARY": "/nonexistent/libcuda.so.1"})


def test_cuda_array_interface_and_vram_over_tcp_with_the_mock_driver(tmp_path):
    cc = os.environ.get("CC", "cc")
    assert shutil.which(cc), "the mock CUDA driver needs a C compiler (cc)"
    lib = tmp_path / "libcuda.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), MOCK_SRC, "-lpthread"], check=True)
    flow("mock", {"KVLANE_CUDA_LIBRARY": str(lib)})


@pytest.mark.skipif("KVLANE_TEST_GPU" not in os.environ,
                    reason="needs a GPU: KVLANE_TEST_GPU=cuda:0 (ci/gpu.sh)")
def test_torch_cuda_tensors_on_a_real_gpu():
    flow("torch", {})
