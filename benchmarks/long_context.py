"""Long-context serving through the real services (gateway -> verifier <-> drafter, separate processes): per
context and drafter, TTFT, decode tokens/s (n-gram and DFlash speculation vs plain decoding), the wall time per
step against the verifier's own step time, and the mean acceptance length.

Each drafter gets a fresh local stack; in it, every context in turn runs `--sessions` concurrent one-shot
generations (greedy, `--max-new-tokens` each, EOS ignored) of a repetitive document (a passage repeated, one
distinct opening per session), so that n-gram drafting hits. Writes long_context_<shape>.{json,md} to `--out-dir`.

    python benchmarks/long_context.py --shape qwen3-8b [--contexts 32k 128k 185k] [--drafters ngram dflash none]
        [--sessions 1] [--max-new-tokens 256] [--tree-budget 15] [--budget-policy fixed|adaptive]
        [--tree-budgets 7 15 31 63 adaptive] [--repeats 3] [--documents 3] [--shared-prefill]
        [--verifier-arg "--prefill-chunk 128"] [--kv-budget-mb MB] [--checkpoint-dir DIR] [--out-dir DIR]
    python benchmarks/long_context.py --shape tiny --contexts 512 --drafters ngram none   # CPU smoke run

Shapes: `qwen3-8b` is Qwen3-8B's layers and vocabulary with random bf16 weights and the byte-level tokenizer of
the tiny model (one token per character of the prompt), on CUDA, with a 5-layer block-16 DFlash drafter of the
published shape (random weights too: its acceptance says nothing, its cost per step does); each is written to
`--checkpoint-dir` the first time a run needs it (the target takes a minute or two) and reused. `tiny` is the
built-in tiny model and its DFlash drafter, on the CPU.

`--tree-budgets` runs every context once per choice on the same stack (a speculative drafter's requests pin the
budget, or leave it to the verifier's adaptive policy), and the table sets each against the best fixed one;
`--repeats N` runs each N times (every other time in reverse order) and compares their medians; `--documents N`
runs each on N documents (the sessions' openings differ), so that a choice's median is not one text's luck;
`--shared-prefill` prefills each document once and runs every choice on forks of its sessions, so that a run
costs its decode only (at 128k a prefill is ~12 s, a 384-token decode ~2 s).

A run too long for one sitting splits by drafter, context or document: later parts add their rows (and with
`--save-outputs` their texts) with `--merge`, e.g.
    python benchmarks/long_context.py --shape qwen3-8b --drafters none ngram
    python benchmarks/long_context.py --shape qwen3-8b --drafters dflash --merge
    python benchmarks/long_context.py ... --documents 10 --first-document 11 --merge   # documents 11-20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from e2e_step import git_commit, shape_of
from prometheus_client.parser import text_string_to_metric_families
from throughput import add_budget_sweep_args, best_fixed, budget_pins, median_runs, prompts

from ddtree.bench import RequestRecord, summarize
from ddtree.client import AsyncClient
from ddtree.local_stack import TINY_MODEL_DIR, LocalStack, ensure_tiny_model, free_port
from proto import gateway_pb2

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = ("ngram", "dflash", "none")  # "none": plain decoding
SHAPES = ("qwen3-8b", "tiny")
DEFAULT_CHECKPOINTS = TINY_MODEL_DIR.parent / "long-context-qwen3-8b"
# NOTE: the warm-up prompt spans two of the verifier's prefill chunks (4096 tokens on CUDA, 256 on the CPU) where the
# contexts allow: first-use costs (kernel compiles, CUDA graph capture, the drafter's first draft) stay out of TTFT
WARM_UP_TOKENS = 4608


@dataclass(frozen=True)
class Checkpoints:
    target: Path
    dflash: Path
    device: str


def context_tokens(text: str) -> int:
    """'32k' -> 32768 (k = 1024 tokens); plain integers as they are."""
    value = int(text[:-1]) * 1024 if text.lower().endswith("k") else int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a context must be positive, got {text}")
    return value


def context_label(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def checkpoints(shape: str, directory: Path, with_dflash: bool) -> Checkpoints:
    """The target and DFlash checkpoints of a shape: the tiny built-in model, or the random qwen3-8b-shaped pair,
    each written into `directory` the first time it is needed (the DFlash drafter only `with_dflash`); a
    `NAME.done` marker says a checkpoint was written whole."""
    if shape == "tiny":
        target, dflash = ensure_tiny_model()
        return Checkpoints(target, dflash, "cpu")
    target_config, dflash_config, device = shape_of(shape)
    found = Checkpoints(directory / "target", directory / "dflash", device)
    if not (directory / "target.done").is_file():
        from modeling.tiny import make_tiny_target

        print(f"writing a random {shape}-shaped target to {found.target}", flush=True)
        make_tiny_target(found.target, seed=0, shape=target_config)
        (directory / "target.done").write_text("")
    if with_dflash and not (directory / "dflash.done").is_file():
        print(f"writing a random DFlash drafter of the published {shape} shape to {found.dflash}", flush=True)
        write_dflash(found.dflash, dflash_config, target_config["vocab_size"], seed=1)
        (directory / "dflash.done").write_text("")
    return found


def write_dflash(path: Path, config: dict, vocab_size: int, seed: int) -> None:
    """A random DFlash drafter of `config` as modeling/tiny.py writes the tiny one: config.json and the drafter's
    own tensors (the embedding and LM head are the target's), saved in the config's dtype."""
    import torch
    from safetensors.torch import save_file

    from modeling.config import parse_dtype
    from modeling.dflash import TARGET_TENSORS, DFlashConfig, DFlashModel
    from modeling.tiny import _random_tensors

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    with torch.device("meta"):
        model = DFlashModel(DFlashConfig.from_hf(config), vocab_size)
    shapes = {name: p.shape for name, p in model.named_parameters() if name not in TARGET_TENSORS}
    dtype = parse_dtype(config["torch_dtype"])
    tensors = {name: t.to(dtype) for name, t in _random_tensors(shapes, seed, std=0.02).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def kv_budget_mb(target: Path, tokens_per_session: int, sessions: int, page_size: int) -> float:
    """The KV cache that holds `sessions` sessions of `tokens_per_session` tokens (whole pages), plus one page each
    for the draft tree's commit, in MB, in the checkpoint's dtype (qwen3-8b: 144 KiB per token, 185k ~ 26 GiB)."""
    from modeling.config import ModelConfig, parse_dtype
    from verifier_service.engine.kv_cache import KVCache

    config = ModelConfig.from_dir(target)
    page_bytes = KVCache.page_bytes(config, page_size, parse_dtype(config.torch_dtype))
    pages = sessions * (-(-tokens_per_session // page_size) + 1)
    return pages * page_bytes / (1 << 20)


def verifier_words(args: argparse.Namespace) -> list[str]:
    """What the verifier gets besides this script's own words: `--budget-policy` and every `--verifier-arg`. Plain
    steps go one per engine call unless a `--verifier-arg` says otherwise: each step is then one message, whose
    time this script sets against the engine step's."""
    words = ["--decode-burst-steps", "1", *(["--budget-policy", args.budget_policy] if args.budget_policy else [])]
    return words + [word for value in args.verifier_arg for word in shlex.split(value)]


def unknown_to_verifier(words: list[str]) -> list[str]:
    """The words the verifier's command line does not know (its own parser, run here: a bad value of an option
    it knows exits now, with its message, rather than after the checkpoints are written)."""
    from verifier_service.server import build_parser

    _, unknown = build_parser().parse_known_args(["--target", ".", *words])
    return unknown


@dataclass
class Stream:
    """One session's Generate stream: its timeline and the PrefillProgress messages before its first token."""
    record: RequestRecord
    prefill_messages: int = 0
    session: str = ""  # the session's handle (kept with `keep_session`)
    token_ids: list[int] = field(default_factory=list)


async def generate(client: AsyncClient, text: str, max_new_tokens: int, tree_budget: int = 0,
                   session: str | None = None, keep_session: bool = False) -> Stream:
    stream = Stream(RequestRecord(sent_at=time.perf_counter()))
    generation = client.generate(text, max_new_tokens=max_new_tokens, ignore_eos=True, tree_budget=tree_budget,
                                 session=session, keep_session=keep_session)
    async for event in generation.events():
        if isinstance(event, gateway_pb2.GenerateChunk):
            # NOTE: the first chunk is the first token (TTFT); later gaps are one step each
            stream.record.add_chunk(len(event.token_ids), time.perf_counter())
            stream.token_ids.extend(event.token_ids)
        else:
            stream.prefill_messages += 1
    stream.record.finish(time.perf_counter())
    stream.record.input_tokens = generation.summary.prompt_tokens
    stream.record.acceptance_lengths = generation.acceptance_lengths
    stream.session = generation.summary.session
    return stream


async def run_sessions(gateway: str, texts: list[str], max_new_tokens: int, tree_budget: int = 0,
                       parents: list[str] | None = None) -> tuple[list[Stream], float]:
    """`tree_budget` pinned by every request (0: the verifier's policy). With `parents` (sessions that hold the
    texts' prefills, `prefill_sessions`), each generation runs on a fork of its parent instead, released after it."""
    client = AsyncClient(gateway, timeout=3600)
    try:
        started = time.perf_counter()
        if parents is None:
            runs = [generate(client, text, max_new_tokens, tree_budget) for text in texts]
        else:
            runs = [on_fork(client, parent, max_new_tokens, tree_budget) for parent in parents]
        streams = await asyncio.gather(*runs)
        return list(streams), time.perf_counter() - started
    finally:
        await client.close()


async def on_fork(client: AsyncClient, parent: str, max_new_tokens: int, tree_budget: int) -> Stream:
    """A generation on a fork of `parent` (its KV prefix shared copy-on-write): the parent stays as it was."""
    fork = (await client.fork_session(parent)).session
    try:
        return await generate(client, "", max_new_tokens, tree_budget, session=fork)
    finally:
        await client.release_session(fork)


async def prefill_sessions(gateway: str, texts: list[str]) -> tuple[list[str], float]:
    """Sessions holding the texts' prefills, made one after another, and their mean prefill time (ms)."""
    client = AsyncClient(gateway, timeout=3600)
    try:
        replies = [await client.create_session(text) for text in texts]
        return [reply.session.session for reply in replies], statistics.mean(reply.prefill_ms for reply in replies)
    finally:
        await client.close()


async def release_sessions(gateway: str, handles: list[str]) -> None:
    client = AsyncClient(gateway, timeout=60)
    try:
        for handle in handles:
            await client.release_session(handle)
    finally:
        await client.close()


def verifier_counters(metrics_port: int) -> dict[str, float]:
    """The verifier's unlabelled counters and histogram sums / counts, by sample name."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if not sample.labels}


def mean_or_none(values: list[float]) -> float | None:
    return statistics.mean(values) if values else None


def context_row(drafter: str, context: int, budget: str, streams: list[Stream], duration_s: float,
                before: dict[str, float], after: dict[str, float]) -> dict:
    """One (context, drafter) result. Per session: decode tokens/s is the tokens after the first over the time
    from the first chunk to the last; ms per step is that time over the steps after the first. The verifier's
    step time is its `ddtree_verifier_step_seconds` over this run's steps (the engine step as the generation loop
    waits for it: batch, verify, accept, commit)."""
    records = [s.record for s in streams]
    report = summarize(records, duration_s)
    decode = [(len(r.itl_s), sum(r.itl_s), len(r.acceptance_lengths) - 1) for r in records]
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}
    steps = delta.get("ddtree_verifier_step_seconds_count", 0.0)
    ms_per_step = mean_or_none([1e3 * seconds / gaps for _, seconds, gaps in decode if gaps > 0])
    verify_ms = 1e3 * delta["ddtree_verifier_step_seconds_sum"] / steps if steps else None

    def mean_ms(histogram: str) -> float | None:
        count = delta.get(f"{histogram}_count", 0.0)
        return 1e3 * delta[f"{histogram}_sum"] / count if count else None

    per_session = [tokens / seconds for tokens, seconds, _ in decode if seconds > 0]
    return {
        "drafter": drafter, "context": context, "budget": budget, "sessions": len(streams),
        "prompt_tokens": report["input_tokens"], "output_tokens": report["output_tokens"],
        "ttft_ms": report["ttft_ms"]["mean"], "ttft_max_ms": max(1e3 * r.ttft_s for r in records),
        "prefill_messages": statistics.mean(s.prefill_messages for s in streams),
        "decode_tokens_per_s": mean_or_none(per_session), "decode_tokens_per_s_all_sessions": sum(per_session),
        "ms_per_step": ms_per_step, "verifier_step_ms": verify_ms,
        "outside_verifier_ms_per_step": None if ms_per_step is None or verify_ms is None else ms_per_step - verify_ms,
        # per drafting pass: planning and the round trip, and of it the drafters' own time (their replies' draft_ms)
        "draft_round_ms": mean_ms("ddtree_verifier_draft_round_seconds"),
        "seed_ms": mean_ms("ddtree_verifier_seed_seconds"),
        "drafter_compute_ms": mean_ms("ddtree_verifier_drafter_compute_seconds"),
        # the verifier's loop beside its engine calls (in the JSON only): per plain step, per drafting pass, and the
        # engine's idle gap between steps
        "plain_step_host_ms": mean_ms("ddtree_verifier_plain_step_host_seconds"),
        "drafting_pass_host_ms": mean_ms("ddtree_verifier_drafting_pass_host_seconds"),
        "step_gap_ms": mean_ms("ddtree_verifier_step_gap_seconds"),
        # on a GPU, per forward: the GPU's time (CUDA events around each engine call) and the rest of the step's
        # wall time (the host's share: the loop, the draft round, the engine's launches); None on the CPU
        "engine_gpu_ms": mean_ms("ddtree_verifier_engine_gpu_seconds"),
        "step_host_overhead_ms": mean_ms("ddtree_verifier_step_host_overhead_seconds"),
        "mean_acceptance_length": report["mean_acceptance_length"], "steps": int(steps),
        "drafted_nodes_per_step": delta.get("ddtree_verifier_drafted_nodes_total", 0.0) / steps if steps else None,
        # the tree budget the verifier chose per step after each generation's first (where it reports it)
        "mean_tree_budget": (delta["ddtree_verifier_tree_budget_sum"] / delta["ddtree_verifier_tree_budget_count"]
                             if delta.get("ddtree_verifier_tree_budget_count") else None),
        "draft_misses": int(delta.get("ddtree_verifier_draft_misses_total", 0.0)),
        "duration_s": duration_s,
    }


@dataclass(frozen=True)
class StackPlan:
    """What every stack of a run gets: the checkpoints, the verifier's and drafters' words (the metrics port
    aside) and the generations to run, by context."""
    checkpoints: Checkpoints
    verifier_args: tuple[str, ...]
    drafter_args: tuple[str, ...]
    texts: dict[int, dict[int, list[str]]]  # per context, per document number: the sessions' prompts
    budgets: dict[str, int]  # a speculative drafter's runs per context: name -> the requests' pinned budget
    repeats: int  # runs of each budget per context and document, every other one in reverse order
    shared_prefill: bool  # each document prefilled once, every run on forks of its sessions
    max_new_tokens: int
    start_timeout_s: float
    log_dir: Path | None

    def drafter(self, name: str) -> str:
        """LocalStack's drafter argument for a drafter name."""
        return {"ngram": "ngram", "dflash": str(self.checkpoints.dflash), "none": "none"}[name]


