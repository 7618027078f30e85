"""The verifier -> drafter hop alone: S sessions ask an n-gram drafter replica (its own process, real gRPC) for a
tree at once, round after round, as the verify steps of S sessions do; one message per request and reply, or the
requests of a round in one batch message (and their replies in one). A round is what the step loop's draft does
(verifier_service/step_loop.py): one `draft_all` over every session's step, then each tree validated. Per
session-step: the wall time of a round, and the verifier process's CPU time (what its event loop and gRPC spend on
the hop, and so take from the engine thread's GIL).

    python benchmarks/drafter_hop.py [--sessions 1 16 64] [--budget 15] [--rounds 200]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import titled_table, write_results  # noqa: E402
from ddtree.local_stack import free_port, wait_healthy  # noqa: E402
from modeling.speculation import DraftStep  # noqa: E402
from verifier_service.drafter_pool import DrafterPool  # noqa: E402
from verifier_service.metrics import VerifierMetrics  # noqa: E402

PERIOD = list(range(3, 40))  # a periodic text: every draft finds a chain
VOCAB, MAX_NODES = 151_936, 255  # what the step loop validates trees against (Qwen3's vocabulary, the engine default)


async def rounds(address: str, sessions: int, budget: int, count: int, batches: bool) -> dict:
    pool = DrafterPool(address, VerifierMetrics(), timeout_s=10)
    await pool.refresh()
    for link in pool.links.values():
        link.info.batches = batches  # NOTE: False is what a replica that does not take batches gets
    history = PERIOD * 30
    for s in range(sessions):
        pool.attach(f"s{s}", lambda: history, None)
    position = len(history)

    def step(session: int, n: int) -> DraftStep:
        """Step n: the last root committed alone (acceptance 0: the most steps per token), the next one pending."""
        root = PERIOD[(position + n) % len(PERIOD)]
        if n == 0:
            return DraftStep(f"s{session}", 1, [], None, root, position, budget)
        return DraftStep(f"s{session}", n + 1, [PERIOD[(position + n - 1) % len(PERIOD)]], None, root,
                         position + n - 1, budget)

    await pool.draft_all([step(s, 0) for s in range(sessions)])  # opens every mirror
    wall, cpu, nodes = [], [], 0
    for n in range(1, count + 1):
        steps = [step(s, n) for s in range(sessions)]
        started, started_cpu = time.perf_counter(), time.process_time()
        trees = await pool.draft_all(steps)
        for tree in trees:
            if tree is not None:
                tree.validate(VOCAB, MAX_NODES)
        wall.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
        nodes += sum(len(tree) for tree in trees if tree is not None)
    await pool.stop()
    wall.sort()
    return {"sessions": sessions, "budget": budget, "batches": batches, "rounds": count,
            "mean_nodes": nodes / (count * sessions),
            "round_ms_p50": 1e3 * wall[len(wall) // 2],
            "wall_us_per_session_step": 1e6 * sum(wall) / (count * sessions),
            "cpu_us_per_session_step": 1e6 * sum(cpu) / (count * sessions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--budget", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    port = free_port()
    drafter = subprocess.Popen([sys.executable, "-m", "drafter_service.server", "--drafter", "ngram",
                                "--listen", f"127.0.0.1:{port}"], cwd=Path(__file__).resolve().parents[1])
    try:
        wait_healthy(f"127.0.0.1:{port}", 60, drafter)
        rows = [asyncio.run(rounds(f"127.0.0.1:{port}", s, args.budget, args.rounds, batches))
                for s in args.sessions for batches in (False, True)]
    finally:
        drafter.terminate()
        drafter.wait()
    command = " ".join(["python benchmarks/drafter_hop.py", *sys.argv[1:]])
    table = titled_table(
        f"The verifier -> drafter hop ({platform.machine()}, n-gram drafter, budget {args.budget})", command,
        ["sessions", "messages", "round ms (p50)", "wall us per session-step", "verifier CPU us per session-step"],
        [[str(r["sessions"]), "one per round" if r["batches"] else "one per request", f"{r['round_ms_p50']:.2f}",
          f"{r['wall_us_per_session_step']:.0f}", f"{r['cpu_us_per_session_step']:.0f}"] for r in rows])
    write_results(args.out_dir, "drafter_hop", {"command": command, "machine": platform.machine(), "rows": rows},
                  table)


if __name__ == "__main__":
    main()
