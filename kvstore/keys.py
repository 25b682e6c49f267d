"""Prefix-chained chunk keys.

Tokens are cut into chunks of ``chunk_tokens``. Chunk ``i`` is named by a hash of the whole
prefix up to its end, chained so each chunk costs one hash::

    h_0 = sha256(b"kvstore-prefix-v1" || namespace digest)
    h_i = sha256(h_{i-1} || kind || uint32-le tokens of chunk i)      kind: b"F" full, b"P" partial

A key therefore names a prefix, never a chunk alone, and two deployments whose namespaces
differ in anything that changes the KV bytes never share a key. The last, shorter chunk is keyed
too (``partial=True``). The functions here are pure and give the same keys in every process and
on every machine for a given ``FORMAT_VERSION``: golden tests pin them.

**Key spaces.** A deployment that signs its records (``kvstore.record.auth``) keys them in its
own space: ``Namespace.key_space`` holds the id of the signing key, so records signed with
different keys never share a key, and deployments with different keys on one store never
overwrite each other. Keyless namespaces (``key_space=""``) hash exactly as before the field
existed: their keys are unchanged.

**Non-text inputs.** A prompt with images (audio, video) carries placeholder tokens that the
engine replaces by the input's embeddings, so equal token ids no longer mean equal KV. Such a
prompt is keyed with its ``InputSpan``s (the input's identity, e.g. vLLM's multimodal hash, and
the placeholder range it fills): every chunk that overlaps a span hashes that span too, as
vLLM's own block hashes do::

    h_i = sha256(h_{i-1} || b"M" || kind || uint32-le length || msgpack spans || tokens of chunk i)

Chunks that overlap no span hash exactly as above, so a text prefix before the first image
(a system prompt) is shared with text-only prompts, and a chunk after an image differs from the
text-only chunk through the chain.

**Head ranges.** A record of attention KV holds a contiguous range of KV heads ``[a, b)`` out of
the model's ``H`` (``HeadRange``): the writer's tensor-parallel rank holds those heads, and any
reader whose heads overlap them can use the record, whatever its own TP size. The chain above is
the same for every range (it names the prefix); the range is a suffix of the key, so an engine
hashes a prompt once and names the records of every range from it (``ChunkKey.with_heads``).
Records that are not cut by head (recurrent state, MLA's latent, the V0 agent's caches) have no
suffix.

Key grammar: ``kvs<format version>/<namespace id: 16 hex>/<prefix digest: 32 hex>``, then
``/h<a>-<b>of<H>`` for a head range (``split_key``, ``key_heads``, ``namespace_prefix``); tools
group and remove records by its first two parts.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

import msgpack
import numpy as np

from kvstore._version import FORMAT_VERSION
from kvstore.errors import ConfigError
from kvstore.types import array_view

__all__ = ["FORMAT_VERSION", "KEY_STEM", "KEY_PREFIX", "MAX_HEADS", "Namespace", "ChunkKey", "HeadRange", "InputSpan",
           "chunk_keys", "prefix_keys", "tokens_to_array", "check_chunk_tokens", "split_key", "key_heads",
           "namespace_prefix", "TokenIds"]

#: Every kvstore key, of any format version, starts with this (tools list all records by it).
KEY_STEM = "kvs"
#: Every key of this format version starts with this.
KEY_PREFIX = f"{KEY_STEM}{FORMAT_VERSION}"
_DIGEST_BYTES = 16  # 128-bit prefix hashes: collisions are astronomically rare and every hit is verified
#: The most KV heads a model may have (a record's header and key name them).
MAX_HEADS = 4096
_KEY_RE = re.compile(rf"^{KEY_STEM}(\d+)/([0-9a-f]{{16}})/([0-9a-f]{{32}})(?:/h(\d{{1,4}})-(\d{{1,4}})of(\d{{1,4}}))?$")
_NAMESPACE_RE = re.compile(rf"^(?:{KEY_STEM}(\d+)/)?([0-9a-f]{{16}})/?$")

#: Token ids as callers hold them: a list, a numpy array or a torch tensor (anything ``numpy()``-able).
TokenIds = Any


def check_chunk_tokens(chunk_tokens: int, block_size: int) -> None:
    """``ConfigError`` unless ``chunk_tokens`` is a positive multiple of the engine's ``block_size``.

    A record covers whole engine blocks, so a prefix is reusable chunk by chunk.
    """
    if type(block_size) is not int or block_size <= 0:
        raise ConfigError(f"block_size={block_size!r} must be a positive number of tokens")
    if type(chunk_tokens) is not int or chunk_tokens <= 0 or chunk_tokens % block_size:
        suggestion = block_size * max(1, round(chunk_tokens / block_size) if isinstance(chunk_tokens, int) else 1)
        raise ConfigError(
            f"chunk_tokens={chunk_tokens!r} must be a positive multiple of the engine's "
            f"block_size={block_size} (e.g. chunk_tokens={suggestion})")


def split_key(key: str) -> tuple[int, str, str] | None:
    """``(format version, namespace id, prefix digest)`` of a kvstore key (with or without a head
    range), ``None`` for a foreign key."""
    m = _KEY_RE.match(key)
    if m is None or (m.group(4) is not None and _head_range(m) is None):
        return None
    return int(m.group(1)), m.group(2), m.group(3)


def key_heads(key: str) -> HeadRange | None:
    """The head range a kvstore key names (``None``: none, or not a kvstore key)."""
    m = _KEY_RE.match(key)
    return None if m is None or m.group(4) is None else _head_range(m)


def _head_range(m: re.Match[str]) -> HeadRange | None:
    try:
        heads = HeadRange(int(m.group(4)), int(m.group(5)), int(m.group(6)))
    except ValueError:
        return None
    return heads if heads.suffix == m.group(0)[-len(heads.suffix):] else None  # no leading zeros


def namespace_prefix(text: str) -> str:
    """``3fa2...`` or ``kvs2/3fa2...`` (a namespace id as tools print it) -> its key prefix ``kvs2/3fa2.../``."""
    m = _NAMESPACE_RE.match(text.strip().lower())
    if m is None:
        raise ConfigError(f"namespace {text!r} is not a namespace id; use the 16 hex digits that "
                          f"`kvstore stats` shows (optionally as {KEY_PREFIX}/<id>)")
    version = int(m.group(1)) if m.group(1) else FORMAT_VERSION
    return f"{KEY_STEM}{version}/{m.group(2)}/"


@dataclass(frozen=True)
class Namespace:
    """Everything that changes the KV bytes of a token prefix.

    Two caches may share records only if every field is equal. ``model_fingerprint`` should
    change whenever weights or model config change (a revision, or a hash of the config).
    """

    model: str
    kv_dtype: str
    layout: str
    block_size: int
    chunk_tokens: int
    layer_start: int = 0
    layer_end: int = 0
    #: An opaque shard of a writer's tensor-parallel rank, for records whose bytes cannot be cut
    #: by KV head (recurrent state, the V0 agent's caches). Attention KV of the vLLM connector
    #: leaves these at 0 and 1: its records name their heads (``HeadRange``), not their writer.
    tp_rank: int = 0
    tp_size: int = 1
    model_fingerprint: str = ""
    adapter: str = ""
    cache_salt: str = ""
    extra: tuple[tuple[str, str], ...] = field(default=())
    format_version: int = FORMAT_VERSION
    #: The id (hex) of the key that signs this namespace's records; empty when unsigned.
    key_space: str = ""

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("namespace needs a model name (model='...')")
        check_chunk_tokens(self.chunk_tokens, self.block_size)
        if not (0 <= self.layer_start <= self.layer_end):
            raise ConfigError(f"layer range [{self.layer_start}, {self.layer_end}) is not valid")
        if not (0 <= self.tp_rank < self.tp_size):
            raise ConfigError(f"tp_rank={self.tp_rank} must be in [0, tp_size={self.tp_size})")

    def with_salt(self, cache_salt: str) -> Namespace:
        """The same namespace for another tenant's ``cache_salt``."""
        return self if cache_salt == self.cache_salt else replace(self, cache_salt=cache_salt)

    def with_key_space(self, key_space: str) -> Namespace:
        """The same namespace in the key space of the signing key ``key_space`` ("": unsigned)."""
        return self if key_space == self.key_space else replace(self, key_space=key_space)

    @cached_property
    def digest(self) -> bytes:
        """32-byte sha256 of the canonical (sorted, msgpack) encoding of every field."""
        fields = asdict(self)
        fields["extra"] = [list(kv) for kv in sorted(self.extra)]
        if not self.key_space:
            del fields["key_space"]  # unsigned namespaces keep the digest (and keys) they always had
        canonical = msgpack.packb(sorted(fields.items()), use_bin_type=True)
        return hashlib.sha256(b"kvstore-namespace\x00" + canonical).digest()

    @property
    def id(self) -> str:
        """Short printable id used in store keys (first 8 bytes of the digest, hex)."""
        return self.digest[:8].hex()

    @property
    def key_prefix(self) -> str:
        """Every key of this namespace starts with this string (for listing and removal)."""
        return f"{KEY_STEM}{self.format_version}/{self.id}/"


