"""Typed options: one frozen dataclass per configurable thing, filled from URLs or mappings.

Every store, the tiered store and each engine adapter declare their options as dataclass fields
made with ``option(default, help=..., kind=..., choices=..., secret=...)``. ``build(cls,
options, where=...)`` fills one from raw values (a URL's query via ``query_options``, a JSON
mapping, command-line strings): each value is converted by the field's declared type, with extra
kinds given in ``option(kind=...)``: ``"size"`` accepts ``8GiB``-style sizes, ``"duration"``
accepts ``250ms``/``2s``/``1h``, ``"urls"`` a URL or a list of URLs (``split_urls``). An unknown
parameter, a repeated one or a value that does not convert is a ``ConfigError`` naming it and
what is accepted. Numbers are ASCII digits only (``int()`` alone would take other scripts'
digits and ``1_000``), finite, and integers are never silently truncated; sizes are at most
``MAX_SIZE`` and durations at most ``MAX_DURATION`` (each options class narrows its own ranges
with ``check_range``, or declare it: ``option(..., lo=, hi=)``, checked by ``build`` and by
``check_options`` from a dataclass's ``__post_init__``, so direct construction is checked too).
No text value may hold a control character: URLs (``check_url``: Python's URL parser silently
drops CR, LF and tabs, so the operator would get another value than written) and every other
option alike (``"1h\\r\\n"`` is not ``1h``).
Fields marked ``secret=True`` are hidden from ``repr``; ``safe_repr`` also
redacts passwords in URL fields. ``kvstore.docs`` renders the reference tables from the same
metadata, so the documentation cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
import unicodedata
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import SplitResult, parse_qs, urlsplit, urlunsplit

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
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)
_INTEGER = re.compile(r"^\s*[+-]?[0-9]+\s*$", re.ASCII)
_FLOAT = re.compile(r"^\s*[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?\s*$", re.ASCII)
#: The largest size any option takes (1 PiB): beyond it a value is a typo, not a plan.
MAX_SIZE = 1 << 50
#: The longest duration any option takes (10 years); options narrow it (timeouts: minutes).
MAX_DURATION = 10 * 365 * 86400.0
# A comma separates URLs only where a new URL (a scheme) follows: a cluster URL lists its
# nodes with commas (redis+cluster://h1:7000,h2:7001).
_URL_SEPARATOR = re.compile(r"\s+|,\s*(?=[A-Za-z][A-Za-z0-9+.-]*://)")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_size(text: str | int, *, name: str = "size") -> int:
    """``"8GiB"`` -> 8589934592. Decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units; at most ``MAX_SIZE``."""
    if isinstance(text, bool):
        raise ConfigError(f"{name}={text!r} is not a size")
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
        number = m.group(1)
        exact = number.isdigit()  # ASCII digits only (the pattern): no float rounding of big counts
        scaled = int(number) * _SIZE_UNITS[unit] if exact else float(number) * _SIZE_UNITS[unit]
        if not exact and not math.isfinite(scaled):
            raise ConfigError(f"{name}={text!r} is not a finite size (at most {MAX_SIZE} bytes, 1 PiB)")
        value = int(scaled) if scaled <= MAX_SIZE else MAX_SIZE + 1
    if value < 0:
        raise ConfigError(f"{name}={text!r} must not be negative")
    if value > MAX_SIZE:
        raise ConfigError(f"{name}={text!r} is larger than any store ({MAX_SIZE} bytes, 1 PiB, at most)")
    return value


def parse_duration(text: str | float, *, name: str = "duration") -> float:
    """``"250ms"`` -> 0.25 seconds. Units: us, ms, s (default), m/min, h, d; finite, at most ``MAX_DURATION``."""
    if isinstance(text, bool):
        raise ConfigError(f"{name}={text!r} is not a duration")
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
    if not value <= MAX_DURATION:  # also NaN and infinity
        raise ConfigError(f"{name}={text!r} is not a finite duration of at most 10 years")
    return value


def format_number(x: float) -> str:
    """``x`` exactly, as a person reads it: a whole number in full (``1048576``, never
    ``1.04858e+06``), any other the shortest decimal that reads back as ``x`` (``0.001``)."""
    if isinstance(x, float) and x.is_integer():
        return str(int(x))
    return str(x) if isinstance(x, int) else repr(x)


_BINARY_UNITS = (("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def format_size(n: float) -> str:
    """A byte count exactly, in its largest whole binary unit where it has one: ``1 MiB``,
    ``1000000 bytes``, ``1 byte``."""
    if isinstance(n, (int, float)) and n and float(n).is_integer():
        for unit, size in _BINARY_UNITS:
            if int(n) % size == 0:
                return f"{int(n) // size} {unit}"
    return f"{format_number(n)} byte{'' if n == 1 else 's'}"


def check_range(name: str, value: float, lo: float, hi: float, *, unit: str = "", given: Any = None) -> None:
    """``ConfigError`` unless ``lo <= value <= hi`` (NaN never is), naming the value (``given``:
    as the user wrote it, when ``value`` was converted from it) and the range, exactly (sizes,
    ``unit=" bytes..."``, in binary units where they are whole ones)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        sizes = unit.startswith(" bytes")

        def show(x: float) -> str:
            return format_size(x) if sizes else format_number(x) + unit

        shown = repr(value if given is None else given)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and show(value) != shown:
            shown += f" ({show(value)})"
        accepted = (f"{format_size(lo)} to {format_size(hi)}{unit[len(' bytes'):]}" if sizes
                    else f"{format_number(lo)} to {format_number(hi)}{unit}")
        raise ConfigError(f"{name}={shown} is out of range; accepted: {accepted}")


