"""Offline cache warming: run prompts through an engine so their KV lands in the store.

``warm(prompts, engine)`` streams prompts (never holding the whole file), asks the engine to
prefill each one (the engine's kvstore connector saves the KV as it would in serving), and
returns a ``WarmSummary``. Its promises:

* **Resumable.** Before running a prompt it asks the store whether every chunk the engine would
  save is already there, with the engine's own namespace and keys (one ``longest_prefix`` call);
  a fully stored prompt is skipped. Engines that cannot name their keys (a remote server whose
  namespace is unknown here) run every prompt; the server's connector then loads instead of
  recomputing, so a rerun is still cheap.
* **Bounded memory.** The prompt file is read line by line and at most ``2 x concurrency``
  prompts are in flight.
* **Nothing silent.** A line that is not a prompt is reported with its line number and counted
  (``invalid``); a prompt the engine fails on is reported and counted (``failed``). Neither stops
  the run, unless ``max_consecutive_failures`` prompts fail in a row (the engine is down).

Engines: ``ReferenceWarmEngine`` (the in-package reference engine through the agent connector),
``ServerWarmEngine`` (a running vLLM OpenAI-compatible server with the kvstore connector), and
``VLLMWarmEngine`` (vLLM in-process with the kvstore connector). ``kvstore.cli.warm`` builds
them from command-line options.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from kvstore import metrics
from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkKey
from kvstore.stores.base import Buffer, Store

log = logging.getLogger(__name__)

#: Largest token id accepted in a prompt file (token ids are stored as uint32).
_MAX_TOKEN_ID = (1 << 32) - 1
_MAX_REPORTED = 50  # failures and bad lines kept in the summary (all are logged)


class EngineUnavailableError(KVStoreError, ConnectionError):
    """The engine (a server, a model directory) could not be reached or started."""


# -- prompts ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    """One prompt of the input file: its 1-based line number and token ids."""

    line: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class BadLine:
    """A line that is not a prompt, and why."""

    line: int
    reason: str


class Tokenizer:
    """A local Hugging Face tokenizer (``transformers``), loaded without network access."""

    def __init__(self, path: str, *, add_special_tokens: bool = True) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ConfigError("text prompts need the transformers package (pip install transformers) "
                              "or prompts given as prompt_token_ids") from exc
        try:
            self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--tokenizer {path!r} is not a local tokenizer directory: {exc}") from exc
        self.add_special_tokens = add_special_tokens

    def encode(self, text: str) -> list[int]:
        return list(self._tok(text, add_special_tokens=self.add_special_tokens)["input_ids"])


def parse_line(text: str, line: int, tokenizer: Tokenizer | None) -> Prompt | BadLine | None:
    """One JSONL line as a prompt; ``None`` for a blank line."""
    if not text.strip():
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return BadLine(line, f"not JSON ({exc})")
    if not isinstance(doc, dict):
        return BadLine(line, "not a JSON object")
    if "prompt_token_ids" in doc:
        ids = doc["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(type(t) is int and 0 <= t <= _MAX_TOKEN_ID for t in ids)):
            return BadLine(line, "prompt_token_ids must be a non-empty list of non-negative integer token ids")
        return Prompt(line, tuple(ids))
    if "text" in doc:
        if not isinstance(doc["text"], str) or not doc["text"]:
            return BadLine(line, "text must be a non-empty string")
        if tokenizer is None:
            return BadLine(line, "a text prompt needs --tokenizer PATH (or give prompt_token_ids)")
        try:
            ids = tokenizer.encode(doc["text"])
        except Exception as exc:  # noqa: BLE001 - a tokenizer's failure on one line is that line's problem
            return BadLine(line, f"tokenizer failed: {exc}")
        if not ids:
            return BadLine(line, "text tokenizes to no tokens")
        return Prompt(line, tuple(ids))
    return BadLine(line, 'expected {"prompt_token_ids": [...]} or {"text": "..."}')


def iter_prompts(lines: Iterable[str], *, tokenizer: Tokenizer | None = None) -> Iterator[Prompt | BadLine]:
    """Prompts and bad lines of a JSONL stream, in order, one line at a time."""
    for number, text in enumerate(lines, start=1):
        item = parse_line(text, number, tokenizer)
        if item is not None:
            yield item


# -- engines --------------------------------------------------------------------------------------
class WarmEngine(ABC):
    """What ``warm`` needs from an engine.

    ``prefill`` runs one prompt so that the engine's connector saves its KV, raising on failure.
    ``keys`` names the chunks the engine saves for a prompt (``None`` when unknown) and
    ``store`` is where they land; together they make runs resumable.
    """

    name: str = "engine"
    #: Prompts that may run at the same time (threads calling ``prefill``).
    concurrency: int = 1
    #: Prompts handed to ``prefill_batch`` at once (engines that batch internally, like vLLM).
    batch_size: int = 1

    @property
    def store(self) -> Store | None:
        return None

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey] | None:
        return None

    @abstractmethod
    def prefill(self, tokens: Sequence[int]) -> None:
        """Compute (or load) the KV of ``tokens`` and let the connector save it."""

    def prefill_batch(self, batch: Sequence[Sequence[int]]) -> list[BaseException | None]:
        """Prefill several prompts; the error of each (``None`` on success). Default: one by one."""
        errors: list[BaseException | None] = []
        for tokens in batch:
            try:
                self.prefill(tokens)
                errors.append(None)
            except Exception as exc:  # noqa: BLE001 - reported per prompt
                errors.append(exc)
        return errors

    def bytes_written(self) -> int | None:
        """Record bytes this engine has written so far, when it can tell."""
        return None

    def flush(self) -> None:
        """Wait for writes still on their way to shared tiers."""
        store = self.store
        if store is not None and hasattr(store, "flush"):
            store.flush()

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name}

    def close(self) -> None:
        pass


class CountingStore(Store):
    """Delegates to ``inner`` and counts the bytes put through it (for the warm summary)."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.is_local = inner.is_local  # type: ignore[misc]
        self._lock = threading.Lock()
        self.bytes_put = 0

    def _count(self, value: Buffer) -> None:
        n = memoryview(value).nbytes
        with self._lock:
            self.bytes_put += n

    def get(self, key: str):  # type: ignore[override]
        return self.inner.get(key)

    def put(self, key: str, value: Buffer) -> None:
        self.inner.put(key, value)
        self._count(value)

    def put_many(self, items: Iterable[tuple[str, Buffer]]) -> None:
        items = list(items)
        self.inner.put_many(items)
        for _, v in items:
            self._count(v)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def iter_keys(self, prefix: str = "") -> Iterator[str]:
        return self.inner.iter_keys(prefix)

    def exists(self, key: str) -> bool:
        return self.inner.exists(key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists_many(keys)

    def get_many(self, keys: Sequence[str]):  # type: ignore[override]
        return self.inner.get_many(keys)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self.inner.delete_many(keys)

    def longest_prefix(self, keys: Sequence[str]) -> int:
        return self.inner.longest_prefix(keys)

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        return self.inner.size_many(keys)

    def flush(self, *args: Any, **kwargs: Any) -> Any:
        flush = getattr(self.inner, "flush", None)
        return flush(*args, **kwargs) if flush is not None else True

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()


class ServerWarmEngine(WarmEngine):
    """A running vLLM OpenAI-compatible server whose kvstore connector saves the KV.

    Each prompt goes to ``/v1/completions`` as token ids with ``max_tokens=1``: the server
    prefills it (loading any stored prefix) and its connector saves the rest. Connection errors
    and 5xx answers are retried ``retries`` times; a 4xx answer (a prompt too long for the
    model, a wrong model name) fails that prompt at once with the server's message.
    """

    name = "server"

    def __init__(self, url: str, *, model: str | None = None, concurrency: int = 4, timeout: float = 600.0,
                 retries: int = 2, api_key: str | None = None, store: Store | None = None,
                 keys: Callable[[Sequence[int]], list[ChunkKey]] | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {url!r} must be an http:// or https:// URL of a vLLM OpenAI-compatible server")
        if concurrency < 1:
            raise ConfigError(f"--concurrency {concurrency} must be at least 1")
        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.api_key = api_key
        self._store = store
        self._keys = keys
        self.model = model or self._first_model()

    @property
    def store(self) -> Store | None:
        return self._store

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey] | None:
        return None if self._keys is None else self._keys(tokens)

    def _request(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method="GET" if body is None else "POST")
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout) as resp:
            return json.loads(resp.read() or b"{}")

    def _first_model(self) -> str:
        try:
            models = self._request("/v1/models").get("data") or []
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise EngineUnavailableError(f"server {self.base} did not list its models (GET /v1/models): "
                                         f"{_http_reason(exc)}") from exc
        if not models:
            raise EngineUnavailableError(f"server {self.base} serves no model; pass --served-model NAME")
        return str(models[0]["id"])

    def prefill(self, tokens: Sequence[int]) -> None:
        body = {"model": self.model, "prompt": list(tokens), "max_tokens": 1, "temperature": 0.0, "stream": False}
        attempt = 0
        while True:
            try:
                self._request("/v1/completions", body)
                return
            except urllib.error.HTTPError as exc:
                if exc.code < 500 or attempt >= self.retries:
                    raise RuntimeError(_http_reason(exc)) from exc
            except (urllib.error.URLError, OSError) as exc:
                if attempt >= self.retries:
                    raise EngineUnavailableError(f"{self.base}: {_http_reason(exc)}") from exc
            attempt += 1
            time.sleep(min(0.5 * 2 ** attempt, 10.0))

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "url": self.base, "model": self.model, "concurrency": self.concurrency}


