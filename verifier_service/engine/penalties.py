"""logit_bias and the repetition, presence and frequency penalties, as vLLM defines and orders them: on the raw
fp32 logits, the bias first, then the repetition penalty (a token seen in the prompt or the output: a positive
logit divided by it, a negative one multiplied), the frequency penalty (times the token's count in the output) and
the presence penalty (once per token the output holds); temperature, top-k and top-p come after
(sampling.target_distribution). Logprobs stay raw (engine/logprobs.py).

NOTE (exactness under speculation): every verify row is a position of its own, whose output so far is the
generation's emitted tokens plus the draft tokens on the tree path from the root down to that row. Each row is
adjusted with its own counts (the generation's, kept on the device, plus its path's), so the target's choice at a
row is the one plain decoding with the same penalties would make there, and acceptance stays exact.

All adjusting sessions' rows of a step are adjusted in one pass (`adjust`): one session at a time took ~8 kernel
launches each, at 64 sessions an estimated 2-3 ms of a GPU step's host time (not yet measured on a GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from verifier_service.engine.sampling import SamplingParams


class LogitAdjustment:
    """One generation's penalty state on the device: the prompt's tokens as a [V] mask, and the output's token counts
    [V], which grow as tokens are emitted (`count`). Its bias is its params' (a few pairs, kept on the host)."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, device: torch.device):
        self.params = params
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        if params.repetition_penalty != 1.0:
            self.in_prompt[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def count(self, tokens: list[int] | torch.Tensor) -> None:
        """Emitted tokens join the output: a host list, or a decode burst's choices still on the device."""
        if not self.params.penalized:
            return
        ids = torch.as_tensor(tokens, dtype=torch.int64).to(self.output_counts.device, non_blocking=True)
        self.output_counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))


class AdjustedRows(NamedTuple):
    """A session's rows in a step's logits: its adjustment, its block's tokens and parent rows (BlockSpec), and
    where its rows start."""

    adjustment: LogitAdjustment
    tokens: list[int]
    parent_rows: list[int]
    start: int


def adjust(logits: torch.Tensor, sessions: list[AdjustedRows]) -> torch.Tensor:
    """logits: [N, V] raw -> a new [N, V] in which each listed session's rows carry its bias and penalties, and the
    other rows are as they were: one pass of kernels for all the sessions (each row's counts are its session's
    output plus its path's draft tokens)."""
    logits, device = logits.clone(), logits.device
    biased = [(row, token, bias) for s in sessions for row in range(s.start, s.start + len(s.tokens))
              for token, bias in s.adjustment.params.logit_bias]
    if biased:
        rows, tokens, biases = zip(*biased)
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                          torch.tensor(biases, dtype=torch.float32, device=device), accumulate=True)
    penalized = [s for s in sessions if s.adjustment.params.penalized]
    if not penalized:
        return logits
    owners, rows, settings, path_rows, path_ids = [], [], [], [], []
    for s in penalized:
        path_row, path = path_tokens(s.tokens, s.parent_rows)
        path_rows += [len(rows) + row for row in path_row]
        path_ids += path
        owners += [s.adjustment] * len(s.tokens)
        rows += range(s.start, s.start + len(s.tokens))
        params = s.adjustment.params
        settings += [(params.repetition_penalty, params.frequency_penalty, params.presence_penalty)] * len(s.tokens)
    row_index = torch.tensor(rows, device=device)
    counts = torch.stack([owner.output_counts for owner in owners])  # NOTE: [R, V], a row's session's at each row
    if path_rows:
        counts.index_put_((torch.tensor(path_rows, device=device), torch.tensor(path_ids, device=device)),
                          torch.ones(len(path_rows), device=device), accumulate=True)
    in_prompt = torch.stack([owner.in_prompt for owner in owners])
    repetition, frequency, presence = torch.tensor(settings, dtype=torch.float32, device=device).T[:, :, None]
    chosen, in_output = logits.index_select(0, row_index), counts > 0
    scaled = torch.where(chosen > 0, chosen / repetition, chosen * repetition)  # NOTE: a penalty of 1 changes nothing
    chosen = torch.where(in_prompt | in_output, scaled, chosen) - frequency * counts - presence * in_output
    return logits.index_copy_(0, row_index, chosen)


def path_tokens(tokens: list[int], parent_rows: list[int]) -> tuple[list[int], list[int]]:
    """(row, token) pairs, as two lists: every row's path from the root, the row itself included and the root
    (row 0, the session's own last token, already counted) excluded."""
    rows, path = [], []
    for row in range(1, len(tokens)):
        node = row
        while node > 0:
            rows.append(row)
            path.append(tokens[node])
            node = parent_rows[node]
    return rows, path
