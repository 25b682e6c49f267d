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

Stored hidden states are used only when they are what this engine's model consumes: the
agent expects ``[hidden_size]`` in the model's dtype, read from ``model_executable`` (its or
its ``.model``'s ``config.hidden_size`` and ``dtype``). A record whose hidden state differs is
a miss; when the model does not say, stored hidden states are never used (the last prompt
token is always computed).

The agent never raises a storage error: an outage or a bad record is a miss.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from kvstore.connectors.agent.batch import PrefillSeq, prefill_sequences, rebuild_model_input
from kvstore.connectors.agent.config import AgentConfig
from kvstore.connectors.gil import lower_switch_interval
from kvstore.errors import ConfigError
from kvstore.keys import Namespace
from kvstore.paged import KVTransfer, PagedLayout, dtype_name, get_layout
from kvstore.prefix_cache import PrefixCache
from kvstore.record.auth import RecordAuth
from kvstore.stores import Store, TieredStore

__all__ = ["KVStoreAgent", "AgentStats"]

log = logging.getLogger(__name__)

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

    def __init__(self, config: AgentConfig | Mapping[str, Any], *, store: Store | None = None) -> None:
        self.config = config if isinstance(config, AgentConfig) else AgentConfig.from_mapping(config)
        lower_switch_interval(self.config.switch_interval, who="KVStoreAgent")
        if store is None:
            store = TieredStore.from_urls(list(self.config.store), **dict(self.config.store_options))
        self.store = store
        self._role = self.config.parsed_role
        self.stats = AgentStats()
        # (start layer, end layer, first cache's address, shape, dtype, number of caches) -> transfer
        self._transfers: dict[tuple[int, int, int, tuple[int, ...], torch.dtype, int], KVTransfer] = {}
        self._rebuilt: tuple[Any, list[PrefillSeq], list[int]] | None = None
        self._bypassed: Any = None  # the model_input of the last step recv told to bypass
        self._closed = False
        self._auth = RecordAuth.from_options(self.config.auth_key_file, self.config.auth_key_env,
                                             self.config.auth_previous_window)

    # -- setup ----------------------------------------------------------------------------
    def namespace(self, kv_caches: Sequence[torch.Tensor], start_layer: int, layout_name: str,
                  block_size: int) -> Namespace:
        c = self.config
        return Namespace(
            model=c.model, model_fingerprint=c.model_fingerprint, kv_dtype=dtype_name(kv_caches[0].dtype),
            layout=layout_name, block_size=block_size, chunk_tokens=c.chunk_tokens,
            layer_start=start_layer, layer_end=start_layer + len(kv_caches), tp_rank=c.rank, tp_size=c.tp_size,
            adapter=c.adapter, cache_salt=c.cache_salt,
        )

    def _layout(self, cache: torch.Tensor) -> PagedLayout:
        if self.config.kv_layout:
            return get_layout(self.config.kv_layout)
        if cache.dim() == 5 and cache.shape[0] == 2:
            return get_layout("flash-2bnhd")
        if cache.dim() == 3:
            return get_layout("mla-bnl")
        raise ConfigError(f"cannot tell the layout of a KV cache of shape {list(cache.shape)}; "
                          "set kv_layout (e.g. 'vllm-bhnc' for vLLM's GPU view, 'vllm-cpu-vec' for its CPU pages)")

    def transfer(self, model_executable: Any, kv_caches: Sequence[torch.Tensor]) -> KVTransfer:
        """The ``KVTransfer`` for this rank's layers (built once per set of caches)."""
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
            xfer = KVTransfer(PrefixCache(self.store, ns, codec=self.config.codec, auth=self._auth), kv_caches, layout,
                              land=self.config.land_in_cache)
            self._transfers[key] = xfer
        return xfer

    @staticmethod
    def expected_hidden(model_executable: Any) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """``(dtype, shape)`` of one token's hidden state as this model consumes it, if it says."""
        for obj in (model_executable, getattr(model_executable, "model", None)):
            size = getattr(getattr(obj, "config", None), "hidden_size", None)
            dtype = getattr(obj, "dtype", None)
            if not isinstance(dtype, torch.dtype) and isinstance(obj, torch.nn.Module):
                dtype = next((p.dtype for p in obj.parameters() if p.is_floating_point()), None)
            if type(size) is int and size > 0 and isinstance(dtype, torch.dtype):
                return dtype, (size,)
        return None

    # -- recv -----------------------------------------------------------------------------
    def recv_kv_caches_and_hidden_states(self, model_executable: Any, model_input: Any,
                                         kv_caches: Sequence[torch.Tensor]) -> tuple[Any, bool, Any]:
        """Load stored prefixes of the batch's prefill sequences (see the module docstring)."""
        self._rebuilt = self._bypassed = None
        md = model_input.attn_metadata
        if not self._role.loads or int(md.num_prefills) == 0:
            return None, False, model_input
        self.stats.recv_calls += 1
        xfer = self.transfer(model_executable, kv_caches)
        expected = self.expected_hidden(model_executable)
        seqs = prefill_sequences(model_input)
        loaded: list[int] = []
        hiddens: list[torch.Tensor | None] = []
        for s in seqs:
            n, h = (0, None)
            if s.tokens is not None:
                try:
                    n, h = xfer.load_sequence(s.tokens, s.slots, hidden_dtype=expected[0] if expected else None,
                                              hidden_shape=expected[1] if expected else None)
                except Exception:  # never fail the request; a bug here must not cost more than a miss
                    log.exception("KV load failed for a sequence; computing it")
                    n, h = 0, None
                self.stats.tokens_requested += s.q_end - s.q_start
            loaded.append(n)
            # Only a hidden state this model can take; unknown expectations: compute the last token.
            hiddens.append(h if expected is not None and h is not None
                           and (h.dtype, tuple(h.shape)) == expected else None)
        self.stats.tokens_loaded += sum(loaded)
        if not any(loaded):
            return None, False, model_input
        full = [s.tokens is not None and n == s.q_end - s.q_start and h is not None
                for s, n, h in zip(seqs, loaded, hiddens)]
        if int(md.num_decode_tokens) == 0 and all(full):
            present = cast("list[torch.Tensor]", hiddens)  # all(full): every hidden state is known
            first = present[0]
            out = torch.zeros((model_input.input_tokens.shape[0], *first.shape), dtype=first.dtype,
                              device=kv_caches[0].device)
            for s, h in zip(seqs, present):
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
                                         kv_caches: Sequence[torch.Tensor],
                                         hidden_or_intermediate_states: Any) -> None:
        """Store the batch's prefill sequences' chunks not yet stored (see the module docstring)."""
        rebuilt, self._rebuilt = self._rebuilt, None
        bypassed, self._bypassed = self._bypassed, None
        md = model_input.attn_metadata
        if not self._role.saves or int(md.num_prefills) == 0:
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
            new = prefill_sequences(model_input)
            for s, ns in zip(seqs, new):
                s.q_start, s.q_end = ns.q_start, ns.q_end
        else:
            seqs, skip = prefill_sequences(model_input), None
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
        return self.store.flush(timeout)

    def close(self) -> None:
        """Finish pending writes (bounded) and release the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.flush()
        finally:
            self.store.close()