def measure(drafter: str, plan: StackPlan) -> tuple[list[dict], float]:
    """Start the stack for one drafter, warm it up, run every context; the rows and the start + warm-up time."""
    metrics_port = free_port()
    stack = LocalStack(str(plan.checkpoints.target), plan.drafter(drafter), 1, plan.checkpoints.device,
                       f"127.0.0.1:{free_port()}", verifier_args=(*plan.verifier_args, "--metrics-port",
                                                                  str(metrics_port)),
                       drafter_args=plan.drafter_args, log_dir=plan.log_dir / drafter if plan.log_dir else None)
    started = time.perf_counter()
    stack.start(timeout_s=plan.start_timeout_s)
    try:
        gateway = stack.addresses["gateway"]
        asyncio.run(run_sessions(gateway, prompts(1, min(WARM_UP_TOKENS, *plan.texts)), 16))
        start_s = time.perf_counter() - started
        rows = []
        budgets = {"-": 0} if drafter == "none" else plan.budgets
        for context, documents in plan.texts.items():
            for document, texts in documents.items():
                first_outputs: list[list[int]] | None = None
                parents, prefill_ms = (asyncio.run(prefill_sessions(gateway, texts)) if plan.shared_prefill
                                       else (None, None))
                try:
                    for repeat in range(1, plan.repeats + 1):
                        turn = (document - 1) * plan.repeats + repeat - 1  # NOTE: alternates across split calls too
                        for budget, pin in (reversed if turn % 2 else list)(budgets.items()):
                            before = verifier_counters(metrics_port)
                            streams, duration_s = asyncio.run(run_sessions(gateway, texts, plan.max_new_tokens, pin,
                                                                           parents))
                            outputs = [stream.token_ids for stream in streams]
                            first_outputs = first_outputs or outputs
                            rows.append({**context_row(drafter, context, budget, streams, duration_s, before,
                                                       verifier_counters(metrics_port)), "document": document,
                                         "same_tokens_as_first_run": same_prefix(first_outputs, outputs),
                                         "output_token_ids": outputs,
                                         "run": repeat, **({"document_prefill_ms": prefill_ms} if parents else {})})
                            print(json.dumps({k: v for k, v in rows[-1].items() if k != "output_token_ids"}),
                                  flush=True)
                finally:
                    if parents:
                        asyncio.run(release_sessions(gateway, parents))
        return rows, start_s
    finally:
        stack.stop()


