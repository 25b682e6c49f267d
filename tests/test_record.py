"""Record codec: golden fixtures, round trips, and a fuzzed decoder that only ever says 'corrupt'."""

from __future__ import annotations

import dataclasses
import math
import struct

import forge
import msgpack
import numpy as np
import pytest
from golden_records import CASE_VERSIONS, CASES, HEADS, case_inputs, encode_case, fixture
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore import CorruptRecordError, Namespace, chunk_keys, decode_record, encode_record, read_header
from kvstore.errors import ConfigError, KVStoreError
from kvstore.record import DTYPES, FRAME_BYTES, header_extent
from kvstore.record.codecs import CHAINS, resolve_chain

NS = Namespace(model="m", kv_dtype="bfloat16", layout="t", block_size=4, chunk_tokens=8, layer_end=2)


# -- golden records -----------------------------------------------------------------------------
@pytest.mark.parametrize("name, version", CASE_VERSIONS)
def test_golden_record_decodes(name, version):
    ns, chunk, tokens, dtype, shapes, kv, hidden, hidden_meta, chain = case_inputs(name, version=version)
    data = fixture(name, version).read_bytes()
    rec = decode_record(data, namespace=ns, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes)
    assert rec.header.version == version
    assert bytes(rec.kv) == kv
    assert (None if rec.hidden is None else bytes(rec.hidden)) == hidden
    assert rec.header.codecs == tuple(chain)
    assert rec.header.created == 1_790_000_000.0
    assert rec.header.heads == (HEADS[name][0].as_tuple() if name in HEADS else None)


@pytest.mark.parametrize("name", sorted(CASES))
def test_encoder_still_writes_the_golden_bytes(name):
    # If this fails the wire format changed: bump FORMAT_VERSION and keep the old fixtures decoding.
    assert encode_case(name) == fixture(name).read_bytes()


# -- round trips and expectations ---------------------------------------------------------------
def _record(chain=(), hidden=True, tokens=None):
    tokens = list(range(8)) if tokens is None else tokens
    chunk = chunk_keys(NS, tokens)[0]
    kv = np.arange(2 * 2 * 8 * 3 * 4, dtype=np.uint16).tobytes()
    h = np.arange(16, dtype=np.uint16).tobytes() if hidden else None
    data = encode_record(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=[(2, 8, 3, 4)] * 2,
                         kv=kv, hidden=h, hidden_dtype="bfloat16" if hidden else None,
                         hidden_shape=(16,) if hidden else None, chain=chain)
    return bytes(data), chunk, tokens, kv, h


@pytest.mark.parametrize("codec", sorted(CHAINS))
def test_roundtrip_every_codec(codec):
    data, chunk, tokens, kv, h = _record(resolve_chain(codec, 2))
    rec = decode_record(data, namespace=NS, chunk=chunk, tokens=tokens)
    assert bytes(rec.kv) == kv and bytes(rec.hidden) == h


@pytest.mark.parametrize("codec", sorted(CHAINS))
def test_decode_into_callers_buffer(codec):
    data, chunk, tokens, kv, _ = _record(resolve_chain(codec, 2))
    out = bytearray(len(kv))
    rec = decode_record(data, chunk=chunk, out=memoryview(out))
    assert bytes(out) == kv and rec.kv.obj is out  # written in place, no new buffer handed back


@pytest.mark.parametrize("name, version", CASE_VERSIONS)
def test_a_header_read_from_the_first_bytes_is_the_whole_records(name, version):
    data = fixture(name, version).read_bytes()
    whole = read_header(data)
    extent = header_extent(data)
    assert extent is not None and FRAME_BYTES < extent < len(data)
    head = read_header(data[:extent], len(data))
    if version >= 2:  # its trailer was not read
        assert head.checksum == b"" and head.tag is None
        whole = dataclasses.replace(whole, checksum=b"", tag=None)
    assert head == whole
    with pytest.raises(CorruptRecordError) as err:
        read_header(data[:extent - 1], len(data))  # the header cut short
    assert err.value.reason == "truncated"
    with pytest.raises(CorruptRecordError):
        read_header(data[:extent], len(data) + 1)  # one byte more than the header says
    with pytest.raises(ValueError):
        read_header(data, len(data) - 1)
    assert header_extent(data[:FRAME_BYTES - 1]) is None and header_extent(b"x" * 64) is None


