"""The gateway's session registry: opaque handles -> the verifier session that holds their KV.

Pure domain code (no gRPC calls): its errors (SessionNotFound, SessionForbidden, TooManySessions) name their
status codes in gateway/errors.py.

Each entry also names the quota account it counts against (the API key, or the client's address when quotas
go by peer) and the KV tokens it holds or may add while a generation runs.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from gateway.errors import SessionForbidden, SessionNotFound, TooManySessions

# 24 random bytes = 192 bits: a handle cannot be guessed, only handed out. Hex, so a handle never
# starts with "-" (which a command line would take for an option).
HANDLE_BYTES = 24


@dataclass
class SessionEntry:
    handle: str
    owner: str | None  # the creating key's identity; None when auth is off
    verifier: str  # address of the verifier holding the KV
    verifier_session_id: str
    last_used: float
    account: str | None = None  # the quota account it counts against; None = the one shared account
    tokens: int = 0  # the session's length as the verifier last reported it
    reserved: int = 0  # tokens a running generation may still add (appended text + max_new_tokens)
    in_use: int = 0  # calls running on the session now; it never expires while > 0
    # The stop token that ended the last generation on it, if one did: its text closes the model's turn, which a
    # chat continuing the session must not close again (GatewayService.chat_prompt).
    stop_token: int | None = None

    @property
    def kv_tokens(self) -> int:
        """What the session counts against its account's KV quota."""
        return self.tokens + self.reserved


class SessionRegistry:
    """Handles bound to their owner, released after `idle_ttl_s` without a call on them.

    NOTE: with auth off every session has owner None, so `max_sessions_per_key` bounds them all.
    Expired entries stay until `expire_idle` hands them to the caller, which must release their
    verifier sessions; lookups already treat them as gone.
    """

    def __init__(self, idle_ttl_s: float, max_sessions_per_key: int,
                 clock: Callable[[], float] = time.monotonic):
        if idle_ttl_s <= 0 or max_sessions_per_key < 1:
            raise ValueError("idle_ttl_s must be > 0 and max_sessions_per_key >= 1")
        self.idle_ttl_s = idle_ttl_s
        self.max_sessions_per_key = max_sessions_per_key
        self._clock = clock
        self._entries: dict[str, SessionEntry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def can_create(self, account: str | None, sessions: int = 1) -> bool:
        return len(self.of_account(account)) + sessions <= self.max_sessions_per_key

    def check_room(self, account: str | None, sessions: int = 1) -> None:
        """Raise TooManySessions when the account has no room for `sessions` more: checked before the (costly)
        prefill, and again by `create`."""
        if not self.can_create(account, sessions):
            raise TooManySessions(f"session: the caller holds {len(self.of_account(account))} sessions of its limit "
                                  f"of {self.max_sessions_per_key} and the call needs {sessions} more; release one "
                                  "first")

    def create(self, owner: str | None, verifier: str, verifier_session_id: str, *, account: str | None,
               tokens: int = 0) -> SessionEntry:
        """Register a verifier session under a fresh handle. On TooManySessions the caller still
        owns the verifier session and must release it."""
        self.check_room(account)
        handle = secrets.token_hex(HANDLE_BYTES)
        entry = SessionEntry(handle, owner, verifier, verifier_session_id, last_used=self._clock(), account=account,
                             tokens=tokens)
        self._entries[handle] = entry
        return entry

    def get(self, handle: str, owner: str | None) -> SessionEntry:
        """The owner's live entry; a lookup counts as use and restarts the idle timer."""
        entry = self._live(handle, owner)
        entry.last_used = self._clock()
        return entry

    def peek(self, handle: str, owner: str | None) -> SessionEntry:
        """The owner's live entry, leaving its idle timer alone (a status query is not use)."""
        return self._live(handle, owner)

    @contextmanager
    def using(self, handle: str, owner: str | None) -> Iterator[SessionEntry]:
        """Hold the session for a call that may outlast the TTL (a long generation)."""
        entry = self.get(handle, owner)
        entry.in_use += 1
        try:
            yield entry
        finally:
            entry.in_use -= 1
            entry.last_used = self._clock()

    def remove(self, handle: str, owner: str | None) -> SessionEntry:
        """Forget the handle; the caller releases the returned verifier session."""
        entry = self._live(handle, owner)
        del self._entries[handle]
        return entry

    def owned_by(self, owner: str | None) -> list[SessionEntry]:
        """The owner's live sessions, oldest use first."""
        now = self._clock()
        mine = [e for e in self._entries.values() if e.owner == owner and not self._expired(e, now)]
        return sorted(mine, key=lambda e: e.last_used)

    def of_account(self, account: str | None) -> list[SessionEntry]:
        """The live sessions that count against `account`'s quotas."""
        now = self._clock()
        return [e for e in self._entries.values() if e.account == account and not self._expired(e, now)]

    def kv_tokens(self, account: str | None) -> int:
        return sum(e.kv_tokens for e in self.of_account(account))

    def on_verifier(self, verifier: str) -> list[SessionEntry]:
        return [e for e in self._entries.values() if e.verifier == verifier]

    def drop_unknown(self, verifier: str, unknown_session_ids: list[str]) -> list[SessionEntry]:
        """Forget idle entries whose session the verifier no longer holds (it restarted, or their lease ran
        out); returns them. An entry in use keeps its call's own view until the call ends."""
        gone = set(unknown_session_ids)
        dropped = [e for e in self.on_verifier(verifier) if e.verifier_session_id in gone and not e.in_use]
        for entry in dropped:
            del self._entries[entry.handle]
        return dropped

    def idle_for(self, entry: SessionEntry) -> float:
        """Seconds since the last call on the session (0 while one runs)."""
        return 0.0 if entry.in_use else max(0.0, self._clock() - entry.last_used)

    def expire_idle(self, now: float | None = None) -> list[SessionEntry]:
        """Drop and return the entries idle longer than the TTL, for the caller to release."""
        now = self._clock() if now is None else now
        expired = [e for e in self._entries.values() if self._expired(e, now)]
        for entry in expired:
            del self._entries[entry.handle]
        return expired

    def _live(self, handle: str, owner: str | None) -> SessionEntry:
        entry = self._entries.get(handle)
        if entry is None or self._expired(entry, self._clock()):
            raise SessionNotFound("session: unknown or expired handle")
        # NOTE: owners are key digests, not keys: a plain comparison leaks nothing usable.
        if entry.owner != owner:
            raise SessionForbidden("session: the handle belongs to another API key")
        return entry

    def _expired(self, entry: SessionEntry, now: float) -> bool:
        return entry.in_use == 0 and now - entry.last_used > self.idle_ttl_s
