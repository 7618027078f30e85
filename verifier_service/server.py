"""Starts the verifier: engine + drafter connections + gRPC (health, reflection) + metrics."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from modeling.config import ModelConfig
from modeling.ops import use_device
from proto import verifier_pb2, verifier_pb2_grpc
from proto.security import add_internal_auth_args, internal_auth
from proto.serving import ServiceServer, channel_options, server_options, service_main
from verifier_service.admission import DEFAULT_ADMISSION_TIMEOUT_S
from verifier_service.drafter_pool import DrafterPool
from verifier_service.engine.config import ATTENTION_CHOICES, EngineConfig, resolve_attention
from verifier_service.engine.engine import Engine
from verifier_service.metrics import VerifierMetrics
from verifier_service.service import DEFAULT_LEASE_S, VerifierService
from verifier_service.servicer import VerifierServicer
from verifier_service.tensor_parallel import TensorParallelGroup
from verifier_service.tree_budget import BUDGET_POLICIES

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name
EXIT_CANNOT_SERVE = 3  # the process status after a lost rank (2 is a failed start, as for every service)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree-verifier", description="the verifier service")
    parser.add_argument("--target", required=True, help="HF checkpoint directory of the target model")
    parser.add_argument("--listen", default="127.0.0.1:50053")
    parser.add_argument("--drafters", default="", help="host:port,... or dns:///name:port; empty = no speculation")
    parser.add_argument("--tree-budget", type=int, default=15,
                        help="the largest draft tree of a step (the fixed policy's budget, the adaptive one's maximum)")
    parser.add_argument("--budget-policy", choices=BUDGET_POLICIES, default="fixed",
                        help="fixed: every step drafts --tree-budget nodes; adaptive: each pass the sessions' budgets "
                             "with the most expected tokens per second of the batch, from each session's acceptance "
                             "and the measured step times (docs/design.md section 4)")
    parser.add_argument("--draft-timeout-s", type=float, default=2.0,
                        help="how long a step waits for its tree; a replica that misses it is probed, not waited on")
    parser.add_argument("--session-lease-s", type=float, default=DEFAULT_LEASE_S,
                        help="a session no gateway renews (and no generation holds) is released after this long")
    parser.add_argument("--admission-timeout-s", type=float, default=DEFAULT_ADMISSION_TIMEOUT_S,
                        help="how long a prompt waits for free KV pages (first come first served) before it is "
                             "RESOURCE_EXHAUSTED; 0: at once")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 | float16 | bfloat16 (default: checkpoint's)")
    parser.add_argument("--attention", default="auto", choices=ATTENTION_CHOICES,
                        help="auto: triton on CUDA, torch on the CPU")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-budget-mb", type=float, default=256)
    parser.add_argument("--max-tree-nodes", type=int, default=255)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=None,
                        help="tokens per prefill chunk (default: 4096 on CUDA, else 256)")
    parser.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="keep released sessions' full KV pages indexed by their tokens, so that a prompt "
                             "beginning with the same tokens (a system prompt, a resent conversation) skips "
                             "prefilling them; the pages count as free and are reused least recently released first")
    parser.add_argument("--lone-prefill-chunk", type=int, default=None,
                        help="tokens per prefill chunk while no other session waits for the engine (a multiple of "
                             "the prefill chunk; larger chunks prefill faster, and a session that arrives meanwhile "
                             "waits for the chunk under way; default: the prefill chunk always)")
    parser.add_argument("--prompt-logprob-rows", type=int, default=512,
                        help="prompt rows whose logits are computed at once when a request asks for its prompt's "
                             "logprobs: the memory they take is about 8 bytes x rows x vocab")
    parser.add_argument("--max-batch-tokens", type=int, default=2048,
                        help="rows (tree nodes + roots) of one verify step; steps beyond it wait for the next")
    parser.add_argument("--max-batch-sessions", type=int, default=256,
                        help="sessions in one verify step; more wait for the next")
    parser.add_argument("--step-cohorts", type=int, default=1,
                        help="groups of generations that step in turn, each with its own passes: while one group's "
                             "step is on the GPU the next group's drafts are out (with many drafting sessions the "
                             "draft round otherwise leaves the GPU idle)")
    parser.add_argument("--decode-burst-steps", type=int, default=4,
                        help="plain decoding steps per engine call when every session of a batch decodes plainly: "
                             "the host's work per call serves this many tokens (throughput at many sessions), which "
                             "stream in bursts of as many")
    parser.add_argument("--gil-switch-interval-ms", type=float, default=0.5,
                        help="Python's thread switch interval (sys.setswitchinterval; Python's default is 5): the "
                             "engine thread lets go of the GIL at every torch call and waits up to this long to take "
                             "it back from the busy event loop")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="run every forward eagerly (graphs are used on CUDA with --attention triton)")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    parser.add_argument("--metrics-addr", default="127.0.0.1", help="address of the metrics port (0.0.0.0: all)")
    parser.add_argument("--tensor-parallel", type=int, default=1,
                        help="ranks (processes) the model is split over: cuda:0..N-1 with --device cuda, else gloo "
                             "on the CPU")
    parser.add_argument("--tp-timeout-s", type=float, default=120.0,
                        help="collective timeout between ranks (a dead rank is noticed sooner: its process exits)")
    parser.add_argument("--exit-after-failure-s", type=float, default=10.0,
                        help="after a lost rank the verifier reports NOT_SERVING this long, then exits with status "
                             f"{EXIT_CANNOT_SERVE} so that a restart policy brings it back; negative: it stays up")
    add_internal_auth_args(parser)
    return parser


def engine_config(args: argparse.Namespace, model: ModelConfig) -> EngineConfig:
    return EngineConfig(page_size=args.page_size, kv_budget_bytes=int(args.kv_budget_mb * (1 << 20)),
                        max_tree_nodes=args.max_tree_nodes, prefill_chunk=args.prefill_chunk,
                        lone_prefill_chunk=args.lone_prefill_chunk, prefix_caching=args.prefix_caching,
                        prompt_logprob_rows=args.prompt_logprob_rows,
                        max_batch_tokens=args.max_batch_tokens, max_batch_sessions=args.max_batch_sessions,
                        max_context=args.max_context, decode_burst_steps=args.decode_burst_steps,
                        dtype=args.dtype or model.torch_dtype, device=args.device,
                        attention=resolve_attention(args.attention, args.device),
                        cuda_graphs=not args.no_cuda_graphs)


async def fail_when_a_rank_fails(group: TensorParallelGroup, service: VerifierService, server: ServiceServer,
                                 exit_after_s: float) -> None:
    """The watchdog: a dead rank makes the service NOT_SERVING and fails its requests with UNAVAILABLE; then,
    unless `exit_after_s` is negative, the process exits after that grace (health checks and the gateway see
    NOT_SERVING meanwhile). NOTE: the group cannot be rebuilt in place, and Docker restarts a container whose
    process exited, never one that is merely unhealthy."""
    reason = await group.wait_for_failure()
    logging.error("%s: the verifier stops serving", reason)
    service.fail(reason)
    await server.set_serving(False)
    group.abort()
    if exit_after_s < 0:
        return
    await asyncio.sleep(exit_after_s)
    logging.error("exiting with status %d for a restart (%s)", EXIT_CANNOT_SERVE, reason)
    logging.shutdown()
    os._exit(EXIT_CANNOT_SERVE)  # NOTE: no graceful stop: the engine thread may be stuck in a collective


async def serve(args: argparse.Namespace) -> None:
    sys.setswitchinterval(args.gil_switch_interval_ms / 1e3)
    auth = internal_auth(args)  # NOTE: first: a bad secret file fails the start before the checkpoint loads
    config = engine_config(args, ModelConfig.from_dir(args.target))
    use_device(config.device)  # NOTE: the loop's thread runs steps inline (the engine's thread sets it too)
    group = None
    if args.tensor_parallel > 1:
        group = TensorParallelGroup.start(args.target, config, args.tensor_parallel, args.tp_timeout_s)
        engine = group.engine
    else:
        engine = Engine.from_checkpoint(args.target, config)
    metrics = VerifierMetrics()
    drafters = None
    if args.drafters:
        drafters = DrafterPool(args.drafters, metrics, args.draft_timeout_s, channel_options=channel_options(),
                               auth=auth)
    service = VerifierService(engine, drafters, metrics, tree_budget=args.tree_budget, inline_steps=group is None,
                              lease_s=args.session_lease_s, budget_policy=args.budget_policy,
                              step_cohorts=args.step_cohorts, admission_timeout_s=args.admission_timeout_s)

    server = ServiceServer(SERVICE_NAME, verifier_pb2_grpc.add_VerifierServicer_to_server,
                           VerifierServicer(service, Path(args.target).name), args.listen, server_options(), auth)
    if args.metrics_port:
        metrics.serve(args.metrics_port, args.metrics_addr)
    await service.start()
    await server.start()
    if group:
        watchdog = asyncio.create_task(fail_when_a_rank_fails(group, service, server, args.exit_after_failure_s))
    logging.info("verifier listening on port %d (internal callers show %s)", server.port, auth.kind)
    await server.serve_until_signal(grace_s=2.0)
    await service.stop()
    if group:
        watchdog.cancel()
        group.stop()


def main(argv: list[str] | None = None) -> int:
    return service_main(build_parser(), serve, argv, "verifier")


if __name__ == "__main__":
    sys.exit(main())
