"""Load or recompute (kvstore.cost): decisions from measured tier speeds and prefill speed."""

from __future__ import annotations

import pytest

from kvstore.cost import CostModel
from kvstore.errors import ConfigError
from kvstore.stores.tiered.speed import LinkSpeed

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
