"""The verifier's event loop per session-step, engine work excluded: S sessions generate at once in a
VerifierService (the tiny model on the CPU, its steps on the engine thread), plain or drafting with an n-gram
replica in its own process over real gRPC, with a fixed or the adaptive tree budget; read from the service itself,
or over a real GenerateStream (the verifier's servicer on a port, a gateway's GenerationStream client on a thread
of its own). The loop thread's CPU time per session-step is what the serving loop itself costs (drafts, batching,
results, events, metrics, and over the stream its messages), and what it takes from the engine thread's GIL on a GPU.

    python benchmarks/verifier_loop.py [--sessions 64] [--tokens 96] [--decode-burst-steps 1] [--temperature 0]
        [--profile [fixed|adaptive]]

`--temperature 1` samples the tiny model's text, which then seldom repeats: the n-gram drafts fail, as at
acceptance ~1 on a GPU, and the adaptive policy decodes plainly between its probes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import platform
import pstats
import subprocess
import sys
import time
from pathlib import Path

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import titled_table, write_results  # noqa: E402
from ddtree.local_stack import ensure_tiny_model, free_port, wait_healthy  # noqa: E402
from gateway.generation_streams import GenerationStream  # noqa: E402
from proto import common_pb2, verifier_pb2, verifier_pb2_grpc  # noqa: E402
from verifier_service.drafter_pool import DrafterPool  # noqa: E402
from verifier_service.engine.config import EngineConfig  # noqa: E402
from verifier_service.engine.engine import Engine  # noqa: E402
from verifier_service.engine.sampling import SamplingParams  # noqa: E402
from verifier_service.metrics import VerifierMetrics  # noqa: E402
from verifier_service.service import VerifierService  # noqa: E402
from verifier_service.servicer import VerifierServicer  # noqa: E402
from verifier_service.tree_budget import BudgetPolicyName  # noqa: E402

PROMPT = list(b"the verifier keeps the prefix in pages and the drafter proposes a tree. " * 2)


def read_over_stream(port: int, ids: list[str], tokens: int, temperature: float) -> int:
    """Every session's generation over one GenerateStream, as a gateway reads them; returns the steps read."""
    async def main() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stream = GenerationStream(verifier_pb2_grpc.VerifierStub(channel))
            params = common_pb2.SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=temperature)

            async def one(session_id: str) -> int:
                request = verifier_pb2.VerifierGenerateRequest(session_id=session_id, params=params)
                return sum([1 async for step in stream.generate(request, None) if not step.HasField("prefill")])

            steps = await asyncio.gather(*(one(session_id) for session_id in ids))
            await stream.close()
            return sum(steps)
    return asyncio.run(main())


async def generate_all(engine: Engine, drafter: str | None, sessions: int, tokens: int,
                       profile: cProfile.Profile | None, policy: BudgetPolicyName = "fixed",
                       over_stream: bool = False, temperature: float = 0.0) -> dict:
    metrics = VerifierMetrics()
    pool = DrafterPool(drafter, metrics, timeout_s=10) if drafter else None
    service = VerifierService(engine, pool, metrics, tree_budget=15, inline_steps=False, budget_policy=policy)
    await service.start()
    if pool is not None:
        await pool.refresh()
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(service, "tiny"), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    ids = [(await service.create_session(PROMPT)).session_id for _ in range(sessions)]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=temperature)

    async def one(session_id: str) -> int:
        return sum([hasattr(event, "result") async for event in service.generate(session_id, [], params, False)])

    async def read_all() -> int:
        if over_stream:  # NOTE: the reader on a thread of its own: only the verifier's side is on this one
            return await asyncio.to_thread(read_over_stream, port, ids, tokens, temperature)
        return sum(await asyncio.gather(*(one(session_id) for session_id in ids)))

    started, cpu = time.perf_counter(), time.thread_time()
    if profile:
        profile.enable()
    steps = await read_all()
    if profile:
        profile.disable()
    wall, cpu = time.perf_counter() - started, time.thread_time() - cpu
    await server.stop(None)
    await service.stop()
    return {"drafter": "ngram" if drafter else "none", "budget_policy": policy if drafter else "-",
            "read": "GenerateStream" if over_stream else "service", "sessions": sessions, "session_steps": steps,
            "tokens": sessions * tokens, "wall_s": wall,
            "loop_cpu_us_per_session_step": 1e6 * cpu / steps, "loop_cpu_us_per_token": 1e6 * cpu / (sessions * tokens),
            "loop_cpu_share": cpu / wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--decode-burst-steps", type=int, default=1, help="plain steps per engine call")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--profile", nargs="?", const="fixed", choices=("fixed", "adaptive"),
                        help="print where the loop's time goes in the n-gram run with this budget policy")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = ensure_tiny_model()[0]
    engine = Engine.from_checkpoint(target, EngineConfig(max_context=1024, decode_burst_steps=args.decode_burst_steps))
    port = free_port()
    drafter = subprocess.Popen([sys.executable, "-m", "drafter_service.server", "--drafter", "ngram",
                                "--listen", f"127.0.0.1:{port}"], cwd=Path(__file__).resolve().parents[1])
    profile = cProfile.Profile() if args.profile else None
    profiled = {policy: profile if args.profile == policy else None for policy in ("fixed", "adaptive")}
    address, run = f"127.0.0.1:{port}", dict(sessions=args.sessions, tokens=args.tokens, temperature=args.temperature)
    try:
        wait_healthy(address, 60, drafter)
        rows = [asyncio.run(generate_all(engine, None, profile=None, **run)),
                asyncio.run(generate_all(engine, address, profile=profiled["fixed"], **run)),
                asyncio.run(generate_all(engine, address, profile=profiled["adaptive"], policy="adaptive", **run)),
                asyncio.run(generate_all(engine, None, profile=None, over_stream=True, **run)),
                asyncio.run(generate_all(engine, address, profile=None, over_stream=True, **run))]
    finally:
        drafter.terminate()
        drafter.wait()
    for row in rows:
        print(row)
    if profile:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(25)
        print(text.getvalue())
    command = " ".join(["python benchmarks/verifier_loop.py", *sys.argv[1:]])
    table = titled_table(
        f"The verifier's event loop per session-step ({platform.machine()}, tiny model, engine excluded)", command,
        ["drafter", "budget policy", "read from", "sessions", "session-steps", "loop CPU us per session-step",
         "loop CPU us per token", "loop CPU / wall"],
        [[r["drafter"], r["budget_policy"], r["read"], str(r["sessions"]), str(r["session_steps"]),
          f"{r['loop_cpu_us_per_session_step']:.0f}", f"{r['loop_cpu_us_per_token']:.0f}",
          f"{r['loop_cpu_share']:.0%}"] for r in rows])
    write_results(args.out_dir, "verifier_loop", {"command": command, "rows": rows}, table)


if __name__ == "__main__":
    main()
