"""``kvstore stats/ls/inspect/rm/gc``: behaviour on real stores, and clean failures.

Most cases call ``kvstore.cli.main`` in-process (fast); the error cases that promise "one line,
non-zero exit, no traceback" also run the installed ``kvstore`` console script.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from servers import freeze, thaw

from kvstore import open_store
from kvstore.cli import main
from kvstore.cli.clean import HEAD_BYTES
from kvstore.keys import FORMAT_VERSION, Namespace
from kvstore.prefix_cache import ChunkPayload, PrefixCache
from kvstore.record import header_extent
from kvstore.stores.file import FileStore
from kvstore.testing.damage import flip_byte

CHUNK = 32


def _namespace(model: str, chunk: int = CHUNK) -> Namespace:
    return Namespace(model=model, kv_dtype="float16", layout="test", block_size=16, chunk_tokens=chunk, layer_end=2)


def _fill(url: str, model: str, num_tokens: int, *, created: float | None = None, seed: int = 0,
          width: int = 8, chunk: int = CHUNK) -> list[str]:
    """Save a synthetic prompt's KV under ``model``'s namespace (``width`` values per token and
    layer); returns its keys."""
    ns = _namespace(model, chunk)
    tokens = np.random.default_rng(seed).integers(0, 32000, num_tokens)
    with open_store(url) as store:
        cache = PrefixCache(store, ns)
        keys = cache.keys(tokens)

        def payload(c):
            return ChunkPayload(shapes=[(c.num_tokens, width)] * 2, kv=np.ones((2, c.num_tokens, width), np.float16))

        if created is None:
            cache.save(tokens, keys, payload)
        else:  # records written "in the past": encode with an explicit creation time
            from kvstore.record import encode_record

            arr = np.asarray(tokens)
            for c in keys:
                p = payload(c)
                store.put(c.key, encode_record(namespace=ns, chunk=c, tokens=arr[c.start:c.end], dtype="float16",
                                               shapes=p.shapes, kv=p.kv, created=created))
    return [k.key for k in keys]


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return f"file://{tmp_path}/kv"


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_stats_counts_records_and_bytes_per_namespace(store_url, capsys):
    a = _fill(store_url, "model-a", 100)  # 4 chunks (3 full + 1 partial)
    b = _fill(store_url, "model-b", 64, seed=1)  # 2 chunks
    with open_store(store_url) as s:
        s.put("someone/else", b"xyz")
        sizes_a = sum(s.size_many(a))
    rc, out, _ = run_cli(capsys, "stats", "--store", store_url, "--json")
    assert rc == 0
    doc = json.loads(out)
    (tier,) = doc["tiers"]
    by_ns = {n["namespace"]: n for n in tier["namespaces"]}
    assert by_ns[_namespace("model-a").id]["records"] == len(a) == 4
    assert by_ns[_namespace("model-a").id]["bytes"] == sizes_a
    assert by_ns[_namespace("model-b").id]["records"] == len(b) == 2
    assert tier["records"] == 6 and tier["other_keys"] == {"records": 1, "bytes": 3}
    rc, out, _ = run_cli(capsys, "stats", "--store", store_url)
    assert rc == 0 and _namespace("model-a").id in out and "(total)" in out and "RECORDS" in out


def test_stats_per_tier(tmp_path, capsys):
    top, bottom = f"file://{tmp_path}/top", f"file://{tmp_path}/bottom"
    _fill(top, "m", 64)
    _fill(bottom, "m", 128)
    rc, out, _ = run_cli(capsys, "stats", "--store", top, "--store", bottom, "--json")
    tiers = json.loads(out)["tiers"]
    assert [t["tier"] for t in tiers] == [top, bottom]
    assert [t["records"] for t in tiers] == [2, 4]


def test_store_from_environment(store_url, capsys, monkeypatch):
    _fill(store_url, "m", 64)
    monkeypatch.setenv("KVSTORE_STORE", store_url)
    rc, out, _ = run_cli(capsys, "ls")
    assert rc == 0 and len(out.split()) == 2


@pytest.mark.parametrize("value, urls", [
    ("memory://, file:///tmp/kv", ["memory://", "file:///tmp/kv"]),
    ("memory://  redis+cluster://:pw@h1:7000,h2:7001,h3:7002/?ttl=1h",
     ["memory://", "redis+cluster://:pw@h1:7000,h2:7001,h3:7002/?ttl=1h"]),
    ("redis+cluster://h1:7000,h2:7001,s3://bucket/p", ["redis+cluster://h1:7000,h2:7001", "s3://bucket/p"]),
])
def test_store_environment_keeps_cluster_node_lists_whole(monkeypatch, value, urls):
    from kvstore.cli import default_store_urls

    monkeypatch.setenv("KVSTORE_STORE", value)
    assert default_store_urls() == urls


def test_ls_lists_keys_of_a_namespace(store_url, capsys):
    a = _fill(store_url, "model-a", 100)
    _fill(store_url, "model-b", 64, seed=1)
    rc, out, _ = run_cli(capsys, "ls", "--store", store_url, "--namespace", _namespace("model-a").id)
    assert rc == 0 and sorted(out.split()) == sorted(a)
    rc, out, _ = run_cli(capsys, "ls", "--store", store_url, "--json", "--long")
    keys = json.loads(out)["keys"]
    assert len(keys) == 6 and all(k["bytes"] > 0 for k in keys)
    rc, out, err = run_cli(capsys, "ls", "--store", store_url, "--limit", "3")
    assert len(out.split()) == 3 and "--limit" in err


def test_inspect_shows_header(store_url, capsys):
    keys = _fill(store_url, "model-a", 100)
    rc, out, _ = run_cli(capsys, "inspect", "--store", store_url, keys[1], "--json")
    assert rc == 0
    doc = json.loads(out)
    h = doc["header"]
    assert h["version"] == FORMAT_VERSION and h["start"] == CHUNK and h["num_tokens"] == CHUNK
    assert h["namespace"] == _namespace("model-a").digest.hex()
    assert len(h["tokens"]) == CHUNK and h["dtype"] == "float16" and h["shapes"] == [[CHUNK, 8]] * 2
    assert doc["tiers"][0]["valid"] is True
    rc, out, _ = run_cli(capsys, "inspect", "--store", store_url, keys[-1])
    assert rc == 0 and "partial chunk" in out and "valid" in out and "created:" in out


def test_inspect_reports_damaged_and_missing_records(store_url, capsys):
    keys = _fill(store_url, "model-a", 64)
    with open_store(store_url) as s:
        flip_byte(s, keys[0])
    rc, out, _ = run_cli(capsys, "inspect", "--store", store_url, keys[0])
    assert rc == 1 and "INVALID" in out and "checksum" in out
    rc, out, err = run_cli(capsys, "inspect", "--store", store_url, f"kvs{FORMAT_VERSION}/0000000000000000/" + "0" * 32)
    assert rc == 1 and "not stored in any tier" in err


def test_rm_namespace_needs_yes(tmp_path, capsys):
    top, bottom = f"file://{tmp_path}/top", f"file://{tmp_path}/bottom"
    a = _fill(top, "model-a", 100) and _fill(bottom, "model-a", 100)
    b = _fill(bottom, "model-b", 64, seed=1)
    ns = _namespace("model-a").id
    rc, out, err = run_cli(capsys, "rm", "--store", top, "--store", bottom, "--namespace", ns)
    assert rc == 1 and "would remove 4 records" in out and "--yes" in err
    with open_store(bottom) as s:
        assert all(s.exists(k) for k in a)
    rc, out, _ = run_cli(capsys, "rm", "--store", top, "--store", bottom, "--namespace", f"kvs{FORMAT_VERSION}/{ns}", "--yes", "--json")
    assert rc == 0 and [t["removed"] for t in json.loads(out)["tiers"]] == [4, 4]
    for url in (top, bottom):
        with open_store(url) as s:
            assert not any(s.exists(k) for k in a)
    with open_store(bottom) as s:
        assert all(s.exists(k) for k in b)  # another namespace is untouched


def test_rm_single_keys(store_url, capsys):
    keys = _fill(store_url, "m", 100)
    rc, out, _ = run_cli(capsys, "rm", "--store", store_url, keys[-1], "--yes")
    assert rc == 0 and "removed 1 records" in out
    with open_store(store_url) as s:
        assert [s.exists(k) for k in keys] == [True, True, True, False]


@pytest.mark.parametrize("yes", [[], ["--yes"]])
def test_rm_refuses_keys_that_are_not_kvstore_records(store_url, capsys, yes):
    keys = _fill(store_url, "m", 100)
    with open_store(store_url) as s:
        s.put("someone/else", b"theirs")
    rc, out, err = run_cli(capsys, "rm", "--store", store_url, keys[0], "someone/else", *yes)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "'someone/else' is not a kvstore record key" in err and "never removed" in err
    with open_store(store_url) as s:
        assert s.exists("someone/else") and s.exists(keys[0])  # nothing removed, not even the good key


def test_gc_removes_expired_old_format_and_undecodable(store_url, capsys):
    old = _fill(store_url, "old", 64, created=time.time() - 10 * 86400)
    fresh = _fill(store_url, "fresh", 64, seed=2)
    junk = f"kvs{FORMAT_VERSION}/{'ab' * 8}/{'cd' * 16}"
    old_format = f"kvs{FORMAT_VERSION - 1}/{'ab' * 8}/{'cd' * 16}"
    newer_format = f"kvs{FORMAT_VERSION + 1}/{'ab' * 8}/{'cd' * 16}"
    with open_store(store_url) as s:
        s.put(junk, b"definitely not a kvstore record")
        s.put(old_format, b"written by an old build")
        s.put(newer_format, b"written by a newer build")
        s.put("unrelated", b"not ours")
        # A valid record stored under another key: must not be served under the wrong name.
        moved = f"kvs{FORMAT_VERSION}/{fresh[0].split('/')[1]}/{'ee' * 16}"
        s.put(moved, s.get(fresh[0]))
        # ... or under its own key, named as another head range's record.
        s.put(fresh[0] + "/h0-1of2", s.get(fresh[0]))
    rc, out, _ = run_cli(capsys, "gc", "--store", store_url, "--older-than", "7d", "--dry-run", "--json")
    (t,) = json.loads(out)["tiers"]
    assert t["removed"] == {"expired": 2, "undecodable:foreign": 1, "old-version": 1, "mismatch": 2}
    assert t["kept"] == 2 and t["newer_version"] == 1
    with open_store(store_url) as s:
        assert s.exists(junk) and all(s.exists(k) for k in old)  # dry run removes nothing
    rc, out, _ = run_cli(capsys, "gc", "--store", store_url, "--older-than", "7d", "--batch", "2")
    assert rc == 0 and "removed 6" in out
    with open_store(store_url) as s:
        left = set(s.iter_keys())
    assert left == set(fresh) | {newer_format, "unrelated"}


def test_gc_verify_finds_damaged_payloads(store_url, capsys):
    keys = _fill(store_url, "m", 64)
    with open_store(store_url) as s:
        flip_byte(s, keys[1])
    rc, out, _ = run_cli(capsys, "gc", "--store", store_url, "--json")
    assert json.loads(out)["tiers"][0]["removed"] == {}  # headers alone look fine
    rc, out, _ = run_cli(capsys, "gc", "--store", store_url, "--verify", "--json")
    assert json.loads(out)["tiers"][0]["removed"] == {"undecodable:checksum": 1}


def test_gc_judges_records_by_their_headers_and_verify_reads_them_whole(redis_server_factory, capsys):
    server = redis_server_factory()  # its own: the test resets and reads the server's counters
    url = f"{server.url}/0"
    keys = _fill(url, "big", 4 * CHUNK, width=8192)  # 1 MiB records: the payloads dwarf the headers
    record_bytes = 2 * CHUNK * 8192 * 2
    with server.client() as c, open_store(url) as s:
        c.config_resetstat()
        rc, out, _ = run_cli(capsys, "gc", "--store", url, "--json")
        stats, sent = c.info("commandstats"), c.info("stats")["total_net_output_bytes"]
        assert rc == 0 and json.loads(out)["tiers"][0]["kept"] == len(keys)
        assert "cmdstat_get" not in stats and stats["cmdstat_getrange"]["calls"] == len(keys)
        assert sent < len(keys) * (HEAD_BYTES + 4096) < len(keys) * record_bytes  # first bytes, not payloads
        flip_byte(s, keys[2])
        c.config_resetstat()
        rc, out, _ = run_cli(capsys, "gc", "--store", url, "--verify", "--json")
        stats, sent = c.info("commandstats"), c.info("stats")["total_net_output_bytes"]
        assert json.loads(out)["tiers"][0]["removed"] == {"undecodable:checksum": 1}
        assert stats["cmdstat_get"]["calls"] == len(keys) and sent > len(keys) * record_bytes
        assert [s.exists(k) for k in keys] == [True, True, False, True]


def test_gc_on_a_frozen_redis_ends_in_one_line_within_its_deadline(redis_server_factory, capsys):
    server = redis_server_factory()
    url = f"{server.url}/0?timeout=300ms&connect_timeout=300ms"
    _fill(url, "m", 64)
    pid = server._proc.proc.pid
    freeze(pid)  # the socket accepts, nothing answers
    try:
        start = time.monotonic()
        rc, _, err = run_cli(capsys, "gc", "--store", url)
        elapsed = time.monotonic() - start
    finally:
        thaw(pid)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert elapsed < 3, elapsed


def test_gc_reads_a_header_longer_than_its_first_read_without_reading_payloads(store_url, capsys, monkeypatch):
    tokens = HEAD_BYTES // 4 + 1024  # the header's token ids alone outgrow the first read
    keys = _fill(store_url, "long", tokens, chunk=-(-tokens // 16) * 16)
    with open_store(store_url) as s:
        (size, head), = s.get_heads(keys, HEAD_BYTES)
        assert header_extent(head) > HEAD_BYTES and size > HEAD_BYTES

    def no_whole_reads(self, keys):
        raise AssertionError("gc read whole records without --verify")

    monkeypatch.setattr(FileStore, "get_many", no_whole_reads)
    rc, out, _ = run_cli(capsys, "gc", "--store", store_url, "--json")
    (t,) = json.loads(out)["tiers"]
    assert rc == 0 and t["kept"] == 1 and t["removed"] == {}


def test_gc_reads_a_record_whole_before_removing_it_on_its_header_alone(store_url, capsys, monkeypatch):
    """A record replaced between its size and its first bytes reads as truncated: gc confirms
    that on the whole record, which is fine, and keeps it."""
    keys = _fill(store_url, "m", 64)
    heads = FileStore.get_heads
    monkeypatch.setattr(FileStore, "get_heads", lambda self, ks, n: [
        None if h is None else (h[0] + 8, h[1]) for h in heads(self, ks, n)])
    rc, out, _ = run_cli(capsys, "gc", "--store", store_url, "--json")
    (t,) = json.loads(out)["tiers"]
    assert rc == 0 and t["kept"] == len(keys) and t["removed"] == {}
    with open_store(store_url) as s:
        assert all(s.exists(k) for k in keys)


@pytest.mark.parametrize("argv, message", [
    (["stats", "--store", "bogus://x"], "unknown store scheme"),
    (["stats", "--store", "no-scheme-here"], "has no scheme"),
    (["stats", "--store", "memory://?max_bytes=lots"], "max_bytes"),
    (["ls", "--store", "memory://", "--namespace", "xyz"], "not a namespace id"),
    (["gc", "--store", "memory://", "--older-than", "soon"], "--older-than"),
    (["rm", "--store", "memory://"], "needs --namespace"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def _console_script() -> list[str]:
    script = shutil.which("kvstore", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    return [script] if script else [sys.executable, "-m", "kvstore.cli"]


@pytest.mark.parametrize("argv, message", [
    (["stats", "--store", "redis://127.0.0.1:1/0?connect_timeout=0.5s"], "127.0.0.1:1"),
    (["gc", "--store", "redis://127.0.0.1:1/0?connect_timeout=0.5s"], "127.0.0.1:1"),
    (["ls", "--store", "redis://host:notaport/0"], "port"),
    (["inspect", "--store", "bogus://x", "kvs1/x/y"], "unknown store scheme"),
])
def test_console_script_fails_cleanly(argv, message):
    proc = subprocess.run(_console_script() + argv, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr
    assert lines[0].startswith(f"kvstore {argv[0]}: error:")


def test_commands_against_redis(redis_server, capsys):
    url = redis_server.url
    keys = _fill(url, "model-r", 100)
    rc, out, _ = run_cli(capsys, "stats", "--store", url, "--json")
    (tier,) = json.loads(out)["tiers"]
    assert {n["namespace"]: n["records"] for n in tier["namespaces"]}[_namespace("model-r").id] == 4
    rc, out, _ = run_cli(capsys, "inspect", "--store", url, keys[0], "--json")
    assert rc == 0 and json.loads(out)["header"]["start"] == 0
    rc, out, _ = run_cli(capsys, "rm", "--store", url, "--namespace", _namespace("model-r").id, "--yes")
    assert rc == 0
    with open_store(url) as s:
        assert not any(s.exists(k) for k in keys)


def test_the_command_runs_on_a_core_install_without_redis_or_boto3(tmp_path):
    """`make demo` installs no extra: every subcommand must register (and a file store work)
    with redis-py and boto3 absent; a store that needs them says which extra to install."""
    import subprocess
    import sys

    code = ("import sys; sys.modules.update(redis=None, boto3=None, botocore=None)\n"
            "from kvstore.cli import main\n"
            f"sys.exit(main(['selftest', '--tokens', '300', '--layers', '2', '--store', 'file://{tmp_path / 'kv'}']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "selftest: OK" in proc.stdout, proc.stdout + proc.stderr


def test_a_missing_client_gets_an_install_hint_that_works(tmp_path):
    """The distribution is on no package index: the hint names the client package as setup.cfg's
    extra lists it, and the checkout's extra."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    (requirement,) = cfg["options.extras_require"]["redis"].split()
    code = ("import sys; sys.modules.update(redis=None)\n"
            "from kvstore.cli import main\n"
            "sys.exit(main(['stats', '--store', 'redis://127.0.0.1:1/0']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    from packaging.requirements import Requirement

    hinted = proc.stderr.split("pip install '", 1)[1].split("'", 1)[0]
    assert Requirement(hinted).name == "redis" and Requirement(hinted).specifier == Requirement(requirement).specifier
    assert "(or pip install '.[redis]' in a kvstore checkout)" in proc.stderr, proc.stderr


def test_no_hint_names_the_distribution_with_an_extra():
    """``pip install 'kvstore-llm[redis]'`` finds nothing on any index."""
    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *root.glob("docs/*.md"), *root.glob("kvstore/**/*.py"), *root.glob("docker/*")]
    offenders = [str(f.relative_to(root)) for f in files if f.is_file() and "kvstore-llm[" in f.read_text()]
    assert not offenders