@dataclass(frozen=True, order=True)
class HeadRange:
    """KV heads ``[start, end)`` out of a model's ``total`` KV heads (per layer): what one record of
    attention KV holds. A tensor-parallel rank holds such a range (``kvstore.heads``)."""

    start: int
    end: int
    total: int

    def __post_init__(self) -> None:
        if not all(type(v) is int for v in (self.start, self.end, self.total)) or \
                not 0 <= self.start < self.end <= self.total <= MAX_HEADS:
            raise ValueError(f"head range [{self.start!r}, {self.end!r}) of {self.total!r} heads is not valid "
                             f"(0 <= start < end <= total <= {MAX_HEADS})")

    @property
    def count(self) -> int:
        return self.end - self.start

    @property
    def suffix(self) -> str:
        """What a key naming these heads ends with."""
        return f"/h{self.start}-{self.end}of{self.total}"

    def contains(self, other: HeadRange) -> bool:
        return self.total == other.total and self.start <= other.start and other.end <= self.end

    def overlap(self, other: HeadRange) -> HeadRange | None:
        """The heads both hold (None: none)."""
        lo, hi = max(self.start, other.start), min(self.end, other.end)
        return HeadRange(lo, hi, self.total) if lo < hi and self.total == other.total else None

    def as_tuple(self) -> tuple[int, int, int]:
        return self.start, self.end, self.total

    def __str__(self) -> str:
        return f"[{self.start}, {self.end}) of {self.total}"


