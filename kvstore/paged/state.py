"""``StateTransfer``: save and load the recurrent state a token prefix ends with.

A recurrent layer (Mamba, gated delta net, short convolution, linear attention) keeps no KV per
token: its state after token ``t`` sums up every token before it, so a stored prefix is worth
resuming from only with the state at its end. An engine that keeps the state at block
boundaries (vLLM's ``mamba_cache_mode="align"``: one state page per block of a request's state
table) hands over, per layer, a paged tensor whose block ``b`` holds one state: the layer's
state tensors (e.g. a convolution window and an SSM state) packed back to back.

The state after ``end`` tokens is stored as one record beside the chunk it ends: the record of
chunk ``[start, end)`` in the state's own namespace (its own key chain, so a state record is
never read as KV, nor as another model's state), holding every layer's page of the block the
caller names. It is a record like any other (``PrefixCache``): the chunk's token ids, every
state tensor's byte length (``shapes``, dtype ``uint8``; the namespace names their shapes and
dtypes), checksum, tag; verified before a byte reaches the cache; a bad record is counted,
deleted, a miss, and rewritten by the next save that covers it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvstore.errors import ConfigError
from kvstore.keys import ChunkKey, InputSpan, Namespace, TokenIds, prefix_keys, tokens_to_array
from kvstore.paged.tensors import tensor_bytes
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record import Record

__all__ = ["StateTransfer"]


class StateTransfer:
    """Save and load one state per layer of a group of recurrent layers at a chunk end.

    ``pages`` are the layers' paged state tensors (dim 0: blocks; ``pages[l][b]`` one contiguous
    state of ``sum(tensor_bytes)`` bytes, e.g. vLLM's ``[blocks, 1, 1, bytes]`` int8 views),
    ``tensor_bytes`` the byte length of each state tensor of one layer, in page order. The
    ``PrefixCache``'s namespace must describe them: dtype ``uint8``, one layer per page.
    Nothing here raises a storage or record error: a failed load is ``False``.
    """

    def __init__(self, cache: PrefixCache, pages: Sequence[torch.Tensor], tensor_bytes: Sequence[int]) -> None:
        if not pages:
            raise ValueError("StateTransfer needs at least one layer's state pages")
        self.cache = cache
        self.pages = [p.reshape(p.shape[0], -1) for p in pages]  # a view: each page is contiguous
        self.tensor_bytes = [int(n) for n in tensor_bytes]
        self.page_bytes = sum(self.tensor_bytes)
        self.device = self.pages[0].device
        ns = cache.namespace
        problems = []
        if ns.kv_dtype != "uint8":
            problems.append(f"kv_dtype={ns.kv_dtype!r} (state records hold bytes: 'uint8')")
        if ns.layer_end - ns.layer_start != len(pages):
            problems.append(f"layer range [{ns.layer_start}, {ns.layer_end}) for {len(pages)} layers")
        for i, p in enumerate(self.pages):
            if p.shape[1] * p.element_size() != self.page_bytes or p.device != self.device:
                problems.append(f"layer {i} holds {p.shape[1] * p.element_size()}-byte states on {p.device}, "
                                f"not {self.page_bytes} bytes ({'+'.join(map(str, self.tensor_bytes))}) on {self.device}")
        if problems:
            raise ConfigError("namespace does not describe the state pages: " + "; ".join(problems))
        self.shapes = [(n,) for _ in self.pages for n in self.tensor_bytes]
        self.nbytes = self.page_bytes * len(self.pages)

    def keys(self, tokens: TokenIds, ends: Sequence[int], namespace: Namespace | None = None, *,
             spans: Sequence[InputSpan] = ()) -> list[ChunkKey]:
        """The keys of the state records of the prefixes ``tokens[:e]``, one per ``e`` in ``ends``
        (in order; the chain hashed once)."""
        ns = self.cache.in_space(namespace or self.cache.namespace)
        wanted = sorted(set(ends))
        by_end = {k.end: k for k in prefix_keys(ns, tokens, wanted, spans=spans)}
        return [by_end[e] for e in wanted if e in by_end]

    def save(self, tokens: TokenIds, blocks: dict[int, int], namespace: Namespace | None = None, *,
             spans: Sequence[InputSpan] = ()) -> int:
        """Store, for each ``end -> block`` of ``blocks``, the state of ``block`` as the state after
        ``tokens[:end]``; returns the records written. The pages must not change until this returns."""
        arr = tokens_to_array(tokens)
        keys = self.keys(arr, list(blocks), namespace, spans=spans)
        if not keys:
            return 0

        def payload(chunk: ChunkKey) -> ChunkPayload:
            block = blocks[chunk.end]
            lease = self.cache.pool.lease(self.nbytes)
            out = (torch.frombuffer(lease.view, dtype=torch.uint8) if lease is not None
                   else torch.empty(self.nbytes, dtype=torch.uint8))
            try:
                for i, page in enumerate(self.pages):
                    out[i * self.page_bytes:(i + 1) * self.page_bytes].copy_(page[block].view(torch.uint8))
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            return ChunkPayload(shapes=self.shapes, kv=lease.view if lease is not None else tensor_bytes(out),
                                owner=lease)

        # Every state is written (a record a load rejected first of all: PrefixCache heals it).
        return self.cache.save(arr[:keys[-1].end], keys, payload, skip_stored=False, namespace=namespace,
                               spans=spans)

    def load(self, tokens: TokenIds, end: int, block: int, namespace: Namespace | None = None, *,
             spans: Sequence[InputSpan] = (), before_place: Callable[[ChunkKey, Record], None] | None = None) -> bool:
        """Load the state after ``tokens[:end]`` into ``block`` of every layer; whether it loaded
        (verified before any byte is written: a missing or bad record leaves the block as it was).
        ``before_place`` runs for the verified record first; an exception from it propagates."""
        arr = tokens_to_array(tokens)
        keys = self.keys(arr, [end], namespace, spans=spans)
        if not keys or keys[0].end != end:
            return False

        def sink(chunk: ChunkKey, record: Record) -> None:
            if before_place is not None:
                before_place(chunk, record)
            src = np.frombuffer(record.kv, dtype=np.uint8)
            for i, page in enumerate(self.pages):
                part = src[i * self.page_bytes:(i + 1) * self.page_bytes]
                if self.device.type == "cpu":
                    np.copyto(page[block].view(torch.uint8).numpy(), part)
                else:  # staged: torch cannot wrap a read-only buffer (a memory tier's value)
                    page[block].view(torch.uint8).copy_(torch.from_numpy(part.copy()))

        result = self.cache.load(arr[:end], keys, sink, shapes=lambda _: self.shapes, namespace=namespace)
        return result.num_chunks == 1
