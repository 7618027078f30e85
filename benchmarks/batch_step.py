"""One engine verify step of B sessions at once, without the services: its wall time, the GPU's busy time inside
it, the host's share (wall minus busy) and the floor (weights and every session's KV read once at the measured
copy bandwidth). Where the serving loop's step time goes before any gRPC is involved.

    python benchmarks/batch_step.py [--shape qwen3-8b] [--sessions 1 16 32 64 128] [--budgets 0 15] [--burst K]
        [--temperature T [--top-p P]] [--repetition-penalty R] [--frequency-penalty F]   # every session's settings
    python benchmarks/batch_step.py --shape tiny --sessions 1 4 --profile-host   # CPU smoke run
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
from e2e_step import (
    build_ours,
    copy_bandwidth,
    cuda_events,
    engine_for,
    kernel_breakdown,
    our_session,
    random_tree,
    shape_of,
    synchronize,
    timed,
    weight_counts,
    write_results,
)

from modeling.tree import DraftTree
from verifier_service.engine.engine import Engine
from verifier_service.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_new_tokens=1 << 20, ignore_eos=True)


def gpu_busy_ms(fn, steps: int = 5) -> float:
    """GPU time per call of fn(): the union of its kernels' intervals (overlapping kernels counted once)."""
    intervals = sorted((e.time_range.start, e.time_range.end) for e in cuda_events(fn, steps))
    busy, end = 0.0, float("-inf")
    for start, stop in intervals:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy / 1e3 / steps


def host_profile(fn, steps: int = 20, top: int = 12) -> str:
    """The host functions fn() spends its time in, by cumulative time (cProfile)."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        fn()
    synchronize()
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def open_sessions(engine: Engine, count: int, context: int, sampling: SamplingParams = GREEDY) -> list[str]:
    """`count` sessions of `context` tokens generating with `sampling` (each its own seed)."""
    ids = [our_session(engine, context) for _ in range(count)]
    for seed, session_id in enumerate(ids):
        engine.start_generation(session_id, replace(sampling, seed=seed))
    return ids


def floor_ms(engine: Engine, weights: dict, sessions: int, context: int, bandwidth: float) -> float:
    """Dense shapes: every matmul weight (layers and LM head, bf16) and every session's KV read once."""
    kv_bytes = engine.kv.page_bytes(engine.model_config, 1, torch.bfloat16) * sessions * context
    return (2 * weights["matmul"] + kv_bytes) / bandwidth * 1e3


def measure(engine: Engine, weights: dict, sessions: int, budget: int, context: int, bandwidth: float,
            profile_host: bool, burst: int = 1, sampling: SamplingParams = GREEDY) -> dict:
    """One point; a plain point with burst > 1 times `Engine.decode` of that many steps and reports per step."""
    ids = open_sessions(engine, sessions, context, sampling)
    generator = torch.Generator().manual_seed(sessions + budget)
    trees = [random_tree(budget, engine.model_config.vocab_size, generator) if budget else DraftTree.empty()
             for _ in ids]
    forwards = 1 if budget else burst

    def step() -> None:
        if forwards > 1:
            engine.decode(ids, forwards)
        else:
            engine.step(list(zip(ids, trees)))

    reps = [timed(step, reps=1, warmup=3 if rep == 0 else 0) / forwards for rep in range(10)]
    wall = statistics.fmean(reps)
    row = {"sessions": sessions, "budget": budget, "context": context, "burst": forwards, "step_ms": wall,
           "step_ms_each": reps,  # NOTE: one mean hides an outlier (a first call's allocation, a collection)
           "temperature": sampling.temperature, "top_p": sampling.top_p,
           "repetition_penalty": sampling.repetition_penalty, "frequency_penalty": sampling.frequency_penalty,
           "floor_ms": floor_ms(engine, weights, sessions, context, bandwidth)}
    if engine.device.type == "cuda":
        row["gpu_busy_ms"] = gpu_busy_ms(step) / forwards
        row["host_ms"] = wall - row["gpu_busy_ms"]
        row["kernels_ms"] = {name: ms / forwards for name, ms in kernel_breakdown(step).items()}
    if profile_host:
        print(f"# host profile, {sessions} sessions, budget {budget}\n{host_profile(step)}", flush=True)
    for session_id in ids:
        engine.release_session(session_id)
    return row


