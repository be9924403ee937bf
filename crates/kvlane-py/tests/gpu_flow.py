"""GPU memory through the Python package, run as its own process (the
GPU driver is loaded once per process, so each mode gets a fresh one).

    python gpu_flow.py absent   # no driver: clear UnsupportedError
    python gpu_flow.py mock     # KVLANE_CUDA_LIBRARY = the MOCK driver
    python gpu_flow.py mock-rocm  # KVLANE_HIP_LIBRARY = the MOCK HIP runtime, no CUDA
    python gpu_flow.py torch    # a real GPU, torch CUDA tensors (ci/gpu.sh)
    python gpu_flow.py cupy     # a real GPU, a CuPy array (needs CuPy)

``mock`` and ``torch`` end with a two-process run: this process WRITEs
GPU memory into GPU memory of a child process (``target-mock`` /
``target-torch``) over tcp; the child checks the bytes (sha256) when the
notification arrives, which must be after they landed.

``mock`` uses the mock CUDA driver built from
crates/kvlane-data/testdata/mock_cuda.c (host memory behind the driver
API): it checks registration through ``__cuda_array_interface__`` and the
staged tcp path, not a GPU. ``mock-rocm`` runs the same flow against the
mock HIP runtime (mock_hip.c) on a machine without CUDA, as an AMD host
is: ``__cuda_array_interface__`` (which ROCm builds of torch and CuPy
speak) and NIXL's ``(addr, len, gpu_id)`` rows become ``rocm:0`` memory. Every mode prints ``ok <mode>`` at the end and
exits non-zero on any failure.
"""

import ctypes
import hashlib
import json
import os
import subprocess
import sys
import time

import kvlane
import kvlane.nixl as nixl

N = (3 << 20) + 17  # several 2 MiB staging chunks


