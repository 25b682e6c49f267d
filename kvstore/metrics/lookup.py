"""The lookups the metrics server answers for routers: a registry of providers, and request checks.

The metrics server (``kvstore.metrics.server``) answers ``POST /v1/lookup`` ("how many leading
tokens of these token ids does the store hold, per tier") and ``GET /v1/namespaces``. It
knows neither keys nor stores: whoever runs in the process (an engine adapter's scheduler
side, a warm tool) registers a ``LookupProvider`` for the namespace it serves
(``kvstore.lookup_service.PrefixLookup`` is the one over prefix caches), and the server asks
it. Contracts:

* A provider is read-only: ``lookup`` only asks the store what it holds (bounded by the tiers'
  deadlines and breakers) and never raises for a storage outage (an outage is a miss).
* Providers are found by their namespace id (16 hex). Registering a second provider for an id
  already registered makes it the one that answers until it is unregistered; the earlier one
  answers again afterwards.
* ``parse_lookup`` turns a request body into a ``LookupRequest`` or raises ``BadLookup`` with a
  one-line reason and the HTTP status to answer (400).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["LookupProvider", "LookupRegistry", "LookupRequest", "LookupInput", "BadLookup", "LOOKUPS", "register_lookup",
           "parse_lookup", "MAX_LOOKUP_TOKENS", "MAX_SALT_CHARS", "max_body_bytes"]

#: Tokens one lookup may ask about (a prompt this long is beyond every served context).
MAX_LOOKUP_TOKENS = 1 << 20
#: Characters of a ``cache_salt`` (vLLM takes a tenant id or a random token: short strings).
MAX_SALT_CHARS = 1024
_TOKEN_LIMIT = 1 << 32  # token ids are hashed and stored as uint32
_NAMESPACE_RE = re.compile(r"^[0-9a-f]{16}$")
_FIELDS = ("tokens", "namespace", "model", "cache_salt", "inputs")
#: Multimodal inputs one lookup may name, and the characters of an input's identity or modality.
MAX_INPUTS, MAX_IDENTITY_CHARS = 1024, 1024
_INPUT_FIELDS = ("offset", "length", "identity", "modality")


def max_body_bytes(max_tokens: int) -> int:
    """The largest request body a server limited to ``max_tokens`` reads: every token at its
    longest (ten digits, a comma and a space) plus room for the other fields."""
    return max_tokens * 12 + 64 * 1024


class LookupProvider(Protocol):
    """Answers lookups for one namespace (see the module docstring)."""

    @property
    def namespace_id(self) -> str:
        """The id a request names (``Namespace.id``: 16 hex)."""

    def describe(self) -> dict[str, Any]:
        """A JSON-able description for ``GET /v1/namespaces`` (model, chunk size, tiers); no secrets."""

    def lookup(self, tokens: Sequence[int], cache_salt: str, inputs: Sequence[LookupInput] = ()) -> dict[str, Any]:
        """The JSON-able answer for ``tokens`` (with the multimodal ``inputs``) under
        ``cache_salt``; never raises for an outage."""


class BadLookup(ValueError):
    """A request the server rejects: ``status`` (400, 404 or 413) and a one-line reason."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class LookupInput:
    """A multimodal input of the prompt: vLLM's ``mm_position`` (offset, length) of its
    placeholder tokens, its ``identifier`` and modality (what the engine keys chunks by)."""

    offset: int
    length: int
    identity: str
    modality: str = ""


@dataclass(frozen=True)
class LookupRequest:
    tokens: list[int]
    namespace: str | None = None
    model: str | None = None
    cache_salt: str = ""
    inputs: tuple[LookupInput, ...] = ()


class LookupRegistry:
    """Providers by namespace id; thread-safe (engines register while the server answers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._providers: dict[str, list[LookupProvider]] = {}

    def register(self, provider: LookupProvider) -> Callable[[], None]:
        """Make ``provider`` answer for its namespace; returns the function that unregisters it."""
        ns = provider.namespace_id
        if not _NAMESPACE_RE.match(ns):
            raise ValueError(f"lookup provider namespace id {ns!r} is not 16 lowercase hex digits")
        with self._lock:
            self._providers.setdefault(ns, []).append(provider)

        def unregister() -> None:
            self.unregister(provider)

        return unregister

    def unregister(self, provider: LookupProvider) -> None:
        """Stop ``provider`` answering (a no-op if it is not registered)."""
        with self._lock:
            stack = self._providers.get(provider.namespace_id, [])
            for i in range(len(stack) - 1, -1, -1):
                if stack[i] is provider:
                    del stack[i]
                    break
            if not stack:
                self._providers.pop(provider.namespace_id, None)

    def providers(self) -> list[LookupProvider]:
        """The provider answering for each registered namespace, in registration order."""
        with self._lock:
            return [stack[-1] for stack in self._providers.values()]

    def find(self, request: LookupRequest) -> LookupProvider:
        """The provider a request names: by ``namespace``, else by ``model``, else the only one.
        ``BadLookup`` (404) when none or (400) several match."""
        providers = self.providers()
        if request.namespace is not None:
            match = [p for p in providers if p.namespace_id == request.namespace]
            what = f"namespace {request.namespace}"
        elif request.model is not None:
            match = [p for p in providers if p.describe().get("model") == request.model]
            what = f"model {request.model!r}"
        else:
            match, what = providers, "any namespace"
        if len(match) == 1:
            return match[0]
        known = ", ".join(p.namespace_id for p in providers) or "none"
        if not match:
            raise BadLookup(f"no lookup registered for {what} (registered: {known}; see GET /v1/namespaces)", 404)
        raise BadLookup(f"{len(match)} namespaces match {what}; name one with \"namespace\" "
                        f"(registered: {known})")


#: The process's registry: what the metrics server answers from.
LOOKUPS = LookupRegistry()


def register_lookup(provider: LookupProvider) -> Callable[[], None]:
    """``LOOKUPS.register(provider)``: the process's metrics server answers for it from now on."""
    return LOOKUPS.register(provider)