def kernels(row: dict, top: int = 4) -> str:
    groups = list(row.get("kernels_ms", {}).items())[:top]
    return ", ".join(f"{name} {ms:.2f}" for name, ms in groups) or "-"


def markdown(result: dict) -> str:
    lines = [f"# One engine step of B sessions ({result['shape']}, {result['device']})", "",
             f"`{result['command']}`", "",
             "| sessions | budget | steps per call | context | sampling | step ms | GPU busy ms "
             "| host ms (step - busy) | floor ms | step / floor | GPU kernels, ms per step |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        busy, host = (f"{r[k]:.2f}" if k in r else "-" for k in ("gpu_busy_ms", "host_ms"))
        sampling = ", ".join([f"T {r['temperature']:g}" if r.get("temperature") else "greedy"]
                             + ([f"top-p {r['top_p']:g}"] if r.get("top_p", 1) < 1 else [])
                             + ([f"repetition {r['repetition_penalty']:g}"]
                                if r.get("repetition_penalty", 1) != 1 else [])
                             + ([f"frequency {r['frequency_penalty']:g}"] if r.get("frequency_penalty") else []))
        lines.append(f"| {r['sessions']} | {r['budget']} | {r['burst']} | {r['context']} | {sampling} "
                     f"| {r['step_ms']:.2f} "
                     f"| {busy} | {host} "
                     f"| {r['floor_ms']:.2f} | {r['step_ms'] / r['floor_ms']:.2f}x | {kernels(r)} |")
    return "\n".join(lines) + ("\n\nThe step is `Engine.step` (batch building, the forward, acceptance, commit) with "
                               "the GPU synchronised after it, the mean of 10 calls after 3 warm-ups (each call's in "
                               "the JSON, `step_ms_each`) (with several steps per call: `Engine.decode`, its times "
                               "divided by its steps); GPU busy is the union of its kernels' intervals in the "
                               "profiler; the floor reads the layer and LM-head weights and every session's KV once "
                               "at the measured copy bandwidth.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-8b", help="a shape of benchmarks/e2e_step.py")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 15])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--burst", type=int, default=1,
                        help="plain steps per engine call (Engine.decode) at budget 0; times are per step")
    parser.add_argument("--profile-host", action="store_true", help="print a cProfile of each point's steps")
    parser.add_argument("--temperature", type=float, default=0.0, help="every session samples (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    shape, drafter_shape, device = shape_of(args.shape)
    ours, _ = build_ours(shape, drafter_shape, device)
    # NOTE: room for the timed steps' commits (~25 calls)
    tokens_per_session = args.context + 64 * max(max(args.budgets) + 1, args.burst)
    engine = engine_for(ours, device, tokens_per_session, sessions=max(args.sessions))
    bandwidth, weights = copy_bandwidth(device), weight_counts(ours)
    engine.warm_up(max(args.budgets) + 1)
    sampling = replace(GREEDY, temperature=args.temperature, top_p=args.top_p,
                       repetition_penalty=args.repetition_penalty, frequency_penalty=args.frequency_penalty)
    rows = [measure(engine, weights, sessions, budget, args.context, bandwidth, args.profile_host, args.burst,
                    sampling) for budget in args.budgets for sessions in args.sessions]
    device_name = "CPU" if device == "cpu" else torch.cuda.get_device_name()
    result = {"command": "python " + " ".join(sys.argv), "shape": args.shape, "device": device_name,
              "bandwidth": bandwidth, "rows": rows}
    write_results(args.out_dir, f"batch_step_{args.shape}", result, markdown(result))


if __name__ == "__main__":
    main()