class ReferenceWarmEngine(WarmEngine):
    """The in-package reference engine with the agent connector (``connectors.agent``), in-process.

    The model and namespace are those a serving reference engine with the same ``preset`` (or
    ``config``), ``chunk_tokens`` and store builds, so what this writes is what it looks up.
    """

    name = "reference"

    def __init__(self, store: str | Sequence[str], *, preset: str = "tiny", config: Any = None,
                 chunk_tokens: int | None = None, codec: str = "raw", store_options: dict | None = None) -> None:
        from connectors.agent import AgentConfig, KVStoreAgent
        from kvstore.engine import PRESETS, ModelRunner
        from kvstore.stores.tiered import TieredStore

        if config is None:
            if preset not in PRESETS:
                raise ConfigError(f"--preset {preset!r} is not known; accepted: {', '.join(PRESETS)}")
            config = PRESETS[preset]
        self.config = config
        urls = [store] if isinstance(store, str) else list(store)
        # Without an explicit chunk size, use the agent's own default: a serving replica built
        # with default settings must find what this writes.
        sizing = {"chunk_tokens": chunk_tokens} if chunk_tokens else {}
        agent_config = AgentConfig(store=tuple(urls), model=config.name, model_fingerprint=config.fingerprint,
                                   codec=codec, **sizing)
        self._store = CountingStore(TieredStore.from_urls(urls, **(store_options or {})))
        self.agent = KVStoreAgent(agent_config, store=self._store)
        self.runner = ModelRunner(config, agent=self.agent)
        self.transfer = self.agent.transfer(self.runner.model, self.runner.kv_caches)
        self._max_tokens = config.num_blocks * config.block_size - 1

    @property
    def store(self) -> Store:
        return self._store

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey]:
        return self.transfer.keys(list(tokens))

    def prefill(self, tokens: Sequence[int]) -> None:
        if len(tokens) > self._max_tokens:
            raise ValueError(f"prompt of {len(tokens)} tokens exceeds the engine's cache of {self._max_tokens} tokens")
        if max(tokens) >= self.config.vocab_size:
            raise ValueError(f"token id {max(tokens)} is outside the model's vocabulary of {self.config.vocab_size}")
        self.runner.generate([list(tokens)], max_new_tokens=1)

    def bytes_written(self) -> int:
        return self._store.bytes_put

    def flush(self) -> None:
        self.agent.flush()

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "model": self.config.name, "fingerprint": self.config.fingerprint,
                "namespace": self.transfer.cache.namespace.id, "store": self._store.describe()}

    def close(self) -> None:
        self.agent.close()


