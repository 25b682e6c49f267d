"""Authenticated records: with a deployment key, only writers holding it place KV that readers
load. Unsigned, forged, other-key and other-tenant records are counted misses; a previous key
is accepted for its window only; keyless readers still read signed records; golden signed
records stay readable; and on the reference engine a keyless writer never changes what a keyed
reader generates."""

from __future__ import annotations

import random
import sys

import forge
import numpy as np
import pytest
from golden_records import GOLDEN_KEY, SIGNED_CASES, VERSIONS, encode_case, fixture, golden_auth, signed_inputs

from kvstore import FORMAT_VERSION, CorruptRecordError, Namespace, chunk_keys, decode_record, encode_record, read_header
from kvstore.connectors.agent import KVStoreAgent
from kvstore.errors import ConfigError
from kvstore.metrics.catalog import CORRUPT
from kvstore.record.auth import TAG_BYTES, RecordAuth, shared_auth
from kvstore.reference import PRESETS, ModelRunner
from kvstore.stores import open_store

NS = Namespace(model="m", kv_dtype="bfloat16", layout="t", block_size=4, chunk_tokens=8, layer_end=1,
               cache_salt="tenant")
KEY_A, KEY_B = bytes(range(32)), bytes(range(1, 33))


def _record(auth=None, ns=NS, kv=None, hidden=True):
    tokens = list(range(8))
    chunk = chunk_keys(ns, tokens)[0]
    kv = np.arange(2 * 8 * 3 * 4, dtype=np.uint16).tobytes() if kv is None else kv
    h = np.arange(16, dtype=np.uint16).tobytes() if hidden else None
    data = encode_record(namespace=ns, chunk=chunk, tokens=tokens, dtype="bfloat16", shapes=[(2, 8, 3, 4)], kv=kv,
                         hidden=h, hidden_dtype="bfloat16" if hidden else None,
                         hidden_shape=(16,) if hidden else None, auth=auth)
    return bytes(data), chunk, kv


def _auth_error(data, keys, reason="auth", **expect):
    with pytest.raises(CorruptRecordError) as err:
        decode_record(data, auth=keys, **expect)
    assert err.value.reason == reason, err.value
    try:
        size = read_header(data).raw_len
    except CorruptRecordError:  # a header that does not parse: any destination
        size = 1024
    out = bytearray(b"\xa5" * size)
    with pytest.raises(CorruptRecordError):
        decode_record(data, auth=keys, out=memoryview(out), **expect)
    assert set(out) == {0xA5}  # nothing reached the destination


def test_signed_records_verify_and_keyless_readers_read_them():
    keys = RecordAuth([KEY_A]).for_salt(NS.cache_salt)
    data, chunk, kv = _record(keys)
    header = read_header(data)
    assert header.key_id == RecordAuth([KEY_A]).key_id and len(header.tag) == 32
    assert bytes(decode_record(data, namespace=NS, chunk=chunk, auth=keys).kv) == kv
    assert bytes(decode_record(data, namespace=NS, chunk=chunk).kv) == kv  # no key: the tag is not checked
    for codec_out in (None, memoryview(bytearray(len(kv)))):
        assert bytes(decode_record(data, auth=keys, out=codec_out).kv) == kv


def test_unsigned_forged_and_other_key_records_are_rejected():
    keys = RecordAuth([KEY_A]).for_salt(NS.cache_salt)
    unsigned, _, _ = _record()
    _auth_error(unsigned, keys)
    other, _, _ = _record(RecordAuth([KEY_B]).for_salt(NS.cache_salt))
    _auth_error(other, keys)
    other_tenant, _, _ = _record(RecordAuth([KEY_A]).for_salt("someone-else"))
    _auth_error(other_tenant, keys)  # same deployment key, another tenant's derived key
    # A forger who rewrites the payload and fixes the xxh3 checksum and header CRC still lacks the key.
    signed, _, _ = _record(keys)
    header, payload, trailer = forge.split(signed)
    altered = bytearray(payload)
    altered[0] ^= 0xFF
    _auth_error(forge.reframe(header, bytes(altered), tag=trailer[:TAG_BYTES]), keys)
    # And one that changes a header field the tag covers (the created time), CRC fixed.
    _auth_error(forge.reframe(dict(header, created=header["created"] + 1), payload, tag=trailer[:TAG_BYTES]), keys)
    # And one that moves the tag into the header, where version 1 kept it.
    _auth_error(forge.reframe(dict(header, tag=trailer[:TAG_BYTES]), payload, tag=trailer[:TAG_BYTES]), keys,
                reason="header")


