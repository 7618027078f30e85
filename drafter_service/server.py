"""Starts one drafter replica: a DFlash checkpoint (on one device) or the n-gram drafter (CPU)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector

from drafter_service.drafter import Drafter
from drafter_service.servicer import DrafterServicer
from proto import drafter_pb2, drafter_pb2_grpc
from proto.security import add_internal_auth_args, internal_auth
from proto.serving import ServiceServer, serve_metrics, server_options, service_main

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ddtree-drafter", description="one drafter replica")
    parser.add_argument("--drafter", required=True, help="DFlash checkpoint directory, or 'ngram'")
    parser.add_argument("--target", help="target checkpoint (the DFlash drafter reads its embed_tokens, lm_head)")
    parser.add_argument("--listen", default="127.0.0.1:50052")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--context-window", type=int, default=1024, help="W; 0 = unlimited")
    parser.add_argument("--max-budget", type=int, default=255)
    parser.add_argument("--max-sessions", type=int, default=64,
                        help="DFlash: session mirrors held at once (each holds its window's K/V in every layer)")
    parser.add_argument("--ngram-min", type=int, default=1)
    parser.add_argument("--ngram-max", type=int, default=4)
    parser.add_argument("--replica-id", default=f"{socket.gethostname()}:{os.getpid()}")
    parser.add_argument("--metrics-port", type=int, default=0, help="Prometheus port; 0 = off")
    parser.add_argument("--metrics-addr", default="127.0.0.1", help="address of the metrics port (0.0.0.0: all)")
    add_internal_auth_args(parser)
    return parser


def drafter_metrics(servicer: DrafterServicer) -> CollectorRegistry:
    """A replica's gauges, read when scraped, and its process's CPU and memory. Trees, stalls and re-seeds per
    replica are counted where they are seen: in the verifiers (ddtree_verifier_*)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    Gauge("ddtree_drafter_open_sessions", "Session mirrors held", registry=registry).set_function(
        lambda: len(servicer.open_ids))
    Gauge("ddtree_drafter_streams", "Verifier streams connected", registry=registry).set_function(
        lambda: len(servicer.streams))
    Gauge("ddtree_drafter_queued_steps", "Draft steps waiting for the next batch", registry=registry).set_function(
        lambda: len(servicer.queued))
    return registry


def load_drafter(drafter: str, target: str | None, device: str = "cpu", dtype: str | None = None,
                 context_window: int | None = 1024, max_budget: int = 255,
                 ngram_sizes: tuple[int, int] = (1, 4), max_sessions: int = 64) -> Drafter:
    """`drafter` is a DFlash checkpoint directory or 'ngram'."""
    if drafter == "ngram":
        from drafter_service.ngram_drafter import NgramDrafter

        return NgramDrafter(*ngram_sizes, max_budget=max_budget)
    from drafter_service.dflash_drafter import DFlashDrafter
    from modeling.dflash import load_dflash
    from modeling.ops import use_device

    if not target:
        raise ValueError("a DFlash drafter needs the target checkpoint (it shares its embed_tokens and lm_head)")
    use_device(device)  # NOTE: drafts run on this thread (the event loop's): its Triton kernels launch on `device`
    tree_drafter = DFlashDrafter(load_dflash(drafter, target, dtype, device), context_window, max_budget=max_budget,
                                 max_sessions=max_sessions)
    tree_drafter.warmup()  # NOTE: captures the CUDA graphs of every batch size now, not during the first steps
    return tree_drafter


async def serve(args: argparse.Namespace) -> None:
    auth = internal_auth(args)
    drafter = load_drafter(args.drafter, args.target, args.device, args.dtype, args.context_window or None,
                           args.max_budget, (args.ngram_min, args.ngram_max), args.max_sessions)
    servicer = DrafterServicer(drafter, args.replica_id)
    # NOTE: verifiers find new replicas by re-resolving the name themselves; a long connection age only bounds
    # how long a verifier keeps a connection to an address that DNS no longer lists.
    server = ServiceServer(SERVICE_NAME, drafter_pb2_grpc.add_DrafterServicer_to_server, servicer, args.listen,
                           server_options(max_connection_age_s=300.0), auth)
    if args.metrics_port:
        serve_metrics(drafter_metrics(servicer), args.metrics_port, args.metrics_addr)
    servicer.start()
    await server.start()
    logging.info("drafter %s (%s) listening on port %d (internal callers show %s)", args.replica_id,
                 servicer.drafter.info.kind, server.port, auth.kind)
    await server.serve_until_signal(grace_s=1.0)


def main(argv: list[str] | None = None) -> int:
    return service_main(build_parser(), serve, argv, "drafter")


if __name__ == "__main__":
    sys.exit(main())