class FakeCudaArray:
    """Exposes ``__cuda_array_interface__`` (v3) for ``n`` bytes at ``ptr``."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None,
        }


def expect(exc, match, f):
    try:
        f()
    except exc as e:
        assert all(m in str(e) for m in match), f"{e!r} lacks {match}"
        return
    raise AssertionError(f"no {exc.__name__}")


def absent() -> None:
    assert os.environ["KVLANE_CUDA_LIBRARY"].startswith("/nonexistent")
    msg = ["cuda:0", "unsupported", "no cuda driver", "KVLANE_CUDA_LIBRARY"]
    expect(kvlane.UnsupportedError, msg,
           lambda: kvlane.Memory.unsafe_from_ptr(0x7F0000000000, 4096, "cuda:0"))
    expect(kvlane.UnsupportedError, ["no cuda driver"],
           lambda: kvlane.Memory(FakeCudaArray(0x7F0000000000, 4096)))
    a = nixl.nixl_agent("a", nixl.nixl_agent_config(backend="tcp"))
    expect(kvlane.UnsupportedError, msg,
           lambda: a.register_memory([(0x7F0000000000, 4096, 0, "")], "VRAM"))


DATA = bytes((i * 7) % 251 for i in range(N))


def mock_alloc(runtime: str = "cuda"):
    """A function returning (object, device pointer) of N bytes of mock
    "device" memory of device 0 of ``runtime`` (the mock CUDA driver or the
    mock HIP runtime) filled with given bytes, and one reading them back."""
    if runtime == "cuda":
        lib = ctypes.CDLL(os.environ["KVLANE_CUDA_LIBRARY"])
        ctx = ctypes.c_void_p()
        assert lib.cuInit(0) == 0
        assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) == 0
        assert lib.cuCtxSetCurrent(ctx) == 0
        malloc = lib.cuMemAlloc_v2
    else:
        lib = ctypes.CDLL(os.environ["KVLANE_HIP_LIBRARY"])
        assert lib.hipInit(0) == 0
        assert lib.hipSetDevice(0) == 0
        malloc = lib.hipMalloc

    def alloc(data: bytes):
        p = ctypes.c_uint64()
        assert malloc(ctypes.byref(p), ctypes.c_size_t(N)) == 0
        ctypes.memmove(p.value, data, N)  # mock "device" memory is host memory
        return FakeCudaArray(p.value, N), p.value

    return alloc, lambda obj, p: ctypes.string_at(p, N)


ALLOCATORS = {
    "mock": lambda: mock_alloc("cuda"),
    "mock-rocm": lambda: mock_alloc("rocm"),
    "torch": lambda: torch_alloc(),
}


def torch_alloc():
    import torch

    assert torch.cuda.is_available(), "torch sees no GPU"
    dev = os.environ.get("KVLANE_TEST_GPU", "cuda:0")

    def alloc(data: bytes):
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
        torch.cuda.synchronize()
        return t, t.data_ptr()

    return alloc, lambda t, p: bytes(t.cpu().numpy())


def target(kind: str) -> None:
    """The child of `two_processes`: serves GPU memory, checks what lands."""
    alloc, read = ALLOCATORS[kind]()
    obj, ptr = alloc(bytes(N))
    with kvlane.Agent(engine_id="gpu-target", backend="tcp", regions=[kvlane.Memory(obj)]) as t:
        notes = t.notifications()
        print(json.dumps({"addr": t.addr, "ptr": ptr}), flush=True)
        note = notes.recv(60)
        assert note is not None, "no notification"
        print(json.dumps({"sha": hashlib.sha256(read(obj, ptr)).hexdigest()}), flush=True)


def two_processes(kind: str) -> None:
    alloc, _ = ALLOCATORS[kind]()
    obj, ptr = alloc(DATA)
    child = subprocess.Popen([sys.executable, __file__, f"target-{kind}"],
                             stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline())
        with kvlane.Agent(engine_id="gpu-init", backend="tcp", regions=[kvlane.Memory(obj)]) as a:
            peer = a.connect(info["addr"])
            assert peer.write_spans([(ptr, N)], [(info["ptr"], N)], notify=b"done").wait(60)
            got = json.loads(child.stdout.readline())
        assert got["sha"] == hashlib.sha256(DATA).hexdigest(), "bytes in the target's GPU differ"
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def mock(runtime: str = "cuda") -> None:
    kind = "mock" if runtime == "cuda" else "mock-rocm"
    dev = f"{runtime}:0"
    alloc, _ = ALLOCATORS[kind]()
    data = DATA
    (_, src_p), (_, dst_p) = alloc(data), alloc(bytes(N))
    src, dst = FakeCudaArray(src_p, N), FakeCudaArray(dst_p, N)
    m = kvlane.Memory(src)
    assert m.device == dev and m.nbytes == N and m.addr == src_p, m
    # Host memory is never taken as GPU memory.
    host = bytearray(4096)
    addr = ctypes.addressof((ctypes.c_char * 4096).from_buffer(host))
    expect(kvlane.InvalidInputError, [f"not memory of {dev}"],
           lambda: kvlane.Memory.unsafe_from_ptr(addr, 4096, dev))
    bad = FakeCudaArray(src_p, N)
    bad.__cuda_array_interface__["strides"] = (2,)
    expect(kvlane.InvalidInputError, ["C-contiguous"], lambda: kvlane.Memory(bad))

    # Native API: WRITE from GPU to GPU over tcp, notification after data.
    with kvlane.Agent(engine_id="t", backend="tcp", regions=[dst]) as t, \
         kvlane.Agent(engine_id="i", backend="tcp", regions=[m]) as i:
        notes = t.notifications()
        peer = i.connect(t.addr)
        assert peer.write_spans([(src_p, N)], [(dst_p, N)], notify=b"w").wait(30)
        note = notes.recv(10)
        assert note is not None and note.payload == b"w"
        assert ctypes.string_at(dst_p, N) == data, "GPU -> GPU bytes differ"

    # kvlane.nixl: VRAM rows (addr, len, gpu) on both sides, READ back.
    ctypes.memset(src_p, 0, N)
    tgt = nixl.nixl_agent("tgt", nixl.nixl_agent_config(backend="tcp"))
    tgt.register_memory([(dst_p, N, 0, "")], "VRAM")
    ini = nixl.nixl_agent("ini", nixl.nixl_agent_config(backend="tcp"))
    ini.register_memory([src], "VRAM")
    name = ini.add_remote_agent(tgt.get_agent_metadata())
    h = ini.initialize_xfer("READ", ini.get_xfer_descs([(src_p, N, 0)], "VRAM"),
                            ini.get_xfer_descs([(dst_p, N, 0)], "VRAM"), name, b"r")
    assert ini.transfer(h) in ("PROC", "DONE")
    end = time.monotonic() + 30
    while (state := ini.check_xfer_state(h)) == "PROC" and time.monotonic() < end:
        time.sleep(0.01)
    assert state == "DONE", state
    assert ctypes.string_at(src_p, N) == data, "GPU <- GPU bytes differ"
    ini.close()
    tgt.close()
    two_processes(kind)


def torch_flow() -> None:
    import torch

    assert torch.cuda.is_available(), "torch sees no GPU"
    dev = os.environ.get("KVLANE_TEST_GPU", "cuda:0")
    src = torch.frombuffer(bytearray(DATA), dtype=torch.uint8).to(dev)
    dst = torch.zeros(N, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize()
    m = kvlane.Memory(src)
    assert m.device == dev, m
    with kvlane.Agent(engine_id="t", backend="tcp", regions=[dst]) as t, \
         kvlane.Agent(engine_id="i", backend="tcp", regions=[m]) as i:
        notes = t.notifications()
        peer = i.connect(t.addr)
        assert peer.write_spans([(src.data_ptr(), N)], [(dst.data_ptr(), N)], notify=b"w").wait(30)
        assert notes.recv(10) is not None
        assert torch.equal(src, dst), "GPU -> GPU bytes differ"
    # kvlane.nixl with torch tensors as VRAM.
    dst.zero_()
    torch.cuda.synchronize()
    tgt = nixl.nixl_agent("tgt", nixl.nixl_agent_config(backend="tcp"))
    tgt.register_memory([dst], "VRAM")
    ini = nixl.nixl_agent("ini", nixl.nixl_agent_config(backend="tcp"))
    ini.register_memory([src], "VRAM")
    name = ini.add_remote_agent(tgt.get_agent_metadata())
    h = ini.initialize_xfer("WRITE", ini.get_xfer_descs([src], "VRAM"),
                            ini.get_xfer_descs([dst], "VRAM"), name, b"n")
    ini.transfer(h)
    end = time.monotonic() + 30
    while (state := ini.check_xfer_state(h)) == "PROC" and time.monotonic() < end:
        time.sleep(0.01)
    assert state == "DONE", state
    assert torch.equal(src, dst), "nixl VRAM WRITE bytes differ"
    ini.close()
    tgt.close()
    two_processes("torch")


def cupy_flow() -> None:
    """A CuPy array registers as memory of its GPU. Run only where CuPy is
    installed (test_gpu.py skips with the reason otherwise); without it
    this mode fails, it does not pass quietly."""
    import cupy

    dev = os.environ.get("KVLANE_TEST_GPU", "cuda:0")
    c = cupy.zeros(4096, dtype=cupy.uint8)
    m = kvlane.Memory(c)
    assert m.device == dev, m


if __name__ == "__main__":
    mode = sys.argv[1]
    {
        "absent": absent, "mock": mock, "mock-rocm": lambda: mock("rocm"), "torch": torch_flow, "cupy": cupy_flow,
        "target-mock": lambda: target("mock"), "target-mock-rocm": lambda: target("mock-rocm"),
        "target-torch": lambda: target("torch"),
    }[mode]()
    print(f"ok {mode}")
