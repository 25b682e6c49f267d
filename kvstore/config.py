"""Typed options: one frozen dataclass per configurable thing, filled from URLs or mappings.

Every store, the tiered store and each engine adapter declare their options as dataclass fields
made with ``option(default, help=..., kind=..., choices=..., secret=...)``. ``build(cls,
options, where=...)`` fills one from raw values (a URL's query via ``query_options``, a JSON
mapping, command-line strings): each value is converted by the field's declared type, with extra
kinds given in ``option(kind=...)``: ``"size"`` accepts ``8GiB``-style sizes, ``"duration"``
accepts ``250ms``/``2s``/``1h``, ``"urls"`` a URL or a list of URLs (``split_urls``). An unknown
parameter, a repeated one or a value that does not convert is a ``ConfigError`` naming it and
what is accepted. Fields marked ``secret=True`` are hidden from ``repr``; ``safe_repr`` also
redacts passwords in URL fields. ``kvstore.docs`` renders the reference tables from the same
metadata, so the documentation cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

from kvstore.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
# A comma separates URLs only where a new URL (a scheme) follows: a cluster URL lists its
# nodes with commas (redis+cluster://h1:7000,h2:7001).
_URL_SEPARATOR = re.compile(r"\s+|,\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(text: str | int, *, name: str = "size") -> int:
    """``"8GiB"`` -> 8589934592. Decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units."""
    if isinstance(text, int):
        value = text
    else:
        m = _NUMBER_UNIT.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _SIZE_UNITS:
            raise ConfigError(
                f"{name}={text!r} is not a size; use a number of bytes with an optional unit "
                f"such as 512MiB, 8GiB or 100MB"
            )
        value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value < 0:
        raise ConfigError(f"{name}={text!r} must not be negative")
    return value


def parse_duration(text: str | float, *, name: str = "duration") -> float:
    """``"250ms"`` -> 0.25 seconds. Units: us, ms, s (default), m/min, h, d."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _NUMBER_UNIT.match(str(text))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _DURATION_UNITS:
            raise ConfigError(
                f"{name}={text!r} is not a duration; use seconds or a number with a unit "
                f"such as 250ms, 2s, 10m or 1h"
            )
        value = float(m.group(1)) * _DURATION_UNITS[unit]
    if value < 0:
        raise ConfigError(f"{name}={text!r} must not be negative")
    return value


def parse_bool(text: str | bool, *, name: str = "flag") -> bool:
    if isinstance(text, bool):
        return text
    low = str(text).strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise ConfigError(f"{name}={text!r} is not a boolean; use one of true/false, 1/0, yes/no, on/off")


def split_urls(text: str) -> list[str]:
    """Store URLs written as one string (separated by spaces, or commas before a scheme)."""
    return [u for u in _URL_SEPARATOR.split(text.strip()) if u]


def parse_urls(raw: Any, *, name: str = "store") -> tuple[str, ...]:
    """A URL, a string of URLs (``split_urls``) or a list of URL strings, as a tuple."""
    if isinstance(raw, str):
        urls = split_urls(raw)
    elif isinstance(raw, (list, tuple)):
        urls = list(raw)
    else:
        raise ConfigError(f"{name}={raw!r} must be a URL string or a list of URL strings")
    for url in urls:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"{name} entry {redact_url(url) if isinstance(url, str) else url!r} is not a URL "
                              "(scheme://...)")
    return tuple(urls)


def convert(cls: type, field: dataclasses.Field[Any], raw: Any) -> Any:
    """Convert one raw option value to the type declared by ``field`` of dataclass ``cls``."""
    kind = field.metadata.get("kind")
    name = field.name
    if kind == "size":
        return parse_size(raw, name=name)
    if kind == "duration":
        return parse_duration(raw, name=name)
    if kind == "urls":
        return parse_urls(raw, name=name)
    hint = typing.get_type_hints(cls)[name]
    origin = typing.get_origin(hint)
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and args:
        if raw is None or raw == "":
            return None
        hint = args[0]
    choices = field.metadata.get("choices")
    try:
        if hint is bool:
            value: Any = parse_bool(raw, name=name)
        elif hint is int:
            value = int(raw)
        elif hint is float:
            value = float(raw)
        elif hint is str:
            value = str(raw)
        elif typing.get_origin(hint) is tuple:
            value = tuple(s for s in (raw.split(",") if isinstance(raw, str) else raw) if s != "")
        else:
            value = raw
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{name}={raw!r} is not a valid {getattr(hint, '__name__', hint)}") from exc
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}={raw!r} is not accepted; use one of: {', '.join(map(str, choices))}")
    return value


def build(cls: type[T], options: Mapping[str, Any], *, where: str, **fixed: Any) -> T:
    """Build dataclass ``cls`` from ``fixed`` values plus user ``options`` (raw strings or values).

    ``where`` names the source (a URL scheme or config section) in error messages. Fields set
    in ``fixed`` (taken from the URL's host or path) cannot also be given as options.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    settable = sorted(n for n in fields if n not in fixed and not fields[n].metadata.get("internal"))
    values: dict[str, Any] = dict(fixed)
    for key, raw in options.items():
        if key not in fields or key in fixed or fields[key].metadata.get("internal"):
            raise ConfigError(
                f"unknown parameter {key!r} for {where}; accepted: {', '.join(settable) or '(none)'}"
            )
        values[key] = convert(cls, fields[key], raw)
    try:
        return cls(**values)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid options for {where}: {exc}") from exc


def query_options(url: str) -> dict[str, str]:
    """The query parameters of ``url`` as a flat dict; a repeated parameter is an error."""
    query = urlsplit(url).query
    parsed = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    out: dict[str, str] = {}
    for key, values in parsed.items():
        if len(values) != 1:
            raise ConfigError(f"parameter {key!r} is given {len(values)} times in {redact_url(url)!r}")
        out[key] = values[0]
    return out


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, safe for logs and ``repr``.

    Works on the raw network location, so URLs that ``urlsplit`` cannot fully interpret (a
    cluster's ``host:port,host:port`` list, a bad port) are redacted too instead of raising.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    userinfo, at, hostinfo = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hostinfo}", parts.path, parts.query, parts.fragment))


def option(default: Any = dataclasses.MISSING, *, kind: str | None = None, secret: bool = False,
           choices: tuple[Any, ...] | None = None, help: str = "", internal: bool = False,
           factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field with kvstore option metadata (``help`` feeds the config reference).

    ``internal`` fields are set by code (from a URL's host, say), never by a user option;
    ``factory`` makes a fresh default (a dict) per instance, like ``field(default_factory=)``.
    """
    meta = {"kind": kind, "secret": secret, "choices": choices, "help": help, "internal": internal}
    if factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=factory, repr=not secret, metadata=meta)
    return dataclasses.field(default=default, repr=not secret, metadata=meta)


def safe_repr(obj: Any) -> str:
    """``repr`` of an options dataclass without secrets: ``secret`` fields are left out and
    passwords in ``urls`` fields are redacted."""
    shown = []
    for f in dataclasses.fields(obj):
        if f.metadata.get("secret"):
            continue
        value = getattr(obj, f.name)
        if f.metadata.get("kind") == "urls":
            value = tuple(redact_url(u) for u in value)
        shown.append(f"{f.name}={value!r}")
    return f"{type(obj).__name__}({', '.join(shown)})"