def test_raw_decode_is_a_view_of_the_input():
    data, *_ = _record(hidden=False)
    buf = bytearray(data)
    rec = decode_record(buf)
    assert isinstance(rec.kv, memoryview) and rec.kv.obj is buf


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_the_trailer_is_computed_as_the_pieces_stream(codec):
    from kvstore.record import encode_record_pieces

    data, chunk, tokens, kv, h = _record(resolve_chain(codec, 2))
    pieces = encode_record_pieces(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16",
                                  shapes=[(2, 8, 3, 4)] * 2, kv=kv, hidden=h, hidden_dtype="bfloat16",
                                  hidden_shape=(16,), chain=resolve_chain(codec, 2), created=read_header(data).created)
    streamed = [bytes(p) for p in pieces.stream(slice_bytes=64)]
    assert max(len(p) for p in streamed) == 64 and len(streamed[-1]) == 8  # slices, then the checksum
    assert b"".join(streamed) == data == pieces.tobytes() and len(pieces) == len(data)


@pytest.mark.parametrize("codec", ["raw", "lz4"])
def test_kv_in_parts_encodes_the_record_of_the_joined_bytes(codec):
    """A paged cache's blocks go in as the KV's parts, in record order: the same record as their
    bytes joined (a codec joins them first), the parts sent as they are."""
    from kvstore.record import encode_record_pieces

    data, chunk, tokens, kv, h = _record(resolve_chain(codec, 2))
    view = memoryview(kv)
    parts = [view[:5], view[5:5], view[5:100], bytearray(view[100:101]), view[101:]]
    pieces = encode_record_pieces(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16",
                                  shapes=[(2, 8, 3, 4)] * 2, kv=parts, hidden=h, hidden_dtype="bfloat16",
                                  hidden_shape=(16,), chain=resolve_chain(codec, 2), created=read_header(data).created)
    assert pieces.tobytes() == data
    if codec == "raw":
        assert any(p.obj is kv for p in pieces.parts if isinstance(p, memoryview))  # no copy of the KV
    with pytest.raises(ValueError, match="need"):
        encode_record_pieces(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=[(2, 8, 3, 4)] * 2,
                             kv=parts[:-1])


def test_a_digest_computed_on_arrival_stands_in_for_hashing_the_record():
    import xxhash

    data, chunk, tokens, kv, _ = _record()
    right = xxhash.xxh3_64_digest(data[:-8])
    assert bytes(decode_record(data, chunk=chunk, tokens=tokens, digest=right).kv) == kv
    damaged = bytearray(data)
    damaged[100] ^= 1  # what arrived is damaged, and so is the digest of what arrived
    with pytest.raises(CorruptRecordError) as err:
        decode_record(bytes(damaged), digest=xxhash.xxh3_64_digest(bytes(damaged[:-8])))
    assert err.value.reason == "checksum"
    with pytest.raises(CorruptRecordError):
        decode_record(data, digest=bytes(8))


def test_a_payload_and_trailer_under_another_header_are_rejected():
    # Both records have the same lengths, so only the checksum's binding to its header tells.
    a, chunk, tokens, *_ = _record(hidden=False)
    b = bytes(encode_record(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=[(2, 8, 3, 4)] * 2,
                            kv=bytes(2 * 2 * 8 * 3 * 4 * 2)))
    hlen_a, hlen_b = struct.unpack_from("<I", a, 8)[0], struct.unpack_from("<I", b, 8)[0]
    spliced = a[:FRAME_BYTES + hlen_a] + b[FRAME_BYTES + hlen_b:]
    assert len(spliced) == len(a)
    with pytest.raises(CorruptRecordError) as err:
        decode_record(spliced, namespace=NS, chunk=chunk, tokens=tokens)
    assert err.value.reason == "checksum"