@dataclass(frozen=True)
class ChunkKey:
    """One chunk of a token prefix: tokens ``[start, end)`` and the key naming ``tokens[:end]``."""

    index: int
    start: int
    end: int
    digest: bytes
    partial: bool
    key: str
    #: The same chunk in the key spaces of previous keys still accepted (a rotation's window):
    #: lookups and loads fall back to them (``PrefixCache.keys``); empty otherwise.
    previous: tuple[ChunkKey, ...] = ()
    #: The KV heads the record holds (named by the key's suffix); None: a record not cut by head.
    heads: HeadRange | None = None

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def base(self) -> str:
        """The key without its head range: the same for every range of the chunk."""
        return self.key if self.heads is None else self.key[:-len(self.heads.suffix)]

    def with_heads(self, heads: HeadRange | None) -> ChunkKey:
        """The same chunk's key for the record of ``heads`` (None: the record not cut by head)."""
        if heads == self.heads:
            return self
        return replace(self, key=self.base + (heads.suffix if heads is not None else ""), heads=heads,
                       previous=tuple(p.with_heads(heads) for p in self.previous))


@dataclass(frozen=True, order=True)
class InputSpan:
    """A non-text input that fills the placeholder tokens ``[offset, offset + length)``.

    ``identity`` names the input's content and everything that changes its embeddings (vLLM's
    ``MultiModalFeatureSpec.identifier``: a hash of the item and its processor options, with a
    LoRA prefix where one applies); equal identities at equal offsets must mean equal KV.
    """

    offset: int
    length: int
    identity: str
    modality: str = ""

    def __post_init__(self) -> None:
        if type(self.offset) is not int or self.offset < 0 or type(self.length) is not int or self.length <= 0:
            raise ValueError(f"input span [{self.offset!r}, +{self.length!r}) must have offset >= 0 and length > 0")
        if not isinstance(self.identity, str) or not self.identity:
            raise ValueError(f"input span at {self.offset} has no identity: it cannot be keyed")

    @property
    def end(self) -> int:
        return self.offset + self.length


def _spans_key(spans: Sequence[InputSpan], start: int, end: int) -> bytes:
    """The canonical bytes of the spans that overlap tokens ``[start, end)`` (b"" for none)."""
    inside = [[s.offset, s.length, s.identity, s.modality] for s in spans if s.offset < end and s.end > start]
    if not inside:
        return b""
    packed: bytes = msgpack.packb(inside, use_bin_type=True)
    return len(packed).to_bytes(4, "little") + packed


def _check_spans(spans: Sequence[InputSpan]) -> Sequence[InputSpan]:
    if not all(isinstance(s, InputSpan) for s in spans):
        raise TypeError("spans must be InputSpan objects")
    return sorted(spans)


