"""Reading docker-compose.yml the way Docker Compose does, without Docker.

``load_compose(path, env_file)`` parses the file (pyyaml) and substitutes variables like Compose:
``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``, ``$VAR``
and ``$$`` (a literal ``$``), taking values from the process environment first, then the env
file (``.env`` beside the compose file, or the one given). A required variable that is unset is
a ``ConfigError`` naming it. ``read_env_file`` reads ``KEY=value`` lines (``#`` comments).

Used by ``kvstore dev-stack`` (which runs the stack natively from these definitions) and by the
tests that check the compose file against the code.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError

__all__ = ["Compose", "load_compose", "interpolate", "read_env_file", "published_port", "arg_value"]

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass
class Compose:
    """A parsed, interpolated compose file: ``services`` and which variables it used."""

    path: Path
    doc: dict[str, Any]
    raw: dict[str, Any]
    env: dict[str, str]
    used: set[str] = field(default_factory=set)

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        services: dict[str, dict[str, Any]] = self.doc.get("services") or {}
        return services


def read_env_file(path: str | Path) -> dict[str, str]:
    """``KEY=value`` lines of a Compose env file (blank lines and ``#`` comments skipped);
    ``ConfigError`` naming the file when it cannot be read."""
    values: dict[str, str] = {}
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"env file {str(path)!r} cannot be read: {reason}") from exc
    for line in text.splitlines():
        m = re.match(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$", line)
        if m:
            value = m.group(2).strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            values[m.group(1)] = value
    return values


def interpolate(value: Any, env: Mapping[str, str], used: set[str] | None = None) -> Any:
    """Compose-style variable substitution over a parsed YAML tree (see the module docstring)."""
    used = set() if used is None else used
    if isinstance(value, dict):
        return {k: interpolate(v, env, used) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, used) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(4)
        used.add(name)
        op, arg = m.group(2), m.group(3)
        current = env.get(name)
        if op in (":-", "-"):
            present = bool(current) if op == ":-" else current is not None
            return current if present and current is not None else arg
        if op in (":?", "?"):
            missing = not current if op == ":?" else current is None
            if missing:
                raise ConfigError(f"{name} is required ({arg}); set it in the environment or the env file")
            return current or ""
        return current or ""

    return _VAR.sub(sub, value)


def load_compose(path: str | Path, env_file: str | Path | None = None,
                 environ: Mapping[str, str] | None = None) -> Compose:
    """Parse and interpolate ``path`` (see the module docstring)."""
    try:
        import yaml
    except ImportError:
        raise ConfigError("reading docker-compose.yml needs pyyaml (pip install pyyaml)") from None
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"compose file {str(path)!r} does not exist")
    if env_file is None and (path.parent / ".env").is_file():
        env_file = path.parent / ".env"
    env = read_env_file(env_file) if env_file is not None else {}
    env.update(os.environ if environ is None else environ)
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not isinstance(raw.get("services"), dict):
        raise ConfigError(f"{path} has no services")
    used: set[str] = set()
    doc = interpolate(raw, env, used)
    return Compose(path, doc, raw, env, used)


def published_port(service: Mapping[str, Any], container_port: int) -> int:
    """The host port a service publishes for ``container_port`` (``"127.0.0.1:HOST:CONTAINER"``,
    port ranges ``A-B:C-D`` included); ``ConfigError`` if it publishes none."""
    for item in service.get("ports", []):
        parts = str(item).split(":")
        host, inner = parts[-2], parts[-1].split("/")[0]
        lo, _, hi = inner.partition("-")
        hlo, _, _hhi = host.partition("-")
        if int(lo) <= container_port <= int(hi or lo):
            return int(hlo) + container_port - int(lo)
    raise ConfigError(f"the service publishes no host port for {container_port}")


def arg_value(command: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in a command list, else ``None``."""
    for i, item in enumerate(command):
        if item == name and i + 1 < len(command):
            return command[i + 1]
        if item.startswith(name + "="):
            return item.split("=", 1)[1]
    return None