class VLLMWarmEngine(WarmEngine):
    """vLLM in-process with the kvstore connector (``connectors.vllm_v1``), prompts in batches.

    The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the warm
    run asks the connector itself for the keys it saves (its namespaces, one per TP rank, and
    its lookup limit) and checks them in the connector's own store. ``engine_args`` are extra
    ``vllm.LLM`` arguments; prompts are token ids, so the tokenizer is not loaded by default.
    """

    name = "vllm"

    def __init__(self, model: str, store: str | Sequence[str], *, chunk_tokens: int | None = None,
                 codec: str | None = None, kv_config: dict[str, Any] | None = None,
                 engine_args: dict[str, Any] | None = None, batch_size: int = 16) -> None:
        import os

        from connectors.vllm_config import parse_options

        if batch_size < 1:
            raise ConfigError(f"--batch-size {batch_size} must be at least 1")
        extra = dict(kv_config or {})
        if "store" in extra:
            raise ConfigError("give the store with --store, not in --kv-config")
        extra["store"] = [store] if isinstance(store, str) else list(store)
        if chunk_tokens is not None:
            extra["chunk_tokens"] = chunk_tokens
        if codec is not None:
            extra["codec"] = codec
        parse_options(extra)  # a bad option fails here, before the engine loads
        # vLLM logs to stdout by default; stdout carries the warm summary (--json).
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
        except ImportError as exc:
            raise ConfigError(f"--engine vllm needs vLLM installed ({exc})") from exc
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # keep the connector reachable from here
        kwargs: dict[str, Any] = {"model": model, "skip_tokenizer_init": True}
        kwargs.update(engine_args or {})
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_connector_module_path="connectors.vllm_v1",
            kv_role="kv_both", kv_connector_extra_config=extra)
        self.model = model
        self.batch_size = batch_size
        try:
            self.llm = LLM(**kwargs)
        except (KVStoreError, ImportError):
            raise
        except (OSError, ValueError, RuntimeError) as exc:
            raise EngineUnavailableError(f"vLLM could not start with model {model!r}: {exc}") from exc
        self.params = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
        self.connector = self._find_connector()
        self._store = getattr(self.connector, "store", None)
        if self.connector is None:
            log.warning("the kvstore connector is not reachable in this process: every prompt will run")

    def _find_connector(self) -> Any:
        try:
            core = self.llm.llm_engine.engine_core.engine_core
            return core.scheduler.get_kv_connector()
        except AttributeError:
            return None

    @property
    def store(self) -> Store | None:
        return self._store

    def keys(self, tokens: Sequence[int]) -> list[ChunkKey] | None:
        from connectors.vllm_v1 import lookup_limit

        caches = getattr(self.connector, "_caches", None)
        if not caches:
            return None
        limit = lookup_limit(len(tokens), self.connector.block_size)
        keys: list[ChunkKey] = []
        for cache in caches:  # every TP rank saves its own shard
            keys.extend(cache.keys(list(tokens[:limit])))
        return keys

    def prefill(self, tokens: Sequence[int]) -> None:
        self.llm.generate([{"prompt_token_ids": list(tokens)}], self.params, use_tqdm=False)

    def prefill_batch(self, batch: Sequence[Sequence[int]]) -> list[BaseException | None]:
        try:
            self.llm.generate([{"prompt_token_ids": list(t)} for t in batch], self.params, use_tqdm=False)
            return [None] * len(batch)
        except Exception as exc:  # noqa: BLE001 - vLLM rejects a whole batch for one bad prompt: find which
            return super().prefill_batch(batch) if len(batch) > 1 else [exc]

    def bytes_written(self) -> int | None:
        tiers = getattr(self._store, "tiers", None)
        if not tiers:
            return None
        return int(metrics.BYTES_WRITTEN.value(tier=tiers[0].name))

    def flush(self) -> None:
        if self._store is not None and hasattr(self._store, "flush"):
            self._store.flush()

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"engine": self.name, "model": self.model, "batch_size": self.batch_size}
        caches = getattr(self.connector, "_caches", None)
        if caches:
            d["namespace"] = caches[0].namespace.id
        return d

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # noqa: BLE001 - best effort; the connector flushes at exit too
                log.debug("vLLM shutdown failed", exc_info=True)