def same_prefix(first: list[list[int]], outputs: list[list[int]]) -> int:
    """The tokens every session's output shares with the same session's in the document's first run, from the
    start. Greedy outputs are exact in exact arithmetic; in bf16 a verify of T rows rounds otherwise than one of T'
    (other matmul tilings), so a random model's near-tied logits may tip another way and the text, and with it what
    the drafter can hit, differs between budgets after that many tokens."""
    return min(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))
               for x, y in zip(first, outputs))


def median_rates(rows: list[dict]) -> dict[tuple[str, int, str], tuple[int, float]]:
    """(drafter, context, budget) -> (runs, median decode tokens/s per session), over the rows that have a rate."""
    return median_runs(rows, lambda r: (r["drafter"], r["context"], r.get("budget", "-")),
                       lambda r: r["decode_tokens_per_s"] or None)


def best_fixed_rates(medians: dict[tuple[str, int, str], tuple[int, float]]) -> dict[tuple[str, int], float]:
    """(drafter, context) -> the best median rate of a pinned budget."""
    return best_fixed(medians, lambda key: key[:2], lambda key: key[2])


def add_speedups(rows: list[dict]) -> None:
    """Each row's decode tokens/s over plain decoding's at its context (when plain ran), and over the best fixed
    budget's of its drafter and context (when several ran); with repeats, against their medians."""
    medians = median_rates(rows)
    plain = {context: rate for (drafter, context, _), (_, rate) in medians.items() if drafter == "none"}
    best_fixed = best_fixed_rates(medians)
    for row in rows:
        base = plain.get(row["context"])
        row["speedup_vs_plain"] = row["decode_tokens_per_s"] / base if base and row["decode_tokens_per_s"] else None
        best = best_fixed.get((row["drafter"], row["context"]))
        row["vs_best_fixed"] = row["decode_tokens_per_s"] / best if best and row["decode_tokens_per_s"] else None


