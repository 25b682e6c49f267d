"""Cleaning stores: ``kvstore rm`` (a namespace or given keys) and ``kvstore gc`` (expired,
old-format, undecodable or misplaced records).

Keys of another shape than kvstore's belong to someone else and are never changed. ``rm``
without ``--yes`` only reports and exits 1; ``gc --dry-run`` reports what would go.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

from kvstore.buffers import BufferPool
from kvstore.cli import tiers as tier_io
from kvstore.cli.common import number
from kvstore.cli.tiers import (
    BATCH_KEYS,
    Tier,
    add_common_options,
    batched,
    emit_json,
    human_bytes,
    iter_tier_keys,
    open_tiers,
    unavailable_as_error,
)
from kvstore.config import parse_duration
from kvstore.errors import ConfigError, CorruptRecordError
from kvstore.keys import FORMAT_VERSION, KEY_STEM, key_heads, namespace_prefix, split_key
from kvstore.record import decode_record, header_extent, read_header


# -- rm -------------------------------------------------------------------------------------------
def cmd_rm(args: argparse.Namespace) -> int:
    if not args.namespace and not args.keys:
        raise ConfigError("kvstore rm needs --namespace ID or one or more KEYs")
    foreign = [k for k in args.keys if split_key(k) is None]
    if foreign:
        raise ConfigError(f"{', '.join(map(repr, foreign[:3]))}{' ...' if len(foreign) > 3 else ''} "
                          f"{'is not a kvstore record key' if len(foreign) == 1 else 'are not kvstore record keys'} "
                          f"({KEY_STEM}<version>/<namespace>/<digest>, as `kvstore ls` prints them); "
                          "keys of another shape belong to someone else and are never removed")
    prefix = namespace_prefix(args.namespace) if args.namespace else None
    report: list[dict[str, Any]] = []
    with open_tiers(args) as tiers:
        for tier in tiers:
            records = nbytes = removed = 0
            candidates: Iterable[str] = list(args.keys)
            if prefix is not None:
                candidates = _chain(candidates, iter_tier_keys(tier, prefix))
            for batch in batched(candidates, BATCH_KEYS):
                sizes = tier_io.sizes(tier, batch)
                present = [k for k, s in zip(batch, sizes) if s is not None]
                records += len(present)
                nbytes += sum(s for s in sizes if s is not None)
                if args.yes and present:
                    with unavailable_as_error(tier.name):
                        removed += tier.store.delete_many(present)
            report.append({"tier": tier.name, "records": records, "bytes": nbytes, "removed": removed})
    what = f"namespace {prefix.rstrip('/')}" if prefix else f"{len(args.keys)} key(s)"
    if args.json:
        emit_json({"target": what, "removed": bool(args.yes), "tiers": report})
    else:
        verb = "removed" if args.yes else "would remove"
        for r in report:
            n = r["removed"] if args.yes else r["records"]
            print(f"{r['tier']}: {verb} {n} records ({human_bytes(r['bytes'])}) of {what}")
    if not args.yes:
        if any(r["records"] for r in report):
            print("kvstore rm: nothing removed; pass --yes to remove these records", file=sys.stderr)
        return 1
    return 0


def _chain(*iterables: Iterable[str]) -> Iterator[str]:
    for it in iterables:
        yield from it


# -- gc -------------------------------------------------------------------------------------------
@dataclass
class GcTally:
    tier: str
    scanned: int = 0
    kept: int = 0
    kept_bytes: int = 0
    removed: dict[str, int] = field(default_factory=dict)
    removed_bytes: int = 0
    newer_version: int = 0
    foreign_keys: int = 0

    def drop(self, reason: str, size: int) -> None:
        self.removed[reason] = self.removed.get(reason, 0) + 1
        self.removed_bytes += size


def gc_verdict(key: str, value: bytes | memoryview, *, now: float, older_than: float | None,
               verify: bool, digest: bytes | None = None, size: int | None = None) -> str | None:
    """Why record ``key`` should go (``expired``, ``undecodable:<reason>``, ``mismatch``), or ``None``.

    ``digest``: the value's arrival hash (``Lease.digest``), which ``verify`` then checks the
    record's checksum against instead of reading the value again. ``size``: without ``verify``,
    ``value`` may be the record's first bytes (``read_header``) and ``size`` its whole length."""
    parts = split_key(key)
    assert parts is not None
    try:
        header = decode_record(value, digest=digest).header if verify else read_header(value, size)
    except CorruptRecordError as exc:
        return f"undecodable:{exc.reason}"
    if header.namespace[:8].hex() != parts[1] or header.key.hex() != parts[2]:
        return "mismatch"
    named = key_heads(key)
    if header.heads != (None if named is None else named.as_tuple()):  # a record under another head range's key
        return "mismatch"
    if older_than is not None and now - header.created > older_than:
        return "expired"
    return None


#: The first bytes of a record gc reads to judge it by its header: a frame and a header of
#: thousands of tokens and hundreds of layers. A longer header is read again whole.
HEAD_BYTES = 64 << 10
#: Pool of a ``--verify`` scan: records are received into it, verified as they arrive, released.
_VERIFY_POOL_BYTES = 256 << 20

Verdicts = Iterator[tuple[str, int, str | None]]


