"""The ``kvstore`` command.

Each subcommand lives in its own module with ``register(subparsers)``; ``COMMANDS`` lists them
in help order. Expected problems (a bad URL, an unreachable store) end with one clear line on
stderr and exit status 2, never a traceback; anything else (a bug) also ends with one line and
exit status 1, the traceback only with ``--verbose`` (given before or after the subcommand).
Output piped into a reader that stops early (``kvstore ls | head``) ends quietly, with the
status a shell gives a Unix tool its SIGPIPE stopped (141). ``python -m kvstore`` runs it too.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import select
import sys
from collections.abc import Sequence
from typing import NoReturn

from kvstore._version import FORMAT_VERSION, __version__
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


#: The exit status of a command whose reader closed its output early: a shell's for SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvstore", description="A shared, tiered KV-cache store for LLM inference.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens (INFO level)")
    parser.add_argument("--version", action="version",
                        version=f"kvstore {__version__} (record format {FORMAT_VERSION})")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    for command in sub.choices.values():
        # Also after the subcommand, where users put it; SUPPRESS keeps the one given before.
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log what happens (INFO level)")
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
        if isinstance(exc, BrokenPipeError) and _stdout_closed():
            return EXIT_BROKEN_PIPE
        if args.verbose:
            logging.getLogger("kvstore.cli").exception("kvstore %s failed", args.command)
        print(f"kvstore {args.command}: unexpected error: {type(exc).__name__}: {_one_line(exc)}"
              + ("" if args.verbose else " (run with --verbose for the traceback)"), file=sys.stderr)
        return 1


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _stdout_closed() -> bool:
    """Whether standard output's reader is gone (the broken pipe was ours to write, not a
    store's socket). If so, it is pointed at /dev/null: the interpreter flushes it at exit."""
    try:
        fd = sys.stdout.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        closed = any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # replaced (a test's capture), or closed
        return False
    if closed:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return closed


if __name__ == "__main__":
    sys.exit(main())
