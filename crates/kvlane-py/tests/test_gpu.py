"""GPU memory through the Python package. ``absent``, ``mock`` and
``mock-rocm`` run everywhere (against the MOCK CUDA driver and the MOCK HIP
runtime, compiled with cc from crates/kvlane-data/testdata/mock_cuda.c and
mock_hip.c: host memory, not a GPU); the
torch test needs a GPU, is skipped unless ``KVLANE_TEST_GPU`` is set, and
then fails loudly without one (ci/gpu.sh sets it)."""

import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "..", "..", "kvlane-data", "testdata")


def build_mock(name: str, lib) -> None:
    cc = os.environ.get("CC", "cc")
    assert shutil.which(cc), "the mock GPU runtimes need a C compiler (cc)"
    src = os.path.join(TESTDATA, name)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(lib), src, "-lpthread"], check=True)


def flow(mode: str, env: dict) -> None:
    r = subprocess.run(
        [sys.executable, os.path.join(HERE, "gpu_flow.py"), mode],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0 and f"ok {mode}" in r.stdout, r.stdout + r.stderr


def test_vram_without_a_driver_is_unsupported_naming_the_device():
    flow("absent", {"KVLANE_CUDA_LIBRARY": "/nonexistent/libcuda.so.1"})


def test_cuda_array_interface_and_vram_over_tcp_with_the_mock_driver(tmp_path):
    lib = tmp_path / "libcuda.so.1"
    build_mock("mock_cuda.c", lib)
    flow("mock", {"KVLANE_CUDA_LIBRARY": str(lib)})


def test_rocm_memory_over_tcp_with_the_mock_hip_runtime_and_no_cuda(tmp_path):
    lib = tmp_path / "libamdhip64.so"
    build_mock("mock_hip.c", lib)
    flow("mock-rocm", {"KVLANE_HIP_LIBRARY": str(lib),
                       "KVLANE_CUDA_LIBRARY": "/nonexistent/libcuda.so.1"})


@pytest.mark.skipif("KVLANE_TEST_GPU" not in os.environ,
                    reason="needs a GPU: KVLANE_TEST_GPU=cuda:0 (ci/gpu.sh)")
def test_torch_cuda_tensors_on_a_real_gpu():
    flow("torch", {})


@pytest.mark.skipif("KVLANE_TEST_GPU" not in os.environ,
                    reason="needs a GPU: KVLANE_TEST_GPU=cuda:0 (ci/gpu.sh)")
def test_cupy_arrays_register_as_memory_of_their_gpu():
    pytest.importorskip("cupy", reason="CuPy is not installed (optional; e.g. cupy-cuda12x)")
    flow("cupy", {})
