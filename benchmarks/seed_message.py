"""A DFlash mirror's seed as a message: the host work at both ends of the verifier -> drafter Open. A seed carries
the target features of the session's W latest tokens (W = the drafter's window): 1024 x 20480 bf16, 42 MB, for the
Qwen3-8B-shaped drafter, sent as a generation starts. Stages, each the best of `--repeats`: the verifier builds its
request (`drafter_messages.open_request`: the features to the host, into the message), gRPC encodes it, the drafter
decodes it and takes the features as a tensor (`proto.tensors.from_proto`).

    python benchmarks/seed_message.py [--rows 1024] [--width 20480] [--repeats 5]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.e2e_step import titled_table, write_results  # noqa: E402
from modeling.speculation import DrafterSeed  # noqa: E402
from proto import drafter_pb2  # noqa: E402
from proto.tensors import from_proto  # noqa: E402
from verifier_service.drafter_messages import open_request  # noqa: E402


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def stages(rows: int, width: int, repeats: int) -> dict[str, float]:
    features = torch.randn(rows, width).to(torch.bfloat16)
    seed = DrafterSeed(list(range(rows)), features, 0)
    outgoing = open_request("s", seed)
    wire = outgoing.request.SerializeToString()
    message = drafter_pb2.DrafterRequest.FromString(wire)
    if not torch.equal(from_proto(message.open.features), features):
        raise AssertionError("the seed's features did not survive the trip")
    times = {"build (verifier)": best_ms(lambda: open_request("s", seed), repeats),
             "encode (gRPC)": best_ms(outgoing.request.SerializeToString, repeats),
             "decode (gRPC)": best_ms(lambda: drafter_pb2.DrafterRequest.FromString(wire), repeats),
             "features as a tensor (drafter)": best_ms(lambda: from_proto(message.open.features), repeats)}
    return {**times, "total": sum(times.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024, help="W: the seed's tokens")
    parser.add_argument("--width", type=int, default=20480, help="F: features per token (target layers x hidden)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    result = stages(args.rows, args.width, args.repeats)
    megabytes = args.rows * args.width * 2 / 1e6
    command = " ".join(["python benchmarks/seed_message.py", *sys.argv[1:]])
    table = titled_table(f"A DFlash seed's message, {args.rows} x {args.width} bf16 ({megabytes:.0f} MB), host work "
                         f"({platform.machine()}, best of {args.repeats})", command, ["stage", "ms"],
                         [[stage, f"{ms:.1f}"] for stage, ms in result.items()])
    write_results(args.out_dir, "seed_message", {"command": command, "rows": args.rows, "width": args.width,
                                                 "megabytes": megabytes, "stages_ms": result}, table)


if __name__ == "__main__":
    main()
