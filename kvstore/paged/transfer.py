"""``KVTransfer``: save and load token prefixes of a sequence between a paged cache and a store.

The engine-agnostic core the agent API and the vLLM connector both use: per sequence (tokens,
slots) it saves chunks through a ``PrefixCache`` and loads the longest stored prefix back. What
is shared lives here (keys, the namespace's checks, hidden states); the copies are one of two
paths, chosen once, when the transfer is built:

* ``HostCopies`` (``kvstore.paged.host``) for CPU caches: records gathered into (or sent
  straight from) the blocks, loaded records landed in (or scattered into) them by numpy kernels;
* ``DeviceCopies`` (``kvstore.paged.device``) for accelerators: one gather pass and one D2H copy
  per save, DMAs from where records lie and verification on many threads per load, one scatter
  pass for the verified prefix.

**KV heads.** A cache whose ``PrefixCache`` names a head range (``PrefixCache.heads``: the heads
this rank holds) saves records of that range, and loads from records of any ranges that cover it
(``load_sequence``'s ``sources``, ``kvstore.heads.cover``): each source's records are received
and verified whole, and only the heads both hold are copied into the cache; a load from its own
range alone is the plain one (records landed in the blocks where they can be).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, HeadRange, InputSpan, Namespace, TokenIds, prefix_keys, tokens_to_array
from kvstore.paged.device import DEFAULT_STAGING_BYTES, DeviceCopies
from kvstore.paged.host import HostCopies
from kvstore.paged.layouts import HeadSlice, PagedLayout, get_layout
from kvstore.paged.tensors import dtype_name, tensor_bytes
from kvstore.pinned import HostPinner
from kvstore.prefix_cache import PrefixCache
from kvstore.record import Record
from kvstore.types import Buffer

__all__ = ["KVTransfer"]


class KVTransfer:
    """Save and load token prefixes of a sequence between a paged KV cache and a store.

    ``kv_caches`` are this rank's layers (``layout`` describes each), all of one dtype and
    device. Every record holds all these layers for one chunk (``shapes``: one
    ``chunk_shape`` per layer) plus, when known, the hidden state of the chunk's last token.
    The ``PrefixCache``'s namespace must name this layout, dtype, block size and layer range;
    ``KVTransfer`` checks what it can at construction.

    Block-granular layouts save and load whole blocks only (a final partial block is neither
    stored nor loaded). Nothing here raises a storage or record error: a failed load is a
    shorter (or zero) hit.

    On a CPU cache whose blocks are whole items (every layout here but token rows at odd
    strides), loads land records straight in the blocks (``PrefixCache.load``'s ``land``:
    no copy out of a pool buffer); ``land=False`` keeps every record in its lease until
    verified, then scatters it. Either way the blocks past the loaded prefix hold nothing the
    caller may use: stale KV, or a failed record's bytes. Saves into a store that does not queue
    writes send such a cache's blocks as they are (``save_from_blocks``; off: gathered into a
    pool buffer first, as for every other store).

    On an accelerator (or with ``device_path=True``, which the tests use on the CPU) the copies
    are ``DeviceCopies``: ``pinner`` registers host memory with the device (default: CUDA's),
    and ``staging_bytes`` bounds the device memory a load or save stages at once; ``kernel``
    picks how records move between the staging and the layers (``DeviceCopies``: ``"torch"``,
    one launch per layer, or ``"triton"``, one for all).
    """

    def __init__(self, cache: PrefixCache, kv_caches: Sequence[torch.Tensor], layout: PagedLayout | str, *,
                 land: bool = True, save_from_blocks: bool = True, device_path: bool | None = None,
                 pinner: HostPinner | None = None, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 kernel: str = "torch") -> None:
        if not kv_caches:
            raise ValueError("KVTransfer needs at least one layer's KV cache")
        self.cache = cache
        self.kv_caches = list(kv_caches)
        self.layout = get_layout(layout)
        first = self.kv_caches[0]
        self.device, self.dtype = first.device, first.dtype
        self.block_size = self.layout.block_size(first)
        for i, c in enumerate(self.kv_caches):
            if c.dtype != self.dtype or c.device != self.device or c.shape != first.shape:
                raise ValueError(f"layer {i} cache is {c.dtype}{list(c.shape)} on {c.device}; "
                                 f"layer 0 is {self.dtype}{list(first.shape)} on {self.device}")
        ns = cache.namespace
        problems = []
        if ns.layout != self.layout.name:
            problems.append(f"layout={ns.layout!r} (cache is {self.layout.name!r})")
        if ns.kv_dtype != dtype_name(self.dtype):
            problems.append(f"kv_dtype={ns.kv_dtype!r} (cache is {dtype_name(self.dtype)!r})")
        if ns.block_size != self.block_size and not (ns.block_size == 1 and self.layout.granularity == "token"):
            problems.append(f"block_size={ns.block_size} (cache has {self.block_size}; 1 for any block size of "
                            f"a token layout)")
        if ns.layer_end - ns.layer_start != len(self.kv_caches):
            problems.append(f"layer range [{ns.layer_start}, {ns.layer_end}) for {len(self.kv_caches)} layers")
        #: The KV heads this cache holds, as its records name them (None: records not cut by head).
        self.heads = cache.heads
        if self.heads is not None and self.layout.num_heads(first) != self.heads.count:
            problems.append(f"heads {self.heads} for a cache of {self.layout.num_heads(first)} KV heads")
        if problems:
            raise ConfigError("namespace does not describe the KV cache: " + "; ".join(problems))
        if staging_bytes < 1:
            raise ConfigError(f"staging_bytes={staging_bytes} must be at least 1")
        #: Device memory a load or save stages at most at once (the device path only).
        self.staging_bytes = staging_bytes
        self.on_cuda = self.device.type == "cuda"
        if device_path is None:
            device_path = self.device.type != "cpu"
        self.copies: HostCopies | DeviceCopies = (
            DeviceCopies(cache, self.kv_caches, self.layout, pinner=pinner, staging_bytes=staging_bytes, kernel=kernel)
            if device_path else
            HostCopies(cache, self.kv_caches, self.layout, land=land, save_from_blocks=save_from_blocks))
        #: Where records are received and gathered (pinned on an accelerator).
        self.pool = self.copies.pool
        self.num_slots = self.layout.num_blocks(first) * self.block_size

    def _slots_on_device(self, slots: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """``slots`` as int64 on the cache's device; those of tokens ``[start, end)`` (the ones
        the copy touches) checked first where they are on the host: on an accelerator a slot out
        of range would fail the indexed copy with a device-side assert, which ends the process's
        use of the device, where the host path gets an ``IndexError`` (a failed load or save: a
        recompute)."""
        used = slots[start:end]
        if used.device.type == "cpu" and used.numel():
            lo, hi = int(used.min()), int(used.max())
            if lo < 0 or hi >= self.num_slots:
                raise IndexError(f"slot {lo if lo < 0 else hi} is out of range for a cache of {self.num_slots} slots")
        if isinstance(self.copies, DeviceCopies):  # pinned, non-blocking, on the transfer's own stream
            return self.copies.device_slots(slots)
        return slots.to(self.device, torch.int64)

    @property
    def lands_in_cache(self) -> bool:
        """Whether loads land records straight in the cache's blocks (a store that receives piece
        by piece permitting): a CPU cache of whole-block items, and ``land`` not turned off."""
        return isinstance(self.copies, HostCopies) and self.copies.lands_in_cache

    # -- helpers ---------------------------------------------------------------------------
    def _parts(self, sources: Sequence[HeadRange] | None) -> list[tuple[HeadRange | None, HeadSlice | None]]:
        """Each source range with what of its records this cache takes (None: all, its own range)."""
        own = self.heads
        if sources is None or own is None or list(sources) == [own]:
            return [(own, None)]
        parts: list[tuple[HeadRange | None, HeadSlice | None]] = []
        covered = 0
        for source in sources:
            both = source.overlap(own)
            if both is None:
                raise ValueError(f"heads {source} hold none of this cache's heads {own}")
            parts.append((source, HeadSlice(source.count, both.start - source.start, both.start - own.start,
                                             both.count)))
            covered += both.count
        if covered < own.count:
            raise ValueError(f"heads {[str(s) for s in sources]} do not cover this cache's heads {own}")
        return parts

    def usable_tokens(self, num_tokens: int) -> int:
        """How many leading tokens of a ``num_tokens`` sequence this layout can store or load."""
        if self.layout.granularity == "block":
            return num_tokens - num_tokens % self.block_size
        return num_tokens

    def keys(self, tokens: TokenIds, max_tokens: int | None = None,
             namespace: Namespace | None = None, *, spans: Sequence[InputSpan] = ()) -> list[ChunkKey]:
        """Chunk keys of the storable part of ``tokens`` (up to ``max_tokens``), under
        ``namespace`` (default: the cache's; e.g. ``namespace.with_salt(...)`` per tenant), with
        the prompt's non-text inputs ``spans`` (``kvstore.keys.InputSpan``)."""
        return self._array_keys(tokens_to_array(tokens), max_tokens, namespace, spans)

    def _array_keys(self, arr: np.ndarray, max_tokens: int | None, namespace: Namespace | None,
                    spans: Sequence[InputSpan]) -> list[ChunkKey]:
        """``keys`` of tokens already made an array by ``tokens_to_array`` (not converted again)."""
        n = self.usable_tokens(arr.shape[0])
        return self.cache.keys(arr[:n], max_tokens=max_tokens, namespace=namespace, spans=spans)

    def lookup(self, tokens: TokenIds, max_tokens: int | None = None, *, spans: Sequence[InputSpan] = ()) -> int:
        """Tokens of the longest stored prefix (one lookup round trip; nothing is loaded)."""
        return self.cache.lookup_tokens(self.keys(tokens, max_tokens, spans=spans))

    # -- save ------------------------------------------------------------------------------
    def save_sequence(self, tokens: TokenIds, slots: torch.Tensor,
                      hidden_states: torch.Tensor | None = None, start_token: int = 0,
                      namespace: Namespace | None = None, *, ends: Sequence[int] | None = None,
                      from_token: int | None = None, spans: Sequence[InputSpan] = (),
                      announce: tuple[int, int] | None = None) -> int:
        """Store the chunks of ``tokens`` whose KV sits at ``slots`` (one slot per token).

        ``hidden_states[i]`` (optional) is the hidden state of token ``start_token + i``; each
        chunk whose last token has one stores it. ``ends`` saves the prefixes ``tokens[:e]``
        for each ``e`` (default: the whole of ``tokens``), the chain hashed once for all of them.
        ``from_token`` says how far the prefix is known to be stored: chunks ending after it are
        written, no lookup is made (``PrefixCache.save``); without it, chunks already stored are
        found by one pre-check and not rebuilt or rewritten. ``namespace`` overrides the cache's
        (same layout, e.g. another cache salt); ``spans`` are the prompt's non-text inputs;
        ``announce``: what to announce to the cache's event sink (``PrefixCache.save``).
        The KV at ``slots`` must not change until this returns: chunks are read from the cache
        as the store takes them (gathered, or sent from the blocks themselves). Returns the
        number of chunks written (handed to the store).
        """
        arr = tokens_to_array(tokens)
        if slots.numel() < arr.shape[0]:
            raise ValueError(f"{arr.shape[0]} tokens need as many slots, got {slots.numel()}")
        if ends is None:
            keys = self._array_keys(arr, None, namespace, spans)
        else:
            n = arr.shape[0]
            keys = prefix_keys(self.cache.in_space(namespace or self.cache.namespace), arr,
                               [self.usable_tokens(min(int(e), n)) for e in ends], spans=spans, heads=self.heads)
        if not keys:
            return 0
        written = [k for k in keys if from_token is None or k.end > from_token] or keys
        slots = self._slots_on_device(slots, written[0].start, written[-1].end)

        # Every chunk end's hidden state in one copy to the host (on an accelerator, one wait for
        # the compute stream instead of one per chunk).
        end_hidden: dict[int, torch.Tensor] = {}
        if hidden_states is not None:
            n = hidden_states.shape[0]
            rows = sorted({row for row in (k.end - 1 - start_token for k in keys) if 0 <= row < n})
            if rows:
                index = torch.tensor(rows, device=hidden_states.device)
                host = hidden_states.detach().index_select(0, index).to("cpu").contiguous()
                end_hidden = {row: host[i] for i, row in enumerate(rows)}

        def hidden(chunk: ChunkKey) -> tuple[Buffer | None, str | None, tuple[int, ...] | None]:
            h = end_hidden.get(chunk.end - 1 - start_token)
            if h is None:
                return None, None, None
            return tensor_bytes(h), dtype_name(h.dtype), tuple(h.shape)

        return self.copies.save(arr[:max(k.end for k in keys)], keys, slots, hidden, from_token=from_token,
                                namespace=namespace, spans=spans, announce=announce)

    # -- load ------------------------------------------------------------------------------
    def load_sequence(self, tokens: TokenIds, slots: torch.Tensor,
                      max_tokens: int | None = None, *, skip_tokens: int = 0,
                      namespace: Namespace | None = None, spans: Sequence[InputSpan] = (),
                      before_place: Callable[[ChunkKey, Record], None] | None = None,
                      hidden_dtype: torch.dtype | str | None = None,
                      hidden_shape: Sequence[int] | None = None,
                      sources: Sequence[HeadRange] | None = None) -> tuple[int, torch.Tensor | None]:
        """Load the longest stored prefix of ``tokens`` into ``slots``.

        Only chunks ending at or before ``max_tokens`` are considered. Each chunk is verified
        before it counts as loaded (before its KV is scattered, or, landed in the blocks, once
        its last byte is in). Slots past the returned prefix hold nothing usable. ``skip_tokens``
        leading tokens are already in the cache (an engine's local prefix hit, possibly shared
        blocks): chunks ending there are not fetched and those slots are never written
        (``slots`` may hold anything for them); on a block-granular layout it must be a whole
        number of blocks. ``namespace`` overrides the cache's; ``spans`` are the prompt's
        non-text inputs. ``before_place(chunk, record)`` runs for each verified chunk before it
        is counted (and its KV scattered, if it did not land); an exception from it stops the
        load there and propagates (a caller's cancellation). ``hidden_dtype``/``hidden_shape`` are what the caller's model consumes: a
        record carrying another hidden state is a miss there, never a tensor the model cannot
        take. Returns ``(tokens present: skip_tokens or the end of the loaded prefix, hidden
        state of the last loaded token or None)``; the hidden state is a new CPU tensor.
        One batch read, no separate lookup: the records are fetched up to the first missing one.
        ``sources``: the head ranges whose records to read, which must cover the cache's ``heads``
        (``kvstore.heads.cover``; default: its own): one batch read per range, each up to where
        the ranges before it got, and the prefix every one of them loaded counts.
        """
        arr = tokens_to_array(tokens)
        if skip_tokens < 0 or (self.layout.granularity == "block" and skip_tokens % self.block_size):
            raise ValueError(f"skip_tokens={skip_tokens} must be a non-negative multiple of "
                             f"block_size={self.block_size} for {self.layout.name}")
        keys = [k for k in self._array_keys(arr, max_tokens, namespace, spans) if k.end > skip_tokens]
        if not keys:
            return min(skip_tokens, arr.shape[0]), None
        slots = self._slots_on_device(slots, skip_tokens, keys[-1].end)
        parts = self._parts(sources)
        hidden_name = dtype_name(hidden_dtype) if isinstance(hidden_dtype, torch.dtype) else hidden_dtype
        for i, (source, part) in enumerate(parts):
            result = self.copies.load(arr[:keys[-1].end], [k.with_heads(source) for k in keys], slots, skip_tokens,
                                      namespace=namespace, before_place=before_place, hidden_dtype=hidden_name,
                                      hidden_shape=hidden_shape, part=part, counted=i == 0)
            if i + 1 < len(parts):  # the next range is read only as far as this one got
                keys = [k for k in keys if k.end <= result.num_tokens]
                if not keys:
                    break
        hidden = None
        header = result.last_header
        if result.num_tokens and header is not None and result.hidden is not None and header.hidden_shape is not None:
            dt = getattr(torch, header.hidden_dtype or "", None)
            if isinstance(dt, torch.dtype):
                hidden = torch.frombuffer(bytearray(result.hidden), dtype=dt).view(header.hidden_shape)
        return (result.num_tokens if result.num_tokens else min(skip_tokens, arr.shape[0])), hidden
