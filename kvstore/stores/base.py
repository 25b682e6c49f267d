"""The store contract.

A store maps string keys to immutable byte values. Backends implement five methods
(``get``, ``put``, ``delete``, ``iter_keys`` and ``close``); everything else has a default built
on them that a backend overrides only where it can do better (a pipeline, MGET, parallel
requests).

Contract, for every backend:

* ``get`` returns the whole value as written, or ``None`` on a miss. A reader never sees half a
  value: ``put`` is atomic per key.
* An outage (unreachable, timed out) raises ``StoreUnavailableError``; a miss is never an
  exception. Bad configuration raises ``ConfigError`` when the store is built.
* Values are copied or sent before ``put`` returns: callers may reuse their buffers.
* Stores are thread-safe.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Iterable, Iterator, Sequence, Union

Buffer = Union[bytes, bytearray, memoryview]


class Store(ABC):
    """A key-value store of byte values. See the module docstring for the contract."""

    #: URL schemes this backend serves (``memory``, ``redis``...), used by ``open_store``.
    schemes: ClassVar[tuple[str, ...]] = ()
    #: True for stores private to this machine (memory, file): the tiered store writes them
    #: synchronously; shared remote tiers are written in the background.
    is_local: ClassVar[bool] = False

    # -- the small contract -------------------------------------------------------------------
    @abstractmethod
    def get(self, key: str) -> bytes | memoryview | None:
        """The value stored under ``key``, or ``None`` if there is none."""

    @abstractmethod
    def put(self, key: str, value: Buffer) -> None:
        """Store ``value`` under ``key``, replacing any previous value."""

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove ``key``; True if it was present."""

    @abstractmethod
    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        """Every key that starts with ``prefix``, in no particular order (for tools, not the hot path)."""

    def close(self) -> None:
        """Release connections and threads. The store must not be used afterwards."""

    # -- defaults built on the small contract -------------------------------------------------
    def exists(self, key: str) -> bool:
        return self.get(key) is not None

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.exists(k) for k in keys]

    def get_many(self, keys: Sequence[str]) -> list[bytes | memoryview | None]:
        return [self.get(k) for k in keys]

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> None:
        for key, value in items:
            self.put(key, value)

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(1 for k in keys if self.delete(k))

    def longest_prefix(self, keys: Sequence[str]) -> int:
        """How many of ``keys``, from the first, are present (stops at the first absent one)."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        """Stored length of each key's value (``None`` if absent); for stats, not the hot path."""
        out: list[int | None] = []
        for k in keys:
            v = self.get(k)
            out.append(None if v is None else len(v))
        return out

    def describe(self) -> dict[str, Any]:
        """A JSON-able description for logs and tools; never contains secrets."""
        return {"store": type(self).__name__}

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.describe()}>"
