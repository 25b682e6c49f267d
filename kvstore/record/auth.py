"""Keyed record tags: with a deployment key, only writers holding it place KV that readers load.

A record's xxh3 checksum catches accidents, not writers: anyone who can write to a shared Redis
or bucket can write a well-formed record for any key. With a deployment key configured, every
record carries a tag, keyed BLAKE3 (32 bytes) over its header bytes up to the tag value and its
whole payload, and a keyed reader rejects a record that is unsigned, signed with a key it does
not accept, or whose tag does not verify (``CorruptRecordError`` reason ``auth``: a counted
miss). The threat model is in ``docs/operations.md``.

Keys:

* The **deployment key** is 32 random bytes written as 64 hex digits, in a key file or an
  environment variable (``RecordAuth.from_options``). Further keys after the first are
  **previous** keys: readers still accept them for ``previous_window`` seconds after the keys
  were loaded, writers never sign with them, so a rotation rolls out without a cold cache.
* **Per tenant**, the tag key is derived from the deployment key and the namespace's cache
  salt (BLAKE3 ``derive_key``): a tenant's records verify only under its own salt.
* A record names the deployment key that signed it by an 8-byte key id (derived, it reveals
  nothing of the key), so a reader picks the key instead of trying each.
* **Key spaces.** Records live in the key space of the key that signed them (its id in
  ``Namespace.key_space``, so in every store key): deployments with different keys on one store
  never overwrite each other, and a reader never even fetches another key's records. During a
  rotation's window readers also look in the previous keys' spaces, and what they load from
  there is re-signed into the current space by their next save (``PrefixCache``). A keyless
  reader and keyed writers do not share records either: each keeps to its own space.

``blake3`` is an optional dependency (the ``auth`` extra): kvstore imports without
it, and configuring a key without it is a ``ConfigError`` naming the extra.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvstore.config import option
from kvstore.errors import ConfigError, CorruptRecordError
from kvstore.extras import install_hint
from kvstore.types import Buffer

__all__ = ["RecordAuth", "TagKeys", "TAG_BYTES", "KEY_ID_BYTES", "MAX_PREVIOUS_WINDOW", "shared_auth",
           "key_file_option", "key_env_option", "previous_window_option"]

log = logging.getLogger(__name__)

TAG_BYTES = 32
KEY_ID_BYTES = 8
KEY_BYTES = 32
#: The longest a previous key may stay accepted: rotation is a rollout, not a second key forever.
MAX_PREVIOUS_WINDOW = 30 * 86400.0
# BLAKE3 derive_key contexts: hardcoded, globally unique, never reused for anything else.
_CONTEXT_TAG_KEY = "kvstore 2026-12-01 record tag key v1"
_CONTEXT_KEY_ID = "kvstore 2026-12-01 record key id v1"
_HEX_KEY = re.compile(r"^[0-9a-fA-F]{64}$")
_SEPARATORS = re.compile(r"[\s,]+")
_GENERATE = "generate one with `openssl rand -hex 32`"


def _blake3() -> Any:
    try:
        import blake3
    except ImportError as exc:
        raise ConfigError("record authentication (auth_key_file / auth_key_env) needs the blake3 package: "
                          f"{install_hint('auth')}") from exc
    return blake3


def parse_keys(text: str, *, where: str) -> list[bytes]:
    """Keys from a key file's or variable's text: 64 hex digits each, current first.

    Keys are separated by newlines, spaces or commas; lines starting with ``#`` are comments.
    Error messages name ``where`` and the key's position, never the key material.
    """
    keys: list[bytes] = []
    words = [w for line in text.splitlines() if not line.lstrip().startswith("#")
             for w in _SEPARATORS.split(line.strip()) if w]
    for i, word in enumerate(words, 1):
        if not _HEX_KEY.match(word):
            raise ConfigError(f"{where}: key {i} is not 64 hex digits (a {KEY_BYTES}-byte key; {_GENERATE})")
        key = bytes.fromhex(word)
        if key not in keys:
            keys.append(key)
    if not keys:
        raise ConfigError(f"{where} holds no key; expected 64 hex digits ({_GENERATE})")
    return keys


_THREADED_BYTES = 1 << 20


class TagKeys:
    """One tenant's tag keys: ``sign`` with the current key, ``check`` against any accepted one."""

    def __init__(self, blake3: Any, current: tuple[bytes, bytes], previous: Sequence[tuple[bytes, bytes]],
                 accept_previous_until: float, clock: Callable[[], float]) -> None:
        self._blake3 = blake3
        self.key_id, self._key = current
        self._previous = dict(previous)
        self._until = accept_previous_until
        self._clock = clock

    def sign(self, pieces: Iterable[Buffer]) -> bytes:
        """The tag of the concatenation of ``pieces`` under the current key."""
        return self._mac(self._key, pieces)

    def signer(self, nbytes: int) -> Any:
        """A hasher (``update``, ``copy``, ``digest``) that tags ``nbytes`` bytes fed in pieces
        under the current key: what ``sign`` computes, for bytes that arrive one slice at a time."""
        return self._hasher(self._key, nbytes)

    def check(self, key_id: bytes | None, tag: bytes | None, pieces: Iterable[Buffer]) -> None:
        """Raise ``CorruptRecordError(reason="auth")`` unless ``tag`` verifies under key ``key_id``."""
        import hmac

        if key_id is None or tag is None:
            raise CorruptRecordError("record is not signed; this reader accepts only signed records", "auth")
        if key_id == self.key_id:
            key = self._key
        elif key_id in self._previous and self._clock() < self._until:
            key = self._previous[key_id]
        else:
            raise CorruptRecordError(f"record is signed with key {key_id.hex()}, which this reader does not accept",
                                     "auth")
        if not hmac.compare_digest(self._mac(key, pieces), tag):
            raise CorruptRecordError("record tag does not verify (forged or altered)", "auth")

    def _mac(self, key: bytes, pieces: Iterable[Buffer]) -> bytes:
        views = [memoryview(p).cast("B") for p in pieces]
        hasher = self._hasher(key, sum(v.nbytes for v in views))
        for view in views:
            hasher.update(view)
        tag: bytes = hasher.digest()
        return tag

    def _hasher(self, key: bytes, nbytes: int) -> Any:
        # BLAKE3 can spread a large input over idle cores; below ~1 MiB its threads cost more than
        # they save. On a contended 2-core VM it measured no gain either way (results/auth.md).
        threads = self._blake3.blake3.AUTO if nbytes >= _THREADED_BYTES else 1
        return self._blake3.blake3(key=key, max_threads=threads)


