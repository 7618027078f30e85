"""The progress reporter: a bar redrawn in place on a terminal, log lines every few seconds elsewhere; and the
weight loading that reports through it."""

from __future__ import annotations

import io
import logging
import re

import pytest

from ddtree.progress import LOG_EVERY_S, Progress, track
from modeling.checkpoint import checkpoint_files, load_causal_lm


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "ddtree.progress"]


def test_off_a_terminal_it_logs_the_start_a_line_every_few_seconds_and_the_end(caplog) -> None:
    caplog.set_level(logging.INFO)
    clock = Clock()
    with Progress("loading weights from m", 16.4e9, unit="B", detail="shard 1/4", stream=io.StringIO(),
                  clock=clock) as progress:
        clock.now += 1
        progress.advance(4e9)  # within LOG_EVERY_S of the first line: not logged
        clock.now += LOG_EVERY_S
        progress.note("shard 2/4")
        progress.advance(4.2e9)
    assert messages(caplog) == ["loading weights from m: 0.0/16.4 GB (0%), shard 1/4, 0 s",
                                "loading weights from m: 4.0/16.4 GB (24%), shard 2/4, 6 s",
                                "loading weights from m: done, 16.4 GB in 6.0 s"]


def test_work_that_fails_or_is_transient_logs_no_end(caplog) -> None:
    caplog.set_level(logging.INFO)
    with pytest.raises(RuntimeError), Progress("capturing CUDA graphs", 3, unit="graphs", stream=io.StringIO()):
        raise RuntimeError("capture failed")
    Progress("prefill", 999, unit="tokens", stream=io.StringIO(), transient=True).close()
    assert messages(caplog) == ["capturing CUDA graphs: 0/3 graphs (0%), 0 s", "prefill: 0/999 tokens (0%), 0 s"]


def test_on_a_terminal_it_redraws_one_line_and_ends_it_or_erases_it() -> None:
    terminal, clock = Terminal(), Clock()
    with Progress("starting the stack", 4, unit="services", stream=terminal, clock=clock) as progress:
        clock.now += 1
        progress.advance(2)
    bars = terminal.getvalue().split("\r")[1:]
    assert bars == ["starting the stack [....................] 0/4 services (0%), 0 s\x1b[K",
                    "starting the stack [##########..........] 2/4 services (50%), 1 s\x1b[K",
                    "starting the stack [##########..........] 2/4 services (50%), 1 s\x1b[K\n"]
    transient = Terminal()
    Progress("prefill", 10, unit="tokens", stream=transient, transient=True).close()
    assert transient.getvalue().endswith("\r\x1b[K")


def test_track_advances_after_each_item(caplog) -> None:
    caplog.set_level(logging.INFO)
    done = [item for item in track(["a", "b", "c"], "capturing CUDA graphs", unit="graphs")]
    assert done == ["a", "b", "c"]
    assert re.fullmatch(r"capturing CUDA graphs: done, 3 graphs in [0-9.]+ s", messages(caplog)[-1])


def test_loading_a_checkpoint_reports_its_shards_and_bytes(tiny_target, caplog) -> None:
    caplog.set_level(logging.INFO)
    load_causal_lm(tiny_target)
    shards = len(checkpoint_files(tiny_target))
    assert shards > 1
    first, last = messages(caplog)
    assert re.fullmatch(rf"loading weights from {tiny_target.name}: 0\.0/[0-9.]+ kB \(0%\), shard 1/{shards}, 0 s",
                        first)
    assert re.fullmatch(rf"loading weights from {tiny_target.name}: done, [0-9.]+ kB in [0-9.]+ s", last)
