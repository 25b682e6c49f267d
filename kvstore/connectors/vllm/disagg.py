"""Disaggregated prefill through the store: the promise a prefill engine hands a decode engine.

vLLM's P/D contract (``docs/disagg.md``): a proxy sends the request to a prefill engine with
``kv_transfer_params={"do_remote_decode": true}`` and ``max_tokens=1``; the prefill engine's
connector answers ``request_finished`` with the params that come back in the response; the proxy
sends the original request to a decode engine with those params, which its connector reads in
``get_num_new_matched_tokens``.

Here the prefill engine saves the prompt's records as it always does (in the background: its step
never waits on the network) and returns a **promise**: the decode engine will find ``tokens``
leading tokens of this prompt in the shared tier (``tier``), within ``deadline_s`` seconds of the
response. The params name the namespace and the last chunk's prefix digest, so a decode engine
of another deployment, or a request whose prompt differs, is told apart before it waits. They
carry no KV bytes and no secret (a digest names a prompt the client sent anyway)::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "kvstore": {"v": 1, "namespace": "3f2a...", "tokens": 1984, "chunks": 8,
                 "digest": "9c1e...", "tier": "redis", "deadline_s": 2.0}}

The decode engine waits (never in the scheduler's step: ``scheduler``) until the store holds
the promised prefix or the deadline passes (its own ``pd_deadline`` bounds the producer's), then
loads it in the background; what is not there in time, or fails verification, vLLM recomputes.

This module is the wire format and its checks: pure functions, no vLLM, no store.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PARAMS_KEY", "VERSION", "Promise", "BadPromise", "wants_remote_decode", "wants_remote_prefill",
           "read_promise", "shared_tier", "wait_for", "POLL_FIRST", "POLL_MAX"]

#: Our entry in ``kv_transfer_params`` (other connectors' keys sit beside it).
PARAMS_KEY = "kvstore"
VERSION = 1
_MAX_TOKENS = 1 << 24
_MAX_DEADLINE = 3600.0


@dataclass(frozen=True)
class Promise:
    """What a prefill engine stored for a prompt, as a decode engine reads it."""

    namespace: str  #: the first KV cache group's namespace id (TP rank 0), without cache salt
    tokens: int  #: leading prompt tokens stored (whole blocks; the last one or more is computed)
    chunks: int  #: records of one shard that cover them
    digest: str  #: hex digest of the prefix ``tokens[:tokens]`` (its last chunk key's)
    tier: str  #: the tier other engines read them from
    deadline_s: float  #: seconds after the response within which they are visible

    def to_params(self) -> dict[str, Any]:
        return {"do_remote_prefill": True, "do_remote_decode": False,
                PARAMS_KEY: {"v": VERSION, "namespace": self.namespace, "tokens": self.tokens,
                             "chunks": self.chunks, "digest": self.digest, "tier": self.tier,
                             "deadline_s": self.deadline_s}}


class BadPromise(ValueError):
    """Params that announce a remote prefill but whose promise is malformed or foreign; the
    message is the reason's label (``kvstore_pd_load_failures_total{reason}``) then details."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """The request is a P/D prefill (the proxy asked for params to hand to a decode engine)."""
    return bool(params) and params.get("do_remote_decode") is True  # type: ignore[union-attr]


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """The request is a P/D decode whose prefill engine promised records in the store."""
    return bool(params) and params.get("do_remote_prefill") is True and PARAMS_KEY in params  # type: ignore[operator,union-attr]


def read_promise(params: Mapping[str, Any], *, namespace: str, max_tokens: int, block_size: int) -> Promise:
    """The promise in ``params`` (``wants_remote_prefill`` is true), checked against this engine:
    ``BadPromise("params", ...)`` for a malformed one, ``BadPromise("mismatch", ...)`` for one
    made for another namespace or for more tokens than this prompt's ``max_tokens`` (a prompt
    that differs). Params come from the client: every field is type- and range-checked."""
    raw = params.get(PARAMS_KEY)
    if not isinstance(raw, Mapping):
        raise BadPromise("params", f"{PARAMS_KEY!r} is not an object")
    if raw.get("v") != VERSION:
        raise BadPromise("params", f"version {raw.get('v')!r} (this engine reads {VERSION})")

    def text(name: str, limit: int = 200) -> str:
        value = raw.get(name)
        if not isinstance(value, str) or not value or len(value) > limit or not value.isprintable():
            raise BadPromise("params", f"{name}={str(value)[:40]!r} is not a short printable string")
        return value

    def integer(name: str, lo: int, hi: int) -> int:
        value = raw.get(name)
        if type(value) is not int or not lo <= value <= hi:
            raise BadPromise("params", f"{name}={str(value)[:40]!r} is not an integer in {lo}..{hi}")
        return value

    deadline = raw.get("deadline_s")
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not math.isfinite(deadline) \
            or not 0 <= deadline <= _MAX_DEADLINE:
        raise BadPromise("params", f"deadline_s={str(deadline)[:40]!r} is not a number in 0..{_MAX_DEADLINE:g}")
    promise = Promise(namespace=text("namespace"), tokens=integer("tokens", 1, _MAX_TOKENS),
                      chunks=integer("chunks", 1, _MAX_TOKENS), digest=text("digest", 128), tier=text("tier"),
                      deadline_s=float(deadline))
    if promise.namespace != namespace:
        raise BadPromise("mismatch", f"namespace {promise.namespace} is not this engine's {namespace}")
    if promise.tokens % block_size or promise.tokens > max_tokens:
        raise BadPromise("mismatch", f"{promise.tokens} tokens promised; this prompt has {max_tokens} hittable "
                                     f"tokens in blocks of {block_size}")
    return promise


def shared_tier(tiers: Sequence[tuple[str, bool]]) -> str | None:
    """The tier other engines read a prefill engine's records from, out of ``(name, local)`` pairs
    fastest first: the first shared (not process-local) tier; else a host-shared one (``shm``,
    ``file``: every engine of the host reads it); None for process memory only (no P/D)."""
    for name, local in tiers:
        if not local:
            return name
    for name, _ in tiers:
        if not name.startswith("memory"):
            return name
    return None


#: A decode engine polls the store for promised records this often: first soon (records written
#: while the response travelled are found at once), then backing off to the slowest poll.
POLL_FIRST, POLL_MAX = 0.001, 0.02


def wait_for(probe: Callable[[], int], want: int, deadline: float, *, clock: Callable[[], float],
             sleep: Callable[[float], None] = time.sleep) -> int:
    """Call ``probe()`` (how much is there now) until it answers at least ``want`` or ``clock()``
    passes ``deadline``; returns its last answer. It is called at least once, and at the deadline
    once more after the last wait, so a deadline of 0 still looks once."""
    delay = POLL_FIRST
    while True:
        got = probe()
        left = deadline - clock()
        if got >= want or left <= 0:
            return got
        sleep(min(delay, left))
        delay = min(delay * 2, POLL_MAX)