def test_previous_key_is_accepted_for_its_window_only():
    now = [1000.0]
    rotated = RecordAuth([KEY_B, KEY_A], previous_window=3600, clock=lambda: now[0])
    keys = rotated.for_salt(NS.cache_salt)
    old, _, kv = _record(RecordAuth([KEY_A]).for_salt(NS.cache_salt))
    assert bytes(decode_record(old, auth=keys).kv) == kv  # written before the rotation: still read
    new, _, _ = _record(keys)
    assert read_header(new).key_id == rotated.key_id != read_header(old).key_id  # writers sign with the current key
    now[0] += 3599
    decode_record(old, auth=keys)
    now[0] += 2
    _auth_error(old, keys)  # the window is over
    decode_record(new, auth=keys)
    assert rotated.describe()["previous_key_ids"] == [RecordAuth([KEY_A]).key_id.hex()]


def test_keys_from_a_file_or_the_environment(tmp_path, monkeypatch, caplog):
    path = tmp_path / "key"
    path.write_text(f"# kvstore deployment key\n{KEY_B.hex()}\n{KEY_A.hex()}\n")
    path.chmod(0o600)
    auth = RecordAuth.from_options(key_file=str(path))
    assert auth.key_id == RecordAuth([KEY_B]).key_id and len(auth.describe()["previous_key_ids"]) == 1
    monkeypatch.setenv("KVSTORE_TEST_KEY", KEY_A.hex())
    assert RecordAuth.from_options(key_env="KVSTORE_TEST_KEY").key_id == RecordAuth([KEY_A]).key_id
    assert RecordAuth.from_options() is None
    path.chmod(0o644)
    RecordAuth.from_options(key_file=str(path))
    assert "readable by other users" in caplog.text
    secret = KEY_A.hex()[:60] + "zz!!"
    monkeypatch.setenv("KVSTORE_TEST_BAD", secret)
    for kwargs, message in ((dict(key_file=str(path), key_env="X"), "not both"),
                            (dict(key_file=str(tmp_path / "missing")), "cannot be read"),
                            (dict(key_env="KVSTORE_TEST_UNSET"), "not set or empty"),
                            (dict(key_env="KVSTORE_TEST_BAD"), "not 64 hex digits"),
                            (dict(key_env="KVSTORE_TEST_KEY", previous_window=31 * 86400), "30 days")):
        with pytest.raises(ConfigError, match=message) as err:
            RecordAuth.from_options(**kwargs)
        assert secret not in str(err.value) and KEY_A.hex() not in str(err.value)  # never the key itself
    assert shared_auth("", "KVSTORE_TEST_KEY", 60.0) is shared_auth("", "KVSTORE_TEST_KEY", 60.0)


def test_a_configured_key_without_blake3_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "blake3", None)  # import blake3 -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'blake3>=1\.0' \(or pip install '\.\[auth\]' in a kvstore checkout\)"):
        RecordAuth([KEY_A])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(SIGNED_CASES))
def test_golden_signed_records(name, version):
    ns, chunk, tokens, dtype, shapes, kv, hidden, _, _ = signed_inputs(name, version)
    data = fixture(name, version).read_bytes()
    if version == FORMAT_VERSION:
        assert encode_case(name) == data  # the signed wire format is pinned too
    keys = golden_auth().for_salt(ns.cache_salt)
    rec = decode_record(data, namespace=ns, chunk=chunk, tokens=tokens, dtype=dtype, shapes=shapes, auth=keys)
    assert bytes(rec.kv) == kv and (None if rec.hidden is None else bytes(rec.hidden)) == hidden
    assert rec.header.key_id == RecordAuth([GOLDEN_KEY]).key_id
    _auth_error(data, RecordAuth([KEY_B]).for_salt(ns.cache_salt))


