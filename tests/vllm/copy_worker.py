"""The one replaced part of vLLM in these tests: the copy worker of the CPU tier.

vLLM's ``TieringOffloadingSpec`` moves KV blocks between the engine's KV cache and its
CPU tier (the shared offload region) with CUDA/XPU streams, and refuses to build its
worker on any other platform. On a machine without a GPU the engine's KV cache lives in
host memory, so this spec subclass overrides ``get_worker`` alone: it maps the same
shared offload region the real worker maps (``SharedOffloadRegion``, the same strided
per-tensor views) and copies rows with torch on the CPU, one offloaded block per KV block.
Everything else -- the scheduler, the KV cache manager, the ``OffloadingConnector``, the
tiering manager, the CPU primary tier and vLLM's own kvcr adapter -- runs as shipped.

Select it through ``kv_connector_extra_config``: ``"spec_name": "CpuCopyTieringSpec"``,
``"spec_module_path": "copy_worker"`` (this directory on ``PYTHONPATH``).
"""

from __future__ import annotations

import time

import numpy as np
import torch
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


class CpuCopyWorker(OffloadingWorker):
    """Copies whole KV pages between the engine's KV tensors and the offload region.

    The copy is done at submission (the engine's tensors live in host memory), so a job
    is finished by the next ``get_finished``: the same order of calls the real worker's
    CUDA events give the connector, without the streams.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        if blocks_per_chunk != 1:
            raise ValueError(
                f"CpuCopyWorker: one offloaded block per KV block only, got {blocks_per_chunk}"
                " (leave the connector's block_size at the KV cache's)"
            )
        self._region = region
        # The engine's tensors as (num_blocks, page bytes) int8 rows, exactly as the real
        # worker views them; the region's views are (num_chunks, page bytes) with the
        # region's row stride (every tensor of a chunk side by side in one row).
        self._engine = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self._offload = [
            region.create_next_worker_view(t.page_size_bytes) for t in kv_caches.tensors
        ]
        self._tensors_of_group = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []

    def _copy(
        self, job_id: int, engine: GPULoadStoreSpec, offload: LoadStoreSpec, store: bool
    ) -> bool:
        assert isinstance(offload, BlockIDsLoadStoreSpec)
        started = time.perf_counter()
        engine_ids = torch.from_numpy(engine.block_ids.astype(np.int64))
        offload_ids = torch.from_numpy(offload.block_ids.astype(np.int64))
        if len(engine_ids) != len(offload_ids):
            raise ValueError(
                f"CpuCopyWorker: job {job_id} pairs {len(engine_ids)} KV blocks with "
                f"{len(offload_ids)} offloaded blocks"
            )
        copied = 0
        start = 0
        for size, tensors in zip(engine.group_sizes, self._tensors_of_group):
            rows = slice(start, start + size)
            for t in tensors:
                if store:
                    self._offload[t][offload_ids[rows]] = self._engine[t][engine_ids[rows]]
                else:
                    self._engine[t][engine_ids[rows]] = self._offload[t][offload_ids[rows]]
                copied += size * self._engine[t].shape[1]
            start += size
        self._finished.append(TransferResult(job_id, True, copied, time.perf_counter() - started))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        return None  # every job finished at submission

    def shutdown(self) -> None:
        self._engine.clear()
        self._offload.clear()
        self._region.cleanup()


class CpuCopyTieringSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with :class:`CpuCopyWorker` as its worker (see the header)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            # The region exactly as TieringOffloadingSpec.create_worker maps it.
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = CpuCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._worker
