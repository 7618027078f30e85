"""The n-gram drafter's CPU time: a seed (Open) of C history tokens, and a decode step (the step's accepted tokens
appended, then a tree of budget B drafted) per session. At 64 sessions one drafter replica serves every session's
step in turn, so its per-step time times the sessions is the draft round's floor (benchmarks/results/
throughput_step_loop.md: ~170 us per session-step on the H200 host, half of it appending to the index).

Texts: "repetitive" is the throughput benchmark's prompt (a paragraph over and over: long trees, every step
accepted); "varied" is seeded random tokens from a 4k vocabulary with short repeats (few, short matches).

    python benchmarks/ngram_drafter.py [--contexts 1024 32768 131072] [--steps 200]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from e2e_step import titled_table, write_results
from throughput import PARAGRAPH

from drafter_service.ngram_drafter import NgramDrafter
from modeling.speculation import DrafterSeed, DraftStep

ACCEPTED = 15  # tokens each step commits besides its root (acceptance near the budget's depth)


def text(kind: str, length: int) -> list[int]:
    if kind == "repetitive":
        body = PARAGRAPH.encode() * (length // len(PARAGRAPH) + 1)
        return list(body[:length])
    rng = random.Random(0)
    tokens: list[int] = []
    while len(tokens) < length:  # NOTE: runs of fresh tokens, now and then a short copy of an earlier stretch
        if tokens and rng.random() < 0.2:
            start = rng.randrange(len(tokens))
            tokens += tokens[start:start + rng.randrange(2, 8)]
        else:
            tokens += [rng.randrange(4096) for _ in range(rng.randrange(4, 32))]
    return tokens[:length]


def measure(kind: str, context: int, steps: int, budget: int) -> dict:
    tokens = text(kind, context + steps * (ACCEPTED + 1) + 1)
    drafter = NgramDrafter()
    started = time.perf_counter()
    drafter.open("s", DrafterSeed(tokens[:context], None, 0))
    seed_s = time.perf_counter() - started
    position, times, nodes = context, [], []
    committed: list[int] = []
    for step in range(steps):
        root = tokens[position + len(committed)]
        draft = DraftStep("s", step, committed, None, root, position, budget)
        started = time.perf_counter()
        (tree,) = drafter.draft([draft])
        times.append(time.perf_counter() - started)
        nodes.append(len(tree))
        # NOTE: the next step commits the root and the following ACCEPTED tokens of the text
        position += len(committed)
        committed = tokens[position:position + ACCEPTED + 1]
    return {"text": kind, "context": context, "budget": budget, "steps": steps, "seed_ms": seed_s * 1e3,
            "step_us_p50": statistics.median(times) * 1e6, "step_us_mean": statistics.mean(times) * 1e6,
            "mean_tree_nodes": statistics.mean(nodes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 32768, 131072])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--budget", type=int, default=31)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    rows = [measure(kind, context, args.steps, args.budget)
            for kind in ("repetitive", "varied") for context in args.contexts]
    for row in rows:
        print(row)
    command = " ".join(["python benchmarks/ngram_drafter.py", *sys.argv[1:]])
    table = titled_table(
        f"The n-gram drafter per session ({platform.machine()}, one process, budget {args.budget})", command,
        ["text", "history tokens", "seed ms", "step us (p50)", "step us (mean)", "tree nodes"],
        [[r["text"], str(r["context"]), f"{r['seed_ms']:.2f}", f"{r['step_us_p50']:.0f}",
          f"{r['step_us_mean']:.0f}", f"{r['mean_tree_nodes']:.1f}"] for r in rows])
    write_results(args.out_dir, "ngram_drafter", {"command": command, "rows": rows}, table)


if __name__ == "__main__":
    main()
