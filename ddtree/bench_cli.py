"""`ddtree bench`: the command over ddtree/bench.py. Light imports only (the `ddtree` CLI imports this module to
parse); the backends (the gRPC client, aiohttp) load when the command runs."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import sys
from pathlib import Path
from typing import NoReturn

from ddtree.bench import Progress, dataset_requests, format_report, run_load, summarize, synthetic_requests
from proto.security import add_client_tls_args


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="serving benchmark: TTFT, TPOT, ITL, E2E latency and throughput "
                                  "over gRPC or an OpenAI-compatible HTTP server")
    bench.add_argument("--backend", choices=("grpc", "openai"), default="grpc")
    bench.add_argument("--address", required=True, help="grpc: the gateway's HOST:PORT; openai: the server's base "
                       "URL (http://HOST:PORT, with or without /v1)")
    bench.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY"), help="env DDTREE_API_KEY")
    bench.add_argument("--model", help="openai: the 'model' field (default: the first of GET /v1/models)")
    bench.add_argument("--concurrency", type=_positive(int), help="most requests in flight (default: no limit)")
    bench.add_argument("--request-rate", type=_positive(float), default=math.inf,
                       help="requests per second, Poisson arrivals (default: all at once)")
    bench.add_argument("--num-requests", type=_positive(int), default=100)
    bench.add_argument("--input-len", type=_positive(int), default=128, help="synthetic prompt length, tokens "
                       "(grpc: exact, random token ids; openai: about one token per word)")
    bench.add_argument("--shared-prefix-len", type=int, default=0, help="synthetic prompts begin with this many "
                       "tokens (words) in common, before their own --input-len: a system prompt, what a prefix cache "
                       "serves (default 0: random from the first token)")
    bench.add_argument("--output-len", type=_positive(int), default=128, help="max tokens per request")
    bench.add_argument("--dataset", help='a JSONL file of {"prompt": ..., "max_tokens": ...} (instead of '
                       "synthetic prompts; cycled to --warmup + --num-requests)")
    bench.add_argument("--warmup", type=int, default=1, help="requests sent first and not counted")
    bench.add_argument("--temperature", type=float, default=0.0)
    bench.add_argument("--ignore-eos", action="store_true", help="grpc: generate max tokens exactly (the OpenAI "
                       "API has no such field: there, outputs may end early and their lengths are reported)")
    bench.add_argument("--seed", type=int, default=0, help="of the arrivals and the synthetic prompts")
    bench.add_argument("--timeout", type=_positive(float), help="deadline of each request, seconds")
    bench.add_argument("--json", metavar="FILE", help="also write the report as JSON")
    add_client_tls_args(bench)  # grpc: TLS to the gateway; openai: an https:// address checked against --tls-ca
    bench.set_defaults(run=_bench)


def _positive(kind: type) -> type:
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value
    return parse


async def benchmark(args: argparse.Namespace) -> dict:
    """Warm up, run the measured load, return the report with the run's parameters."""
    from ddtree.bench_backends import open_backend

    backend = await open_backend(args)
    try:
        count = args.warmup + args.num_requests
        if args.dataset:
            requests = list(itertools.islice(itertools.cycle(dataset_requests(args.dataset, args.output_len)),
                                             count))
        else:
            requests = synthetic_requests(count, args.input_len, args.output_len, args.seed, backend.token_pool,
                                          args.shared_prefix_len)
        if args.warmup:
            warmup, _ = await run_load(backend, requests[:args.warmup], math.inf, args.concurrency, args.seed)
            if failed := [r.error for r in warmup if r.error is not None]:
                print(f"warmup: {len(failed)} of {args.warmup} requests failed ({failed[0]})", file=sys.stderr)
        progress = Progress(args.num_requests)
        records, duration_s = await run_load(backend, requests[args.warmup:], args.request_rate, args.concurrency,
                                             args.seed, progress)
        progress.close()
    finally:
        await backend.close()
    return {"backend": args.backend, "address": args.address, "model": backend.model,
            "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
            "concurrency": args.concurrency, "dataset": args.dataset,
            "input_len": None if args.dataset else args.input_len,
            "shared_prefix_len": None if args.dataset else args.shared_prefix_len,
            "output_len": None if args.dataset else args.output_len, "warmup": args.warmup, "seed": args.seed,
            **summarize(records, duration_s)}


def _bench(args: argparse.Namespace) -> None:
    from ddtree.bench_backends import ConnectFailed
    from proto.serving import describe

    try:
        report = asyncio.run(benchmark(args))
    except (ValueError, OSError) as error:  # NOTE: bad values, a missing or malformed dataset: their messages say
        _exit(describe(error), 2)
    except ConnectFailed as error:
        _exit(str(error), 1)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


def _exit(message: str, status: int) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(status)
