"""logit_bias and the repetition, presence and frequency penalties, as vLLM defines and orders them: on the raw
fp32 logits, the bias first, then the repetition penalty (a token seen in the prompt or the output: a positive
logit divided by it, a negative one multiplied), the frequency penalty (times the token's count in the output) and
the presence penalty (once per token the output holds); temperature, top-k and top-p come after
(sampling.target_distribution). Logprobs stay raw (engine/logprobs.py).

NOTE (exactness under speculation): every verify row is a position of its own, whose output so far is the
generation's emitted tokens plus the draft tokens on the tree path from the root down to that row. Each row is
adjusted with its own counts (the generation's, kept on the device, plus its path's), so the target's choice at a
row is the one plain decoding with the same penalties would make there, and acceptance stays exact.
"""

from __future__ import annotations

import torch

from verifier_service.engine.sampling import SamplingParams


class LogitAdjustment:
    """One generation's bias and penalty state on the device: the bias as (ids, values), the prompt's tokens as a
    [V] mask, and the output's token counts [V], which grow as tokens are emitted (`count`)."""

    def __init__(self, params: SamplingParams, prompt: list[int], vocab_size: int, device: torch.device):
        self.params = params
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.int64, device=device)
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32, device=device)
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

    def apply(self, logits: torch.Tensor, tokens: list[int], parent_rows: list[int]) -> torch.Tensor:
        """logits: [R, V] raw, of one block's rows (`tokens` and `parent_rows` as in a BlockSpec) -> adjusted [R, V],
        a new tensor: the raw logits stay for the logprobs."""
        if self.params.logit_bias:
            logits = logits.index_add(1, self.bias_ids, self.bias_values.expand(len(logits), -1))
        if not self.params.penalized:
            return logits
        counts = self._row_counts(tokens, parent_rows)  # [R, V]
        in_output = counts > 0
        params = self.params
        if params.repetition_penalty != 1.0:
            penalty = params.repetition_penalty
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(self.in_prompt | in_output, scaled, logits)
        if params.frequency_penalty:
            logits = logits - params.frequency_penalty * counts
        if params.presence_penalty:
            logits = logits - params.presence_penalty * in_output
        return logits

    def _row_counts(self, tokens: list[int], parent_rows: list[int]) -> torch.Tensor:
        """[R, V]: the output's counts, plus at each row the draft tokens of its path."""
        counts = self.output_counts.expand(len(tokens), -1).clone()
        rows, path = path_tokens(tokens, parent_rows)
        if rows:
            device = counts.device
            index = (torch.tensor(rows, device=device), torch.tensor(path, device=device))
            counts.index_put_(index, torch.ones(len(rows), device=device), accumulate=True)
        return counts


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
