"""The n choices of one request in the gateway's domain, without gRPC: each choice's seed, and the n generations run
together (the first failure stops them all; every one is closed, whoever ends first)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from gateway.choices import choice_params, interleaved
from proto import common_pb2


def test_choice_i_samples_with_the_seed_plus_i_wrapping_at_2_64() -> None:
    params = common_pb2.SamplingParams(temperature=0.7, seed=2**64 - 2, max_new_tokens=9)
    derived = [choice_params(params, i) for i in range(3)]
    assert [p.seed for p in derived] == [2**64 - 2, 2**64 - 1, 0]
    assert all((p.temperature, p.max_new_tokens) == (params.temperature, 9) for p in derived)
    assert params.seed == 2**64 - 2  # the request's own stays
    unseeded = common_pb2.SamplingParams(temperature=0.7)
    assert not choice_params(unseeded, 2).HasField("seed")  # each choice draws its own


class Streams:
    """Generators that record how they ended: "done", "closed" (cancelled or closed early) or the error raised."""

    def __init__(self) -> None:
        self.ended: dict[str, str] = {}

    async def stream(self, name: str, items: int, delay_s: float = 0.0, fail: bool = False) -> AsyncGenerator[str]:
        try:
            for i in range(items):
                await asyncio.sleep(delay_s)
                yield f"{name}{i}"
            if fail:
                raise ValueError(f"{name} failed")
            self.ended[name] = "done"
        except (asyncio.CancelledError, GeneratorExit):
            self.ended[name] = "closed"
            raise


def test_interleaved_streams_run_together_and_name_their_index() -> None:
    streams = Streams()

    async def read() -> list[tuple[int, str]]:
        return [item async for item in interleaved([streams.stream("a", 3, 0.04), streams.stream("b", 2, 0.05)])]

    # NOTE: as they come: a's at 40, 80 and 120 ms, b's at 50 and 100
    assert asyncio.run(read()) == [(0, "a0"), (1, "b0"), (0, "a1"), (1, "b1"), (0, "a2")]
    assert streams.ended == {"a": "done", "b": "done"}


def test_the_first_failure_closes_the_other_streams_and_is_raised_once() -> None:
    streams = Streams()

    async def read() -> list[tuple[int, str]]:
        seen = []
        with pytest.raises(ValueError, match="b failed"):
            async for item in interleaved([streams.stream("a", 100, 0.01), streams.stream("b", 1, fail=True)]):
                seen.append(item)
        return seen

    assert (1, "b0") in asyncio.run(read())
    assert streams.ended == {"a": "closed"}


def test_closing_early_closes_every_stream_before_it_returns() -> None:
    streams = Streams()

    async def read() -> dict[str, str]:
        merged = interleaved([streams.stream("a", 100, 0.01), streams.stream("b", 100, 0.01)])
        await anext(merged)
        await merged.aclose()
        return dict(streams.ended)

    assert asyncio.run(read()) == {"a": "closed", "b": "closed"}
