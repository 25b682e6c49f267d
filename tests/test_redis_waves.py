"""``Waves``: how far a batch's connections may request GET replies ahead, under one budget."""

from __future__ import annotations

import threading

import pytest

from kvstore.stores.redis.waves import Cancelled, Waves, requested_ahead

MiB = 1 << 20


def test_one_value_before_any_size_is_known_then_the_budget():
    waves = Waves(10, budget=64 * MiB)
    assert waves.frontier() == 1  # only value 0: its size sizes the waves
    waves.received(32 * MiB)
    assert waves.frontier() == 3  # 64 MiB of 32 MiB replies ahead of the one received
    waves.received(32 * MiB)
    assert waves.frontier() == 4
    waves.received(3 * MiB)  # the largest size seen stays the estimate
    assert waves.frontier() == 5


def test_small_values_are_all_requested_and_the_frontier_stops_at_the_end():
    waves = Waves(16, budget=64 * MiB, connections=16)
    waves.received(3 * MiB)
    assert waves.frontier() == 16
    assert Waves(5, budget=None).frontier() == 5  # no budget: every value at once


def test_a_miss_ends_the_first_wave():
    waves = Waves(3, budget=MiB)
    waves.received(0)
    assert waves.frontier() == 3


def _frontier(waves: Waves, j: int) -> object:
    try:
        return waves.frontier(waiting_for=j)
    except Cancelled:
        return "cancelled"


def test_a_connection_waits_until_its_value_may_be_requested_and_cancel_wakes_it():
    waves = Waves(8, budget=2 * MiB)
    got: list[object] = []
    waiting = threading.Thread(target=lambda: got.append(_frontier(waves, 1)))
    waiting.start()
    waiting.join(0.1)
    assert waiting.is_alive()  # value 0 in flight, its size unknown
    waves.received(MiB)
    waiting.join(2)
    assert got == [3]
    blocked = threading.Thread(target=lambda: got.append(_frontier(waves, 5)))
    blocked.start()
    blocked.join(0.1)
    assert blocked.is_alive()
    waves.cancel()
    blocked.join(2)
    assert got[-1] == "cancelled"
    with pytest.raises(Cancelled):
        waves.frontier()


def test_a_size_hint_sizes_the_first_wave():
    waves = Waves(10, budget=64 * MiB, size_hint=16 * MiB, connections=8)
    assert waves.frontier() == 4 and waves.size == 16 * MiB  # the budget, not the 8 connections
    waves.received(32 * MiB)
    assert waves.size == 32 * MiB and waves.frontier() == 3


def test_a_batch_starts_with_one_value_per_connection_and_ramps_up_to_the_budget():
    waves = Waves(40, budget=64 * MiB, size_hint=MiB, connections=4)
    assert waves.frontier() == 4
    waves.received(MiB)
    assert waves.frontier() == 1 + 5
    for _ in range(5):
        waves.received(MiB)
    assert waves.frontier() == 6 + 10
    for _ in range(30):
        waves.received(MiB)
    assert waves.frontier() == 40
    big = Waves(40, budget=64 * MiB, size_hint=32 * MiB, connections=4)
    assert big.frontier() == 2  # the budget caps the first wave too


def test_the_budget_keeps_two_values_ahead_and_one_per_connection_up_to_the_limit():
    """``requested_ahead``: as many values as fit the (cache-sized) budget, at least two and at
    least one per connection, never more than the limit holds, never fewer than one."""
    budget, limit = 8 * MiB, 64 * MiB
    assert requested_ahead(3 * MiB, budget, limit) == 2  # the budget holds two
    assert requested_ahead(256 << 10, budget, limit) == 32
    assert requested_ahead(32 * MiB, budget, limit) == 2  # two at least: 64 MiB, the limit
    assert requested_ahead(3 * MiB, budget, limit, connections=4) == 4  # one per connection
    assert requested_ahead(32 * MiB, budget, limit, connections=4) == 2  # the limit wins
    assert requested_ahead(64 * MiB, budget, limit) == 1
    assert requested_ahead(100 * MiB, budget, limit) == 1  # one at least, whatever the limit
    waves = Waves(40, budget=budget, size_hint=3 * MiB, connections=1, limit=limit)
    assert waves.frontier() == 1  # the ramp still starts at one value per connection
    waves.received(3 * MiB)
    assert waves.frontier() == 1 + 2


def test_one_servers_waves_count_its_own_values_and_answer_in_batch_indices():
    """A batch over two servers: each keeps its own values requested ahead, however the batch
    orders them (one frontier over the batch left a server idle while the values next in line
    were the other's)."""
    mine = [0, 1, 2, 3, 7, 9]  # this server's values of a batch of 10 (the other holds 4, 5, 6, 8)
    waves = Waves(10, budget=8 * MiB, size_hint=32 * MiB, connections=1, limit=64 * MiB, indices=mine)
    assert waves.frontier() == 1  # value 0 only: a ramp of one per connection
    waves.received(32 * MiB)
    assert waves.frontier() == 3  # values 1 and 2: two ahead, whatever the other server does
    waves.received(32 * MiB)
    waves.received(32 * MiB)
    assert waves.frontier() == 9  # values 3 and 7: the other server's 4 to 6 wait for nobody here
    waves.received(32 * MiB)
    assert waves.frontier(waiting_for=9) == 10  # the last: past every value it governs
    assert Waves(10, budget=None, indices=[4, 5]).frontier() == 6
