"""The projections of one Qwen3-8B decoder layer at verify-step row counts: cuBLAS against the skinny-M
Triton GEMM (ddtree_kernels/skinny_gemm.py), bf16, on one GPU.

Each time is the median per GEMM of a CUDA graph that runs the projection over 8 copies of its weight in
turn, so every call streams its weight from HBM as in a real 36-layer step (one copy would sit in L2).
"gate/up + SiLU" is what the MLP computes: cuBLAS's fused gate/up GEMM then the fused SiLU-product
kernel, against the gated skinny kernel that does both. Rows above MAX_ROWS (which the layers send to
cuBLAS) are timed too, to show where the limit comes from.

    python benchmarks/skinny_gemm.py [--rows 1 16 32 64] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from ddtree_kernels import fused_layer_ops, skinny_gemm

HIDDEN, INTERMEDIATE, Q_COLS, KV_COLS = 4096, 12288, 32 * 128, 8 * 128
# name -> (weight rows, weight columns, gated)
SHAPES = {"q/k/v": (Q_COLS + 2 * KV_COLS, HIDDEN, False), "o": (HIDDEN, Q_COLS, False),
          "gate/up + SiLU": (2 * INTERMEDIATE, HIDDEN, True), "down": (HIDDEN, INTERMEDIATE, False)}
COPIES = 8


def graph_us(gemm, x: torch.Tensor, weights: list[torch.Tensor], gated: bool) -> float:
    """Median µs per weight copy of `gemm` over all copies, replayed from a CUDA graph."""
    def run() -> None:
        for weight in weights:
            gemm(x, weight, gated)
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return do_bench(graph.replay, warmup=10, rep=100, return_mode="median") * 1e3 / COPIES


def cublas(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor:
    if gated:
        return fused_layer_ops.silu_mul(*F.linear(x, weight).chunk(2, dim=-1))
    return F.linear(x, weight)


def skinny(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> torch.Tensor:
    with mock.patch.object(skinny_gemm, "MAX_ROWS", max(skinny_gemm.MAX_ROWS, x.shape[0])):
        return (skinny_gemm.silu_mul_linear if gated else skinny_gemm.linear)(x, weight)


def measure(rows: list[int]) -> list[dict]:
    results = []
    for name, (n, k, gated) in SHAPES.items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(COPIES)]
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            error = (skinny(x, weights[0], gated).float() - cublas(x, weights[0], gated).float()).abs().max().item()
            row = {"gemm": name, "rows": m, "weight_bytes": n * k * 2, "max_abs_diff": error,
                   "used_by_layers": m <= skinny_gemm.MAX_ROWS}
            for label, gemm in (("cublas", cublas), ("skinny", skinny)):
                row[f"{label}_us"] = graph_us(gemm, x, weights, gated)
            results.append(row)
            print(json.dumps(row), flush=True)
    return results


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# Skinny-M GEMM: the layer projections of Qwen3-8B (bf16) at verify-step row counts",
        "",
        f"Command: `{command}`",
        "",
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}. µs per GEMM "
        "(median of CUDA-graph replays over 8 weight copies); TB/s = weight bytes / time. Rows marked * are "
        "above MAX_ROWS: the layers send them to cuBLAS.",
        "",
        "| GEMM | rows | cuBLAS µs | TB/s | skinny µs | TB/s | saved µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tbs = {k: r["weight_bytes"] / r[f"{k}_us"] / 1e6 for k in ("cublas", "skinny")}
        lines.append(f"| {r['gemm']} | {r['rows']}{'' if r['used_by_layers'] else '*'} | {r['cublas_us']:.1f} "
                     f"| {tbs['cublas']:.2f} | {r['skinny_us']:.1f} | {tbs['skinny']:.2f} "
                     f"| {r['cublas_us'] - r['skinny_us']:+.1f} |")
    lines += ["", "| rows | one layer, cuBLAS µs | one layer, skinny µs | 36 layers saved ms |", "|---|---|---|---|"]
    for m in sorted({r["rows"] for r in rows}):
        same = [r for r in rows if r["rows"] == m]
        base, ours = sum(r["cublas_us"] for r in same), sum(r["skinny_us"] for r in same)
        lines.append(f"| {m} | {base:.1f} | {ours:.1f} | {36 * (base - ours) / 1e3:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    command = "python " + " ".join(sys.argv)
    torch.manual_seed(0)
    rows = measure(args.rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"command": command, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "rows": rows}
    (args.out_dir / "skinny_gemm.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "skinny_gemm.md").write_text(markdown(rows, command))
    print(markdown(rows, command))


if __name__ == "__main__":
    main()
