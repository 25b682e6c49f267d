"""``warm()``: run a stream of prompts through an engine so their KV lands in the store."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from kvstore.errors import ConfigError, KVStoreError
from kvstore.keys import ChunkKey
from kvstore.metrics.catalog import WARM_PROMPTS
from kvstore.warm.engine import WarmEngine
from kvstore.warm.prompts import BadLine, Prompt

__all__ = ["WarmSummary", "warm"]

log = logging.getLogger("kvstore.warm")

_MAX_REPORTED = 50  # failures and bad lines kept in the summary (all are logged)


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


@dataclass
class _Pending:
    """A prompt about to run: its keys and how many leading keys were stored before."""

    prompt: Prompt
    keys: list[ChunkKey] | None
    before: int


class _Run:
    """One ``warm()`` call: the summary and the bookkeeping its prompts share (thread-safe)."""

    def __init__(self, engine: WarmEngine, bar: _Progress, max_consecutive_failures: int,
                 on_problem: Callable[[int, str, str], None] | None) -> None:
        self.engine = engine
        self.store = engine.store
        self.summary = WarmSummary()
        self.bar = bar
        self.max_failures = max_consecutive_failures
        self.on_problem = on_problem
        self.lock = threading.Lock()
        self.consecutive = 0
        self.bytes_before = engine.bytes_written()
        self.measured_bytes = 0

    def report(self, line: int, kind: str, reason: str) -> None:
        self.summary.problem(line, kind, reason)
        if self.on_problem is not None:
            self.on_problem(line, kind, reason)
        else:
            log.warning("line %d: %s: %s", line, kind, reason)

    def check(self, prompt: Prompt) -> _Pending | None:
        """The prompt to run, or ``None`` when every chunk the engine would save is stored."""
        keys = self.engine.keys(prompt.tokens) if self.store is not None else None
        before = 0
        if keys and self.store is not None:
            try:
                before = self.store.longest_prefix([k.key for k in keys])
            except KVStoreError as exc:
                log.debug("resume check failed, running the prompt: %s", exc)
        if keys and before == len(keys):
            return None
        return _Pending(prompt, keys, before)

    def measure(self, pending: _Pending) -> int:
        """Bytes now stored for the chunks that were missing (engines that cannot count)."""
        if not pending.keys or self.bytes_before is not None or self.store is None:
            return 0
        try:
            return sum(s for s in self.store.size_many([k.key for k in pending.keys[pending.before:]]) if s)
        except KVStoreError:
            return 0

    def run_one(self, prompt: Prompt) -> tuple[str, int]:
        """(``"warmed"`` | ``"skipped"``, bytes measured); raises when the engine fails."""
        pending = self.check(prompt)
        if pending is None:
            return "skipped", 0
        self.engine.prefill(prompt.tokens)
        return "warmed", self.measure(pending)

    def finish(self, prompt: Prompt, outcome: tuple[str, int] | None, error: BaseException | None) -> None:
        s = self.summary
        with self.lock:
            if error is not None:
                s.failed += 1
                self.consecutive += 1
                WARM_PROMPTS.inc(result="failed")
                plain = isinstance(error, (KVStoreError, RuntimeError))
                self.report(prompt.line, "failed", str(error) if plain else f"{type(error).__name__}: {error}")
                if isinstance(error, ConfigError) and s.aborted is None:
                    # The engine does not fit the prompts (another model's token ids): every
                    # line after this one would fail the same way.
                    s.aborted = f"line {prompt.line} does not fit the engine (above); the rest were not tried"
                if self.consecutive >= self.max_failures and s.aborted is None:
                    s.aborted = f"{self.consecutive} prompts failed in a row; the engine looks down"
            else:
                assert outcome is not None
                self.consecutive = 0
                result, nbytes = outcome
                WARM_PROMPTS.inc(result=result)
                if result == "skipped":
                    s.skipped += 1
                    s.skipped_tokens += len(prompt.tokens)
                else:
                    s.warmed += 1
                    s.tokens += len(prompt.tokens)
                    self.measured_bytes += nbytes
            self.bar.update(s)

    def prompts(self, items: Iterable[Prompt | BadLine]) -> Iterator[Prompt]:
        """The prompts of ``items``; bad lines are counted and reported on the way."""
        for item in items:
            if self.summary.aborted:
                return
            if isinstance(item, BadLine):
                with self.lock:
                    self.summary.invalid += 1
                    WARM_PROMPTS.inc(result="invalid")
                    self.report(item.line, "invalid", item.reason)
                continue
            with self.lock:
                self.summary.prompts += 1
            yield item

    # -- the three ways of running: batches, one by one, a pool of threads ----------------------
    def batched(self, prompts: Iterator[Prompt]) -> None:
        batch: list[_Pending] = []

        def flush() -> None:
            errors = self.engine.prefill_batch([p.prompt.tokens for p in batch])
            for p, error in zip(batch, errors):
                self.finish(p.prompt, None if error else ("warmed", self.measure(p)), error)
            batch.clear()

        for prompt in prompts:
            pending = self.check(prompt)
            if pending is None:
                self.finish(prompt, ("skipped", 0), None)
                continue
            batch.append(pending)
            if len(batch) >= self.engine.batch_size:
                flush()
        if batch:
            flush()

    def serial(self, prompts: Iterator[Prompt]) -> None:
        for prompt in prompts:
            try:
                outcome = self.run_one(prompt)
            except Exception as exc:  # noqa: BLE001 - one prompt's failure is counted, not fatal
                self.finish(prompt, None, exc)
            else:
                self.finish(prompt, outcome, None)

    def threaded(self, prompts: Iterator[Prompt]) -> None:
        n = self.engine.concurrency
        with ThreadPoolExecutor(n, thread_name_prefix="kvstore-warm") as pool:
            pending: set[Future[tuple[str, int]]] = set()
            for prompt in prompts:
                while len(pending) >= 2 * n:  # bounded memory: at most 2 x concurrency in flight
                    _, pending = wait(pending, return_when=FIRST_COMPLETED)
                fut = pool.submit(self.run_one, prompt)

                def done(f: Future[tuple[str, int]], p: Prompt = prompt) -> None:
                    self.finish(p, None if f.exception() else f.result(), f.exception())

                fut.add_done_callback(done)
                pending.add(fut)
            wait(pending)


def warm(items: Iterable[Prompt | BadLine], engine: WarmEngine, *, progress: str = "none",
         total: int | None = None, max_consecutive_failures: int = 20,
         on_problem: Callable[[int, str, str], None] | None = None) -> WarmSummary:
    """Run every prompt of ``items`` through ``engine``; see the package docstring.

    ``progress`` is ``"bar"`` (tqdm if installed), ``"lines"`` (a log line every 2 s) or
    ``"none"``; ``total`` is the expected number of lines for the bar. ``on_problem(line, kind,
    reason)`` is called for each bad line (``invalid``) and failed prompt (``failed``).
    """
    start = time.perf_counter()
    bar = _Progress(progress, total)
    run = _Run(engine, bar, max_consecutive_failures, on_problem)
    try:
        prompts = run.prompts(items)
        if engine.batch_size > 1:
            run.batched(prompts)
        elif engine.concurrency <= 1:
            run.serial(prompts)
        else:
            run.threaded(prompts)
        engine.flush()
    finally:
        bar.close()
    summary = run.summary
    after = engine.bytes_written()
    if run.bytes_before is not None and after is not None:
        summary.bytes_written = after - run.bytes_before
    elif run.measured_bytes or (summary.warmed == 0 and run.store is not None):
        summary.bytes_written = run.measured_bytes
    summary.elapsed = time.perf_counter() - start
    return summary