class RecordAuth:
    """A deployment's keys, current first; ``for_salt(salt)`` gives one tenant's ``TagKeys``."""

    def __init__(self, keys: Sequence[bytes], *, previous_window: float = 86400.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not keys:
            raise ConfigError(f"record authentication needs at least one key ({_GENERATE})")
        for key in keys:
            if type(key) is not bytes or len(key) != KEY_BYTES:
                raise ConfigError(f"a record key must be {KEY_BYTES} bytes ({_GENERATE})")
        if not 0 <= previous_window <= MAX_PREVIOUS_WINDOW:  # also rejects NaN
            raise ConfigError(f"auth_previous_window={previous_window!r} must be between 0 and "
                              f"{MAX_PREVIOUS_WINDOW:g} seconds (30 days)")
        self._blake3 = _blake3()
        self._keys = list(keys)
        self._ids: list[bytes] = [self._blake3.blake3(k, derive_key_context=_CONTEXT_KEY_ID).digest(length=KEY_ID_BYTES)
                     for k in self._keys]
        self.previous_window = float(previous_window)
        self._clock = clock
        self._until = clock() + self.previous_window
        self._tenants: dict[str, TagKeys] = {}

    @classmethod
    def from_options(cls, key_file: str = "", key_env: str = "", previous_window: float = 86400.0,
                     *, clock: Callable[[], float] = time.monotonic) -> RecordAuth | None:
        """Keys from ``key_file`` (a path) or the environment variable named ``key_env``; None if neither.

        Both at once, a missing or unreadable file, an unset or empty variable and malformed keys
        are ``ConfigError``s: a deployment that asked for authentication never runs without it.
        """
        if key_file and key_env:
            raise ConfigError("give auth_key_file or auth_key_env, not both")
        if key_file:
            where = f"auth_key_file={key_file!r}"
            try:
                with open(key_file, encoding="ascii") as f:
                    text = f.read(1 << 16)
                mode = os.stat(key_file).st_mode
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{where} cannot be read: {type(exc).__name__}: {exc}") from None
            if mode & 0o077:
                log.warning("%s is readable by other users (mode %o); chmod 600 it", where, mode & 0o777)
        elif key_env:
            where = f"auth_key_env={key_env!r}"
            text = os.environ.get(key_env, "")
            if not text.strip():
                raise ConfigError(f"{where}: the environment variable is not set or empty")
        else:
            return None
        return cls(parse_keys(text, where=where), previous_window=previous_window, clock=clock)

    @property
    def key_id(self) -> bytes:
        """The id of the current key (the one writers sign with)."""
        return self._ids[0]

    @property
    def key_space(self) -> str:
        """The key space of this deployment's records (``Namespace.key_space``): the current key's id."""
        return self._ids[0].hex()

    def previous_key_spaces(self) -> list[str]:
        """The key spaces of the previous keys while they are still accepted (the rotation
        window), else none: readers look there too, writers never write there."""
        return [k.hex() for k in self._ids[1:]] if self._clock() < self._until else []

    def for_salt(self, cache_salt: str) -> TagKeys:
        """The tag keys of the tenant whose namespaces carry ``cache_salt``."""
        keys = self._tenants.get(cache_salt)
        if keys is None:
            salt = cache_salt.encode("utf-8")
            derived = [(kid, self._blake3.blake3(k + salt, derive_key_context=_CONTEXT_TAG_KEY).digest())
                       for kid, k in zip(self._ids, self._keys)]
            keys = TagKeys(self._blake3, derived[0], derived[1:], self._until, self._clock)
            self._tenants[cache_salt] = keys
        return keys

    def describe(self) -> dict[str, Any]:
        """Key ids (never keys) and the rotation window, for logs and ``describe()``."""
        return {"key_id": self.key_id.hex(), "previous_key_ids": [k.hex() for k in self._ids[1:]],
                "previous_window": self.previous_window}

    def __repr__(self) -> str:
        return f"RecordAuth(key_id={self.key_id.hex()}, previous={len(self._keys) - 1})"


@functools.lru_cache(maxsize=16)
def shared_auth(key_file: str = "", key_env: str = "", previous_window: float = 86400.0) -> RecordAuth | None:
    """``RecordAuth.from_options`` once per process and settings: the sides of one engine (vLLM's
    scheduler and worker in one process) share the keys and the rotation window's start."""
    return RecordAuth.from_options(key_file, key_env, previous_window)


# The options an adapter (the vLLM connector, the agent) offers for authentication, defined once:
# ``auth_key_file: str = key_file_option()`` and so on, range-checked by the adapter.
def key_file_option() -> Any:
    return option("", help="File holding the deployment key (64 hex digits; further keys are previous ones): every "
                  "record saved is signed, and only records whose tag verifies are loaded. See operations.md, "
                  "record authentication.")


def key_env_option() -> Any:
    return option("", help="Name of an environment variable holding the deployment key(s), instead of auth_key_file.")


def previous_window_option() -> Any:
    return option(86400.0, kind="duration", lo=0.0, hi=MAX_PREVIOUS_WINDOW, help="How long after start-up records signed with a previous key are "
                  "still loaded (at most 30 days).")
