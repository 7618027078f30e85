"""The drafter's top-k kernel (ddtree_kernels/row_top_k.py) against the torch top-k it replaces on CUDA.

Without CUDA it runs in Triton's CPU interpreter (fp32/fp16, small rows); with CUDA (`gpu`) in bf16 at the
serving shape too, where equal values at the k-th rank are common: a top-k is then checked for what any top-k
must be (the same ranked values, every larger value kept, ids that hold those values), not for torch's ids.
"""

from __future__ import annotations

import pytest
import torch

from ddtree_kernels.row_top_k import CHUNK, GROUP, top_k_log_probs
from modeling.ops import TorchRowOps

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
REFERENCE = TorchRowOps()


def assert_a_top_k(logits: torch.Tensor, values: torch.Tensor, ids: torch.Tensor, k: int) -> None:
    """values, ids are a top-k of each row of logits, ranked by (log-prob desc, token id asc)."""
    expected_values, expected_ids = REFERENCE.top_k_log_probs(logits.cpu(), k)
    values, ids, logits = values.cpu(), ids.cpu(), logits.cpu().float()
    assert values.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == expected_ids.shape
    torch.testing.assert_close(values, expected_values, atol=1e-5, rtol=1e-6)
    assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "a token twice in one row"
    kept = logits.gather(-1, ids)
    assert torch.equal(kept, logits.gather(-1, expected_ids)), "an id that does not hold its rank's value"
    later = (kept[..., 1:] == kept[..., :-1]) <= (ids[..., 1:] > ids[..., :-1])
    assert later.all(), "equal values not ranked by token id"
    larger = (logits > kept[..., -1:]).sum(-1)
    assert torch.equal(larger, (kept > kept[..., -1:]).sum(-1)), "a value above the k-th left out"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("shape", "k"), [((3, 5, 1000), 15), ((2, CHUNK + 3), 64), ((4, 100), 15), ((1, 37), 37),
                                          ((2, 3, 2 * GROUP + 1), 1), ((5, 70), 64), ((2, 50), 80)])
def test_a_top_k_of_every_row(dtype: torch.dtype, shape: tuple[int, ...], k: int) -> None:
    """Rows of one group and fewer values than groups picked (every group a candidate), of several chunks, k = 1,
    k > V (K = V). In fp32 the values are distinct, so the ids are torch's."""
    logits = (3 * torch.randn(shape, generator=torch.Generator().manual_seed(k))).to(DEVICE, dtype)
    values, ids = top_k_log_probs(logits, k)
    assert_a_top_k(logits, values, ids, k)
    if dtype == torch.float32:
        assert torch.equal(ids.cpu(), REFERENCE.top_k_log_probs(logits.cpu(), k)[1])


def test_ties_masked_logits_and_empty_rows() -> None:
    """A few distinct values over thousands of tokens (ties at and above the k-th rank), -inf logits, a row of
    nothing but zeros (every group tied), a row with two finite values and k = 4 (the -inf ones fill the rest)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 4, (3, 2 * CHUNK + 5), generator=gen).to(DEVICE, torch.float16)
    logits[1, ::2] = float("-inf")
    logits[2] = 0
    assert_a_top_k(logits, *top_k_log_probs(logits, 20), 20)
    sparse = torch.full((1, 300), float("-inf"), device=DEVICE)
    sparse[0, 250] = sparse[0, 7] = 1.0
    values, ids = top_k_log_probs(sparse, 4)
    assert ids[0, :2].tolist() == [7, 250] and values[0, 2:].isneginf().all()
    torch.testing.assert_close(values[0, :2].cpu(), torch.full((2,), -0.6931472))
    assert top_k_log_probs(torch.zeros(0, 5, 100, device=DEVICE), 3)[1].shape == (0, 5, 3)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs CUDA")
@pytest.mark.parametrize("k", [1, 15, 64, 255])
def test_serving_shape_in_bf16(k: int) -> None:
    """64 sessions of 15 depths over Qwen3's 151936 tokens, in bf16 (ties at the k-th rank are likely)."""
    logits = (4 * torch.randn(64, 15, 151936, device="cuda")).bfloat16()
    logits[3, 2] = logits[3, 2].round()  # most of a row tied
    assert_a_top_k(logits, *top_k_log_probs(logits, k), k)
