"""`ddtree bench`: a serving benchmark client, as `vllm bench serve` or SGLang's `bench_serving`.

Requests (synthetic or from a JSONL dataset) go out at Poisson arrivals (`--request-rate`), at most
`--concurrency` in flight, over the gRPC gateway or any OpenAI-compatible HTTP server (ddtree/bench_backends.py).
Each request keeps a timeline (RequestRecord); the report gives TTFT, TPOT, ITL and E2E latency percentiles and
throughputs of the requests that completed. The command is ddtree/bench_cli.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from ddtree.bench_backends import Backend

# Words that are one token each in GPT-2, Llama and Qwen BPE vocabularies (with their leading space): synthetic
# text prompts for backends that take only text (OpenAI) come out about --input-len tokens long.
WORDS = ("the of and to in is it that for on with as was at by be this are from or have an not but all were "
         "we when there can more one so if out up").split()
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class BenchRequest:
    text: str
    token_ids: tuple[int, ...]  # a prompt as token ids (then text is empty): exact input lengths
    max_tokens: int


@dataclass
class RequestRecord:
    """One request's timeline, in seconds of time.perf_counter(); a failed request has `error` set."""
    sent_at: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one per token after the first chunk
    e2e_s: float | None = None
    input_tokens: int | None = None  # as the server counted them, where it says
    cached_tokens: int | None = None  # of those, the ones its prefix cache held, where it says
    output_tokens: int = 0
    acceptance_lengths: list[int] | None = None  # one per verify step (gRPC only)
    error: str | None = None
    _last_chunk_at: float = field(default=0.0, init=False, repr=False)

    def add_chunk(self, tokens: int, now: float) -> None:
        """A streamed chunk of `tokens` tokens: its gap from the previous chunk counts as `tokens` inter-token
        latencies of gap / tokens (speculative decoding streams several tokens per step)."""
        if self.ttft_s is None:
            self.ttft_s = now - self.sent_at
        elif tokens > 0:
            self.itl_s += [(now - self._last_chunk_at) / tokens] * tokens
        self._last_chunk_at = now
        self.output_tokens += tokens

    def finish(self, now: float) -> None:
        self.e2e_s = now - self.sent_at

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None for one-token outputs)."""
        if self.output_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def synthetic_requests(count: int, input_len: int, output_len: int, seed: int, token_pool: Sequence[int] | None,
                       shared_prefix_len: int = 0) -> list[BenchRequest]:
    """Random prompts: `input_len` token ids drawn from `token_pool`, or (None) `input_len` words of WORDS, after
    `shared_prefix_len` more that every prompt begins with (a system prompt: what a prefix cache serves, as SGLang's
    generated-shared-prefix dataset). Without one they are random from their first token on, so a prefix cache
    does not shorten the measured prefills."""
    rng = random.Random(seed)
    if token_pool is not None:
        shared = tuple(rng.choices(token_pool, k=shared_prefix_len))
        return [BenchRequest("", shared + tuple(rng.choices(token_pool, k=input_len)), output_len)
                for _ in range(count)]
    shared_words = rng.choices(WORDS, k=shared_prefix_len)
    return [BenchRequest(" ".join(shared_words + rng.choices(WORDS, k=input_len)), (), output_len)
            for _ in range(count)]


def dataset_requests(path: str, default_max_tokens: int) -> list[BenchRequest]:
    """One JSON object per line: {"prompt": str, "max_tokens": int (default: `default_max_tokens`)}."""
    requests = []
    with open(path, encoding="utf-8") as file:
        for number, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                prompt, max_tokens = item["prompt"], item.get("max_tokens", default_max_tokens)
            except (ValueError, KeyError, TypeError):
                raise ValueError(f'{path}:{number}: expected {{"prompt": ..., "max_tokens": ...}}') from None
            if not isinstance(prompt, str) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError(f"{path}:{number}: prompt must be a string and max_tokens a positive integer")
            requests.append(BenchRequest(prompt, (), max_tokens))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Send times in seconds from the start: the first at 0, then exponential gaps of mean 1 / rate
    (a Poisson process); rate inf: all at 0."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    return list(itertools.accumulate((rng.expovariate(rate) for _ in range(count - 1)), initial=0.0))


class Progress:
    """A one-line progress bar on a terminal (stderr); silent when it is not one."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30):
        stream = stream or sys.stderr
        self.total, self.done, self.width = total, 0, width
        self.stream = stream if stream.isatty() else None

    def advance(self, failed: bool) -> None:
        self.done += 1
        if self.stream is not None:
            filled = self.width * self.done // self.total
            self.stream.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total}"
                              + (" (failures)" if failed else ""))
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")


