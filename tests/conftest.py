"""Shared fixtures: tiny checkpoints written in the real HF formats, once per test session."""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    # NOTE: without CUDA the Triton kernels run in Triton's CPU interpreter, which reads this flag when its
    # own library functions are decorated, i.e. at Triton's first import: set it before any test imports it.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 could be set: export it to run the tests")
    os.environ["TRITON_INTERPRET"] = "1"

from modeling.tiny import make_tiny_target

# NOTE: tiny models on a 2-core machine: intra-op threads only add contention (measured 15x slower).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny-target"), seed=0)


@pytest.fixture(scope="module")
def hf_logprobs(tiny_target):
    """Token ids -> the log_softmax of transformers' fp32 logits at every position: the logprobs' reference."""
    import transformers  # NOTE: here, so that tests without it collect where it is not installed

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].log_softmax(-1)
    return logprobs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
