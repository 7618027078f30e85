"""Time the DDTree builder on the CPU: the heap part alone, and top-k + heap together; and the drafter's tree
stage, a batch's trees from its ranked top-k rows already on the host (trees_from_top_k).

Issue 3's target: the heap part under 1 ms for budget 256 (B = 16, V = 151936, Qwen3's vocabulary).
Writes benchmarks/results/ddtree_builder.json and .md.

    python benchmarks/ddtree_builder.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.e2e_step import git_commit  # noqa: E402
from drafter_service.tree_builder import (  # noqa: E402
    best_first_tree,
    build_ddtree,
    top_k_log_probs,
    top_k_per_depth,
    trees_from_top_k,
)

BLOCK_SIZE = 16
VOCAB = 151936
BUDGETS = (15, 63, 256)
PEAKS = (0.0, 40.0)
BATCH_SESSIONS = (1, 16, 64)
BATCH_BUDGET = 15
RESULTS = Path(__file__).resolve().parent / "results"


def _timings_ms(fn, repeats: int) -> list[float]:
    """Wall times of `repeats` calls after a few warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _summary(times: list[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {"median_ms": statistics.median(ordered), "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
            "min_ms": ordered[0]}


def drafter_like_logp(peak: float, seed: int) -> torch.Tensor:
    """[B-1, V] float32 log-probs: N(0, 3^2) logits plus `peak` on one token per depth.

    peak 0 gives flat rows (a wide, shallow tree); a large peak gives a confident drafter (a deep tree).
    """
    gen = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(BLOCK_SIZE - 1, VOCAB, generator=gen)  # [B-1, V]
    logits[:, 0] += peak
    return torch.log_softmax(logits, dim=-1)


def measure(budget: int, logp: torch.Tensor, repeats: int) -> dict:
    """logp: [B-1, V] float32 on the CPU."""
    values, ids = top_k_per_depth(logp, budget)
    heap = _summary(_timings_ms(lambda: best_first_tree(values, ids, budget), repeats))
    total = _summary(_timings_ms(lambda: build_ddtree(logp, budget), max(repeats // 4, 10)))
    tree = build_ddtree(logp, budget)
    return {"budget": budget, "nodes": len(tree), "max_depth": tree.max_depth(),
            "heap": heap, "topk_plus_heap": total}


def measure_batch(sessions: int, repeats: int) -> dict:
    """The tree stage of a draft of `sessions` sessions at budget BATCH_BUDGET: their rows alternate between flat
    and confident ones, ranked top-k (fp32 values, int64 ids) on the host as the draft graphs hand them over."""
    logp = torch.stack([drafter_like_logp(PEAKS[i % len(PEAKS)], seed=i) for i in range(min(sessions, 4))])
    values, ids = top_k_log_probs(logp.repeat((sessions + 3) // 4, 1, 1)[:sessions], BATCH_BUDGET)
    budgets = [BATCH_BUDGET] * sessions
    return {"sessions": sessions, "budget": BATCH_BUDGET,
            "trees": _summary(_timings_ms(lambda: trees_from_top_k(values, ids, budgets), repeats))}


def to_markdown(rows: list[dict], batch_rows: list[dict], command: str, env: dict) -> str:
    lines = [
        "# DDTree builder on the CPU",
        "",
        f"Command: `{command}` (at commit {env['commit']})",
        "",
        f"B = {BLOCK_SIZE} ({BLOCK_SIZE - 1} depths), V = {VOCAB}, float32 log_softmax of N(0, 3^2) logits "
        f"plus `peak` on one token per depth (0: flat rows, wide tree; 40: confident drafter, deep tree); "
        f"{env['cpu']}, torch {env['torch']} ({env['threads']} threads), Python {env['python']}.",
        "Heap = best_first_tree on the transferred top-k lists; top-k + heap = build_ddtree from the tensor.",
        "",
        "| peak | budget | nodes | max depth | heap median (ms) | heap p90 (ms) | top-k + heap median (ms) | "
        "top-k + heap p90 (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        h, t = r["heap"], r["topk_plus_heap"]
        lines.append(f"| {r['peak']:g} | {r['budget']} | {r['nodes']} | {r['max_depth']} | {h['median_ms']:.3f} | "
                     f"{h['p90_ms']:.3f} | {t['median_ms']:.3f} | {t['p90_ms']:.3f} |")
    lines += ["", "The drafter's tree stage: trees_from_top_k over a batch's ranked top-k rows (budget "
              f"{BATCH_BUDGET}, flat and confident rows in turn), already on the host.", "",
              "| sessions | trees median (ms) | trees p90 (ms) |", "|---|---|---|"]
    lines += [f"| {r['sessions']} | {r['trees']['median_ms']:.3f} | {r['trees']['p90_ms']:.3f} |" for r in batch_rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    rows = [{"peak": peak, **measure(budget, drafter_like_logp(peak, seed=0), args.repeats)}
            for peak in PEAKS for budget in BUDGETS]
    batch_rows = [measure_batch(sessions, args.repeats) for sessions in BATCH_SESSIONS]
    env = {"cpu": _cpu_name(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "python": platform.python_version(), "commit": git_commit()}
    command = "python benchmarks/ddtree_builder.py" + ("" if args.repeats == 200 else f" --repeats {args.repeats}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "ddtree_builder.json").write_text(json.dumps({"command": command, "env": env,
                                                              "block_size": BLOCK_SIZE, "vocab": VOCAB,
                                                              "results": rows, "batches": batch_rows},
                                                             indent=2) + "\n")
    markdown = to_markdown(rows, batch_rows, command, env)
    (RESULTS / "ddtree_builder.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
