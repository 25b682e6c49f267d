"""``kvstore warm PROMPTS.jsonl``: fill a store with the KV of known prompts, offline.

Each line is ``{"prompt_token_ids": [...]}`` or ``{"text": "..."}`` (with ``--tokenizer``).
Engines: ``reference`` (the in-package reference engine, in-process: kvstore's small model of
demos and tests, whose vocabulary a real model's token ids exceed), ``vllm`` (vLLM in-process
with the kvstore connector, ``--model DIR``) and ``server`` (a running vLLM OpenAI-compatible
server with the connector configured, ``--url``). Prompts already fully stored are skipped, so
an interrupted run can simply be started again. Exit status: 0 when every line was warmed or
skipped, 1 when some line was invalid or failed (the summary says which), 2 for a bad option or
an unreachable engine or store.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterator
from typing import IO, Any

from kvstore.cli.common import add_store_option, number, store_urls
from kvstore.errors import ConfigError
from kvstore.warm import BadLine, Prompt, Tokenizer, WarmEngine, WarmSummary, iter_prompts, warm

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("warm", help="write the KV of prompts from a JSONL file into a store (offline cache warming)",
                       description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("prompts", metavar="PROMPTS.jsonl", help='one {"prompt_token_ids": [...]} or {"text": "..."} per line; - for stdin')
    p.add_argument("--engine", choices=("reference", "vllm", "server"), default="reference",
                   help="what computes the KV: your model in vLLM (vllm, --model DIR), a running vLLM server "
                        "(server, --url URL), or kvstore's small built-in model for demos and tests (reference, "
                        "the default: token ids below its vocabulary, 256 with --preset tiny)")
    add_store_option(p)
    p.add_argument("--tokenizer", metavar="PATH", help="local Hugging Face tokenizer directory for text prompts")
    p.add_argument("--no-special-tokens", action="store_true",
                   help="tokenize text without the BOS/special tokens (default: add them, as vLLM's completions API does)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--progress", choices=("auto", "bar", "lines", "none"), default="auto",
                   help="progress display (auto: a bar on a terminal, else none)")
    p.add_argument("--max-failures", type=number(int, 1, 2**31), default=20, metavar="N",
                   help="stop after N prompts fail in a row (default 20)")
    p.add_argument("--metrics-port", type=number(int, 0, 65535), default=None, metavar="PORT",
                   help="serve kvstore metrics at http://127.0.0.1:PORT/metrics while warming")
    g = p.add_argument_group("reference engine")
    g.add_argument("--preset", default="tiny", help="reference model size: tiny, small or bench (default tiny)")
    g.add_argument("--chunk-tokens", type=number(int, 1, 1048576), default=None, metavar="N",
                   help="tokens per stored record (default: the agent's or the vLLM connector's default, 256)")
    g.add_argument("--codec", default=None, help="record codec: raw, lz4, shuffle-lz4, zstd, shuffle-zstd")
    g = p.add_argument_group("vllm engine")
    g.add_argument("--model", metavar="DIR", help="model directory (or name) for --engine vllm")
    g.add_argument("--kv-config", metavar="JSON", default=None,
                   help="extra kv_connector_extra_config options as a JSON object (store comes from --store)")
    g.add_argument("--engine-args", metavar="JSON", default=None,
                   help="extra vllm.LLM(...) keyword arguments as a JSON object, e.g. {\"max_model_len\": 4096}")
    g.add_argument("--batch-size", type=number(int, 1, 100000), default=16, metavar="N", help="prompts per vLLM generate() call (default 16)")
    g = p.add_argument_group("server engine")
    g.add_argument("--url", help="base URL of a vLLM OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    g.add_argument("--served-model", metavar="NAME", help="model name to request (default: the first the server lists)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $KVSTORE_WARM_API_KEY or $OPENAI_API_KEY)")
    g.add_argument("--concurrency", type=number(int, 1, 1024), default=4, metavar="N", help="requests in flight (default 4)")
    g.add_argument("--timeout", type=number(float, 0.001, 86400), default=600.0, metavar="SECONDS", help="per request (default 600)")
    p.set_defaults(func=run)


def _json_option(text: str | None, name: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object, got {text!r}")
    return value


def build_engine(args: argparse.Namespace) -> WarmEngine:
    """The engine the options ask for (ConfigError for missing or contradictory options)."""
    if args.engine == "server":
        from kvstore.warm.server import ServerWarmEngine

        if not args.url:
            raise ConfigError("--engine server needs --url http://host:port of a vLLM OpenAI-compatible server")
        api_key = args.api_key or os.environ.get("KVSTORE_WARM_API_KEY") or os.environ.get("OPENAI_API_KEY")
        return ServerWarmEngine(args.url, model=args.served_model, concurrency=args.concurrency,
                                timeout=args.timeout, api_key=api_key)
    if args.url:
        raise ConfigError(f"--url is only for --engine server (this run uses --engine {args.engine})")
    if args.engine == "reference":
        from kvstore.warm.reference import ReferenceWarmEngine

        return ReferenceWarmEngine(store_urls(args), preset=args.preset, chunk_tokens=args.chunk_tokens,
                                   codec=args.codec or "raw")
    from kvstore.warm.vllm import VLLMWarmEngine

    if not args.model:
        raise ConfigError("--engine vllm needs --model DIR (a local model directory)")
    return VLLMWarmEngine(args.model, store_urls(args), chunk_tokens=args.chunk_tokens, codec=args.codec,
                          kv_config=_json_option(args.kv_config, "--kv-config"),
                          engine_args=_json_option(args.engine_args, "--engine-args"), batch_size=args.batch_size)


def _open_prompts(path: str) -> IO[str]:
    if path == "-":
        return sys.stdin
    try:
        return open(path, encoding="utf-8", errors="replace")
    except OSError as exc:
        raise ConfigError(f"cannot read prompts file {path!r}: {exc.strerror or exc}") from exc


def count_lines(path: str) -> int | None:
    """Lines in ``path`` (for the progress bar's total), read in blocks; ``None`` for stdin."""
    if path == "-":
        return None
    n = 0
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                n += block.count(b"\n")
    except OSError:
        return None
    return n


def format_summary(s: WarmSummary, engine: dict[str, Any]) -> str:
    from kvstore.cli.tiers import human_bytes

    d = s.to_dict()
    lines = [
        f"warm ({engine.get('engine')}): {s.prompts} prompts: {s.warmed} warmed, {s.skipped} skipped "
        f"(already stored), {s.failed} failed; {s.invalid} invalid lines",
        f"  tokens:     {s.tokens} prefilled" + (f", {s.skipped_tokens} in skipped prompts" if s.skipped else ""),
        f"  written:    {'unknown (the server writes; give --store to measure)' if s.bytes_written is None else human_bytes(s.bytes_written)}",
        f"  elapsed:    {s.elapsed:.1f} s, {d['tokens_per_second']:.0f} tokens/s, {d['prompts_per_second']:.2f} prompts/s",
    ]
    if s.aborted:
        lines.append(f"  stopped early: {s.aborted}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.max_failures < 1:
        raise ConfigError(f"--max-failures {args.max_failures} must be at least 1")
    tokenizer = Tokenizer(args.tokenizer, add_special_tokens=not args.no_special_tokens) if args.tokenizer else None
    if args.metrics_port is not None:
        from kvstore.metrics.server import start_metrics_server

        server = start_metrics_server(args.metrics_port)
        print(f"kvstore warm: metrics at {server.url}", file=sys.stderr)
    progress = args.progress
    if progress == "auto":
        progress = "bar" if sys.stderr.isatty() and not args.json else "none"
    stream = _open_prompts(args.prompts)

    def problem(line: int, kind: str, reason: str) -> None:
        print(f"{args.prompts}:{line}: {kind}: {reason}", file=sys.stderr)

    engine = build_engine(args)
    try:
        items: Iterator[Prompt | BadLine] = iter_prompts(stream, tokenizer=tokenizer)
        summary = warm(items, engine, progress=progress,
                       total=count_lines(args.prompts) if progress == "bar" else None,
                       max_consecutive_failures=args.max_failures, on_problem=problem)
        described = engine.describe()
    finally:
        engine.close()
        if stream is not sys.stdin:
            stream.close()
    if args.json:
        json.dump({"engine": described, **summary.to_dict()}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_summary(summary, described))
    return 0 if summary.ok else 1
