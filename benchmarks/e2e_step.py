"""One decode step of a Qwen3-8B-shaped target (random bf16 weights) on one GPU, side by side:

- this engine: the verify step alone (forward + greedy head, replayed from a CUDA graph, and eagerly),
  the whole engine step (batch upload, verify, target tokens, acceptance, commit), and draft + tree + step
  with a 5-layer DFlash-shaped drafter; for the breakdown, the attention kernel alone x 36 layers;
- the DDTree reference way: HF transformers Qwen3ForCausalLM on the same weights, SDPA with a dense 4-D
  additive mask over prefix + tree, DynamicCache cropped back after the step;
- the roofline floor: max(weight + KV bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured here.

The KV prefix holds random values (timing does not depend on them); no prefill is run.

    python benchmarks/e2e_step.py [--contexts 1024 16384 65536 131072] [--budgets 15 63] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from drafter_service.dflash_drafter import DFlashDrafter
from modeling.config import ModelConfig
from modeling.dflash import DFlashConfig, DFlashModel
from modeling.speculation import DrafterSeed, DraftStep
from modeling.target import CausalLM
from modeling.tree import DraftTree
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine
from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.verify_batch import BlockSpec, build_verify_batch

QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
DRAFTER = {**QWEN3_8B, "architectures": ["DFlashDraftModel"], "num_hidden_layers": 5, "block_size": 16,
           "num_target_layers": 36, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
           "layer_types": ["full_attention"] * 5}
TINY = {**QWEN3_8B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
TINY_DRAFTER = {**DRAFTER, **{k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                   "num_attention_heads", "num_key_value_heads", "head_dim")},
                "num_target_layers": 6, "dflash_config": {"mask_token_id": 500, "target_layer_ids": [1, 2, 3, 4, 5]}}
WINDOW = 1024


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, reps: int = 10, warmup: int = 3) -> float:
    """Mean wall time in ms of fn() with the GPU synchronised around it (what a step costs end to end)."""
    for _ in range(warmup):
        fn()
    synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    synchronize()
    return (time.perf_counter() - started) / reps * 1e3


def copy_bandwidth(device: str) -> float:
    src = torch.empty(2 << 30 if device == "cuda" else 1 << 24, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / (ms / 1e3)  # read + write


def matmul_rate(device: str) -> float:
    n = 8192 if device == "cuda" else 512
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    ms = timed(lambda: a @ b, reps=20)
    return 2 * n**3 / (ms / 1e3)


def random_tree(budget: int, vocab: int, generator: torch.Generator) -> DraftTree:
    """A DDTree-like shape: a best-first tree of `budget` nodes over random per-depth scores."""
    from drafter_service.tree_builder import build_ddtree

    return build_ddtree(torch.randn(15, vocab, generator=generator).log_softmax(-1), budget)


def build_models(shape: dict, drafter_shape: dict, device: str) -> tuple[CausalLM, object, DFlashModel]:
    """The HF model (random init on the device) and ours sharing its parameters, and the drafter."""
    import transformers

    hf_config = transformers.Qwen3Config(**{k: v for k, v in shape.items() if k != "architectures"})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        hf = transformers.Qwen3ForCausalLM(hf_config).eval()
    config = ModelConfig.from_hf(shape)
    with torch.device("meta"):
        ours = CausalLM(config)
    ours.load_state_dict(hf.state_dict(), assign=True)
    ours.rotary = type(ours.rotary)(config.rope, config.head_dim).to(device)
    with torch.device(device):
        drafter = DFlashModel(DFlashConfig.from_hf(drafter_shape), config.vocab_size).eval()
    torch.set_default_dtype(torch.float32)
    drafter.embed_tokens, drafter.lm_head = ours.model.embed_tokens, ours.lm_head
    for model in (hf, ours, drafter):
        model.requires_grad_(False)
    return ours.eval(), hf, drafter


def our_session(engine: Engine, context: int) -> str:
    """A session whose pages hold `context` positions (random K/V: the pool is filled at start)."""
    session, _ = engine.create_session([1, 2])
    session.block_table.prepare_write(1, context, engine.kv)
    session.tokens = [7] * (context + 1)
    return session.session_id


def hf_step_fn(hf, context: int, tree: DraftTree):
    from transformers import DynamicCache

    config, device = hf.config, hf.device
    cache = DynamicCache()
    for layer in range(config.num_hidden_layers):
        kv_shape = (1, config.num_key_value_heads, context, config.head_dim)
        cache.update(torch.randn(kv_shape, dtype=torch.bfloat16, device=device),
                     torch.randn(kv_shape, dtype=torch.bfloat16, device=device), layer)
    ids = torch.tensor([[7, *tree.tokens]], device=device)
    positions = torch.tensor([[context, *(context + d for d in tree.depths)]], device=device)
    parents = [-1, *(p + 1 for p in tree.parents)]
    visible = torch.zeros(len(parents), context + len(parents), dtype=torch.bool, device=device)
    visible[:, :context] = True
    for row, parent in enumerate(parents):
        visible[row, context + row] = True
        if parent >= 0:
            visible[row, context:] |= visible[parent, context:]
    mask = torch.zeros(visible.shape, dtype=torch.bfloat16, device=device)
    mask.masked_fill_(~visible, torch.finfo(torch.bfloat16).min)
    mask = mask[None, None]

    @torch.inference_mode()
    def step() -> None:
        out = hf(input_ids=ids, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
        out.logits.argmax(-1).tolist()
        cache.crop(-ids.shape[1])  # NOTE: a negative crop means "drop the last k" in old and new transformers
    return step, cache


def attention_alone(engine: Engine, block: BlockSpec) -> float:
    """One layer's verify attention (the engine's kernel, graph bound as in a captured step), in ms."""
    if engine.device.type != "cuda":
        return float("nan")
    import triton.testing

    batch = build_verify_batch([block], engine.device)
    batch = dataclasses.replace(batch, max_prefix_len=engine.max_context)
    config, rows = engine.model_config, batch.num_tokens
    q = torch.randn(rows, config.num_heads, config.head_dim, dtype=engine.kv.k.dtype, device=engine.device)
    tree_k, tree_v = engine.scratch.k[0, :rows], engine.scratch.v[0, :rows]
    run = lambda: engine.backend.verify(q, engine.kv.k[0], engine.kv.v[0], tree_k, tree_v, batch, engine.sm_scale)
    return triton.testing.do_bench_cudagraph(run, return_mode="median")


def kernel_group(name: str) -> str:
    """A readable bucket for a kernel name: cuBLAS GEMMs under one name, Triton kernels (named after their
    Python function, `_..._kernel`) by their own."""
    if not name.startswith("_") and any(tag in name for tag in ("gemm", "nvjet", "cutlass", "xmma")):
        return "GEMM (cuBLAS)"
    return name.split("(")[0][:48]


def kernel_breakdown(fn, steps: int = 5) -> dict[str, float]:
    """GPU time per step of each kernel group fn() launches (CUDA-graph replays included), in ms."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            group = kernel_group(event.name)
            totals[group] = totals.get(group, 0.0) + event.time_range.elapsed_us() / 1e3 / steps
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def measure(engine: Engine, hf, drafter: DFlashDrafter, context: int, budget: int, floor: dict) -> dict:
    generator = torch.Generator().manual_seed(context + budget)
    config = engine.model_config
    tree = random_tree(budget, config.vocab_size, generator)
    session_id = our_session(engine, context)
    engine.start_generation(session_id, SamplingParams(max_new_tokens=1 << 20, ignore_eos=True))
    session = engine.session(session_id)

    session.block_table.prepare_write(session.kv_len, session.kv_len + tree.max_depth() + 1, engine.kv)
    block = BlockSpec.from_tree(session.kv_len, session.root, tree, session.block_table.pages)

    @torch.inference_mode()
    def verify_only() -> None:
        hidden, _ = engine.forward([block])
        engine.head(hidden, greedy=True).tolist()

    @torch.inference_mode()
    def verify_eager() -> None:
        hidden, _ = engine._forward(build_verify_batch([block], engine.device))
        engine.head(hidden, greedy=True).tolist()

    def engine_step() -> None:
        engine.step([(session_id, tree)])

    feature_dim = drafter.info.feature_dim
    seed_features = torch.randn(WINDOW, feature_dim, dtype=torch.bfloat16, device=engine.device)
    drafter.open(session_id, DrafterSeed([7] * WINDOW, seed_features, session.kv_len - WINDOW))
    step_number = iter(range(1 << 30))

    def whole_step() -> None:
        committed = [session.root]
        features = torch.randn(1, feature_dim, dtype=torch.bfloat16, device=engine.device)
        (drafted,) = drafter.draft([DraftStep(session_id, next(step_number), committed, features, session.root,
                                              drafter.mirrors.context_length(session_id), budget)])
        engine.step([(session_id, drafted)])

    row = {"context": context, "budget": budget, "verify_ms": timed(verify_only),
           "verify_eager_ms": timed(verify_eager),
           "attention_ms": attention_alone(engine, block) * config.num_layers,
           "engine_step_ms": timed(engine_step)}
    if engine.device.type == "cuda":
        row["verify_kernels_ms"] = kernel_breakdown(verify_only)
    try:
        row["draft_and_step_ms"] = timed(whole_step)
    except Exception as error:  # NOTE: keep the verify numbers when the drafter fails; the table says why
        row["draft_and_step_ms"], row["draft_error"] = float("nan"), repr(error)
    drafter.close(session_id)
    engine.release_session(session_id)
    hf_step, cache = hf_step_fn(hf, context, tree)
    row["hf_reference_ms"] = timed(hf_step, reps=5, warmup=2)
    del cache
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    kv_bytes = 2 * context * config.num_layers * config.num_kv_heads * config.head_dim * 2
    tokens = budget + 1
    attention_flops = 4 * context * tokens * config.num_heads * config.head_dim * config.num_layers
    flops = 2 * floor["matmul_params"] * tokens + attention_flops
    row["roofline_ms"] = 1e3 * max((floor["weight_bytes"] + kv_bytes) / floor["bandwidth"], flops / floor["rate"])
    row["verify_vs_roofline"] = row["verify_ms"] / row["roofline_ms"]
    row["hf_vs_verify"] = row["hf_reference_ms"] / row["verify_ms"]
    return row


