"""One definition per concept: where two layers use the same vocabulary, they agree."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


def test_registry_serves_exactly_the_schemes_redis_config_parses():
    from kvstore.stores.redis.config import parse_scheme
    from kvstore.stores.registry import BACKENDS

    routed = {s: b.target for b in BACKENDS for s in b.schemes if b.target.startswith("kvstore.stores.redis:")}
    candidates = {f"{base}{topology}" for base in ("redis", "rediss", "unix") for topology in ("", "+cluster")}
    accepted = set()
    for scheme in candidates | {"redis+sentinel", "http"}:
        try:
            tls, cluster = parse_scheme(scheme)
        except ConfigError:
            continue
        accepted.add(scheme)
        assert routed[scheme].endswith("RedisClusterStore" if cluster else "RedisStore"), scheme
        assert tls == scheme.startswith("rediss")
    assert accepted == set(routed)


def test_v0_roles_are_the_adapters_roles():
    from kvstore.connectors.agent import v0
    from kvstore.connectors.roles import KV_ROLE_NAMES, ROLE_NAMES, parse_role

    assert set(KV_ROLE_NAMES) <= set(ROLE_NAMES)
    assert {parse_role(n).name for n in KV_ROLE_NAMES} == {parse_role(n).name for n in ROLE_NAMES}
    assert v0.KV_ROLE_NAMES is KV_ROLE_NAMES


def test_agent_layout_names_are_the_paged_layouts():
    from kvstore.connectors.agent.config import LAYOUT_NAMES
    from kvstore.paged.layouts import LAYOUTS

    assert LAYOUT_NAMES == tuple(LAYOUTS)


def test_the_docs_state_the_supported_vllm_range():
    from kvstore.connectors.vllm.facts import SUPPORTED_VLLM, VLLM_MINORS

    assert SUPPORTED_VLLM == (f">={VLLM_MINORS[0][0]}.{VLLM_MINORS[0][1]}",
                              f"<{VLLM_MINORS[-1][0]}.{VLLM_MINORS[-1][1] + 1}")
    assert f"**Supported vLLM:** `{','.join(SUPPORTED_VLLM)}`" in (ROOT / "docs" / "vllm.md").read_text()


def test_connector_location_is_derived_from_the_package():
    import importlib.util

    from kvstore.connectors.vllm import plugin

    spec = importlib.util.find_spec(plugin.CONNECTOR_MODULE)
    assert spec is not None and spec.origin is not None
    assert f"class {plugin.CONNECTOR_CLASS}(" in Path(spec.origin).read_text()


def test_key_stem_is_the_key_grammars():
    from kvstore.keys import FORMAT_VERSION, KEY_PREFIX, KEY_STEM, Namespace, chunk_keys, namespace_prefix, split_key

    assert KEY_PREFIX == f"{KEY_STEM}{FORMAT_VERSION}"
    ns = Namespace(model="m", kv_dtype="bfloat16", layout="flash-2bnhd", block_size=16, chunk_tokens=16,
                   layer_start=0, layer_end=1, tp_rank=0, tp_size=1, model_fingerprint="f")
    key = chunk_keys(ns, list(range(16)))[0].key
    assert key.startswith(ns.key_prefix) and ns.key_prefix.startswith(KEY_PREFIX + "/")
    assert split_key(key) == (FORMAT_VERSION, ns.id, key.rsplit("/", 1)[1])
    assert namespace_prefix(ns.id) == ns.key_prefix


def test_bad_redis_scheme_names_the_grammar():
    from kvstore.stores.redis.config import RedisConfig

    with pytest.raises(ConfigError, match=r"redis\+sentinel.*rediss.*\+cluster.*unix"):
        RedisConfig.from_url("redis+sentinel://h:1")