@pytest.mark.parametrize("argv", [["ls"], ["inspect", "KEY"], ["selftest", "--tokens", "300", "--layers", "2"]])
def test_output_into_a_pipe_its_reader_closed_ends_quietly(store_url, argv):
    """``kvstore ls | head``: the reader leaves, the command stops without a word, with the
    status a shell reports for a Unix tool stopped by SIGPIPE."""
    keys = _fill(store_url, "model-pipe", 100)
    argv = [keys[0] if a == "KEY" else a for a in argv]
    proc = subprocess.Popen(_console_script() + [*argv, "--store", store_url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read()
    assert proc.wait(120) == 141 and err == "", err


def test_a_broken_pipe_that_is_not_the_output_is_still_reported(monkeypatch, capsys):
    """A BrokenPipeError from elsewhere (a socket) is an unexpected error, not a quiet exit."""
    import kvstore.cli.browse as browse

    def broken(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(browse, "open_tiers", broken)
    rc, _, err = run_cli(capsys, "stats", "--store", "memory://")
    assert rc == 1 and "unexpected error: BrokenPipeError" in err


@pytest.mark.parametrize("where", ["before", "after"])
def test_verbose_before_or_after_the_subcommand_shows_the_traceback(where):
    flag = ["--verbose"]
    argv = [*flag, "stats", "--store", "memory://"] if where == "before" else ["stats", "--store", "memory://", *flag]
    code = ("import sys, kvstore.cli.browse as browse\n"
            "def boom(args): raise RuntimeError('a bug')\n"
            "browse.open_tiers = boom\n"
            "from kvstore.cli import main\n"
            f"sys.exit(main({argv!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "RuntimeError: a bug" in proc.stderr, proc.stderr
    assert "run with --verbose" not in proc.stderr


def test_verbose_is_off_unless_given():
    from kvstore.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["ls"]).verbose is False
    assert parser.parse_args(["-v", "ls"]).verbose is True and parser.parse_args(["ls", "-v"]).verbose is True


@pytest.mark.parametrize("command", [["kvstore"], [sys.executable, "-m", "kvstore"]])
def test_version_and_python_dash_m(command):
    from kvstore import FORMAT_VERSION, __version__

    if command == ["kvstore"]:
        command = _console_script()
    proc = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"kvstore {__version__} (record format {FORMAT_VERSION})\n"
    proc = subprocess.run([*command, "stats", "--store", "memory://", "--json"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and json.loads(proc.stdout)["tiers"][0]["records"] == 0, proc.stderr


def test_install_hints_read_the_extra_from_each_requirements_marker():
    from kvstore.extras import install_hint, requirements

    requires = ['redis[hiredis]<9,>=5.0; extra == "redis"', 'boto3>=1.34; extra == "s3"',
                'mooncake-transfer-engine-non-cuda>=0.3.13; (platform_system == "Linux" and '
                'python_version >= "3.11") and extra == "mooncake"', 'redis[hiredis]<9,>=5.0; extra == "all"']
    assert requirements("redis", requires) == ["redis[hiredis]<9,>=5.0"]
    assert requirements("mooncake", requires) == ["mooncake-transfer-engine-non-cuda>=0.3.13"]
    assert requirements("nothing", requires) == []
    assert install_hint("no-such-extra") == "pip install '.[no-such-extra]' in a kvstore checkout"