def markdown(result: dict) -> str:
    lines = [f"# End-to-end decode step, Qwen3-8B shape, bf16, {result['device']}", "",
             f"`{result['command']}`", "",
             f"copy bandwidth {result['bandwidth'] / 1e12:.2f} TB/s, bf16 matmul {result['rate'] / 1e12:.0f} TFLOP/s.",
             "verify = forward replayed from a CUDA graph + greedy head + reading the tokens; eager = the same "
             "forward launched op by op; attention = the verify kernel alone x layers (its share of verify).", "",
             "| context | budget | roofline | verify | verify / roofline | eager verify | attention | engine step "
             "| draft + tree + step | HF reference | HF / verify |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['context'] // 1024}k | {r['budget']} | {r['roofline_ms']:.2f} | {r['verify_ms']:.2f} | "
                     f"{r['verify_vs_roofline']:.2f}x | {r['verify_eager_ms']:.2f} | {r['attention_ms']:.2f} | "
                     f"{r['engine_step_ms']:.2f} | {r['draft_and_step_ms']:.2f} | "
                     f"{r['hf_reference_ms']:.1f} | {r['hf_vs_verify']:.1f}x |")
    lines += ["", "Times in ms, mean over repeated steps with the GPU synchronised per measurement.", ""]
    for r in result["rows"]:
        kernels = r.get("verify_kernels_ms")
        if kernels:
            busy = sum(kernels.values())
            lines += [f"Verify step at {r['context'] // 1024}k, budget {r['budget']}: GPU time per kernel "
                      f"(profiler, {busy:.2f} ms busy of {r['verify_ms']:.2f} ms)", "", "| kernel | ms |", "|---|---|"]
            lines += [f"| `{name}` | {ms:.3f} |" for name, ms in kernels.items()] + [""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 16384, 65536, 131072])
    parser.add_argument("--budgets", type=int, nargs="+", default=[15, 63])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (a smoke test of this script)")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cpu" if args.tiny else "cuda"
    shape, drafter_shape = (TINY, TINY_DRAFTER) if args.tiny else (QWEN3_8B, DRAFTER)
    ours, hf, draft_model = build_models(shape, drafter_shape, device)
    config = ours.config
    max_context = max(args.contexts) + 4096
    page_bytes = 2 * config.num_layers * 64 * config.num_kv_heads * config.head_dim * 2
    engine = Engine(ours, EngineConfig(page_size=64, kv_budget_bytes=(max_context // 64 + 8) * page_bytes,
                                       dtype="bfloat16", device=device, attention="torch" if args.tiny else "triton",
                                       max_context=max_context))
    engine.kv.k.normal_()
    engine.kv.v.normal_()
    drafter = DFlashDrafter(draft_model, WINDOW)
    floor = {"bandwidth": copy_bandwidth(device), "rate": matmul_rate(device),
             "weight_bytes": sum(p.numel() * 2 for p in ours.parameters()),
             "matmul_params": sum(p.numel() for name, p in ours.named_parameters()
                                  if "embed" not in name and "norm" not in name)}
    rows = []
    for context in args.contexts:
        for budget in args.budgets:
            rows.append(measure(engine, hf, drafter, context, budget, floor))
            print(json.dumps(rows[-1]), flush=True)
    device_name = "CPU" if args.tiny else torch.cuda.get_device_name()
    result = {"command": "python " + " ".join(sys.argv), "device": device_name,
              "torch": torch.__version__, "bandwidth": floor["bandwidth"], "rate": floor["rate"], "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "e2e_step.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "e2e_step.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
