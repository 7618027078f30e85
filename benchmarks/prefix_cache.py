"""The prefix cache through the real services: requests that share a long system prompt, each with its own
question, against one stack with the verifier's prefix cache and one without (`--no-prefix-caching`), the same
requests (`ddtree bench`'s synthetic prompts with `--shared-prefix-len`) at the same concurrency; per stack TTFT,
E2E latency, throughput and the prompt tokens the cache held.

    python benchmarks/prefix_cache.py --shape qwen3-8b --shared-prefix 8192 --input-len 256 [--output-len 64]
        [--requests 32] [--concurrency 4] [--checkpoint-dir DIR] [--out-dir DIR]
    python benchmarks/prefix_cache.py --shape tiny --shared-prefix 1024 --input-len 64   # CPU smoke run

Writes prefix_cache_<shape>.{json,md} to `--out-dir`. The shapes and checkpoints are long_context.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

from e2e_step import git_commit
from long_context import SHAPES, add_stack_args, checkpoints, device_name, kv_budget_mb

from ddtree.bench_cli import add_bench_command, benchmark
from ddtree.local_stack import LocalStack, free_port

STACKS = {"prefix cache": (), "no prefix cache": ("--no-prefix-caching",)}


def bench_args(address: str, args: argparse.Namespace) -> argparse.Namespace:
    """`ddtree bench`'s options for one run, parsed by its own parser: gRPC, synthetic token-id prompts, greedy, EOS
    ignored, all sent at once with `--concurrency` in flight."""
    parser = argparse.ArgumentParser()
    add_bench_command(parser.add_subparsers())
    return parser.parse_args(["bench", "--address", address, "--concurrency", str(args.concurrency),
                              "--num-requests", str(args.requests), "--input-len", str(args.input_len),
                              "--shared-prefix-len", str(args.shared_prefix), "--output-len", str(args.output_len),
                              "--ignore-eos"])


def measure(target: Path, device: str, verifier_args: tuple[str, ...], args: argparse.Namespace) -> dict:
    """One stack: started, the bench run (its warm-up request writes the shared prefix first), stopped."""
    stack = LocalStack(str(target), "ngram", 1, device, f"127.0.0.1:{free_port()}", verifier_args=verifier_args,
                       gateway_args=("--max-sessions-per-key", str(args.concurrency)))
    started = time.perf_counter()
    stack.start(timeout_s=args.start_timeout_s)
    try:
        report = asyncio.run(benchmark(bench_args(stack.addresses["gateway"], args)))
    finally:
        stack.stop()
    return {**report, "stack_s": time.perf_counter() - started}


def markdown(result: dict) -> str:
    runs = result["runs"]
    lines = [f"# Prefix cache through the services, {result['shape']} shape, {result['device']}", "",
             f"`{result['command']}`", "",
             f"Commit {result['commit']}. {result['requests']} requests after one warm-up, {result['concurrency']} "
             f"at a time, each {result['shared_prefix']} shared prompt tokens then {result['input_len']} of its own, "
             f"{result['output_len']} new tokens (greedy, EOS ignored), n-gram drafter.", "",
             "| stack | prompt tokens | of those cached | TTFT ms p50 / p90 | E2E ms p50 | requests/s | output tok/s |",
             "|---|---|---|---|---|---|---|"]
    for name, run in runs.items():
        ttft, e2e = run["ttft_ms"], run["e2e_ms"]
        lines.append(f"| {name} | {run['input_tokens']} | {run['cached_input_tokens']} | {ttft['p50']:.0f} / "
                     f"{ttft['p90']:.0f} | {e2e['p50']:.0f} | {run['request_throughput']:.2f} | "
                     f"{run['output_throughput']:.1f} |")
    on, off = runs["prefix cache"], runs["no prefix cache"]
    lines += ["", f"TTFT p50 {off['ttft_ms']['p50'] / on['ttft_ms']['p50']:.2f}x lower with the prefix cache, "
              f"requests/s {on['request_throughput'] / off['request_throughput']:.2f}x."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    parser.add_argument("--shared-prefix", type=int, default=8192, help="prompt tokens every request begins with")
    parser.add_argument("--input-len", type=int, default=256, help="each request's own prompt tokens after them")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=4)
    add_stack_args(parser)
    args = parser.parse_args()
    found = checkpoints(args.shape, args.checkpoint_dir, with_dflash=False)
    tokens = args.shared_prefix + args.input_len + args.output_len + 64
    # NOTE: room for every request in flight, and for the shared prefix's pages kept besides
    kv_mb = kv_budget_mb(found.target, tokens, args.concurrency + 1, args.page_size)
    common = ("--max-context", str(tokens), "--kv-budget-mb", f"{kv_mb:.1f}", "--page-size", str(args.page_size))
    runs = {name: measure(found.target, found.device, (*common, *flags), args) for name, flags in STACKS.items()}
    result = {"command": shlex.join(["python", "benchmarks/prefix_cache.py", *sys.argv[1:]]), "shape": args.shape,
              "device": device_name(found.device), "commit": git_commit(), "shared_prefix": args.shared_prefix,
              "input_len": args.input_len, "output_len": args.output_len, "requests": args.requests,
              "concurrency": args.concurrency, "runs": runs}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"prefix_cache_{args.shape}.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (args.out_dir / f"prefix_cache_{args.shape}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