def test_encode_into_reusable_buffer():
    data, chunk, tokens, kv, h = _record()
    out = bytearray()
    view = encode_record(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=[(2, 8, 3, 4)] * 2,
                         kv=kv, hidden=h, hidden_dtype="bfloat16", hidden_shape=(16,), created=read_header(data).created)
    view2 = encode_record(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=[(2, 8, 3, 4)] * 2,
                          kv=kv, hidden=h, hidden_dtype="bfloat16", hidden_shape=(16,), out=out,
                          created=read_header(data).created)
    assert bytes(view2) == bytes(view) == data


@pytest.mark.parametrize("kwargs, reason", [
    (dict(namespace=Namespace(model="other", kv_dtype="bfloat16", layout="t", block_size=4, chunk_tokens=8)), "namespace"),
    (dict(tokens=[0, 1, 2, 3, 4, 5, 6, 99]), "tokens"),
    (dict(dtype="float16"), "shape"),
    (dict(shapes=[(2, 8, 3, 4)]), "shape"),
])
def test_foreign_or_mismatched_records_are_corrupt(kwargs, reason):
    data, *_ = _record()
    with pytest.raises(CorruptRecordError) as err:
        decode_record(data, **kwargs)
    assert err.value.reason == reason


def test_a_record_of_other_heads_is_rejected():
    """A record names its head range in its header: read as another range (a key whose suffix was
    changed, or a record moved under another range's key), it is corrupt, never scattered into
    other heads."""
    from kvstore.keys import HeadRange

    tokens = list(range(8))
    chunk = chunk_keys(NS, tokens, heads=HeadRange(0, 1, 2))[0]
    kv = np.arange(2 * 8 * 12, dtype=np.uint16).tobytes()
    data = bytes(encode_record(namespace=NS, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=[(8, 12)] * 2, kv=kv))
    assert decode_record(data, chunk=chunk).header.heads == (0, 1, 2)
    for other in (chunk.with_heads(HeadRange(1, 2, 2)), chunk.with_heads(HeadRange(0, 1, 4)), chunk.with_heads(None)):
        with pytest.raises(CorruptRecordError) as err:
            decode_record(data, chunk=other)
        assert err.value.reason == "heads"


def test_record_under_the_wrong_key_is_rejected():
    data, *_ = _record()
    other = chunk_keys(NS, list(range(1, 9)))[0]
    with pytest.raises(CorruptRecordError) as err:
        decode_record(data, chunk=other)
    assert err.value.reason == "key"


@pytest.mark.parametrize("damage, reason", [
    (lambda d: d[:10], "truncated"),
    (lambda d: d[:-1], "truncated"),
    (lambda d: d + b"x", "header"),
    (lambda d: b"XXXX" + d[4:], "foreign"),
    (lambda d: d[:4] + struct.pack("<H", 9) + d[6:], "version"),
    (lambda d: d[:FRAME_BYTES + 3] + bytes([d[FRAME_BYTES + 3] ^ 1]) + d[FRAME_BYTES + 4:], "checksum"),
    (lambda d: d[:-5] + bytes([d[-5] ^ 0x40]) + d[-4:], "checksum"),
    (lambda d: b"", "truncated"),
])
def test_damaged_records_are_corrupt(damage, reason):
    data, *_ = _record()
    with pytest.raises(CorruptRecordError) as err:
        decode_record(damage(data))
    assert err.value.reason == reason
    assert isinstance(err.value, ValueError) and isinstance(err.value, KVStoreError)


