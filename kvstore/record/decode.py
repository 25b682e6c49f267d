"""Accepting a whole record: its checksum and tag over every byte, then its KV bytes.

``decode_record`` accepts a record only if ``check_record`` (``kvstore.record.parse``: the
frame, every header field, the reader's expectations) and ``verify_record`` (the checksum and,
with the tenant's keys, the tag) both pass; every failure is a ``CorruptRecordError``, raised
before a byte reaches the caller's ``out``. A reader that moves the payload while the hashes run
(a device's staging) calls the two halves itself.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.buffers import byte_view, copy_bytes, xxh3_digest
from kvstore.errors import CorruptRecordError
from kvstore.keys import ChunkKey, Namespace, TokenIds
from kvstore.record import codecs
from kvstore.record.auth import TAG_BYTES, TagKeys
from kvstore.record.format import CHECKSUM_BYTES, FRAME_BYTES, Record
from kvstore.record.parse import CheckedRecord, check_record
from kvstore.types import Buffer


def verify_record(data: Buffer, checked: CheckedRecord, *, auth: TagKeys | None = None,
                  digest: bytes | None = None) -> None:
    """The rest of a record's checks, after ``check_record`` of the same bytes: its checksum
    (against ``digest``, the caller's xxh3-64 of every byte but the last 8, when given: no pass
    over the bytes) and, with ``auth``, its tag. A ``CorruptRecordError`` if either fails.
    Reads every byte when it hashes: callers may run it on other threads (xxh3 and BLAKE3
    release the GIL)."""
    view = byte_view(data)
    header, payload_at = checked.header, checked.payload_at
    payload = view[payload_at:payload_at + header.payload_len]
    signed: tuple[memoryview, ...]
    if header.version == 1:
        checked_bytes = payload
        signed = (view[FRAME_BYTES:payload_at - (TAG_BYTES if header.tag is not None else 0)], payload)
    else:
        checked_bytes, signed = view[:len(view) - CHECKSUM_BYTES], (view[:payload_at + header.payload_len],)
    if header.version == 1 or digest is None:
        digest = xxh3_digest(checked_bytes)
    if digest != header.checksum:
        raise CorruptRecordError("record checksum mismatch", "checksum")
    if auth is not None:
        auth.check(header.key_id, header.tag, signed)


def decode_record(
    data: Buffer,
    *,
    namespace: Namespace | None = None,
    chunk: ChunkKey | None = None,
    tokens: TokenIds | None = None,
    dtype: str | None = None,
    shapes: Sequence[Sequence[int]] | None = None,
    out: memoryview | None = None,
    hidden_dtype: str | None = None,
    hidden_shape: Sequence[int] | None = None,
    auth: TagKeys | None = None,
    digest: bytes | None = None,
) -> Record:
    """Validate and decode a record. Every expectation given is checked before returning.

    ``tokens`` are the chunk's own token ids as the reader sees them: a record whose tokens
    differ (a hash collision, a foreign writer) is rejected. ``hidden_dtype``/``hidden_shape``
    are what the reader's model would consume: a record whose hidden state differs is rejected
    (a record without one is accepted, ``Record.hidden`` is then None). With ``auth`` (the
    tenant's keys) only a record signed with an accepted key whose tag verifies is accepted.
    With ``out`` (a byte buffer of exactly ``raw_len`` bytes, else the record is rejected) the
    KV bytes are written there, only once the record is accepted; otherwise ``Record.kv`` is a
    view of ``data`` for uncompressed records (no copy) or a new buffer. ``digest``, if given,
    is the xxh3-64 of all of ``data`` but its last 8 bytes as the caller computed it when the
    bytes arrived (``Lease.digest``): a version-2 record's checksum is compared with it instead
    of reading ``data`` again. ``check_record`` and ``verify_record`` are its two halves.
    """
    view = byte_view(data)
    checked = check_record(view, namespace=namespace, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes,
                           hidden_dtype=hidden_dtype, hidden_shape=hidden_shape)
    header = checked.header
    if out is not None:
        if out.format != "B" or out.ndim != 1:
            out = out.cast("B")
        if out.nbytes != header.raw_len:
            raise CorruptRecordError(f"record decodes to {header.raw_len} bytes, the destination holds {out.nbytes}", "shape")
    verify_record(view, checked, auth=auth, digest=digest)
    body = view[checked.body]
    hidden_at = checked.hidden
    hidden = view[hidden_at] if hidden_at is not None else None
    if header.codecs:
        kv = codecs.decode(header.codecs, body, header.raw_len, out)
    elif out is not None:
        copy_bytes(out, body)  # the GIL released: readers keep receiving meanwhile
        kv = out
    else:
        kv = body
    return Record(header, kv, hidden)
