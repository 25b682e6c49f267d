"""Saves that send records straight from a CPU cache's blocks (``KVTransfer(save_from_blocks=True)``,
the default): every store that sends or copies a value before ``put`` returns gets the blocks as
the payload's pieces (no gather), on real servers (redis-server, Redis Cluster, shards, rclone S3)
and local stores; the records hold what a gathered save's hold; a store that queues writes
(a tiered store's background writers) gets a gathered lease instead, so blocks the engine reuses
after the save returns never reach a record; many small pieces survive partial sends."""

from __future__ import annotations

import shutil
import socket
import threading
import uuid

import pytest
import torch
from test_landing import SAVED, TOKENS, N, _cache, _same, _xfer, shard_servers  # noqa: F401 - a fixture

from kvstore.buffers import Pieces
from kvstore.paged import KVTransfer, slots_from_block_table
from kvstore.paged.host import HostCopies
from kvstore.record import RecordAuth, decode_record
from kvstore.stores import TieredStore, open_store
from kvstore.stores.memory import MemoryStore
from kvstore.stores.redis import hooks


def _no_gather(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count ``HostCopies._gather`` calls (they still run)."""
    calls: list[int] = []
    real = HostCopies._gather

    def counted(self, slots, host):
        calls.append(slots.numel())
        return real(self, slots, host)

    monkeypatch.setattr(HostCopies, "_gather", counted)
    return calls


def _payloads(store) -> dict[str, tuple[bytes, bytes | None]]:
    """Every record's KV and hidden bytes, by key."""
    out = {}
    for key in store.iter_keys():
        record = decode_record(store.get(key))
        out[key] = (bytes(record.kv), None if record.hidden is None else bytes(record.hidden))
    return out


@pytest.fixture(params=["redis", "cluster", "shards", "s3", "file", "shm", "memory"])
def url(request, redis_server, tmp_path):
    kind = request.param
    if kind == "redis":
        redis_server.flushall()
        yield redis_server.url
    elif kind == "cluster":
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        yield cluster.url
    elif kind == "shards":
        shards = request.getfixturevalue("shard_servers")
        for s in shards:
            s.flushall()
        yield "redis+shards://" + ",".join(f"127.0.0.1:{s.port}" for s in shards)
    elif kind == "s3":
        yield request.getfixturevalue("s3_server").url_for(f"blocks-{uuid.uuid4().hex[:8]}/")
    elif kind == "file":
        yield f"file://{tmp_path}/kv"
    elif kind == "shm":
        name = f"blocks-{uuid.uuid4().hex[:12]}"
        yield f"shm://{name}?max_bytes=16MiB"
        shutil.rmtree(f"/dev/shm/kvstore-{name}", ignore_errors=True)
    else:
        yield "memory://"


@pytest.mark.parametrize("case", ["cpu", "flash"])
def test_a_save_sends_the_blocks_themselves_and_stores_what_a_gathered_save_stores(url, case, monkeypatch):
    layout, caches = _cache(case)
    hidden = torch.randn(32, 6)
    gathers = _no_gather(monkeypatch)
    auth = RecordAuth([b"k" * 32])
    with open_store(url) as store:
        assert not store.queues_writes
        assert _xfer(store, layout, caches, auth=auth).save_sequence(TOKENS, SAVED, hidden_states=hidden) == 4
        assert gathers == []  # no chunk was gathered: the store read the blocks
        reference = MemoryStore()
        gathered = KVTransfer(_xfer(reference, layout, caches, auth=auth).cache, caches, layout,
                              save_from_blocks=False)
        assert gathered.save_sequence(TOKENS, SAVED, hidden_states=hidden) == 4
        assert len(gathers) == 4
        assert _payloads(store) == _payloads(reference)  # each checksum checked by the decoder
        fresh = [torch.zeros_like(c) for c in caches]
        slots = slots_from_block_table(list(range(12, 20)), N, 32)
        n, h = _xfer(store, layout, fresh, auth=auth).load_sequence(TOKENS, slots)  # tags checked
        assert n == 32 and torch.equal(h, hidden[-1])
        assert _same(layout, caches, SAVED, fresh, slots)


def test_a_compressed_save_gathers_for_its_codec(monkeypatch):
    layout, caches = _cache("cpu")
    gathers = _no_gather(monkeypatch)
    store = MemoryStore()
    assert _xfer(store, layout, caches, codec="lz4").save_sequence(TOKENS, SAVED) == 4
    assert len(gathers) == 4
    fresh = [torch.zeros_like(c) for c in caches]
    assert _xfer(store, layout, fresh, codec="lz4").load_sequence(TOKENS, SAVED)[0] == 32
    assert _same(layout, caches, SAVED, fresh, SAVED)


@pytest.mark.parametrize("upper", ["none", "memory"])
def test_a_queueing_store_gets_a_gathered_lease_and_reused_blocks_never_reach_a_record(redis_server, upper,
                                                                                        monkeypatch):
    """The tiered store's writers send after ``save_sequence`` returns, when the engine may have
    reused the blocks: what they send is the gathered copy."""
    redis_server.flushall()
    layout, caches = _cache("flash")
    original = [c.clone() for c in caches]
    gathers = _no_gather(monkeypatch)
    urls = [redis_server.url] if upper == "none" else ["memory://", redis_server.url]
    with TieredStore.from_urls(urls) as tiered:
        assert tiered.queues_writes
        shared = tiered.tiers[-1]
        released = threading.Event()
        write = shared.write

        def held(batch):  # the background writer sends only once the blocks are overwritten
            assert released.wait(10)
            return write(batch)

        monkeypatch.setattr(shared, "write", held)
        assert _xfer(tiered, layout, caches).save_sequence(TOKENS, SAVED) == 4
        assert len(gathers) == 4
        for c in caches:  # the engine reuses the blocks
            c.fill_(3)
        released.set()
        assert tiered.flush(10)
    with open_store(redis_server.url) as below:
        fresh = [torch.zeros_like(c) for c in caches]
        slots = slots_from_block_table(list(range(12, 20)), N, 32)
        assert _xfer(below, layout, fresh).load_sequence(TOKENS, slots)[0] == 32
        assert _same(layout, original, SAVED, fresh, slots)


def test_blocks_overwritten_after_a_save_to_a_sending_store_are_not_in_its_records(redis_server):
    redis_server.flushall()
    layout, caches = _cache("cpu")
    original = [c.clone() for c in caches]
    with open_store(redis_server.url) as store:
        assert _xfer(store, layout, caches).save_sequence(TOKENS, SAVED) == 4
        for c in caches:
            c.fill_(3)
        fresh = [torch.zeros_like(c) for c in caches]
        assert _xfer(store, layout, fresh).load_sequence(TOKENS, SAVED)[0] == 32
        assert _same(layout, original, SAVED, fresh, SAVED)


class _JoinedOnly:
    """A socket without ``sendmsg`` (as TLS sockets have none): ``send_all`` joins and sends."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def sendall(self, data) -> None:
        self.sent.append(bytes(data))


@pytest.mark.parametrize("joined", [False, True])
def test_send_all_sends_thousands_of_pieces_in_order_through_partial_sends(joined):
    rng = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 40_000, (3000,), generator=rng).tolist()
    parts = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    value = Pieces(parts)
    packed = [b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % value.nbytes, value, b"\r\n"]
    expected = packed[0] + b"".join(parts) + b"\r\n"
    if joined:
        sock = _JoinedOnly()
        hooks.send_all(sock, packed)
        assert b"".join(sock.sent) == expected
        return
    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # many partial sendmsg calls
    a.settimeout(5)
    got = bytearray()

    def read() -> None:
        while len(got) < len(expected):
            chunk = b.recv(1 << 16)
            if not chunk:
                return
            got.extend(chunk)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        hooks.send_all(a, packed)
        reader.join(10)
    finally:
        a.close()
        b.close()
    assert bytes(got) == expected
