"""The ``kvstore`` command.

Each subcommand lives in its own module with ``register(subparsers)``; ``COMMANDS`` lists them
in help order. Expected problems (a bad URL, an unreachable store) end with one clear line on
stderr and exit status 2, never a traceback; anything else (a bug) also ends with one line and
exit status 1, the traceback only with ``--verbose``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvstore.cli.common import ENV_STORE, default_store_urls
from kvstore.errors import KVStoreError

__all__ = ["main", "build_parser", "ENV_STORE", "default_store_urls"]

COMMANDS = (
    "kvstore.cli.selftest",
    "kvstore.cli.browse",
    "kvstore.cli.clean",
    "kvstore.cli.copy",
    "kvstore.cli.bench",
    "kvstore.cli.devstack",
    "kvstore.cli.warm",
    "kvstore.cli.demo",
    "kvstore.cli.proxy",
)


class _Parser(argparse.ArgumentParser):
    """argparse with its errors in one line (no usage block): bad input reads like every other error."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstore", description="A shared, tiered KV-cache store for LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO level)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
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
        print(f"kvstore {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug, or an error class we did not expect: still one line
        if args.verbose:
            logging.getLogger("kvstore.cli").exception("kvstore %s failed", args.command)
        print(f"kvstore {args.command}: unexpected error: {type(exc).__name__}: {_one_line(exc)}"
              + ("" if args.verbose else " (run with --verbose for the traceback)"), file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
