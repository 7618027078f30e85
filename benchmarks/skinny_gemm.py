"""The projections of one dense decoder layer (Qwen3-8B's, or `--shape qwen3-0.6b`'s) at verify-step row counts:
cuBLAS against the skinny-M Triton GEMM (ddtree_kernels/skinny_gemm.py), bf16, on one GPU.

Each time is the median per GEMM of a CUDA graph that runs the projection over 8 copies of its weight in
turn, so every call streams its weight from HBM as in a real 36-layer step (one copy would sit in L2).
"gate/up + SiLU" is what the MLP computes: cuBLAS's fused gate/up GEMM then the fused SiLU-product
kernel, against the gated skinny kernel that does both. Rows above MAX_ROWS (which the layers send to
cuBLAS) are timed too, to show where the limit comes from.

    python benchmarks/skinny_gemm.py [--shape qwen3-8b] [--rows 1 16 32 64] [--out-dir DIR]
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.e2e_step import shape_of  # noqa: E402
from ddtree_kernels import fused_layer_ops, skinny_gemm  # noqa: E402

COPIES = 8


def layer_gemms(shape: str) -> dict[str, tuple[int, int, bool]]:
    """A dense shape's projections: name -> (weight rows, weight columns, gated)."""
    config = shape_of(shape)[0]
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_cols, kv_cols = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {"q/k/v": (q_cols + 2 * kv_cols, hidden, False), "o": (hidden, q_cols, False),
            "gate/up + SiLU": (2 * intermediate, hidden, True), "down": (hidden, intermediate, False)}


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


def measure(shape: str, rows: list[int]) -> list[dict]:
    results = []
    for name, (n, k, gated) in layer_gemms(shape).items():
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


def markdown(rows: list[dict], command: str, shape: str) -> str:
    layers = shape_of(shape)[0]["num_hidden_layers"]
    lines = [
        f"# Skinny-M GEMM: the layer projections of the {shape} shape (bf16) at verify-step row counts",
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
    lines += ["", f"| rows | one layer, cuBLAS µs | one layer, skinny µs | {layers} layers saved ms |",
              "|---|---|---|---|"]
    for m in sorted({r["rows"] for r in rows}):
        same = [r for r in rows if r["rows"] == m]
        base, ours = sum(r["cublas_us"] for r in same), sum(r["skinny_us"] for r in same)
        lines.append(f"| {m} | {base:.1f} | {ours:.1f} | {layers * (base - ours) / 1e3:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=("qwen3-8b", "qwen3-0.6b"), default="qwen3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    command = "python " + " ".join(sys.argv)
    torch.manual_seed(0)
    rows = measure(args.shape, args.rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = {"command": command, "shape": args.shape, "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "rows": rows}
    name = "skinny_gemm" if args.shape == "qwen3-8b" else f"skinny_gemm_{args.shape}"
    (args.out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"{name}.md").write_text(markdown(rows, command, args.shape))
    print(markdown(rows, command, args.shape))


if __name__ == "__main__":
    main()
