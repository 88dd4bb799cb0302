"""Keyed hashes under the gateways' shared secret (`events.arena_readmodel.arena_secret`).

One primitive for every identity the gateway derives without keeping the raw value: a
request's principal (gateway.access), a voter's pseudonym and a battle side's
conversation id (gateway.arena.identity). Below both, so access control does not import
from the arena feature.
"""

from __future__ import annotations

import hashlib
import hmac


def keyed(key: bytes, *parts: str) -> str:
    """HMAC-SHA256 of `parts`, joined by the unit separator U+001F, under `key`, in hex."""
    return hmac.new(key, "\x1f".join(parts).encode(), hashlib.sha256).hexdigest()
