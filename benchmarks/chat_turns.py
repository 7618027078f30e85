"""A chat's later turns through the real services (gateway -> verifier <-> drafter, separate processes): one or
more sessions, each a long document then `--turns` - 1 short user turns on the same session; per turn, TTFT, decode
tokens/s, ms per step, and how the drafter's mirror of the session was opened: seeds (a seed of the W latest
tokens' features, 42 MB for the Qwen3-8B-shaped DFlash drafter) or resumed (the mirror kept from the turn before,
the tokens since carried by the turn's first draft).

    python benchmarks/chat_turns.py --shape qwen3-8b --context 32k --turns 4 [--drafter dflash] [--sessions 1]
        [--turn-tokens 64] [--max-new-tokens 128] [--checkpoint-dir DIR] [--out-dir DIR]
    python benchmarks/chat_turns.py --shape tiny --context 512 --turns 3   # CPU smoke run

Writes chat_turns_<shape>.{json,md} to `--out-dir`. The shapes and checkpoints are long_context.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time

from e2e_step import git_commit
from long_context import (
    SHAPES,
    Stream,
    add_stack_args,
    checkpoints,
    context_label,
    context_tokens,
    device_name,
    generate,
    kv_budget_mb,
    verifier_counters,
)
from throughput import prompts

from ddtree.bench import summarize
from ddtree.client import AsyncClient
from ddtree.local_stack import LocalStack, free_port

# NOTE: a user's turn: a question about the document, as many characters (tokens of the byte-level tokenizer) as asked
TURN_TEXT = "\n\nUser: and what does the passage above say next, in the same words? Assistant: "


def turn_text(tokens: int) -> str:
    return (TURN_TEXT * (tokens // len(TURN_TEXT) + 1))[:tokens]


def turn_row(turn: int, streams: list[Stream], duration_s: float, before: dict[str, float],
             after: dict[str, float]) -> dict:
    """One turn of every session: its timings and how the sessions' mirrors were opened (the verifier's counters
    over the turn)."""
    records = [s.record for s in streams]
    report = summarize(records, duration_s)
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    seeds = delta.get("ddtree_verifier_seed_seconds_count", 0.0)
    per_session = [(len(r.itl_s), sum(r.itl_s), len(r.acceptance_lengths) - 1) for r in records]
    return {
        "turn": turn, "sessions": len(streams), "prompt_tokens": report["input_tokens"] // len(streams),
        "output_tokens": report["output_tokens"] // len(streams), "ttft_ms": report["ttft_ms"]["mean"],
        "decode_tokens_per_s": statistics.mean(n / s for n, s, _ in per_session if s > 0),
        "ms_per_step": statistics.mean(1e3 * s / steps for _, s, steps in per_session if steps > 0),
        "seeds": int(seeds), "seed_ms": 1e3 * delta["ddtree_verifier_seed_seconds_sum"] / seeds if seeds else None,
        "mirror_resumes": int(delta.get("ddtree_verifier_mirror_resumes_total", 0.0)),
        "mean_acceptance_length": report["mean_acceptance_length"],
        "draft_misses": int(delta.get("ddtree_verifier_draft_misses_total", 0.0)),
    }


async def chat(gateway: str, documents: list[str], turns: int, turn_tokens: int, max_new_tokens: int,
               metrics_port: int) -> list[dict]:
    """Every session takes each turn together; the last one releases them."""
    client = AsyncClient(gateway, timeout=3600)
    try:
        handles: list[str | None] = [None] * len(documents)
        rows = []
        for turn in range(1, turns + 1):
            texts = documents if turn == 1 else [turn_text(turn_tokens)] * len(documents)
            before, started = verifier_counters(metrics_port), time.perf_counter()
            streams = await asyncio.gather(*(generate(client, text, max_new_tokens, session=handle,
                                                      keep_session=turn < turns)
                                             for text, handle in zip(texts, handles)))
            duration_s = time.perf_counter() - started
            handles = [stream.session for stream in streams]
            rows.append(turn_row(turn, list(streams), duration_s, before, verifier_counters(metrics_port)))
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        await client.close()


def markdown(result: dict) -> str:
    def cell(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    run = result["run"]
    lines = [f"# A chat's turns through the services, {result['shape']} shape, {run['device']}", "",
             f"`{run['command']}`", "", f"Commit {run['commit'] or 'unknown'}, {run['date']}; drafter "
             f"{result['drafter']}, {result['sessions']} session(s), a {context_label(result['context'])} document "
             f"then turns of {result['turn_tokens']} tokens, {result['max_new_tokens']} new tokens a turn (greedy, "
             "EOS ignored).", "",
             "| turn | prompt tokens | TTFT ms | decode tok/s per session | ms / step | seeds | seed ms | mirrors "
             "resumed | mean acceptance | draft misses |", "|---" * 10 + "|"]
    lines += [f"| {r['turn']} | {r['prompt_tokens']} | {r['ttft_ms']:.0f} | {cell(r['decode_tokens_per_s'])} "
              f"| {cell(r['ms_per_step'], 2)} | {r['seeds']} | {cell(r['seed_ms'])} | {r['mirror_resumes']} "
              f"| {cell(r['mean_acceptance_length'], 2)} | {r['draft_misses']} |" for r in result["rows"]]
    lines += ["", "Seeds: the mirrors opened with a seed in the turn (`ddtree_verifier_seed_seconds`; seed ms its "
              "mean, the session stepping without drafts meanwhile); mirrors resumed: the sessions whose mirror "
              "stayed open from their last turn and whose first draft carried the tokens since "
              "(`ddtree_verifier_mirror_resumes`). TTFT: the turn's request to its first token (its prompt's "
              "prefill). Decode tok/s and ms / step: a session's tokens after the first over the time from its "
              "first chunk to its last, and that time over its steps after the first.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    parser.add_argument("--context", type=context_tokens, default=32 << 10, help="the document's tokens (32k = 32768)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=64, help="tokens of each later turn's prompt")
    parser.add_argument("--sessions", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--drafter", choices=("dflash", "ngram"), default="dflash")
    parser.add_argument("--tree-budget", type=int, default=15)
    add_stack_args(parser)
    args = parser.parse_args()
    if args.turns < 2 or args.sessions < 1 or args.max_new_tokens < 2 or args.turn_tokens < 1:
        parser.error("--turns must be >= 2, --sessions and --turn-tokens >= 1, --max-new-tokens >= 2")
    found = checkpoints(args.shape, args.checkpoint_dir, args.drafter == "dflash")
    max_context = (args.context + args.turns * args.max_new_tokens + (args.turns - 1) * args.turn_tokens
                   + args.tree_budget + args.page_size)
    metrics_port = free_port()
    verifier_args = ("--tree-budget", str(args.tree_budget), "--max-context", str(max_context), "--kv-budget-mb",
                     f"{kv_budget_mb(found.target, max_context, args.sessions, args.page_size):.1f}",
                     "--page-size", str(args.page_size), "--metrics-port", str(metrics_port))
    drafter = str(found.dflash) if args.drafter == "dflash" else "ngram"
    stack = LocalStack(str(found.target), drafter, 1, found.device, f"127.0.0.1:{free_port()}",
                       verifier_args=verifier_args, gateway_args=("--max-sessions-per-key", str(args.sessions)))
    stack.start(timeout_s=args.start_timeout_s)
    try:
        documents = [text[:args.context] for text in prompts(args.sessions, args.context)]
        rows = asyncio.run(chat(stack.addresses["gateway"], documents, args.turns, args.turn_tokens,
                                args.max_new_tokens, metrics_port))
    finally:
        stack.stop()
    result = {"shape": args.shape, "drafter": args.drafter, "context": args.context, "sessions": args.sessions,
              "turn_tokens": args.turn_tokens, "max_new_tokens": args.max_new_tokens, "rows": rows,
              "run": {"command": "python " + shlex.join(sys.argv), "commit": git_commit(),
                      "date": time.strftime("%Y-%m-%d %H:%M"), "device": device_name(found.device)}}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"chat_turns_{args.shape}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out_dir / f"chat_turns_{args.shape}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
