"""Prometheus metrics of one verifier process (own registry: several servers may share a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


class VerifierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("ddtree_verifier_steps", "Verify steps run", registry=r)
        self.drafted = Counter("ddtree_verifier_drafted_nodes", "Draft nodes verified", registry=r)
        self.accepted = Counter("ddtree_verifier_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance = Histogram("ddtree_verifier_acceptance_length", "Tokens per verify step",
                                    buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32), registry=r)
        self.trees = Counter("ddtree_verifier_trees", "Trees received per drafter replica", ["replica"], registry=r)
        self.bad_trees = Counter("ddtree_verifier_bad_trees", "Trees rejected by validation", registry=r)
        self.draft_misses = Counter("ddtree_verifier_draft_misses", "Steps run without a tree (no drafter, timeout, "
                                    "error)", registry=r)
        self.reseeds = Counter("ddtree_verifier_reseeds", "Sessions re-seeded on another drafter replica",
                               registry=r)
        self.step_seconds = Histogram("ddtree_verifier_step_seconds", "Engine step latency", registry=r)
        self.kv_pages_used = Gauge("ddtree_verifier_kv_pages_used", "KV pages in use", registry=r)
        self.kv_pages_free = Gauge("ddtree_verifier_kv_pages_free", "KV pages free", registry=r)
        self.sessions = Gauge("ddtree_verifier_sessions", "Open sessions", registry=r)

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
