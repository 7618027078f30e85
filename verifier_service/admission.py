"""Prompts and generations that find the KV cache full wait for pages, first come first served, instead of failing.

A full cache is usually momentary: generations end and give their pages back every few steps. So a prompt whose
pages are not free now, or a generation whose growth (Engine.pages_owed: up to its max_new_tokens) does not fit
beside the growth of those under way, queues here (as TGI's waiting queue does) until they are, for at most
`timeout_s`, and only then fails with RESOURCE_EXHAUSTED; one larger than the whole cache fails at once (the engine
refuses it). Since a generation starts only once its growth fits, a generation under way never finds the cache
full. The queue is strict: the first waiting goes first, so a large prompt is not starved by smaller ones that keep
fitting in. Pages come back when the service releases a session, ends a generation or aborts a prefill
(`pages_freed`); a periodic look covers anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable

from verifier_service.errors import CapacityError

DEFAULT_ADMISSION_TIMEOUT_S = 60.0
RECHECK_S = 0.5  # the longest a waiting request goes without looking at the pool again


class KVAdmission:
    def __init__(self, timeout_s: float, observe: Callable[[float], None] = lambda seconds: None):
        """timeout_s: how long a request may wait for pages (0: it fails at once, as without a queue); `observe`
        takes each wait's seconds, however it ended."""
        self.timeout_s, self.observe = timeout_s, observe
        self._queue: deque[object] = deque()
        self._changes = 0  # pages freed or the queue's head gone: a waiter that saw none may sleep
        self._changed = asyncio.Event()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def pages_freed(self) -> None:
        """Pages went back to the pool: the first waiting request looks again."""
        self._wake()

    def _wake(self) -> None:
        self._changes += 1
        self._changed.set()

    async def admit(self, reserve: Callable[[], Awaitable[bool]], what: str) -> None:
        """Wait for this turn in the queue and for `reserve()` (which takes the pages if they are free) to succeed;
        CapacityError after `timeout_s`, naming `what` pages it waited for. A waiter that is cancelled leaves the
        queue."""
        ticket = object()
        self._queue.append(ticket)
        started = time.monotonic()
        deadline = started + self.timeout_s
        try:
            while True:
                seen = self._changes
                if self._queue[0] is ticket and await reserve():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CapacityError(f"KV cache full: waited {self.timeout_s:g} s for {what} pages to be free "
                                        "(--admission-timeout-s)")
                if self._changes == seen:  # NOTE: nothing changed during the look: sleep until something does
                    self._changed.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(self._changed.wait(), min(left, RECHECK_S))
        finally:
            self._queue.remove(ticket)
            self._wake()  # NOTE: the next one in the queue may go now
            self.observe(time.monotonic() - started)
