"""vLLM's tiered KV offloading on the CPU platform:
``kvlane.vllm.CpuTieringOffloadingSpec``.

vLLM 0.32's ``TieringOffloadingSpec`` (the OffloadingConnector spec that
carries ``secondary_tiers``, the P2P tier among them) builds its worker
from ``CPUOffloadingSpec.get_worker``, which refuses every platform but
CUDA-alike and XPU ("CPU Offloading is currently only supported on
CUDA-alike and XPU GPUs"): its copies are CUDA streams and events. On the
CPU platform the KV cache is host memory and the tier's region is the same
``/dev/shm`` file the scheduler maps (``SharedOffloadRegion``), so a copy
is a ``memmove`` per (block, layer) piece, done when it is submitted. This
spec is ``TieringOffloadingSpec`` with that worker; the scheduler side
(primary tier, secondary tiers, the region) is vLLM's, unchanged::

    "kv_connector_extra_config": {
        "spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "kvlane.vllm",
        "cpu_bytes_to_use": 1 << 30,
        "secondary_tiers": [{"type": "KvlaneP2PTier", "module_path": "kvlane.vllm",
                             "host": "127.0.0.1", "port": 5710}]}

On a GPU, vLLM's own ``TieringOffloadingSpec`` is the one to use (only the
tier entry names kvlane). ``canonical_layout`` is not supported here.
"""

from __future__ import annotations

import ctypes
import time
from typing import List, Optional, Tuple

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

_memmove = ctypes.memmove  # a foreign call: releases the GIL while it copies


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` whose worker copies with ``memmove``
    (the CPU platform; see the module's doc). Configured exactly as
    ``TieringOffloadingSpec`` is, plus ``spec_module_path: "kvlane.vllm"``."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> "CpuOffloadingWorker":  # type: ignore[override]
        if self.config.canonical_layout:
            raise ValueError(
                "kvlane.vllm.CpuTieringOffloadingSpec: canonical_layout is not supported; "
                "remove it from kv_connector_extra_config"
            )
        if self.num_chunks <= 0:
            raise ValueError(
                "kvlane.vllm.CpuTieringOffloadingSpec: cpu_bytes_to_use "
                f"{self.extra_config.get('cpu_bytes_to_use')} holds no chunk of "
                f"{self.kv_bytes_per_chunk} bytes"
            )
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CpuOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except BaseException:
            region.cleanup()
            raise


class CpuOffloadingWorker(OffloadingWorker):
    """Copies between the KV cache (host memory on the CPU platform) and
    this worker's slots of the tier's shared region, one ``memmove`` per
    (block, layer) piece, synchronously: a submitted job is finished when
    ``submit_*`` returns, and ``get_finished`` reports it once.

    Layout, as vLLM's CUDA worker has it: KV tensor ``t`` is ``(num_blocks,
    page)`` bytes; its region view is ``(num_chunks, page *
    blocks_per_chunk)``, sub-block ``j`` of a chunk at ``j * page``; a
    layer's piece is its unpadded page size (``CanonicalKVCacheRef``)."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 region: SharedOffloadRegion) -> None:
        if not kv_caches.tensors:
            raise ValueError("kvlane.vllm.CpuTieringOffloadingSpec: no KV cache tensors")
        self._region: Optional[SharedOffloadRegion] = region
        self._per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._kv: List[torch.Tensor] = []
        self._tier: List[torch.Tensor] = []
        for t in kv_caches.tensors:
            if t.tensor.device.type != "cpu":
                raise ValueError(
                    "kvlane.vllm.CpuTieringOffloadingSpec copies host memory; the KV cache "
                    f"is on {t.tensor.device} (use vLLM's TieringOffloadingSpec on a GPU)"
                )
            kv = t.tensor.view(torch.int8).view(-1, t.page_size_bytes)
            self._kv.append(kv)
            self._tier.append(region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk))
        self._finished: List[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        """KV cache -> tier region."""
        return self._copy(job_id, src_spec, dst_spec, to_tier=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        """Tier region -> KV cache."""
        return self._copy(job_id, dst_spec, src_spec, to_tier=False)

    def get_finished(self) -> List[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set) -> None:
        return  # every job is finished when it is submitted

    def shutdown(self) -> None:
        self._kv.clear()
        self._tier.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None

    # -- internal ----------------------------------------------------------

    def _copy(self, job_id: int, kv_spec: LoadStoreSpec, tier_spec: LoadStoreSpec,
              to_tier: bool) -> bool:
        if not isinstance(kv_spec, GPULoadStoreSpec) or not isinstance(
                tier_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"kvlane.vllm.CpuTieringOffloadingSpec: job {job_id} has specs "
                            f"{type(kv_spec).__name__}, {type(tier_spec).__name__}")
        t0 = time.perf_counter()
        nbytes = 0
        for kv_ptrs, tier_ptrs, size in self._pieces(kv_spec, tier_spec):
            src, dst = (kv_ptrs, tier_ptrs) if to_tier else (tier_ptrs, kv_ptrs)
            for s, d in zip(src.tolist(), dst.tolist()):
                _memmove(d, s, size)
            nbytes += size * len(src)
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes,
                                             transfer_time=time.perf_counter() - t0))
        return True

    def _pieces(self, kv_spec: GPULoadStoreSpec,
                tier_spec: BlockIDsLoadStoreSpec) -> List[Tuple[np.ndarray, np.ndarray, int]]:
        """``(kv addresses, tier addresses, bytes)`` per (group, layer).

        ``kv_spec`` lists KV blocks group after group (``group_sizes``);
        group ``g``'s first block is block ``block_indices[g]`` of the
        request, so it sits at sub-block ``block_indices[g] % per_chunk``
        of the first of the group's chunks in ``tier_spec``."""
        if len(kv_spec.group_sizes) != len(self._refs):
            raise ValueError(f"kvlane.vllm.CpuTieringOffloadingSpec: {len(kv_spec.group_sizes)} "
                             f"groups in a job, {len(self._refs)} KV cache groups")
        kv_blocks = kv_spec.block_ids.astype(np.int64)
        chunks = tier_spec.block_ids.astype(np.int64)
        out: List[Tuple[np.ndarray, np.ndarray, int]] = []
        b = c = 0  # the group's first KV block and first chunk in the specs
        for refs, n, first in zip(self._refs, kv_spec.group_sizes, kv_spec.block_indices):
            if n == 0:
                continue
            skip = first % self._per_chunk
            nchunks = cdiv(skip + n, self._per_chunk)
            sub = np.arange(skip, skip + n, dtype=np.int64)  # sub-blocks of the group's chunks
            group_chunks = chunks[c:c + nchunks][sub // self._per_chunk]
            if len(group_chunks) != n:
                raise ValueError(f"kvlane.vllm.CpuTieringOffloadingSpec: {n} KV blocks need "
                                 f"{nchunks} chunks, the job has {len(chunks) - c}")
            for ref in refs:
                kv, tier = self._kv[ref.tensor_idx], self._tier[ref.tensor_idx]
                kv_ptrs = kv.data_ptr() + kv_blocks[b:b + n] * kv.stride(0)
                tier_ptrs = (tier.data_ptr() + group_chunks * tier.stride(0)
                             + (sub % self._per_chunk) * kv.shape[1])
                out.append((kv_ptrs, tier_ptrs, ref.page_size_bytes))
            b += n
            c += nchunks
        if b != len(kv_blocks) or c != len(chunks):
            raise ValueError(f"kvlane.vllm.CpuTieringOffloadingSpec: a job of {len(kv_blocks)} "
                             f"KV blocks and {len(chunks)} chunks used {b} and {c}")
        return out
