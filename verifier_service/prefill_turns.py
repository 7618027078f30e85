"""Whose prefill chunk goes to the engine next: one at a time, the prefill with the fewest tokens left first.

Prefills that each sent their next chunk as soon as the last one was done would share the engine in turns, chunk by
chunk: prompts that arrive together would then all get their first token at about the time the last one does, and
a verify step would queue behind one chunk of every prefill under way. Shortest-remaining-first instead finishes
prompts one after another (the earliest first among equals), which minimises the mean time to first token; a short
prompt that arrives during a long prefill goes ahead of the long one's remaining chunks. Decode steps still run
between any two chunks, as only one chunk is queued on the engine at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable


class PrefillTurns:
    def __init__(self) -> None:
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # (tokens left, arrival, grant): a heap
        self._arrivals = itertools.count()
        self._held = False

    @contextlib.asynccontextmanager
    async def turn(self, tokens: int) -> AsyncIterator[Callable[[int], Awaitable[None]]]:
        """The turn of a prefill of `tokens` tokens, held until the block ends (after waiting for it). The block
        awaits the yielded `between(tokens_left)` between two chunks: it hands the turn to a waiting prefill with
        fewer tokens left, if any, and waits for it to come back."""
        arrival = next(self._arrivals)
        await self._acquire(tokens, arrival)
        try:
            yield lambda left: self._between(left, arrival)
        finally:
            self._pass_on()

    @property
    def under_way(self) -> bool:
        """Whether a prefill holds the turn: its next chunk goes to the engine as soon as the last one ends."""
        return self._held

    @property
    def waiting(self) -> int:
        """Prefills waiting for a turn."""
        return sum(not grant.done() for *_, grant in self._waiting)

    async def _between(self, left: int, arrival: int) -> None:
        while self._waiting and self._waiting[0][2].done():  # NOTE: a waiter that was cancelled
            heapq.heappop(self._waiting)
        if self._waiting and self._waiting[0][:2] < (left, arrival):
            self._pass_on()
            await self._acquire(left, arrival)

    async def _acquire(self, tokens: int, arrival: int) -> None:
        if not self._held:
            self._held = True
            return
        grant = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (tokens, arrival, grant))
        try:
            await grant
        except asyncio.CancelledError:
            if grant.done() and not grant.cancelled():  # NOTE: granted, then cancelled before it ran: pass it on
                self._pass_on()
            raise

    def _pass_on(self) -> None:
        """The turn to the first waiting prefill still there, or to whoever asks next."""
        while self._waiting:
            grant = heapq.heappop(self._waiting)[2]
            if not grant.done():
                grant.set_result(None)
                return
        self._held = False
