"""A structured mutation fuzzer of the record format.

Each case takes a valid record (every codec chain, with and without a hidden state, unsigned
and signed) and damages it the way storage, a bad writer or an attacker would: bit and byte
flips by region (frame, header, KV body, hidden state, tag), truncations and extensions,
length-field rewrites, valid msgpack headers with fields of wrong types and values, header /
payload splices between records, foreign records, and forged checksums (payload changed, xxh3
and header CRC recomputed: only a tag can tell). The reader decodes with every expectation it
has, with and without ``out=``, and every 16th case also goes through ``PrefixCache.load``.

Asserted for every case: the only exception is ``CorruptRecordError``; a rejected record leaves
the sentinel-filled destination untouched and, through ``PrefixCache.load``, is a counted miss
whose sink never runs; an accepted record decodes to exactly the original KV and hidden state
(a mutation that changes what a reader would place is a failure); no case hangs (a
``faulthandler`` guard) and memory stays bounded (``tracemalloc`` peak of sampled cases, and
the process's peak RSS growth).

CI runs ``KVSTORE_FUZZ_CASES`` cases (default 20,000); the long mode is
``KVSTORE_FUZZ_CASES=200000 pytest -s tests/test_fuzz_records.py`` (``KVSTORE_FUZZ_SEED`` picks
another seed); it prints the count of every outcome.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import math
import os
import random
import resource
import struct
import tracemalloc
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import forge
import msgpack
import numpy as np
import pytest

from kvstore import FORMAT_VERSION, CorruptRecordError, Namespace, chunk_keys, decode_record, encode_record
from kvstore.metrics.catalog import CORRUPT
from kvstore.prefix_cache import PrefixCache
from kvstore.record import FRAME_BYTES, header_extent, read_header
from kvstore.record.auth import RecordAuth, TagKeys
from kvstore.record.codecs import resolve_chain
from kvstore.record.format import CHECKSUM_BYTES
from kvstore.stores.memory import MemoryStore

CASES = int(os.environ.get("KVSTORE_FUZZ_CASES", "20000"))
SEED = int(os.environ.get("KVSTORE_FUZZ_SEED", "20261201"))
HANG_GUARD = 600.0  # seconds for the whole run: a generous guard, not a measurement
_AUTH = RecordAuth([bytes(range(100, 132))])
_FRAME = struct.Struct("<4sHHII")


@dataclass(frozen=True)
class Base:
    """A valid record and everything its reader expects."""

    name: str
    data: bytes
    namespace: Namespace
    chunk: object
    tokens: np.ndarray
    dtype: str
    shapes: list[tuple[int, ...]]
    kv: bytes
    hidden: bytes | None
    hidden_meta: tuple[str, tuple[int, ...]]
    keys: TagKeys | None

    def expect(self) -> dict:
        return dict(namespace=self.namespace, chunk=self.chunk, tokens=self.tokens, dtype=self.dtype,
                    shapes=self.shapes, hidden_dtype=self.hidden_meta[0], hidden_shape=self.hidden_meta[1],
                    auth=self.keys)


def _bases() -> list[Base]:
    out = []
    rng = np.random.default_rng(SEED)
    for dtype, codec in (("bfloat16", "raw"), ("bfloat16", "lz4"), ("bfloat16", "shuffle-lz4"),
                         ("bfloat16", "shuffle-zstd"), ("float16", "zstd"), ("float32", "shuffle-lz4"),
                         ("float8_e4m3fn", "raw"), ("float32", "raw")):
        for signed in (False, True):
            for with_hidden in (True, False):
                salt = "tenant-a" if signed else ""
                ns = Namespace(model="fuzz", kv_dtype=dtype, layout="t", block_size=4, chunk_tokens=16,
                               layer_end=2, cache_salt=salt, key_space=_AUTH.key_space if signed else "")
                tokens = rng.integers(0, 50_000, 40)
                chunk = chunk_keys(ns, tokens)[1]  # a middle chunk: start 16
                itemsize = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}[dtype]
                shapes = [(2, 16, 2, 8)] * 2
                n = 2 * 2 * 16 * 2 * 8
                values = rng.standard_normal(n).astype(np.float32)  # smooth-ish: compressors engage
                kv = (values.tobytes() if itemsize == 4 else values.astype(np.float16).tobytes() if itemsize == 2
                      else rng.integers(0, 4, n, dtype=np.uint8).tobytes())
                hidden = rng.integers(0, 256, 32, dtype=np.uint8).tobytes() if with_hidden else None
                keys = _AUTH.for_salt(salt) if signed else None
                data = bytes(encode_record(
                    namespace=ns, chunk=chunk, tokens=tokens[16:32], dtype=dtype, shapes=shapes, kv=kv, hidden=hidden,
                    hidden_dtype="bfloat16" if with_hidden else None, hidden_shape=(16,) if with_hidden else None,
                    chain=resolve_chain(codec, itemsize), auth=keys, created=1_790_000_000.0))
                out.append(Base(f"{dtype}/{codec}/{'signed' if signed else 'plain'}/{'h' if with_hidden else '-'}",
                                data, ns, chunk, tokens[16:32], dtype, shapes, kv, hidden, ("bfloat16", (16,)), keys))
    return out


BASES = _bases()


# -- the record's anatomy --------------------------------------------------------------------------
def _parts(data: bytes) -> tuple[dict, bytes, bytes, bytes]:
    """(header dict, header bytes, payload, trailer) of a valid record."""
    header, payload, trailer = forge.split(data)
    hlen = struct.unpack_from("<I", data, 8)[0]
    return header, data[FRAME_BYTES:FRAME_BYTES + hlen], payload, trailer


def _frame(header_bytes: bytes, payload: bytes, trailer: bytes | None = None, tag: bytes = b"") -> bytes:
    """Framed, CRC agreeing; ``trailer`` as given, else ``tag`` and the checksum that agrees."""
    return forge.frame(header_bytes, payload, trailer=trailer, tag=tag)


def _regions(base: Base) -> dict[str, tuple[int, int]]:
    _, hb, payload, trailer = _parts(base.data)
    start = FRAME_BYTES + len(hb)
    end = start + len(payload)
    hidden_len = len(base.hidden or b"")
    regions = {"frame": (0, FRAME_BYTES), "header": (FRAME_BYTES, start),
               "body": (start, end - hidden_len), "checksum": (len(base.data) - CHECKSUM_BYTES, len(base.data))}
    if hidden_len:
        regions["hidden"] = (end - hidden_len, end)
    if len(trailer) > CHECKSUM_BYTES:
        regions["tag"] = (end, len(base.data) - CHECKSUM_BYTES)
    return regions


_ODD_VALUES: list[object] = [None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("nan"),
                             float("inf"), -0.0, "", "x", "bfloat16", "float32", "lz4", b"", b"\x00" * 8, b"\x00" * 32,
                             [], [0], [[]], [[-1]], [[2**40 + 1]], [[1] * 17], ["lz4", "lz4"], ["shuffle8", "zstd"],
                             ["bfloat16", [16]], ["int4", [16]], {"a": 1}, [None, None]]


# -- mutations: each returns (bytes, whether it forges the payload checksum) ------------------------
def m_flip_bits(rng: random.Random, base: Base) -> tuple[str, bytes]:
    region, (lo, hi) = rng.choice(sorted(_regions(base).items()))
    data = bytearray(base.data)
    for _ in range(rng.randint(1, 4)):
        pos = rng.randrange(lo, hi)
        data[pos] ^= 1 << rng.randrange(8)
    return f"flip_bits:{region}", bytes(data)


def m_set_bytes(rng: random.Random, base: Base) -> tuple[str, bytes]:
    region, (lo, hi) = rng.choice(sorted(_regions(base).items()))
    data = bytearray(base.data)
    pos = rng.randrange(lo, hi)
    n = rng.randint(1, min(16, hi - pos))
    fill = rng.choice([b"\x00", b"\xff", bytes([rng.randrange(256)])])
    data[pos:pos + n] = fill * n
    return f"set_bytes:{region}", bytes(data)


def m_truncate_or_extend(rng: random.Random, base: Base) -> tuple[str, bytes]:
    if rng.random() < 0.7:
        cut = rng.choice([0, 1, FRAME_BYTES - 1, FRAME_BYTES, FRAME_BYTES + 3, rng.randrange(len(base.data)),
                          len(base.data) - 1, len(base.data) - 32])
        return "truncate", base.data[:max(0, cut)]
    extra = rng.choice([b"\x00", b"\x00" * 32, os.urandom(rng.randint(1, 64)), base.data[:64]])
    return "extend", base.data + extra


def m_frame_lengths(rng: random.Random, base: Base) -> tuple[str, bytes]:
    magic, version, reserved, hlen, crc = _FRAME.unpack_from(base.data, 0)
    field = rng.choice(["hlen", "version", "reserved", "magic"])
    if field == "hlen":
        hlen = rng.choice([0, 1, hlen - 1, hlen + 1, hlen + 32, 2**20 + 1, 2**32 - 1, rng.randrange(2**32)])
    elif field == "version":
        version = rng.choice([0, 1, FORMAT_VERSION + 1, 255, 65535])
    elif field == "reserved":
        reserved = rng.randint(1, 65535)
    else:
        magic = rng.choice([b"KVSr", b"\x00\x00\x00\x00", b"SRVK"])
    return f"frame:{field}", _FRAME.pack(magic, version, reserved, hlen, crc) + base.data[FRAME_BYTES:]


def m_header_lengths(rng: random.Random, base: Base) -> tuple[str, bytes]:
    """raw_len / payload_len rewritten; the header CRC (and sometimes the checksum) made to agree."""
    header, _, payload, _ = _parts(base.data)
    field = rng.choice(["raw_len", "payload_len"])
    old = header[field]
    header[field] = rng.choice([v for v in (0, 1, old - 1, old + 1, old * 2, old * 400, 4 << 30, 2**62,
                                            old - len(base.hidden or b""), old + 32) if v != old])
    header.pop("kid", None)  # a rewritten header cannot keep a valid signature
    return f"lengths:{field}", _frame(msgpack.packb(header, use_bin_type=True), payload)


def m_header_types(rng: random.Random, base: Base) -> tuple[str, bytes]:
    """A valid msgpack header with fields of wrong types or values (CRC recomputed)."""
    header, _, payload, trailer = _parts(base.data)
    fields = sorted(header)
    for _ in range(rng.randint(1, 3)):
        action = rng.random()
        field = rng.choice(fields)
        if action < 0.7:
            header[field] = rng.choice(_ODD_VALUES)
        elif action < 0.85:
            header.pop(field, None)
        else:
            header[rng.choice(["extra", "v2", "Tag", "kid", "tag", "checksum"])] = rng.choice(_ODD_VALUES)
    packed = msgpack.packb(header, use_bin_type=True) if rng.random() < 0.9 else msgpack.packb(
        rng.choice([[header], list(header.items()), 7, "header", None]), use_bin_type=True)
    return "header_types", _frame(packed, payload, trailer)


def m_splice(rng: random.Random, base: Base) -> tuple[str, bytes]:
    """This record's header with another record's payload, as is or with the checksum made to
    agree (a forgery: only against a keyed reader, no other reader can tell it from a record)."""
    other = rng.choice([b for b in BASES if b.data != base.data])
    header, hb, payload, trailer = _parts(base.data)
    _, _, o_payload, o_trailer = _parts(other.data)
    if base.keys is None or rng.random() < 0.5:
        return "splice:raw", _frame(hb, o_payload, rng.choice([trailer, o_trailer]))
    header.update(payload_len=len(o_payload))
    header.pop("kid", None)
    return "splice:fixed", _frame(msgpack.packb(header, use_bin_type=True), o_payload)


def m_foreign(rng: random.Random, base: Base) -> tuple[str, bytes]:
    """Bytes that are not this reader's record at all."""
    kind = rng.randrange(5)
    if kind == 0:
        return "foreign:random", os.urandom(rng.randint(0, 4096))
    if kind == 1:
        return "foreign:other_record", rng.choice([b for b in BASES if b.data != base.data]).data
    if kind == 2:  # a well-formed record of another namespace, chunk or token sequence
        ns = base.namespace.with_salt(rng.choice(["other", "tenant-b", ""]) + "x")
        chunk = chunk_keys(base.namespace, np.concatenate([base.tokens[:8] + 1, base.tokens]))[rng.randrange(2)]
        use_ns = ns if rng.random() < 0.5 else base.namespace
        try:
            data = encode_record(namespace=use_ns, chunk=chunk, tokens=base.tokens[:chunk.num_tokens], dtype=base.dtype,
                                 shapes=base.shapes, kv=base.kv, chain=(), auth=base.keys)
        except ValueError:
            return "foreign:other_record", BASES[0].data
        return "foreign:other_key", bytes(data)
    if kind == 3:
        return "foreign:msgpack", _frame(msgpack.packb(rng.choice(_ODD_VALUES), use_bin_type=True), b"")
    return "foreign:text", rng.choice([b'{"v": 1}', b"KVSR", b"\x80\x04\x95", b"GET / HTTP/1.1\r\n\r\n"])