def test_encode_rejects_inconsistent_input():
    chunk = chunk_keys(NS, list(range(8)))[0]
    with pytest.raises(ValueError, match="need"):
        encode_record(namespace=NS, chunk=chunk, tokens=list(range(8)), dtype="bfloat16", shapes=[(4,)], kv=b"123")
    with pytest.raises(ValueError, match="covers 8 tokens"):
        encode_record(namespace=NS, chunk=chunk, tokens=[1, 2], dtype="bfloat16", shapes=[(1,)], kv=b"12")
    with pytest.raises(ValueError, match="not supported"):
        encode_record(namespace=NS, chunk=chunk, tokens=list(range(8)), dtype="int4", shapes=[(1,)], kv=b"1")


def test_unknown_codec_name_is_a_config_error():
    with pytest.raises(ConfigError, match="codec='snappy' is not known; accepted: raw, lz4"):
        resolve_chain("snappy", 2)


# -- property-based -----------------------------------------------------------------------------
_dtypes = st.sampled_from(sorted(DTYPES))
_shapes = st.lists(st.lists(st.integers(0, 6), min_size=1, max_size=4).map(tuple), min_size=1, max_size=4)


@settings(max_examples=300, deadline=None)
@given(dtype=_dtypes, shapes=_shapes, codec=st.sampled_from(sorted(CHAINS)), ntok=st.integers(1, 8),
       hidden=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_roundtrip_random_shapes_and_dtypes(dtype, shapes, codec, ntok, hidden, seed):
    rng = np.random.default_rng(seed)
    ns = Namespace(model="m", kv_dtype=dtype, layout="t", block_size=4, chunk_tokens=8)
    tokens = rng.integers(0, 2**31, ntok)
    chunk = chunk_keys(ns, tokens)[0]
    n = DTYPES[dtype] * sum(math.prod(s) for s in shapes)
    kv = rng.integers(0, 4, n, dtype=np.uint8).tobytes()  # low entropy so compressors engage
    h = rng.integers(0, 256, 8, dtype=np.uint8).tobytes() if hidden else None
    data = encode_record(namespace=ns, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes, kv=kv, hidden=h,
                         hidden_dtype="float32" if hidden else None, hidden_shape=(2,) if hidden else None,
                         chain=resolve_chain(codec, DTYPES[dtype]))
    rec = decode_record(data, namespace=ns, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes)
    assert bytes(rec.kv) == kv
    assert (None if rec.hidden is None else bytes(rec.hidden)) == h


def _decode_or_corrupt(data: bytes) -> None:
    try:
        decode_record(data)
    except CorruptRecordError:
        pass


def _framed(header: bytes, payload: bytes) -> bytes:
    return forge.frame(header, payload)


_VALID = [_record(chain)[0] for chain in ((), ("lz4",), ("shuffle2", "lz4"), ("shuffle2", "zstd"))]
_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_FIELDS = ["v", "ns", "key", "start", "partial", "tokens", "dtype", "shapes", "hidden", "codecs", "raw_len",
           "payload_len", "created"]


@st.composite
def _hostile_records(draw):
    kind = draw(st.integers(0, 3))
    if kind == 0:  # arbitrary bytes
        return draw(st.binary(max_size=300))
    base = draw(st.sampled_from(_VALID))
    if kind == 1:  # byte-level mutations of a valid record
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 6))):
            op = draw(st.integers(0, 2))
            pos = draw(st.integers(0, len(data) - 1)) if data else 0
            if op == 0 and data:
                data[pos] ^= draw(st.integers(1, 255))
            elif op == 1:
                del data[pos:pos + draw(st.integers(1, 64))]
            else:
                data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        return bytes(data)
    header, payload, _ = forge.split(base)
    if kind == 2:  # a correctly framed header with fields replaced by arbitrary values
        for field in draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=3)):
            if draw(st.booleans()):
                header[field] = draw(_msgpack_values)
            else:
                header.pop(field, None)
        return _framed(msgpack.packb(header, use_bin_type=True), payload)
    # kind 3: framed arbitrary msgpack, or a consistent header over a payload that lies
    if draw(st.booleans()):
        return _framed(msgpack.packb(draw(_msgpack_values), use_bin_type=True), payload)
    return forge.reframe(header, draw(st.binary(max_size=len(payload) + 8)))


