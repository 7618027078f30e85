"""The gateway's self-exit: a gateway that has had no serving verifier for longer than a timeout exits with
status 3, so that a restart policy (compose `restart: unless-stopped`, a Kubernetes pod) brings a fresh one.

The timeout is `--exit-without-verifier-s` (GatewayConfig.exit_without_verifier_s; its default comes from the
environment variable `DDTREE_GATEWAY_EXIT_WITHOUT_VERIFIER_S`, which the compose files and manifests set; 0: the
gateway stays up). The clock
starts when the last verifier stops serving, and only once one has served: a gateway started before its
verifiers (still loading) waits for them, since a restart would not bring them sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from typing import NoReturn

from gateway.verifiers import VerifierPool
from proto.serving import wait_for_termination_signal

log = logging.getLogger(__name__)

EXIT_WITHOUT_VERIFIER_ENV = "DDTREE_GATEWAY_EXIT_WITHOUT_VERIFIER_S"
EXIT_NO_VERIFIER = 3


class NoVerifierClock:
    """How long no verifier has served, counted from the last moment one did."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self.last_serving: float | None = None  # monotonic seconds; None until a verifier has served

    def expired(self, serving: bool, now: float) -> bool:
        if serving:
            self.last_serving = now
            return False
        return self.last_serving is not None and now - self.last_serving > self.timeout_s


def _exit_process(status: int) -> NoReturn:
    logging.shutdown()
    os._exit(status)  # NOTE: nothing to finish: without a verifier every call fails anyway


async def exit_without_verifier(pool: VerifierPool, timeout_s: float, poll_s: float = 1.0,
                                exit_process: Callable[[int], NoReturn] = _exit_process) -> None:
    """Watch `pool.up` (the housekeeping refreshes it) and exit the process once the clock runs out."""
    clock = NoVerifierClock(timeout_s)
    while True:
        if clock.expired(bool(pool.up), time.monotonic()):
            log.error("no verifier has served for %.0f s (%s): exiting with status %d for a restart", timeout_s,
                      ", ".join(pool.addresses), EXIT_NO_VERIFIER)
            exit_process(EXIT_NO_VERIFIER)
        await asyncio.sleep(poll_s)


async def wait_for_termination_signal_watching(pool: VerifierPool, timeout_s: float) -> None:
    """proto.serving.wait_for_termination_signal, with the watchdog running meanwhile when the timeout is set."""
    watchdog = asyncio.create_task(exit_without_verifier(pool, timeout_s)) if timeout_s > 0 else None
    try:
        await wait_for_termination_signal()
    finally:
        if watchdog is not None:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