def device_name(device: str) -> str:
    if device == "cpu":
        return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    import torch

    return torch.cuda.get_device_name()


def check_mergeable(earlier: dict, shape: str, settings: dict) -> None:
    if (earlier["shape"], earlier["settings"]) != (shape, settings):
        raise ValueError(f"--merge: the earlier results are of other settings ({earlier['shape']}, "
                         f"{earlier['settings']}); run with the same ones or without --merge")


def merge(result: dict, earlier: dict) -> dict:
    """`result` with the rows of an earlier run of the same settings that it did not measure again (the rows of
    one drafter, context, budget and document are the latest run's), and the earlier runs listed before its own."""
    check_mergeable(earlier, result["shape"], result["settings"])
    return {**result, "runs": earlier["runs"] + result["runs"], "rows": merged_rows(result["rows"], earlier["rows"])}


def merged_rows(rows: list[dict], earlier: list[dict]) -> list[dict]:
    """The earlier rows whose (drafter, context, budget, document) `rows` do not hold, then `rows`: the rows of the
    results, or of the saved outputs."""
    def key(row: dict) -> tuple:
        return row["drafter"], row["context"], row.get("budget", "-"), row.get("document", 1)

    measured = {key(r) for r in rows}
    return [r for r in earlier if key(r) not in measured] + rows


