"""Starts the verifier: engine + drafter connections + gRPC (health, reflection) + metrics."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from grpc_health.v1 import health, health_pb2

from proto import verifier_pb2, verifier_pb2_grpc
from proto.serving import (
    add_health_and_reflection,
    bind,
    channel_options,
    mark_serving,
    new_server,
    run_service,
    server_options,
    wait_for_termination_signal,
)
from verifier_service.drafter_pool import DrafterPool
from verifier_service.engine.config import EngineConfig
from verifier_service.engine.engine import Engine
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import DEFAULT_LEASE_S, VerifierService
from verifier_service.servicer import VerifierServicer
from verifier_service.tensor_parallel import TensorParallelGroup

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree-verifier", description="the verifier service")
    parser.add_argument("--target", required=True, help="HF checkpoint directory of the target model")
    parser.add_argument("--listen", default="127.0.0.1:50053")
    parser.add_argument("--drafters", default="", help="host:port,... or dns:///name:port; empty = no speculation")
    parser.add_argument("--tree-budget", type=int, default=15)
    parser.add_argument("--draft-timeout-s", type=float, default=2.0,
                        help="how long a step waits for its tree; a replica that misses it is probed, not waited on")
    parser.add_argument("--session-lease-s", type=float, default=DEFAULT_LEASE_S,
                        help="a session no gateway renews (and no generation holds) is released after this long")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: checkpoint's)")
    parser.add_argument("--attention", default="torch", choices=["torch", "triton"])
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-budget-mb", type=float, default=256)
    parser.add_argument("--max-tree-nodes", type=int, default=255)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=256)
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run every forward eagerly (graphs are used on CUDA with --attention triton)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    parser.add_argument("--metrics-addr", default="127.0.0.1", help="address of the metrics port (0.0.0.0: all)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="ranks (processes) the model is split over: cuda:0..N-1 with --device cuda, else gloo "
                             "on the CPU")
    parser.add_argument("--tp-timeout-s", type=float, default=120.0,
                        help="collective timeout between ranks (a dead rank is noticed sooner: its process exits)")
    return parser


def engine_config(args: argparse.Namespace, checkpoint_dtype: str) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, kv_budget_bytes=int(args.kv_budget_mb * (1 << 20)),
                        max_tree_nodes=args.max_tree_nodes, prefill_chunk=args.prefill_chunk,
                        max_batch_tokens=max(2048, args.prefill_chunk), max_context=args.max_context,
                        dtype=args.dtype or checkpoint_dtype, device=args.device, attention=args.attention,
                        cuda_graphs=not args.no_cuda_graphs)


async def fail_when_a_rank_fails(group: TensorParallelGroup, service: VerifierService,
                                 health_servicer: health.aio.HealthServicer) -> None:
    """The watchdog: a dead rank makes the service NOT_SERVING and fails its requests with UNAVAILABLE."""
    reason = await group.wait_for_failure()
    logging.error("%s: the verifier stops serving", reason)
    service.fail(reason)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    group.abort()


async def serve(args: argparse.Namespace) -> None:
    from modeling.config import ModelConfig

    config = engine_config(args, ModelConfig.from_dir(args.target).torch_dtype)
    group = None
    if args.tensor_parallel > 1:
        group = TensorParallelGroup.start(args.target, config, args.tensor_parallel, args.tp_timeout_s)
        engine = group.engine
    else:
        engine = Engine.from_checkpoint(args.target, config)
    metrics = VerifierMetrics()
    drafters = None
    if args.drafters:
        drafters = DrafterPool(args.drafters, metrics, args.draft_timeout_s, channel_options=channel_options())
    service = VerifierService(engine, drafters, metrics, tree_budget=args.tree_budget, inline_steps=group is None,
                              lease_s=args.session_lease_s)

    server = new_server(server_options())
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(service, Path(args.target).name), server)
    health_servicer = add_health_and_reflection(server, [SERVICE_NAME])
    port = bind(server, args.listen)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    await service.start()
    await server.start()
    await mark_serving(health_servicer, [SERVICE_NAME])
    if group:
        watchdog = asyncio.create_task(fail_when_a_rank_fails(group, service, health_servicer))
    logging.info("verifier listening on port %d", port)
    await wait_for_termination_signal()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace=2.0)
    await service.stop()
    if group:
        watchdog.cancel()
        group.stop()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s verifier %(levelname)s %(message)s")
    return run_service(parser.prog, lambda: serve(args))


if __name__ == "__main__":
    sys.exit(main())