def m_forged(rng: random.Random, base: Base) -> tuple[str, bytes]:
    """Payload (KV or hidden) changed, xxh3 checksum and header CRC recomputed, tag kept or moved."""
    header, hb, payload, trailer = _parts(base.data)
    payload = bytearray(payload)
    pos = rng.randrange(len(payload))
    payload[pos] ^= 1 + rng.randrange(255)
    if rng.random() < 0.2:
        header["created"] = 1_800_000_000.0  # a covered field too
        hb = msgpack.packb(header, use_bin_type=True)
    return "forged_checksum", _frame(hb, bytes(payload), tag=trailer[:-CHECKSUM_BYTES])


MUTATIONS: list[tuple[Callable[[random.Random, Base], tuple[str, bytes]], bool]] = [
    # (mutation, applies to unsigned records too): a forged checksum fools every reader but a keyed one
    (m_flip_bits, True), (m_set_bytes, True), (m_truncate_or_extend, True), (m_frame_lengths, True),
    (m_header_lengths, True), (m_header_types, True), (m_splice, True), (m_foreign, True), (m_forged, False),
]


# -- the run -------------------------------------------------------------------------------------
def _decode(base: Base, data: bytes) -> str:
    """Decode ``data`` as ``base``'s reader would, on both paths; the case's outcome."""
    outcome = None
    for use_out in (False, True):
        out = bytearray(b"\xa5" * len(base.kv)) if use_out else None
        try:
            rec = decode_record(data, out=None if out is None else memoryview(out), **base.expect())
        except CorruptRecordError as exc:
            if out is not None:
                assert not out.strip(b"\xa5"), "a rejected record wrote into the destination"
            result = f"rejected:{exc.reason}"
        else:
            if bytes(rec.kv) != base.kv or (None if rec.hidden is None else bytes(rec.hidden)) != base.hidden:
                raise AssertionError("an accepted mutation changed what the reader would place")
            if out is not None:
                assert bytes(out) == base.kv
            result = "accepted:same"
        assert outcome in (None, result), f"the two decode paths disagree: {outcome} vs {result}"
        outcome = result
    assert outcome is not None
    _header_from_first_bytes(data)
    return outcome


