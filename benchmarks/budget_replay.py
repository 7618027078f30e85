"""The tree-budget policies replayed on recorded texts: every policy drafts with the real n-gram drafter on the same
tokens, so their tokens per second differ only by the budgets they choose.

Why: through the services on a GPU, greedy bf16 text from a random model changes with the budget (a verify of other
row counts rounds otherwise and tips near-tied tokens), and with it what the drafter can hit: at 128k one document
accepted 4.1 tokens a step at budget 15 and 11.6 at 31 and 63, another 2.6 at 63 against 4.2 at 15, which one text
cannot do (long_context_adaptive_10docs_h100.md). Here
each recorded text (`benchmarks/long_context.py --save-outputs`) is the truth every policy is walked against: a step
drafts from the history (prompt and text so far) with the budget the policy chose, accepts the path of its tree that
the text follows, and costs what the engine model says (budget_simulation.py's, fitted to the run's measured steps).

`--git-edits REPO` takes real texts instead, which no CPU model writes: code edits from a git history, each prompted
with the file's old version and written as its new one (what prompt-lookup drafting is for; the text repeats the
prompt in runs, broken where the edit is), replayed by a lone session on each of budget_simulation's engines and by a
batch of 16 sessions, one text each.

    python benchmarks/budget_replay.py OUTPUTS.json [--verify-ms 13.5] [--row-us 13] [--round-ms 1.4]
    python benchmarks/budget_replay.py OUTPUTS.json --fit RESULTS.json   # the costs of the run itself
    python benchmarks/budget_replay.py --git-edits REPO [--rev HEAD] [--edits 24] [--tokens 512]
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget_simulation import ENGINES, FIXED, Engine, adaptive_sessions, tokens_per_s  # noqa: E402
from throughput import prompts  # noqa: E402

from drafter_service.ngram_drafter import MAX_DEPTH  # noqa: E402
from drafter_service.ngram_index import NgramIndex  # noqa: E402
from modeling.tiny import byte_level_tokenizer  # noqa: E402
from modeling.tree import DraftTree  # noqa: E402
from verifier_service.engine.acceptance import accept_path  # noqa: E402
from verifier_service.tree_budget import FixedBudget  # noqa: E402

PROMPT_TAIL = 4096  # the prompt tokens the history starts with (a random model seldom outputs their ids)
EDIT_LEAD = 200  # the characters of an edited file's new version before its first change that its text starts with
BATCH = 16  # the sessions of an edits replay's batch, one text each


class RecordedText:
    """A generation whose tokens are known in advance (budget_simulation's Workload, one session): a step `made`
    tokens in drafts from the prompt and the text's first `made` tokens, and accepts the nodes of its tree that
    the text follows from there."""

    def __init__(self, prompt: list[int], text: list[int]):
        self.prompt, self.text = prompt, text
        self.index = NgramIndex()
        self.made = -1  # the tokens of the text in the index's history (-1: not opened)

    def lucky(self, made: int, session: int, generation: int) -> bool:
        return True  # NOTE: the text alone decides what a draft accepts

    def tree(self, budget: int, made: int, lucky: bool) -> DraftTree:
        if made < self.made or self.made < 0:  # NOTE: a new generation of the same text
            self.index.open("text", self.prompt + self.text[:made])
        elif made > self.made:
            self.index.extend("text", self.text[self.made:made])
        self.made = made
        return self.index.draft("text", budget, MAX_DEPTH)

    def path(self, tree: DraftTree, made: int, lucky: bool) -> list[int]:
        """The accepted nodes, walked as the engine walks them: the target's token after a node at depth d is the
        text's token d places past the root's (-1, matching nothing, past the text's end)."""
        following = [self.text[made + depth] if made + depth < len(self.text) else -1 for depth in (0, *tree.depths)]
        return accept_path(tree, following)[0]


class RecordedTexts:
    """One recorded text per session (as budget_simulation's Workload tells each session's)."""

    def __init__(self, texts: list[tuple[list[int], list[int]]]):
        self.texts = [RecordedText(prompt, text) for prompt, text in texts]

    def of_session(self, session: int) -> RecordedText:
        return self.texts[session]


def replay(texts: list[tuple[list[int], list[int]]], engine: Engine, generations: int,
           tokens: int | None = None) -> dict[str, float]:
    """Tokens per simulated second of every fixed budget and the adaptive policy, one session per (prompt, text),
    each writing `tokens` of its text (all of the shortest one by default) per generation."""
    tokens = tokens or min(len(text) for _, text in texts)
    policies = {str(b): lambda _, b=b: FixedBudget(b) for b in FIXED} | {"adaptive": adaptive_sessions(max(FIXED))}
    return {name: tokens_per_s(policy, len(texts), RecordedTexts(texts), engine, tokens=tokens,
                               generations=generations) for name, policy in policies.items()}


def git(repo: Path, *args: str) -> str:
    """A git command's output in `repo` (an error if it fails)."""
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, errors="replace",
                          check=True).stdout


def edit_texts(repo: Path, rev: str, count: int, tokens: int) -> list[dict]:
    """Up to `count` code edits from the commits of `repo` up to `rev`, newest first: per commit, its first changed
    .py or .md file whose new version holds `tokens` tokens from EDIT_LEAD characters before its first change.
    The prompt is the old version (its last PROMPT_TAIL tokens), the text the new one from there."""

    tokenizer, edits = byte_level_tokenizer(), []
    for commit in git(repo, "rev-list", "--no-merges", rev).split():
        changed = git(repo, "diff-tree", "--no-commit-id", "--name-only", "--diff-filter=M", "-r", commit).split()
        for path in (p for p in changed if p.endswith((".py", ".md"))):
            old, new = git(repo, "show", f"{commit}^:{path}"), git(repo, "show", f"{commit}:{path}")
            first = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
            text = tokenizer.encode(new[max(0, first - EDIT_LEAD):]).ids[:tokens]
            if len(text) == tokens:
                edits.append({"commit": commit[:12], "path": path, "prompt": tokenizer.encode(old).ids[-PROMPT_TAIL:],
                              "text": text})
                break
        if len(edits) == count:
            break
    return edits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("outputs", type=Path, nargs="?",
                        help="long_context_SHAPE_outputs.json (long_context.py --save-outputs)")
    parser.add_argument("--verify-ms", type=float, default=13.5, help="a verify step's fixed part")
    parser.add_argument("--row-us", type=float, default=13.0, help="a verify step's cost per row (tree node or root)")
    parser.add_argument("--round-ms", type=float, default=1.4, help="a drafting step's draft round trip")
    parser.add_argument("--fit", type=Path, metavar="RESULTS.json",
                        help="the three costs above fitted to the run's own steps (long_context.py's results JSON)")
    parser.add_argument("--git-edits", type=Path, metavar="REPO", help="replay code edits from this git repository "
                        "instead of recorded outputs, on every engine of budget_simulation.py")
    parser.add_argument("--rev", default="HEAD", help="--git-edits: the newest commit to take edits from")
    parser.add_argument("--edits", type=int, default=24, help="--git-edits: how many (one per commit)")
    parser.add_argument("--tokens", type=int, default=512, help="--git-edits: the tokens of each text")
    parser.add_argument("--generations", type=int, default=2, help="generations of each text back to back (the "
                        "second starts with the service's record of what the budgets accepted)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if (args.outputs is None) == (args.git_edits is None):
        parser.error("give either OUTPUTS.json or --git-edits REPO")
    if args.fit is not None:
        args.verify_ms, args.row_us, args.round_ms = fitted_costs(json.loads(args.fit.read_text()))
    command = " ".join(["python benchmarks/budget_replay.py", *sys.argv[1:]])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.git_edits is not None:
        replay_edits(args, command)
    else:
        replay_recorded(args, command)


def fitted_costs(results: dict) -> tuple[float, float, float]:
    """(verify ms, us a row, round ms) of a long_context.py run: the line through its fixed-budget speculative runs'
    ms per step less their draft round, against their rows a step (drafted nodes and the root), least squares; the
    round's median. The steps' cost in rows is what the policies trade, and at 128k a row costs ~0.1 ms (each reads
    the whole prefix), where the defaults' 13 us suit a short context."""
    runs = [r for r in results["rows"] if r["drafter"] != "none" and str(r["budget"]).isdigit()]
    if len(runs) < 2:
        raise SystemExit("--fit needs two or more fixed-budget speculative runs (long_context.py --tree-budgets)")
    rows = np.array([r["drafted_nodes_per_step"] + 1 for r in runs])
    verify = np.array([r["ms_per_step"] - r["draft_round_ms"] for r in runs])
    slope, intercept = np.polyfit(rows, verify, 1)
    return round(float(intercept), 2), round(float(slope) * 1e3, 1), round(statistics.median(r["draft_round_ms"]
                                                                                          for r in runs), 2)


def replay_recorded(args: argparse.Namespace, command: str) -> None:
    """Every recorded speculative run's text, replayed by a lone session on the flat cost line of the arguments."""
    recorded = json.loads(args.outputs.read_text())
    engine = Engine(fixed=args.verify_ms / 1e3, per_session=0.0, per_tree=0.0, per_row=args.row_us / 1e6,
                    round_s=args.round_ms / 1e3, round_per_draft=0.0, call_s=0.0, burst=1)
    tokenizer = byte_level_tokenizer()
    rows = []
    for output in recorded["rows"]:
        if output["drafter"] == "none":
            continue
        text = prompts(1, output["context"], output["document"] - 1)[0][:output["context"]]
        prompt = tokenizer.encode(text).ids[-PROMPT_TAIL:]
        rates = replay([(prompt, output["token_ids"][0])], engine, args.generations)
        rows.append({key: output[key] for key in ("context", "document", "budget", "run")} | {"rates": rates})
        print(json.dumps(rows[-1]), flush=True)
    stem = args.outputs.name.removesuffix("_outputs.json").replace("long_context", "budget_replay")
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"command": command, "source": recorded.get("command"),
                                                           "rows": rows}, indent=1) + "\n")
    costs = (f"a step {args.verify_ms} ms, {args.row_us} us more a row (tree node or root), {args.round_ms} ms more "
             f"when it drafts; {args.generations} generations of each text back to back")
    (args.out_dir / f"{stem}.md").write_text(markdown(command, recorded.get("command"), costs, rows))


