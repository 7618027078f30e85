"""Session leases: a session whose holder stops renewing it is released, so KV pages never outlive the
gateway that handed out their handle (it died, restarted, or lost the reply that named the session)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable


class SessionLeases:
    """The expiry time of every session. The holder renews the sessions it still knows; a generation in
    progress holds its session by itself (`expired` skips the busy ones), and its end restarts the lease."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic):
        if lease_s <= 0:
            raise ValueError("lease_s must be > 0")
        self.lease_s = lease_s
        self._clock = clock
        self._expiry: dict[str, float] = {}

    def grant(self, session_id: str) -> None:
        """A full lease from now: at creation, on a renewal, at the end of a generation."""
        self._expiry[session_id] = self._clock() + self.lease_s

    def renew(self, session_ids: Iterable[str]) -> list[str]:
        """Renew the known ids; returns the unknown ones (their holder should forget them)."""
        unknown = []
        for session_id in session_ids:
            if session_id in self._expiry:
                self.grant(session_id)
            else:
                unknown.append(session_id)
        return unknown

    def drop(self, session_id: str) -> None:
        self._expiry.pop(session_id, None)

    def expired(self, busy: Collection[str]) -> list[str]:
        """Sessions past their lease that no generation holds; the caller releases them."""
        now = self._clock()
        return [sid for sid, expiry in self._expiry.items() if expiry < now and sid not in busy]
