"""API keys: `authorization: Bearer <key>` metadata checked against the configured keys.

Pure domain code (no gRPC calls); Unauthenticated (gateway/errors.py) ends the call UNAUTHENTICATED. A caller is
identified by its key's SHA-256 digest, so sessions and logs never hold a key itself.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable

from gateway.errors import Unauthenticated

BEARER = "bearer"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """The configured keys; none configured means auth is off and every caller is None."""

    def __init__(self, keys: Iterable[str] = ()):
        self.replace(keys)

    def replace(self, keys: Iterable[str]) -> None:
        """Put `keys` in force at once (a rotation); invalid ones raise ValueError (naming none) and change
        nothing. Sessions stay with the digest that opened them."""
        keys = list(keys)
        if any(key.split() != [key] for key in keys):
            raise ValueError("API keys must be non-empty and contain no whitespace")
        self._digests = [key_digest(key) for key in keys]

    def __len__(self) -> int:
        return len(self._digests)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
        """The caller's identity (its key's digest), or None when auth is off."""
        if not self.enabled:
            return None
        header = next((value for name, value in metadata if name.lower() == "authorization"), None)
        if header is None:
            raise Unauthenticated("missing 'authorization: Bearer <key>' metadata")
        if isinstance(header, bytes):
            header = header.decode(errors="replace")
        scheme, _, key = header.strip().partition(" ")
        if scheme.lower() != BEARER or not key.strip():
            raise Unauthenticated("authorization metadata must be 'Bearer <key>'")
        digest = key_digest(key.strip())
        # NOTE: compare fixed-length digests against every key, without an early exit, so the
        # time taken says nothing about how close a guess was or which key matched.
        matched = False
        for known in self._digests:
            matched |= hmac.compare_digest(known, digest)
        if not matched:
            raise Unauthenticated("unknown API key")
        return digest