def markdown(result: dict) -> str:
    def cell(value: float | None, digits: int = 1) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    settings = result["settings"]
    devices = sorted({run["device"] for run in result["runs"]})
    lines = [f"# Long-context serving through the services, {result['shape']} shape, {', '.join(devices)}", ""]
    for run in result["runs"]:
        starts = ", ".join(f"{name} {seconds:.0f} s" for name, seconds in run["stack_start_s"].items())
        lines += [f"`{run['command']}`", "", f"Commit {run['commit'] or 'unknown'}, {run['date']}; checkpoints "
                  f"{run['checkpoints_s']:.0f} s, stack start and warm-up: {starts}; the whole run {run['wall_s']:.0f} "
                  "s.", ""]
    lines += [f"{settings['sessions']} concurrent session(s) per context, {settings['max_new_tokens']} new tokens "
              f"each (greedy, EOS ignored), tree budget {settings['tree_budget']}"
              + (f", budget policy {settings['budget_policy']}" if settings["budget_policy"] else "")
              + (f"; verifier arguments `{shlex.join(settings['verifier_args'])}`" if settings["verifier_args"]
                 else "") + ".", "",
              "| context | drafter | budget | document | run | TTFT ms (mean / max) | decode tok/s per session "
              "| all sessions | vs plain | vs best fixed budget | ms / step | verifier step ms "
              "| outside the verifier ms | draft round ms | the drafter's own ms | seed ms | mean acceptance "
              "| mean tree budget | draft misses | same tokens as the first run |", "|---" * 20 + "|"]
    for r in result["rows"]:
        speedup = "-" if r["speedup_vs_plain"] is None else f"{r['speedup_vs_plain']:.2f}x"
        vs_best = "-" if r.get("vs_best_fixed") is None else f"{r['vs_best_fixed']:.2f}x"
        lines.append(f"| {context_label(r['context'])} | {r['drafter']} | {r.get('budget', '-')} | "
                     f"{r.get('document', 1)} | {r.get('run', 1)} | "
                     f"{r['ttft_ms']:.0f} / {r['ttft_max_ms']:.0f} | {cell(r['decode_tokens_per_s'])} | "
                     f"{cell(r['decode_tokens_per_s_all_sessions'])} | {speedup} | {vs_best} "
                     f"| {cell(r['ms_per_step'], 2)} | {cell(r['verifier_step_ms'], 2)} | "
                     f"{cell(r['outside_verifier_ms_per_step'], 2)} | {cell(r.get('draft_round_ms'), 2)} | "
                     f"{cell(r.get('drafter_compute_ms'), 2)} | {cell(r.get('seed_ms'))} | "
                     f"{cell(r['mean_acceptance_length'], 2)} | "
                     f"{cell(r.get('mean_tree_budget'))} | {r['draft_misses']} | "
                     f"{r.get('same_tokens_as_first_run', '-')} |")
    shared = ("With --shared-prefill each document's sessions were prefilled once and every run generated on forks "
              "of them: TTFT is a fork's first step (the prefills' means are the JSON's document_prefill_ms). "
              if settings.get("shared_prefill") else "")
    lines += ["", shared + "TTFT: request to the first token at the client (the prefill, streamed as PrefillProgress "
              "messages before it; concurrent sessions queue behind each other's prefills). Decode tok/s: a session's "
              "tokens after the first over the time from its first chunk to its last; all sessions: their sum; vs "
              "plain: per session, against drafter none at the same context; vs best fixed budget: against the fastest "
              "pinned budget of the same drafter and context (issue 23's adaptive target: >= 0.95x). Budget: the "
              "tree budget the requests pinned, adaptive (the verifier's policy chose per step) or - (the verifier's "
              "--tree-budget, or plain decoding). ms / step: that time over the steps after "
              "the first (one chunk per step). Verifier step: the verifier's own `ddtree_verifier_step_seconds` "
              "(batch, verify, accept, commit, as the generation loop waits for it) over the run's steps, the first "
              "(the prompt's last token, undrafted) included; outside the verifier: drafting, gRPC and the gateway. "
              "Draft round: per pass that drafted, from its start (the budgets' planning) until every draft is in "
              "(`ddtree_verifier_draft_round_seconds`); the drafter's own: the longest reply's draft_ms in that "
              "round (the replica's commit, forward and trees), so the round less it is the hop. Seed: opening a "
              "generation's mirror on the drafter, from its Open to the drafter's acknowledgement, the generation "
              "stepping without drafts meanwhile (`ddtree_verifier_seed_seconds`; not in the draft round's mean). "
              "Mean acceptance: tokens per step, the first included. Mean tree budget: the draft nodes the verifier "
              "asked for per step after the first (`ddtree_verifier_tree_budget`; its policy's choice). Same tokens as "
              "the first run: the new tokens every session's output shares, from the start, with its output in the "
              "document's first run (all of them: the runs generated the same text, so their drafts could hit "
              "alike; fewer: bf16 rounding differs with the rows verified, a near-tied token tipped another way)."
              + (" Random weights: the DFlash drafter's acceptance means nothing, its cost per step does; the n-gram "
                 "drafter hits because the prompt and the random model's output repeat themselves."
                 if result["shape"] != "tiny" else ""), ""]
    medians = median_rates(result["rows"])
    if any(runs > 1 for runs, _ in medians.values()):
        best_fixed = best_fixed_rates(medians)
        lines += ["Medians over the runs (the adaptive target, issue 23: >= 0.95x the best fixed budget's median):",
                  "", "| context | drafter | budget | runs | median decode tok/s | vs best fixed budget |",
                  "|---|---|---|---|---|---|"]
        for (drafter, context, budget), (runs, rate) in medians.items():
            best = best_fixed.get((drafter, context))
            lines.append(f"| {context_label(context)} | {drafter} | {budget} | {runs} | {rate:.1f} | "
                         + (f"{rate / best:.2f}x |" if best else "- |"))
        lines.append("")
    return "\n".join(lines)


