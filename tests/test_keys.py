"""Key scheme: golden values, determinism across processes, namespace coverage.

Hashing speed is measured in benchmarks/bench_codec.py, not here."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kvstore import FORMAT_VERSION, ConfigError, Namespace, chunk_keys

NS = Namespace(model="meta-llama/Llama-3-8B", kv_dtype="bfloat16", layout="vllm-flash", block_size=16,
               chunk_tokens=256, layer_start=0, layer_end=32, tp_rank=0, tp_size=1,
               model_fingerprint="rev-abc")

# Pinned forever, per format version: a change here breaks every stored cache of that version.
GOLDEN = {
    1: ("76dc44145c2bc61ecba7a8993165146d7f779914271078ff6612c5e39558c627", [
        ("kvs1/76dc44145c2bc61e/f893f6d5b21da60bb867befcf2434e08", 0, 256, False),
        ("kvs1/76dc44145c2bc61e/80d46d0cbeb712770e3841a305dd2f36", 256, 512, False),
        ("kvs1/76dc44145c2bc61e/c3db05fa71f5475f503096fbb3c82d1c", 512, 600, True),
    ]),
    2: ("e19ed406587707884e80a9cc6244d917b975e7a504a9af3d988ac0709d77186c", [
        ("kvs2/e19ed40658770788/014f5059128c2b7f1de73ce1510c37ee", 0, 256, False),
        ("kvs2/e19ed40658770788/b5c97e4c6710fcf65792bf921dac686d", 256, 512, False),
        ("kvs2/e19ed40658770788/8e78d74693934720350a1681b30cf9e0", 512, 600, True),
    ]),
}


@pytest.mark.parametrize("version", sorted(GOLDEN))
def test_golden_namespace_and_keys(version):
    ns = dataclasses.replace(NS, format_version=version)
    namespace, keys = GOLDEN[version]
    assert ns.digest.hex() == namespace
    assert [(k.key, k.start, k.end, k.partial) for k in chunk_keys(ns, list(range(600)))] == keys


def test_the_current_format_has_golden_keys():
    assert NS.format_version == FORMAT_VERSION in GOLDEN


def test_token_container_does_not_matter():
    tokens = list(range(600))
    expected = chunk_keys(NS, tokens)
    for variant in (np.array(tokens, dtype=np.int64), np.array(tokens, dtype=np.uint32), tuple(tokens)):
        assert chunk_keys(NS, variant) == expected


def test_keys_name_prefixes_not_chunks():
    a = chunk_keys(NS, [1] * 256 + [2] * 256)
    b = chunk_keys(NS, [3] * 256 + [2] * 256)
    assert a[1].key != b[1].key  # same second chunk, different prefix
    c = chunk_keys(NS, [1] * 256 + [2] * 256 + [9] * 10)
    assert [k.key for k in c[:2]] == [k.key for k in a]  # shared prefix, shared keys


def test_partial_chunk_is_marked_and_optional():
    keys = chunk_keys(NS, list(range(300)))
    assert [k.partial for k in keys] == [False, True]
    assert len(chunk_keys(NS, list(range(300)), include_partial=False)) == 1
    assert chunk_keys(NS, []) == []
    assert len(chunk_keys(NS, list(range(2000)), max_chunks=3)) == 3


@pytest.mark.parametrize("field, value", [
    ("model", "other"), ("model_fingerprint", "rev-def"), ("kv_dtype", "float16"), ("layout", "cpu-packed"),
    ("layer_start", 16), ("layer_end", 16), ("tp_rank", 1), ("tp_size", 4), ("block_size", 32),
    ("chunk_tokens", 512), ("adapter", "lora-7"), ("cache_salt", "tenant-a"), ("extra", (("isa", "amx"),)),
])
def test_every_namespace_field_changes_keys(field, value):
    changes = {field: value}
    if field == "tp_rank":
        changes["tp_size"] = 2
    if field == "layer_start":
        changes["layer_end"] = 32
    other = dataclasses.replace(NS, **changes)
    assert other.digest != NS.digest
    assert chunk_keys(other, [5] * 256)[0].key != chunk_keys(NS, [5] * 256)[0].key


def test_with_salt():
    assert NS.with_salt("") is NS
    assert NS.with_salt("t1").cache_salt == "t1"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(chunk_tokens=100), "chunk_tokens=100 must be a positive multiple of the engine's block_size=16"),
    (dict(block_size=0), "block_size=0"),
    (dict(model=""), "model name"),
    (dict(tp_rank=2, tp_size=2), "tp_rank=2"),
    (dict(layer_start=5, layer_end=2), "layer range"),
])
def test_bad_namespace_is_a_config_error(kwargs, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace("[", r"\[")):
        dataclasses.replace(NS, **kwargs)


_CHILD = """
import json, sys
from kvstore import Namespace, chunk_keys
ns = Namespace(**json.loads(sys.argv[1]))
print(json.dumps([k.key for k in chunk_keys(ns, list(range(1000)))]))
"""


def test_same_keys_in_a_subprocess_with_another_hash_seed():
    fields = {f.name: getattr(NS, f.name) for f in dataclasses.fields(NS) if f.name != "extra"}
    here = [k.key for k in chunk_keys(NS, list(range(1000)))]
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(fields)], env=env,
                             capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == here
