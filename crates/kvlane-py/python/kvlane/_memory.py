"""Host memory kvlane allocates for Python: shareable by default (what
``backend="auto"`` passes to peers on this host), or laid out as the Rust
side's ``Region::alloc``."""

import ctypes
import mmap

import numpy as np

from kvlane._kvlane import InvalidInputError, _SharedAlloc

#: A transparent huge page on x86-64 and most aarch64 kernels.
HUGE_PAGE = 2 << 20


def host_buffer(nbytes: int, *, shared: bool = True) -> np.ndarray:
    """``nbytes`` of zeroed host memory for a KV cache or a staging area,
    as a writable 1-D ``uint8`` array to register (zero-copy) with
    ``Agent(kv=...)`` or ``Agent(regions=...)``.

    By default (``shared=True``) the memory is a sealed memory file
    (the Rust ``Region::alloc_shared``): registered whole, it is what the
    shm backend passes to a peer on this host, so ``backend="auto"`` (the
    default) moves it over shared memory to such peers and over the
    network to the others. Only the registered memory becomes reachable.
    Its pages are allocated when it is made, not on first touch. Huge
    pages follow the kernel's setting for shared memory
    (``/sys/kernel/mm/transparent_hugepage/shmem_enabled``; with
    ``never``, the default of many distributions, 4 KiB pages). A slice
    or a read-only registration of the array is registered as plain
    memory (no shm for it).

    ``shared=False``: a private anonymous mapping that shm serves only with
    cross-memory attach (``shm_cross_memory_attach=True``), as numpy's or
    torch's own memory. From 2 MiB up it starts on a 2 MiB boundary and
    is advised to use transparent huge pages (``MADV_HUGEPAGE``), as the
    Rust ``Region::alloc`` does: fewer TLB misses for the copies a
    software transport makes, fewer translation entries for a NIC. numpy's
    own large arrays get 4 KiB pages where the kernel's THP mode is
    ``madvise``; on this project's machine that cost 0.1 of the Python
    bench's ratio to the Rust bench at 64 KiB blocks over tcp (the bench
    uses this form). Pages are faulted in on first touch.

    Either way the memory lives as long as the array (or any view of it)
    does, and as long as an agent it is registered with uses it."""
    n = int(nbytes)
    if n <= 0:
        raise InvalidInputError(f"host_buffer needs a positive size, not {nbytes!r}")
    if shared:
        owner = _SharedAlloc(n)
        raw = (ctypes.c_uint8 * n).from_address(owner.addr)
        raw._kvlane_owner = owner  # the memory lives while the array does
        return np.frombuffer(raw, dtype=np.uint8)
    pad = HUGE_PAGE if n >= HUGE_PAGE else 0
    m = mmap.mmap(-1, n + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE if pad else 0
    if pad and hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        # Advice only: where THP is off the pages stay 4 KiB.
        m.madvise(mmap.MADV_HUGEPAGE, start - start % mmap.PAGESIZE, n + start % mmap.PAGESIZE)
    return whole[start:start + n]