def _http_reason(exc: BaseException) -> str:
    """A short reason from an HTTP error: the server's own message when it sent one."""
    if isinstance(exc, urllib.error.HTTPError):
        detail = ""
        try:
            payload = json.loads(exc.read() or b"{}")
            err = payload.get("error", payload)
            detail = err.get("message") if isinstance(err, dict) else str(err)
        except Exception:  # noqa: BLE001 - the body is only a nicety
            pass
        return f"HTTP {exc.code}" + (f": {detail}" if detail else f" {exc.reason}")
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"


# -- the run --------------------------------------------------------------------------------------
@dataclass
class WarmSummary:
    """What a warm run did. ``bytes_written`` is ``None`` when the engine cannot tell."""

    prompts: int = 0
    warmed: int = 0
    skipped: int = 0
    failed: int = 0
    invalid: int = 0
    tokens: int = 0
    skipped_tokens: int = 0
    bytes_written: int | None = None
    elapsed: float = 0.0
    aborted: str | None = None
    problems: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.failed or self.invalid or self.aborted)

    def to_dict(self) -> dict[str, Any]:
        d = dict(vars(self))
        d["tokens_per_second"] = self.tokens / self.elapsed if self.elapsed > 0 else 0.0
        d["prompts_per_second"] = self.warmed / self.elapsed if self.elapsed > 0 else 0.0
        return d

    def problem(self, line: int, kind: str, reason: str) -> None:
        if len(self.problems) < _MAX_REPORTED:
            self.problems.append({"line": line, "kind": kind, "reason": reason})


