"""Prometheus metrics of the gateway, in a registry of its own (served over HTTP on a port of its own)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto import verifier_pb2
from proto.serving import serve_metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
ACCEPTANCE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("ddtree_gateway_ttft_seconds", "Request arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("ddtree_gateway_inter_token_latency_seconds",
                                     "Time between steps over the tokens of the later step",
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("ddtree_gateway_e2e_latency_seconds", "Request arrival to the summary",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.acceptance = Histogram("ddtree_gateway_acceptance_length", "Accepted draft nodes + 1 per verify step",
                                    buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.drafted = Counter("ddtree_gateway_drafted_tokens", "Draft tree nodes verified", registry=r)
        self.accepted = Counter("ddtree_gateway_accepted_tokens", "Draft nodes accepted", registry=r)
        self.generated = Counter("ddtree_gateway_generated_tokens", "Tokens emitted", registry=r)
        self.kv_pages_used = Gauge("ddtree_gateway_kv_pages_used", "KV pages in use, per verifier",
                                   ["verifier"], registry=r)
        self.kv_pages_free = Gauge("ddtree_gateway_kv_pages_free", "KV pages free, per verifier",
                                   ["verifier"], registry=r)
        self.verifiers_up = Gauge("ddtree_gateway_verifiers_up", "Verifiers answering Info", registry=r)
        self.active_sessions = Gauge("ddtree_gateway_active_sessions", "Session handles held (one-shot included)",
                                     registry=r)
        self.errors = Counter("ddtree_gateway_errors", "Failed calls by status code", ["code"], registry=r)

    def count_sessions(self, count: Callable[[], int]) -> None:
        self.active_sessions.set_function(count)

    def observe_step(self, step: verifier_pb2.VerifierGenerateStep, since_previous_s: float | None) -> None:
        tokens = len(step.token_ids)
        self.generated.inc(tokens)
        self.drafted.inc(step.drafted_nodes)
        self.accepted.inc(max(0, step.acceptance_length - 1))
        if step.acceptance_length:
            self.acceptance.observe(step.acceptance_length)
        if since_previous_s is not None and tokens:
            for _ in range(tokens):
                self.inter_token.observe(since_previous_s / tokens)

    def observe_verifiers(self, infos: dict[str, verifier_pb2.VerifierInfoReply | None]) -> None:
        """Record the last Info of each verifier (None: it did not answer)."""
        self.verifiers_up.set(sum(info is not None for info in infos.values()))
        for address, info in infos.items():
            if info is not None:
                self.kv_pages_used.labels(address).set(info.kv_capacity_pages - info.free_pages)
                self.kv_pages_free.labels(address).set(info.free_pages)

    def serve_http(self, port: int, addr: str):
        """Start the /metrics HTTP server in a thread; returns the server (call shutdown())."""
        return serve_metrics(self.registry, port, addr)
