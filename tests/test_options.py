"""Options and URLs from a careless or hostile operator: every value range-checked at start-up,
``open_store`` raises nothing but ``ConfigError`` for a bad URL (fuzzed), and the CLI answers one
line and a non-zero exit, never a traceback or a hang."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore import ConfigError, open_store
from kvstore.cli import main
from kvstore.config import MAX_SIZE, format_number, format_size, parse_duration, parse_size
from kvstore.connectors.agent import AgentConfig
from kvstore.stores.base import Store
from kvstore.stores.redis import RedisConfig
from kvstore.stores.tiered import TieredConfig, TieredStore
from kvstore.stores.tiered.config import QUEUE_MEMORY_FRACTION, available_memory


@pytest.mark.parametrize("url, names", [
    # ports: range, sign, width, digits of other scripts, wrap-around (P + 65536 wrote to port P)
    ("redis://127.0.0.1:99999", "99999"), ("redis://127.0.0.1:-1", "-1"), ("redis://127.0.0.1:0", "'0'"),
    ("redis://127.0.0.1:\uff16\uff13\uff17\uff19", "port"), (f"redis://127.0.0.1:{6379 + 65536}", "71915"),
    ("redis+cluster://127.0.0.1:7000,127.0.0.1:70000", "70000"), ("redis://127.0.0.1:", "empty port"),
    ("redis://[::1", "IPv6"), ("redis://[::1]x", "IPv6"), ("redis://ho st", "host"),
    # databases, durations, sizes, retries
    ("redis://127.0.0.1/-1", "database"), ("redis://127.0.0.1?db=-1", "db=-1"), ("redis://h?db=\u0661", "db"),
    ("redis://h?timeout=1e400", "timeout"), ("redis://h?timeout=nan", "timeout"), ("redis://h?timeout=0", "timeout"),
    ("redis://h?connect_timeout=1h", "connect_timeout"), ("redis://h?write_timeout=-1", "write_timeout"),
    ("redis://h?ttl=1e300", "ttl"), ("redis://h?ttl=100us", "ttl"), ("redis://h?retries=1000000", "retries"),
    ("redis://h?retries=1.5", "retries"), ("redis://h?max_connections=0", "max_connections"),
    ("memory://?max_bytes=1e400", "max_bytes"), ("memory://?max_bytes=2PiB", "max_bytes"),
    ("memory://?max_bytes=1e30", "max_bytes"), ("file:///tmp/kvstore-x?max_bytes=inf", "max_bytes"),
    ("file:///tmp/kvstore-x%00y", "holds the control character"),
    ("s3://b/p?timeout=0", "timeout"), ("s3://b/p?deadline=1e999", "deadline"), ("s3://b/p?retries=11", "retries"),
    ("s3://b/p?max_workers=100000", "max_workers"), ("s3://b/p?endpoint_url=http://h:99999", "endpoint_url"),
    ("s3://b/p?endpoint_url=http://[::1", "endpoint_url"), ("s3://b%20c/p", "bucket"),
    # control characters: urlsplit drops CR, LF and tab silently
    ("redis://127.0.0.1?prefix=\r\nFLUSHALL", "control character"),
    ("redis://127.0.0.1?prefix=%0D%0AFLUSHALL", "control character"), ("redis://127.0.0.1\t:6379", "control"),
    ("\x85redis://127.0.0.1", "control"), ("s3://b/p?region=eu\x00", "control"),
])
def test_bad_urls_are_config_errors_naming_the_value(url, names):
    with pytest.raises(ConfigError) as err:
        open_store(url)
    assert names in str(err.value), str(err.value)


def test_good_edge_values_are_accepted():
    for url in ("redis://127.0.0.1:1", "redis://127.0.0.1:65535/2147483647", "redis://[::1]:6379/0?ttl=1ms",
                "redis://h?retries=10&timeout=300s", "memory://?max_bytes=0", f"memory://?max_bytes={MAX_SIZE}",
                "s3://b/p?endpoint_url=http://127.0.0.1:9000&deadline=300"):
        open_store(url).close()
    assert RedisConfig.from_url("redis://u:p@h:6380/3").hosts == (("h", 6380),)


def test_numbers_are_ascii_finite_and_never_truncated():
    assert parse_size("1e3") == 1000 and parse_size(str(MAX_SIZE)) == MAX_SIZE
    for bad in ("1e400", "nan", "-1", "\uff11GiB", True):
        with pytest.raises(ConfigError):
            parse_size(bad)  # type: ignore[arg-type]
    for bad in ("inf", "1e400", "11y", float("nan"), 1e12):
        with pytest.raises(ConfigError):
            parse_duration(bad)
    with pytest.raises(ConfigError, match="whole number"):
        TieredStore.from_urls(["memory://"], queue_items=2.5)
    with pytest.raises(ConfigError, match="out of range"):
        AgentConfig.from_mapping(dict(store="memory://", model="m", model_fingerprint="f", auth_previous_window="31d"))


def test_write_queue_bytes_scale_with_memory():
    memory = available_memory()
    assert TieredConfig().queue_bytes == memory // QUEUE_MEMORY_FRACTION
    assert TieredConfig(queue_bytes=1 << 20).queue_bytes == 1 << 20
    with pytest.raises(ConfigError, match="queue_bytes"):
        TieredConfig(queue_bytes=memory + 1)
    for name, value in (("breaker_cooldown", 0.0), ("close_timeout", 1e9), ("batch_bytes", 0),
                        ("queue_items", 10**7), ("breaker_failures", 0)):
        with pytest.raises(ConfigError, match=name):
            TieredConfig(**{name: value})


# -- fuzz: many malformed URLs, only ConfigError ---------------------------------------------------
_SEEDS = [
    "redis://user:pw@127.0.0.1:6379/0?ttl=1h&prefix=app/&timeout=250ms",
    "rediss://127.0.0.1:6380/1?ca_certs=/etc/ssl/ca.pem&tls_verify=false",
    "unix:///tmp/kvstore-fuzz.sock?db=2",
    "redis+cluster://127.0.0.1:7000,127.0.0.1:7001?max_connections=4",
    "[::1]", "memory://?max_bytes=8GiB",
    "s3://bucket/prefix?endpoint_url=http://127.0.0.1:9000&region=us-east-1&max_workers=4&deadline=2s",
    "FILE?max_bytes=1GiB&low_water=0.5",
]
_JUNK = ["\r", "\n", "\t", "\x00", "\x7f", "\x85", "\u2028", "\uff11", "\u0661", "%", "%0A", "%00", "%zz", "[", "]",
         "@", ":", "/", "?", "&", "=", "#", ",", " ", "-1", "1e400", "nan", "inf", "99999", "65536", "0", "+", "_",
         "é", "😀", "..", "\\"]
_VALUES = ["", "-1", "0", "1e400", "-0", "nan", "inf", "1e-400", "1_000", "\uff11", "0x10", "99999999999999999999",
           "1.5", "true", "2PiB", "1e30", "3h", "-3s", "\r\n", "%0d%0a", "a" * 2000]
_PARAMS = ["ttl", "timeout", "connect_timeout", "write_timeout", "retries", "db", "max_connections", "max_bytes",
           "low_water", "max_workers", "deadline", "endpoint_url", "prefix", "tls_verify", "bogus"]


def _mutate(rng: random.Random, url: str) -> str:
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(6)
        pos = rng.randint(0, len(url))
        if op == 0:
            url = url[:pos] + rng.choice(_JUNK) + url[pos:]
        elif op == 1 and url:
            url = url[:pos] + url[pos + rng.randint(1, 8):]
        elif op == 2:
            url += ("&" if "?" in url else "?") + f"{rng.choice(_PARAMS)}={rng.choice(_VALUES)}"
        elif op == 3:
            url = url.replace(":6379", ":" + rng.choice(["", "-1", "0", "65536", "99999", "\uff16", "6379" * 3, "1e3"]))
        elif op == 4:
            url = url[:pos]  # truncated
        else:
            url = url.replace("127.0.0.1", rng.choice(["", "[::1", "::1", "h st", "%41", "a" * 300, "[::1]"]))
    return url


def test_open_store_raises_only_config_errors_for_malformed_urls(tmp_path):
    rng = random.Random(11)
    accepted = rejected = 0
    for _ in range(3000):
        # An accepted s3:// URL costs ~0.25 s (boto3 loads its service models per session): fewer of them.
        seed = rng.choice([s for s in _SEEDS if not s.startswith("s3") or rng.random() < 0.15])
        if seed == "FILE?max_bytes=1GiB&low_water=0.5":  # never let a mutation create directories elsewhere
            url = f"file://{tmp_path}/f?" + _mutate(rng, "max_bytes=1GiB&low_water=0.5")
        elif seed == "[::1]":
            url = _mutate(rng, "redis://[::1]:6379/0")
        else:
            url = _mutate(rng, seed)
        try:
            store = open_store(url)
        except ConfigError:
            rejected += 1
            continue
        except Exception as exc:  # the bug this guards against
            pytest.fail(f"open_store({url!r}) raised {type(exc).__name__}: {exc}")
        assert isinstance(store, Store)
        if any(ch in url for ch in "\r\n\t\x00\x7f\x85"):
            pytest.fail(f"open_store({url!r}) accepted a control character")
        store.close()
        accepted += 1
    assert rejected > 1000 and accepted > 100, (accepted, rejected)  # the mutations mean something


# -- the CLI: one line, non-zero, no traceback, no hang ---------------------------------------------
@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:99999", "redis://[::1", "memory://?max_bytes=1e400", "redis://h?timeout=1e400",
    "file:///tmp/kvstore-x%00y", "redis://127.0.0.1?prefix=%0D%0AFLUSHALL", "s3://b/p?retries=1000000",
    "redis://127.0.0.1:1?retries=10",  # refused: fast, even with every retry
])
def test_cli_bad_url_is_one_line_and_non_zero(capsys, url):
    for command in ("stats", "ls", "gc"):
        rc = main([command, "--store", url])
        out, err = capsys.readouterr()
        assert rc == 2, (command, url, err)
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_cli_unexpected_error_is_one_line_too(capsys, monkeypatch):
    from kvstore.cli import browse

    def boom(args):
        raise RuntimeError("a bug\nover two lines")

    monkeypatch.setattr(browse, "cmd_stats", boom)  # register() looks it up when main() builds the parser
    rc = main(["stats", "--store", "memory://"])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip() == ("kvstore stats: unexpected error: RuntimeError: a bug over two lines "
                                       "(run with --verbose for the traceback)")


@pytest.mark.parametrize("url", ["redis://127.0.0.1:70000/0", "memory://?max_bytes=1e400",
                                 "redis://127.0.0.1?prefix=\r\nFLUSHALL"])
def test_console_script_bad_url_no_traceback_no_hang(url):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--store", url], capture_output=True,
                          text=True, timeout=60, env=env, stdin=subprocess.DEVNULL)  # the hang guard
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("value, number, size", [
    (1048576, "1048576", "1 MiB"), (1048576.0, "1048576", "1 MiB"), (1 << 44, str(1 << 44), "16 TiB"),
    (1000000, "1000000", "1000000 bytes"), (1, "1", "1 byte"), (0, "0", "0 bytes"), (0.001, "0.001", "0.001 bytes"),
    (315360000.0, "315360000", "315360000 bytes"), (2**62, str(2**62), "4096 PiB"),
])
def test_numbers_in_messages_are_exact(value, number, size):
    """Never ``1.04858e+06``: a whole number in full, a size in its largest whole binary unit."""
    assert format_number(value) == number and format_size(value) == size
