"""The tree-budget policies replayed on recorded texts: every policy drafts with the real n-gram drafter on the same
tokens, so their tokens per second differ only by the budgets they choose.

Why: through the services on a GPU, greedy bf16 text from a random model changes with the budget (a verify of other
row counts rounds otherwise and tips near-tied tokens), and with it what the drafter can hit: at 128k one document
accepted 4.1 tokens a step at budget 15 and 11.6 at 31 and 63, another 2.6 at 63 against 4.2 at 15, which one text
cannot do (long_context_adaptive_10docs_h100.md). Here
each recorded text (`benchmarks/long_context.py --save-outputs`) is the truth every policy is walked against: a step
drafts from the history (prompt and text so far) with the budget the policy chose, accepts the path of its tree that
the text follows, and costs what the engine model says (budget_simulation.py's, fitted to the run's measured steps).

    python benchmarks/budget_replay.py OUTPUTS.json [--verify-ms 13.5] [--row-us 13] [--round-ms 1.4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from budget_simulation import FIXED, Engine, adaptive_sessions, tokens_per_s  # noqa: E402
from throughput import prompts  # noqa: E402

from drafter_service.ngram_drafter import MAX_DEPTH  # noqa: E402
from drafter_service.ngram_index import NgramIndex  # noqa: E402
from modeling.tiny import byte_level_tokenizer  # noqa: E402
from modeling.tree import DraftTree  # noqa: E402
from verifier_service.engine.acceptance import accept_path  # noqa: E402
from verifier_service.tree_budget import FixedBudget  # noqa: E402

PROMPT_TAIL = 4096  # the prompt tokens the history starts with (a random model seldom outputs their ids)


class RecordedText:
    """A generation whose tokens are known in advance (budget_simulation's Workload, one session): a step `made`
    tokens in drafts from the prompt and the text's first `made` tokens, and accepts the nodes of its tree that
    the text follows from there."""

    def __init__(self, prompt: list[int], text: list[int]):
        self.prompt, self.text = prompt, text
        self.index = NgramIndex()
        self.made = -1  # the tokens of the text in the index's history (-1: not opened)

    def of_session(self, session: int) -> RecordedText:
        return self

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


def replay(prompt: list[int], text: list[int], engine: Engine, generations: int) -> dict[str, float]:
    """Tokens per simulated second of every fixed budget and the adaptive policy on one text."""
    policies = {str(b): lambda _, b=b: FixedBudget(b) for b in FIXED} | {"adaptive": adaptive_sessions(max(FIXED))}
    return {name: tokens_per_s(policy, 1, RecordedText(prompt, text), engine, tokens=len(text),
                               generations=generations) for name, policy in policies.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    parser.add_argument("outputs", type=Path, help="long_context_SHAPE_outputs.json (long_context.py --save-outputs)")
    parser.add_argument("--verify-ms", type=float, default=13.5, help="a verify step's fixed part")
    parser.add_argument("--row-us", type=float, default=13.0, help="a verify step's cost per row (tree node or root)")
    parser.add_argument("--round-ms", type=float, default=1.4, help="a drafting step's draft round trip")
    parser.add_argument("--generations", type=int, default=2, help="generations of each text back to back (the "
                        "second starts with the service's record of what the budgets accepted)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
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
        rates = replay(prompt, output["token_ids"][0], engine, args.generations)
        rows.append({key: output[key] for key in ("context", "document", "budget", "run")} | {"rates": rates})
        print(json.dumps(rows[-1]), flush=True)
    command = " ".join(["python benchmarks/budget_replay.py", *sys.argv[1:]])
    stem = args.outputs.name.removesuffix("_outputs.json").replace("long_context", "budget_replay")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"command": command, "source": recorded.get("command"),
                                                           "rows": rows}, indent=1) + "\n")
    costs = (f"a step {args.verify_ms} ms, {args.row_us} us more a row (tree node or root), {args.round_ms} ms more "
             f"when it drafts; {args.generations} generations of each text back to back")
    (args.out_dir / f"{stem}.md").write_text(markdown(command, recorded.get("command"), costs, rows))


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
        best = max(rates[str(b)] for b in FIXED)
        lines.append(f"| {row['document']} | {row['budget']} | {row['run']} | "
                     + " | ".join(f"{rates[n]:.1f}" for n in names) + f" | {rates['adaptive'] / best:.2f} |")
    medians = {n: statistics.median(row["rates"][n] for row in rows) for n in names}
    ratios = [row["rates"]["adaptive"] / max(row["rates"][str(b)] for b in FIXED) for row in rows]
    lines += ["", "Medians over the texts: " + ", ".join(f"{n} {medians[n]:.1f}" for n in names)
              + f"; adaptive / best fixed, per text: median {statistics.median(ratios):.2f}, "
              f"min {min(ratios):.2f}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