# -- end to end on the reference engine ------------------------------------------------------------
CFG = PRESETS["tiny"]


def _agent(url, key_env="", **kw):
    return KVStoreAgent(dict(store=url, model=CFG.name, model_fingerprint=CFG.fingerprint, chunk_tokens=32,
                             auth_key_env=key_env, **kw))


def test_keyless_writer_never_reaches_a_keyed_reader(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSTORE_E2E_KEY", KEY_A.hex())
    url = f"file://{tmp_path / 'kv'}"
    rng = random.Random(5)
    prompt = [rng.randrange(CFG.vocab_size) for _ in range(100)]
    baseline = ModelRunner(CFG).generate([prompt], 8).tokens
    auth_rejects = CORRUPT
    before = auth_rejects.value(reason="auth")

    keyless = _agent(url)  # a writer without the key, on the same shared store
    assert ModelRunner(CFG, keyless).generate([prompt], 8).tokens == baseline
    assert keyless.stats.chunks_saved == 4
    keyless.close()

    unsigned = _records(url)
    reader = _agent(url, "KVSTORE_E2E_KEY")
    out = ModelRunner(CFG, reader).generate([prompt], 8)
    assert out.tokens == baseline and out.tokens_loaded == 0  # nothing of the keyless writer was loaded
    # Keyed records live in their key's space: the keyless ones are never even fetched, and stay.
    assert auth_rejects.value(reason="auth") - before == 0
    assert reader.stats.chunks_saved == 4  # the keyed reader stored signed records beside them
    reader.close()
    assert {k: v for k, v in _records(url).items() if k in unsigned} == unsigned

    again = _agent(url, "KVSTORE_E2E_KEY")
    out = ModelRunner(CFG, again).generate([prompt], 8)
    assert out.bypassed and out.tokens_loaded == len(prompt) and out.tokens == baseline
    assert auth_rejects.value(reason="auth") - before == 0
    again.close()
    # And the keyless reader (a documented choice: keyed and keyless deployments do not share)
    # still hits its own unsigned records, never the signed ones.
    out = ModelRunner(CFG, _agent(url)).generate([prompt], 8)
    assert out.bypassed and out.tokens_loaded == len(prompt) and out.tokens == baseline

    # A keyless writer that overwrites a signed record (forged KV, valid checksum) changes nothing.
    xfer = next(iter(again._transfers.values()))
    keys = xfer.keys(prompt)
    raw = open_store(url)  # the agent's store is closed: a closed store answers misses
    rec = decode_record(raw.get(keys[1].key))
    noisy = np.frombuffer(rec.kv, np.float32) + 0.5
    raw.put(keys[1].key, encode_record(
        namespace=xfer.cache.namespace, chunk=keys[1], tokens=prompt[32:64], dtype=rec.header.dtype,
        shapes=rec.header.shapes, kv=noisy.astype(np.float32), hidden=rec.hidden,
        hidden_dtype=rec.header.hidden_dtype, hidden_shape=rec.header.hidden_shape))
    raw.close()
    last = _agent(url, "KVSTORE_E2E_KEY")
    out = ModelRunner(CFG, last).generate([prompt], 8)
    assert out.tokens == baseline and out.tokens_loaded == 32  # the first chunk, then the forged one is a miss
    assert auth_rejects.value(reason="auth") - before == 1
    last.close()


def _records(url):
    store = open_store(url)
    try:
        return {k: bytes(store.get(k)) for k in store.iter_keys()}
    finally:
        store.close()


def _prompt(seed, n=100):
    rng = random.Random(seed)
    return [rng.randrange(CFG.vocab_size) for _ in range(n)]


def test_two_keys_on_one_store_do_not_fight(tmp_path, monkeypatch):
    """Writers with keys K1 and K2 on one store: each keys its records in its own space, so a K2
    reader misses K1's records (and recomputes) without touching them, and K1 readers still hit
    all of it afterwards; the K2 records it wrote are K2's alone."""
    monkeypatch.setenv("KVSTORE_K1", KEY_A.hex())
    monkeypatch.setenv("KVSTORE_K2", KEY_B.hex())
    url = f"file://{tmp_path / 'kv'}"
    prompt = _prompt(11)
    baseline = ModelRunner(CFG).generate([prompt], 8).tokens
    before = CORRUPT.value(reason="auth")
    k1 = _agent(url, "KVSTORE_K1")
    ModelRunner(CFG, k1).generate([prompt], 8)
    k1.close()
    signed_k1 = _records(url)
    assert len(signed_k1) == 4

    k2 = _agent(url, "KVSTORE_K2")
    out = ModelRunner(CFG, k2).generate([prompt], 8)
    assert out.tokens == baseline and out.tokens_loaded == 0 and k2.stats.chunks_saved == 4
    k2.close()
    after = _records(url)
    assert {k: v for k, v in after.items() if k in signed_k1} == signed_k1  # K1's records untouched
    k2_keys = set(after) - set(signed_k1)
    assert len(k2_keys) == 4 and {read_header(after[k]).key_id for k in k2_keys} == {RecordAuth([KEY_B]).key_id}
    assert CORRUPT.value(reason="auth") == before  # nobody even fetched the other key's records

    for env in ("KVSTORE_K1", "KVSTORE_K2"):
        out = ModelRunner(CFG, _agent(url, env)).generate([prompt], 8)
        assert out.bypassed and out.tokens_loaded == len(prompt) and out.tokens == baseline, env


def test_a_rotation_reads_the_previous_keys_space_and_moves_it_to_the_new_one(tmp_path, monkeypatch):
    """Keys "K2 K1" (K1 previous): within the window a reader hits K1's records and its save
    re-signs them into K2's space, so once the window is over (keys "K2" alone) they still hit."""
    monkeypatch.setenv("KVSTORE_OLD", KEY_A.hex())
    monkeypatch.setenv("KVSTORE_ROTATED", f"{KEY_B.hex()} {KEY_A.hex()}")
    monkeypatch.setenv("KVSTORE_NEW", KEY_B.hex())
    url = f"file://{tmp_path / 'kv'}"
    prompt = _prompt(12)
    baseline = ModelRunner(CFG).generate([prompt], 8).tokens
    ModelRunner(CFG, _agent(url, "KVSTORE_OLD")).generate([prompt], 8)
    old = _records(url)

    rotating = _agent(url, "KVSTORE_ROTATED")
    out = ModelRunner(CFG, rotating).generate([prompt[:90]], 8)  # a shorter prompt: a partial hit, then a save
    assert out.tokens_loaded == 64 and out.tokens == ModelRunner(CFG).generate([prompt[:90]], 8).tokens
    rotating.close()
    out = ModelRunner(CFG, _agent(url, "KVSTORE_ROTATED")).generate([prompt], 8)
    assert out.bypassed and out.tokens_loaded == len(prompt) and out.tokens == baseline
    moved = {k: v for k, v in _records(url).items() if k not in old}
    assert moved and {read_header(v).key_id for v in moved.values()} == {RecordAuth([KEY_B]).key_id}

    # After the window: the previous key's space is not read; what was moved still hits.
    out = ModelRunner(CFG, _agent(url, "KVSTORE_NEW")).generate([prompt[:90]], 8)
    assert out.bypassed and out.tokens_loaded == 90
    out = ModelRunner(CFG, _agent(url, "KVSTORE_ROTATED", auth_previous_window=0)).generate([prompt], 8)
    assert out.tokens == baseline and out.tokens_loaded == 64  # K1's chunks 2-3 are no longer read