class _Progress:
    """tqdm when installed and wanted, else a line every few seconds, else nothing."""

    def __init__(self, mode: str, total: int | None) -> None:
        self._bar = None
        self._mode = mode
        self._last = 0.0
        self._done = 0
        self._total = total
        if mode == "bar":
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, unit="prompt", dynamic_ncols=True)
            except ImportError:
                self._mode = "lines"

    def update(self, summary: WarmSummary) -> None:
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(tokens=summary.tokens, skipped=summary.skipped, failed=summary.failed, refresh=False)
        elif self._mode == "lines":
            now = time.monotonic()
            if now - self._last >= 2.0:
                self._last = now
                total = f"/{self._total}" if self._total else ""
                log.warning("warm: %d%s prompts (%d warmed, %d skipped, %d failed), %d tokens",
                            self._done, total, summary.warmed, summary.skipped, summary.failed, summary.tokens)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def warm(items: Iterable[Prompt | BadLine], engine: WarmEngine, *, progress: str = "none",
         total: int | None = None, max_consecutive_failures: int = 20,
         on_problem: Callable[[int, str, str], None] | None = None) -> WarmSummary:
    """Run every prompt of ``items`` through ``engine``; see the module docstring.

    ``progress`` is ``"bar"`` (tqdm if installed), ``"lines"`` (a log line every 2 s) or
    ``"none"``; ``total`` is the expected number of lines for the bar. ``on_problem(line, kind,
    reason)`` is called for each bad line (``invalid``) and failed prompt (``failed``).
    """
    summary = WarmSummary()
    bar = _Progress(progress, total)
    lock = threading.Lock()
    consecutive = 0
    bytes_before = engine.bytes_written()
    measured_bytes = 0
    store = engine.store
    start = time.perf_counter()

    def report(line: int, kind: str, reason: str) -> None:
        summary.problem(line, kind, reason)
        if on_problem is not None:
            on_problem(line, kind, reason)
        else:
            log.warning("line %d: %s: %s", line, kind, reason)

    def check(prompt: Prompt) -> tuple[bool, list[ChunkKey] | None, int]:
        """(already fully stored?, the engine's keys, how many leading keys are stored)."""
        keys = engine.keys(prompt.tokens) if store is not None else None
        before = 0
        if keys:
            try:
                before = store.longest_prefix([k.key for k in keys])  # type: ignore[union-attr]
            except KVStoreError as exc:
                log.debug("resume check failed, running the prompt: %s", exc)
        return bool(keys) and before == len(keys), keys, before  # type: ignore[arg-type]

    def measure(keys: list[ChunkKey] | None, before: int) -> int:
        """Bytes now stored for the chunks that were missing (engines that cannot count)."""
        if not keys or bytes_before is not None:
            return 0
        try:
            return sum(s for s in store.size_many([k.key for k in keys[before:]]) if s)  # type: ignore[union-attr]
        except KVStoreError:
            return 0

    def run_one(prompt: Prompt) -> tuple[str, int]:
        """("warmed" | "skipped", bytes measured); raises when the engine fails."""
        stored, keys, before = check(prompt)
        if stored:
            return "skipped", 0
        engine.prefill(prompt.tokens)
        return "warmed", measure(keys, before)

    def finish(prompt: Prompt, outcome: tuple[str, int] | None, error: BaseException | None) -> None:
        nonlocal consecutive, measured_bytes
        with lock:
            if error is not None:
                summary.failed += 1
                consecutive += 1
                metrics.WARM_PROMPTS.inc(result="failed")
                report(prompt.line, "failed", f"{type(error).__name__}: {error}" if not isinstance(
                    error, (KVStoreError, RuntimeError)) else str(error))
                if consecutive >= max_consecutive_failures and summary.aborted is None:
                    summary.aborted = f"{consecutive} prompts failed in a row; the engine looks down"
            else:
                assert outcome is not None
                consecutive = 0
                result, nbytes = outcome
                metrics.WARM_PROMPTS.inc(result=result)
                if result == "skipped":
                    summary.skipped += 1
                    summary.skipped_tokens += len(prompt.tokens)
                else:
                    summary.warmed += 1
                    summary.tokens += len(prompt.tokens)
                    measured_bytes += nbytes
            bar.update(summary)

    def prompts() -> Iterator[Prompt]:
        for item in items:
            if summary.aborted:
                return
            if isinstance(item, BadLine):
                with lock:
                    summary.invalid += 1
                    metrics.WARM_PROMPTS.inc(result="invalid")
                    report(item.line, "invalid", item.reason)
                continue
            with lock:
                summary.prompts += 1
            yield item

    try:
        if engine.batch_size > 1:
            batch: list[tuple[Prompt, list[ChunkKey] | None, int]] = []

            def run_batch() -> None:
                errors = engine.prefill_batch([p.tokens for p, _, _ in batch])
                for (p, keys, before), error in zip(batch, errors):
                    finish(p, None if error else ("warmed", measure(keys, before)), error)
                batch.clear()

            for prompt in prompts():
                stored, keys, before = check(prompt)
                if stored:
                    finish(prompt, ("skipped", 0), None)
                    continue
                batch.append((prompt, keys, before))
                if len(batch) >= engine.batch_size:
                    run_batch()
            if batch:
                run_batch()
        elif engine.concurrency <= 1:
            for prompt in prompts():
                try:
                    outcome = run_one(prompt)
                except Exception as exc:  # noqa: BLE001 - one prompt's failure is counted, not fatal
                    finish(prompt, None, exc)
                else:
                    finish(prompt, outcome, None)
        else:
            with ThreadPoolExecutor(engine.concurrency, thread_name_prefix="kvstore-warm") as pool:
                pending: set[Future] = set()
                for prompt in prompts():
                    while len(pending) >= 2 * engine.concurrency:
                        done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    fut = pool.submit(run_one, prompt)
                    fut.add_done_callback(lambda f, p=prompt: finish(p, None if f.exception() else f.result(),
                                                                     f.exception()))
                    pending.add(fut)
                wait(pending)
        engine.flush()
    finally:
        bar.close()
    after = engine.bytes_written()
    if bytes_before is not None and after is not None:
        summary.bytes_written = after - bytes_before
    elif measured_bytes or (summary.warmed == 0 and store is not None):
        summary.bytes_written = measured_bytes
    summary.elapsed = time.perf_counter() - start
    return summary
