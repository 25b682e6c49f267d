"""Generate the option references from the code: ``docs/configuration.md`` (every store URL
parameter, every option) and the options table of ``docs/vllm.md``.

The tables come from the store registry (``kvstore.stores.registry.BACKENDS``) and the options
dataclasses themselves (field names, types, defaults and ``option(help=...)`` metadata), so the
reference cannot drift: ``tests/test_docs.py`` requires the committed files to equal what this
module renders.

    python -m kvstore.docs            # rewrite both files
    python -m kvstore.docs --check    # exit 1 if either is out of date
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvstore.connectors.agent.config import AgentConfig
from kvstore.connectors.vllm.options import VLLMConnectorOptions
from kvstore.stores.registry import BACKENDS
from kvstore.stores.tiered import TieredConfig

ENVIRONMENT = [
    ("KVSTORE_STORE", "kvstore.cli.common:ENV_STORE",
     "Default `--store` of every `kvstore` command: URLs separated by spaces or commas, fastest tier first."),
    ("KVSTORE_METRICS_PORT", "kvstore.metrics.server:ENV_PORT",
     "`kvstore.metrics.server.start_from_env()` serves `/metrics` on this port (or the next free one of the range)."),
    ("KVSTORE_METRICS_HOST", "kvstore.metrics.server:ENV_HOST",
     "Address for `start_from_env()` (default `127.0.0.1`; `0.0.0.0` inside a container)."),
    ("KVSTORE_METRICS_PORT_RANGE", "kvstore.metrics.server:ENV_PORT_RANGE",
     "How many consecutive ports `start_from_env()` tries (default 4): one per engine process."),
    ("KVSTORE_METRICS_LOOKUP", "kvstore.metrics.server:ENV_LOOKUP",
     "`0` (or `false`, `no`, `off`) turns off the router lookups (`POST /v1/lookup`, `GET /v1/namespaces`: "
     "docs/lookup.md) that the server of `start_from_env()` answers beside `/metrics` (default `1`)."),
    ("KVSTORE_WARM_API_KEY", None,
     "Bearer token `kvstore warm --engine server` sends (else `OPENAI_API_KEY`)."),
]


def _load(target: str) -> Any:
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _type_name(cls: type, f: dataclasses.Field[Any]) -> str:
    kind: str | None = f.metadata.get("kind") if f.metadata else None
    if kind in ("size", "duration"):
        return kind
    if kind == "urls":
        return "URL list"
    hint = typing.get_type_hints(cls).get(f.name, f.type)
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return " \\| ".join(repr(a) for a in typing.get_args(hint))
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin is tuple:
        return "list"
    if origin is not None and args and origin in (typing.Union, types.UnionType):
        return f"{getattr(args[0], '__name__', args[0])} (optional)"
    if origin is not None:
        return getattr(origin, "__name__", str(origin))
    return getattr(hint, "__name__", str(hint))


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
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


def _number(value: float, meta: Mapping[str, Any]) -> str:
    """A range end as the reference shows it: sizes in their largest whole binary unit, durations in s."""
    if meta.get("kind") == "size":
        for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value and value % size == 0:
                return f"`{int(value) // size}{unit}`"
    if meta.get("kind") == "duration":
        return f"`{value:g}s`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def options_table(cls: type, *, skip: tuple[str, ...] = (), required: tuple[str, ...] = ()) -> list[str]:
    """Markdown rows ``| name | type | default | meaning |`` for the settable fields of ``cls``."""
    rows = ["| option | type | default | meaning |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        meta: Mapping[str, Any] = f.metadata or {}
        if not f.init or meta.get("internal") or f.name in skip:
            continue
        help_text = meta.get("help", "")
        if not help_text:
            raise RuntimeError(f"{cls.__name__}.{f.name} has no help text: give it option(help=...)")
        choices = meta.get("choices")
        if choices:
            help_text += " Accepted: " + ", ".join(f"`{c}`" if c != "" else "(empty)" for c in choices) + "."
        bounds = meta.get("range")
        if bounds is not None:
            help_text += f" Accepted: {_number(bounds[0], meta)} to {_number(bounds[1], meta)}."
        default = "required" if f.name in required else _default(f)
        rows.append(f"| `{f.name}` | {_type_name(cls, f)} | {default} | {_cell(help_text)} |")
    return rows


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 -]", "", title.lower()).replace(" ", "-")


def render() -> str:
    """The whole of ``docs/configuration.md``."""
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
    sections = [b.title for b in BACKENDS] + [
        "Tiered store", "vLLM connector", "Agent connector (reference engine, vLLM V0 API)", "Environment variables"]
    out += [f"- [{name}](#{_anchor(name)})" for name in sections]
    out.append("")

    for backend in BACKENDS:
        out += [f"## {backend.title}", "", "Schemes: " + ", ".join(f"`{s}://`" for s in backend.schemes) + ".",
                "", "```", *backend.forms, "```", ""]
        if backend.notes:
            out += [backend.notes, ""]
        if backend.config:
            out += options_table(_load(backend.config), skip=backend.url_fields)
        out.append("")

    out += [
        "## Tiered store",
        "",
        "Built from several URLs (`open_store([...])`, `--store` repeated, the connectors' `store` list).",
        "Local tiers (memory, file) are written synchronously; shared tiers (Redis, S3) through a bounded",
        "background queue each. These options are keyword arguments of `TieredStore.from_urls(urls, **options)`",
        "(the agent's `store_options`).",
        "",
        *options_table(TieredConfig),
        "",
        "## vLLM connector",
        "",
        "`kv_transfer_config = {\"kv_connector\": \"KVStoreConnector\", \"kv_connector_module_path\":",
        "\"kvstore.vllm\", \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {...}}`; the options below",
        "go in `kv_connector_extra_config` (JSON values, or strings such as `\"8GiB\"`).",
        "",
        *vllm_options_table(),
        "## Agent connector (reference engine, vLLM V0 API)",
        "",
        "`kvstore.KVStoreAgent(config)`; `config` is an `AgentConfig` or a mapping with these keys.",
        "",
        *options_table(AgentConfig, required=("store", "model", "model_fingerprint")),
        "",
        "## Environment variables",
        "",
        "| variable | meaning |",
        "|---|---|",
    ]
    for name, target, meaning in ENVIRONMENT:
        if target is not None and _load(target) != name:
            raise RuntimeError(f"{target} is {_load(target)!r}, the docs say {name}")
        out.append(f"| `{name}` | {_cell(meaning)} |")
    out.append("")
    return "\n".join(out)


def vllm_options_table() -> list[str]:
    """The vLLM connector's options (``docs/configuration.md`` and ``docs/vllm.md`` share it)."""
    return [*options_table(VLLMConnectorOptions, required=("store",)), ""]


_VLLM_BEGIN, _VLLM_END = "<!-- options:start -->", "<!-- options:end -->"


def render_vllm_doc(current: str) -> str:
    """``docs/vllm.md`` with its options table (between the option markers) regenerated."""
    begin, end = current.index(_VLLM_BEGIN) + len(_VLLM_BEGIN), current.index(_VLLM_END)
    return current[:begin] + "\n" + "\n".join(vllm_options_table()) + current[end:]


DOCS = Path(__file__).resolve().parents[1] / "docs"
DEFAULT_PATH = DOCS / "configuration.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstore.docs", description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a file differs from the code")
    parser.add_argument("--output", type=Path, default=DEFAULT_PATH, help="where the configuration reference goes")
    parser.add_argument("--vllm-doc", type=Path, default=DOCS / "vllm.md", help="the vLLM guide holding the options table")
    args = parser.parse_args(argv)
    targets = [(args.output, render())]
    if args.vllm_doc.exists():
        targets.append((args.vllm_doc, render_vllm_doc(args.vllm_doc.read_text())))
    stale = [path for path, text in targets if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date; run: python -m kvstore.docs", file=sys.stderr)
        return 1 if stale else 0
    for path, text in targets:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
