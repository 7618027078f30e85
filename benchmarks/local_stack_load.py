"""Load on the local stack: C concurrent clients, each a one-shot greedy generation, through the gateway.

Writes local_stack_load.{json,md} to --out-dir. Exactness is the tests' job; this measures rate, and with a small
`--kv-budget-mb` what an overload does: requests that fail are counted by their gRPC status.

    python benchmarks/local_stack_load.py [--clients 32] [--requests 64] [--max-new-tokens 32]
        [--kv-budget-mb MB --page-size 16] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import grpc

from ddtree.client import AsyncClient
from ddtree.local_stack import LocalStack, ensure_tiny_model, free_port

RESULTS = Path(__file__).parent / "results"


async def drive(gateway: str, clients: int, requests: int, max_new_tokens: int) -> dict:
    client = AsyncClient(gateway, timeout=600)
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    latencies, tokens, acceptance, errors = [], 0, [], collections.Counter()

    async def worker() -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            generation = client.generate(f"request {i}: the cat sat on the mat. the cat sat on the",
                                         max_new_tokens=max_new_tokens)
            try:
                summary = await generation.result()
            except grpc.RpcError as error:
                errors[error.code().name] += 1
                continue
            latencies.append(time.perf_counter() - started)
            tokens += len(generation.token_ids)
            acceptance.append(summary.mean_acceptance_length)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    elapsed = time.perf_counter() - started
    return {"requests": requests, "clients": clients, "max_new_tokens": max_new_tokens, "seconds": elapsed,
            "requests_per_s": len(latencies) / elapsed, "tokens_per_s": tokens / elapsed,  # NOTE: finished ones
            "latency_p50_s": statistics.median(latencies or [0.0]), "latency_max_s": max(latencies or [0.0]),
            "mean_acceptance_length": statistics.mean(acceptance or [0.0]), "failed": dict(errors)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--drafter", default=None, help="default: the tiny DFlash drafter")
    parser.add_argument("--drafters", type=int, default=2)
    parser.add_argument("--kv-budget-mb", type=float, help="the verifier's KV cache (default: its own)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    target, tiny_drafter = ensure_tiny_model()
    drafter = args.drafter or str(tiny_drafter)
    kv = ("--kv-budget-mb", str(args.kv_budget_mb)) if args.kv_budget_mb else ()
    with LocalStack(str(target), drafter, args.drafters, gateway_listen=f"127.0.0.1:{free_port()}",
                    verifier_args=("--page-size", str(args.page_size), *kv)) as stack:
        result = asyncio.run(drive(stack.addresses["gateway"], args.clients, args.requests, args.max_new_tokens))
    command = "python " + " ".join(sys.argv)
    result.update(command=command, machine=f"{platform.processor() or platform.machine()}, CPU only",
                  model="tiny built-in (4 layers, hidden 64)", drafter=Path(drafter).name,
                  drafter_replicas=args.drafters)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    failed = ", ".join(f"{count} {code}" for code, count in result["failed"].items()) or "none"
    (args.out_dir / "local_stack_load.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / "local_stack_load.md").write_text(
        f"# Local stack load ({result['machine']})\n\n`{command}`\n\n"
        "| clients | requests | failed | req/s | tokens/s | p50 latency (s) | max latency (s) | mean acceptance |\n"
        "|---|---|---|---|---|---|---|---|\n"
        f"| {args.clients} | {args.requests} | {failed} | {result['requests_per_s']:.2f} | "
        f"{result['tokens_per_s']:.1f} | "
        f"{result['latency_p50_s']:.2f} | {result['latency_max_s']:.2f} | {result['mean_acceptance_length']:.2f} |\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
