"""A request's n choices (OpenAI's `n`): each choice's sampling parameters, and the n generations run together.

Pure asyncio and protobuf: GatewayService.generate_choices runs each choice as a generation of its own on a fork of
one session, and hands their replies on through `interleaved`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TypeVar

from proto import common_pb2

T = TypeVar("T")
SEEDS = 2**64  # NOTE: SamplingParams.seed is a uint64: a derived seed wraps around
_END = object()  # a stream's end, in `interleaved`'s queue


def choice_params(params: common_pb2.SamplingParams, index: int) -> common_pb2.SamplingParams:
    """Choice `index`'s parameters: the request's, with seed + index (mod 2**64) where it has a seed, so that the
    whole reply replays and its choice i is what one choice with that seed gives. Without a seed every choice draws
    its own; greedy choices are all the same."""
    if not params.HasField("seed"):
        return params
    derived = common_pb2.SamplingParams()
    derived.CopyFrom(params)
    derived.seed = (params.seed + index) % SEEDS
    return derived


async def interleaved(streams: Sequence[AsyncGenerator[T, None]]) -> AsyncIterator[tuple[int, T]]:
    """The items of `streams`, each stream read by a task of its own so that they run together, as they come and
    with their stream's index. The first failure stops the other streams and is raised here, once. Every stream is
    closed (its cleanup done) before this ends, also when it is closed or cancelled early.
    NOTE: the queue holds as many items as there are streams, so a caller that stops reading soon holds them all
    back, as it would hold back one."""
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue(maxsize=len(streams))

    async def read(index: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((index, item))
        except Exception as error:  # noqa: BLE001 - the caller raises it
            await queue.put((index, error))
        else:
            await queue.put((index, _END))

    readers = [asyncio.ensure_future(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(readers)
        while running:
            index, item = await queue.get()
            if item is _END:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
