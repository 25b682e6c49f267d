"""Store administration: ``kvstore stats``, ``ls``, ``inspect``, ``rm`` and ``gc``.

Every command takes the store as ``--store URL`` (repeatable, one per tier) and looks at each
tier on its own: a tiered deployment's memory, Redis and S3 tiers are listed, counted and
cleaned separately, never through the tiered store (whose promotion and write-behind would
blur what each tier holds).

Keys look like ``kvs<format version>/<namespace id>/<prefix digest>``. Keys of another shape
belong to someone else and are only counted, never changed. ``--json`` prints one JSON document
for scripts; otherwise the output is a table for people. Expected problems (a bad URL, an
unreachable store) are ``KVStoreError``\\ s, which the dispatcher turns into one line and exit
status 2. Commands that find nothing to act on, or are refused (``rm`` without ``--yes``), exit 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from kvstore.cli import add_store_option, store_urls
from kvstore.config import parse_duration, redact_url
from kvstore.errors import ConfigError, CorruptRecordError, StoreUnavailableError
from kvstore.keys import FORMAT_VERSION
from kvstore.record import decode_record, read_header
from kvstore.stores import open_store
from kvstore.stores.base import Store

#: ``kvs<version>/<namespace id>/<digest>`` as written by ``kvstore.keys``.
KEY_RE = re.compile(r"^kvs(\d+)/([0-9a-f]{16})/([0-9a-f]{32})$")
_NAMESPACE_RE = re.compile(r"^(?:kvs(\d+)/)?([0-9a-f]{16})/?$")
_BATCH_KEYS = 1000  # keys per size/delete round trip


# -- shared helpers -------------------------------------------------------------------------------
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
def _unavailable_as_error(tier_name: str) -> Iterator[None]:
    """OS-level failures of a backend (a vanished directory, a reset socket) are outages, not bugs."""
    try:
        yield
    except (OSError, TimeoutError) as exc:
        if isinstance(exc, StoreUnavailableError):
            raise
        raise StoreUnavailableError(f"{tier_name}: {type(exc).__name__}: {exc}") from exc


@contextmanager
def open_tiers(args: argparse.Namespace) -> Iterator[list[Tier]]:
    """Open every ``--store`` URL separately; all of them are closed on exit."""
    tiers: list[Tier] = []
    try:
        for i, url in enumerate(store_urls(args)):
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


def parse_namespace(text: str) -> str:
    """``3fa2...`` or ``kvs1/3fa2...`` -> the key prefix ``kvs1/3fa2.../``."""
    m = _NAMESPACE_RE.match(text.strip().lower())
    if m is None:
        raise ConfigError(f"--namespace {text!r} is not a namespace id; use the 16 hex digits that "
                          f"`kvstore stats` shows (optionally as kvs{FORMAT_VERSION}/<id>)")
    version = int(m.group(1)) if m.group(1) else FORMAT_VERSION
    return f"kvs{version}/{m.group(2)}/"


def split_key(key: str) -> tuple[int, str, str] | None:
    """``(version, namespace id, digest)`` of a kvstore key, or ``None`` for a foreign key."""
    m = KEY_RE.match(key)
    return None if m is None else (int(m.group(1)), m.group(2), m.group(3))


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


def _sizes(tier: Tier, keys: list[str]) -> list[int | None]:
    with _unavailable_as_error(tier.name):
        return tier.store.size_many(keys)


def _iter_keys(tier: Tier, prefix: str) -> Iterator[str]:
    with _unavailable_as_error(tier.name):
        yield from tier.store.iter_keys(prefix)


# -- stats ----------------------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace) -> int:
    report = []
    with open_tiers(args) as tiers:
        for tier in tiers:
            groups: dict[str, dict[str, int]] = {}
            other = {"records": 0, "bytes": 0}
            for batch in batched(_iter_keys(tier, ""), _BATCH_KEYS):
                for key, size in zip(batch, _sizes(tier, batch)):
                    if size is None:
                        continue  # evicted or expired while we looked
                    parts = split_key(key)
                    if parts is None:
                        other["records"] += 1
                        other["bytes"] += size
                        continue
                    g = groups.setdefault(f"kvs{parts[0]}/{parts[1]}", {"records": 0, "bytes": 0})
                    g["records"] += 1
                    g["bytes"] += size
            namespaces = [
                {"namespace": name.split("/", 1)[1], "version": int(name.split("/", 1)[0][3:]), **g}
                for name, g in sorted(groups.items(), key=lambda kv: -kv[1]["bytes"])
            ]
            report.append({
                "tier": tier.name, "store": tier.store.describe(),
                "records": sum(g["records"] for g in groups.values()),
                "bytes": sum(g["bytes"] for g in groups.values()),
                "namespaces": namespaces, "other_keys": other,
            })
    if args.json:
        emit_json({"format_version": FORMAT_VERSION, "tiers": report})
        return 0
    rows = []
    for t in report:
        for ns in t["namespaces"]:
            note = "" if ns["version"] == FORMAT_VERSION else f"  (format v{ns['version']})"
            rows.append([t["tier"], ns["namespace"] + note, ns["records"], human_bytes(ns["bytes"])])
        rows.append([t["tier"], "(total)", t["records"], human_bytes(t["bytes"])])
        if t["other_keys"]["records"]:
            rows.append([t["tier"], "(not kvstore keys)", t["other_keys"]["records"],
                         human_bytes(t["other_keys"]["bytes"])])
    print_table(rows, ["TIER", "NAMESPACE", "RECORDS", "BYTES"], right=(2, 3))
    return 0


# -- ls -------------------------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    prefix = parse_namespace(args.namespace) if args.namespace else "kvs"
    listed = 0
    entries: list[dict[str, Any]] = []
    truncated = False
    with open_tiers(args) as tiers:
        for tier in tiers:
            keys = (k for k in _iter_keys(tier, prefix) if split_key(k) is not None)
            for batch in batched(keys, _BATCH_KEYS if args.long else 1 << 30 if args.limit is None else args.limit):
                sizes = _sizes(tier, batch) if args.long else [None] * len(batch)
                for key, size in zip(batch, sizes):
                    if args.limit is not None and listed >= args.limit:
                        truncated = True
                        break
                    if args.long and size is None:
                        continue
                    listed += 1
                    entry = {"tier": tier.name, "key": key} | ({"bytes": size} if args.long else {})
                    if args.json:
                        entries.append(entry)
                    elif args.long:
                        print(f"{tier.name}\t{size}\t{key}")
                    elif len(tiers) > 1:
                        print(f"{tier.name}\t{key}")
                    else:
                        print(key)
                if truncated:
                    break
            if truncated:
                break
    if args.json:
        emit_json({"keys": entries, "truncated": truncated})
    elif truncated:
        print(f"(stopped after --limit {args.limit} keys)", file=sys.stderr)
    return 0


# -- inspect --------------------------------------------------------------------------------------
def cmd_inspect(args: argparse.Namespace) -> int:
    key = args.key
    found: list[dict[str, Any]] = []
    header_doc: dict[str, Any] | None = None
    problem: str | None = None
    with open_tiers(args) as tiers:
        for tier in tiers:
            with _unavailable_as_error(tier.name):
                value = tier.store.get(key)
            if value is None:
                found.append({"tier": tier.name, "present": False})
                continue
            entry: dict[str, Any] = {"tier": tier.name, "present": True, "bytes": len(value)}
            try:
                header = read_header(value)
                decode_record(value)  # payload checksum and codec stream; no expectations
                entry["valid"] = True
            except CorruptRecordError as exc:
                entry["valid"] = False
                entry["problem"] = f"{exc.reason}: {exc}"
                header = None
            if header is not None:
                parts = split_key(key)
                if parts is not None and (header.namespace[:8].hex() != parts[1] or header.key.hex() != parts[2]):
                    entry["valid"] = False
                    entry["problem"] = "key: the record's namespace or prefix digest does not match its key"
                if header_doc is None:
                    header_doc = header.to_dict()
                    header_doc["tokens"] = header.token_ids.tolist()
                    header_doc["age_seconds"] = max(0.0, time.time() - header.created)
            if not entry["valid"] and problem is None:
                problem = entry["problem"]
            found.append(entry)
    present = [f for f in found if f["present"]]
    if args.json:
        emit_json({"key": key, "tiers": found, "header": header_doc})
    else:
        for f in found:
            state = "absent" if not f["present"] else (
                f"{human_bytes(f['bytes'])}, " + ("valid" if f["valid"] else f"INVALID ({f['problem']})"))
            print(f"{f['tier']}: {state}")
        if header_doc is not None:
            print()
            tokens = header_doc["tokens"]
            shown = ", ".join(map(str, tokens[:16])) + (", ..." if len(tokens) > 16 else "")
            rows = [
                ("format version", header_doc["version"]),
                ("namespace", header_doc["namespace"]),
                ("prefix digest", header_doc["key"]),
                ("tokens", f"{header_doc['start']}..{header_doc['start'] + header_doc['num_tokens']}"
                           f" ({header_doc['num_tokens']}{', partial chunk' if header_doc['partial'] else ''})"),
                ("token ids", f"[{shown}]"),
                ("dtype", header_doc["dtype"]),
                ("tensors", f"{len(header_doc['shapes'])} x {header_doc['shapes'][0] if header_doc['shapes'] else []}"),
                ("hidden state", header_doc["hidden"] or "none"),
                ("codecs", ", ".join(header_doc["codecs"]) or "raw"),
                ("kv bytes", f"{header_doc['raw_len']} (stored {header_doc['payload_len']})"),
                ("checksum", f"xxh3-64 {header_doc['checksum']}"),
                ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(header_doc["created"]))
                 + f" ({human_age(header_doc['age_seconds'])} ago)"),
            ]
            for name, value in rows:
                print(f"{name + ':':16}{value}")
    if not present:
        print(f"kvstore inspect: {key} is not stored in any tier", file=sys.stderr)
        return 1
    return 1 if problem is not None else 0


# -- rm -------------------------------------------------------------------------------------------
def cmd_rm(args: argparse.Namespace) -> int:
    if not args.namespace and not args.keys:
        raise ConfigError("kvstore rm needs --namespace ID or one or more KEYs")
    prefix = parse_namespace(args.namespace) if args.namespace else None
    report = []
    with open_tiers(args) as tiers:
        for tier in tiers:
            records = nbytes = removed = 0
            candidates: Iterable[str] = list(args.keys)
            if prefix is not None:
                candidates = _chain(candidates, _iter_keys(tier, prefix))
            for batch in batched(candidates, _BATCH_KEYS):
                sizes = _sizes(tier, batch)
                present = [k for k, s in zip(batch, sizes) if s is not None]
                records += len(present)
                nbytes += sum(s for s in sizes if s is not None)
                if args.yes and present:
                    with _unavailable_as_error(tier.name):
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
               verify: bool) -> str | None:
    """Why record ``key`` should go (``expired``, ``undecodable:<reason>``, ``mismatch``), or ``None``."""
    parts = split_key(key)
    assert parts is not None
    try:
        header = read_header(value)
        if verify:
            decode_record(value)
    except CorruptRecordError as exc:
        return f"undecodable:{exc.reason}"
    if header.namespace[:8].hex() != parts[1] or header.key.hex() != parts[2]:
        return "mismatch"
    if older_than is not None and now - header.created > older_than:
        return "expired"
    return None


def cmd_gc(args: argparse.Namespace) -> int:
    older_than = parse_duration(args.older_than, name="--older-than") if args.older_than else None
    if args.batch < 1:
        raise ConfigError(f"--batch {args.batch} must be at least 1")
    prefix = parse_namespace(args.namespace) if args.namespace else "kvs"
    now = time.time()
    tallies: list[GcTally] = []
    with open_tiers(args) as tiers:
        for tier in tiers:
            t = GcTally(tier.name)
            tallies.append(t)
            doomed: list[str] = []
            for batch in batched(_iter_keys(tier, prefix), args.batch):
                current: list[str] = []
                for key in batch:
                    parts = split_key(key)
                    if parts is None:
                        t.foreign_keys += 1
                    elif parts[0] < FORMAT_VERSION:
                        current.append(key)  # read below only for its size
                    elif parts[0] > FORMAT_VERSION:
                        t.newer_version += 1  # written by a newer build: not ours to judge
                    else:
                        current.append(key)
                if not current:
                    continue
                with _unavailable_as_error(tier.name):
                    values = tier.store.get_many(current)
                for key, value in zip(current, values):
                    if value is None:
                        continue
                    t.scanned += 1
                    if split_key(key)[0] < FORMAT_VERSION:  # type: ignore[index]
                        verdict: str | None = "old-version"
                    else:
                        verdict = gc_verdict(key, value, now=now, older_than=older_than, verify=args.verify)
                    if verdict is None:
                        t.kept += 1
                        t.kept_bytes += len(value)
                    else:
                        t.drop(verdict, len(value))
                        doomed.append(key)
                del values
                if len(doomed) >= _BATCH_KEYS:
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
        with _unavailable_as_error(tier.name):
            tier.store.delete_many(keys)


# -- registration ---------------------------------------------------------------------------------
def _common(p: argparse.ArgumentParser) -> None:
    add_store_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="records and bytes per namespace and per tier")
    _common(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("ls", help="list stored record keys")
    _common(p)
    p.add_argument("--namespace", metavar="ID", help="only this namespace (as `kvstore stats` shows it)")
    p.add_argument("-l", "--long", action="store_true", help="with each record's size in bytes")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="stop after N keys")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show a record's header and check it")
    _common(p)
    p.add_argument("key", metavar="KEY", help="a record key, as `kvstore ls` prints it")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("rm", help="remove a namespace (or given keys) from every tier")
    _common(p)
    p.add_argument("keys", nargs="*", metavar="KEY", help="record keys to remove")
    p.add_argument("--namespace", metavar="ID", help="remove every record of this namespace")
    p.add_argument("--yes", action="store_true", help="really remove (without it, only report what would go)")
    p.set_defaults(func=cmd_rm)

    p = sub.add_parser("gc", help="remove expired, old-format or undecodable records")
    _common(p)
    p.add_argument("--older-than", metavar="AGE", help="also remove records created longer ago than AGE (e.g. 7d, 12h)")
    p.add_argument("--namespace", metavar="ID", help="only this namespace")
    p.add_argument("--verify", action="store_true", help="also check every payload checksum (reads each record fully)")
    p.add_argument("--dry-run", action="store_true", help="report what would be removed, remove nothing")
    p.add_argument("--batch", type=int, default=16, metavar="N",
                   help="records read per round trip (bounds memory: N x record size; default 16)")
    p.set_defaults(func=cmd_gc)
