"""``kvstore cp`` and ``kvstore bench`` on real Redis and S3 servers, and the raw RESP client.

cp: records copied and verified byte for byte between file, Redis and S3 stores; a namespace
filter; invalid records never copied; a copy killed half-way (SIGKILL) that the same command
resumes; an unreachable destination ends in one line and a non-zero exit.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore import open_store
from kvstore.cli import main
from kvstore.keys import Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.stores.redis.raw import RawRedis, RawRedisError
from kvstore.testing.damage import flip_byte

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 32


def fill(url: str, model: str, num_tokens: int, *, width: int = 8, seed: int = 0) -> list[str]:
    """Save a synthetic prompt's KV (``width`` values per token and layer); returns its keys."""
    ns = Namespace(model=model, kv_dtype="float16", layout="test", block_size=16, chunk_tokens=CHUNK, layer_end=2)
    tokens = np.random.default_rng(seed).integers(0, 32000, num_tokens)
    with open_store(url) as store:
        cache = PrefixCache(store, ns)
        keys = cache.keys(tokens)
        rng = np.random.default_rng(seed)
        cache.save(tokens, keys, lambda c: ChunkPayload(
            shapes=[(c.num_tokens, width)] * 2, kv=rng.standard_normal((2, c.num_tokens, width)).astype(np.float16)))
    return [k.key for k in keys]


def contents(url: str) -> dict[str, bytes]:
    with open_store(url) as store:
        keys = sorted(store.iter_keys())
        return {k: bytes(v) for k, v in zip(keys, store.get_many(keys)) if v is not None}


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "kvstore.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


