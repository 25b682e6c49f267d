"""What the engine adapters share: roles, and one store per URL list and process."""

from __future__ import annotations

import pytest

from kvstore.connectors.roles import ROLE_NAMES, parse_role
from kvstore.errors import ConfigError
from kvstore.stores import shared


@pytest.mark.parametrize("name, loads, saves", [
    ("both", True, True), ("kv_both", True, True), ("producer", False, True), ("kv_producer", False, True),
    ("consumer", True, False), ("kv_consumer", True, False)])
def test_roles_have_one_vocabulary(name, loads, saves):
    role = parse_role(name)
    assert (role.loads, role.saves) == (loads, saves) and name in ROLE_NAMES
    assert parse_role(role.name) == role


def test_unknown_role_names_what_is_accepted():
    with pytest.raises(ConfigError, match=r"'kv_reader'.*kv_consumer"):
        parse_role("kv_reader")


def test_shared_store_is_one_per_url_list_and_closed_by_its_last_user():
    urls = ("memory://?max_bytes=1MiB",)
    a = shared.acquire(urls)
    b = shared.acquire(list(urls))
    assert a is b
    a.put("kvs1/t/k", b"v")
    shared.release(urls, 1.0)  # b still holds it: only flushed
    assert b.get("kvs1/t/k") == b"v"
    shared.release(urls, 1.0)  # the last user: closed and forgotten
    c = shared.acquire(urls)
    try:
        assert c is not a and c.get("kvs1/t/k") is None
    finally:
        shared.release(urls, 1.0)
