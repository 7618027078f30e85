"""Helpers for tests that run the real services (the local stack on the tiny model)."""

from __future__ import annotations

import re
import urllib.request

import grpc

from ddtree.local_stack import LocalStack
from ddtree.offline import generate_offline
from proto import verifier_pb2, verifier_pb2_grpc
from tests.engine_helpers import make_engine
from verifier_service.engine.sampling import SamplingParams

TINY_PAGE_BYTES = 2 * 4 * 16 * 2 * 16 * 4  # K+V, 4 layers, 16 slots, 2 kv heads, head_dim 16, fp32


def kv_budget_mb(pages: int) -> str:
    """The verifier's --kv-budget-mb that holds exactly `pages` pages of 16 tokens of the tiny model."""
    return str(pages * TINY_PAGE_BYTES / (1 << 20))


def greedy_reference(checkpoint, default_max_new: int, ignore_eos: bool = False):
    """Plain greedy decoding in this process: what every generation through the stack must equal.
    Returns expected(prompt_ids, max_new) -> token ids, with `.encode` for text."""
    engine = make_engine(checkpoint, page_size=64)

    def expected(prompt_ids: list[int], max_new: int = default_max_new) -> list[int]:
        params = SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos)
        return generate_offline(engine, None, prompt_ids, params).token_ids
    expected.encode = engine.tokenizer.encode
    return expected


def verifier_info(stack: LocalStack) -> verifier_pb2.VerifierInfoReply:
    with grpc.insecure_channel(stack.addresses["verifier"]) as channel:
        return verifier_pb2_grpc.VerifierStub(channel).Info(verifier_pb2.VerifierInfoRequest(), timeout=5)


def verifier_metric(metrics_url: str, name: str, label: str = "") -> float:
    """A verifier metric summed over its series (`label` selects one, e.g. '{replica="drafter-0"}')."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    pattern = rf"^{name}(?:_total)?{re.escape(label)} ([0-9.e+]+)$" if label else \
        rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.e+]+)$"
    return sum(float(m) for m in re.findall(pattern, text, flags=re.M))