def replay_edits(args: argparse.Namespace, command: str) -> None:
    """Each edit replayed by a lone session, and the first BATCH together, on every engine."""
    rev = git(args.git_edits, "rev-parse", args.rev).strip()
    edits = edit_texts(args.git_edits, rev, args.edits, args.tokens)
    texts = [(edit["prompt"], edit["text"]) for edit in edits]
    batch = texts[:BATCH]
    rows = []
    for name, engine in ENGINES.items():
        alone = [replay([text], engine, args.generations) for text in texts]
        together = replay(batch, engine, args.generations)
        rows.append({"engine": name, "alone": alone, "batch": together, "batch_sessions": len(batch)})
        print(json.dumps({"engine": name, "batch": together}), flush=True)
    sources = [{"commit": edit["commit"], "path": edit["path"]} for edit in edits]
    (args.out_dir / "budget_replay_edits.json").write_text(json.dumps(
        {"command": command, "rev": rev, "edits": sources, "rows": rows}, indent=1) + "\n")
    (args.out_dir / "budget_replay_edits.md").write_text(edits_markdown(command, rev, len(edits), args, rows))


def vs_best(rates: dict[str, float]) -> float:
    """The adaptive policy's rate over the best fixed budget's."""
    return rates["adaptive"] / max(rates[str(b)] for b in FIXED)


