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
from kvstore.keys import HeadRange, key_heads, prefix_keys, split_key

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
    3: ("8de763504463f399b0c76cccb3de3719053809017b9e66e180a910d823e264b2", [
        ("kvs3/8de763504463f399/39488ca39cac7797919fcb174b98fc29", 0, 256, False),
        ("kvs3/8de763504463f399/d83dc1f58b525240a00d2563c9f904ff", 256, 512, False),
        ("kvs3/8de763504463f399/97b63ee2336899abe5dc764f771629f3", 512, 600, True),
    ]),
}
#: Version 3's keys of the records of KV heads [2, 4) of 8: the chain's keys with a suffix.
GOLDEN_HEADS = [
    "kvs3/8de763504463f399/39488ca39cac7797919fcb174b98fc29/h2-4of8",
    "kvs3/8de763504463f399/d83dc1f58b525240a00d2563c9f904ff/h2-4of8",
    "kvs3/8de763504463f399/97b63ee2336899abe5dc764f771629f3/h2-4of8",
]


@pytest.mark.parametrize("version", sorted(GOLDEN))
def test_golden_namespace_and_keys(version):
    ns = dataclasses.replace(NS, format_version=version)
    namespace, keys = GOLDEN[version]
    assert ns.digest.hex() == namespace
    assert [(k.key, k.start, k.end, k.partial) for k in chunk_keys(ns, list(range(600)))] == keys


def test_the_current_format_has_golden_keys():
    assert NS.format_version == FORMAT_VERSION in GOLDEN


def test_golden_head_range_keys():
    heads = HeadRange(2, 4, 8)
    keys = chunk_keys(NS, list(range(600)), heads=heads)
    assert [k.key for k in keys] == GOLDEN_HEADS and all(k.heads == heads for k in keys)
    plain = chunk_keys(NS, list(range(600)))
    # One chain for every range: the digests are the plain keys', the range only a suffix.
    assert [k.digest for k in keys] == [k.digest for k in plain]
    assert [k.with_heads(heads) for k in plain] == keys and [k.with_heads(None) for k in keys] == plain
    assert [k.base for k in keys] == [k.key for k in plain]
    assert prefix_keys(NS, list(range(600)), [600], heads=heads) == keys


def test_head_range_keys_parse():
    key = GOLDEN_HEADS[0]
    assert split_key(key) == (3, "8de763504463f399", "39488ca39cac7797919fcb174b98fc29")
    assert key_heads(key) == HeadRange(2, 4, 8) and key_heads(GOLDEN[3][1][0][0]) is None
    for bad in ("/h4-2of8", "/h0-9of8", "/h02-4of8", "/h2-4of", "/h-1-2of8", "/h0-0of8"):
        assert split_key(GOLDEN[3][1][0][0] + bad) is None and key_heads(GOLDEN[3][1][0][0] + bad) is None, bad


@pytest.mark.parametrize("args", [(1, 1, 2), (2, 1, 2), (-1, 1, 2), (0, 3, 2), (0, 1, 5000), (0.0, 1, 2)])
def test_bad_head_ranges(args):
    with pytest.raises(ValueError, match="head range"):
        HeadRange(*args)


def test_head_range_arithmetic():
    a, b = HeadRange(0, 4, 8), HeadRange(2, 6, 8)
    assert a.overlap(b) == HeadRange(2, 4, 8) and a.overlap(HeadRange(4, 8, 8)) is None
    assert a.contains(HeadRange(1, 3, 8)) and not a.contains(b) and a.count == 4 and str(a) == "[0, 4) of 8"


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
