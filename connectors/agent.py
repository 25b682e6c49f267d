"""The agent API: vLLM V0's KV-transfer agent contract over kvstore.

``KVStoreAgent(config)`` is called by a model runner around each model step:

* ``recv_kv_caches_and_hidden_states(model_executable, model_input, kv_caches)`` before the
  model, for batches with prefills. For every prefill sequence it loads the longest stored
  prefix of its prompt into the sequence's slots. Returns ``(hidden, bypass, model_input)``:

  - every sequence's whole prompt loaded, its last hidden state known, no decode tokens in the
    batch: ``(hidden states [num_tokens, ...], True, model_input)``: skip the model. Only each
    sequence's last-token row is meaningful (the rows the sampler reads); the others are zero.
  - some prefix loaded: ``(None, False, rebuilt)``: ``rebuilt`` schedules only the tokens not
    loaded (positions, slot mapping, query_start_loc, context lengths, token counts updated;
    at least the last prompt token is always computed so its hidden state exists);
  - nothing loaded: ``(None, False, model_input)`` unchanged.

* ``send_kv_caches_and_hidden_states(model_executable, model_input, kv_caches, hidden)`` after
  the model: for every prefill sequence, stores the chunks not yet stored, each with the
  hidden state of its last token when this step computed it (a bypassed step computed
  nothing and stores nothing). The store is always a
  ``TieredStore``: local tiers are written synchronously, remote ones in the background.

Inputs are duck-typed like vLLM V0's GPU model runner: ``model_input.input_tokens`` and
``input_positions`` (flattened, prefills first), ``model_input.attn_metadata`` with
``num_prefills``, ``num_prefill_tokens``, ``num_decode_tokens``, ``seq_lens``, ``slot_mapping``
and, when present, ``query_start_loc`` and ``context_lens_tensor``; ``kv_caches`` this rank's
per-layer paged caches; ``model_executable.model.start_layer/end_layer`` (pipeline stage).
A prefill sequence with cached context (``context_lens_tensor[i] > 0``) is skipped: the V0
batch does not carry its earlier tokens, so its keys cannot be computed.

The agent never raises a storage error: an outage or a bad record is a miss.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from kvstore.paged import KVTransfer
    from kvstore.stores.base import Store

log = logging.getLogger(__name__)

_ROLES = {"producer": "producer", "kv_producer": "producer", "consumer": "consumer",
          "kv_consumer": "consumer", "both": "both", "kv_both": "both"}


@dataclass(frozen=True)
class AgentConfig:
    """What an agent needs; ``from_mapping`` builds one from a dict (e.g. vLLM's
    ``kv_connector_extra_config``) and names every missing or invalid field.

    ``store``: a URL or a list of URLs, fastest tier first. ``model`` and ``model_fingerprint``
    identify the weights (a revision or a hash of config and weights): KV is shared only
    between equal identities. ``kv_layout``: a ``kvstore.paged`` layout name; inferred for
    5-d (``flash-2bnhd``) and 3-d (``mla-bnl``) caches, required for 4-d ones (vLLM's GPU view
    ``vllm-bhnc`` and its CPU pages ``vllm-cpu-vec`` have the same shape).
    """

    store: tuple[str, ...]
    model: str
    model_fingerprint: str
    chunk_tokens: int = 256
    role: Literal["producer", "consumer", "both"] = "both"
    rank: int = 0
    tp_size: int = 1
    local_rank: int = 0
    codec: str = "raw"
    kv_layout: str | None = None
    adapter: str = ""
    cache_salt: str = ""
    store_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [n for n in ("store", "model", "model_fingerprint") if not getattr(self, n)]
        if missing:
            raise ConfigError(
                "the kvstore agent needs " + ", ".join(missing)
                + " (store: a URL or list of URLs such as 'file:///tmp/kv' or 'redis://host:6379'; "
                  "model and model_fingerprint: the model's name and a hash of its weights/config)")
        if isinstance(self.store, str):
            object.__setattr__(self, "store", (self.store,))
        object.__setattr__(self, "store", tuple(self.store))
        role = _ROLES.get(str(self.role))
        if role is None:
            raise ConfigError(f"role={self.role!r}; accepted: producer, consumer, both (or kv_producer, kv_consumer, kv_both)")
        object.__setattr__(self, "role", role)
        for name in ("chunk_tokens", "tp_size"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if type(self.rank) is not int or not 0 <= self.rank < self.tp_size:
            raise ConfigError(f"rank={self.rank!r} must be an integer in [0, tp_size={self.tp_size})")
        if self.kv_layout is not None:
            from kvstore.paged import LAYOUTS

            if self.kv_layout not in LAYOUTS:
                raise ConfigError(f"kv_layout={self.kv_layout!r}; accepted: {', '.join(LAYOUTS)}")

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> "AgentConfig":
        """Build from a dict, rejecting unknown keys by name."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown kvstore agent option(s) {', '.join(unknown)}; accepted: {', '.join(sorted(known))}")
        return cls(**{"store": (), "model": "", "model_fingerprint": "", **options})

    def __repr__(self) -> str:
        # Store URLs may carry a password (redis://:pw@host): never print it.
        from kvstore.config import redact_url

        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        shown["store"] = tuple(redact_url(u) for u in self.store)
        return f"AgentConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @property
    def is_producer(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.role in ("consumer", "both")


@dataclass
class _PrefillSeq:
    """One prefill sequence of a batch, as the agent sees it."""

    index: int            # position among the batch's sequences
    q_start: int          # its scheduled tokens in the flattened batch: [q_start, q_end)
    q_end: int
    context: int          # tokens already in the cache before this step
    tokens: Any = None    # the whole prompt (context 0 only), torch int64
    slots: Any = None     # one slot per prompt token


@dataclass
class AgentStats:
    """Counters of what the agent did (cumulative)."""

    recv_calls: int = 0
    bypasses: int = 0
    tokens_loaded: int = 0
    tokens_requested: int = 0
    chunks_saved: int = 0


class KVStoreAgent:
    """vLLM V0's KV-transfer agent API over kvstore (see the module docstring for semantics)."""

    def __init__(self, config: AgentConfig | Mapping[str, Any], *, store: "Store | None" = None) -> None:
        self.config = config if isinstance(config, AgentConfig) else AgentConfig.from_mapping(config)
        if store is None:
            from kvstore.stores.tiered import TieredStore

            store = TieredStore.from_urls(list(self.config.store), **dict(self.config.store_options))
        self.store = store
        self.stats = AgentStats()
        self._transfers: dict[tuple, "KVTransfer"] = {}
        self._rebuilt: tuple[Any, list[_PrefillSeq], list[int]] | None = None
        self._bypassed: Any = None  # the model_input of the last step recv told to bypass
        self._closed = False

    # -- setup ----------------------------------------------------------------------------
    def namespace(self, kv_caches: Sequence["torch.Tensor"], start_layer: int, layout_name: str, block_size: int):
        from kvstore.keys import Namespace
        from kvstore.paged import dtype_name

        c = self.config
        return Namespace(
            model=c.model, model_fingerprint=c.model_fingerprint, kv_dtype=dtype_name(kv_caches[0].dtype),
            layout=layout_name, block_size=block_size, chunk_tokens=c.chunk_tokens,
            layer_start=start_layer, layer_end=start_layer + len(kv_caches), tp_rank=c.rank, tp_size=c.tp_size,
            adapter=c.adapter, cache_salt=c.cache_salt,
        )

    def _layout(self, cache: "torch.Tensor"):
        from kvstore.paged import get_layout

        if self.config.kv_layout:
            return get_layout(self.config.kv_layout)
        if cache.dim() == 5 and cache.shape[0] == 2:
            return get_layout("flash-2bnhd")
        if cache.dim() == 3:
            return get_layout("mla-bnl")
        raise ConfigError(f"cannot tell the layout of a KV cache of shape {list(cache.shape)}; "
                          "set kv_layout (e.g. 'vllm-bhnc' for vLLM's GPU view, 'vllm-cpu-vec' for its CPU pages)")

    def transfer(self, model_executable: Any, kv_caches: Sequence["torch.Tensor"]) -> "KVTransfer":
        """The ``KVTransfer`` for this rank's layers (built once per set of caches)."""
        from kvstore.paged import KVTransfer
        from kvstore.prefix_cache import PrefixCache

        model = getattr(model_executable, "model", model_executable)
        start = int(getattr(model, "start_layer", 0) or 0)
        end = int(getattr(model, "end_layer", start + len(kv_caches)))
        if end - start != len(kv_caches):
            raise ConfigError(f"model layers [{start}, {end}) but {len(kv_caches)} KV caches were given")
        first = kv_caches[0]
        key = (start, end, first.data_ptr(), tuple(first.shape), first.dtype, len(kv_caches))
        xfer = self._transfers.get(key)
        if xfer is None:
            layout = self._layout(first)
            ns = self.namespace(kv_caches, start, layout.name, layout.block_size(first))
            xfer = KVTransfer(PrefixCache(self.store, ns, codec=self.config.codec), kv_caches, layout)
            self._transfers[key] = xfer
        return xfer

    # -- the batch, per sequence ------------------------------------------------------------
    @staticmethod
    def _prefills(model_input: Any) -> list[_PrefillSeq]:
        import torch

        md = model_input.attn_metadata
        n = int(md.num_prefills)
        seq_lens = [int(x) for x in md.seq_lens]
        qsl = getattr(md, "query_start_loc", None)
        if qsl is not None:
            qsl = [int(x) for x in qsl.tolist()]
        else:  # V0 without prefix caching: a prefill schedules its whole sequence
            qsl = [0]
            for L in seq_lens[:n]:
                qsl.append(qsl[-1] + L)
        ctx = getattr(md, "context_lens_tensor", None)
        ctx = [int(x) for x in ctx.tolist()] if ctx is not None else [0] * n
        slot_mapping = md.slot_mapping.flatten()
        out = []
        for i in range(n):
            s = _PrefillSeq(i, qsl[i], qsl[i + 1], ctx[i])
            if s.context == 0:
                s.tokens = model_input.input_tokens[s.q_start:s.q_end].to("cpu", torch.int64)
                s.slots = slot_mapping[s.q_start:s.q_end].to(torch.int64)
            out.append(s)
        return out

    # -- recv -----------------------------------------------------------------------------
    def recv_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: Sequence["torch.Tensor"]) -> tuple[Any, bool, Any]:
        """Load stored prefixes of the batch's prefill sequences (see the module docstring)."""
        import torch

        self._rebuilt = self._bypassed = None
        md = model_input.attn_metadata
        if not self.config.is_consumer or int(md.num_prefills) == 0:
            return None, False, model_input
        self.stats.recv_calls += 1
        xfer = self.transfer(model_executable, kv_caches)
        seqs = self._prefills(model_input)
        loaded: list[int] = []
        hiddens: list[torch.Tensor | None] = []
        for s in seqs:
            n, h = (0, None)
            if s.tokens is not None:
                try:
                    n, h = xfer.load_sequence(s.tokens, s.slots)
                except Exception:  # never fail the request; a bug here must not cost more than a miss
                    log.exception("KV load failed for a sequence; computing it")
                    n, h = 0, None
                self.stats.tokens_requested += s.q_end - s.q_start
            loaded.append(n)
            hiddens.append(h)
        self.stats.tokens_loaded += sum(loaded)
        if not any(loaded):
            return None, False, model_input
        full = [s.tokens is not None and n == s.q_end - s.q_start and h is not None
                for s, n, h in zip(seqs, loaded, hiddens)]
        if int(md.num_decode_tokens) == 0 and all(full):
            first = hiddens[0]
            out = torch.zeros((model_input.input_tokens.shape[0], *first.shape), dtype=first.dtype,
                              device=kv_caches[0].device)
            for s, h in zip(seqs, hiddens):
                out[s.q_end - 1] = h.to(out.device)
            self.stats.bypasses += 1
            self._bypassed = model_input
            return out, True, model_input
        # Compute what was not loaded, and always each prompt's last token (its hidden state feeds the sampler).
        skip = [min(n, s.q_end - s.q_start - 1) if s.tokens is not None else 0 for s, n in zip(seqs, loaded)]
        rebuilt = rebuild_model_input(model_input, seqs, skip)
        self._rebuilt = (rebuilt, seqs, skip)
        return None, False, rebuilt

    # -- send -----------------------------------------------------------------------------
    def send_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: Sequence["torch.Tensor"],
                                         hidden_or_intermediate_states: Any) -> None:
        """Store the batch's prefill sequences' chunks not yet stored (see the module docstring)."""
        import torch

        rebuilt, self._rebuilt = self._rebuilt, None
        bypassed, self._bypassed = self._bypassed, None
        md = model_input.attn_metadata
        if not self.config.is_producer or int(md.num_prefills) == 0:
            return
        if bypassed is model_input:
            # Nothing was computed: every prompt was just loaded, and the hidden states handed
            # back are our own placeholders (zeros but each last row). Re-saving a chunk evicted
            # since recv would store a zero row as its hidden state.
            return
        xfer = self.transfer(model_executable, kv_caches)
        if rebuilt is not None and rebuilt[0] is model_input:
            # The runner ran our rebuilt input: the prompt tokens and slots come from the original.
            seqs, skip = rebuilt[1], rebuilt[2]
            new = self._prefills(model_input)
            for s, ns in zip(seqs, new):
                s.q_start, s.q_end = ns.q_start, ns.q_end
        else:
            seqs, skip = self._prefills(model_input), None
        hidden = hidden_or_intermediate_states if isinstance(hidden_or_intermediate_states, torch.Tensor) else None
        for i, s in enumerate(seqs):
            if s.tokens is None:
                continue
            start = skip[i] if skip is not None else 0
            rows = hidden[s.q_start:s.q_end] if hidden is not None else None
            try:
                self.stats.chunks_saved += xfer.save_sequence(s.tokens, s.slots, hidden_states=rows, start_token=start)
            except Exception:  # the cache may only make a request faster, never fail it
                log.exception("KV save failed for a sequence")

    # -- lifecycle --------------------------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until background (remote-tier) writes are done; True if they all finished."""
        flush = getattr(self.store, "flush", None)
        return bool(flush(timeout)) if flush is not None else True

    def close(self) -> None:
        """Finish pending writes (bounded) and release the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self.store.close()


def _replace(obj: Any, **changes: Any) -> Any:
    """``obj`` with ``changes`` applied to the fields it has (a copy; dataclasses via ``replace``)."""
    changes = {k: v for k, v in changes.items() if hasattr(obj, k)}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = {f.name for f in dataclasses.fields(obj) if f.init}
        new = dataclasses.replace(obj, **{k: v for k, v in changes.items() if k in names})
        for k, v in changes.items():
            if k not in names:
                object.__setattr__(new, k, v)
        return new
    new = copy.copy(obj)
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def rebuild_model_input(model_input: Any, seqs: Sequence[_PrefillSeq], skip: Sequence[int]) -> Any:
    """``model_input`` with the first ``skip[i]`` scheduled tokens of prefill sequence ``i``
    removed (they are in the cache now): tokens, positions, slot mapping, ``query_start_loc``,
    context lengths, token counts and query lengths follow; decode tokens are unchanged."""
    import torch

    md = model_input.attn_metadata
    total = int(model_input.input_tokens.shape[0])
    device = model_input.input_tokens.device
    keep = [torch.arange(s.q_start + k, s.q_end, device=device) for s, k in zip(seqs, skip)]
    num_prefill_tokens = int(md.num_prefill_tokens)
    keep.append(torch.arange(num_prefill_tokens, total, device=device))
    idx = torch.cat(keep)
    old_qsl = getattr(md, "query_start_loc", None)
    lens = [s.q_end - s.q_start - k for s, k in zip(seqs, skip)]
    if old_qsl is not None:
        old = old_qsl.tolist()
        lens += [b - a for a, b in zip(old[len(seqs):], old[len(seqs) + 1:])]
    qsl = [0]
    for L in lens:
        qsl.append(qsl[-1] + L)
    changes: dict[str, Any] = {
        "slot_mapping": md.slot_mapping.flatten()[idx.to(md.slot_mapping.device)],
        "num_prefill_tokens": sum(lens[:len(seqs)]),
        "max_query_len": max(lens) if lens else 0,
        "max_prefill_query_len": max(lens[:len(seqs)]) if seqs else 0,
    }
    if old_qsl is not None:
        changes["query_start_loc"] = torch.tensor(qsl, dtype=old_qsl.dtype, device=old_qsl.device)
    ctx = getattr(md, "context_lens_tensor", None)
    if ctx is not None:
        new_ctx = ctx.clone()
        for i, (s, k) in enumerate(zip(seqs, skip)):
            new_ctx[i] = s.context + k
        changes["context_lens_tensor"] = new_ctx
    new_md = _replace(md, **changes)
    mi_changes: dict[str, Any] = {
        "input_tokens": model_input.input_tokens[idx],
        "input_positions": model_input.input_positions[idx],
        "attn_metadata": new_md,
    }
    if getattr(model_input, "query_lens", None) is not None:
        mi_changes["query_lens"] = lens
    return _replace(model_input, **mi_changes)