def _header_from_first_bytes(data: bytes) -> None:
    """What ``kvstore gc`` reads of a record, its first bytes and its size, is judged as the
    whole record's header is: the same header (its trailer unread), or the same rejection."""
    extent = header_extent(data)
    head = data if extent is None else data[:extent]
    try:
        whole = read_header(data)
    except CorruptRecordError as exc:
        with pytest.raises(CorruptRecordError) as err:
            read_header(head, len(data))
        assert err.value.reason == exc.reason, (err.value.reason, exc.reason)
        return
    got = read_header(head, len(data))
    if len(head) < len(data) and whole.version >= 2:
        whole = dataclasses.replace(whole, checksum=b"", tag=None)
    assert got == whole


def _through_prefix_cache(base: Base, data: bytes, outcome: str) -> None:
    """The same record as a store would hand it to ``PrefixCache.load``: a counted miss, or a hit."""
    store = MemoryStore()
    store.put(base.chunk.key, data)
    cache = PrefixCache(store, base.namespace, auth=_AUTH if base.keys is not None else None)
    corrupt = CORRUPT
    reason = outcome.partition(":")[2]
    before = corrupt.value(reason=reason)
    placed = []
    result = cache.load(np.concatenate([np.zeros(16, np.int64), base.tokens]), [base.chunk],
                        lambda c, r: placed.append(bytes(r.kv)), shapes=lambda c: base.shapes,
                        hidden_dtype=base.hidden_meta[0], hidden_shape=base.hidden_meta[1])
    if outcome.startswith("rejected"):
        assert result.reason == "corrupt" and not placed and corrupt.value(reason=reason) - before == 1
        assert store.get(base.chunk.key) is None  # discarded
    else:
        assert result.reason == "hit" and placed == [base.kv]


