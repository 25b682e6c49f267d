"""A Redis password from the environment or a file, never in the URL: used against a real
redis-server started with ``--requirepass``, and never shown (repr, describe(), ``kvstore
stats``, logs, errors). A missing variable or unreadable file is a ``ConfigError`` naming the
option, not the secret."""

from __future__ import annotations

import json
import logging

import pytest

from kvstore.cli import main
from kvstore.config import safe_repr
from kvstore.errors import ConfigError, StoreUnavailableError
from kvstore.stores import open_store
from kvstore.stores.redis import RedisConfig
from kvstore.stores.redis.sharded import shards_config

SECRET = "pw-7f3a-not-in-any-log"


@pytest.fixture(scope="module")
def server(redis_server_factory):
    return redis_server_factory("--requirepass", SECRET)


def _shown(store) -> list[str]:
    return [repr(store), str(store.describe()), repr(store.config), safe_repr(store.config),
            store.config.safe_url()]


def test_password_from_the_environment(server, monkeypatch):
    monkeypatch.setenv("KV_REDIS_PW", SECRET)
    with open_store(f"redis://127.0.0.1:{server.port}/0?password_env=KV_REDIS_PW") as store:
        store.put("k", b"v")
        assert store.get("k") == b"v"
        assert store.describe()["url"] == f"redis://:***@127.0.0.1:{server.port}/0"
        for text in _shown(store):
            assert SECRET not in text


def test_password_from_a_file(server, tmp_path):
    path = tmp_path / "redis.password"
    path.write_text(SECRET + "\n")  # as `echo pw > file` writes it
    path.chmod(0o600)
    with open_store(f"redis://127.0.0.1:{server.port}?password_file={path}") as store:
        store.put("k", b"w")
        assert store.get("k") == b"w"
        for text in _shown(store):
            assert SECRET not in text


def test_a_tiered_store_and_kvstore_stats_show_no_secret(server, monkeypatch, capsys):
    monkeypatch.setenv("KV_REDIS_PW", SECRET)
    url = f"redis://127.0.0.1:{server.port}/0?password_env=KV_REDIS_PW"
    with open_store(["memory://", url]) as tiered:
        tiered.put("k", b"v")
        assert SECRET not in repr(tiered) and SECRET not in json.dumps(tiered.describe(), default=str)
    for flags in ((), ("--json",)):
        assert main(["stats", "--store", url, *flags]) == 0
        out, err = capsys.readouterr()
        assert out and SECRET not in out + err


def test_a_wrong_password_is_an_outage_that_names_no_secret(server, monkeypatch, caplog):
    monkeypatch.setenv("KV_REDIS_PW", "wrong-" + SECRET)
    caplog.set_level(logging.DEBUG)
    with open_store(f"redis://127.0.0.1:{server.port}?password_env=KV_REDIS_PW") as store:
        with pytest.raises(StoreUnavailableError) as info:
            store.get("k")
    assert SECRET not in str(info.value) and SECRET not in caplog.text
    with open_store(["memory://", f"redis://127.0.0.1:{server.port}?password_env=KV_REDIS_PW"]) as tiered:
        assert tiered.get("k") is None  # the tier's outage is a miss, and its log shows no secret
    assert SECRET not in caplog.text


def test_a_missing_variable_is_a_config_error_naming_the_option(monkeypatch):
    monkeypatch.delenv("KV_NOT_SET", raising=False)
    with pytest.raises(ConfigError) as info:
        open_store("redis://127.0.0.1:1?password_env=KV_NOT_SET")
    assert "password_env=KV_NOT_SET" in str(info.value)


@pytest.mark.parametrize("make, fragment", [
    (lambda d: d / "absent", "cannot read it"),
    (lambda d: d, "cannot read it"),  # a directory
    (lambda d: (d / "empty").write_text("\n") and d / "empty", "empty"),
    (lambda d: (d / "big").write_text("x" * 5000) and d / "big", "larger than"),
])
def test_an_unusable_file_is_a_config_error_naming_the_option(tmp_path, make, fragment):
    path = make(tmp_path)
    with pytest.raises(ConfigError) as info:
        open_store(f"redis://127.0.0.1:1?password_file={path}")
    assert f"password_file={path}" in str(info.value) and fragment in str(info.value)


def test_a_secret_with_a_control_character_is_refused_without_showing_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KV_REDIS_PW", SECRET + "\r")
    with pytest.raises(ConfigError) as info:
        open_store("redis://127.0.0.1:1?password_env=KV_REDIS_PW")
    assert "control character" in str(info.value) and SECRET not in str(info.value)
    (tmp_path / "pw").write_text(SECRET + "\r\n")  # a file written on Windows: its line end is dropped
    assert RedisConfig.from_url(f"redis://h?password_file={tmp_path / 'pw'}").password == SECRET


def test_one_source_of_the_password(monkeypatch, tmp_path):
    monkeypatch.setenv("KV_REDIS_PW", SECRET)
    with pytest.raises(ConfigError) as info:
        open_store("redis://:in-url-pw@127.0.0.1:1?password_env=KV_REDIS_PW")
    assert "password_env" in str(info.value) and "in-url-pw" not in str(info.value)
    with pytest.raises(ConfigError, match="not both"):
        open_store(f"redis://127.0.0.1:1?password_env=KV_REDIS_PW&password_file={tmp_path}/pw")
    with pytest.raises(ConfigError, match="not an environment variable name"):
        open_store("redis://127.0.0.1:1?password_env=1BAD")
    with pytest.raises(ConfigError, match="control character"):
        open_store("redis://127.0.0.1:1?password_env=A%0D")


def test_cluster_and_shards_urls_take_it_too(monkeypatch):
    monkeypatch.setenv("KV_REDIS_PW", SECRET)
    c = RedisConfig.from_url("rediss+cluster://h1:7000,h2:7001?password_env=KV_REDIS_PW&ca_certs=/ca.pem")
    assert c.cluster and c.password == SECRET and c.hosts == (("h1", 7000), ("h2", 7001))
    assert SECRET not in repr(c) and SECRET not in c.safe_url()
    s = shards_config("redis+shards://user@h1:7000,h2:7001/0?password_env=KV_REDIS_PW")
    assert (s.username, s.password, len(s.hosts)) == ("user", SECRET, 2)
    with open_store("redis+cluster://127.0.0.1:1,127.0.0.1:2?password_env=KV_REDIS_PW") as store:
        assert SECRET not in str(store.describe()) and SECRET not in repr(store)
