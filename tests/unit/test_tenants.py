"""tenants.py: the --api-key syntax (one plain key, or NAME=KEY,...) and key matching."""

from __future__ import annotations

import pytest

from pagoda.entrypoints.openai.tenants import APIKeys, parse_api_keys


def scope(auth: str | None) -> dict:
    return {"headers": [] if auth is None else [(b"authorization", auth.encode())]}


@pytest.mark.parametrize("value, expected", [
    (None, {}),
    ("", {}),
    ("sk-abc", {"default": "sk-abc"}),
    ("abc==", {"default": "abc=="}),  # NOTE: base64 padding stays a plain key
    ("sk-abc=", {"default": "sk-abc="}),
    ("a b=c", {"default": "a b=c"}),
    ("alice=key-a,bob=key-b", {"alice": "key-a", "bob": "key-b"}),
    ("default=x=y", {"default": "x=y"}),
    ("alice=key-a,plainkey", {"default": "alice=key-a,plainkey"}),
])
def test_parse(value: str | None, expected: dict[str, str]) -> None:
    assert parse_api_keys(value) == expected


def test_parse_refuses_ambiguous_lists() -> None:
    with pytest.raises(ValueError, match="'alice' twice"):
        parse_api_keys("alice=k1,alice=k2")
    with pytest.raises(ValueError, match="same key"):
        parse_api_keys("alice=k1,bob=k1")


def test_tenant_of() -> None:
    keys = APIKeys(parse_api_keys("alice=key-a,bob=key-b"))
    assert keys and keys.names == ["alice", "bob"]
    assert keys.tenant_of(scope("Bearer key-b")) == "bob"
    assert keys.tenant_of(scope("Bearer  key-a ")) == "alice"
    for bad in (None, "Bearer key-c", "key-a", "Basic key-a"):
        assert keys.tenant_of(scope(bad)) is None
    assert not APIKeys({})
