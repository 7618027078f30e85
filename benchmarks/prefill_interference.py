"""Decoding sessions' inter-token latency while another session's long prompt prefills, through the real services
(issue 23: a 128k prefill must not stop the other sessions' decoding for seconds).

One local stack. `--decoders` sessions with short prompts decode (greedy, EOS ignored) from before the long prompt
is sent until after its first token. For each long context: the gaps between the decoders' streamed steps before
the long prompt (the baseline) and during its prefill (from its request to its first token), and the long
prompt's TTFT, beside its TTFT with no one decoding. The verifier runs a prefill one chunk per engine call with
the other sessions' steps between chunks, so a decoder's longest gap is about one chunk's time; pass
`--verifier-arg "--prefill-chunk N"` to try other chunk sizes. Writes prefill_interference_<shape>.{json,md}.

    python benchmarks/prefill_interference.py --shape qwen3-8b [--contexts 32k 128k] [--decoders 4] [--drafter none]
    python benchmarks/prefill_interference.py --shape tiny --contexts 1024 --decoders 2   # CPU smoke run

The qwen3-8b checkpoints are long_context.py's (random weights, written once to `--checkpoint-dir`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

from e2e_step import git_commit, titled_table, write_results
from long_context import (
    SHAPES,
    add_stack_args,
    checkpoints,
    context_label,
    context_tokens,
    device_name,
    kv_budget_mb,
)
from throughput import prompts

from ddtree.client import AsyncClient
from ddtree.local_stack import LocalStack, free_port
from proto import gateway_pb2

DECODER_PROMPT_CHARS = 256
SETTLE_STEPS = 8  # the decoders' steps before the baseline starts: first-token and warm-up costs stay out of it


@dataclass
class Decoder:
    """One decoding session's streamed chunks, by arrival time."""
    arrivals: list[float] = field(default_factory=list)

    def gaps(self, start: float, end: float) -> list[float]:
        """The gaps (s) between consecutive chunks whose later chunk arrived in [start, end)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:]) if start <= b < end]


async def decode(client: AsyncClient, text: str, max_new_tokens: int, decoder: Decoder) -> None:
    generation = client.generate(text, max_new_tokens=max_new_tokens, ignore_eos=True)
    async for event in generation.events():
        if isinstance(event, gateway_pb2.GenerateChunk):
            decoder.arrivals.append(time.perf_counter())


async def first_token_s(client: AsyncClient, text: str) -> float:
    """Request to first token of a generation of this prompt (two tokens, so it ends right after)."""
    sent = time.perf_counter()
    async for event in client.generate(text, max_new_tokens=2, ignore_eos=True).events():
        if isinstance(event, gateway_pb2.GenerateChunk):
            return time.perf_counter() - sent
    raise RuntimeError("the long prompt's generation ended without a token")


def distribution_ms(gaps: list[float]) -> dict[str, float | None]:
    if not gaps:
        return {"p50": None, "p99": None, "max": None, "count": 0}
    ordered = sorted(gaps)
    return {"p50": 1e3 * statistics.median(ordered), "p99": 1e3 * ordered[min(len(ordered) - 1,
                                                                               int(0.99 * len(ordered)))],
            "max": 1e3 * ordered[-1], "count": len(ordered)}


async def interference(gateway: str, long_text: str, decoders: int, baseline_s: float, max_new_tokens: int) -> dict:
    """The long prompt's TTFT alone, then beside `decoders` decoding sessions, and their gaps before and during."""
    client = AsyncClient(gateway, timeout=3600)
    try:
        alone_s = await first_token_s(client, long_text)
        streams = [Decoder() for _ in range(decoders)]
        texts = prompts(decoders, DECODER_PROMPT_CHARS)
        tasks = [asyncio.create_task(decode(client, text, max_new_tokens, stream))
                 for text, stream in zip(texts, streams)]
        while any(len(s.arrivals) < SETTLE_STEPS for s in streams):
            if any(task.done() for task in tasks):
                await asyncio.gather(*tasks)  # NOTE: raises the failure of a decoder that stopped early
                raise RuntimeError("a decoder finished before the long prompt was sent: raise --decoder-tokens")
            await asyncio.sleep(0.01)
        baseline_from = time.perf_counter()
        await asyncio.sleep(baseline_s)
        sent = time.perf_counter()
        beside_s = await first_token_s(client, long_text)
        first = sent + beside_s
        finished = [task for task in tasks if task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if finished:
            raise RuntimeError("a decoder finished during the long prefill: raise --decoder-tokens")
    finally:
        await client.close()
    return {"ttft_alone_ms": 1e3 * alone_s, "ttft_beside_ms": 1e3 * beside_s,
            "baseline_gap_ms": distribution_ms([g for s in streams for g in s.gaps(baseline_from, sent)]),
            "prefill_gap_ms": distribution_ms([g for s in streams for g in s.gaps(sent, first + 1e-3)])}


def markdown(result: dict) -> str:
    def cell(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    columns = ["context", "TTFT alone ms", "TTFT beside the decoders ms",
               "decoders' step gap before: p50 / p99 / max ms", "during the prefill: p50 / p99 / max ms", "gaps during"]
    rows = [[context_label(r["context"]), f"{r['ttft_alone_ms']:.0f}", f"{r['ttft_beside_ms']:.0f}",
             " / ".join(cell(r["baseline_gap_ms"][k]) for k in ("p50", "p99", "max")),
             " / ".join(cell(r["prefill_gap_ms"][k]) for k in ("p50", "p99", "max")), str(r["prefill_gap_ms"]["count"])]
            for r in result["rows"]]
    settings = result["settings"]
    title = f"Decoding beside a long prefill, {result['shape']} shape, {result['device']}"
    return titled_table(title, result["command"], columns, rows) + (
        f"\nCommit {result['commit'] or 'unknown'}, {result['date']}. {settings['decoders']} sessions decode "
        f"(drafter {settings['drafter']}, {DECODER_PROMPT_CHARS}-token prompts) while one long prompt of the context's "
        "length prefills. A gap is the time between two of a decoder's streamed steps; 'during' counts the gaps "
        "that end between the long prompt's request and its first token. TTFT alone: the same prompt with no one "
        "decoding (sent before the decoders start; the verifier keeps no prefix cache, so both prefill in full)."
        + (f" Verifier arguments `{shlex.join(settings['verifier_args'])}`." if settings["verifier_args"] else "")
        + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b")
    parser.add_argument("--contexts", type=context_tokens, nargs="+", default=[32 << 10, 128 << 10])
    parser.add_argument("--decoders", type=int, default=4, help="sessions decoding beside the long prompt")
    parser.add_argument("--drafter", choices=("none", "ngram"), default="none")
    parser.add_argument("--decoder-tokens", type=int, default=8192,
                        help="the decoders' max new tokens (at most the gateway's limit, 8192 by default): enough to "
                        "outlast the long prefill (they are cancelled)")
    parser.add_argument("--baseline-s", type=float, default=1.0, help="the decoders' time alone, for the baseline")
    parser.add_argument("--verifier-arg", action="append", default=[], metavar="WORDS",
                        help='more verifier options, e.g. --verifier-arg "--prefill-chunk 1024" (repeatable)')
    add_stack_args(parser)
    args = parser.parse_args()
    if args.decoders < 1:
        parser.error("--decoders must be >= 1")
    found = checkpoints(args.shape, args.checkpoint_dir, with_dflash=False)
    verifier_args = [word for value in args.verifier_arg for word in shlex.split(value)]
    longest = max(args.contexts) + args.page_size
    decoder_context = DECODER_PROMPT_CHARS + 16 + args.decoder_tokens + args.page_size
    kv_mb = (kv_budget_mb(found.target, longest, 1, args.page_size)
             + kv_budget_mb(found.target, decoder_context, args.decoders, args.page_size))
    stack = LocalStack(str(found.target), args.drafter, 1, found.device, f"127.0.0.1:{free_port()}",
                       verifier_args=("--max-context", str(max(longest, decoder_context)), "--kv-budget-mb",
                                      f"{kv_mb:.1f}", "--page-size", str(args.page_size), "--decode-burst-steps", "1",
                                      "--no-prefix-caching", *verifier_args))  # NOTE: each long prompt is prefilled
    stack.start(timeout_s=args.start_timeout_s)
    rows = []
    try:
        gateway = stack.addresses["gateway"]
        asyncio.run(interference(gateway, prompts(1, min(args.contexts))[0], 1, 0.1, args.decoder_tokens))  # warm-up
        for context in args.contexts:
            long_text = prompts(1, context)[0][:context]
            rows.append({"context": context, **asyncio.run(interference(gateway, long_text, args.decoders,
                                                                        args.baseline_s, args.decoder_tokens))})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        stack.stop()
    result = {"command": "python " + " ".join(sys.argv), "shape": args.shape, "device": device_name(found.device),
              "commit": git_commit(), "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M"),
              "settings": {"decoders": args.decoders, "drafter": args.drafter, "verifier_args": verifier_args},
              "rows": rows}
    write_results(args.out_dir, f"prefill_interference_{args.shape}", result, markdown(result))


if __name__ == "__main__":
    main()
