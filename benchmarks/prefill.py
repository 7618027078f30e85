"""Prefill of one long prompt (time to first token, without the network) on one GPU, side by side:

- this engine: `Engine.create_session` of N tokens in chunks of C (C <= 256: every chunk through the Triton
  verify kernels, replayed from CUDA graphs as in a server; longer: the prefill path,
  ddtree_kernels.prefill_attention, for MLA shapes in its expanded form), random bf16 weights;
- HF transformers' model of the same shape with SDPA attention, prefilled in 8k chunks into its DynamicCache
  (`logits_to_keep=1`, as a server would);
- the FLOP floor: (2 x the layers' active weights x N + causal attention over N^2 / 2 token pairs) / the bf16
  matmul rate measured in the same run (`floor_s`).

    python benchmarks/prefill.py [--shape qwen3-8b|glm-4.7-flash|deepseek-v2-lite|tiny|tiny-mla]
        [--lengths 32768 131072] [--chunks 256 2048 4096 8192] [--hf-chunk 8192] [--server-warm-up]
        [--breakdown-chunk C] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import (  # noqa: E402
    build_hf,
    build_ours,
    kernel_breakdown,
    matmul_rate,
    our_session,
    shape_of,
    synchronize,
    write_results,
)
from modeling.config import ModelConfig  # noqa: E402
from modeling.target import CausalLM  # noqa: E402
from verifier_service.engine.config import EngineConfig  # noqa: E402
from verifier_service.engine.engine import Engine  # noqa: E402
from verifier_service.engine.kv_cache import KVCache  # noqa: E402
from verifier_service.engine.verify_batch import BlockSpec  # noqa: E402


def active_layer_weights(model: CausalLM) -> float:
    """The layer weights one token multiplies: all of a dense model's; of an MoE layer, the router, the shared
    experts and `experts_per_token` of its routed experts."""
    moe = model.config.moe
    total = 0.0
    for name, param in model.model.layers.named_parameters():
        routed = ".experts." in name and "shared" not in name
        total += param.numel() * (moe.experts_per_token / moe.num_experts if routed else 1)
    return total


def floor_s(config: ModelConfig, layer_weights: float, tokens: int, rate: float) -> float:
    """FLOPs / rate: 2 x the active weights per token, and causal attention over N^2 / 2 token pairs (MLA: the
    expanded form's qk + v widths per head, the cheaper of its two forms for a prefill)."""
    mla = config.mla
    per_pair = 2 * config.num_heads * (mla.qk_head_dim + mla.v_head_dim if mla else 2 * config.head_dim)
    return (2 * layer_weights * tokens + config.num_layers * per_pair * tokens * tokens / 2) / rate


def prompt(tokens: int, vocab: int) -> list[int]:
    return torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()


def engine_for(model: CausalLM, device: str, tokens: int, chunk: int) -> Engine:
    page_bytes = KVCache.page_bytes(model.config, 64, torch.bfloat16)
    return Engine(model, EngineConfig(page_size=64, kv_budget_bytes=(tokens // 64 + 8) * page_bytes,
                                      dtype="bfloat16", device=device, prefill_chunk=chunk,
                                      attention="triton" if device == "cuda" else "torch", max_context=tokens + 64))


def time_ours(model: CausalLM, device: str, tokens: int, chunk: int, server_warm_up: bool) -> float:
    engine = engine_for(model, device, tokens, chunk)
    if server_warm_up:
        engine.warm_up(16)  # NOTE: what a server does at start: the fused attention's plans for every chunk
    ids = prompt(tokens + 1, model.config.vocab_size)  # NOTE: the engine prefills all but the last token
    engine.create_session(ids[:min(tokens, 4 * chunk) + 1], "warm-up")  # kernels compiled, cuDNN plans built
    engine.release_session("warm-up")
    synchronize()
    started = time.perf_counter()
    engine.create_session(ids, "timed")
    synchronize()
    seconds = time.perf_counter() - started
    del engine
    torch.cuda.empty_cache() if device == "cuda" else None
    return seconds


def chunk_breakdown(model: CausalLM, device: str, tokens: int, chunk: int) -> dict[str, float]:
    """GPU ms per kernel group of the last chunk of a `tokens` prefill (its prefix holds random K/V)."""
    engine = engine_for(model, device, tokens, chunk)
    session = engine.session(our_session(engine, tokens - chunk))
    block = BlockSpec.chain(tokens - chunk, prompt(chunk, model.config.vocab_size), session.block_table.pages)
    return kernel_breakdown(lambda: engine.forward([block]), steps=2)


@torch.inference_mode()
def time_hf(hf, tokens: int, chunk: int) -> float:
    import transformers

    ids = torch.tensor([prompt(tokens, hf.config.vocab_size)], device=hf.device)
    hf(ids[:, :chunk], use_cache=True, logits_to_keep=1)  # warm-up
    synchronize()
    started = time.perf_counter()
    cache = transformers.DynamicCache()
    for start in range(0, tokens, chunk):
        hf(ids[:, start:start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)
    synchronize()
    seconds = time.perf_counter() - started
    del cache
    return seconds


def markdown(result: dict) -> str:
    lines = [f"# Prefill of one prompt ({result['shape']}, {result['device']})", "",
             f"Command: `{result['command']}`", "",
             f"bf16 matmul rate measured: {result['rate'] / 1e12:.0f} TFLOP/s. Floor: FLOPs / that rate. "
             f"HF: transformers with SDPA, {result['hf_chunk']}-token chunks into a DynamicCache.", "",
             "| tokens | chunk | ours s | floor s | ours / floor | HF SDPA s | HF / ours |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        hf, ours = row.get("hf_s"), row["seconds"]
        versus_hf = f"{hf:.2f} | {hf / ours:.2f}" if hf else "- | -"
        lines.append(f"| {row['tokens']} | {row['chunk']} | {ours:.2f} | {row['floor_s']:.2f} | "
                     f"{ours / row['floor_s']:.2f} | {versus_hf} |")
    if result["breakdown_ms"]:
        lines += ["", f"GPU time of the last {result['breakdown_chunk']}-token chunk of the longest prompt, per "
                  "kernel group (ms):", "", "| kernel | ms |", "|---|---|"]
        lines += [f"| `{name}` | {ms:.2f} |" for name, ms in result["breakdown_ms"].items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=("qwen3-8b", "glm-4.7-flash", "deepseek-v2-lite", "tiny", "tiny-mla"),
                        default="qwen3-8b", help="MLA shapes take the expanded prefill path for chunks over 256")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--chunks", type=int, nargs="+", default=[256, 2048, 4096, 8192])
    parser.add_argument("--hf-chunk", type=int, default=8192)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--server-warm-up", action="store_true",
                        help="warm the engine up as a server does at start (the prefill attention's plans for every "
                             "chunk are built then, not during the timed prefill)")
    parser.add_argument("--breakdown-chunk", type=int, default=0,
                        help="also profile the last chunk of this size of the longest prompt, per kernel group")
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    shape, drafter_shape, device = shape_of(args.shape)
    model, _ = build_ours(shape, drafter_shape, device)
    config, rate = model.config, matmul_rate(device)
    layer_weights = active_layer_weights(model)
    rows = []
    for tokens in args.lengths:
        for chunk in args.chunks:
            seconds = time_ours(model, device, tokens, chunk, args.server_warm_up)
            rows.append({"tokens": tokens, "chunk": chunk, "seconds": seconds,
                         "floor_s": floor_s(config, layer_weights, tokens, rate)})
            print(json.dumps(rows[-1]), flush=True)
    breakdown = {}
    if args.breakdown_chunk:
        breakdown = chunk_breakdown(model, device, max(args.lengths), args.breakdown_chunk)
        torch.cuda.empty_cache() if device == "cuda" else None
        print(json.dumps(breakdown), flush=True)
    del model
    if not args.no_hf:
        hf = build_hf(shape, device)
        for tokens in args.lengths:
            hf_s = time_hf(hf, tokens, args.hf_chunk)
            for row in rows:
                if row["tokens"] == tokens:
                    row["hf_s"] = hf_s
            print(json.dumps({"tokens": tokens, "hf_s": hf_s}), flush=True)
    result = {"command": "python " + " ".join(sys.argv), "shape": args.shape, "hf_chunk": args.hf_chunk,
              "device": "CPU" if device == "cpu" else torch.cuda.get_device_name(), "torch": torch.__version__,
              "rate": rate, "rows": rows, "breakdown_chunk": args.breakdown_chunk, "breakdown_ms": breakdown}
    write_results(args.out_dir, "prefill" if args.shape == "qwen3-8b" else f"prefill_{args.shape}", result,
                  markdown(result))


if __name__ == "__main__":
    main()
