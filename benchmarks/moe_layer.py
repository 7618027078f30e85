"""One MoE layer (router, routed experts, shared experts; random bf16 weights) on one GPU at verify-step and
prefill-chunk sizes:

- served: the layer as served on CUDA (`MoE.expert_sum` with the stacked experts: ddtree_kernels/fused_moe.py, or
  from 8192 (token, expert) pairs on torch's grouped GEMM where it runs), replayed from a CUDA graph;
  `experts_ms` is the routed experts alone as served, `fused_kernel_ms` the fused kernels at any size;
- torch: the reference grouped loop (`MoE.run_experts` before stacking: one GEMM per touched expert, a host sync
  for the counts), eager;
- floor: the larger of the bytes of the weights the step must read (the touched experts, the shared experts, the
  router) / the copy bandwidth and its FLOPs / the bf16 matmul rate, both measured in the same run.

Shapes: GLM-4.7-Flash (hidden 2048, 64 experts of width 1536, top-4, 1 shared) and DeepSeek-V2-Lite (hidden 2048,
64 experts of width 1408, top-6, 2 shared).

    python benchmarks/moe_layer.py [--tokens 1 16 64 256 1024 4096] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import triton
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import matmul_rate  # noqa: E402
from benchmarks.verify_attention import copy_bandwidth, time_graph  # noqa: E402
from ddtree_kernels.fused_moe import MoELaunch, fused_moe  # noqa: E402
from modeling.config import ModelConfig  # noqa: E402
from modeling.moe import MoE  # noqa: E402

SHAPES = {
    "glm-4.7-flash": {"architectures": ["Glm4MoeLiteForCausalLM"], "hidden_size": 2048, "moe_intermediate_size": 1536,
                      "n_routed_experts": 64, "num_experts_per_tok": 4, "n_shared_experts": 1, "n_group": 1,
                      "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.8},
    "deepseek-v2-lite": {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
                         "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6,
                         "n_shared_experts": 2, "topk_method": "greedy", "n_group": 1, "topk_group": 1},
}
COMMON = {"vocab_size": 1024, "num_hidden_layers": 1, "num_attention_heads": 16, "intermediate_size": 10944,
          "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}


def build(shape: dict) -> MoE:
    config = ModelConfig.from_hf({**COMMON, **shape})
    with torch.device("cuda"):
        layer = MoE(config).requires_grad_(False)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=config.hidden_size**-0.5)
    for module in (*layer.experts, layer.shared_experts):
        module.to(torch.bfloat16)
    return layer


def floor_bytes(layer: MoE, ids: torch.Tensor) -> int:
    """Weights the step reads at least once: each touched expert, the shared experts, the fp32 router."""
    expert = sum(p.numel() * p.element_size() for p in layer.experts[0].parameters())
    shared = sum(p.numel() * p.element_size() for p in layer.shared_experts.parameters())
    router = layer.gate.weight.numel() * 4
    return int(ids.unique().numel()) * expert + shared + router


def floor_flops(layer: MoE, tokens: int) -> int:
    """Multiply-adds x 2 of the router, the k routed experts of each token and the shared experts."""
    expert = sum(p.numel() for p in layer.experts[0].parameters())
    shared = sum(p.numel() for p in layer.shared_experts.parameters())
    return 2 * tokens * (layer.gate.weight.numel() + layer.gate.moe.experts_per_token * expert + shared)


def measure(name: str, layer: MoE, tokens: int, bw: float, rate: float) -> dict:
    x = torch.randn(tokens, layer.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
    ids, weights = layer.gate(x)
    torch_ms = do_bench(lambda: layer.run_experts(x, ids, weights), warmup=5, rep=40, return_mode="median")
    layer.fuse_projections()
    stacked = layer.stacked
    want = None
    try:
        layer.stacked = None
        want = layer.run_experts(x, ids, weights)
    finally:
        layer.stacked = stacked
    got = fused_moe(x, ids, weights, stacked.w13, stacked.w2, stacked.first_expert)
    err = (got - want).abs().max().item()
    if not err < 5e-2 * max(1.0, want.abs().max().item()):
        raise AssertionError(f"fused MoE disagrees with the torch loop: {err}")
    floor, flops = floor_bytes(layer, ids), floor_flops(layer, tokens)
    row = {"shape": name, "tokens": tokens, "experts_touched": int(ids.unique().numel()), "floor_bytes": floor,
           "floor_flops": flops, "floor_ms": 1e3 * max(floor / bw, flops / rate), "err": err,
           "torch_experts_ms": torch_ms,
           "experts_ms": time_graph(lambda: stacked(x, ids, weights)),
           "fused_kernel_ms": time_graph(lambda: fused_moe(x, ids, weights, stacked.w13, stacked.w2)),
           "fused_layer_ms": time_graph(lambda: layer.expert_sum(x))}
    row["layer_vs_floor"] = row["fused_layer_ms"] / row["floor_ms"]
    return row


SWEEP = [MoELaunch(bm, bn, bk, w, st) for bm, bn, bk, w, st in [
    (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4), (16, 32, 128, 4, 4), (16, 64, 256, 4, 3),
    (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 8, 3), (16, 64, 128, 2, 4),
]]


def sweep(tokens: list[int]) -> list[dict]:
    """The routed-expert kernels at each launch shape (how `default_moe_launch` was chosen), GLM-4.7-Flash shape."""
    layer = build(SHAPES["glm-4.7-flash"])
    layer.fuse_projections()
    rows = []
    for n in tokens:
        x = torch.randn(n, layer.gate.weight.shape[1], device="cuda", dtype=torch.bfloat16)
        ids, weights = layer.gate(x)
        for launch in SWEEP:
            ms = time_graph(partial(fused_moe, x, ids, weights, layer.stacked.w13, layer.stacked.w2, 0, launch))
            rows.append({"tokens": n, **launch.__dict__, "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(result: dict) -> str:
    lines = [f"# MoE layer at verify-step and prefill sizes, one {result['device']} (bf16, random weights)", "",
             f"Command: `{result['command']}`", "",
             f"Measured in the same run: copy bandwidth {result['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), "
             f"bf16 matmul {result['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s. Floor = the larger of the bytes of the "
             "touched experts + shared experts + router / that bandwidth and the layer's FLOPs / that rate. Served "
             "and fused times are CUDA-graph replays (medians); the torch loop runs eagerly (it syncs for the expert "
             "counts, so it cannot be captured).", "",
             "| shape | tokens | experts touched | floor | layer as served | x floor | routed experts as served "
             "| fused kernels | torch loop |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['tokens']} | {r['experts_touched']} | {r['floor_ms']:.3f} "
              f"| {r['fused_layer_ms']:.3f} | {r['layer_vs_floor']:.2f} | {r['experts_ms']:.3f} "
              f"| {r['fused_kernel_ms']:.3f} | {r['torch_experts_ms']:.3f} |" for r in result["rows"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--sweep", action="store_true", help="time the kernels' launch shapes instead")
    args = parser.parse_args()
    command = "python " + " ".join(sys.argv)
    torch.manual_seed(0)
    started = time.time()
    bw, rate = copy_bandwidth(), matmul_rate("cuda")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        (args.out_dir / "moe_layer_sweep.json").write_text(json.dumps({"command": command, "rows": sweep(args.tokens)},
                                                                      indent=1) + "\n")
        return
    rows = []
    for name, shape in SHAPES.items():
        for tokens in args.tokens:
            rows.append(measure(name, build(shape), tokens, bw, rate))
            print(json.dumps(rows[-1]), flush=True)
    result = {"command": command, "device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw,
              "matmul_flops_per_s": rate, "torch": torch.__version__, "triton": triton.__version__, "rows": rows,
              "seconds": time.time() - started}
    (args.out_dir / "moe_layer.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "moe_layer.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
