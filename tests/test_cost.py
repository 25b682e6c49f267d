"""Load or recompute (kvstore.cost): decisions from measured tier speeds and prefill speed."""

from __future__ import annotations

import logging
import re

import pytest

from kvstore.cost import CostModel
from kvstore.errors import ConfigError
from kvstore.stores.speed import LinkSpeed

MIB = 1 << 20


def speed(name: str, latency: float, bandwidth: float) -> LinkSpeed:
    s = LinkSpeed(name)
    s.round_trip(latency)
    s.read(64 * MIB, latency + 64 * MIB / bandwidth)
    return s


def test_unmeasured_sides_load_so_that_they_get_measured():
    model = CostModel()
    plan = model.plan([(LinkSpeed("redis"), 4)], [256] * 4, 32 * MIB)
    assert plan.chunks == 4 and plan.load_seconds is None
    model.observe_prefill(2048, 1.0)
    assert model.plan([(LinkSpeed("redis"), 4)], [256] * 4, 32 * MIB).chunks == 4  # the tier is still unmeasured


def test_with_the_prefill_unmeasured_a_slow_link_recomputes_once_to_measure_it():
    """Every request so far was a hit (no prefill seen): a fast load goes ahead, a slow one is
    recomputed, which measures the prefill for the next decisions."""
    model = CostModel()
    assert model.plan([(speed("redis", 0.001, 2e9), 4)], [256] * 4, 32 * MIB).chunks == 4  # ~0.07 s
    slow = speed("redis-throttled", 0.005, 250e3)
    assert model.plan([(slow, 4)], [256] * 4, 32 * MIB).chunks == 0  # ~540 s: recompute, and so measure
    model.observe_prefill(100, 10.0)  # 10 tokens/s: ~100 s to recompute 1,024 tokens
    assert model.plan([(slow, 4)], [256] * 4, 32 * MIB).chunks == 0
    assert model.plan([(slow, 4)], [256] * 4, MIB).chunks == 4  # 4 MiB: ~17 s to load


def test_a_fast_tier_loads_a_slow_one_recomputes():
    model = CostModel()
    model.observe_prefill(2000, 1.0)  # 2,000 tokens/s: a 1,024-token prefix takes ~0.5 s to recompute
    fast = speed("redis", 0.001, 2e9)  # 128 MiB in ~0.07 s
    slow = speed("redis-throttled", 0.005, 50e6)  # 128 MiB in ~2.7 s
    assert model.plan([(fast, 4)], [256] * 4, 32 * MIB).chunks == 4
    plan = model.plan([(slow, 4)], [256] * 4, 32 * MIB)
    assert plan.chunks == 0 and plan.recompute_seconds == pytest.approx(0.512)


def test_per_tier_the_fast_part_of_a_hit_is_loaded_and_the_slow_part_recomputed():
    model = CostModel()
    model.observe_prefill(2000, 1.0)
    memory, s3 = speed("memory", 1e-5, 10e9), speed("s3", 0.03, 40e6)
    plan = model.plan([(memory, 2), (LinkSpeed("redis"), 0), (s3, 8)], [256] * 8, 32 * MIB)
    assert plan.chunks == 2 and plan.tier == "memory"


def test_forced_policies_and_bad_options():
    slow = speed("slow", 1.0, 1e6)
    model = CostModel("always")
    model.observe_prefill(10_000, 0.1)
    assert model.plan([(slow, 3)], [256] * 3, MIB).chunks == 3
    assert CostModel("never").plan([(speed("fast", 0, 1e12), 3)], [256] * 3, MIB).chunks == 0
    with pytest.raises(ConfigError, match="sometimes"):
        CostModel("sometimes")
    with pytest.raises(ConfigError, match="margin"):
        CostModel(margin=0)
    with pytest.raises(ConfigError, match="explore_above"):
        CostModel(explore_above=-1)


def test_reads_measured_in_another_process_take_the_place_of_the_local_bandwidth():
    """vLLM: the scheduler decides, the workers read. The scheduler's tier knows only the latency of
    its own lookups; the workers' reads (sums) give the bandwidth, each read less one round trip."""
    model = CostModel()
    model.observe_prefill(2000, 1.0)
    local = LinkSpeed("redis")
    local.round_trip(0.01)
    assert model.plan([(local, 4)], [256] * 4, 32 * MIB).load_seconds is None  # no read seen yet: load
    model.observe_reads(local, 4 * 32 * MIB, 4 * 0.01 + 4 * 32 * MIB / 50e6, 4)  # four 50 MB/s reads
    assert model.bandwidth(local) == pytest.approx(50e6)
    plan = model.plan([(local, 4)], [256] * 4, 32 * MIB)
    assert plan.chunks == 0 and model.load_seconds(local, 128 * MIB) == pytest.approx(0.01 + 128 * MIB / 50e6)
    model.observe_reads(local, 0, 1.0, 1)  # nothing moved: no information
    assert model.bandwidth(local) == pytest.approx(50e6)


def test_a_tier_only_recomputed_is_probed_with_one_chunk_now_and_then():
    """Recomputing never measures a tier again: after ``reprobe_after`` seconds one chunk is
    loaded, and a link that got fast again is loaded from once more."""
    now = [0.0]
    model = CostModel(reprobe_after=300, clock=lambda: now[0])
    model.observe_prefill(2000, 1.0)
    link = LinkSpeed("redis")
    assert model.plan([(link, 4)], [256] * 4, 32 * MIB).chunks == 4  # unmeasured: load
    link.read(32 * MIB, 32 * MIB / 5e6)  # that load: 5 MB/s, ~27 s for 4 chunks against 0.5 s
    now[0] = 100
    assert model.plan([(link, 4)], [256] * 4, 32 * MIB).chunks == 0
    now[0] = 301
    assert model.plan([(link, 4)], [256] * 4, 32 * MIB).chunks == 1  # the probe
    assert model.plan([(link, 4)], [256] * 4, 32 * MIB).chunks == 0  # once
    for _ in range(30):
        link.read(32 * MIB, 32 * MIB / 5e9)  # the link is fast again
    assert model.plan([(link, 4)], [256] * 4, 32 * MIB).chunks == 4


def test_the_decision_log_shows_both_estimates_whichever_is_chosen(caplog):
    """A change of mind is logged with the load estimate and the recompute estimate, including
    the one it rejected (a recompute names what loading the hit would have cost)."""
    model = CostModel()
    model.observe_prefill(2000, 1.0)  # 1,024 tokens: ~0.512 s to recompute
    slow, fast = speed("redis", 0.005, 50e6), speed("memory", 1e-5, 10e9)
    with caplog.at_level(logging.INFO, logger="kvstore.cost"):
        rejected = model.plan([(slow, 4)], [256] * 4, 32 * MIB)
        chosen = model.plan([(fast, 4)], [256] * 4, 32 * MIB)
    assert not rejected.loads and chosen.loads
    recompute_line, load_line = (r.getMessage() for r in caplog.records if r.name == "kvstore.cost")
    expected_load = model.load_seconds(slow, 4 * 32 * MIB)
    assert expected_load is not None and expected_load > 2
    assert re.fullmatch(r"kvstore: recompute hits from tier redis \(load (\S+) s vs recompute 0\.5120 s\)",
                        recompute_line)
    assert f"load {expected_load:.4f} s" in recompute_line  # the estimate it rejected, not the 0 s of loading nothing
    assert f"load {chosen.load_seconds:.4f} s vs recompute 0.5120 s" in load_line
    assert load_line.startswith("kvstore: load hits from tier memory")
