"""The DFlash drafter's attention, one layer: S sessions' B block queries over their slots' context K/V (C ring
rows each) and the block's own K/V, as a draft step runs it in every drafter layer. The Triton kernel
(`ddtree_kernels/draft_attention.py`) against the torch path it replaced on CUDA (`modeling.dflash.block_attention`:
gather the slots, mask, SDPA) and against the floor: the drafted slots' K and V read once at the measured copy
bandwidth.

    python benchmarks/draft_attention.py [--sessions 1 3 8 16 64] [--capacity 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import titled_table, write_results  # noqa: E402
from benchmarks.verify_attention import copy_bandwidth, time_graph  # noqa: E402
from ddtree_kernels.draft_attention import draft_block_attention, plan_splits  # noqa: E402
from modeling.dflash import LayerContext, block_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # the published Qwen3-8B DFlash drafter
SLOTS = 64  # the mirrors' slots (the drafter's --max-sessions)


def layer_inputs(sessions: int, capacity: int, gen: torch.Generator) -> dict:
    """Every slot's ring full (its session past `capacity` tokens), `sessions` of them drafted, bf16 on the GPU."""
    shape = (SLOTS, capacity + BLOCK, KV_HEADS, HEAD_DIM)
    lengths = torch.randint(capacity + 1, 3 * capacity, (SLOTS,), generator=gen)
    held = lengths[:, None] - capacity + torch.arange(capacity)  # the last `capacity` positions, in ring rows
    positions = torch.empty(SLOTS, capacity, dtype=torch.long).scatter_(1, held % capacity, held)
    slots = torch.randperm(SLOTS, generator=gen)[:sessions]
    qkv = torch.randn(sessions * BLOCK, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen)
    inputs = dict(q=qkv[:, :HEADS], k=qkv[:, HEADS:-KV_HEADS], v=qkv[:, -KV_HEADS:],
                  keys=torch.randn(shape, generator=gen), values=torch.randn(shape, generator=gen),
                  positions=positions, slots=slots, block_pos=lengths[slots, None] + torch.arange(BLOCK),
                  context_start=torch.zeros(sessions, dtype=torch.long))
    return {name: t.to("cuda", torch.bfloat16 if t.is_floating_point() else t.dtype) for name, t in inputs.items()}


def measure(sessions: int, capacity: int, bandwidth: float, gen: torch.Generator) -> dict:
    """Median ms of each path (checked against each other first) and the floor's share of the kernel's."""
    x = layer_inputs(sessions, capacity, gen)
    context = LayerContext(x["keys"], x["values"], x["positions"])

    def torch_path() -> torch.Tensor:
        return block_attention(x["q"], x["k"], x["v"], context, x["slots"], x["block_pos"], x["context_start"],
                               None, False)

    def kernel() -> torch.Tensor:
        return draft_block_attention(**x, window=None, causal=False)

    err = (kernel().float() - torch_path().float()).abs().max().item()
    if not err < 3e-2:
        raise AssertionError(f"{sessions} sessions: the kernel disagrees with the torch path by {err}")
    floor_ms = 2 * sessions * (capacity + BLOCK) * KV_HEADS * HEAD_DIM * 2 / bandwidth * 1e3
    kernel_ms = time_graph(kernel)
    splits = plan_splits(sessions * KV_HEADS, capacity + BLOCK, torch.device("cuda"))[0]
    return {"sessions": sessions, "capacity": capacity, "splits": splits, "torch_ms": time_graph(torch_path),
            "kernel_ms": kernel_ms, "floor_ms": floor_ms, "floor_share": floor_ms / kernel_ms, "max_abs_err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 3, 8, 16, 64])
    parser.add_argument("--capacity", type=int, default=1024, help="context rows per slot (the drafter's window)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("draft_attention.py times the Triton kernel on a CUDA GPU")
    gen, bandwidth, rows = torch.Generator().manual_seed(0), copy_bandwidth(), []
    for sessions in args.sessions:
        rows.append(measure(sessions, args.capacity, bandwidth, gen))
        print(rows[-1], flush=True)
    command = " ".join(["python benchmarks/draft_attention.py", *sys.argv[1:]])
    table = titled_table(
        f"DFlash draft attention, one layer (Qwen3-8B drafter: {HEADS} q / {KV_HEADS} KV heads, d={HEAD_DIM}, "
        f"block {BLOCK}, bf16; {torch.cuda.get_device_name()})", command,
        ["sessions", "context rows", "splits", "torch path ms", "kernel ms", "torch / kernel", "floor ms",
         "floor / kernel"],
        [[str(r["sessions"]), str(r["capacity"]), str(r["splits"]), f"{r['torch_ms']:.4f}", f"{r['kernel_ms']:.4f}",
          f"{r['torch_ms'] / r['kernel_ms']:.1f}x", f"{r['floor_ms']:.4f}", f"{r['floor_share']:.0%}"] for r in rows])
    write_results(args.out_dir, "draft_attention", {"command": command, "bandwidth": bandwidth, "rows": rows}, table)


if __name__ == "__main__":
    main()
