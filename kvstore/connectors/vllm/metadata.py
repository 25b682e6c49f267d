"""What the scheduler side tells the worker side each step (pickled by vLLM from the scheduler
process to every worker; built by the connector, never read from a store)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.keys import HeadRange, InputSpan

__all__ = ["LoadSpec", "SaveSpec", "KVStoreConnectorMetadata"]


@dataclass
class LoadSpec:
    """Load tokens ``[start, end)`` of ``tokens`` into ``block_ids`` (one list per stored KV cache
    group, in the worker's group order; ``[0, start)`` is a local hit)."""

    req_id: str
    tokens: list[int]
    block_ids: list[list[int]]
    start: int
    end: int
    salt: str = ""
    #: Loaded in the background (the request waits in WAITING_FOR_REMOTE_KVS) rather than before
    #: this step's forward.
    background: bool = False
    #: The prompt's multimodal inputs, part of its chunk keys (``kvstore.keys.InputSpan``).
    spans: tuple[InputSpan, ...] = ()
    #: Per stored group cut by KV head, the head ranges whose records the lookup found covering
    #: the hit (each rank reads those covering its heads, ``kvstore.heads.cover``); empty: the
    #: ranks' own.
    heads: list[list[HeadRange]] = field(default_factory=list)


@dataclass
class SaveSpec:
    """After this step's forward, save the prefixes ``tokens[:e]`` for ``e`` in ``ends``: the
    chunks ending after ``start``, without asking the store which are there (the scheduler knows
    how far the request is saved; a plan that must rewrite a stretch sets ``start`` before it).
    ``block_ids``: one list per stored KV cache group. Sliding-window and chunked-local groups
    store only the window before each of ``window_ends``, recurrent-state groups the state at
    each of ``state_ends`` (subsets of ``ends``). ``announce``: the token range ``(after, upto]``
    whose full chunks the KV events announce (None: the chunks written)."""

    req_id: str
    tokens: list[int]
    block_ids: list[list[int]]
    ends: list[int]
    salt: str = ""
    start: int = 0
    window_ends: list[int] = field(default_factory=list)
    spans: tuple[InputSpan, ...] = ()
    state_ends: list[int] = field(default_factory=list)
    announce: tuple[int, int] | None = None
    #: The save that completes a P/D prefill's promised prefix (``disagg``): the worker times how
    #: long its records take to be visible in every shared tier.
    promise: bool = False


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    #: The scheduler's step number, and how many steps it plans ahead of the outputs it has seen
    #: (1 with vLLM's async scheduling, else 0): a failure seen in step s can only have been known
    #: to plans made after step s + lag.
    step: int = 0
    lag: int = 0
    #: Requests vLLM preempted in this step: their blocks are freed without asking the connector.
    preempted: list[str] = field(default_factory=list)
    #: Prompt tokens this step's forward computes (the worker times prefills for the cost model).
    prefill_tokens: int = 0