def _by_headers(tier: Tier, keys: list[str], now: float, older_than: float | None) -> Verdicts:
    """``(key, size, verdict)`` of each present record, judged by its first bytes only: the
    payloads stay where they are. A verdict of undecodable is confirmed on the whole record
    before it stands (the record may have been replaced between reading its size and its bytes)."""
    with unavailable_as_error(tier.name):
        heads = tier.store.get_heads(keys, HEAD_BYTES)
        longer = {i: extent for i, head in enumerate(heads) if head is not None
                  for extent in [header_extent(head[1])] if extent is not None and len(head[1]) < extent <= head[0]}
        if longer:
            again = tier.store.get_heads([keys[i] for i in longer], max(longer.values()))
            for i, head in zip(longer, again):
                heads[i] = head
    doubtful: list[tuple[str, int]] = []
    for key, head in zip(keys, heads):
        if head is None:
            continue
        size, data = head
        verdict = gc_verdict(key, data, now=now, older_than=older_than, verify=False, size=size)
        if verdict is not None and verdict.startswith("undecodable:"):
            doubtful.append((key, size))
        else:
            yield key, size, verdict
    if doubtful:
        with unavailable_as_error(tier.name):
            values = tier.store.get_many([key for key, _ in doubtful])
        for (key, _), value in zip(doubtful, values):
            if value is not None:
                yield key, len(value), gc_verdict(key, value, now=now, older_than=older_than, verify=False)


def _by_records(tier: Tier, keys: list[str], now: float, older_than: float | None, pool: BufferPool) -> Verdicts:
    """``(key, size, verdict)`` of each present record read whole into ``pool`` and verified
    against the hash taken as it arrived (no second pass over it), each buffer back in the pool
    once judged."""
    with unavailable_as_error(tier.name), closing(tier.store.get_into(keys, pool)) as stream:
        for key, lease in zip(keys, stream):
            if lease is None:
                continue
            try:
                size = len(lease)
                verdict = gc_verdict(key, lease.view, now=now, older_than=older_than, verify=True,
                                     digest=lease.digest)
            finally:
                lease.release()
            yield key, size, verdict


def cmd_gc(args: argparse.Namespace) -> int:
    older_than = parse_duration(args.older_than, name="--older-than") if args.older_than else None
    if args.batch < 1:
        raise ConfigError(f"--batch {args.batch} must be at least 1")
    prefix = namespace_prefix(args.namespace) if args.namespace else KEY_STEM
    now = time.time()
    pool = BufferPool(_VERIFY_POOL_BYTES) if args.verify else None
    tallies: list[GcTally] = []
    with open_tiers(args) as tiers:
        for tier in tiers:
            t = GcTally(tier.name)
            tallies.append(t)
            doomed: list[str] = []
            for batch in batched(iter_tier_keys(tier, prefix), args.batch):
                current: list[str] = []
                old: list[str] = []
                for key in batch:
                    parts = split_key(key)
                    if parts is None:
                        t.foreign_keys += 1
                    elif parts[0] > FORMAT_VERSION:
                        t.newer_version += 1  # written by a newer build: not ours to judge
                    else:
                        (current if parts[0] == FORMAT_VERSION else old).append(key)
                # An older version's record is judged by its key alone: only its size is read.
                verdicts: Verdicts = ((key, size, "old-version") for key, size in zip(old, tier_io.sizes(tier, old))
                                      if size is not None)
                if current:
                    verdicts = itertools.chain(verdicts, _by_headers(tier, current, now, older_than) if pool is None
                                               else _by_records(tier, current, now, older_than, pool))
                for key, size, verdict in verdicts:
                    t.scanned += 1
                    if verdict is None:
                        t.kept += 1
                        t.kept_bytes += size
                    else:
                        t.drop(verdict, size)
                        doomed.append(key)
                if len(doomed) >= BATCH_KEYS:
                    _delete(tier, doomed, args.dry_run)
                    doomed = []
            _delete(tier, doomed, args.dry_run)
    if args.json:
        emit_json({"dry_run": args.dry_run, "older_than_seconds": older_than,
                   "tiers": [vars(t) for t in tallies]})
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for t in tallies:
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(t.removed.items())) or "nothing"
        total = sum(t.removed.values())
        print(f"{t.tier}: scanned {t.scanned} records, {verb} {total} ({human_bytes(t.removed_bytes)}: "
              f"{reasons}), kept {t.kept} ({human_bytes(t.kept_bytes)})")
        if t.newer_version:
            print(f"{t.tier}: left {t.newer_version} records of a newer format version alone")
    return 0


def _delete(tier: Tier, keys: list[str], dry_run: bool) -> None:
    if keys and not dry_run:
        with unavailable_as_error(tier.name):
            tier.store.delete_many(keys)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("rm", help="remove a namespace (or given keys) from every tier")
    add_common_options(p)
    p.add_argument("keys", nargs="*", metavar="KEY", help="record keys to remove")
    p.add_argument("--namespace", metavar="ID", help="remove every record of this namespace")
    p.add_argument("--yes", action="store_true", help="really remove (without it, only report what would go)")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("gc", help="remove old-format, undecodable or misplaced records (and expired ones, with "
                                  "--older-than); other keys are left alone")
    add_common_options(p)
    p.add_argument("--older-than", metavar="AGE", help="also remove records created longer ago than AGE (e.g. 7d, 12h)")
    p.add_argument("--namespace", metavar="ID", help="only this namespace")
    p.add_argument("--verify", action="store_true", help="also check every payload checksum (reads each record fully)")
    p.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    p.add_argument("--batch", type=number(int, 1, 100000), default=16, metavar="N",
                   help="records read per round trip (bounds memory: N x record size; default 16)")
    p.set_defaults(func=cmd_gc)
