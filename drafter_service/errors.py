"""The drafter's domain errors; each names the status of the per-session error reply it becomes."""

from __future__ import annotations

from proto.status import InvalidArgument, SessionNotFound, TooManySessions

__all__ = ["SessionNotFound", "StaleStep", "TooManySessions"]


class StaleStep(InvalidArgument):
    """A step number not above the session's last one: the verifier no longer waits for it."""
