"""``KVStoreConnector`` that also writes the KV bytes it saved and loaded to files, for tests that
compare what lands in each reader rank's cache with what the writer's ranks computed.

``kv_connector_module_path="tests.vllm_dump_connector"`` (``vllm_worker``'s ``connector_module``)
with ``KVSTORE_TEST_DUMP_DIR`` set: every TP rank writes, per request, the blocks of the first KV
cache group that a save covered (right after the step's forward, before the blocks can change) and
that a load filled (once the load is reported done), every layer, as they lie in the cache:
``<dir>/<save|load>-tp<size>-rank<rank>-<prefix digest>.npy``, uint8 ``[layers, blocks, heads,
block_size, bytes of 2*head_size]`` (``dump_name``). Nothing else changes.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstore.connectors.vllm.connector import KVStoreConnector as _Connector
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata, LoadSpec

__all__ = ["KVStoreConnector", "dump_name", "read_dump"]


def dump_name(kind: str, tp_size: int, rank: int, tokens: list[int]) -> str:
    digest = hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()[:16]
    return f"{kind}-tp{tp_size}-rank{rank}-{digest}.npy"


def read_dump(directory: str | Path, kind: str, tp_size: int, rank: int, tokens: list[int]) -> np.ndarray:
    return np.load(Path(directory) / dump_name(kind, tp_size, rank, tokens), allow_pickle=False)


class KVStoreConnector(_Connector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dump_dir = os.environ.get("KVSTORE_TEST_DUMP_DIR", "")
        self._dump_loads: dict[str, LoadSpec] = {}

    def _dump(self, kind: str, tokens: list[int], blocks: list[int], end: int) -> None:
        worker = self.worker
        if not self._dump_dir or worker is None or worker.transfer is None:
            return
        n = end // worker.block_size
        ids = blocks[:n]
        layers = [c[ids].contiguous().view(torch.uint8).numpy() for c in worker.transfer.kv_caches]
        path = Path(self._dump_dir) / dump_name(kind, self.facts.tp_size, worker.tp_rank, tokens[:end])
        np.save(path, np.stack(layers), allow_pickle=False)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVStoreConnectorMetadata):
            self._dump_loads.update((spec.req_id, spec) for spec in meta.loads)
        super().start_load_kv(forward_context, **kwargs)

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, KVStoreConnectorMetadata):
            for spec in meta.saves:
                top = max(spec.ends)
                self._dump("save", spec.tokens, spec.block_ids[0], top - top % self.block_size)
        super().wait_for_save()

    def _dump_loaded(self, recving: set[str] | None) -> None:
        for req_id in recving or ():
            spec = self._dump_loads.pop(req_id, None)
            if spec is not None:
                self._dump("load", spec.tokens, spec.block_ids[0], spec.end)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = super().get_finished(finished_req_ids)
        self._dump_loaded(recving)
        return sending, recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        results = super().get_transfer_results(finished_req_ids)
        self._dump_loaded(set(results.finished_recving or ()))
        return results
