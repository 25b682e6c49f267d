"""What the store commands share: each ``--store`` URL opened as its own tier, batching, and
output for people (aligned tables, sizes, ages) and for scripts (``--json``).

Every store command looks at each tier on its own: a tiered deployment's memory, Redis and S3
tiers are listed, counted and cleaned separately, never through the tiered store (whose
promotion and write-behind would blur what each tier holds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvstore.cli.common import add_store_option, store_urls
from kvstore.config import redact_url, split_url
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.stores import Store, open_store
from kvstore.stores.file import FileStore
from kvstore.stores.registry import backend_class, known_schemes
from kvstore.stores.shm import ShmStore

__all__ = ["Tier", "open_tiers", "batched", "human_bytes", "human_age", "print_table", "emit_json", "sizes",
           "iter_tier_keys", "unavailable_as_error", "add_common_options", "BATCH_KEYS"]

BATCH_KEYS = 1000  # keys per size/delete round trip


@dataclass
class Tier:
    """One ``--store`` URL, opened on its own."""

    index: int
    url: str
    store: Store

    @property
    def name(self) -> str:
        return redact_url(self.url)


@contextmanager
def unavailable_as_error(tier_name: str) -> Iterator[None]:
    """OS-level failures of a backend (a vanished directory, a reset socket) are outages, not bugs."""
    try:
        yield
    except (OSError, TimeoutError) as exc:
        if isinstance(exc, StoreUnavailableError):
            raise
        raise StoreUnavailableError(f"{tier_name}: {type(exc).__name__}: {exc}") from exc


def require_existing(url: str, what: str = "store") -> None:
    """ConfigError if ``url`` names a store of this host (``file://``, ``shm://``: a directory,
    created when the store opens) that does not exist yet.

    A command that only reads (or removes) must not leave a store behind for a mistyped path or
    name, and a copy from nothing is an error, not "0 records". The URL is read by the backend's
    own configuration, so a malformed one gets the backend's error (``file://host/path``).
    """
    scheme = split_url(url).scheme.lower()  # a ConfigError for what urlsplit cannot parse ("redis://[::1")
    if scheme not in known_schemes():
        return  # opening it says what is wrong
    cls = backend_class(scheme)
    if not issubclass(cls, FileStore):
        return
    directory = cls.Config.from_url(url).path
    if not os.path.isdir(directory):
        tier = "no shm:// tier of that name: " if issubclass(cls, ShmStore) else ""
        raise ConfigError(f"{what} {redact_url(url)!r}: {tier}no such directory {directory!r} (nothing was created)")


@contextmanager
def open_tiers(args: argparse.Namespace) -> Iterator[list[Tier]]:
    """Open every ``--store`` URL separately (each must exist: these commands create nothing); all
    of them are closed on exit."""
    tiers: list[Tier] = []
    try:
        for i, url in enumerate(store_urls(args)):
            require_existing(url)
            try:
                store = open_store(url)
            except (ConfigError, StoreUnavailableError):
                raise
            except ValueError as exc:  # urlsplit on a malformed netloc, a bad port...
                raise ConfigError(f"store URL {redact_url(url)!r} is not valid: {exc}") from exc
            tiers.append(Tier(i, url, store))
        yield tiers
    finally:
        for tier in tiers:
            try:
                tier.store.close()
            except Exception:  # noqa: BLE001 - closing must not hide the command's own outcome
                pass


def batched(items: Iterable[Any], n: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for item in items:
        batch.append(item)
        if len(batch) >= n:
            yield batch
            batch = []
    if batch:
        yield batch


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def print_table(rows: Sequence[Sequence[Any]], header: Sequence[str], *, right: Sequence[int] = (),
                out: Any = None) -> None:
    """A plain aligned table; columns in ``right`` are right-aligned (numbers)."""
    out = out or sys.stdout
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        print("  ".join(parts).rstrip(), file=out)


def emit_json(doc: Any) -> None:
    json.dump(doc, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def sizes(tier: Tier, keys: list[str]) -> list[int | None]:
    with unavailable_as_error(tier.name):
        return tier.store.size_many(keys)


def iter_tier_keys(tier: Tier, prefix: str) -> Iterator[str]:
    with unavailable_as_error(tier.name):
        yield from tier.store.iter_keys(prefix)



def add_common_options(p: argparse.ArgumentParser) -> None:
    add_store_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
