"""Host memory laid out as the Rust side allocates it (`Region::alloc`)."""

import mmap

import numpy as np

from kvlane._kvlane import InvalidInputError

#: A transparent huge page on x86-64 and most aarch64 kernels.
HUGE_PAGE = 2 << 20


def host_buffer(nbytes: int) -> np.ndarray:
    """``nbytes`` of zeroed host memory for a KV cache or a staging area,
    as a writable 1-D ``uint8`` array to register (zero-copy) with
    ``Agent(kv=...)`` or ``Agent(regions=...)``.

    The memory is a private anonymous mapping. From 2 MiB up it starts on
    a 2 MiB boundary and is advised to use transparent huge pages
    (``MADV_HUGEPAGE``), as the Rust ``Region::alloc`` does: fewer TLB
    misses for the copies a software transport makes, fewer translation
    entries for a NIC. numpy's own large arrays get 4 KiB pages where the
    kernel's THP mode is ``madvise`` (the default of many distributions);
    on this project's machine that cost 0.1 of the Python bench's ratio to
    the Rust bench at 64 KiB blocks. Pages are faulted in on first touch.
    The mapping lives as long as the array (or any view of it) does."""
    n = int(nbytes)
    if n <= 0:
        raise InvalidInputError(f"host_buffer needs a positive size, not {nbytes!r}")
    pad = HUGE_PAGE if n >= HUGE_PAGE else 0
    m = mmap.mmap(-1, n + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = np.frombuffer(m, dtype=np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE if pad else 0
    if pad and hasattr(m, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        # Advice only: where THP is off the pages stay 4 KiB.
        m.madvise(mmap.MADV_HUGEPAGE, start - start % mmap.PAGESIZE, n + start % mmap.PAGESIZE)
    return whole[start:start + n]
