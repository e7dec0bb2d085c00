"""API keys and the tenant names they stand for (`--api-key` / $PAGODA_API_KEY).

Syntax: either one plain key (`--api-key sk-abc`, tenant name "default"), or a list of
`NAME=KEY` items separated by commas (`--api-key alice=sk-a,bob=sk-b`). The value is a list
only when every item is NAME=KEY with NAME a short identifier (a letter, then letters,
digits, `_` or `-`, at most 64) and KEY non-empty, not starting with `=`, without spaces:
so base64-padded keys (`abc==`) stay plain keys. A plain key that looks like NAME=KEY is
written `default=NAME=KEY`. Metrics and logs carry the name, never the key.
"""

from __future__ import annotations

import hmac
import re

from starlette.types import Scope

DEFAULT_TENANT = "default"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
_KEY = re.compile(r"[^=\s,][^\s,]*")


def parse_api_keys(value: str | None) -> dict[str, str]:
    """tenant name -> key; {} for no key. Raises ValueError for a list that names a
    tenant twice or gives two tenants the same key."""
    if not value:
        return {}
    items = [item.partition("=") for item in value.split(",")]
    if not all(sep and _NAME.fullmatch(name) and _KEY.fullmatch(key)
               for name, sep, key in items):
        return {DEFAULT_TENANT: value}
    keys: dict[str, str] = {}
    for name, _, key in items:
        if name in keys:
            raise ValueError(f"--api-key names the tenant {name!r} twice")
        keys[name] = key
    if len(set(keys.values())) != len(keys):
        raise ValueError("--api-key gives two tenants the same key")
    return keys


class APIKeys:
    """Checks `Authorization: Bearer KEY` against every configured key (constant time)."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = [(name, key.encode()) for name, key in keys.items()]

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._keys]

    def tenant_of(self, scope: Scope) -> str | None:
        """The name whose key the request carries; None without a matching key."""
        for header, value in scope.get("headers") or []:
            if header == b"authorization" and value.startswith(b"Bearer "):
                sent = value[7:].strip()
                found = None
                for name, key in self._keys:
                    # NOTE: compare with every key, so the time does not tell which matched.
                    if hmac.compare_digest(sent, key):
                        found = name
                return found
        return None
