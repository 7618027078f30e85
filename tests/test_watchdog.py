"""The gateway's self-exit (gateway/watchdog.py): the clock, and the watchdog over a pool whose verifiers go away.
The process exit itself is replaced by a recorder; the compose test sees real restarts."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from gateway.watchdog import EXIT_NO_VERIFIER, NoVerifierClock, exit_without_verifier


def test_the_clock_runs_from_the_last_serving_moment_and_only_after_one() -> None:
    clock = NoVerifierClock(timeout_s=10)
    assert not clock.expired(serving=False, now=100)  # never served yet: a restart would not help
    assert not clock.expired(serving=True, now=200)
    assert not clock.expired(serving=False, now=210)
    assert clock.expired(serving=False, now=210.5)
    assert not clock.expired(serving=True, now=211)  # a verifier came back: the clock starts over
    assert not clock.expired(serving=False, now=221)
    assert clock.expired(serving=False, now=222)


class Exited(Exception):
    pass


def test_the_watchdog_exits_with_status_3_once_the_verifiers_are_gone_for_the_timeout() -> None:
    pool = SimpleNamespace(up=["verifier:50053"], addresses=("verifier:50053",))
    statuses = []

    def record_exit(status: int):
        statuses.append(status)
        raise Exited

    async def scenario() -> float:
        watchdog = asyncio.create_task(exit_without_verifier(pool, timeout_s=0.2, poll_s=0.01,
                                                             exit_process=record_exit))
        await asyncio.sleep(0.3)
        assert not watchdog.done()  # serving all along
        pool.up = []
        gone = asyncio.get_running_loop().time()
        with pytest.raises(Exited):
            await watchdog
        return asyncio.get_running_loop().time() - gone

    waited = asyncio.run(scenario())
    assert statuses == [EXIT_NO_VERIFIER]
    assert 0.1 < waited < 1.0  # counted from the last poll that saw a verifier serving, a poll or so before
