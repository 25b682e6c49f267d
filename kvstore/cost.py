"""Load or recompute: whether loading a stored prefix beats computing it again, per request.

A hit is not always worth loading: a prefix that comes over a slow link (an S3 bucket across
regions, a throttled Redis) can take longer than the engine needs to prefill it. ``CostModel``
compares the two online:

* each tier's latency and read bandwidth, measured by the tiered store on every call
  (``LinkSpeed``). Where the loads run in another process than the decision (vLLM: the workers
  load, the scheduler decides), the adapter hands the workers' reads over (``observe_reads``);
  that bandwidth then takes the place of the local tier's, whose latency (measured by the
  lookups, which run where the decision is made) still counts;
* the engine's prefill speed in tokens per second, measured by the adapter on steps that
  computed a prefill (``observe_prefill``).

``plan(...)`` takes how many leading chunks each tier holds (fastest tier first) and picks how
many chunks to load so that load time plus the recompute of the rest is smallest, considering
only tier boundaries (a prefix in the memory tier can be worth loading when the rest, in S3, is
not). While a tier is unmeasured it loads (that is how a tier gets measured); while the prefill
is unmeasured (every request so far was a hit) it loads unless the load would take more than
``explore_above`` seconds, in which case it recomputes once to measure the prefill. A tier that
has only been recomputed for ``reprobe_after`` seconds gets one hit's first chunk loaded, which
measures it again (a link that got fast again is noticed). ``policy``
forces the answer: ``"always"`` loads every hit, ``"never"`` none. Every decision is counted in
``kvstore_load_decisions_total{tier,decision}``.

What the model learns from arrives as ``Measurements`` where the loads and prefills run in
another process (an adapter ships them: vLLM's in its stats, ``kvstore.connectors.vllm.stats``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.errors import ConfigError
from kvstore.metrics.catalog import LOAD_DECISIONS, PREFILL_RATE
from kvstore.stores.speed import LinkSpeed, transfer_rate

__all__ = ["CostModel", "LoadPlan", "Measurements", "POLICIES"]

log = logging.getLogger("kvstore.cost")

POLICIES = ("auto", "always", "never")
_ALPHA = 0.2


@dataclass
class Measurements:
    """What workers measured for the cost model since they last reported: sums, so the reports of
    several workers (TP ranks) add up to the same rates (``CostModel.observe_reads`` per tier,
    ``CostModel.observe_prefill``)."""

    #: tier -> (bytes, seconds, reads) of the loads' reads from it.
    reads: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    #: Prompt tokens computed by forwards that computed a prefill, and those forwards' seconds.
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0


@dataclass(frozen=True)
class LoadPlan:
    """How many leading chunks to load, and why."""

    chunks: int
    #: The tier the last loaded chunk comes from ("" when nothing is loaded).
    tier: str
    load_seconds: float | None
    recompute_seconds: float | None

    @property
    def loads(self) -> bool:
        return self.chunks > 0


class CostModel:
    """Online estimates and the decision; thread-safe. See the module docstring."""

    def __init__(self, policy: str = "auto", *, margin: float = 1.0, explore_above: float = 0.5,
                 reprobe_after: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"load policy {policy!r} is not accepted; use one of: {', '.join(POLICIES)}")
        if not 0 < margin <= 100:
            raise ConfigError(f"load margin={margin!r} must be in (0, 100]")
        if not 0 <= explore_above <= 3600:
            raise ConfigError(f"explore_above={explore_above!r} must be in [0, 3600] seconds")
        if not 1 <= reprobe_after <= 86400:
            raise ConfigError(f"reprobe_after={reprobe_after!r} must be in [1, 86400] seconds")
        self.policy = policy
        self.margin = margin
        self.explore_above = explore_above  # seconds: a load this slow is recomputed while prefill is unmeasured
        self.reprobe_after = reprobe_after  # seconds without a load from a tier before one chunk re-measures it
        self._clock = clock
        self._last_load: dict[str, float] = {}  # tier -> when a decision last loaded from it
        self._lock = threading.Lock()
        self.prefill_rate: float | None = None  # tokens per second
        self._bandwidth: dict[str, float] = {}  # tier -> bytes per second of reported reads
        self._last_choice: dict[str, bool] = {}

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            self.prefill_rate = rate if self.prefill_rate is None else (1 - _ALPHA) * self.prefill_rate + _ALPHA * rate
            PREFILL_RATE.set(self.prefill_rate)

    def observe_reads(self, speed: LinkSpeed, nbytes: int, seconds: float, reads: int) -> None:
        """``reads`` reads of ``speed.tier`` measured elsewhere moved ``nbytes`` in ``seconds`` (sums)."""
        if nbytes <= 0 or seconds <= 0 or reads <= 0:
            return
        rate = transfer_rate(nbytes, seconds, reads, speed.latency)
        with self._lock:
            before = self._bandwidth.get(speed.tier)
            self._bandwidth[speed.tier] = rate if before is None else (1 - _ALPHA) * before + _ALPHA * rate

    def bandwidth(self, speed: LinkSpeed) -> float | None:
        """Bytes per second a load from ``speed.tier`` moves: reported reads first, else the tier's own."""
        with self._lock:
            reported = self._bandwidth.get(speed.tier)
        return reported if reported is not None else speed.bandwidth

    def load_seconds(self, speed: LinkSpeed, nbytes: int) -> float | None:
        """Estimated time to load ``nbytes`` from ``speed.tier`` in one batch; None while unmeasured."""
        rate = self.bandwidth(speed)
        return None if rate is None else (speed.latency or 0.0) + nbytes / rate

    def inputs(self) -> dict[str, object]:
        """What the decisions are based on now (for logs, tests and benchmarks)."""
        with self._lock:
            return {"prefill_tokens_per_s": self.prefill_rate, "read_bytes_per_s": dict(self._bandwidth)}

    def recompute_seconds(self, tokens: int) -> float | None:
        with self._lock:
            return None if self.prefill_rate is None else tokens / self.prefill_rate

    def plan(self, per_tier: Sequence[tuple[LinkSpeed, int]], chunk_tokens: Sequence[int],
             chunk_bytes: int, *, extra_bytes: int = 0) -> LoadPlan:
        """The chunks to load of a hit: ``per_tier`` is ``(tier speed, leading chunks it holds)``
        fastest first; ``chunk_tokens[i]`` the tokens of chunk i; ``chunk_bytes`` one chunk's size;
        ``extra_bytes`` what any load adds once, from the tier of its last chunk (e.g. the
        recurrent state at the hit's end, a sliding window)."""
        total = max((n for _, n in per_tier), default=0)
        if total == 0:
            return LoadPlan(0, "", None, None)
        # Boundaries: chunk i comes from the first tier that holds it.
        segments: list[tuple[LinkSpeed, int, int]] = []  # (tier, first chunk, end chunk)
        covered = 0
        for speed, n in per_tier:
            if n > covered:
                segments.append((speed, covered, n))
                covered = n
        hit_tokens = sum(chunk_tokens[:total])
        sizes = (chunk_bytes, extra_bytes)
        full = self._plan_for(total, segments, sizes, hit_tokens, "")
        if self.policy != "auto":
            return self._count(full if self.policy == "always" else self._plan_for(0, segments, sizes,
                                                                                   hit_tokens, full.tier), full)
        first = segments[0][0].tier  # a load's first chunk comes from here
        now = self._clock()
        chosen = self._choose(full, segments, chunk_tokens, sizes, hit_tokens, total)
        with self._lock:
            last = self._last_load.get(first)
            probe = not chosen.loads and last is not None and now - last > self.reprobe_after
            if chosen.loads or probe:
                self._last_load[first] = now
        if probe:
            # Recomputing everything from a tier never measures it again: one chunk now and then
            # keeps its estimate current (a link that got fast again is seen), at a bounded cost.
            chosen = self._plan_for(1, segments, sizes, hit_tokens, full.tier)
        return self._count(chosen, full)

    def _choose(self, full: LoadPlan, segments: Sequence[tuple[LinkSpeed, int, int]], chunk_tokens: Sequence[int],
                sizes: tuple[int, int], hit_tokens: int, total: int) -> LoadPlan:
        """The ``auto`` decision: the cheapest tier boundary to load up to (see the module docstring)."""
        if full.load_seconds is None:
            return full  # the link is unmeasured: load, and so measure it
        if full.recompute_seconds is None:
            # The link is measured but no prefill was seen (every request so far was a hit): a load
            # that takes long is worth one recompute, which measures what recomputing costs.
            slow = full.load_seconds > self.explore_above
            return self._plan_for(0, segments, sizes, hit_tokens, full.tier) if slow else full
        best: LoadPlan | None = None
        best_cost = 0.0
        for end in [0] + [e for _, _, e in segments]:  # fewer chunks first
            candidate = self._plan_for(end, segments, sizes, hit_tokens, full.tier)
            cost = (candidate.load_seconds or 0.0) + (self.recompute_seconds(sum(chunk_tokens[end:total])) or 0.0)
            # Loading more must be ``margin`` times better: ties and noise favour computing.
            if best is None or cost * self.margin < best_cost:
                best, best_cost = candidate, cost
        assert best is not None
        return best

    def _plan_for(self, chunks: int, segments: Sequence[tuple[LinkSpeed, int, int]], sizes: tuple[int, int],
                  hit_tokens: int, hit_tier: str) -> LoadPlan:
        """Loading the first ``chunks`` chunks (``sizes``: a chunk's bytes, and the bytes any load
        adds from the tier of its last chunk): its time, and the recompute time of the whole hit."""
        chunk_bytes, extra_bytes = sizes
        load: float | None = 0.0
        tier = hit_tier
        for speed, start, end in segments:
            n = min(end, chunks) - start
            if n <= 0:
                break
            last = chunks <= end  # the load's last chunk comes from here, and its extra bytes
            seconds = self.load_seconds(speed, n * chunk_bytes + (extra_bytes if last else 0))
            load = None if load is None or seconds is None else load + seconds
            tier = speed.tier
        if not hit_tier:  # the whole hit: name the tier its last chunk comes from
            tier = segments[-1][0].tier
        return LoadPlan(chunks, tier, load, self.recompute_seconds(hit_tokens))

    def _count(self, plan: LoadPlan, full: LoadPlan) -> LoadPlan:
        """Count ``plan`` (chosen for a hit whose whole load is ``full``); log a change of mind
        with both estimates: the load (of what is loaded, or of the whole hit when none of it
        is) against the recompute of the whole hit."""
        decision = "load" if plan.loads else "recompute"
        tier = plan.tier or "none"
        LOAD_DECISIONS.inc(tier=tier, decision=decision)
        with self._lock:
            changed = self._last_choice.get(tier) != plan.loads
            self._last_choice[tier] = plan.loads
        if changed:
            load = plan.load_seconds if plan.loads else full.load_seconds
            log.info("kvstore: %s hits from tier %s (load %s s vs recompute %s s)", decision, tier,
                     _fmt(load), _fmt(plan.recompute_seconds))
        return plan


def _fmt(value: float | None) -> str:
    return "?" if value is None else f"{value:.4f}"
