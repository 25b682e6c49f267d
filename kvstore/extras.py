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
# The extra in a requirement's marker as setuptools writes it: 'redis[hiredis]<9,>=5.0; extra == "redis"',
# 'pkg>=1; (platform_system == "Linux") and extra == "name"'.
_EXTRA = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")


def requirements(extra: str, requires: list[str] | None = None) -> list[str]:
    """What ``extra`` installs (``["redis[hiredis]<9,>=5.0"]``, platform markers left out), from
    ``requires`` (default: the installed metadata); empty where kvstore runs from a checkout
    that was never installed."""
    if requires is None:
        from importlib import metadata

        try:
            requires = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:
            return []
    out = []
    for line in requires:
        requirement, _, marker = line.partition(";")
        if any(m == extra for m in _EXTRA.findall(marker)):
            out.append(requirement.strip())
    return out


def install_hint(extra: str) -> str:
    """``pip install 'redis[hiredis]<9,>=5.0' (or pip install '.[redis]' in a kvstore checkout)``."""
    checkout = f"pip install '.[{extra}]' in a kvstore checkout"
    packages = " ".join(f"'{r}'" for r in requirements(extra))
    return f"pip install {packages} (or {checkout})" if packages else checkout
