"""What the service split costs per decode step: the same greedy generation in one process (`ddtree offline`'s
loop) and through gateway -> verifier <-> drafter over loopback gRPC, same model, drafter and prompt.

The difference per verify step is the gRPC overhead (both hops, serialisation, scheduling). Writes
benchmarks/results/grpc_overhead[_cuda].{json,md}.

    python benchmarks/grpc_overhead.py [--drafter ngram] [--max-new-tokens 256] [--repeats 3]
    python benchmarks/grpc_overhead.py --random-target DIR --device cuda   # Qwen3-0.6B shape on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from ddtree.client import Client
from ddtree.local_stack import LocalStack, ensure_tiny_model, free_port
from ddtree.offline import generate_offline
from drafter_service.server import load_drafter
from modeling.tiny import QWEN3_06B_SHAPE, make_tiny_target
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine
from verifier_service.engine.sampling import SamplingParams

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat sat on the mat. the dog"
RESULTS = Path(__file__).parent / "results"


def in_process(engine: Engine, target: Path, drafter: str, max_new_tokens: int) -> tuple[float, int, list[int]]:
    result = generate_offline(engine, load_drafter(drafter, str(target)), engine.tokenizer.encode(PROMPT),
                              SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True), tree_budget=15)
    return result.decode_s, len(result.acceptance_lengths), result.token_ids


def through_services(gateway: str, max_new_tokens: int) -> tuple[float, int, list[int]]:
    generation = Client(gateway, timeout=600).generate(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True)
    chunks = iter(generation)
    next(chunks)  # the first step also carries the prefill: start the clock after it
    started = time.perf_counter()
    steps = 1 + sum(1 for _ in chunks)
    return time.perf_counter() - started, steps - 1, generation.token_ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--random-target", type=Path,
                        help="write a random Qwen3-0.6B-shaped bf16 model here and use it (default: the tiny model)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = make_tiny_target(args.random_target, shape=QWEN3_06B_SHAPE) if args.random_target \
        else ensure_tiny_model()[0]
    gpu = args.device == "cuda"
    engine_args = {"device": "cuda", "dtype": "bfloat16", "attention": "triton", "kv_budget_bytes": 4 << 30,
                   "max_context": 4096} if gpu else {}
    engine = Engine.from_checkpoint(target, EngineConfig(**engine_args))
    engine.warm_up(16)
    local = [in_process(engine, target, args.drafter, args.max_new_tokens) for _ in range(args.repeats)]
    verifier_args = ("--tree-budget", "15", "--page-size", "64", *(
        ("--attention", "triton", "--kv-budget-mb", "4096", "--max-context", "4096") if gpu else ()))
    with LocalStack(str(target), args.drafter, 1, args.device, gateway_listen=f"127.0.0.1:{free_port()}",
                    verifier_args=verifier_args) as stack:
        remote = [through_services(stack.addresses["gateway"], args.max_new_tokens) for _ in range(args.repeats)]
    identical = all(r[2] == local[0][2] for r in remote + local)
    assert identical or gpu, "outputs differ: exactness is broken"  # NOTE: fp32 on the CPU must agree exactly
    local_ms = statistics.median(s / n * 1e3 for s, n, _ in local)
    remote_ms = statistics.median(s / n * 1e3 for s, n, _ in remote)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, the model on the {'GPU' if gpu else 'CPU'}"
    result = {"command": "python " + " ".join(sys.argv), "machine": machine,
              "model": target.name if args.random_target else "tiny built-in", "drafter": args.drafter,
              "steps": local[0][1], "identical_outputs": identical,
              "in_process_ms_per_step": local_ms, "services_ms_per_step": remote_ms,
              "overhead_ms_per_step": remote_ms - local_ms}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    name = "grpc_overhead_cuda" if gpu else "grpc_overhead"  # NOTE: the CPU and GPU results are kept side by side
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=2))
    (args.out_dir / f"{name}.md").write_text(
        f"# gRPC overhead per decode step ({result['machine']})\n\n`{result['command']}`\n\n"
        "| drafter | steps | in process (ms/step) | through the services (ms/step) | overhead (ms/step) |\n"
        "|---|---|---|---|---|\n"
        f"| {args.drafter} | {result['steps']} | {local_ms:.2f} | {remote_ms:.2f} | {remote_ms - local_ms:.2f} |\n\n"
        f"Same model, drafter, prompt and greedy output (identical: {identical}; asserted on the CPU); medians\n"
        "over the repeats; the services' "
        "clock starts after the first streamed step so prefill is excluded on both sides.\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
