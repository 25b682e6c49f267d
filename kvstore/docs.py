"""Generate ``docs/configuration.md`` from the code: every store URL parameter, every option.

The tables come from the configuration dataclasses themselves (field names, types, defaults and
``option(help=...)`` metadata), so the reference cannot drift: ``tests/test_docs.py`` requires
the committed file to equal ``render()``.

    python -m kvstore.docs            # rewrite docs/configuration.md
    python -m kvstore.docs --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path
from typing import Any

#: Store schemes grouped by the class that serves them, with the URL forms each accepts.
#: (``open_store`` is the authority on schemes; ``render`` fails if one is missing here.)
STORE_SECTIONS: list[tuple[str, tuple[str, ...], str, list[str]]] = [
    ("Memory", ("memory",), "kvstore.stores.memory:MemoryConfig", [
        "memory://?max_bytes=8GiB",
    ]),
    ("File", ("file",), "kvstore.stores.file:FileConfig", [
        "file:///var/cache/kvstore?max_bytes=100GiB",
    ]),
    ("Redis", ("redis", "rediss", "unix"), "kvstore.stores.redis:RedisConfig", [
        "redis://[user:password@]host[:port][/db]?ttl=1h",
        "rediss://[user:password@]host[:port][/db]?ca_certs=/path/ca.pem (TLS)",
        "unix://[user:password@]/path/to/redis.sock?db=0",
    ]),
    ("Redis Cluster", ("redis+cluster", "rediss+cluster"), "kvstore.stores.redis:RedisConfig", [
        "redis+cluster://[user:password@]host:port[,host:port...]?ttl=1h",
        "rediss+cluster://... (TLS)",
    ]),
    ("S3", ("s3",), "kvstore.stores.s3:S3Config", [
        "s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1",
    ]),
]

STORE_NOTES = {
    "Redis": "The password is part of the URL (percent-encode special characters); `redact_url` hides it "
             "in logs. `db` may also be given as the URL path (`/0`). Values are written with `SET ... PX ttl` "
             "when `ttl` is set; run Redis with `maxmemory` and `maxmemory-policy allkeys-lru`.",
    "Redis Cluster": "Same options as Redis; a cluster has only database 0. Startup nodes are listed in the "
                     "host part, comma-separated.",
    "S3": "Credentials never go in the URL: boto3's standard chain provides them (`AWS_ACCESS_KEY_ID` / "
          "`AWS_SECRET_ACCESS_KEY`, `~/.aws`, `?profile=`, instance roles). The URL path is the key prefix.",
    "File": "The path must be absolute; several processes on one host may share the directory.",
    "Memory": "Private to the process: the fastest tier of one replica.",
}

#: Fields that come from the URL's host or path, not from its query string.
URL_FIELDS = {"kvstore.stores.file:FileConfig": ("path",)}

#: Help for dataclasses that predate ``option(help=...)`` (``AgentConfig``). Every field must have
#: help in its metadata or here: ``render`` fails otherwise, so a new option cannot go undocumented.
FALLBACK_HELP: dict[str, dict[str, str]] = {
    "AgentConfig": {
        "store": "Store URL or list of URLs, fastest tier first (several build a tiered store).",
        "model": "Model name in the key namespace.",
        "model_fingerprint": "A revision or hash of the weights and config: KV is shared only between equal "
                             "(model, model_fingerprint).",
        "chunk_tokens": "Tokens per stored record; a positive multiple of the engine's block size.",
        "role": "`both` loads and saves, `producer` only saves, `consumer` only loads (vLLM's `kv_both`, "
                "`kv_producer`, `kv_consumer` are accepted too).",
        "rank": "Tensor-parallel rank whose KV shard this engine holds (part of the namespace).",
        "tp_size": "Tensor-parallel size (part of the namespace).",
        "local_rank": "Accepted for vLLM V0 compatibility; not used by the agent.",
        "codec": "Record codec: `raw`, `lz4`, `shuffle-lz4`, `zstd`, `shuffle-zstd`.",
        "kv_layout": "`kvstore.paged` layout of the KV cache; inferred for 5-d (`flash-2bnhd`) and 3-d "
                     "(`mla-bnl`) caches, required for 4-d ones (`vllm-bhnc`, `vllm-cpu-vec`).",
        "adapter": "Adapter (LoRA) id, part of the namespace.",
        "cache_salt": "Tenant salt, part of the namespace: different salts never share records.",
        "store_options": "Tiered store options (see [Tiered store](#tiered-store)).",
    },
}

ENVIRONMENT = [
    ("KVSTORE_STORE", "kvstore.cli:ENV_STORE",
     "Default `--store` of every `kvstore` command: URLs separated by spaces or commas, fastest tier first."),
    ("KVSTORE_METRICS_PORT", "kvstore.metrics_server:ENV_PORT",
     "`metrics_server.start_from_env()` serves `/metrics` on this port (or the next free one of the range)."),
    ("KVSTORE_METRICS_HOST", "kvstore.metrics_server:ENV_HOST",
     "Address for `start_from_env()` (default `127.0.0.1`; `0.0.0.0` inside a container)."),
    ("KVSTORE_METRICS_PORT_RANGE", "kvstore.metrics_server:ENV_PORT_RANGE",
     "How many consecutive ports `start_from_env()` tries (default 4): one per engine process."),
    ("KVSTORE_WARM_API_KEY", None,
     "Bearer token `kvstore warm --engine server` sends (else `OPENAI_API_KEY`)."),
]


def _load(target: str) -> Any:
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type_name(cls: type, f: dataclasses.Field) -> str:
    kind = f.metadata.get("kind") if f.metadata else None
    if kind in ("size", "duration"):
        return kind
    hint = typing.get_type_hints(cls).get(f.name, f.type)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin is tuple:
        return "list"
    if origin is not None and args and origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return f"{getattr(args[0], '__name__', args[0])} (optional)"
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    kind = f.metadata.get("kind") if f.metadata else None
    if kind == "size" and isinstance(value, int):
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value and value % size == 0:
                return f"`{value // size}{unit}`"
        return f"`{value}`"
    if kind == "duration":
        return f"`{value:g}s`"
    if value == "" or value == () or value == {}:
        return "(empty)"
    if value is None:
        return "(none)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def options_table(cls: type, *, skip: tuple[str, ...] = (), required: tuple[str, ...] = ()) -> list[str]:
    """Markdown rows ``| name | type | default | meaning |`` for the settable fields of ``cls``."""
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    fallback = FALLBACK_HELP.get(cls.__name__, {})
    for f in dataclasses.fields(cls):
        meta = f.metadata or {}
        if not f.init or meta.get("internal") or f.name in skip:
            continue
        help_text = meta.get("help", "") or fallback.get(f.name, "")
        if not help_text:
            raise RuntimeError(f"{cls.__name__}.{f.name} has no help text: give it option(help=...)")
        choices = meta.get("choices")
        if choices:
            help_text += " Accepted: " + ", ".join(f"`{c}`" if c != "" else "(empty)" for c in choices) + "."
        default = "required" if f.name in required else _default(f)
        rows.append(f"| `{f.name}` | {_type_name(cls, f)} | {default} | {_cell(help_text)} |")
    return rows


def render() -> str:
    """The whole of ``docs/configuration.md``."""
    from kvstore.stores import known_schemes

    covered = {s for _, schemes, _, _ in STORE_SECTIONS for s in schemes}
    missing = set(known_schemes()) - covered
    if missing:
        raise RuntimeError(f"kvstore.docs.STORE_SECTIONS lacks schemes {sorted(missing)}")

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m kvstore.docs` from the configuration dataclasses; do not edit by hand."
        " tests/test_docs.py fails when this file and the code disagree. -->",
        "",
        "Stores are configured by URL: `scheme://location?option=value&...`. Several URLs, fastest first,",
        "make a tiered store. An unknown, repeated or malformed option is an error at start-up that names it.",
        "Sizes accept units (`512MiB`, `8GiB`, `100MB`); durations accept `250ms`, `2s`, `10m`, `1h`, `1d`;",
        "booleans accept `true/false`, `1/0`, `yes/no`, `on/off`.",
        "",
        "## Contents",
        "",
    ]
    sections = [name for name, *_ in STORE_SECTIONS] + [
        "Tiered store", "vLLM connector", "Agent connector (reference engine, vLLM V0 API)", "Environment variables"]
    for name in sections:
        anchor = name.lower().replace(" ", "-").replace("(", "").replace(")", "").replace(",", "")
        out.append(f"- [{name}](#{anchor})")
    out.append("")

    for name, schemes, target, forms in STORE_SECTIONS:
        cls = _load(target)
        out += [f"## {name}", "", "Schemes: " + ", ".join(f"`{s}://`" for s in schemes) + ".", "", "```"]
        out += forms
        out += ["```", ""]
        if STORE_NOTES.get(name):
            out += [STORE_NOTES[name], ""]
        out += options_table(cls, skip=URL_FIELDS.get(target, ()))
        out.append("")

    from kvstore.stores.tiered import TieredConfig

    out += [
        "## Tiered store",
        "",
        "Built from several URLs (`open_store([...])`, `--store` repeated, the connectors' `store` list).",
        "Local tiers (memory, file) are written synchronously; shared tiers (Redis, S3) through a bounded",
        "background queue each. These options are keyword arguments of `TieredStore.from_urls(urls, **options)`",
        "(the agent's `store_options`).",
        "",
    ]
    out += options_table(TieredConfig)
    out.append("")

    from connectors.vllm_config import VLLMConnectorOptions

    out += [
        "## vLLM connector",
        "",
        "`kv_transfer_config = {\"kv_connector\": \"KVStoreConnector\", \"kv_connector_module_path\":",
        "\"connectors.vllm_v1\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {...}}`; the options below",
        "go in `kv_connector_extra_config` (JSON values, or strings such as `\"8GiB\"`).",
        "",
    ]
    out += options_table(VLLMConnectorOptions, required=("store",))
    out.append("")

    from connectors.agent import AgentConfig

    out += [
        "## Agent connector (reference engine, vLLM V0 API)",
        "",
        "`connectors.agent.KVStoreAgent(config)`; `config` is an `AgentConfig` or a mapping with these keys.",
        "",
    ]
    out += options_table(AgentConfig)
    out.append("")

    out += ["## Environment variables", "", "| variable | meaning |", "|---|---|"]
    for name, target, meaning in ENVIRONMENT:
        if target is not None and _load(target) != name:
            raise RuntimeError(f"{target} is {_load(target)!r}, the docs say {name}")
        out.append(f"| `{name}` | {_cell(meaning)} |")
    out.append("")
    return "\n".join(out)


DEFAULT_PATH = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.docs", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from the code")
    parser.add_argument("--output", type=Path, default=DEFAULT_PATH)
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date; run: python -m kvstore.docs", file=sys.stderr)
            return 1
        return 0
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
