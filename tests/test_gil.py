"""The adapters' ``switch_interval`` option (``kvstore.connectors.gil``): at start-up the
interpreter's thread switch interval is lowered to it, never raised, 0 leaves it; out-of-range
values are ConfigErrors naming the value. The figures behind it: ``benchmarks/bench_gil.py``."""

from __future__ import annotations

import sys

import pytest

from kvstore.connectors.agent import AgentConfig, KVStoreAgent
from kvstore.connectors.gil import lower_switch_interval
from kvstore.connectors.vllm.options import parse_options
from kvstore.errors import ConfigError

AGENT = {"store": "memory://", "model": "m", "model_fingerprint": "f"}


@pytest.fixture
def interval():
    """The interpreter's default (5 ms) for the test, whatever an earlier test set; restored after."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_it_is_lowered_never_raised_and_zero_leaves_it(interval):
    assert lower_switch_interval(0.0005) and sys.getswitchinterval() == pytest.approx(0.0005)
    assert not lower_switch_interval(0.002) and sys.getswitchinterval() == pytest.approx(0.0005)  # never raised
    sys.setswitchinterval(0.005)
    assert not lower_switch_interval(0.0) and sys.getswitchinterval() == pytest.approx(0.005)


def test_an_agent_lowers_it_at_start_up(interval, caplog):
    caplog.set_level("INFO", logger="kvstore.connectors.gil")
    KVStoreAgent(AGENT).close()
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    assert "lowered from 5 ms to 0.5 ms" in caplog.text
    sys.setswitchinterval(0.005)
    KVStoreAgent({**AGENT, "switch_interval": 0}).close()
    assert sys.getswitchinterval() == pytest.approx(0.005)


@pytest.mark.parametrize("value", ["-1ms", "10ms", "1s", "fast", "nan"])
def test_out_of_range_values_are_config_errors_naming_them(value):
    with pytest.raises(ConfigError, match="switch_interval"):
        AgentConfig.from_mapping({**AGENT, "switch_interval": value})
    with pytest.raises(ConfigError, match="switch_interval"):
        parse_options({"store": "memory://", "switch_interval": value})


def test_durations_are_accepted_in_any_unit():
    assert parse_options({"store": "memory://", "switch_interval": "200us"}).switch_interval == pytest.approx(2e-4)
    assert AgentConfig.from_mapping({**AGENT, "switch_interval": "1ms"}).switch_interval == 0.001
