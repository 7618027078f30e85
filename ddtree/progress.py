"""Progress of long work: loading weights, capturing CUDA graphs, starting the local stack, a long prefill.

One reporter for all of them: on a terminal, a bar redrawn in place; elsewhere (a service's log file, a pipe), a
log line when the work starts, one every LOG_EVERY_S seconds while it runs, and one when it ends. Standard
library only: the services, the client and the CLI all import it.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

LOG_EVERY_S = 5.0
REDRAW_EVERY_S = 0.1
BAR_WIDTH = 20
_BYTE_SCALES = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


class Progress:
    """How far one piece of work got: `update` or `advance` it and `note` what it does now; `close` it, or use it
    as a context manager (an exception closes it unfinished: no final line). Transient work (a prefill before
    its answer) leaves nothing behind: its bar is erased and no final line is logged."""

    def __init__(self, task: str, total: float, unit: str = "", detail: str = "", stream: TextIO | None = None,
                 transient: bool = False, clock: Callable[[], float] = time.monotonic):
        """unit "B" shows amounts in kB, MB or GB; `detail` as `note` sets it; `stream` (default stderr) decides
        bar or log lines."""
        self.task, self.total, self.unit, self.transient, self.clock = task, total, unit, transient, clock
        self.stream = stream or sys.stderr
        self.bar = self.stream.isatty()
        self.done = 0.0
        self.detail = detail
        self.started = clock()
        self.shown_at: float | None = None
        self._show()

    def update(self, done: float) -> None:
        self.done = done
        self._show()

    def advance(self, amount: float = 1) -> None:
        self.update(self.done + amount)

    def note(self, detail: str) -> None:
        """What the work does now (the shard it reads, the service it waits for), shown after the amounts."""
        self.detail = detail
        self._show()

    def close(self, finished: bool = True) -> None:
        if self.bar:
            self.stream.write("\r\x1b[K" if self.transient else f"\r{self._bar_line()}\n")
            self.stream.flush()
        elif finished and not self.transient:
            log.info("%s: done, %s in %.1f s", self.task, _amounts(self.unit, self.total, self.total),
                     self.clock() - self.started)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(finished=exc_type is None)

    def _show(self) -> None:
        now = self.clock()
        every = REDRAW_EVERY_S if self.bar else LOG_EVERY_S
        if self.shown_at is not None and now - self.shown_at < every:
            return
        self.shown_at = now
        if self.bar:
            self.stream.write(f"\r{self._bar_line()}")
            self.stream.flush()
        else:
            log.info("%s", self._line())

    def _fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0

    def _figures(self) -> str:
        detail = f", {self.detail}" if self.detail else ""
        return (f"{_amounts(self.unit, self.total, self.done, self.total)} ({100 * self._fraction():.0f}%){detail}, "
                f"{self.clock() - self.started:.0f} s")

    def _line(self) -> str:
        return f"{self.task}: {self._figures()}"

    def _bar_line(self) -> str:
        filled = round(BAR_WIDTH * self._fraction())
        line = f"{self.task} [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self._figures()}"
        return line[:shutil.get_terminal_size().columns - 1] + "\x1b[K"


def track(items: Sequence[T], task: str, unit: str = "") -> Iterator[T]:
    """The items, with a Progress advanced after each one's work (the caller's loop body) is done."""
    with Progress(task, len(items), unit) as progress:
        for item in items:
            yield item
            progress.advance()


def _amounts(unit: str, total: float, *values: float) -> str:
    """The values in the scale of `total`: `3.2/16.0 GB` for bytes (unit "B"), else `12/31 graphs`."""
    size, name = 1.0, unit
    if unit == "B":
        size, name = next(((size, name) for size, name in _BYTE_SCALES if total >= size), (1.0, "B"))
    digits = 1 if size > 1 else 0
    return f"{'/'.join(f'{value / size:.{digits}f}' for value in values)} {name}".rstrip()
