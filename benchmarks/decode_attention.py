"""Plain decoding's attention on one GPU: B sessions, one query row each, over paged prefixes of L tokens (page 64,
bf16), as a batch of plain steps runs it in every layer. The split-KV kernel at the launch shape `default_config`
picks, and at candidate shapes, against the time to read every session's K and V once at the measured copy
bandwidth (the floor: nothing else is read in any amount).

Issue 26's 0.6B-shape target needs this stage near its floor: at 64 sessions of 1k tokens the engine step spent
2.65 of its 3.6 GPU ms here, against ~1.6 ms to read the KV (`throughput_decode_bursts.md`).

    python benchmarks/decode_attention.py [--shape qwen3-0.6b] [--sessions 16 64 128] [--contexts 1024 4096]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import titled_table, write_results  # noqa: E402
from benchmarks.verify_attention import copy_bandwidth, time_graph  # noqa: E402
from ddtree_kernels import SplitConfig, hybrid_verify_attention  # noqa: E402
from ddtree_kernels.reference import verify_attention_reference  # noqa: E402
from ddtree_kernels.split_kv import default_config  # noqa: E402

PAGE = 64
SHAPES = {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128)}  # query heads, KV heads, head dim
# (block_m, block_n, warps, stages, programs per SM, tma): tiles of few rows read at most as much K/V per step as
# shared memory allows in flight; these trade stages, key blocks and programs per SM against each other
CANDIDATES = [SplitConfig(64, 64, 4, 3, 2, True), SplitConfig(16, 64, 4, 2, 4, True),
              SplitConfig(16, 32, 2, 2, 8, True), SplitConfig(16, 128, 4, 2, 2, True),
              SplitConfig(16, 64, 8, 2, 2, True), SplitConfig(16, 64, 4, 3, 2, False),
              SplitConfig(16, 32, 4, 4, 4, True), SplitConfig(16, 64, 4, 3, 4, True),
              SplitConfig(16, 32, 8, 3, 4, True)]


class Batch:
    """B sessions of `context` tokens each, their pages shuffled over one pool, one query row each."""

    def __init__(self, sessions: int, context: int, heads: tuple[int, int, int], gen: torch.Generator):
        hq, hkv, d = heads
        pages = context // PAGE
        self.k_pages = torch.randn(sessions * pages, PAGE, hkv, d, device="cuda", dtype=torch.bfloat16)
        self.v_pages = torch.randn_like(self.k_pages)
        order = torch.randperm(sessions * pages, generator=gen).to(torch.int32)
        self.tables = order.view(sessions, pages).cuda()
        self.prefix_lens = torch.full((sessions,), context, dtype=torch.int32, device="cuda")
        self.q = torch.randn(sessions, hq, d, device="cuda", dtype=torch.bfloat16)
        self.tree_k = torch.randn(sessions, hkv, d, device="cuda", dtype=torch.bfloat16)
        self.tree_v = torch.randn_like(self.tree_k)
        self.cu_tree = torch.arange(sessions + 1, dtype=torch.int32, device="cuda")
        self.tree_mask = torch.ones(sessions, 1, dtype=torch.int32, device="cuda")  # each row sees itself
        self.context, self.scale = context, d**-0.5

    def kv_bytes(self) -> int:
        return 2 * self.k_pages.numel() * self.k_pages.element_size()

    def attention(self, cfg: SplitConfig | None):
        return lambda: hybrid_verify_attention(self.q, self.k_pages, self.v_pages, self.tables, self.prefix_lens,
                                               self.tree_k, self.tree_v, self.cu_tree, self.tree_mask, self.scale,
                                               self.context, 1, cfg=cfg)

    def reference(self) -> torch.Tensor:
        return verify_attention_reference(self.q, self.k_pages, self.v_pages, self.tables, self.prefix_lens,
                                          self.tree_k, self.tree_v, self.cu_tree, self.tree_mask, self.scale)


def measure(batch: Batch, configs: list[SplitConfig], bandwidth: float) -> list[dict]:
    """Each config's median ms (checked against the reference first) and its share of the floor."""
    want = batch.reference().float()
    floor_ms = batch.kv_bytes() / bandwidth * 1e3
    rows = []
    for cfg in configs:
        fn = batch.attention(cfg)
        err = (fn().float() - want).abs().max().item()
        if not err < 2e-2:
            raise AssertionError(f"{cfg} disagrees with the reference: max abs err {err}")
        ms = time_graph(fn)
        rows.append({**asdict(cfg), "ms": ms, "floor_ms": floor_ms, "floor_share": floor_ms / ms})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-0.6b")
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_attention.py times the Triton kernels on a CUDA GPU")
    heads, gen = SHAPES[args.shape], torch.Generator().manual_seed(0)
    bandwidth, rows = copy_bandwidth(), []
    for sessions in args.sessions:
        for context in args.contexts:
            batch = Batch(sessions, context, heads, gen)
            default = default_config(heads[0] // heads[1], heads[2])
            for index, row in enumerate(measure(batch, [default, *CANDIDATES], bandwidth)):
                rows.append({"sessions": sessions, "context": context, "default": index == 0, **row})
                print(rows[-1], flush=True)
            del batch
            torch.cuda.empty_cache()
    command = " ".join(["python benchmarks/decode_attention.py", *sys.argv[1:]])
    table = titled_table(
        f"Plain decoding attention, one layer ({args.shape}: {heads[0]} q / {heads[1]} KV heads, "
        f"d={heads[2]}, bf16, page {PAGE}; {torch.cuda.get_device_name()})", command,
        ["sessions", "context", "config (block_m, block_n, warps, stages, programs/SM, tma)", "ms", "floor ms",
         "floor / ms"],
        [[str(r["sessions"]), str(r["context"]),
          f"({r['block_m']}, {r['block_n']}, {r['num_warps']}, {r['num_stages']}, {r['programs_per_sm']}, "
          f"{r['tma']})" + (" default" if r["default"] else ""),
          f"{r['ms']:.4f}", f"{r['floor_ms']:.4f}", f"{r['floor_share']:.0%}"] for r in rows])
    write_results(args.out_dir, f"decode_attention_{args.shape}",
                  {"command": command, "bandwidth": bandwidth, "rows": rows}, table)


if __name__ == "__main__":
    main()