def add_stack_args(parser: argparse.ArgumentParser) -> None:
    """The options of every benchmark that starts a stack on these checkpoints: the KV page size, where the
    checkpoints are kept, how long the stack may take to start, where the results go."""
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--checkpoint-dir", type=Path, default=DEFAULT_CHECKPOINTS,
                        help="where the qwen3-8b-shaped checkpoints are written once and reused (~16 GB target, "
                             "~2 GB drafter)")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "),
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    parser.add_argument("--shape", choices=SHAPES, default="qwen3-8b",
                        help="qwen3-8b: random bf16 weights on CUDA; tiny: the built-in model on the CPU")
    parser.add_argument("--contexts", type=context_tokens, nargs="+", default=[32 << 10, 128 << 10, 185 << 10],
                        help="prompt lengths in tokens; 32k = 32768 (default: 32k 128k 185k)")
    parser.add_argument("--drafters", nargs="+", choices=DRAFTERS, default=list(DRAFTERS),
                        help="a stack each, in this order; none = plain decoding (default: all three)")
    parser.add_argument("--sessions", type=int, default=1, help="concurrent sessions per context")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tree-budget", type=int, default=15, help="the verifier's draft tree nodes per step")
    parser.add_argument("--budget-policy", choices=("fixed", "adaptive"),
                        help="passed to the verifier (an error if its command line has no such option)")
    add_budget_sweep_args(parser, "context")  # NOTE: adaptive among them sets --budget-policy adaptive
    parser.add_argument("--verifier-arg", action="append", default=[], metavar="WORDS",
                        help='more verifier options, e.g. --verifier-arg "--prefill-chunk 128" (repeatable)')
    parser.add_argument("--drafter-arg", action="append", default=[], metavar="WORDS",
                        help='more drafter options, e.g. --drafter-arg "--context-window 4096" (repeatable)')
    parser.add_argument("--documents", type=int, default=1,
                        help="documents per context (the sessions' openings differ); every choice runs on each, "
                             "and the summary's medians are over all of them: with random weights the text, and "
                             "so the acceptance, changes with the document")
    parser.add_argument("--first-document", type=int, default=1,
                        help="the number of the first of the --documents (a run split over calls by document: "
                             "--first-document 11 --merge adds documents 11-20 to a run of the first 10)")
    parser.add_argument("--shared-prefill", action="store_true",
                        help="prefill each document's prompts once (CreateSession) and run every choice on forks of "
                             "them (ForkSession): a run then costs its decode only, so many documents fit one call; "
                             "TTFT is then a fork's first step, the prefill the JSON's document_prefill_ms")
    parser.add_argument("--kv-budget-mb", type=float,
                        help="the verifier's KV cache (default: --sessions sessions of the longest context and its "
                             "new tokens; qwen3-8b at 185k: ~27 GB a session)")
    add_stack_args(parser)
    parser.add_argument("--log-dir", type=Path, help="the services' logs, a folder per drafter (default: temporary)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of the results already in --out-dir that this run does not measure again "
                             "(same shape and settings): a run split over several calls, e.g. one per drafter")
    parser.add_argument("--save-outputs", action="store_true",
                        help="also write every run's generated token ids (long_context_SHAPE_outputs.json): the texts "
                             "benchmarks/budget_replay.py replays the budget policies on")
    parser.add_argument("--commit", default=None,
                        help="the commit to record (default: the checkout's, from git; a copy without .git: unknown)")
    return parser