def tokens_to_array(tokens: TokenIds) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array (the bytes that are hashed and stored).

    Takes a sequence of ints, a numpy array or a torch tensor (on any device); no copy when given
    such an array already.
    """
    if isinstance(tokens, np.ndarray) and tokens.dtype == np.dtype("<u4") and tokens.flags.c_contiguous:
        arr = tokens
    else:
        if hasattr(tokens, "detach"):  # a torch tensor: torch is not imported here
            tokens = tokens.detach().cpu().numpy()
        arr = np.ascontiguousarray(np.asarray(tokens), dtype="<u4")
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    return arr


def chunk_keys(namespace: Namespace, tokens: TokenIds, *, include_partial: bool = True,
               max_chunks: int | None = None, spans: Sequence[InputSpan] = (),
               heads: HeadRange | None = None) -> list[ChunkKey]:
    """Keys of every chunk of ``tokens`` under ``namespace``, in order.

    The last chunk is included when shorter than ``chunk_tokens`` only if ``include_partial``.
    ``max_chunks`` stops early (lookups that only need a bounded prefix). ``spans``: the
    prompt's non-text inputs (see the module docstring); spans past ``tokens`` change nothing.
    ``heads``: the records' head range (the keys' suffix; None: records not cut by head).
    """
    spans = _check_spans(spans)
    arr = tokens_to_array(tokens)
    n = int(arr.shape[0])
    step = namespace.chunk_tokens
    prefix = namespace.key_prefix
    suffix = heads.suffix if heads is not None else ""
    h = _chain_seed(namespace)
    out: list[ChunkKey] = []
    data = array_view(arr).cast("B")
    for index, start in enumerate(range(0, n, step)):
        if max_chunks is not None and index >= max_chunks:
            break
        end = min(start + step, n)
        partial = end - start < step
        if partial and not include_partial:
            break
        h = _link(h, data, start, end, partial, _spans_key(spans, start, end))
        digest = h[:_DIGEST_BYTES]
        out.append(ChunkKey(index, start, end, digest, partial, prefix + digest.hex() + suffix, heads=heads))
    return out


def _chain_seed(namespace: Namespace) -> bytes:
    """The chain's value before its first chunk: the namespace alone."""
    return hashlib.sha256(b"kvstore-prefix-v1" + namespace.digest).digest()


def _link(h: bytes, data: memoryview, start: int, end: int, partial: bool, spans: bytes = b"") -> bytes:
    """The chain's value after the chunk ``tokens[start:end]`` (``data``: the tokens' bytes,
    4 per token) follows the chain value ``h``; a partial chunk is a leaf, never extended.
    ``spans``: ``_spans_key`` of the chunk (length-prefixed, after a tag no plain chunk starts with)."""
    hasher = hashlib.sha256(h)
    if spans:
        hasher.update(b"M")
    hasher.update(b"P" if partial else b"F")
    hasher.update(spans)
    hasher.update(data[start * 4:end * 4])
    return hasher.digest()


def prefix_keys(namespace: Namespace, tokens: TokenIds, ends: Sequence[int], *,
                spans: Sequence[InputSpan] = (), heads: HeadRange | None = None) -> list[ChunkKey]:
    """The keys of every chunk of every prefix ``tokens[:e]`` for ``e`` in ``ends``, each once,
    ordered by end (a partial chunk before the whole chunk it begins): what ``chunk_keys`` gives
    for each prefix (of the records of ``heads``), hashing the chain once. Ends beyond ``tokens``
    are cut to its length."""
    spans = _check_spans(spans)
    arr = tokens_to_array(tokens)
    n = int(arr.shape[0])
    wanted = sorted({min(int(e), n) for e in ends if e > 0})
    if not wanted:
        return []
    step = namespace.chunk_tokens
    prefix = namespace.key_prefix
    suffix = heads.suffix if heads is not None else ""
    h = _chain_seed(namespace)
    out: list[ChunkKey] = []
    data = array_view(arr).cast("B")
    top = wanted[-1]
    for index, start in enumerate(range(0, top, step)):
        full_end = start + step
        # Partial chunks of the ends inside this chunk branch off the chain; only a whole chunk
        # extends it.
        for end in (e for e in wanted if start < e < full_end):
            digest = _link(h, data, start, end, True, _spans_key(spans, start, end))[:_DIGEST_BYTES]
            out.append(ChunkKey(index, start, end, digest, True, prefix + digest.hex() + suffix, heads=heads))
        if full_end > top:
            break
        h = _link(h, data, start, full_end, False, _spans_key(spans, start, full_end))
        digest = h[:_DIGEST_BYTES]
        out.append(ChunkKey(index, start, full_end, digest, False, prefix + digest.hex() + suffix, heads=heads))
    return out