def check_text(name: str, text: str) -> None:
    """``ConfigError`` if the option ``name``'s value ``text`` holds a control character."""
    bad = next((ch for ch in text if unicodedata.category(ch) == "Cc"), None)
    if bad is not None:
        raise ConfigError(f"{name}={text!r} holds the control character {bad!r}; accepted: printable characters only")


def check_options(obj: Any) -> None:
    """Check every field of the options dataclass ``obj`` against its declaration: text without
    control characters (URLs: ``check_url``), numbers within ``option(lo=, hi=)``. For
    ``__post_init__``, so options built directly are held to what ``build`` enforces."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        meta: Mapping[str, Any] = f.metadata or {}
        if meta.get("kind") == "urls":
            for url in (value,) if isinstance(value, str) else value:
                if isinstance(url, str):
                    check_url(url, name=f.name)
        elif isinstance(value, str):
            check_text(f.name, value)
        elif isinstance(value, tuple):
            for item in value:
                if isinstance(item, str):
                    check_text(f.name, item)
        bounds = meta.get("range")
        if bounds is not None and value is not None:
            check_range(f.name, value, *bounds, unit=meta.get("unit", ""))


def check_url(url: str, *, name: str = "store URL") -> None:
    """``ConfigError`` if ``url`` holds a control character (CR, LF, tab, NUL, DEL, C1...)."""
    bad = next((ch for ch in url if unicodedata.category(ch) == "Cc"), None)
    if bad is not None:
        raise ConfigError(f"{name} {redact_url(url.encode('unicode_escape').decode('ascii'))!r} holds the control "
                          f"character {bad!r}; URLs take printable characters only (percent-encode the rest)")


def split_url(url: str, *, name: str = "store URL") -> SplitResult:
    """``urlsplit(url)`` after ``check_url``; ``ConfigError`` for what it cannot parse (``[::1``)."""
    check_url(url, name=name)
    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ConfigError(f"{name} {redact_url(url)!r} is not a valid URL: {exc}") from None
    return parts


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
        check_url(raw, name=name)  # before splitting: whitespace control characters would split it
        urls = split_urls(raw)
    elif isinstance(raw, (list, tuple)):
        urls = list(raw)
    else:
        raise ConfigError(f"{name}={raw!r} must be a URL string or a list of URL strings")
    for url in urls:
        if not isinstance(url, str) or "://" not in url:
            raise ConfigError(f"{name} entry {redact_url(url) if isinstance(url, str) else url!r} is not a URL "
                              "(scheme://...)")
        check_url(url, name=name)
    return tuple(urls)


def convert(cls: type, field: dataclasses.Field[Any], raw: Any) -> Any:
    """Convert one raw option value to the type declared by ``field`` of dataclass ``cls``."""
    kind = field.metadata.get("kind")
    name = field.name
    if kind == "urls":
        return parse_urls(raw, name=name)
    if isinstance(raw, str):
        check_text(name, raw)
    value = _convert(cls, field, raw)
    bounds = field.metadata.get("range")
    if bounds is not None and value is not None:
        check_range(name, value, *bounds, unit=field.metadata.get("unit", ""), given=raw)
    return value


def _convert(cls: type, field: dataclasses.Field[Any], raw: Any) -> Any:
    kind = field.metadata.get("kind")
    name = field.name
    if kind == "size":
        return parse_size(raw, name=name)
    if kind == "duration":
        return parse_duration(raw, name=name)
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
            value = _to_int(raw, name)
        elif hint is float:
            value = _to_float(raw, name)
        elif hint is str:
            value = str(raw)
        elif typing.get_origin(hint) is tuple:
            value = tuple(s for s in (raw.split(",") if isinstance(raw, str) else raw) if s != "")
        else:
            value = raw
    except (TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{name}={raw!r} is not a valid {getattr(hint, '__name__', hint)}") from exc
    if choices is not None and value not in choices:
        raise ConfigError(f"{name}={raw!r} is not accepted; use one of: {', '.join(map(str, choices))}")
    return value


def _to_int(raw: Any, name: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ConfigError(f"{name}={raw!r} is not an integer")
    if isinstance(raw, float):
        if not raw.is_integer():  # also NaN and infinity
            raise ConfigError(f"{name}={raw!r} is not a whole number")
        return int(raw)
    if isinstance(raw, str):
        if not _INTEGER.match(raw):
            raise ConfigError(f"{name}={raw!r} is not an integer (ASCII digits, e.g. {name}=3)")
        return int(raw)
    return raw


def _to_float(raw: Any, name: str) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ConfigError(f"{name}={raw!r} is not a number")
    if isinstance(raw, str) and not _FLOAT.match(raw):
        raise ConfigError(f"{name}={raw!r} is not a number (ASCII digits, e.g. {name}=0.5)")
    value = float(raw)
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number")
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
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"invalid options for {where}: {exc}") from exc


def query_options(url: str) -> dict[str, str]:
    """The query parameters of ``url`` as a flat dict; a repeated parameter, or a control
    character in the URL or in a decoded value (``%0D``), is an error."""
    query = split_url(url).query
    parsed = parse_qs(query, keep_blank_values=True, strict_parsing=False)
    out: dict[str, str] = {}
    for key, values in parsed.items():
        if len(values) != 1:
            raise ConfigError(f"parameter {key!r} is given {len(values)} times in {redact_url(url)!r}")
        check_url(key + "=" + values[0], name="URL parameter")
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
           factory: Any = dataclasses.MISSING, lo: float | None = None, hi: float | None = None,
           unit: str = "") -> Any:
    """A dataclass field with kvstore option metadata (``help`` feeds the config reference).

    ``internal`` fields are set by code (from a URL's host, say), never by a user option;
    ``factory`` makes a fresh default (a dict) per instance, like ``field(default_factory=)``.
    ``lo``/``hi``: the accepted range of a number (both given, or neither), in ``unit`` for
    messages and the reference (``"s"`` for durations, ``" bytes"`` for sizes).
    """
    if (lo is None) != (hi is None):
        raise TypeError("option(): give both lo and hi, or neither")
    if unit == "" and kind in ("size", "duration"):
        unit = " bytes" if kind == "size" else " s"
    meta = {"kind": kind, "secret": secret, "choices": choices, "help": help, "internal": internal,
            "range": None if lo is None else (lo, hi), "unit": unit}
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