def run_fuzz(cases: int, seed: int) -> Counter[str]:
    counts: Counter[str] = Counter()
    for i in range(cases):
        rng = random.Random(seed * 1_000_003 + i)
        base = rng.choice(BASES)
        mutation, unsigned_too = rng.choice(MUTATIONS)
        if not unsigned_too and base.keys is None:
            base = next(b for b in BASES if b.keys is not None and b.name.split("/")[:2] == base.name.split("/")[:2])
        op, data = mutation(rng, base)
        sample = i % 64 == 0
        if sample:
            tracemalloc.start()
        try:
            outcome = _decode(base, data)
            if i % 16 == 0:
                _through_prefix_cache(base, data, outcome)
        except AssertionError as exc:
            raise AssertionError(f"case {i} (seed {seed}, {op} of {base.name}): {exc}") from None
        except Exception as exc:
            raise AssertionError(f"case {i} (seed {seed}, {op} of {base.name}) raised "
                                 f"{type(exc).__name__}: {exc}") from exc
        if sample:
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            bound = 64 * max(len(base.data), len(data)) + (1 << 20)
            assert peak <= bound, f"case {i} ({op} of {base.name}) peaked at {peak} bytes (bound {bound})"
        if outcome == "accepted:same":  # say which: the mutation was a no-op, or changed nothing a reader uses
            outcome = "accepted:identical_bytes" if data == base.data else "accepted:same_kv_and_hidden"
        counts[f"{op.partition(':')[0]} -> {outcome}"] += 1
    return counts


