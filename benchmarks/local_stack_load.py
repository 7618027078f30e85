"""Load on the local stack: C concurrent clients, each a one-shot greedy generation, through the gateway.

Writes benchmarks/results/local_stack_load.{json,md}. Exactness is the tests' job; this measures rate.

    python benchmarks/local_stack_load.py [--clients 32] [--requests 64] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from ddtree.client import AsyncClient
from ddtree.local_stack import LocalStack, ensure_tiny_model, free_port

RESULTS = Path(__file__).parent / "results"


async def drive(gateway: str, clients: int, requests: int, max_new_tokens: int) -> dict:
    client = AsyncClient(gateway, timeout=600)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    latencies, tokens, acceptance = [], 0, []

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            generation = client.generate(f"request {i}: the cat sat on the mat. the cat sat on the",
                                         max_new_tokens=max_new_tokens)
            summary = await generation.result()
            latencies.append(time.perf_counter() - started)
            tokens += len(generation.token_ids)
            acceptance.append(summary.mean_acceptance_length)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    return {"requests": requests, "clients": clients, "max_new_tokens": max_new_tokens, "seconds": elapsed,
            "requests_per_s": requests / elapsed, "tokens_per_s": tokens / elapsed,
            "latency_p50_s": statistics.median(latencies), "latency_max_s": max(latencies),
            "mean_acceptance_length": statistics.mean(acceptance)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--drafter", default=None, help="default: the tiny DFlash drafter")
    parser.add_argument("--drafters", type=int, default=2)
    args = parser.parse_args()
    target, tiny_drafter = ensure_tiny_model()
    drafter = args.drafter or str(tiny_drafter)
    with LocalStack(str(target), drafter, args.drafters, gateway_listen=f"127.0.0.1:{free_port()}") as stack:
        result = asyncio.run(drive(stack.addresses["gateway"], args.clients, args.requests, args.max_new_tokens))
    command = "python " + " ".join(sys.argv)
    result.update(command=command, machine=f"{platform.processor() or platform.machine()}, CPU only",
                  model="tiny built-in (4 layers, hidden 64)", drafter=Path(drafter).name,
                  drafter_replicas=args.drafters)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "local_stack_load.json").write_text(json.dumps(result, indent=2))
    (RESULTS / "local_stack_load.md").write_text(
        f"# Local stack load ({result['machine']})\n\n`{command}`\n\n"
        "| clients | requests | req/s | tokens/s | p50 latency (s) | max latency (s) | mean acceptance |\n"
        "|---|---|---|---|---|---|---|\n"
        f"| {args.clients} | {args.requests} | {result['requests_per_s']:.2f} | {result['tokens_per_s']:.1f} | "
        f"{result['latency_p50_s']:.2f} | {result['latency_max_s']:.2f} | {result['mean_acceptance_length']:.2f} |\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
