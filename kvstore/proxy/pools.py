"""Pools of OpenAI servers for the P/D proxy: which server takes the next request.

A ``Pool`` holds ``Backend``s (a base URL, its requests in flight, whether it is healthy) and picks
one per request by its policy: ``round_robin`` (in turn) or ``least_outstanding`` (fewest requests
in flight; ties in turn). Only healthy backends are picked. A backend becomes unhealthy when a
request to it fails to connect or its health check (``GET /health``) fails, and healthy again when
a health check passes; with every backend unhealthy, ``pick`` answers None (the proxy then sends
the request elsewhere, or answers 503). Pure bookkeeping: no I/O, safe from one event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from kvstore.errors import ConfigError

__all__ = ["Backend", "Pool", "ProxyConfig", "POLICIES", "check_url"]

POLICIES = ("round_robin", "least_outstanding")


def check_url(url: str) -> str:
    """``url`` without a trailing slash, if it is an http(s) base URL with a host; else ``ConfigError``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise ConfigError(f"server URL {url!r} is not an http(s) base URL such as http://10.0.0.5:8000")
    try:
        parts.port  # noqa: B018 - raises for a malformed port
    except ValueError as exc:
        raise ConfigError(f"server URL {url!r}: {exc}") from None
    return url.rstrip("/")


@dataclass(frozen=True)
class ProxyConfig:
    """What ``kvstore proxy`` is told (``kvstore.cli.proxy`` builds it from its flags)."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    policy: str = "least_outstanding"
    #: Seconds between health checks of each server, and how long one may take.
    health_interval: float = 2.0
    health_timeout: float = 2.0
    #: Seconds a prefill request may take (then the decode server prefills the prompt itself).
    prefill_timeout: float = 300.0
    #: Seconds to connect to a server.
    connect_timeout: float = 5.0
    #: Forward vLLM's ``remote_prefill_cached_tokens`` to the decode server, so the response's
    #: ``cached_tokens`` counts the prefill server's prefix-cache hits (vLLM's own P/D reporting);
    #: by default it counts what the decode server did not compute (what it loaded from the store).
    report_prefill_cache_hits: bool = False

    def __post_init__(self) -> None:
        if not self.decode:
            raise ConfigError("the proxy needs at least one decode server (--decode URL)")
        object.__setattr__(self, "prefill", tuple(check_url(u) for u in self.prefill))
        object.__setattr__(self, "decode", tuple(check_url(u) for u in self.decode))
        if self.policy not in POLICIES:
            raise ConfigError(f"policy {self.policy!r} is not one of {', '.join(POLICIES)}")
        for name in ("health_interval", "health_timeout", "prefill_timeout", "connect_timeout"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ConfigError(f"{name}={value!r} must be a number of seconds in (0, 3600]")


@dataclass(eq=False)
class Backend:
    """One server: its base URL, requests in flight, health."""

    url: str
    outstanding: int = 0
    healthy: bool = True
    #: Why it was last marked unhealthy (for the log and ``/health`` of the proxy).
    reason: str = ""
    served: int = field(default=0)


class Pool:
    """Backends of one role (``prefill`` or ``decode``) and the policy that picks among them."""

    def __init__(self, role: str, urls: Sequence[str], policy: str) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"policy {policy!r} is not one of {', '.join(POLICIES)}")
        self.role = role
        self.policy = policy
        self.backends = [Backend(u) for u in urls]
        self._next = 0

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends if b.healthy]

    def pick(self, exclude: Sequence[Backend] = ()) -> Backend | None:
        """The backend for the next request (not one of ``exclude``), or None when none is healthy."""
        n = len(self.backends)
        order = [self.backends[(self._next + i) % n] for i in range(n)] if n else []
        candidates = [b for b in order if b.healthy and b not in exclude]
        if not candidates:
            return None
        if self.policy == "least_outstanding":
            chosen = min(candidates, key=lambda b: b.outstanding)  # the first of the least: in turn
        else:
            chosen = candidates[0]
        self._next = (self.backends.index(chosen) + 1) % n
        return chosen

    def mark(self, backend: Backend, healthy: bool, reason: str = "") -> bool:
        """Set ``backend``'s health; True if that changed it."""
        changed = backend.healthy != healthy
        backend.healthy = healthy
        backend.reason = "" if healthy else reason
        return changed
