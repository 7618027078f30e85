"""Does a plain decode step of B sessions run faster as two micro-batches of B/2 on two CUDA streams?

Issue 26's 0.6B row is GPU-bound: at 64 sessions a step's attention streams the KV at ~80% of the copy rate, while
the layer's small GEMMs, norms and RoPE run at 2-3x their weight bytes (a fixed cost inside each short kernel,
`pdl_h100.md`). Two independent halves of the batch, captured on two streams of one CUDA graph, could let one
half's short kernels run beside the other half's attention instead of one after another (SGLang's two-batch
overlap, here for decoding). This times, from CUDA-graph replays of the engine's forward and greedy head:

- whole: the B sessions in one forward, as the engine runs them;
- halves in turn: two forwards of B/2 on one stream (what two micro-batches cost without overlap);
- halves beside: the two forwards on two streams, forked and joined inside the graph.

The halves write the same rows of the tree scratch at the same time: their K/V are garbage, their timing is not.
An engine that split its batches would give each half its own scratch rows.

    python benchmarks/micro_batches.py [--shape qwen3-0.6b] [--sessions 64 128] [--context 1536]
    python benchmarks/micro_batches.py --shape tiny --sessions 4   # CPU smoke run (no streams: the halves in turn)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from batch_step import open_sessions
from e2e_step import build_ours, engine_for, shape_of, synchronize, timed, write_results

from modeling.graph_capture import capture
from verifier_service.engine.engine import Engine
from verifier_service.engine.verify_batch import BlockSpec, VerifyBatch, build_verify_batch


def plain_batch(engine: Engine, session_ids: list[str]) -> VerifyBatch:
    """The sessions' next plain step as one verify batch on the device, sized for any prefix (as a graph's)."""
    sessions = [engine.session(sid) for sid in session_ids]
    blocks = [BlockSpec.chain(s.kv_len, [s.root], s.block_table.pages) for s in sessions]
    return dataclasses.replace(build_verify_batch(blocks, engine.device), max_prefix_len=engine.max_context)


def forward_and_head(engine: Engine, batch: VerifyBatch) -> torch.Tensor:
    hidden, _ = engine._forward(batch)
    return engine.head(hidden, greedy=True)


def beside(engine: Engine, first: VerifyBatch, second: VerifyBatch,
           side: torch.cuda.Stream | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The two batches' forwards, the second on `side` (forked from the current stream and joined back)."""
    if side is None:
        return forward_and_head(engine, first), forward_and_head(engine, second)
    current = torch.cuda.current_stream(engine.device)
    side.wait_stream(current)
    tokens = forward_and_head(engine, first)
    with torch.cuda.stream(side):
        other = forward_and_head(engine, second)
    current.wait_stream(side)
    return tokens, other


def replayed(engine: Engine, step: Callable[[], object]) -> Callable[[], object]:
    """`step` as a CUDA-graph replay on the GPU (eager on the CPU)."""
    if engine.device.type != "cuda":
        return step
    graph, _ = capture(step, engine.device, torch.cuda.graph_pool_handle())
    return graph.replay


def measure(engine: Engine, sessions: int, context: int) -> dict:
    ids = open_sessions(engine, sessions, context)
    whole = plain_batch(engine, ids)
    first, second = plain_batch(engine, ids[: sessions // 2]), plain_batch(engine, ids[sessions // 2:])
    side = torch.cuda.Stream(engine.device) if engine.device.type == "cuda" else None
    steps = {
        "whole": lambda: forward_and_head(engine, whole),
        "halves_in_turn": lambda: beside(engine, first, second, None),
        "halves_beside": lambda: beside(engine, first, second, side),
    }
    row = {"sessions": sessions, "context": context, "streams": 2 if side is not None else 1}
    with torch.inference_mode():
        for name, step in steps.items():
            row[f"{name}_ms"] = timed(replayed(engine, step), reps=50, warmup=5)
    synchronize()
    for session_id in ids:
        engine.release_session(session_id)
    row["beside_vs_whole"] = row["halves_beside_ms"] / row["whole_ms"]
    return row


def markdown(result: dict) -> str:
    lines = [f"# A plain decode step as two micro-batches on two streams ({result['shape']}, {result['device']})", "",
             f"`{result['command']}`", "",
             "| sessions | context | whole ms | halves in turn ms | halves beside ms | beside / whole |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['sessions']} | {r['context']} | {r['whole_ms']:.3f} | {r['halves_in_turn_ms']:.3f} | "
                     f"{r['halves_beside_ms']:.3f} | {r['beside_vs_whole']:.3f} |")
    return "\n".join(lines) + ("\n\nEach time is a CUDA-graph replay of the engine's forward and greedy head (the mean "
                               "of 50 with the device synchronised around them); 'beside' captures the second half "
                               "on a second stream of the same graph.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="qwen3-0.6b", help="a shape of benchmarks/e2e_step.py")
    parser.add_argument("--sessions", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--context", type=int, default=1536)
    parser.add_argument("--out-dir", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args()
    if any(sessions < 2 or sessions % 2 for sessions in args.sessions):
        parser.error(f"--sessions: even counts of at least 2, got {args.sessions}")
    torch.manual_seed(0)
    shape, drafter_shape, device = shape_of(args.shape)
    ours, _ = build_ours(shape, drafter_shape, device)
    engine = engine_for(ours, device, args.context + 64, sessions=max(args.sessions))
    rows = [measure(engine, sessions, args.context) for sessions in args.sessions]
    device_name = "CPU" if device == "cpu" else torch.cuda.get_device_name()
    result = {"command": "python " + " ".join(sys.argv), "shape": args.shape, "device": device_name, "rows": rows}
    write_results(args.out_dir, f"micro_batches_{args.shape}", result, markdown(result))


if __name__ == "__main__":
    main()