def parse_lookup(body: bytes, *, max_tokens: int = MAX_LOOKUP_TOKENS) -> LookupRequest:
    """The request in a ``POST /v1/lookup`` body, checked; ``BadLookup`` naming what is wrong."""
    try:
        doc = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadLookup(f"the body is not JSON: {exc}") from None
    except RecursionError:
        raise BadLookup("the body is not JSON a lookup reads (nested too deeply)") from None
    if not isinstance(doc, dict):
        raise BadLookup(f"the body must be a JSON object with \"tokens\", got {type(doc).__name__}")
    unknown = sorted(set(doc) - set(_FIELDS))
    if unknown:
        raise BadLookup(f"unknown field(s) {', '.join(map(repr, unknown))}; accepted: {', '.join(_FIELDS)}")
    tokens = doc.get("tokens")
    if not isinstance(tokens, list):
        raise BadLookup("\"tokens\" must be a list of token ids (integers in 0..4294967295)")
    if len(tokens) > max_tokens:
        raise BadLookup(f"{len(tokens)} tokens is more than a lookup takes ({max_tokens})")
    for i, t in enumerate(tokens):
        # bool is an int in Python; JSON's true is not a token id.
        if type(t) is not int or not 0 <= t < _TOKEN_LIMIT:
            raise BadLookup(f"tokens[{i}]={json.dumps(t)[:40]} is not a token id (an integer in 0..4294967295)")
    namespace = doc.get("namespace")
    if namespace is not None:
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace.lower()):
            raise BadLookup(f"\"namespace\"={json.dumps(namespace)[:60]} is not a namespace id "
                            "(16 hex digits, as GET /v1/namespaces lists them)")
        namespace = namespace.lower()
    model = doc.get("model")
    if model is not None and not isinstance(model, str):
        raise BadLookup("\"model\" must be a string (a model name as GET /v1/namespaces lists it)")
    salt = doc.get("cache_salt")
    if salt is None:
        salt = ""
    if not isinstance(salt, str) or len(salt) > MAX_SALT_CHARS:
        raise BadLookup(f"\"cache_salt\" must be a string of at most {MAX_SALT_CHARS} characters")
    return LookupRequest(tokens, namespace, model, salt, _inputs(doc.get("inputs")))


def _inputs(raw: Any) -> tuple[LookupInput, ...]:
    """The ``inputs`` field: ``[{"offset": int, "length": int, "identity": str, "modality": str}]``."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_INPUTS:
        raise BadLookup(f"\"inputs\" must be a list of at most {MAX_INPUTS} objects "
                        "{\"offset\", \"length\", \"identity\", \"modality\"}")
    out = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) - set(_INPUT_FIELDS):
            raise BadLookup(f"inputs[{i}] must be an object with {', '.join(_INPUT_FIELDS)} (modality optional)")
        offset, length, identity, modality = (item.get(f) for f in _INPUT_FIELDS)
        if type(offset) is not int or not 0 <= offset < _TOKEN_LIMIT or type(length) is not int \
                or not 0 < length < _TOKEN_LIMIT:
            raise BadLookup(f"inputs[{i}] needs an integer \"offset\" >= 0 and \"length\" > 0 (its placeholder tokens)")
        if not isinstance(identity, str) or not 0 < len(identity) <= MAX_IDENTITY_CHARS:
            raise BadLookup(f"inputs[{i}].identity must be a non-empty string of at most {MAX_IDENTITY_CHARS} "
                            "characters (vLLM's multimodal identifier)")
        if modality is not None and (not isinstance(modality, str) or len(modality) > MAX_IDENTITY_CHARS):
            raise BadLookup(f"inputs[{i}].modality must be a string (\"image\", \"audio\", ...)")
        out.append(LookupInput(offset, length, identity, modality or ""))
    return tuple(out)