async def run_load(backend: Backend, requests: Sequence[BenchRequest], rate: float, concurrency: int | None,
                   seed: int, progress: Progress | None = None) -> tuple[list[RequestRecord], float]:
    """Send each request at its Poisson arrival time, with at most `concurrency` in flight (None: no limit);
    returns the records in request order and the seconds from the first send to the last completion."""
    limit = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    started = time.perf_counter()

    async def one(request: BenchRequest, arrival: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, started + arrival - time.perf_counter()))
        async with limit:
            record = RequestRecord(sent_at=time.perf_counter())
            try:
                await backend.send(request, record)
            except backend.errors as error:
                record.error = str(error) or type(error).__name__
            record.finish(time.perf_counter())
        if progress is not None:
            progress.advance(failed=record.error is not None)
        return record

    arrivals = poisson_arrivals(len(requests), rate, seed)
    records = await asyncio.gather(*(one(request, at) for request, at in zip(requests, arrivals)))
    return records, time.perf_counter() - started


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution_ms(seconds: Sequence[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    stats = {"mean": 1000 * sum(seconds) / len(seconds)}
    stats.update({f"p{q}": 1000 * percentile(seconds, q) for q in PERCENTILES})
    return stats


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """The report of a run: failed requests are counted (with their distinct errors) and left out of the rest."""
    done = [r for r in records if r.error is None]
    output_tokens = sum(r.output_tokens for r in done)
    steps = [length for r in done for length in (r.acceptance_lengths or ())]
    return {
        "requests": len(records), "completed": len(done), "failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error is not None})[:5],
        "duration_s": duration_s,
        "input_tokens": sum(r.input_tokens for r in done) if all(r.input_tokens is not None for r in done) else None,
        "cached_input_tokens": (sum(r.cached_tokens for r in done)
                                if all(r.cached_tokens is not None for r in done) else None),
        "output_tokens": output_tokens,
        "output_lengths": [None if r.error else r.output_tokens for r in records],  # in request order
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "mean_acceptance_length": sum(steps) / len(steps) if steps else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": distribution_ms([gap for r in done for gap in r.itl_s]),
        "e2e_ms": distribution_ms([r.e2e_s for r in done]),
    }


def format_report(report: dict) -> str:
    """The report as two markdown tables (readable in a terminal, pasted as is into benchmarks/results/)."""
    def value(v: float | None, digits: int = 2) -> str:
        return "n/a" if v is None else f"{v:.{digits}f}"

    def count(n: int | None) -> str:
        return "n/a" if n is None else str(n)

    lines = ["| requests | failed | duration (s) | requests/s | output tokens/s | input tokens | of those cached "
             "| output tokens | mean acceptance length |", "|---|---|---|---|---|---|---|---|---|",
             f"| {report['completed']} | {report['failed']} | {report['duration_s']:.2f} | "
             f"{report['request_throughput']:.2f} | {report['output_throughput']:.1f} | "
             f"{count(report['input_tokens'])} | {count(report['cached_input_tokens'])} | {report['output_tokens']} | "
             f"{value(report['mean_acceptance_length'])} |", "",
             "| latency (ms) | mean | " + " | ".join(f"p{q}" for q in PERCENTILES) + " |",
             "|---|---|" + "---|" * len(PERCENTILES)]
    columns = ("mean", *(f"p{q}" for q in PERCENTILES))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms")):
        stats = report[key] or {}
        lines.append(f"| {name} | " + " | ".join(value(stats.get(column)) for column in columns) + " |")
    lines += [f"\nerror: {error}" for error in report["errors"]]
    return "\n".join(lines)