@settings(max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_hostile_records())
def test_decoder_fuzz_only_raises_corrupt_record_error(data):
    _decode_or_corrupt(data)


def test_zstd_frame_that_declares_more_than_raw_len_is_rejected_before_allocating():
    # A consistent header (checksum included) over a zstd frame that expands to 64 MiB: zstandard
    # would allocate what the frame declares, whatever max_output_size says.
    import zstandard

    header, _, _ = forge.split(_record(("shuffle2", "zstd"), hidden=False)[0])
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    with pytest.raises(CorruptRecordError) as info:
        decode_record(forge.reframe(header, bomb))
    assert info.value.reason == "codec" and "declares" in str(info.value)


# -- exactly what this version writes, and what the reader expects (issue 11) ---------------------
def _split(data: bytes):
    return forge.split(data)[:2]


def _reframe(header: dict, payload: bytes) -> bytes:
    """A record whose header fields were changed, with checksums that agree (a deliberate writer)."""
    return forge.reframe(header, payload)


def _rejected_everywhere(data: bytes, reason: str, **expect) -> None:
    """Rejected with ``reason`` with and without ``out=``; a sentinel-filled ``out`` stays untouched."""
    with pytest.raises(CorruptRecordError) as err:
        decode_record(data, **expect)
    assert err.value.reason == reason, err.value
    try:
        raw_len = read_header(data).raw_len
    except CorruptRecordError:
        raw_len = 64
    out = bytearray(b"\xa5" * raw_len)
    with pytest.raises(CorruptRecordError) as err:
        decode_record(data, out=memoryview(out), **expect)
    assert err.value.reason == reason, err.value
    assert out == b"\xa5" * raw_len


def test_one_element_shuffle_payload_never_fills_a_callers_buffer():
    # The bug: a shuffle payload of one element broadcast over the whole destination with out=.
    data, *_ = _record(("shuffle2", "lz4"), hidden=False)
    header, _ = _split(data)
    _rejected_everywhere(_reframe(dict(header, codecs=["shuffle2"]), b"\x01\x02"), "codec")
    out = bytearray(8)
    from kvstore.record import codecs

    with pytest.raises(CorruptRecordError):
        codecs._unshuffle(b"\x01\x02", 2, memoryview(out))
    assert out == bytes(8)


def test_zstd_payload_with_trailing_bytes_is_rejected():
    data, *_ = _record(("shuffle2", "zstd"), hidden=False)
    header, payload = _split(data)
    _rejected_everywhere(_reframe(header, payload + b"\x00"), "codec")
    import zstandard  # a second whole frame after the first is trailing data too

    _rejected_everywhere(_reframe(header, payload + zstandard.ZstdCompressor().compress(b"x")), "codec")


