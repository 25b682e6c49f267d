"""What every ``kvstore`` subcommand shares: the ``--store`` option and its default."""

from __future__ import annotations

import argparse
import os

from kvstore.config import split_urls

__all__ = ["ENV_STORE", "default_store_urls", "add_store_option", "store_urls"]

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
