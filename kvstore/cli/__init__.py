"""The ``kvstore`` command.

Each subcommand lives in its own module with ``register(subparsers)``; ``COMMANDS`` lists them
in help order. Expected problems (a bad URL, an unreachable store) end with one clear line on
stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from typing import Sequence

from kvstore.errors import KVStoreError

COMMANDS = (
    "kvstore.cli.selftest",
    "kvstore.cli.admin",
    "kvstore.cli.warm",
    "kvstore.cli.demo",
)

#: Default store for every command: the ``KVSTORE_STORE`` environment variable (URLs separated by
#: spaces or commas, fastest tier first), else a file store in the user's cache directory.
ENV_STORE = "KVSTORE_STORE"


# A comma separates URLs only where a new URL (a scheme) follows: a cluster URL lists its
# nodes with commas (redis+cluster://h1:7000,h2:7001).
_URL_SEPARATOR = re.compile(r"\s+|,\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")


def default_store_urls() -> list[str]:
    env = [u for u in _URL_SEPARATOR.split(os.environ.get(ENV_STORE, "").strip()) if u]
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [f"file://{os.path.join(cache, 'kvstore')}"]


def add_store_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", action="append", metavar="URL", default=None,
        help=f"store URL; repeat for tiers, fastest first (default: ${ENV_STORE} or a file store "
             f"in ~/.cache/kvstore)",
    )


def store_urls(args: argparse.Namespace) -> list[str]:
    return args.store or default_store_urls()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="A shared, tiered KV-cache store for LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KVStoreError as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
