"""Looking at stores: ``kvstore stats``, ``ls`` and ``inspect``.

Keys look like ``kvs<format version>/<namespace id>/<prefix digest>`` (``kvstore.keys``); keys
of another shape belong to someone else and are only counted. ``--json`` prints one JSON
document for scripts; otherwise the output is a table for people. Expected problems (a bad URL,
an unreachable store) end as one line and exit status 2; ``inspect`` exits 1 when the record is
missing or invalid.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from kvstore.cli import tiers as tier_io
from kvstore.cli.common import number
from kvstore.cli.tiers import (
    BATCH_KEYS,
    add_common_options,
    batched,
    emit_json,
    human_age,
    human_bytes,
    iter_tier_keys,
    open_tiers,
    print_table,
    unavailable_as_error,
)
from kvstore.errors import CorruptRecordError
from kvstore.keys import FORMAT_VERSION, KEY_STEM, namespace_prefix, split_key
from kvstore.record import decode_record, read_header


# -- stats ----------------------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace) -> int:
    report: list[dict[str, Any]] = []
    with open_tiers(args) as tiers:
        for tier in tiers:
            groups: dict[str, dict[str, int]] = {}
            other = {"records": 0, "bytes": 0}
            for batch in batched(iter_tier_keys(tier, ""), BATCH_KEYS):
                for key, size in zip(batch, tier_io.sizes(tier, batch)):
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
    prefix = namespace_prefix(args.namespace) if args.namespace else KEY_STEM
    listed = 0
    entries: list[dict[str, Any]] = []
    truncated = False
    with open_tiers(args) as tiers:
        for tier in tiers:
            keys = (k for k in iter_tier_keys(tier, prefix) if split_key(k) is not None)
            for batch in batched(keys, BATCH_KEYS if args.long else 1 << 30 if args.limit is None else args.limit):
                sizes = tier_io.sizes(tier, batch) if args.long else [None] * len(batch)
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
            with unavailable_as_error(tier.name):
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


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stats", help="records and bytes per namespace and per tier")
    add_common_options(p)
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("ls", help="list stored record keys")
    add_common_options(p)
    p.add_argument("--namespace", metavar="ID", help="only this namespace (as `kvstore stats` shows it)")
    p.add_argument("-l", "--long", action="store_true", help="with each record's size in bytes")
    p.add_argument("--limit", type=number(int, 1, 2**62), default=None, metavar="N", help="stop after N keys")
    p.set_defaults(func=cmd_ls)

    p = sub.add_parser("inspect", help="show a record's header and check it")
    add_common_options(p)
    p.add_argument("key", metavar="KEY", help="a record key, as `kvstore ls` prints it")
    p.set_defaults(func=cmd_inspect)
