"""A ZMQ publisher of vLLM-format KV events for what kvstore's store holds.

It behaves like vLLM's ``ZmqEventPublisher`` on the wire, so a router that reads an engine's KV
events reads these too:

* **PUB** on ``endpoint``: every message is ``[topic, seq, payload]``, ``seq`` an 8-byte
  big-endian counter from 0, ``payload`` one ``EventBatch`` (``kvstore.events.wire``). Bound when
  the endpoint has a wildcard host (``tcp://*:5557``, ``::``) or is ``ipc://`` / ``inproc://``,
  connected otherwise (vLLM's rule); a data-parallel rank above 0 shifts the TCP port by the
  rank (``inproc``: suffix ``_dp<rank>``).
* **Replay** (ROUTER, bound on ``replay_endpoint``): a client sends ``[b"", start_seq]`` (8 bytes,
  big-endian; a REQ socket adds the empty frame itself) and receives, for every batch still
  buffered with ``seq >= start_seq``, ``[b"", topic, seq, payload]``, then the end marker
  ``[b"", b"", (-1 as 8 signed bytes), b""]``. The last ``buffer_steps`` batches are kept.
* **Batching**: one batch holds every event queued since the last, and batches go at most every
  ``batch_interval`` (vLLM: one batch per scheduler step); the replay socket has a thread of its
  own, so an idle publisher does not wake.

Its promises to the engine (kvstore's "never wait"): ``stored``, ``removed`` and ``cleared``
only copy what they need (the chunk digests and tokens) and queue it; encoding and sending run
in the publisher's thread. A full queue drops the events (counted in ``stats``), never blocks.

What is announced: ``stored`` announces the *full* chunks of a save (a partial last chunk is a
leaf no router can extend, as vLLM announces only full blocks), one ``BlockStored`` per call,
block = chunk (``block_size`` = chunk tokens, block hash = the chunk's digest,
``parent_block_hash`` = the previous chunk's), with the chunks' tokens so an indexer can key
them without any GPU event. With ``blocks_per_chunk`` > 1 each chunk is announced as that many
equal blocks (``wire.block_digests``: the last named by the chunk's digest), so a router that
indexes the engine's block size sees engine-sized blocks. ``watch`` turns a store's own evictions (memory, file and shm LRU)
into ``BlockRemoved``, and, with ``redis=True``, Redis's evicted and expired keys
(``kvstore.events.redis_watch``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvstore.config import build, check_options, option
from kvstore.errors import ConfigError
from kvstore.events.wire import (
    ENCODINGS,
    HASH_FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    block_digests,
    block_hash,
    encode_batch,
)
from kvstore.extras import install_hint
from kvstore.keys import ChunkKey, TokenIds, split_key, tokens_to_array
from kvstore.metrics.catalog import KV_EVENT_DROPS, KV_EVENTS
from kvstore.stores.base import Evicting, Store

__all__ = ["EventsConfig", "EventSink", "KVEventPublisher", "MEDIUMS", "medium_of", "mediums", "END_SEQ"]

log = logging.getLogger(__name__)

#: The medium each kind of store is announced as (``describe()["store"]`` -> medium).
MEDIUMS = {
    "memory": "CPU",
    "shm": "CPU_SHARED",
    "file": "DISK",
    "redis": "REDIS",
    "redis+cluster": "REDIS",
    "redis+shards": "REDIS",
    "s3": "OBJECT_STORE",
}
#: The replay stream's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``).
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_REPLAY_POLL = 500  # ms the replay thread waits for a request before it checks for close
_BATCH_MAX = 4096  # queued calls one batch takes at most


def medium_of(store: Store) -> str:
    """The medium events name ``store`` by (``MEDIUMS``; another store: its name, upper-cased)."""
    name = str(store.describe().get("store") or type(store).__name__)
    return MEDIUMS.get(name, name.upper())


def mediums(store: Store) -> list[str]:
    """The medium of each of ``store.tiers``, fastest first (what a save into it is announced as)."""
    return [medium_of(tier.store) for tier in store.tiers]


@dataclass(frozen=True)
class EventsConfig:
    """Options of the KV-event publisher (vLLM's ``KVEventsConfig``, plus the wire choices)."""

    endpoint: str = option("tcp://*:5557", help="PUB address: bound for tcp://*:PORT, ipc:// and inproc://, "
                                                "connected otherwise (vLLM's rule).")
    replay_endpoint: str = option("", help="ROUTER address serving replays of buffered batches (bound); "
                                           "empty: no replay.")
    topic: str = option("kvstore", help="First frame of every message (llm-d: kv@<pod>@<model>).")
    encoding: str = option("map", choices=ENCODINGS, help="Event form: map (vLLM 0.26 and later) or array "
                                                         "(positional, vLLM up to 0.23).")
    hash_format: str = option("int", choices=HASH_FORMATS, help="Block hashes as 64-bit integers (vLLM's "
                                                               "default) or the chunk digests' bytes.")
    buffer_steps: int = option(10_000, lo=1, hi=1_000_000, help="Batches kept for replay.")
    hwm: int = option(100_000, lo=0, hi=10_000_000, help="ZMQ high-water mark of the PUB socket (0: none).")
    max_queue_size: int = option(100_000, lo=1, hi=10_000_000,
                                 help="Calls queued for the publishing thread at most; beyond, events are dropped.")
    data_parallel_rank: int = option(0, lo=0, hi=65_535, help="Written into every batch; shifts the TCP ports.")
    blocks_per_chunk: int = option(1, lo=1, hi=4096,
                                   help="Blocks each chunk is announced as (block_size = chunk_tokens / this; "
                                        "chunk_tokens / block_size gives the engine's blocks).")
    batch_interval: float = option(0.05, kind="duration", lo=0.0, hi=1.0,
                                   help="Batches are sent at most this often; events meanwhile share one.")

    def __post_init__(self) -> None:
        check_options(self)
        if not self.endpoint:
            raise ConfigError("endpoint='' ; the publisher needs a PUB address such as tcp://*:5557")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{name}={value!r} is not a ZMQ address; accepted: tcp://, ipc:// or inproc://")

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> EventsConfig:
        return build(cls, options, where="events")


class EventSink(Protocol):
    """What a save path announces to (``KVEventPublisher``; tests may pass their own)."""

    def stored(self, keys: Sequence[ChunkKey], tokens: TokenIds, medium: str, *, first: int = 0,
               until: int | None = None, cache_salt: str = "", lora_name: str | None = None) -> int: ...


def _offset_port(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: a data-parallel rank's own address."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://") and ":" in endpoint[6:]:
        base, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{base}:{int(port) + rank}"
    return endpoint


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True)
class _Stored:
    digests: tuple[bytes, ...]
    parent: bytes | None
    tokens: Any  # a private copy of the blocks' token ids (uint32 array)
    block_size: int
    medium: str
    lora_name: str | None
    salt: str


@dataclass(frozen=True)
class _Removed:
    digests: tuple[bytes, ...]
    medium: str


_STOP = object()
_CLEARED = object()


class KVEventPublisher:
    """Publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (module docstring).

    Needs ``pyzmq`` (``ConfigError`` naming it when absent). Binding or connecting happens here,
    so a bad or busy address fails at start-up, not in the thread. Thread-safe; ``close`` sends
    what is queued (for at most ``timeout``) and releases the sockets.
    """

    def __init__(self, config: EventsConfig | None = None) -> None:
        try:
            import zmq
        except ImportError as exc:
            raise ConfigError(f"KV events need pyzmq: {install_hint('events')}") from exc
        self.config = c = config or EventsConfig()
        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._topic = c.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=c.buffer_steps)
        # A deque and an Event rather than a queue.Queue: appends and pops are atomic, so the
        # engine's thread and the publisher's never take a lock per event (only to wake it).
        self._queue: deque[Any] = deque()
        self._wake = threading.Event()
        self._seq = 0
        self._stats = {"batches": 0, "events": 0, "blocks_stored": 0, "blocks_removed": 0, "dropped": 0,
                       "replays": 0, "errors": 0, "thread_cpu_us": 0}
        self._stats_lock = threading.Lock()
        self._detach: list[Callable[[], None]] = []
        #: The Redis removal watchers ``watch(..., redis=True)`` started (closed by ``close``).
        self.redis_watchers: list[Any] = []
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: Any = None
        try:
            self._pub.set_hwm(c.hwm)
            endpoint = _offset_port(c.endpoint, c.data_parallel_rank)
            self.endpoint = self._attach(self._pub, endpoint, bind=_binds(endpoint))
            self.replay_endpoint: str | None = None
            if c.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # vLLM 0.33: room for a whole replay plus its end marker for a slow client.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (c.buffer_steps + 1))
                self.replay_endpoint = self._attach(
                    self._replay, _offset_port(c.replay_endpoint, c.data_parallel_rank), bind=True)
        except BaseException:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-events", daemon=True)
        self._thread.start()
        self._replay_thread: threading.Thread | None = None
        if self._replay is not None:
            self._replay_thread = threading.Thread(target=self._run_replay, name="kvstore-events-replay", daemon=True)
            self._replay_thread.start()

    def _attach(self, sock: Any, endpoint: str, *, bind: bool) -> str:
        """Bind or connect ``sock``; the address bound (a wildcard port resolved)."""
        try:
            if not bind:
                sock.connect(endpoint)
                return endpoint
            sock.bind(endpoint)
        except self._zmq.ZMQError as exc:
            raise ConfigError(f"cannot {'bind' if bind else 'connect'} KV-event socket {endpoint!r}: {exc}") from exc
        last: str = sock.getsockopt_string(self._zmq.LAST_ENDPOINT)
        return last or endpoint

    # -- what callers announce -------------------------------------------------------------------
    def stored(self, keys: Sequence[ChunkKey], tokens: TokenIds, medium: str, *, first: int = 0,
               until: int | None = None, cache_salt: str = "", lora_name: str | None = None) -> int:
        """Announce that ``keys[first:]`` are now stored in ``medium``; how many blocks it announces.

        ``keys`` are a prompt's chunk keys (what ``PrefixCache.save`` was given: ``chunk_keys``,
        or ``prefix_keys`` with partial chunks between the full ones) and ``tokens`` its token
        ids; ``first`` the index in ``keys`` of the first chunk written. Announced: the full
        chunks of ``keys[first:]``, in chain order up to the first gap, ending at or before
        ``until`` (the first non-text input's offset: after it, equal tokens do not mean equal
        KV, and a router keys by tokens); their parent is the full chunk before the first, which
        ``keys`` must hold unless that is the prompt's first chunk (``ValueError``). ``cache_salt``
        goes into the first chunk's ``extra_keys`` (map form), as vLLM does.
        """
        if first < 0 or first > len(keys):
            raise ValueError(f"first={first} is outside the {len(keys)} keys")
        chosen: list[ChunkKey] = []
        for k in keys[first:]:
            if k.partial:
                continue
            if (until is not None and k.end > until) or (chosen and k.index != chosen[-1].index + 1):
                break
            chosen.append(k)
        if not chosen:
            return 0
        parent: bytes | None = None
        if chosen[0].index > 0:
            before = next((k for k in keys[:first] if not k.partial and k.index == chosen[0].index - 1), None)
            if before is None:
                raise ValueError(f"the keys lack chunk {chosen[0].index - 1}, the parent of the first chunk written")
            parent = before.digest
        per = self.config.blocks_per_chunk
        if chosen[0].num_tokens % per:
            raise ValueError(f"chunks of {chosen[0].num_tokens} tokens do not split into blocks_per_chunk={per} "
                             "equal blocks")
        arr = tokens_to_array(tokens)
        if arr.shape[0] < chosen[-1].end:
            raise ValueError(f"tokens hold {arr.shape[0]} ids; the keys cover {chosen[-1].end}")
        # Only copies here (the engine's thread); hashes are converted and events encoded in the
        # publisher's thread, as vLLM's publish() only queues.
        item = _Stored(tuple(k.digest for k in chosen), parent, arr[chosen[0].start:chosen[-1].end].copy(),
                       chosen[0].num_tokens // per, medium, lora_name, cache_salt if chosen[0].index == 0 else "")
        return len(chosen) * per if self._put(item) else 0

    def removed(self, keys: Iterable[str], medium: str) -> int:
        """Announce that the store keys ``keys`` left ``medium``; foreign keys are skipped. How many
        blocks it announces."""
        digests = []
        for key in keys:
            parts = split_key(key)
            if parts is not None:
                digests.append(bytes.fromhex(parts[2]))
        if not digests:
            return 0
        return len(digests) if self._put(_Removed(tuple(digests), medium)) else 0

    def cleared(self) -> None:
        """Announce ``AllBlocksCleared``: a router drops everything this publisher announced."""
        self._put(_CLEARED)

    def watch(self, store: Store, *, redis: bool = False) -> Callable[[], None]:
        """Announce ``store``'s own evictions: every tier that evicts on its own (``Evicting``:
        memory, file, shm) and, with ``redis``, every Redis tier's evicted and expired keys (the
        server's keyspace notifications; ``kvstore.events.redis_watch``). Returns a function that
        stops watching (``close`` also does)."""
        stops: list[Callable[[], None]] = []
        for tier in store.tiers:
            inner = tier.store
            medium = medium_of(inner)
            if isinstance(inner, Evicting):
                stops.append(self._listen(inner, medium))
            elif redis and medium == "REDIS":
                from kvstore.events.redis_watch import watch_store
                watchers = watch_store(inner, self, medium=medium)
                self.redis_watchers.extend(watchers)
                stops.extend(w.close for w in watchers)

        def stop() -> None:
            for s in stops:
                s()
        self._detach.append(stop)
        return stop

    def _listen(self, store: Evicting, medium: str) -> Callable[[], None]:
        def listener(keys: Sequence[str]) -> None:
            self.removed(keys, medium)
        store.add_eviction_listener(listener)
        return lambda: store.remove_eviction_listener(listener)

    def stats(self) -> dict[str, int]:
        """Counts since start: batches and events sent, blocks announced, events dropped
        (queue full), replays served, send errors, and the publishing thread's CPU time (us)."""
        with self._stats_lock:
            return dict(self._stats)

    def _count(self, name: str, n: int = 1) -> None:
        with self._stats_lock:
            self._stats[name] += n

    def _put(self, item: Any) -> bool:
        if self._closed:
            return False
        if len(self._queue) >= self.config.max_queue_size:
            self._count("dropped")
            KV_EVENT_DROPS.inc()
            return False
        self._queue.append(item)
        if not self._wake.is_set():
            self._wake.set()
        return True

    def pending(self) -> int:
        """Calls queued and not yet sent."""
        return len(self._queue)

    # -- the publishing thread -------------------------------------------------------------------
    def _run(self) -> None:
        stop = False
        last = 0.0
        while not stop:
            self._wake.wait()
            self._wake.clear()
            # Coalesce: at most one batch per batch_interval (a burst of evictions is one batch,
            # as vLLM sends one per scheduler step, not one per block).
            wait = last + self.config.batch_interval - time.monotonic()
            if wait > 0 and self._queue and self._queue[0] is not _STOP:
                time.sleep(wait)
            items: list[Any] = []
            while self._queue and len(items) < _BATCH_MAX:
                items.append(self._queue.popleft())
            if self._queue:
                self._wake.set()  # more than one batch's worth: go round again
            if _STOP in items:
                stop = True
                items = items[:items.index(_STOP)]
            if items:
                try:
                    self._send(self._events(items))
                except Exception:  # a bad send must not end the thread: later events still go
                    self._count("errors")
                    log.exception("publishing KV events failed")
                last = time.monotonic()
            self._count("thread_cpu_us", int(time.thread_time() * 1e6) - self._stats["thread_cpu_us"])

    def _run_replay(self) -> None:
        # The replay socket lives in this thread alone (ZMQ sockets are not thread-safe); it reads
        # the buffer the publishing thread appends to (a deque: appends and copies are atomic).
        while not self._closed:
            try:
                if self._replay.poll(_REPLAY_POLL):
                    self._serve_replay()
            except self._zmq.ZMQError:
                if self._closed:
                    return
                log.exception("KV-event replay failed")
            except Exception:
                log.exception("KV-event replay failed")

    def _events(self, items: list[Any]) -> list[Event | bytes]:
        # Adjacent removals from one medium become one BlockRemoved (vLLM sends one per block;
        # a list of hashes is the same message to a router, and much cheaper to encode).
        merged: list[Any] = []
        for item in items:
            last = merged[-1] if merged else None
            if isinstance(item, _Removed) and isinstance(last, list) and last[0] == item.medium:
                last.extend(item.digests)
            else:
                merged.append([item.medium, *item.digests] if isinstance(item, _Removed) else item)
        hf, per = self.config.hash_format, self.config.blocks_per_chunk
        out: list[Event | bytes] = []
        for item in merged:
            if isinstance(item, _Stored):
                hashes = [block_hash(b, hf) for d in item.digests for b in block_digests(d, per)]
                self._count("blocks_stored", len(hashes))
                extra = [(item.salt,), *([None] * (len(hashes) - 1))] if item.salt else None
                out.append(BlockStored(hashes,
                                       None if item.parent is None else block_hash(item.parent, hf),
                                       item.tokens, item.block_size, item.medium, item.lora_name, extra))
            elif isinstance(item, list):
                hashes = [block_hash(b, hf) for d in item[1:] for b in block_digests(d, per)]
                self._count("blocks_removed", len(hashes))
                out.append(BlockRemoved(hashes, item[0]))
            else:
                out.append(AllBlocksCleared())
        return out

    def _send(self, events: list[Event | bytes]) -> None:
        c = self.config
        payload = encode_batch(time.time(), events, c.data_parallel_rank, encoding=c.encoding)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        with self._stats_lock:
            self._stats["batches"] += 1
            self._stats["events"] += len(events)
        for event in events:
            KV_EVENTS.inc(event=type(event).__name__)

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a KV-event replay request of %d frames (expected 3)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self._count("replays")

    # -- shutdown -------------------------------------------------------------------------------
    def close(self, timeout: float = 2.0) -> None:
        """Stop watching, send what is queued (at most ``timeout``), close the sockets. Idempotent."""
        if self._closed:
            return
        for stop in self._detach:
            stop()
        self._detach.clear()
        self._closed = True
        self._queue.append(_STOP)
        self._wake.set()
        self._thread.join(timeout)
        if self._replay_thread is not None:
            self._replay_thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