# -- cp -------------------------------------------------------------------------------------------
def test_cp_file_to_redis_to_s3_verified(tmp_path, redis_server, s3_server, capsys):
    src = f"file://{tmp_path / 'src'}"
    keys = fill(src, "model-a", 200) + fill(src, "model-b", 100, seed=1)
    with open_store(src) as store:
        store.put("someone-else:key", b"not ours")
    redis_url = f"{redis_server.url}/0?prefix=cp1:"
    assert main(["cp", "--from", src, "--to", redis_url, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["copied"] == len(keys) and report["invalid"] == 0 and report["foreign_keys"] == 1
    s3_url = s3_server.url_for("cp1")
    assert main(["cp", "--from", redis_url, "--to", s3_url, "--progress", "lines"]) == 0
    out = capsys.readouterr().out
    assert f"copied {len(keys)}" in out and "cp: " in out
    expected = {k: v for k, v in contents(src).items() if k in keys}
    assert contents(redis_url) == expected
    assert contents(s3_server.url_for("cp1", deadline="10s")) == expected  # a check, not a deadline test
    # Running it again copies nothing: everything is already there.
    assert main(["cp", "--from", redis_url, "--to", s3_url, "--json"]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["copied"] == 0 and again["already_there"] == len(keys)


def test_cp_namespace_filter_and_invalid_records(tmp_path, capsys):
    src, dst = f"file://{tmp_path / 'src'}", f"file://{tmp_path / 'dst'}"
    a = fill(src, "model-a", 128)
    b = fill(src, "model-b", 128, seed=1)
    with open_store(src) as store:
        flip_byte(store, a[1], -5)  # payload damage: the checksum fails
        store.put(a[2], bytes(store.get(b[2])))  # a valid record under a key it does not belong to
    ns_a = a[0].split("/")[1]
    assert main(["cp", "--from", src, "--to", dst, "--namespace", ns_a, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["records"] == len(a) and report["invalid"] == 2 and report["copied"] == len(a) - 2
    assert sorted(contents(dst)) == sorted(set(a) - {a[1], a[2]})


def test_cp_killed_half_way_resumes(tmp_path, s3_server_factory):
    """SIGKILL after the first batch: the destination holds a part; the same command copies the
    rest, skipping what is there, and the result equals the source."""
    server = s3_server_factory()
    src = f"file://{tmp_path / 'src'}"
    keys = fill(src, "model-big", 64 * CHUNK, width=4096)  # 64 records of 512 KiB
    dst = server.url_for("resume", deadline="30s")  # about resuming, not deadlines: room for a loaded machine
    env = dict(os.environ, PYTHONPATH=str(ROOT), **server.env)
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "cp", "--from", src, "--to", dst, "--batch", "2",
                             "--progress", "lines"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert first.startswith("cp: "), first + proc.stderr.read()
    partial = contents(dst)
    assert 2 <= len(partial) < len(keys), len(partial)
    resumed = cli("cp", "--from", src, "--to", dst, "--json", env=server.env)
    assert resumed.returncode == 0, resumed.stderr
    report = json.loads(resumed.stdout)
    assert report["already_there"] >= len(partial) - 2  # a batch may have been half written when killed
    assert report["copied"] + report["already_there"] == len(keys)
    assert contents(dst) == contents(src)


def test_cp_receives_into_buffers_it_reuses_and_holds_them_until_the_destination_has_them(tmp_path, redis_server):
    """A batch's values land in one pool's resident buffers, which the next batch reuses (no
    fresh pages per value); they go back to the pool only once the destination's flush says no
    write is pending, and a destination that cannot say so keeps them (the next batch gets a
    new pool)."""
    from kvstore.cli.copy import CopySummary, _Buffers, _copy_batch
    from kvstore.cli.tiers import Tier
    from kvstore.stores.base import WrapperStore

    class Pending(WrapperStore):
        def flush(self, timeout: float = 30.0) -> bool:
            return False

    src_url, dst_url = f"{redis_server.url}/0?prefix=cp-pool:", f"file://{tmp_path / 'dst'}"
    keys = sorted(fill(src_url, "model-pool", 12 * CHUNK, width=4096))  # 12 records of 512 KiB
    src = Tier(0, src_url, open_store(src_url))
    dst = Tier(1, dst_url, open_store(dst_url))
    buffers, summary = _Buffers(), CopySummary(src.name, dst.name)
    _copy_batch(src, dst, keys[:4], summary, buffers)
    pool = buffers.pool
    assert pool is not None
    first = pool.stats()
    _copy_batch(src, dst, keys[4:8], summary, buffers)
    assert buffers.pool is pool
    assert pool.stats()["leased_bytes"] == 0 and pool.stats()["allocations"] == first["allocations"] == 4
    pending = Tier(1, dst_url, Pending(dst.store))
    _copy_batch(src, pending, keys[8:], summary, buffers)
    held = pool.stats()
    assert held["leased_bytes"] == held["held_bytes"] > 0  # still the destination's to send
    assert buffers.pool is None
    assert summary.copied == 12 and summary.invalid == summary.verify_failed == 0
    assert contents(dst_url) == contents(src_url)
    src.store.close()
    dst.store.close()


def test_cp_retries_a_batch_a_frozen_destination_stalled_and_counts_it_once(tmp_path, redis_server_factory):
    """A destination frozen (SIGSTOP) mid-copy costs the batch its deadline; the batch is run
    again after a pause and completes once the server answers, its records counted once. One
    that stays frozen past every retry is a ``StoreUnavailableError`` saying how often it tried."""
    import threading

    from servers import freeze, thaw

    from kvstore.cli.copy import CopySummary, _Buffers, _copy_with_retries
    from kvstore.cli.tiers import Tier
    from kvstore.errors import StoreUnavailableError

    server = redis_server_factory()
    pid = server._proc.proc.pid
    src_url = f"file://{tmp_path / 'src'}"
    dst_url = f"{server.url}/0?prefix=cp-frozen:&timeout=200ms&connect_timeout=200ms"
    keys = sorted(fill(src_url, "model-frozen", 8 * CHUNK))
    src, dst = Tier(0, src_url, open_store(src_url)), Tier(1, dst_url, open_store(dst_url))
    try:
        summary = CopySummary(src.name, dst.name)
        _copy_with_retries(src, dst, keys[:4], summary, _Buffers(), retries=3)
        freeze(pid)
        thawing = threading.Timer(1.0, thaw, (pid,))
        thawing.start()
        try:
            _copy_with_retries(src, dst, keys, summary, _Buffers(), retries=3)
        finally:
            thawing.join()
        assert summary.retried_batches >= 1
        assert (summary.copied, summary.already_there, summary.invalid, summary.verify_failed) == (8, 4, 0, 0)
        assert contents(dst_url) == contents(src_url)
        freeze(pid)
        try:
            with pytest.raises(StoreUnavailableError, match="tried 2 times"):
                _copy_with_retries(src, dst, keys, CopySummary(src.name, dst.name), _Buffers(), retries=1)
        finally:
            thaw(pid)
    finally:
        src.store.close()
        dst.store.close()


def test_cp_unreachable_destination_is_one_line(tmp_path, redis_server):
    from servers import free_port

    src = f"file://{tmp_path / 'src'}"
    fill(src, "model-a", 64)
    dead = f"redis://127.0.0.1:{free_port()}/0?connect_timeout=500ms"
    proc = cli("cp", "--from", src, "--to", dead)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvstore cp: error: destination redis://127.0.0.1:"), proc.stderr
    assert "unreachable" in lines[0] and "Traceback" not in proc.stderr
    bad = cli("cp", "--from", src, "--to", "nosuch://x")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


# -- bench ----------------------------------------------------------------------------------------
def test_bench_redis_with_raw_ceiling_and_cleanup(redis_server, capsys):
    url = f"{redis_server.url}/0?prefix=bench:"
    assert main(["bench", "--store", url, "--sizes", "64KiB,1MiB", "--count", "4", "--reps", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    paths = [(r["size"], r["path"]) for r in doc["rows"]]
    assert paths == [(65536, "kvstore store"), (65536, "raw RESP (zero-copy)"),
                     (1 << 20, "kvstore store"), (1 << 20, "raw RESP (zero-copy)")]
    assert all(r["put_gbps"] > 0 and r["get_gbps"] > 0 for r in doc["rows"])
    assert all(r["put_cpu_s_per_gb"] >= 0 and r["get_cpu_s_per_gb"] >= 0 for r in doc["rows"])  # clock ticks
    assert all(r["lookup_ms"] > 0 for r in doc["rows"] if r["path"] == "kvstore store")
    with redis_server.client() as c:
        assert not list(c.scan_iter("bench:*")) and not list(c.scan_iter("kvstore-bench/*"))
    assert main(["bench", "--store", url, "--sizes", "64KiB", "--count", "2", "--reps", "1"]) == 0
    table = capsys.readouterr().out
    assert "PUT GB/s" in table and "GET CPU s/GB" in table and "raw RESP (zero-copy)" in table


def test_bench_s3_and_unreachable(s3_server, capsys):
    assert main(["bench", "--store", s3_server.url_for("bench"), "--sizes", "256KiB", "--count", "3",
                 "--reps", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in doc["rows"]] == ["kvstore store"]
    assert not list(open_store(s3_server.url_for("bench")).iter_keys())
    from servers import free_port

    proc = cli("bench", "--store", f"redis://127.0.0.1:{free_port()}?connect_timeout=500ms")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "unreachable" in proc.stderr


# -- the raw RESP client --------------------------------------------------------------------------
def test_raw_redis_set_get_pipelines_and_errors(redis_server_factory):
    server = redis_server_factory("--requirepass", "pw")
    with pytest.raises(RawRedisError):
        RawRedis("127.0.0.1", server.port, password="wrong")
    r = RawRedis("127.0.0.1", server.port, password="pw", db=1)
    assert r.ping()
    big = np.arange(3 << 20, dtype=np.uint8)
    r.set("k", b"head:", memoryview(big), big[:10])  # pieces, sent uncopied
    buf = np.empty(4 << 20, dtype=np.uint8)
    n = r.get_into("k", buf)
    assert n == 5 + big.nbytes + 10
    assert bytes(buf[:5]) == b"head:" and np.array_equal(buf[5:5 + big.nbytes], big)
    assert r.get_into("missing", buf) is None
    with pytest.raises(ValueError, match="does not fit"):
        r.get_into("k", bytearray(10))
    assert r.ping()  # still in step after the oversized value
    items = [(f"p{i}", np.full(100_000 + i, i, dtype=np.uint8)) for i in range(20)] + [("small", b"x")]
    r.set_many(items)
    bufs = [bytearray(200_000) for _ in items]
    sizes = r.get_many_into([k for k, _ in items] + [], bufs)
    assert sizes == [len(v) for _, v in items]
    assert all(bytes(b[:n]) == bytes(v) for b, n, (_, v) in zip(bufs, sizes, items))
    for ahead in (1, 3):  # a window of GETs requested ahead: the same values, in order
        bufs = [bytearray(200_000) for _ in items]
        assert r.get_many_into([k for k, _ in items], bufs, ahead=ahead) == sizes
        assert all(bytes(b[:n]) == bytes(v) for b, n, (_, v) in zip(bufs, sizes, items))
    assert r.get_many_into(["p0", "missing", "p1"], [bytearray(200_000) for _ in range(3)], ahead=1) == [
        len(items[0][1]), None, len(items[1][1])]
    seen = bytearray()  # before_send: every byte of every value, in order, just before it goes out
    r.set_many([("big", (b"head:", memoryview(big)))] + items, before_send=seen.extend)
    assert bytes(seen) == b"head:" + big.tobytes() + b"".join(bytes(v) for _, v in items)
    assert r.get_into("big", buf) == 5 + big.nbytes and np.array_equal(buf[5:5 + big.nbytes], big)
    assert r.delete(*[k for k, _ in items], "k", "big") == len(items) + 2
    with server.client(db=1) as c:  # what another client sees in db 1
        assert c.dbsize() == 0
    r.close()


def test_raw_redis_scattered_values_from_and_into_many_buffers(redis_server):
    """The paged ceiling (``bench_transfer``): a value sent from many buffers (more than one
    ``sendmsg`` takes, empty ones among them) and received into many, in order, exactly."""
    rng = np.random.default_rng(3)
    r = RawRedis("127.0.0.1", redis_server.port)
    sizes = [int(n) for n in rng.integers(0, 40_000, 1300)] + [0, 3 << 20, 7]
    pieces = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    items = [("scatter-a", (b"head", *pieces, b"tail")), ("scatter-b", tuple(pieces[:5]))]
    r.set_many(items, scatter=True)
    whole = [b"".join(bytes(p) for p in value) for _, value in items]
    with redis_server.client() as c:
        assert [c.get(k) for k, _ in items] == whole
    # Received into as many buffers, cut elsewhere; the second value right behind the first.
    cuts = [0, *sorted(int(c) for c in rng.integers(0, len(whole[0]), 900)), len(whole[0])]
    into = [memoryview(bytearray(b - a)) for a, b in itertools.pairwise(cuts)]
    second = [memoryview(bytearray(len(whole[1]) - 10)), memoryview(bytearray(10))]
    assert r.get_many_into([k for k, _ in items], [into, second]) == [len(w) for w in whole]
    assert b"".join(into) == whole[0] and b"".join(second) == whole[1]
    with pytest.raises(ValueError, match="exactly"):  # a list of buffers must be filled exactly
        r.get_many_into(["scatter-b"], [[memoryview(bytearray(len(whole[1]) + 1))]])
    assert r.ping()  # still in step
    r.delete(*[k for k, _ in items])
    r.close()


# -- faults a user meets first (issue 23) -------------------------------------------------------------
def _kvstore(*argv: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from kvstore.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(argv))
    return rc, out.getvalue(), err.getvalue()


def test_cp_from_a_missing_store_is_an_error_and_creates_nothing(tmp_path):
    missing, dest = tmp_path / "does-not-exist", tmp_path / "dest"
    rc, out, err = _kvstore("cp", "--from", f"file://{missing}", "--to", f"file://{dest}", "--progress", "none")
    assert rc == 2 and out == "", (out, err)
    assert len(err.strip().splitlines()) == 1 and "no such directory" in err and "unexpected" not in err, err
    assert not missing.exists() and not dest.exists()


@pytest.mark.parametrize("argv", [["stats"], ["ls"], ["inspect", "kvs2/x"], ["gc", "--dry-run"],
                                  ["rm", "--namespace", "0123456789abcdef"]])
def test_read_only_commands_never_create_a_mistyped_file_store(tmp_path, argv):
    typo = tmp_path / "typo" / "kv"
    rc, _, err = _kvstore(argv[0], "--store", f"file://{typo}", *argv[1:])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "no such directory" in err, err
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("argv", [["stats"], ["ls"], ["inspect", "kvs2/x"], ["gc", "--dry-run"],
                                  ["rm", "--namespace", "0123456789abcdef"], ["cp", "--to", "memory://"]])
def test_read_only_commands_never_create_a_mistyped_shm_tier(tmp_path, argv):
    typo = f"shm://typo?root={tmp_path}"
    store = ["--from", typo] if argv[0] == "cp" else ["--store", typo]
    rc, out, err = _kvstore(argv[0], *store, *argv[1:])
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "no shm:// tier of that name" in err and f"{tmp_path}/kvstore-typo" in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_shm_tier_is_read(tmp_path):
    url = f"shm://kept?root={tmp_path}"
    fill(url, "model-shm", 64)
    rc, out, err = _kvstore("stats", "--store", url, "--json")
    assert rc == 0 and json.loads(out)["tiers"][0]["records"] == 2, err


def test_a_file_url_with_a_host_says_it_needs_an_absolute_path(tmp_path):
    rc, _, err = _kvstore("stats", "--store", "file://data/kv")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "reads 'data' as a host name" in err and "file:///absolute/dir" in err, err
    assert f"file://{os.path.abspath('data/kv')}" in err and "no such directory" not in err, err


def _kvstore_exit(*argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``kvstore ARGV``, argparse's own exits included."""
    import contextlib
    import io

    from kvstore.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as exc:
            rc = int(exc.code or 0)
    return rc, err.getvalue()


@pytest.mark.parametrize("flag, value", [("--tokens", "-5"), ("--tokens", "0"), ("--layers", "0"),
                                         ("--tokens", "10000000"), ("--layers", "two")])
def test_selftest_range_checks_its_numbers(tmp_path, flag, value):
    rc, err = _kvstore_exit("selftest", "--store", f"file://{tmp_path / 'kv'}", flag, value)
    assert rc == 2 and f"argument {flag}: " in err and "unexpected" not in err, err
    assert ("out of range" in err or "not an integer" in err) and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "kv").exists()


def _numeric_flags() -> list[tuple[str, str]]:
    from kvstore.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    return [(name, action.option_strings[-1]) for name, p in sub.choices.items() for action in p._actions
            if action.type in (int, float) or getattr(action.type, "__qualname__", "").startswith("number.")]


def test_every_numeric_flag_is_range_checked():
    flags = _numeric_flags()
    assert len(flags) >= 10
    from kvstore.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, flag in flags:
        action = next(a for a in sub.choices[name]._actions if flag in a.option_strings)
        assert getattr(action.type, "__qualname__", "").startswith("number."), f"kvstore {name} {flag}"


@pytest.mark.parametrize("command, flag", _numeric_flags())
def test_a_bad_number_is_one_line_and_exit_2(tmp_path, command, flag):
    required = {"warm": ["prompts.jsonl"], "inspect": ["kvs2/x"], "cp": ["--from", "memory://", "--to", "memory://"],
                "bench": ["--store", "memory://"]}.get(command, [])
    rc, err = _kvstore_exit(command, *required, flag, "-99999999999")
    assert rc == 2 and f"argument {flag}: " in err and "out of range" in err, (command, err)
    assert len(err.strip().splitlines()) == 1 and "unexpected" not in err, err
    assert not re.search(r"\de[+-]\d", err), err  # the range exactly, never 1.04858e+06


def test_a_range_error_gives_the_exact_bounds():
    rc, err = _kvstore_exit("warm", "prompts.jsonl", "--chunk-tokens", "0")
    assert rc == 2 and "give 1 to 1048576 " in err, err
    rc, err = _kvstore_exit("ls", "--limit", "0")
    assert rc == 2 and f"give 1 to {2**62} " in err, err


def test_the_readme_command_table_matches_each_commands_flags():
    """README: every command takes --store but cp (--from/--to), dev-stack and proxy (its servers
    hold the store)."""
    import re
    from pathlib import Path

    from kvstore.cli import build_parser

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    flags = {name: {o for a in p._actions for o in a.option_strings} for name, p in sub.choices.items()}
    assert "All but `cp`, `dev-stack` and `proxy` take `--store URL`" in readme
    assert {n for n, f in flags.items() if "--store" not in f} == {"cp", "dev-stack", "proxy"}
    assert {"--from", "--to"} <= flags["cp"]
    for row in re.findall(r"^\| `kvstore ([a-z-]+)[^|]*\|", readme, re.M):
        assert row in flags, row
    cp_row = next(line for line in readme.splitlines() if line.startswith("| `kvstore cp"))
    assert "--from URL --to URL" in cp_row


def test_selftest_is_quiet_on_success_and_says_what_it_checks(tmp_path):
    """The record it damages on purpose is rejected without a WARNING line (issue 23)."""
    script = Path(sys.executable).parent / "kvstore"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "kvstore.cli"]
    proc = subprocess.run([*cmd, "selftest", "--store", "memory://", "--store", f"file://{tmp_path / 'kv'}"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("selftest: OK"), proc.stdout + proc.stderr
    assert "WARNING" not in proc.stdout + proc.stderr and proc.stderr == "", proc.stderr
    assert "a load must reject it" in proc.stdout and "record removed: True" in proc.stdout
