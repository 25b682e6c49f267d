"""What every ``kvstore`` subcommand shares: the ``--store`` option and its default."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

from kvstore.config import format_number, split_urls

__all__ = ["ENV_STORE", "default_store_urls", "add_store_option", "store_urls", "number"]

#: Default store for every command: the ``KVSTORE_STORE`` environment variable (URLs separated by
#: spaces or commas, fastest tier first), else a file store in the user's cache directory.
ENV_STORE = "KVSTORE_STORE"


def default_store_urls() -> list[str]:
    env = split_urls(os.environ.get(ENV_STORE, ""))
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
    urls: list[str] = args.store or default_store_urls()
    return urls


def number(kind: type[int] | type[float], lo: float, hi: float) -> Callable[[str], int | float]:
    """An argparse ``type`` for a numeric flag: ``kind`` (int or float) between ``lo`` and ``hi``.

    Bad input is argparse's error (exit 2, the flag named), never an exception in a command.
    """
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not (lo <= value <= hi) or (isinstance(value, float) and math.isnan(value)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: give {format_number(lo)} to {format_number(hi)}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse
