"""The golden record cases: inputs that tests/fixtures/records/v<format version>/*.kvr were
encoded from, one directory per format version (every version still read has its fixtures).

``python -m tests.golden_records`` writes the current version's fixtures. Never do that to make
a failing test pass: a fixture that no longer decodes means stored caches would stop decoding
too. Add a new format version (and new fixtures) instead.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvstore import FORMAT_VERSION, Namespace, chunk_keys
from kvstore.keys import HeadRange

#: The format versions whose records are still read, oldest first.
VERSIONS = (1, 2, 3)
CREATED = 1_790_000_000.0

# name -> (dtype, codec chain, per-layer shape, layers, hidden (dtype, shape) or None, tokens)
CASES = {
    "bf16_raw_hidden": ("bfloat16", (), (2, 32, 2, 16), 3, ("bfloat16", (64,)), 32),
    "bf16_shuffle_lz4": ("bfloat16", ("shuffle2", "lz4"), (2, 32, 2, 16), 3, None, 32),
    "fp16_lz4_partial": ("float16", ("lz4",), (2, 20, 2, 16), 2, ("float32", (64,)), 20),
    "fp32_raw": ("float32", (), (32, 48), 2, None, 32),
    "fp8_raw": ("float8_e4m3fn", (), (2, 32, 1, 16), 2, None, 32),
    "bf16_shuffle_zstd": ("bfloat16", ("shuffle2", "zstd"), (2, 32, 2, 16), 2, None, 32),
    "fp32_raw_heads": ("float32", (), (32, 2, 48), 2, None, 32),
}
#: Cases of records that name a head range, and the first format version that has them.
HEADS = {"fp32_raw_heads": (HeadRange(2, 4, 8), 3)}
#: Every (case, version) with a fixture.
CASE_VERSIONS = [(name, v) for v in VERSIONS for name in sorted(CASES) if HEADS.get(name, (None, 1))[1] <= v]

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}

#: Signed records (optional header fields kid/tag): name -> (unsigned case, cache salt), all signed
#: with GOLDEN_KEY (a test key: never use a published key in a deployment).
SIGNED_CASES = {
    "bf16_raw_hidden_signed": ("bf16_raw_hidden", ""),
    "bf16_shuffle_lz4_signed_tenant": ("bf16_shuffle_lz4", "tenant-a"),
}
GOLDEN_KEY = bytes(range(32))


def fixture(name: str, version: int = FORMAT_VERSION) -> Path:
    return Path(__file__).parent / "fixtures" / "records" / f"v{version}" / f"{name}.kvr"


def namespace(dtype: str, cache_salt: str = "", version: int = FORMAT_VERSION) -> Namespace:
    return Namespace(model="golden", kv_dtype=dtype, layout="golden", block_size=4, chunk_tokens=32,
                     layer_end=4, model_fingerprint="v1", cache_salt=cache_salt, format_version=version)


def case_inputs(name: str, cache_salt: str = "", version: int = FORMAT_VERSION):
    """(namespace, chunk, tokens, dtype, shapes, kv bytes, hidden bytes or None, hidden meta, chain)."""
    dtype, chain, shape, layers, hidden, ntok = CASES[name]
    seed = sum(map(ord, name))
    rng = np.random.default_rng(seed)
    ns = namespace(dtype, cache_salt, version)
    tokens = rng.integers(0, 50_000, ntok, dtype=np.int64)
    chunk = chunk_keys(ns, tokens, heads=HEADS[name][0] if name in HEADS else None)[0]
    n = layers * int(np.prod(shape))
    if dtype in ("bfloat16", "float16", "float32"):
        # Smooth-ish values so the compressors have something to find, stored as the dtype's bytes.
        values = rng.standard_normal(n).astype(np.float32)
        if dtype == "float32":
            kv = values.tobytes()
        elif dtype == "float16":
            kv = values.astype(np.float16).tobytes()
        else:
            kv = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    else:
        kv = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    hidden_bytes = None
    if hidden is not None:
        hdtype, hshape = hidden
        hidden_bytes = rng.integers(0, 256, ITEMSIZE[hdtype] * int(np.prod(hshape)), dtype=np.uint8).tobytes()
    return ns, chunk, tokens, dtype, [shape] * layers, kv, hidden_bytes, hidden, chain


def golden_auth():
    from kvstore.record.auth import RecordAuth

    return RecordAuth([GOLDEN_KEY])


def signed_inputs(name: str, version: int = FORMAT_VERSION):
    """``case_inputs`` of a signed case (its namespace carries the case's cache salt)."""
    base, salt = SIGNED_CASES[name]
    return case_inputs(base, salt, version)


def encode_case(name: str) -> bytes:
    from kvstore import encode_record

    auth = None
    if name in SIGNED_CASES:
        ns, chunk, tokens, dtype, shapes, kv, hidden_bytes, hidden, chain = signed_inputs(name)
        auth = golden_auth().for_salt(ns.cache_salt)
    else:
        ns, chunk, tokens, dtype, shapes, kv, hidden_bytes, hidden, chain = case_inputs(name)
    return bytes(encode_record(
        namespace=ns, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes, kv=kv,
        hidden=hidden_bytes, hidden_dtype=hidden[0] if hidden else None,
        hidden_shape=hidden[1] if hidden else None, chain=chain, created=CREATED, auth=auth,
    ))


if __name__ == "__main__":
    for case in [*CASES, *SIGNED_CASES]:
        path = fixture(case)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(encode_case(case))
        print("wrote", path)
