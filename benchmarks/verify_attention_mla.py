"""MLA verify attention for one layer (absorbed form, 512 + 64 latent entries, bf16) on one GPU, side by side:

- ours: `ddtree_kernels.latent_verify_attention` over the paged latent cache (page size 64, shuffled pages);
- page1: the status quo of tree verification: page size 1, one index load per prefix token, one program per
  (query token, block of 16 heads) walking the prefix serially, then the tree under a dense mask (Triton, below);
- sdpa_dense: `scaled_dot_product_attention` over K/V decompressed per head through kv_b_proj (128 + 64 key,
  128 value dims), one additive mask; the decompression itself is timed apart (`decompress_ms`);
- roofline: max(latent bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in the same run.

Heads: 16 (DeepSeek-V2-Lite; also a tensor-parallel-8 shard of 128), 20 (GLM-4.7-Flash), 64 (Kimi K2), 128
(DeepSeek-V3). Every method is checked against ours (in value space for SDPA) before it is timed.
Run through `python benchmarks/verify_attention.py --mla ...`, or directly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.verify_attention import copy_bandwidth, matmul_rate, time_graph  # noqa: E402
from ddtree_kernels.latent_verify import default_latent_config, latent_verify_attention, prefix_config  # noqa: E402
from ddtree_kernels.lse_merge import merge_partials  # noqa: E402
from ddtree_kernels.reference import pack_tree_mask  # noqa: E402
from ddtree_kernels.split_kv import SplitConfig, plan_splits  # noqa: E402

LORA, ROPE, NOPE, VDIM = 512, 64, 128, 128
C = LORA + ROPE
SCALE = (NOPE + ROPE) ** -0.5
PAGE = 64


@dataclass(frozen=True)
class Problem:
    heads: int
    prefix_len: int
    tree_len: int

    @property
    def latent_bytes(self) -> int:
        return (self.prefix_len + self.tree_len) * C * 2

    @property
    def flops(self) -> int:
        return 2 * self.tree_len * self.heads * (self.prefix_len + self.tree_len) * (C + LORA)


@triton.jit
def _page1_kernel(
    q_ptr, entries, kv_indices, tree_entries, dense_mask, out_ptr, prefix_len, tree_len, qk_scale,
    NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, LORA: tl.constexpr, ROPE: tl.constexpr,
):
    """One program per (query token, head block): every prefix key through its own index, serially."""
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    dims, pe_dims = tl.arange(0, LORA), tl.arange(0, ROPE)
    q_rows = q_ptr + (token * NUM_HEADS + heads) * (LORA + ROPE)
    q_c = tl.load(q_rows[:, None] + dims[None, :], mask=head_ok[:, None], other=0.0)
    q_pe = tl.load(q_rows[:, None] + LORA + pe_dims[None, :], mask=head_ok[:, None], other=0.0)
    acc = tl.zeros([BLOCK_H, LORA], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, prefix_len + tree_len, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_prefix = cols < prefix_len
        in_tree = (cols >= prefix_len) & (cols < prefix_len + tree_len)
        idx = tl.load(kv_indices + cols, mask=in_prefix, other=0).to(tl.int64)
        rows = tl.where(in_prefix, entries + idx * (LORA + ROPE), tree_entries + (cols - prefix_len) * (LORA + ROPE))
        ok = in_prefix | in_tree
        c = tl.load(rows[:, None] + dims[None, :], mask=ok[:, None], other=0.0)
        pe = tl.load(rows[:, None] + LORA + pe_dims[None, :], mask=ok[:, None], other=0.0)
        s = tl.dot(q_c, tl.trans(c)) + tl.dot(q_pe, tl.trans(pe))
        visible = in_prefix | (tl.load(dense_mask + token * tree_len + cols - prefix_len, mask=in_tree, other=0) != 0)
        s = tl.where(visible[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = out_ptr + (token * NUM_HEADS + heads)[:, None] * LORA + dims[None, :]
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])


class Case:
    """One session's tensors in every layout the methods need, over the same latent bytes."""

    def __init__(self, entries: torch.Tensor, problem: Problem, gen: torch.Generator):
        h, n, t = problem.heads, problem.prefix_len, problem.tree_len
        self.problem = problem
        self.entries = entries[:n]  # [n, C]
        # kv_b_proj's key and value halves; the absorbed query is [W_UK^T q_nope, q_pe] (modeling/mla.py)
        self.w_uk = torch.randn(h, NOPE, LORA, device="cuda", dtype=torch.bfloat16) * LORA**-0.5
        self.w_uv = torch.randn(h, VDIM, LORA, device="cuda", dtype=torch.bfloat16) * LORA**-0.5
        self.q_nope = torch.randn(t, h, NOPE, device="cuda", dtype=torch.bfloat16)
        q_pe = torch.randn(t, h, ROPE, device="cuda", dtype=torch.bfloat16)
        self.q = torch.cat([torch.einsum("thd,hdc->thc", self.q_nope, self.w_uk), q_pe], -1)  # [T, H, C]
        self.tree_entries = torch.randn(t, C, device="cuda", dtype=torch.bfloat16)
        mask = torch.eye(t, dtype=torch.bool)
        for node in range(1, t):
            mask[node] = mask[int(torch.randint(0, node, (1,), generator=gen))]
            mask[node, node] = True
        self.dense_mask = mask.cuda()
        self.tree_mask = pack_tree_mask(self.dense_mask)
        self.cu_tree = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        self.prefix_lens = torch.tensor([n], dtype=torch.int32, device="cuda")
        num_pages = max(1, n // PAGE)
        self.table = torch.randperm(num_pages, generator=gen).cuda().to(torch.int32)[None]
        self.pages = entries[:num_pages * PAGE].view(num_pages, PAGE, 1, C)

    def ours(self, cfg: SplitConfig | None = None):
        p = self.problem
        return lambda: latent_verify_attention(self.q, self.pages, self.table, self.prefix_lens, self.tree_entries,
                                               self.cu_tree, self.tree_mask, SCALE, LORA, p.prefix_len, p.tree_len,
                                               cfg=cfg)

    def page1(self):
        """Per-token indices of the same shuffled pages: the page-size-1 view of identical bytes."""
        h, n, t = self.problem.heads, self.problem.prefix_len, self.problem.tree_len
        pos = torch.arange(n, device="cuda")
        indices = (self.table[0].long()[pos // PAGE] * PAGE + pos % PAGE).to(torch.int32)
        out = torch.empty(t, h, LORA, device="cuda", dtype=torch.bfloat16)
        mask = self.dense_mask.to(torch.int8).contiguous()

        def run():
            _page1_kernel[(t, triton.cdiv(h, 16))](self.q, self.entries, indices, self.tree_entries, mask, out, n, t,
                                                  SCALE * 1.4426950408889634, NUM_HEADS=h, BLOCK_H=16, BLOCK_N=32,
                                                  LORA=LORA, ROPE=ROPE, num_warps=4, num_stages=2)
            return out
        return run

    def sdpa_dense(self):
        """HF's path: decompress every cached latent into per-head K/V, then one masked SDPA. Returns the
        decompression and the attention as two callables (the first fills the buffers the second reads)."""
        n, t = self.problem.prefix_len, self.problem.tree_len
        latents = torch.cat([self.entries, self.tree_entries])  # [S, C]
        visible = torch.cat([torch.ones(t, n, dtype=torch.bool, device="cuda"), self.dense_mask], 1)
        bias = torch.zeros(t, n + t, device="cuda", dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))
        q = torch.cat([self.q_nope, self.q[..., LORA:]], -1).transpose(0, 1)[None]  # [1, H, T, 192]
        w_uk, w_uv = self.w_uk, self.w_uv
        kv = {}

        def decompress():
            k_nope = torch.einsum("sc,hdc->hsd", latents[:, :LORA], w_uk)  # [H, S, 128]
            k_pe = latents[:, LORA:][None].expand(k_nope.shape[0], -1, -1)
            kv["k"] = torch.cat([k_nope, k_pe], -1)[None]
            kv["v"] = torch.einsum("sc,hdc->hsd", latents[:, :LORA], w_uv)[None]

        def attend():
            return torch.nn.functional.scaled_dot_product_attention(q, kv["k"], kv["v"], attn_mask=bias[None, None],
                                                                    scale=SCALE)[0].transpose(0, 1)
        return decompress, attend


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    if not err < 2e-2 * max(1.0, scale):
        raise AssertionError(f"{name} disagrees with ours: max abs err {err} (values up to {scale})")
    return err


def measure(entries: torch.Tensor, problem: Problem, gen: torch.Generator, sdpa_max: int) -> dict:
    case = Case(entries, problem, gen)
    ours = case.ours()
    want = ours()
    row = {**asdict(problem), "ours_ms": time_graph(ours)}
    triton_only = case.ours(default_latent_config(problem.heads * problem.tree_len, LORA))
    row["err_triton"] = check("triton", triton_only(), want)
    row["triton_ms"] = time_graph(triton_only)
    page1 = case.page1()
    row["err_page1"] = check("page1", page1(), want)
    row["page1_ms"] = time_graph(page1)
    if problem.prefix_len * problem.heads <= sdpa_max:
        decompress, attend = case.sdpa_dense()
        decompress()
        want_v = torch.einsum("thc,hvc->thv", want.float(), case.w_uv.float())
        row["err_sdpa"] = check("sdpa", attend(), want_v)
        row["sdpa_dense_ms"] = do_bench(attend, warmup=5, rep=30, return_mode="median")
        row["decompress_ms"] = do_bench(decompress, warmup=5, rep=30, return_mode="median")
    torch.cuda.empty_cache()
    return row


def stage_times(entries: torch.Tensor, problem: Problem, gen: torch.Generator) -> dict:
    """Stage-drop variants: the partials launch alone (it writes what the merge reads) and the merge alone."""
    case = Case(entries, problem, gen)
    rows = problem.heads * problem.tree_len
    cfg = prefix_config(case.q, LORA, rows)
    plan = plan_splits(1, 1, rows, problem.prefix_len, case.q.device, cfg)
    full = time_graph(case.ours())
    part_o = torch.randn(plan.num_splits + 1, problem.tree_len, problem.heads, LORA, device="cuda")
    part_lse = torch.randn(plan.num_splits + 1, problem.tree_len, problem.heads, device="cuda")
    merge = partial(merge_partials, part_o, part_lse, case.cu_tree, case.prefix_lens, plan, True, problem.tree_len,
                    torch.bfloat16)
    merge_ms = time_graph(merge)
    return {**asdict(problem), "config": asdict(cfg), "num_splits": plan.num_splits, "total_ms": full,
            "merge_ms": merge_ms, "partials_ms": full - merge_ms}


def sweep(entries: torch.Tensor, gen: torch.Generator, configs: list[SplitConfig], heads: list[int],
          trees: list[int], prefix_len: int) -> list[dict]:
    rows = []
    for h in heads:
        for t in trees:
            case = Case(entries, Problem(h, prefix_len, t), gen)
            for cfg in configs:
                try:
                    ms = time_graph(case.ours(cfg))
                except Exception as error:  # noqa: BLE001  (a launch shape that does not fit is a result too)
                    ms = None
                    print(f"sweep H={h} T={t} {cfg}: {type(error).__name__}", flush=True)
                rows.append({"heads": h, "tree_len": t, **asdict(cfg), "ms": ms})
                if ms is not None:
                    print(f"sweep H={h} T={t} {cfg}: {ms:.4f} ms", flush=True)
    return rows


def markdown(rows: list[dict], stages: list[dict], bw: float, rate: float, command: str, device: str) -> str:
    lines = [
        f"# MLA verify attention, one layer (absorbed, 512 + 64 latent entries, bf16), one {device}",
        "",
        f"Command: `{command}`",
        "",
        f"Measured in the same run: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), bf16 matmul "
        f"{rate / 1e12:.0f} TFLOP/s. Times are medians of CUDA-graph replays (ms; SDPA and decompression eager); "
        "'% roof' = roofline / ours; 'Triton' = the Triton kernel alone (mma.sync tiles; on sm_90 ours runs the "
        "prefix on warpgroup MMAs, `ddtree_kernels/latent_prefix_sm90.py`); 'x page1' = page-size-1 baseline / ours; "
        "SDPA runs over K/V decompressed once "
        "(the decompression, which the HF path repeats every step, is the next column).",
        "",
        "| H | prefix | T | roofline | ours | % roof | Triton | page-size-1 | x page1 | SDPA dense mask | decompress |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sdpa = f"{r['sdpa_dense_ms']:.3f}" if "sdpa_dense_ms" in r else "-"
        decompress = f"{r['decompress_ms']:.3f}" if "decompress_ms" in r else "-"
        lines.append(f"| {r['heads']} | {r['prefix_len'] // 1024}k | {r['tree_len']} | {r['roofline_ms']:.3f} "
                     f"| {r['ours_ms']:.3f} | {100 * r['roofline_ms'] / r['ours_ms']:.0f}% | {r['triton_ms']:.3f} "
                     f"| {r['page1_ms']:.3f} "
                     f"| {r['page1_ms'] / r['ours_ms']:.0f}x | {sdpa} | {decompress} |")
    if stages:
        lines += ["", "Stage-drop variants (the merge alone on partials of the same shape; partials = total - merge):",
                  "", "| H | prefix | T | splits | total | partials | merge |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {s['heads']} | {s['prefix_len'] // 1024}k | {s['tree_len']} | {s['num_splits']} "
                  f"| {s['total_ms']:.3f} | {s['partials_ms']:.3f} | {s['merge_ms']:.3f} |" for s in stages]
    return "\n".join(lines) + "\n"


# NOTE: the value-column split (programs sharing a query block, each accumulating a slice of the latent) measured
# 2-3x slower at every shape (verify_attention_mla_sweep.json) and was removed from the kernel.
SWEEP_CONFIGS = [SplitConfig(bm, bn, w, st, pps) for bm, bn, w, st, pps in [
    (32, 32, 4, 2, 2), (32, 64, 4, 2, 2), (32, 32, 4, 3, 2), (16, 32, 4, 2, 2), (32, 16, 4, 3, 2), (64, 32, 8, 2, 1),
    (64, 32, 4, 2, 1), (64, 64, 8, 2, 1), (128, 32, 8, 2, 1),
]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 20, 64, 128])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072, 189440])
    parser.add_argument("--trees", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--sdpa-max", type=int, default=64 * 131072,
                        help="run the decompressed SDPA only where prefix x heads is at most this")
    parser.add_argument("--sweep", action="store_true", help="time launch shapes at the longest length instead")
    args = parser.parse_args(argv)
    command = "python benchmarks/verify_attention.py --mla " + " ".join(argv if argv is not None else sys.argv[1:])
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    started = time.time()
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"copy {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    entries = torch.randn(max(args.lengths), C, device="cuda", dtype=torch.bfloat16)
    result = {"command": command, "device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw,
              "matmul_flop_per_s": rate, "torch": torch.__version__, "triton": triton.__version__}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        result["sweep"] = sweep(entries, gen, SWEEP_CONFIGS, args.heads, args.trees, max(args.lengths))
        (args.out_dir / "verify_attention_mla_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
        return
    rows, stages = [], []
    for heads in args.heads:
        for prefix_len in args.lengths:
            for tree_len in args.trees:
                problem = Problem(heads, prefix_len, tree_len)
                row = measure(entries, problem, gen, args.sdpa_max)
                row["roofline_ms"] = 1e3 * max(problem.latent_bytes / bw, problem.flops / rate)
                rows.append(row)
                print(json.dumps(row), flush=True)
                partial_result = {**result, "rows": rows, "partial": True}  # kept if the run is cut short
                (args.out_dir / "verify_attention_mla.json").write_text(json.dumps(partial_result, indent=1) + "\n")
        stages += [stage_times(entries, Problem(heads, max(args.lengths), t), gen) for t in args.trees]
    result.update(rows=rows, stages=stages, seconds=time.time() - started)
    (args.out_dir / "verify_attention_mla.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "verify_attention_mla.md").write_text(markdown(rows, stages, bw, rate, command, result["device"]))
    print(markdown(rows, stages, bw, rate, command, result["device"]))


if __name__ == "__main__":
    main()