@pytest.mark.parametrize("change, reason", [
    (lambda h: dict(h, codecs=["shuffle4", "lz4"]), "codec"),          # filter of another element size
    (lambda h: dict(h, codecs=["lz4", "lz4"]), "codec"),               # two compressors
    (lambda h: dict(h, codecs=["shuffle2", "shuffle2", "lz4"]), "codec"),
    (lambda h: dict(h, extra=1), "header"),                             # a field this version does not write
    (lambda h: {k: v for k, v in h.items() if k != "created"}, "header"),
    (lambda h: dict(h, kid=b"12345678"), "truncated"),                  # signed, but no tag in the trailer
    (lambda h: dict(h, tag=bytes(32)), "header"),                       # version 1's place of the tag
    (lambda h: dict(h, checksum=bytes(8)), "header"),                   # version 1's place of the checksum
    (lambda h: dict(h, created=float("nan")), "header"),
    (lambda h: dict(h, created=-1.0), "header"),
    (lambda h: dict(h, shapes=[]), "header"),
    (lambda h: dict(h, shapes=[[]]), "header"),
    # Every layer's shape equal to the first by value, one with a float or a bool in it (2.0 == 2,
    # True == 1): the same bytes, but not a shape of ints.
    (lambda h: dict(h, shapes=h["shapes"][:-1] + [[float(d) for d in h["shapes"][-1]]]), "header"),
    (lambda h: dict(h, shapes=[[2, 1, 8, 3, 4], [2, True, 8, 3, 4]]), "header"),
    (lambda h: dict(h, tokens=b""), "header"),
    (lambda h: dict(h, start=1 << 41), "header"),
    (lambda h: dict(h, hidden=["bfloat16", []]), "header"),
    (lambda h: dict(h, hidden=["bfloat16", [16], 1]), "header"),
    (lambda h: dict(h, partial=0), "header"),
    (lambda h: dict(h, heads=[1, 1, 2]), "header"),                    # an empty head range
    (lambda h: dict(h, heads=[0, 3, 2]), "header"),                    # past the model's heads
    (lambda h: dict(h, heads=[0, 1]), "header"),
    (lambda h: dict(h, heads=[0, 1.0, 2]), "header"),
    (lambda h: dict(h, heads=[0, 1, 5000]), "header"),
    (lambda h: {k: v for k, v in h.items() if k != "heads"}, "header"),  # version 2's header
])
def test_inconsistent_headers_are_rejected(change, reason):
    data, *_ = _record(("shuffle2", "lz4"))
    header, payload = _split(data)
    _rejected_everywhere(_reframe(change(header), payload), reason)


def test_a_repeated_header_field_is_rejected():
    data, *_ = _record()
    header, payload = _split(data)
    packed = msgpack.packb(header, use_bin_type=True)
    # Map with one more entry: "dtype" given twice (the last would win in a plain dict).
    n = len(header) + 1
    body = packed[3:] if packed[0] == 0xDE else packed[1:]
    dup = bytes([0xDE]) + struct.pack(">H", n) + body + msgpack.packb("dtype") + msgpack.packb("float16")
    _rejected_everywhere(_framed(dup, payload), "header")


def test_uncompressed_records_with_trailing_or_missing_bytes_are_rejected():
    data, *_ = _record(hidden=False)
    header, payload = _split(data)
    _rejected_everywhere(_reframe(header, payload + b"\x00\x00"), "header")
    _rejected_everywhere(_reframe(header, payload[:-2]), "header")


def test_hidden_state_is_checked_against_the_readers_model():
    data, chunk, tokens, kv, h = _record()  # hidden: bfloat16 [16]
    rec = decode_record(data, hidden_dtype="bfloat16", hidden_shape=(16,))
    assert bytes(rec.hidden) == h
    _rejected_everywhere(data, "shape", hidden_shape=(32,))
    _rejected_everywhere(data, "shape", hidden_dtype="float32")
    _rejected_everywhere(data, "shape", hidden_dtype="bfloat16", hidden_shape=(1, 16))
    plain, *_ = _record(hidden=False)  # no hidden state at all: fine, there is none to misuse
    assert decode_record(plain, hidden_dtype="float32", hidden_shape=(99,)).hidden is None


def test_a_destination_of_the_wrong_size_rejects_the_record_untouched():
    for chain in ((), ("lz4",), ("shuffle2", "lz4"), ("shuffle2", "zstd")):
        data, _, _, kv, _ = _record(chain)
        for size in (len(kv) - 2, len(kv) + 2, 0):
            out = bytearray(b"\x5a" * size)
            with pytest.raises(CorruptRecordError) as err:
                decode_record(data, out=memoryview(out))
            assert err.value.reason == "shape" and out == b"\x5a" * size
