"""The pip command that installs what an optional feature needs (``install_hint``).

kvstore's distribution (``kvstore-llm``) is installed from a checkout or from a wheel built from
one, not from a package index, so pip finds nothing by its name. A hint names the extra's
packages themselves, as the installed distribution's metadata lists them (setup.cfg's extras),
and the extra as a checkout installs it (``pip install '.[redis]'``).
"""

from __future__ import annotations

import re

__all__ = ["DISTRIBUTION", "requirements", "install_hint"]

DISTRIBUTION = "kvstore-llm"
# A requirement of an extra as setuptools writes it: 'redis[hiredis]<9,>=5.0; extra == "redis"'.
_OF_EXTRA = re.compile(r"""^\s*([^;]+?)\s*;\s*extra\s*==\s*["']([^"']+)["']\s*$""")


def requirements(extra: str) -> list[str]:
    """What ``extra`` installs (``["redis[hiredis]<9,>=5.0"]``), from the installed metadata;
    empty where kvstore runs from a checkout that was never installed."""
    from importlib import metadata

    try:
        lines = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return []
    return [m.group(1) for m in map(_OF_EXTRA.match, lines) if m is not None and m.group(2) == extra]


def install_hint(extra: str) -> str:
    """``pip install 'redis[hiredis]<9,>=5.0' (or pip install '.[redis]' in a kvstore checkout)``."""
    checkout = f"pip install '.[{extra}]' in a kvstore checkout"
    packages = " ".join(f"'{r}'" for r in requirements(extra))
    return f"pip install {packages} (or {checkout})" if packages else checkout