def sweep_pins(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, int]:
    """The speculative runs per context, by name, with the budget their requests pin (0: the verifier's policy).
    With `--tree-budgets`, sets the verifier's maximum (`--tree-budget`) to the largest fixed one, and its policy to
    adaptive where adaptive is a choice."""
    if not args.tree_budgets:
        return {"-": 0}
    pins = budget_pins(args.tree_budgets, parser.error)
    if "adaptive" in pins:
        if args.budget_policy == "fixed":
            parser.error("--tree-budgets adaptive needs the verifier's adaptive policy, not --budget-policy fixed")
        args.budget_policy = "adaptive"
    args.tree_budget = max((pin for pin in pins.values() if pin), default=args.tree_budget)
    return pins


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    started = time.perf_counter()
    if min(args.sessions, args.repeats, args.documents, args.first_document) < 1 or args.max_new_tokens < 2:
        parser.error("--sessions, --repeats, --documents and --first-document must be >= 1 and --max-new-tokens >= 2 "
                     "(a step after the first token)")
    pins = sweep_pins(parser, args)
    extra_verifier = verifier_words(args)
    if unknown := unknown_to_verifier(extra_verifier):
        parser.error(f"the verifier (verifier_service/server.py) has no option {' '.join(unknown)}")
    extra_drafter = [word for value in args.drafter_arg for word in shlex.split(value)]
    settings = {"sessions": args.sessions, "max_new_tokens": args.max_new_tokens, "tree_budget": args.tree_budget,
                "budget_policy": args.budget_policy, "page_size": args.page_size, "verifier_args": extra_verifier,
                "drafter_args": extra_drafter, **({"tree_budgets": args.tree_budgets} if args.tree_budgets else {}),
                **({"repeats": args.repeats} if args.repeats > 1 else {}),
                **({"documents": args.documents} if args.documents > 1 else {}),
                **({"shared_prefill": True} if args.shared_prefill else {})}
    json_path, md_path = (args.out_dir / f"long_context_{args.shape}.{ext}" for ext in ("json", "md"))
    earlier = None
    if args.merge:  # NOTE: checked before the (long) measurements, not after them
        try:
            earlier = json.loads(json_path.read_text())
            check_mergeable(earlier, args.shape, settings)
        except (OSError, ValueError) as error:
            parser.error(f"--merge: {json_path}: {error}")
    found = checkpoints(args.shape, args.checkpoint_dir, "dflash" in args.drafters)
    checkpoint_s = time.perf_counter() - started
    # NOTE: a session holds its prompt and new tokens; a step's tree (and a page of slack) is verified past them
    max_context = max(args.contexts) + args.max_new_tokens + args.tree_budget + args.page_size
    model_limit = json.loads((found.target / "config.json").read_text())["max_position_embeddings"]
    if max_context > model_limit:
        parser.error(f"the longest context, its new tokens and a step's tree ({max_context} tokens) exceed the "
                     f"{args.shape} model's {model_limit} positions")
    kv_mb = args.kv_budget_mb or kv_budget_mb(found.target, max_context, args.sessions, args.page_size)
    if args.shared_prefill and not args.kv_budget_mb:  # NOTE: the forks' own pages beside their parents'
        kv_mb += kv_budget_mb(found.target, args.max_new_tokens + args.tree_budget + 2 * args.page_size,
                              args.sessions, args.page_size)
    documents = range(args.first_document, args.first_document + args.documents)
    texts = {context: {d: [text[:context] for text in prompts(args.sessions, context, d - 1)] for d in documents}
             for context in args.contexts}
    # NOTE: --no-prefix-caching: every run of a document (budgets, repeats) prefills it, so TTFT is the prefill's
    plan = StackPlan(found, ("--tree-budget", str(args.tree_budget), "--max-context", str(max_context),
                             "--kv-budget-mb", f"{kv_mb:.1f}", "--page-size", str(args.page_size),
                             "--no-prefix-caching", *extra_verifier),
                     tuple(extra_drafter), texts, pins, args.repeats, args.shared_prefill, args.max_new_tokens,
                     args.start_timeout_s, args.log_dir)
    rows, start_s = [], {}
    for drafter in args.drafters:
        drafter_rows, start_s[drafter] = measure(drafter, plan)
        rows += drafter_rows
    run = {"command": "python " + shlex.join(sys.argv), "commit": args.commit or git_commit(),
           "date": time.strftime("%Y-%m-%d %H:%M"), "device": device_name(found.device),
           "drafters": args.drafters, "contexts": args.contexts, "kv_budget_mb": kv_mb, "max_context": max_context,
           "checkpoints_s": checkpoint_s, "stack_start_s": start_s, "wall_s": time.perf_counter() - started}
    outputs = [{key: row[key] for key in ("drafter", "context", "budget", "document", "run")}
               | {"token_ids": row.pop("output_token_ids")} for row in rows]
    result = {"shape": args.shape, "target": str(found.target), "dflash": str(found.dflash), "settings": settings,
              "runs": [run], "rows": rows}
    if earlier is not None:
        result = merge(result, earlier)
    result["rows"].sort(key=lambda r: (r["context"], DRAFTERS.index(r["drafter"])))
    add_speedups(result["rows"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    if args.save_outputs:
        outputs_path, command = args.out_dir / f"long_context_{args.shape}_outputs.json", run["command"]
        if earlier is not None and outputs_path.exists():  # NOTE: the texts of the calls merged, as their rows
            saved = json.loads(outputs_path.read_text())
            outputs, command = merged_rows(outputs, saved["rows"]), f"{saved['command']}; then {command}"
        outputs_path.write_text(json.dumps({"command": command, "commit": run["commit"], "rows": outputs}) + "\n")
    md_path.write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
