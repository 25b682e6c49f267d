"""The spread (``kvstore.stores.redis.spread``): how many connections per server a write (or
read) batch uses, learned from the batches before it. The rule is driven here by modelled links;
``test_store_redis`` drives it through a real capped link."""

from __future__ import annotations

import itertools

import pytest

from kvstore.stores.redis.spread import MAX_GAP, MEASURED_BYTES, Spread

BATCH = 64 << 20


def run(spread: Spread, seconds_at, batches: int, nbytes: int = BATCH, values: int = 16) -> list[int]:
    """``batches`` batches of ``values`` values, ``nbytes`` in all, each taking
    ``seconds_at(width)``; their widths."""
    widths = []
    for _ in range(batches):
        w = spread.width()
        spread.measured(w, values, nbytes, seconds_at(w))
        widths.append(w)
    return widths


def capped(per_connection: float, rtt: float = 0.001):
    """A link that carries ``per_connection`` bytes/s on each connection."""
    return lambda w: rtt + BATCH / (w * per_connection)


def test_a_link_capping_each_connection_widens_to_the_most_in_a_few_batches():
    spread = Spread(4)
    widths = run(spread, capped(50e6), 12)
    assert widths[0] == 1
    assert spread.current == 4
    assert widths.index(4) <= 8, widths
    assert spread.width() == 4  # and stays: no probe for a while after it settles
    run(spread, capped(50e6), 200)
    assert spread.current == 4


def test_a_link_that_caps_nothing_stays_on_one_connection_and_probes_ever_less_often():
    spread = Spread(8)
    flat = lambda w: BATCH / 1e9 / (1.2 if w > 1 else 1.0)  # noqa: E731 - wider is a little faster, not 1.5x
    widths = run(spread, flat, 400)
    assert spread.current == 1
    probes = [i for i, w in enumerate(widths) if w != 1]
    # The first batch (it also connected) does not count; the first probe at 2 opens its connection
    # and is repeated; then gaps of 4, 8 ... batches.
    assert probes[:4] == [3, 4, 9, 18], probes
    assert all(b - a >= MAX_GAP for a, b in itertools.pairwise(probes[5:])), probes
    assert len(probes) <= 12


def test_a_cap_that_lifts_is_followed_back_down():
    spread = Spread(4)
    run(spread, capped(50e6), 20)
    assert spread.current == 4
    run(spread, lambda w: BATCH / 1e9, 200)  # now nothing caps a connection: 4 only cost more
    assert spread.current == 1


def test_between_the_thresholds_the_width_stays():
    """Doubling 1 to 2 connections buys 1.4x: too little to widen to, too much to give up."""
    band = lambda w: BATCH / {1: 100e6 / 1.4, 2: 100e6}[w]  # noqa: E731
    spread = Spread(2)
    run(spread, band, 300)
    assert spread.current == 1
    spread = Spread(2)
    run(spread, capped(50e6, rtt=0), 20)  # 2 connections at 100e6 B/s, 1 at 50e6
    assert spread.current == 2
    run(spread, band, 300)
    assert spread.current == 2


def test_small_batches_neither_probe_nor_teach():
    spread = Spread(4)
    widths = run(spread, capped(50e6), 50, nbytes=MEASURED_BYTES - 1)
    assert set(widths) == {1} and spread.current == 1


def test_batches_of_fewer_values_than_the_wider_width_has_connections_teach_nothing():
    """A writer that keeps up sends a record per batch: one value cannot go faster over more
    connections, so its batches neither probe nor move the width, however large."""
    spread = Spread(4)
    assert set(run(spread, capped(50e6), 50, values=1)) == {1}
    run(spread, capped(50e6), 12)  # its queue backs up: batches of 16
    assert spread.current == 4
    run(spread, lambda w: 1.0, 50, values=3)  # 3 values cannot show what 4 connections buy
    assert spread.current == 4


def test_a_cap_narrower_than_the_probe_runs_at_the_cap_and_teaches_nothing():
    spread = Spread(4)
    run(spread, capped(50e6), 3)
    assert spread.width(cap=1) == 1  # a probe is due, but this batch's servers share out 1 each
    spread.measured(1, 16, BATCH, capped(50e6)(1))
    assert spread.width() == 2  # still due
    assert spread.current == 1


def test_fixed_spread_always_uses_the_most():
    spread = Spread(6, adaptive=False)
    assert run(spread, capped(50e6), 10) == [6] * 10
    assert spread.width(cap=2) == 2


@pytest.mark.parametrize("most", [1, 3, 6])
def test_widths_stay_within_one_and_the_most(most):
    spread = Spread(most)
    widths = run(spread, capped(50e6), 100)
    assert set(widths) <= set(range(1, most + 1))
    assert spread.current == most  # 3 and 6 reached through 2 and 4: the doublings stop at the most
