"""Throughput through the local stack: C concurrent sessions with long repetitive prompts, speculative
(n-gram drafter by default) vs plain decoding, on the same prompts. Writes benchmarks/results/throughput.*.

    python benchmarks/throughput.py --target DIR --device cuda [--concurrency 1 4 16] [--context 4096]
    python benchmarks/throughput.py --random-target DIR --device cuda [--random-shape qwen3-0.6b|qwen3-8b]
        [--concurrency 1 16 64 128]   # writes a random model of that shape
    python benchmarks/throughput.py --tiny --context 512 --concurrency 1 4   # CPU smoke run
    python benchmarks/throughput.py --tiny --tree-budgets 7 15 31 63 adaptive   # one speculative run per choice
    python benchmarks/throughput.py --random-target DIR --random-shape small --random-std 0.1 --context 64 \
        --concurrency 64 --tree-budgets adaptive   # CPU: drafts that seldom pay (acceptance ~1)
    python benchmarks/throughput.py ... --repeats 3   # medians over alternating runs (single runs swing by 20%+)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from e2e_step import QWEN3_8B, copy_bandwidth

from ddtree.bench import RequestRecord, distribution_ms
from ddtree.client import AsyncClient
from ddtree.local_stack import LocalStack, ensure_tiny_model, free_port
from modeling.tiny import QWEN3_06B_SHAPE, SMALL_SHAPE, make_tiny_target

PARAGRAPH = ("The verifier keeps the prefix dense in pages, the drafter proposes a tree, and the target checks "
             "every branch in one pass. ")


RANDOM_SHAPES = {"qwen3-0.6b": QWEN3_06B_SHAPE, "qwen3-8b": QWEN3_8B, "small": SMALL_SHAPE}


def prompts(count: int, context_chars: int, document: int = 0) -> list[str]:
    """Repetitive prompts (what prompt lookup thrives on), one distinct opening per session; another `document`
    changes every opening (a random model continues each differently)."""
    body = PARAGRAPH * (context_chars // len(PARAGRAPH) + 1)
    opening = f"Document {document}, session" if document else "Session"
    return [f"{opening} {i}. " + body[: context_chars] for i in range(count)]


class FullWindow:
    """The stretch of a run in which every session decodes: from the last session's first token to the first
    session's last. Its tokens over its seconds is the batch's decode rate with no prefill sharing the GPU and no
    tail of stragglers; `snapshot` (the verifier's histograms) is taken at both ends."""

    def __init__(self, sessions: int, snapshot: Callable[[], object]):
        self.sessions, self.snapshot = sessions, snapshot
        self.started, self.tokens = 0, 0
        self.opened_at: float | None = None
        self.closed_at: float | None = None
        self.snapshots: list[object] = []

    def chunk(self, first: bool, tokens: int, now: float) -> None:
        if self.closed_at is not None:
            return
        if self.opened_at is not None:
            self.tokens += tokens
        elif first:
            self.started += 1
            if self.started == self.sessions:
                self.opened_at = now
                self.snapshots.append(self.snapshot())

    def finish(self, now: float) -> None:
        if self.closed_at is None:
            self.closed_at = now
            if self.opened_at is not None:
                self.snapshots.append(self.snapshot())

    @property
    def tokens_per_s(self) -> float | None:
        """None when a session finished before the last one started (no moment had them all decoding)."""
        return self.tokens / (self.closed_at - self.opened_at) if len(self.snapshots) == 2 else None


async def run_sessions(gateway: str, texts: list[str], max_new_tokens: int, tree_budget: int = 0,
                       window: FullWindow | None = None) -> dict:
    client = AsyncClient(gateway, timeout=3600)
    window = window or FullWindow(len(texts), lambda: None)

    async def one(text: str):
        generation = client.generate(text, max_new_tokens=max_new_tokens, ignore_eos=True, tree_budget=tree_budget)
        record = RequestRecord(time.perf_counter())
        async for chunk in generation:
            now = time.perf_counter()
            window.chunk(record.ttft_s is None, len(chunk.token_ids), now)
            record.add_chunk(len(chunk.token_ids), now)
        window.finish(time.perf_counter())
        summary = generation.summary
        decode_s = (summary.e2e_ms - summary.ttft_ms) / 1e3
        return (len(generation.token_ids), summary.mean_acceptance_length, generation.token_ids, summary.ttft_ms,
                (len(generation.token_ids) - 1) / decode_s, record.itl_s)

    started = time.perf_counter()
    results = await asyncio.gather(*(one(t) for t in texts))
    elapsed = time.perf_counter() - started
    itl = distribution_ms([gap for r in results for gap in r[5]]) or {"p50": 0.0, "p99": 0.0}
    return {"tokens_per_s": sum(r[0] for r in results) / elapsed, "seconds": elapsed,
            "full_window_tokens_per_s": window.tokens_per_s,
            "mean_acceptance_length": statistics.mean(r[1] for r in results), "outputs": [r[2] for r in results],
            "mean_ttft_ms": statistics.mean(r[3] for r in results),
            "decode_tokens_per_s": sum(r[4] for r in results), "itl_p50_ms": itl["p50"], "itl_p99_ms": itl["p99"]}


def add_budget_sweep_args(parser: argparse.ArgumentParser, per: str) -> None:
    """--tree-budgets and --repeats, as this script and long_context.py take them (`per`: what a run is per)."""
    parser.add_argument("--tree-budgets", nargs="+", metavar="B|adaptive",
                        help=f"one speculative run per choice and {per} on the same stack: a budget pinned by the "
                             "requests, or 'adaptive' (the verifier's policy); the verifier's maximum is the largest "
                             "number given")
    parser.add_argument("--repeats", type=int, default=1,
                        help=f"runs of every choice per {per}, every other one in reverse order; the summary gives "
                             "medians")


def budget_pins(choices: list[str], error: Callable[[str], None]) -> dict[str, int]:
    """--tree-budgets' choices by name, with the budget their requests pin: 0 (a choice of "0", or "adaptive")
    leaves it to the verifier's --tree-budget and policy; `error` (the parser's) for a choice that is neither a
    budget >= 0 nor 'adaptive'."""
    pins = {}
    for choice in choices:
        if choice != "adaptive" and not choice.isdigit():
            error(f"--tree-budgets: {choice!r} is neither a budget >= 0 nor 'adaptive'")
        pins[choice] = 0 if choice == "adaptive" else int(choice)
    return pins


def plain_floor_tokens_per_s(target: str, sessions: int, context: int, bandwidth: float) -> float:
    """What plain decoding of `sessions` sessions at `context` tokens can reach at most on this device: each step
    reads the layer and LM-head weights once and every session's KV (bytes / the measured copy bandwidth)."""
    config = json.loads((Path(target) / "config.json").read_text())
    weights = sum(path.stat().st_size for path in Path(target).glob("*.safetensors"))
    if not config.get("tie_word_embeddings", False):  # NOTE: the embedding is read a row per token, not whole
        weights -= config["vocab_size"] * config["hidden_size"] * 2
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2  # bf16 K and V
    step_s = (weights + sessions * context * kv_per_token) / bandwidth
    return sessions / step_s


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


HISTOGRAMS = ("tree_budget", "batch_sessions", "batch_seconds", "step_gap_seconds", "draft_round_seconds",
              "drafting_pass_host_seconds", "plain_step_host_seconds", "engine_gpu_seconds",
              "step_host_overhead_seconds")


def histogram_totals(metrics_url: str) -> dict[str, tuple[float, float]]:
    """The verifier's sum and count so far of each histogram in HISTOGRAMS."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {name: tuple(float(re.search(rf"^ddtree_verifier_{name}_{part} (\S+)$", text, re.M).group(1))
                        for part in ("sum", "count")) for name in HISTOGRAMS}


def histogram_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]) -> dict[str, float]:
    return {f"mean_{name}": (after[name][0] - before[name][0]) / max(1.0, after[name][1] - before[name][1])
            for name in HISTOGRAMS}


def budget_counts(metrics_url: str) -> dict[str, float]:
    """The verifier's cumulative count of steps per tree-budget bucket ('le' -> steps at or below it)."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {le: float(count) for le, count in
            re.findall(r'^ddtree_verifier_tree_budget_bucket\{le="([^"]+)"\} (\S+)$', text, re.M)}


