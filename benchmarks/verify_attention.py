"""Verify attention for one layer (32 q heads, 8 KV heads, d=128, bf16) on one GPU, side by side:

- hybrid: this project's kernel (`ddtree_kernels.hybrid_verify_attention`), paged KV, page size 64 and 16;
- page1: how serving systems verify trees today: page size 1, one index load per prefix token, one
  program per (query head, query block) walking the prefix serially, dense tree mask (Triton, below);
- sdpa_dense: `scaled_dot_product_attention` with a dense additive mask over prefix + tree;
- torch_hybrid: the same decomposition as ours in stock PyTorch under a CUDA graph (GQA heads packed
  into query rows, prefix chunks through aten._scaled_dot_product_flash_attention, tree in torch, LSE merge);
- roofline: max(K+V bytes / copy bandwidth, FLOPs / bf16 matmul rate), both measured in this run.

`--mla` runs the MLA mode instead (benchmarks/verify_attention_mla.py: latent cache, heads 16..128).

Every method is checked against the torch hybrid before it is timed. Timing: CUDA graph replays through
`triton.testing.do_bench` (median; it flushes L2 between replays).
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
from ddtree_kernels import SplitConfig, hybrid_verify_attention  # noqa: E402
from ddtree_kernels.lse_merge import merge_partials  # noqa: E402
from ddtree_kernels.reference import pack_tree_mask  # noqa: E402
from ddtree_kernels.split_kv import attention_partials, default_config, plan_splits  # noqa: E402

HQ, HKV, D = 32, 8, 128
GROUP = HQ // HKV
SCALE = D**-0.5


@dataclass(frozen=True)
class Problem:
    """One verify step of one session: a prefix of `prefix_len` tokens and a `tree_len`-token tree."""

    prefix_len: int
    tree_len: int

    @property
    def kv_bytes(self) -> int:
        return 2 * (self.prefix_len + self.tree_len) * HKV * D * 2

    @property
    def flops(self) -> int:
        return 4 * HQ * self.tree_len * (self.prefix_len + self.tree_len) * D


def time_graph(fn) -> float:
    """Median ms of one CUDA-graph replay of `fn` (captured after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return do_bench(graph.replay, warmup=20, rep=80, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a 2 GiB device copy, counting read + write."""
    src = torch.randn(2**30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=20, rep=100, return_mode="median")
    return 2 * src.numel() * 2 / (ms * 1e-3)


def matmul_rate() -> float:
    """FLOP/s of an 8192^3 bf16 matmul on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = do_bench(lambda: a @ b, warmup=200, rep=200, return_mode="median")  # long warm-up: clocks ramp
    return 2 * 8192**3 / (ms * 1e-3)


@triton.jit
def _page1_kernel(
    q_ptr, k_buf, v_buf, kv_indices, tree_k, tree_v, dense_mask, out_ptr,
    prefix_len, tree_len, qk_scale,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_tn, stride_th, stride_mask,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """The status quo: one program per (q head, query block), a per-token index load for every key."""
    head = tl.program_id(0)
    kv_head = head // GROUP
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < tree_len
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head * stride_qh + dims[None, :], mask=row_ok[:, None])
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for start in range(0, prefix_len, BLOCK_N):  # prefix: gather every key through its own index
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < prefix_len
        idx = tl.load(kv_indices + cols, mask=ok, other=0).to(tl.int64)
        rows_kv = idx[:, None] * stride_kn + kv_head * stride_kh + dims[None, :]
        k = tl.load(k_buf + rows_kv, mask=ok[:, None], other=0.0)
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        v = tl.load(v_buf + rows_kv, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    for start in range(0, tree_len, BLOCK_N):  # tree: dense [T, T] mask
        cols = start + tl.arange(0, BLOCK_N)
        ok = cols < tree_len
        rows_kv = cols[:, None] * stride_tn + kv_head * stride_th + dims[None, :]
        k = tl.load(tree_k + rows_kv, mask=ok[:, None], other=0.0)
        visible = tl.load(dense_mask + rows[:, None] * stride_mask + cols[None, :],
                          mask=row_ok[:, None] & ok[None, :], other=0) != 0
        s = tl.where(visible, tl.dot(q, tl.trans(k)) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        v = tl.load(tree_v + rows_kv, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    out = out_ptr + rows[:, None] * stride_qn + head * stride_qh + dims[None, :]
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


class Session:
    """One session's tensors in every layout the methods need, all over the same KV bytes."""

    def __init__(self, kv: tuple[torch.Tensor, torch.Tensor], problem: Problem, gen: torch.Generator):
        n, t = problem.prefix_len, problem.tree_len
        self.problem = problem
        self.k, self.v = kv[0][:n], kv[1][:n]  # [n, Hkv, D] contiguous
        self.q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16)
        self.tree_k = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16)
        self.tree_v = torch.randn(t, HKV, D, device="cuda", dtype=torch.bfloat16)
        mask = torch.eye(t, dtype=torch.bool)
        for node in range(1, t):
            mask[node] = mask[int(torch.randint(0, node, (1,), generator=gen))]
            mask[node, node] = True
        self.dense_mask = mask.cuda()  # [T, T] ancestors and self
        self.tree_mask = pack_tree_mask(self.dense_mask)  # [T, W]
        self.cu_tree = torch.tensor([0, t], dtype=torch.int32, device="cuda")
        self.prefix_lens = torch.tensor([n], dtype=torch.int32, device="cuda")

    def paged(self, page_size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pages over the whole KV buffer, and a block table visiting them in shuffled order."""
        total = self.k.shape[0] // page_size * page_size
        num_pages = max(1, total // page_size)
        order = torch.randperm(num_pages, generator=gen).cuda().to(torch.int32)
        k_pages = self.k[:total].view(num_pages, page_size, HKV, D)
        v_pages = self.v[:total].view(num_pages, page_size, HKV, D)
        return k_pages, v_pages, order[None]

    def hybrid(self, page_size: int, gen: torch.Generator, cfg: SplitConfig | None = None):
        k_pages, v_pages, table = self.paged(page_size, gen)
        p = self.problem
        return lambda: hybrid_verify_attention(
            self.q, k_pages, v_pages, table, self.prefix_lens, self.tree_k, self.tree_v, self.cu_tree,
            self.tree_mask, SCALE, p.prefix_len, p.tree_len, cfg=cfg), (k_pages, v_pages, table)

    def page1(self, table: torch.Tensor, page_size: int):
        """Per-token indices of the same shuffled pages: the page-size-1 view of identical bytes."""
        n, t = self.problem.prefix_len, self.problem.tree_len
        pos = torch.arange(n, device="cuda")
        indices = (table[0].long()[pos // page_size] * page_size + pos % page_size).to(torch.int32)
        out = torch.empty_like(self.q)
        dense_mask = self.dense_mask.to(torch.int8)
        block_m = 64 if t >= 64 else 16

        def run():
            _page1_kernel[(HQ, triton.cdiv(t, block_m))](
                self.q, self.k, self.v, indices, self.tree_k, self.tree_v, dense_mask, out,
                n, t, SCALE * 1.4426950408889634, self.q.stride(0), self.q.stride(1), self.k.stride(0),
                self.k.stride(1), self.tree_k.stride(0), self.tree_k.stride(1), t,
                GROUP=GROUP, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=64, num_warps=4, num_stages=2)
            return out
        return run

    def sdpa_dense(self):
        """What the DDTree reference does: expand KV to all q heads, one additive mask [T, n + T]."""
        n, t = self.problem.prefix_len, self.problem.tree_len
        keys = torch.cat([self.k, self.tree_k]).repeat_interleave(GROUP, 1).transpose(0, 1)[None]  # [1, Hq, S, D]
        values = torch.cat([self.v, self.tree_v]).repeat_interleave(GROUP, 1).transpose(0, 1)[None]
        visible = torch.cat([torch.ones(t, n, dtype=torch.bool, device="cuda"), self.dense_mask], 1)
        bias = torch.zeros(t, n + t, device="cuda", dtype=torch.bfloat16).masked_fill(~visible, float("-inf"))
        q = self.q.transpose(0, 1)[None]  # [1, Hq, T, D]
        return lambda: torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=bias[None, None], scale=SCALE)[0].transpose(0, 1)

    def torch_hybrid(self, chunks: int):
        """Stock-PyTorch hybrid: flash SDPA over `chunks` prefix chunks (batched), tree in torch, LSE merge."""
        n, t = self.problem.prefix_len, self.problem.tree_len
        k_chunks = self.k.view(chunks, n // chunks, HKV, D).transpose(1, 2)  # [C, Hkv, n/C, D]
        v_chunks = self.v.view(chunks, n // chunks, HKV, D).transpose(1, 2)
        hidden = ~self.dense_mask.repeat_interleave(GROUP, 0)  # [T*G, T], rows (token, head in group)
        tree_k, tree_v = self.tree_k.transpose(0, 1).float(), self.tree_v.transpose(0, 1).float()  # [Hkv, T, D]

        def run():
            rows = self.q.view(t, HKV, GROUP, D).permute(1, 0, 2, 3).reshape(HKV, t * GROUP, D)  # [Hkv, TG, D]
            q = rows[None].expand(chunks, -1, -1, -1).contiguous()
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k_chunks, v_chunks, scale=SCALE)[:2]
            scores = (rows.float() @ tree_k.transpose(1, 2) * SCALE).masked_fill(hidden, float("-inf"))
            lse_tree = scores.logsumexp(-1)  # [Hkv, TG]
            out_tree = scores.softmax(-1) @ tree_v  # [Hkv, TG, D]
            weights = torch.cat([lse, lse_tree[None]]).softmax(0)  # [C + 1, Hkv, TG]
            merged = (torch.cat([out.float(), out_tree[None]]) * weights[..., None]).sum(0)
            return merged.view(HKV, t, GROUP, D).permute(1, 0, 2, 3).reshape(t, HQ, D).to(torch.bfloat16)
        return run


def best_chunks(session: Session) -> tuple[float, int]:
    """The torch hybrid at its best chunk count (fair to the baseline)."""
    n = session.problem.prefix_len
    options = [c for c in (8, 16, 32, 64, 128) if n % c == 0 and n // c >= 256]
    return min((time_graph(session.torch_hybrid(c)), c) for c in options)


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> float:
    err = (got.float() - want.float()).abs().max().item()
    if not err < 1e-2:
        raise AssertionError(f"{name} disagrees with the torch hybrid: max abs err {err}")
    return err


def measure(kv, problem: Problem, gen: torch.Generator, skip_slow: bool) -> dict:
    session = Session(kv, problem, gen)
    hybrid_ms, chunks = best_chunks(session)
    want = session.torch_hybrid(chunks)()
    row = {"prefix_len": problem.prefix_len, "tree_len": problem.tree_len, "torch_hybrid_ms": hybrid_ms,
           "torch_hybrid_chunks": chunks}
    for page_size in (64, 16):
        fn, (_, _, table) = session.hybrid(page_size, gen)
        row[f"err_p{page_size}"] = check(f"hybrid p{page_size}", fn(), want)
        row[f"hybrid_p{page_size}_ms"] = time_graph(fn)
    page1 = session.page1(table, page_size)  # the same shuffled pages, indexed token by token
    row["err_page1"] = check("page1", page1(), want)
    row["page1_ms"] = time_graph(page1)
    if not (skip_slow and problem.prefix_len > 65536):
        sdpa = session.sdpa_dense()
        row["err_sdpa"] = check("sdpa", sdpa(), want)
        row["sdpa_dense_ms"] = do_bench(sdpa, warmup=10, rep=60, return_mode="median")
        del sdpa
    torch.cuda.empty_cache()
    return row


def sweep(kv, gen: torch.Generator, configs: list[SplitConfig]) -> list[dict]:
    """Launch-shape sweep at 128k, page 64 (how `default_config` was chosen)."""
    rows = []
    for tree_len in (16, 64, 128):
        session = Session(kv, Problem(131072, tree_len), gen)
        for cfg in configs:
            ms = time_graph(session.hybrid(64, gen, cfg)[0])
            rows.append({"tree_len": tree_len, **asdict(cfg), "ms": ms})
            print(f"sweep T={tree_len} {cfg}: {ms:.4f} ms", flush=True)
    return rows


def stage_times(s: Session, gen: torch.Generator) -> dict:
    """Each launch alone, default launch shape: the partials stage with and without the tree split
    (the variant that drops the tree block) and the log-sum-exp merge."""
    rows = GROUP * s.problem.tree_len
    k_pages, v_pages, table = s.paged(64, gen)
    cfg = default_config(rows, D)
    plan = plan_splits(1, HKV, rows, s.problem.prefix_len, s.q.device, cfg)
    tree = (s.tree_k, s.tree_v, s.tree_mask)
    prefix = partial(attention_partials, s.q, k_pages, v_pages, table, s.prefix_lens, s.cu_tree, SCALE, plan, cfg)
    partials = partial(prefix, tree=tree, max_q_len=s.problem.tree_len)
    part_o, part_lse = partials()
    merge = partial(merge_partials, part_o, part_lse, s.cu_tree, s.prefix_lens, plan, True, s.problem.tree_len,
                    s.q.dtype)
    return {"tree_len": s.problem.tree_len, "config": asdict(cfg), "num_splits": plan.num_splits,
            "prefix_stage_ms": time_graph(prefix), "partials_stage_ms": time_graph(partials),
            "merge_stage_ms": time_graph(merge)}


def stages(kv, gen: torch.Generator, lengths: tuple[int, ...] = (131072,),
           trees: tuple[int, ...] = (16, 64, 128)) -> list[dict]:
    """Where the time goes: each stage timed alone (the variants that drop the other stage)."""
    rows = []
    for prefix_len in lengths:
        for tree_len in trees:
            rows.append({"prefix_len": prefix_len, **stage_times(Session(kv, Problem(prefix_len, tree_len), gen), gen)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict], bw: float, rate: float, command: str) -> str:
    lines = [
        "# Verify attention, one layer (32 q heads, 8 KV heads, d=128, bf16), one H200",
        "",
        f"Command: `{command}`",
        "",
        f"Measured in the same run: copy bandwidth {bw / 1e12:.2f} TB/s (read + write), "
        f"bf16 matmul {rate / 1e12:.0f} TFLOP/s. Times are medians of CUDA-graph replays (ms); "
        "'% roof' = roofline / time; 'x page1' = page-size-1 baseline time / ours.",
        "",
        "| prefix | T | roofline | hybrid P=64 | % roof | hybrid P=16 | page-size-1 | x page1 | SDPA dense mask "
        "| torch hybrid (graph) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sdpa = f"{r['sdpa_dense_ms']:.3f}" if "sdpa_dense_ms" in r else "-"
        lines.append(
            f"| {r['prefix_len'] // 1024}k | {r['tree_len']} | {r['roofline_ms']:.3f} | {r['hybrid_p64_ms']:.3f} "
            f"| {100 * r['roofline_ms'] / r['hybrid_p64_ms']:.0f}% | {r['hybrid_p16_ms']:.3f} | {r['page1_ms']:.3f} "
            f"| {r['page1_ms'] / r['hybrid_p64_ms']:.0f}x | {sdpa} | {r['torch_hybrid_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if "--mla" in sys.argv:  # the MLA mode: its own problems and methods (benchmarks/verify_attention_mla.py)
        from benchmarks.verify_attention_mla import main as mla_main
        return mla_main([arg for arg in sys.argv[1:] if arg != "--mla"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 65536, 131072])
    parser.add_argument("--trees", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--sweep", action="store_true", help="also time launch shapes and stages at 128k")
    parser.add_argument("--skip-slow", action="store_true", help="no dense-mask SDPA above 64k")
    parser.add_argument("--stages-only", action="store_true",
                        help="time each launch alone (partials with, without the tree; merge) at --lengths x --trees")
    args = parser.parse_args()
    command = "python " + " ".join(sys.argv)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    started = time.time()
    bw, rate = copy_bandwidth(), matmul_rate()
    print(f"copy {bw / 1e12:.2f} TB/s, matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    max_len = max(args.lengths)
    kv = tuple(torch.randn(max_len, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    result = {"command": command, "device": torch.cuda.get_device_name(), "copy_bytes_per_s": bw,
              "matmul_flop_per_s": rate, "torch": torch.__version__, "triton": triton.__version__}
    if args.stages_only:
        rows = stages(kv, gen, tuple(args.lengths), tuple(args.trees))
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "verify_attention_stages.json").write_text(json.dumps({**result, "stages": rows}, indent=1))
        return
    if args.sweep:
        configs = [SplitConfig(bm, bn, w, st, pps, tma) for bm, bn, w, st, pps, tma in [
            (64, 64, 4, 3, 2, False), (64, 64, 4, 3, 2, True), (64, 64, 4, 4, 2, True), (128, 64, 4, 2, 2, False),
            (128, 64, 4, 2, 2, True), (128, 64, 8, 2, 2, True), (256, 64, 8, 2, 1, False), (256, 64, 8, 2, 1, True),
        ]]
        result["sweep"] = sweep(kv, gen, configs)
        result["stages"] = stages(kv, gen)
    rows = []
    for prefix_len in args.lengths:
        for tree_len in args.trees:
            problem = Problem(prefix_len, tree_len)
            row = measure(kv, problem, gen, args.skip_slow)
            row["roofline_ms"] = 1e3 * max(problem.kv_bytes / bw, problem.flops / rate)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result["rows"] = rows
    result["seconds"] = time.time() - started
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "verify_attention.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / "verify_attention.md").write_text(markdown(rows, bw, rate, command))
    print(markdown(rows, bw, rate, command))


if __name__ == "__main__":
    main()