def test_structured_mutations_are_only_ever_rejected():
    for base in BASES:  # the corpus itself decodes
        assert _decode(base, base.data) == "accepted:same"
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    faulthandler.dump_traceback_later(HANG_GUARD, exit=True)
    # One warning per discarded record is right in a deployment; pytest would keep all of them.
    quiet = logging.getLogger("kvstore.prefix_cache")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        counts = run_fuzz(CASES, SEED)
    finally:
        quiet.setLevel(level)
        faulthandler.cancel_dump_traceback_later()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 256, f"peak RSS grew by {grown_mib:.0f} MiB"
    total = sum(counts.values())
    assert total == CASES >= 10_000 or "KVSTORE_FUZZ_CASES" in os.environ
    accepted = sum(n for k, n in counts.items() if "accepted" in k)
    print(f"\nrecord fuzz: {total} cases, seed {SEED}, {accepted} accepted unchanged (no-op mutations), "
          f"peak RSS growth {grown_mib:.0f} MiB")
    for key, n in sorted(counts.items()):
        print(f"  {n:8d}  {key}")
    # Mutations that should never be accepted at all: a forged checksum against a keyed reader, a
    # foreign record, a splice of two different records.
    for key, n in counts.items():
        if key.startswith(("forged_checksum", "foreign", "splice", "lengths")):
            assert "accepted" not in key, (key, n)
    assert math.fsum(n for k, n in counts.items() if "rejected" in k) > 0.9 * total
