"""Malformed option values for both engine adapters (issue 22): control characters, negative,
zero, infinite and NaN numbers, absurd sizes and durations, unit typos. Every case is a
``ConfigError`` naming the option; the cases follow each field's declaration, so an option added
later is fuzzed too."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from kvstore.config import option
from kvstore.connectors.agent import AgentConfig
from kvstore.connectors.options import DEFAULT_CHUNK_TOKENS
from kvstore.connectors.vllm.options import VLLMConnectorOptions, parse_options
from kvstore.errors import ConfigError

AGENT_BASE = {"store": "memory://", "model": "m", "model_fingerprint": "f"}
VLLM_BASE = {"store": "memory://"}
CONTROL = ["\r\n", "\n", "\t", "\x00", "\x1b", "\x7f", "\x85"]


def _cases(cls: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[str, object]] = []
    for f in dataclasses.fields(cls):
        meta = f.metadata or {}
        if not f.init or meta.get("internal"):
            continue
        name, kind, hint = f.name, meta.get("kind"), hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else None
        if kind == "urls":
            out += [(name, "memory://\r\nredis://x"), (name, ["memory://", "redis://h\x00"]),
                    (name, "memory://?max_bytes=1GiB\n"), (name, "memory"), (name, 5)]
            continue
        if hint is dict or typing.get_origin(hint) in (typing.Mapping, dict) or "Mapping" in str(hint):
            out += [(name, "x"), (name, {"queue_items": "8\n"}), (name, {"no_such_option": 1})]
            continue
        text = {"size": "1GiB", "duration": "1h"}.get(kind or "", str(default if default not in (None, "") else "a"))
        if isinstance(default, bool):
            text = "true"
        out += [(name, text + c) for c in CONTROL] + [(name, c + text) for c in CONTROL[:2]]
        if hint in (int, float) and not isinstance(default, bool):
            lo, hi = meta.get("range") or (None, None)
            assert lo is not None, f"{cls.__name__}.{name} declares no range: give it option(lo=, hi=)"
            out += [(name, -1), (name, "-1"), (name, math.inf), (name, -math.inf), (name, math.nan),
                    (name, "inf"), (name, "nan"), (name, 10**30), (name, str(10**30)), (name, "1e400"),
                    (name, True)]
            if lo > 0:
                out += [(name, 0), (name, "0")]
            if kind == "size":
                out += [(name, "1GB B"), (name, "1 GiBs"), (name, "1gibi"), (name, "2PiB"), (name, "1.5.0MiB")]
            elif kind == "duration":
                out += [(name, "10 sec"), (name, "1hr"), (name, "2 mins"), (name, "3650d"), (name, "1e9s"),
                        (name, "5 ms s")]
            else:
                out += [(name, "3x"), (name, "1_000"), (name, "٣"), (name, "1.5")]
        elif isinstance(default, bool):
            out += [(name, "maybe"), (name, 2), (name, "")]
        elif meta.get("choices"):
            out += [(name, str(meta["choices"][-1]).upper() + "?"), (name, 3)]
    return out


def _ids(cases):
    return [f"{n}={v!r}"[:60] for n, v in cases]


AGENT_CASES = _cases(AgentConfig)
VLLM_CASES = _cases(VLLMConnectorOptions)


@pytest.mark.parametrize(("name", "value"), AGENT_CASES, ids=_ids(AGENT_CASES))
def test_agent_options_refuse_malformed_values(name, value):
    with pytest.raises(ConfigError) as err:
        AgentConfig.from_mapping({**AGENT_BASE, name: value})
    assert name in str(err.value)


@pytest.mark.parametrize(("name", "value"), VLLM_CASES, ids=_ids(VLLM_CASES))
def test_vllm_connector_options_refuse_malformed_values(name, value):
    with pytest.raises(ConfigError) as err:
        parse_options({**VLLM_BASE, name: value})
    assert name in str(err.value)


def test_the_issue_cases_name_the_option_and_the_accepted_range():
    with pytest.raises(ConfigError, match=r"flush_timeout='3650d' \(315360000 s\) is out of range; accepted: 0 to 3600 s"):
        parse_options({**VLLM_BASE, "flush_timeout": "3650d"})
    with pytest.raises(ConfigError, match=r"chunk_tokens=10+ is out of range; accepted: 0 to 1048576"):
        parse_options({**VLLM_BASE, "chunk_tokens": 10**30})
    with pytest.raises(ConfigError, match=r"pool_bytes='1GiB\\n' holds the control character"):
        parse_options({**VLLM_BASE, "pool_bytes": "1GiB\n"})
    with pytest.raises(ConfigError, match="auth_previous_window"):
        AgentConfig.from_mapping({**AGENT_BASE, "auth_previous_window": "1h\r\n"})
    with pytest.raises(ConfigError, match="store"):
        AgentConfig.from_mapping({**AGENT_BASE, "store": "memory://\r\nredis://x"})


def test_direct_construction_is_held_to_the_same_declarations():
    """``AgentConfig(...)`` and ``VLLMConnectorOptions(...)`` without ``build`` check the same."""
    with pytest.raises(ConfigError, match="chunk_tokens"):
        AgentConfig(**AGENT_BASE, chunk_tokens=10**30)
    with pytest.raises(ConfigError, match="cache_salt"):
        AgentConfig(**AGENT_BASE, cache_salt="tenant\n2")
    with pytest.raises(ConfigError, match="flush_timeout"):
        VLLMConnectorOptions(store=("memory://",), flush_timeout=math.inf)
    with pytest.raises(ConfigError, match="model_id"):
        VLLMConnectorOptions(store=("memory://",), model_id="m\x00")


def test_the_shared_adapter_options_are_one_definition():
    agent = {f.name: f for f in dataclasses.fields(AgentConfig)}
    vllm = {f.name: f for f in dataclasses.fields(VLLMConnectorOptions)}
    for name in ("store", "codec", "auth_key_file", "auth_key_env", "auth_previous_window"):
        assert dict(agent[name].metadata) == dict(vllm[name].metadata), name
        assert agent[name].default == vllm[name].default, name
    # chunk_tokens: the agent's default is DEFAULT_CHUNK_TOKENS; the vLLM connector's is 0, chosen
    # from the engine's KV cache groups at start-up (kvstore.connectors.vllm.facts.resolve_chunk_tokens).
    assert agent["chunk_tokens"].default == DEFAULT_CHUNK_TOKENS and vllm["chunk_tokens"].default == 0
    assert agent["chunk_tokens"].metadata["range"][1] == vllm["chunk_tokens"].metadata["range"][1]


def test_valid_values_still_pass():
    opts = parse_options({**VLLM_BASE, "flush_timeout": "10 s", "pool_bytes": " 1GiB ", "lookup_wait": 0,
                          "min_load_tokens": "0", "chunk_tokens": "64"})
    assert (opts.flush_timeout, opts.pool_bytes, opts.chunk_tokens) == (10.0, 1 << 30, 64)
    cfg = AgentConfig.from_mapping({**AGENT_BASE, "auth_previous_window": "1h", "store": "memory:// file:///tmp/x",
                                    "store_options": {"queue_items": 8}})
    assert cfg.auth_previous_window == 3600.0 and len(cfg.store) == 2


def test_a_range_needs_both_ends():
    with pytest.raises(TypeError):
        option(1, lo=0)
