"""Landing a record as it arrives: its KV bytes straight into the reader's memory.

``land_record`` makes ``decode_record``'s checks of the frame, the header and the reader's
expectations (``kvstore.record.parse``) before any KV byte lands in the reader's destination;
``verify_landed`` checks the checksum and tag once the last byte is in. Until it accepts the
record, the destination holds bytes no one may use: after a failure, the failed record's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from kvstore.errors import CorruptRecordError
from kvstore.keys import FORMAT_VERSION, ChunkKey, Namespace, TokenIds
from kvstore.record.auth import TAG_BYTES, TagKeys
from kvstore.record.format import CHECKSUM_BYTES, FRAME, FRAME_BYTES, MAX_HEADER_BYTES, Record, RecordHeader
from kvstore.record.parse import check_expected, parse_header


class Landing:
    """Where ``land_record`` put one record: after its run, ``kv`` holds the destination buffers
    its KV bytes went to (empty: the whole record went to the view, for ``decode_record``).

    A reader may get the key's value from somewhere other than the run that landed it (a tier
    that failed mid-record, then the tier below; a retry on a fresh buffer): ``landed_in(view)``
    says whether the value in ``view`` is the one whose KV went to the destination."""

    __slots__ = ("header", "kv", "payload_at", "view")

    def __init__(self) -> None:
        self.header: RecordHeader | None = None
        self.payload_at = 0
        self.kv: tuple[memoryview, ...] = ()
        self.view: memoryview | None = None

    def landed_in(self, view: memoryview) -> bool:
        """Whether the last ``land_record`` run landed the record now in ``view`` (that very
        memoryview object, kept alive here so that no other buffer's view can take its id)."""
        return self.header is not None and self.view is view


def land_record(
    view: memoryview,
    landing: Landing,
    destination: Callable[[], Sequence[memoryview] | None],
    *,
    namespace: Namespace | None = None,
    chunk: ChunkKey | None = None,
    tokens: TokenIds | None = None,
    dtype: str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    hidden_dtype: str | None = None,
    hidden_shape: Sequence[int] | None = None,
) -> Iterator[Sequence[memoryview]]:
    """Where a record of ``len(view)`` bytes arriving in order should land (``Store.get_into``'s
    ``place``): its frame and header into ``view``, then, once they arrived and passed every
    check ``decode_record`` makes of them (frame, fields, lengths, and the reader's expectations
    given here), its KV bytes into ``destination()``'s buffers (their sizes must add up to the
    record's ``raw_len``) and the rest (hidden state, trailer) into ``view`` again.

    Only an uncompressed version-2 record lands in the destination: a foreign, malformed,
    mismatched or compressed one, or one ``destination`` declines (None), lands whole in
    ``view``, where ``decode_record`` then judges it. A landed record's checksum and tag are
    only known once its last byte is in: ``verify_landed`` checks them, and until it accepts
    the record its destination holds bytes no one may use. Each run starts ``landing`` afresh:
    what an earlier, abandoned run landed no longer counts."""
    landing.header, landing.kv, landing.view = None, (), view
    size = len(view)
    if size <= FRAME_BYTES:
        yield (view,)
        return
    yield (view[:FRAME_BYTES],)
    _, version, _, header_len, _ = FRAME.unpack_from(view, 0)
    if version != FORMAT_VERSION or not 0 < header_len <= min(MAX_HEADER_BYTES, size - FRAME_BYTES):
        yield (view[FRAME_BYTES:],)
        return
    payload_at = FRAME_BYTES + header_len
    yield (view[FRAME_BYTES:payload_at],)
    try:
        header, at = parse_header(view)  # the trailer has not arrived: verify_landed reads it
        check_expected(header, namespace, chunk, tokens, dtype, shapes, hidden_dtype, hidden_shape)
        kv = None if header.codecs else destination()
    except CorruptRecordError:
        kv = None
    if kv is None or sum(map(len, kv)) != header.raw_len:
        yield (view[payload_at:],)
        return
    landing.header, landing.payload_at, landing.kv = header, at, tuple(kv)
    yield landing.kv
    yield (view[at + header.raw_len:],)


def verify_landed(view: memoryview, landing: Landing, *, auth: TagKeys | None = None,
                  digest: bytes | None = None) -> Record:
    """The record ``land_record`` landed, once every byte is in: its checksum against
    ``digest`` (the store's ``ArrivalDigest`` of every byte, wherever it landed; required) and,
    with ``auth``, its tag over the header, the KV where it lies and the hidden state. A
    ``CorruptRecordError`` if either fails: the destination then holds the failed record's bytes."""
    header = landing.header
    if header is None or not landing.landed_in(view):
        raise ValueError("verify_landed needs the record land_record landed in this view")
    at, end = landing.payload_at, landing.payload_at + header.payload_len
    checksum = bytes(view[len(view) - CHECKSUM_BYTES:])
    if digest is None or digest != checksum:
        raise CorruptRecordError("record checksum mismatch", "checksum")
    hidden = view[at + header.raw_len:end] if header.hidden_len else None
    tag = None
    if header.key_id is not None:
        tag = bytes(view[end:end + TAG_BYTES])
        if auth is not None:
            auth.check(header.key_id, tag, (view[:at], *landing.kv, *(() if hidden is None else (hidden,))))
    elif auth is not None:
        auth.check(None, None, ())
    return Record(replace(header, checksum=checksum, tag=tag), memoryview(b""), hidden, landed=True)