def budget_shares(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The share of a run's steps per chosen budget bucket (exact budgets 0, 1, 3, ..., 2^k - 1)."""
    cumulative = [(le, after[le] - before.get(le, 0.0)) for le in after]
    total = cumulative[-1][1] if cumulative else 0.0
    shares, below = {}, 0.0
    for le, count in cumulative:
        if le != "+Inf" and count > below:
            shares[str(int(float(le)))] = (count - below) / total
        below = count
    return shares


def measure(target: str, drafter: str, device: str, verifier_args: tuple[str, ...], concurrency: list[int],
            context_chars: int, max_new_tokens: int, pins: dict[str, int],
            repeats: int = 1, replicas: int = 1) -> dict[tuple[int, str, int], dict]:
    """Runs per (concurrency, choice, repeat) on one stack; a choice pins the requests' tree budget (0: the
    verifier's policy), and every other repeat takes the choices in reverse order (the first run at a concurrency
    pays for new shapes). Each run also reports the mean budget its steps chose and its engine steps' mean sessions
    and time, over the whole run and over its full window."""
    metrics_port = free_port()
    verifier_args = (*verifier_args, "--metrics-port", str(metrics_port))
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    runs = {}
    sessions = ("--max-sessions-per-key", str(max(concurrency)))  # NOTE: the benchmark is one caller
    with LocalStack(target, drafter, replicas, device, f"127.0.0.1:{free_port()}", verifier_args=verifier_args,
                    gateway_args=sessions) as stack:
        asyncio.run(run_sessions(stack.addresses["gateway"], prompts(1, 256), 8))  # warm-up (kernels, caches)
        for c in concurrency:
            for repeat in range(repeats):
                for choice, pin in (reversed if repeat % 2 else list)(pins.items()):
                    before, budgets_before = histogram_totals(metrics_url), budget_counts(metrics_url)
                    window = FullWindow(c, lambda: histogram_totals(metrics_url))
                    run = asyncio.run(run_sessions(stack.addresses["gateway"], prompts(c, context_chars),
                                                   max_new_tokens, pin, window))
                    full = histogram_means(*window.snapshots) if len(window.snapshots) == 2 else {}
                    runs[c, choice, repeat] = {
                        **run, **histogram_means(before, histogram_totals(metrics_url)),
                        "full_window": {key: full.get(f"mean_{key}")
                                        for key in ("batch_seconds", "batch_sessions", "step_gap_seconds",
                                                        "draft_round_seconds", "engine_gpu_seconds",
                                                        "step_host_overhead_seconds")},
                        "budget_shares": budget_shares(budgets_before, budget_counts(metrics_url))}
    return runs


def none_or(value: float | None, scale: float) -> float | None:
    return None if value is None else value * scale


def pair(values: list[float | None], spec: str) -> str:
    return " / ".join("-" if v is None else format(v, spec) for v in values)


def summary(rows: list[dict]) -> list[str]:
    """Per (sessions, choice): the medians over its runs, and each against the best fixed budget's median (the
    adaptive target: at least 0.95)."""
    def key(row: dict) -> tuple:
        return row["concurrency"], row["tree_budget"]

    totals = median_runs(rows, key, lambda r: r["speculative_tokens_per_s"])
    windows = median_runs(rows, key, lambda r: r["full_window_tokens_per_s"][0])
    best_total = best_fixed(totals, lambda k: k[0], lambda k: k[1])
    best_window = best_fixed(windows, lambda k: k[0], lambda k: k[1])
    lines = ["| sessions | tree budget | runs | median tok/s | / best fixed | median full-window tok/s "
             "| / best fixed |",
             "|---|---|---|---|---|---|---|"]
    for (c, choice), (runs, total) in totals.items():
        window = windows.get((c, choice), (0, None))[1]
        lines.append(f"| {c} | {choice} | {runs} | {total:.0f} | {pair([ratio(total, best_total.get(c))], '.2f')} "
                     f"| {pair([window], '.0f')} | {pair([ratio(window, best_window.get(c))], '.2f')} |")
    return lines


def median_runs(rows: list[dict], key: Callable[[dict], tuple], value: Callable[[dict], float | None]
                ) -> dict[tuple, tuple[int, float]]:
    """key(row) -> (runs, the median of value(row)) over the rows that have a value, in the rows' order."""
    values: dict[tuple, list[float]] = {}
    for row in rows:
        if (measured := value(row)) is not None:
            values.setdefault(key(row), []).append(measured)
    return {k: (len(v), statistics.median(v)) for k, v in values.items()}


def best_fixed(medians: dict[tuple, tuple[int, float]], group: Callable[[tuple], object],
               choice: Callable[[tuple], str]) -> dict[object, float]:
    """group(key) -> the best median of a pinned budget (a choice that is a number) in that group."""
    best: dict[object, float] = {}
    for key, (_, rate) in medians.items():
        if choice(key).isdigit():
            best[group(key)] = max(best.get(group(key), 0.0), rate)
    return best


def ratio(value: float | None, best: float | None) -> float | None:
    return None if value is None or not best else value / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="HF checkpoint directory")
    parser.add_argument("--tiny", action="store_true", help="the tiny built-in model on the CPU")
    parser.add_argument("--random-shape", choices=tuple(RANDOM_SHAPES), default="qwen3-0.6b",
                        help="the shape --random-target writes ('small': fp32, for the CPU)")
    parser.add_argument("--random-target", type=Path,
                        help="write a random model of --random-shape (byte-level tokenizer) here and use it")
    parser.add_argument("--random-std", type=float, default=0.02,
                        help="the random weights' standard deviation: 0.1 makes the small shape's greedy text seldom "
                             "repeat (n-gram acceptance ~1, as the random 8B model's on the GPU), 0.02 makes it loop")
    parser.add_argument("--drafter", default="ngram")
    parser.add_argument("--drafter-replicas", type=int, default=1,
                        help="drafter processes; the verifier spreads the sessions over them")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=4096, help="prompt length in characters (~tokens)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tree-budget", type=int, default=15)
    add_budget_sweep_args(parser, "concurrency")  # NOTE: without --tree-budgets, the --tree-budget run alone
    parser.add_argument("--verifier-arg", action="append", default=[], metavar="WORDS",
                        help="more words for the verifier, e.g. \"--gil-switch-interval-ms 5\" (repeatable)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    target = str(ensure_tiny_model()[0]) if args.tiny else args.target
    if args.random_target:
        target = str(make_tiny_target(args.random_target, shape=RANDOM_SHAPES[args.random_shape],
                                      std=args.random_std))
    if target is None:
        raise SystemExit("--target DIR or --tiny")
    pins = budget_pins(args.tree_budgets or [str(args.tree_budget)], parser.error)
    max_budget = max((pin for pin in pins.values() if pin), default=args.tree_budget)
    # NOTE: --no-prefix-caching: each budget and repeat runs the same prompts, and every run prefills them alike
    verifier_args = ("--tree-budget", str(max_budget), "--max-context", str(args.context + 2048),
                     "--budget-policy", "adaptive" if "adaptive" in pins else "fixed", "--no-prefix-caching",
                     *(("--attention", "triton", "--kv-budget-mb", "32768")
                       if args.device == "cuda" else ()),
                     *(word for value in args.verifier_arg for word in shlex.split(value)))
    bandwidth = copy_bandwidth(args.device)
    spec_runs = measure(target, args.drafter, args.device, verifier_args, args.concurrency, args.context,
                        args.max_new_tokens, pins, args.repeats, args.drafter_replicas)
    plain_runs = measure(target, "none", args.device, verifier_args, args.concurrency, args.context,
                         args.max_new_tokens, {"plain": 0}, args.repeats)
    rows, mean_context = [], args.context + args.max_new_tokens // 2  # NOTE: the prompt's tokens, ~ its characters
    for (c, choice, repeat), spec in spec_runs.items():
        plain = plain_runs[c, "plain", repeat]
        same = [a == b for a, b in zip(spec["outputs"], plain["outputs"])]
        if args.device == "cpu":  # NOTE: fp32: the two paths must agree token for token
            assert all(same), f"speculative output (tree budget {choice}) differs from plain decoding"
        rows.append({"concurrency": c, "tree_budget": choice, "run": repeat + 1,
                     "mean_tree_budget": spec["mean_tree_budget"],
                     "budget_shares": spec["budget_shares"],
                     "speculative_tokens_per_s": spec["tokens_per_s"],
                     "plain_tokens_per_s": plain["tokens_per_s"],
                     "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                     "mean_acceptance_length": spec["mean_acceptance_length"], "identical_outputs": sum(same),
                     "speculative_decode_tokens_per_s": spec["decode_tokens_per_s"],
                     "plain_decode_tokens_per_s": plain["decode_tokens_per_s"],
                     "speculative_mean_ttft_ms": spec["mean_ttft_ms"], "plain_mean_ttft_ms": plain["mean_ttft_ms"],
                     "speculative_itl_ms": [spec["itl_p50_ms"], spec["itl_p99_ms"]],
                     "plain_itl_ms": [plain["itl_p50_ms"], plain["itl_p99_ms"]],
                     "plain_floor_tokens_per_s": plain_floor_tokens_per_s(target, c, mean_context, bandwidth),
                     "batch_sessions": [spec["mean_batch_sessions"], plain["mean_batch_sessions"]],
                     "batch_ms": [spec["mean_batch_seconds"] * 1e3, plain["mean_batch_seconds"] * 1e3],
                     "host_ms": [spec["mean_drafting_pass_host_seconds"] * 1e3,
                                 spec["mean_plain_step_host_seconds"] * 1e3,
                                 plain["mean_plain_step_host_seconds"] * 1e3],
                     # NOTE: per forward, from CUDA events around each engine call (none on the CPU)
                     "gpu_and_host_overhead_ms": [[none_or(run["mean_engine_gpu_seconds"] or None, 1e3),
                                                   none_or(run["mean_step_host_overhead_seconds"] or None, 1e3)]
                                                  for run in (spec, plain)],
                     "full_window_tokens_per_s": [spec["full_window_tokens_per_s"], plain["full_window_tokens_per_s"]],
                     "full_window_batch_ms": [none_or(run["full_window"]["batch_seconds"], 1e3)
                                              for run in (spec, plain)],
                     "full_window_batch_sessions": [run["full_window"]["batch_sessions"] for run in (spec, plain)],
                     "full_window_gap_ms": [none_or(run["full_window"]["step_gap_seconds"], 1e3)
                                            for run in (spec, plain)],
                     "full_window_draft_round_ms": none_or(spec["full_window"]["draft_round_seconds"], 1e3),
                     "full_window_gpu_and_host_overhead_ms": [
                         [none_or(run["full_window"]["engine_gpu_seconds"] or None, 1e3),
                          none_or(run["full_window"]["step_host_overhead_seconds"] or None, 1e3)]
                         for run in (spec, plain)],
                     "mean_agreeing_prefix": statistics.mean(agreeing_prefix(a, b) for a, b in
                                                            zip(spec["outputs"], plain["outputs"]))})
    command = "python " + " ".join(sys.argv)
    result = {"command": command, "target": target, "drafter": args.drafter,
              "drafter_replicas": args.drafter_replicas, "device": args.device,
              "copy_bandwidth": bandwidth,
              "context_chars": args.context, "max_new_tokens": args.max_new_tokens, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "throughput.json").write_text(json.dumps(result, indent=2))
    lines = [f"# Throughput through the local stack ({args.device}, {Path(target).name})", "", f"`{command}`", "",
             "| sessions | tree budget | mean budget chosen | speculative tok/s | plain tok/s | speedup "
             "| decode tok/s, speculative / plain | plain floor tok/s | sessions per step, speculative / plain "
             "| ms per engine step, speculative / plain | ITL p50 / p99 ms, speculative | ITL p50 / p99 ms, plain "
             "| mean TTFT ms, speculative / plain | mean acceptance "
             "| identical outputs | tokens agreeing before the first difference "
             "| full window: tok/s, speculative / plain | full window: ms per engine step, speculative / plain "
             "| full window: ms between engine steps, speculative / plain "
             "| host ms per drafting pass / per plain step, speculative; per plain step, plain "
             "| GPU / host overhead ms per forward, speculative; plain "
             "| full window: GPU / host overhead ms per forward, speculative; plain | run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['concurrency']} | {r['tree_budget']} | {r['mean_tree_budget']:.1f} "
              f"| {r['speculative_tokens_per_s']:.1f} | {r['plain_tokens_per_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['speculative_decode_tokens_per_s']:.0f} / "
              f"{r['plain_decode_tokens_per_s']:.0f} | {r['plain_floor_tokens_per_s']:.0f} "
              f"| {r['batch_sessions'][0]:.1f} / {r['batch_sessions'][1]:.1f} "
              f"| {r['batch_ms'][0]:.1f} / {r['batch_ms'][1]:.1f} "
              f"| {r['speculative_itl_ms'][0]:.1f} / {r['speculative_itl_ms'][1]:.1f} "
              f"| {r['plain_itl_ms'][0]:.1f} / {r['plain_itl_ms'][1]:.1f} "
              f"| {r['speculative_mean_ttft_ms']:.0f} / {r['plain_mean_ttft_ms']:.0f} "
              f"| {r['mean_acceptance_length']:.2f} | {r['identical_outputs']}/{r['concurrency']} "
              f"| {r['mean_agreeing_prefix']:.1f} of {args.max_new_tokens} "
              f"| {pair(r['full_window_tokens_per_s'], '.0f')} | {pair(r['full_window_batch_ms'], '.1f')} "
              f"| {pair(r['full_window_gap_ms'], '.1f')} "
              f"| {r['host_ms'][0]:.2f} / {r['host_ms'][1]:.2f}; {r['host_ms'][2]:.2f} "
              f"| {pair(r['gpu_and_host_overhead_ms'][0], '.2f')}; {pair(r['gpu_and_host_overhead_ms'][1], '.2f')} "
              f"| {pair(r['full_window_gpu_and_host_overhead_ms'][0], '.2f')}; "
              f"{pair(r['full_window_gpu_and_host_overhead_ms'][1], '.2f')} "
              f"| {r['run']} |" for r in rows]
    lines += ["", *summary(rows)]
    note = ("tok/s counts every generated token over the wall time of the whole run, prefill included; decode "
            "tok/s sums each session's rate after its first token; TTFT is request to first token (the prefill, "
            "queued behind the other sessions' prefills). A tree budget is pinned by every request of its run "
            "('adaptive': the verifier's policy, whose shared cost model has also measured the runs before it); the "
            "mean budget chosen is over the steps after each generation's first. "
            "ITL is each streamed chunk's gap shared by its tokens, over all sessions. The plain floor is the sessions "
            "over a step that reads the weights and every session's KV once at the copy bandwidth measured here. "
            "Sessions per step and ms per engine step are the means over the run's engine verify steps (the batch's "
            "time in the engine, host work included, not its wait behind a prefill chunk; prefill chunks not "
            "counted). The full window is the "
            "stretch in which every session decodes (from the last first token to the first finish; '-' when there "
            "was none): no prefill shares the GPU there, and no tail of stragglers; the ms between engine steps are "
            "what the engine does not run while sessions step (drafts, the loop's own work, waits). Host ms: the "
            "verifier's step passes outside their engine calls and draft rounds (planning, handing events on, the "
            "streams meanwhile), per drafting pass and per plain step of a burst; 0 where there was none. GPU / host "
            "overhead ms per forward: the GPU's time on each engine call (CUDA events around it) and the rest of the "
            "call's wall time since the call before, less the engine's time on prefill chunks in between (issue 26's "
            "host overhead: step wall time less GPU busy time), per forward, over the run and over its full window; "
            "'-' on the CPU. "
            "On the CPU (fp32) the outputs are asserted equal. In bf16 the verify step (prefix partials merged with "
            "the tree block) and a plain step round differently, so near-tied argmaxes can flip (counted here).")
    chosen = [f"- {r['concurrency']} sessions, run {r['run']}: "
              + ", ".join(f"{budget}: {share:.0%}" for budget, share in r["budget_shares"].items())
              for r in rows if r["tree_budget"] == "adaptive"]
    if chosen:
        note += ("\n\nBudgets the adaptive runs chose (share of steps after each generation's first):\n"
                 + "\n".join(chosen))
    (args.out_dir / "throughput.md").write_text("\n".join(lines) + "\n\n" + note + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
