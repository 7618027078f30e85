"""Prometheus metrics of one verifier process (own registry: several servers may share a process)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proto.serving import serve_metrics

if TYPE_CHECKING:
    from verifier_service.engine.engine import Engine


class VerifierMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.steps = Counter("ddtree_verifier_steps", "Verify steps run", registry=r)
        self.drafted = Counter("ddtree_verifier_drafted_nodes", "Draft nodes verified", registry=r)
        self.accepted = Counter("ddtree_verifier_accepted_tokens", "Draft tokens accepted", registry=r)
        self.acceptance = Histogram("ddtree_verifier_acceptance_length", "Tokens per verify step",
                                    buckets=(1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32), registry=r)
        self.tree_budget = Histogram("ddtree_verifier_tree_budget", "Tree budget chosen per step after the first "
                                     "(0: no draft)", buckets=(0, 1, 3, 7, 15, 31, 63, 127, 255), registry=r)
        self.trees = Counter("ddtree_verifier_trees", "Trees received per drafter replica", ["replica"], registry=r)
        self.bad_trees = Counter("ddtree_verifier_bad_trees", "Trees rejected by validation", registry=r)
        self.draft_misses = Counter("ddtree_verifier_draft_misses", "Steps run without a tree (no drafter, timeout, "
                                    "error)", registry=r)
        self.drafter_stalls = Counter("ddtree_verifier_drafter_stalls", "Times a drafter replica stopped "
                                      "answering in time (steps then run without it until it answers)", registry=r)
        self.reseeds = Counter("ddtree_verifier_reseeds", "Sessions re-seeded on another drafter replica",
                               registry=r)
        self.mirror_resumes = Counter("ddtree_verifier_mirror_resumes", "Generations whose drafter mirror stayed open "
                                      "from the session's last turn: their first draft carried the tokens since "
                                      "instead of a seed", registry=r)
        self.mirror_evictions = Counter("ddtree_verifier_mirror_evictions", "Mirrors of sessions between turns "
                                        "closed to make room on a full drafter replica (their next turn seeds "
                                        "again)", registry=r)
        self.step_seconds = Histogram("ddtree_verifier_step_seconds", "Engine step latency", registry=r)
        self.batch_sessions = Histogram("ddtree_verifier_batch_sessions", "Sessions per engine verify step",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_seconds = Histogram("ddtree_verifier_batch_seconds", "Time of one engine verify step on the "
                                       "engine (the whole batch, host work included; not its wait behind other "
                                       "engine work, such as another session's prefill chunk)", registry=r)
        self.step_gap_seconds = Histogram("ddtree_verifier_step_gap_seconds", "Time from the end of one engine "
                                          "verify step to the start of the next while sessions step (drafts, the "
                                          "loop's own work, waits: what the engine is not running)", registry=r)
        self.draft_round_seconds = Histogram("ddtree_verifier_draft_round_seconds", "Time from the start of a step "
                                             "pass until the drafts of all its sessions are in (one round trip to "
                                             "the drafters; passes that draft nothing, or open a mirror, are not "
                                             "counted)", registry=r)
        self.seed_seconds = Histogram(
            "ddtree_verifier_seed_seconds", "Time to open a session's mirror on a drafter (its seed: the features of "
            "its latest tokens, tens of MB for a DFlash drafter of an 8B target): from its Open until the replica "
            "acknowledged it (the session steps without drafts meanwhile), or, from a replica that does not, the "
            "draft round that carried it", registry=r)
        self.drafter_compute_seconds = Histogram(
            "ddtree_verifier_drafter_compute_seconds", "The drafters' own time in a draft round: the longest of its "
            "replies' draft_ms (a replica's commit, forward and trees for the batch that held the step); the round "
            "less this is the hop (serialization, gRPC, queueing)", registry=r)
        host_buckets = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
        self.drafting_pass_host_seconds = Histogram(
            "ddtree_verifier_drafting_pass_host_seconds", "Time of a step pass that drafted outside its engine calls "
            "and its draft round (planning, handing the events on, the streams that ran meanwhile)",
            buckets=host_buckets, registry=r)
        self.plain_step_host_seconds = Histogram(
            "ddtree_verifier_plain_step_host_seconds", "Time of a plain step pass outside its engine calls, per "
            "step of its burst (what the same host work costs each plain token)", buckets=host_buckets, registry=r)
        self.engine_gpu_seconds = Histogram(
            "ddtree_verifier_engine_gpu_seconds", "The GPU's time on one engine call (CUDA events around it), per "
            "forward of the call (a decode burst runs several)", registry=r)
        self.step_host_overhead_seconds = Histogram(
            "ddtree_verifier_step_host_overhead_seconds", "Per forward of an engine call: its wall time from the end "
            "of the call before it (while sessions step) less the GPU's time on it and the engine's time on other "
            "calls in between (prefill chunks): what the host adds to a step (the loop's work, draft rounds, the "
            "engine's launches and reads)", buckets=host_buckets, registry=r)
        self.kv_pages_used = Gauge("ddtree_verifier_kv_pages_used", "KV pages in use", registry=r)
        self.kv_pages_free = Gauge("ddtree_verifier_kv_pages_free", "KV pages free", registry=r)
        self.sessions = Gauge("ddtree_verifier_sessions", "Open sessions", registry=r)
        self.generating = Gauge("ddtree_verifier_generating_sessions", "Sessions with a generation running",
                                registry=r)
        self.waiting_requests = Gauge("ddtree_verifier_waiting_requests", "Prompts and generations waiting for free "
                                      "KV pages", registry=r)
        self.prefills_awaiting_turn = Gauge("ddtree_verifier_prefills_awaiting_turn", "Prompts in, waiting for their "
                                             "turn on the engine (one prefill chunk runs at a time, shortest "
                                             "remaining first)", registry=r)
        self.prefill_tokens = Counter("ddtree_verifier_prefill_tokens", "Prompt positions of finished prefills "
                                      "(computed, or found in the prefix cache)", registry=r)
        self.prefix_cache_hit_tokens = Counter("ddtree_verifier_prefix_cache_hit_tokens", "Prompt positions whose K/V "
                                               "the prefix cache held (not computed again)", registry=r)
        self.kv_pages_cached = Gauge("ddtree_verifier_kv_pages_cached", "KV pages nobody holds that the prefix cache "
                                     "keeps indexed (counted free: reused, least recently released first, when "
                                     "needed)", registry=r)
        self.admission_wait_seconds = Histogram("ddtree_verifier_admission_wait_seconds", "How long a prompt or a "
                                                "generation that found the KV cache full waited for its pages (those "
                                                "that gave up included)", registry=r)

    def watch(self, engine: Engine, generating: Collection[str], waiting_requests: Callable[[], int],
              prefills_awaiting_turn: Callable[[], int]) -> None:
        """The gauges read the engine when scraped, so they show sessions and pages as they are."""
        pool = engine.pool
        self.kv_pages_free.set_function(lambda: pool.num_free)
        self.kv_pages_cached.set_function(lambda: len(pool.evictable))
        self.kv_pages_used.set_function(lambda: pool.num_pages - pool.num_free)
        self.sessions.set_function(lambda: len(engine.sessions))
        self.generating.set_function(lambda: len(generating))
        self.waiting_requests.set_function(waiting_requests)
        self.prefills_awaiting_turn.set_function(prefills_awaiting_turn)

    def observe_prefill(self, tokens: int, cached: int) -> None:
        self.prefill_tokens.inc(tokens)
        self.prefix_cache_hit_tokens.inc(cached)

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """/metrics over HTTP; loopback unless told otherwise (containers pass 0.0.0.0 to be scraped)."""
        serve_metrics(self.registry, port, addr)