def edits_markdown(command: str, rev: str, count: int, args: argparse.Namespace, rows: list[dict]) -> str:
    lines = ["# Budget policies replayed on code edits", "", f"Command: `{command}`", "",
             f"Texts: {count} edits from the history of `{args.git_edits.resolve().name}` up to {rev[:12]} (one per "
             f"commit: the first changed .py or .md file's new version from {EDIT_LEAD} characters before its first "
             f"change, {args.tokens} byte-level tokens, prompted with its old version); {args.generations} "
             "generations of each back to back; engines and costs: budget_simulation.py's.", "",
             "Alone: each text by a lone session; adaptive / the best fixed budget on that text (median, min, texts "
             "below 0.95), and the budget that was best most often. Together: the first "
             f"{rows[0]['batch_sessions']} texts in one batch, tokens per simulated second.", "",
             "| engine | alone: median | min | below 0.95 | best fixed most often | together: "
             + " | ".join(f"fixed {b}" for b in FIXED) + " | adaptive | vs best |", "|---" * (7 + len(FIXED)) + "|"]
    for row in rows:
        ratios = [vs_best(rates) for rates in row["alone"]]
        best = collections.Counter(max(FIXED, key=lambda b: rates[str(b)]) for rates in row["alone"])
        together = row["batch"]
        lines.append(f"| {row['engine']} | {statistics.median(ratios):.2f} | {min(ratios):.2f} | "
                     f"{sum(r < 0.95 for r in ratios)} / {len(ratios)} | {best.most_common(1)[0][0]} | "
                     + " | ".join(f"{together[str(b)]:.0f}" for b in FIXED)
                     + f" | {together['adaptive']:.0f} | {vs_best(together):.2f} |")
    return "\n".join(lines) + "\n"


def markdown(command: str, source: str | None, costs: str, rows: list[dict]) -> str:
    names = [str(b) for b in FIXED] + ["adaptive"]
    lines = ["# Budget policies replayed on recorded texts", "", f"Command: `{command}`", "",
             f"Texts: `{source}`", "", f"Costs: {costs}.", "",
             "Tokens per simulated second of each policy on each recorded text (the text of the run whose budget "
             "the row names; every policy walks the same text). vs best: adaptive / the best fixed budget.", "",
             "| document | recorded with | run | " + " | ".join(f"fixed {n}" if n != "adaptive" else n for n in names)
             + " | vs best |", "|---" * (4 + len(names)) + "|"]
    for row in rows:
        rates = row["rates"]
        lines.append(f"| {row['document']} | {row['budget']} | {row['run']} | "
                     + " | ".join(f"{rates[n]:.1f}" for n in names) + f" | {vs_best(rates):.2f} |")
    medians = {n: statistics.median(row["rates"][n] for row in rows) for n in names}
    ratios = [vs_best(row["rates"]) for row in rows]
    lines += ["", "Medians over the texts: " + ", ".join(f"{n} {medians[n]:.1f}" for n in names)
              + f"; adaptive / best fixed, per text: median {statistics.median(ratios):.2f}, "
              f"min {min(ratios):.2f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
