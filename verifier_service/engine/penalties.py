"""logit_bias and the repetition, presence and frequency penalties, as vLLM defines and orders them: on the raw
fp32 logits, the bias first, then the repetition penalty (a token seen in the prompt or the output: a positive
logit divided by it, a negative one multiplied), the frequency penalty (times the token's count in the output) and
the presence penalty (once per token the output holds); temperature, top-k and top-p come after
(sampling.target_distribution). Logprobs stay raw (engine/logprobs.py).

NOTE (exactness under speculation): every verify row is a position of its own, whose output so far is the
generation's emitted tokens plus the draft tokens on the tree path from the root down to that row. Each row is
adjusted with its own counts (the generation's, kept on the device, plus its path's), so the target's choice at a
row is the one plain decoding with the same penalties would make there, and acceptance stays exact.

All adjusting sessions' rows of a step are adjusted in one pass (`adjust`), and their emitted tokens counted in one
(`count`), over state kept in one pair of tensors for all generations (`PenaltyState`): one session at a time took
~8 kernel launches each to adjust and 3 to count (H100, Qwen3-0.6B shape, 64 sessions: one pass for the adjustment
took a plain step 22.0 -> 13.1 ms, still twice a greedy step's; benchmarks/results/batch_step_sampling_h100.md).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch

from verifier_service.engine.sampling import SamplingParams
from verifier_service.engine.uploads import upload


class PenaltyState:
    """Every adjusting generation's prompt mask and output token counts, a row each of two [slots, V] tensors on the
    device: a step counts all its sessions' emitted tokens in one op and gathers its rows' counts in one, where one
    [V] tensor per generation took an upload and two kernels each per step (64 sessions, 192 small ops). A slot is
    taken by `adjustment` and given back when its LogitAdjustment is dropped, on whatever path its generation ends."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.free: list[int] = []

    def adjustment(self, params: SamplingParams, prompt: list[int]) -> LogitAdjustment:
        """A new generation's state: no output yet, and its prompt's tokens marked where a repetition penalty reads
        them."""
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.counts[slot].zero_()
        self.in_prompt[slot].zero_()
        if params.repetition_penalty != 1.0 and prompt:
            self.in_prompt[slot, upload(prompt, torch.int64, self.device)] = True
        adjustment = LogitAdjustment(params, self, slot)
        weakref.finalize(adjustment, self.free.append, slot)
        return adjustment

    def _grow(self) -> None:
        """Twice the slots (8 at first); the slots in use keep their rows."""
        used = len(self.counts)
        more = max(8, used)
        self.counts = torch.cat([self.counts, self.counts.new_zeros(more, self.vocab_size)])
        self.in_prompt = torch.cat([self.in_prompt, self.in_prompt.new_zeros(more, self.vocab_size)])
        self.free += range(used + more - 1, used - 1, -1)


class LogitAdjustment:
    """One generation's adjustments: its params, and its slot of the PenaltyState (its prompt mask and output
    counts); its bias is its params' (a few pairs, kept on the host)."""

    def __init__(self, params: SamplingParams, state: PenaltyState, slot: int):
        self.params, self.state, self.slot = params, state, slot


def count(emitted: list[tuple[LogitAdjustment, list[int]]]) -> None:
    """Emitted tokens join their generations' outputs (those that a penalty reads): all in one upload and one op."""
    penalized = [(adjustment, tokens) for adjustment, tokens in emitted if adjustment.params.penalized and tokens]
    if not penalized:
        return
    state = penalized[0][0].state
    slots = [adjustment.slot for adjustment, tokens in penalized for _ in tokens]
    ids = upload([slots, [token for _, tokens in penalized for token in tokens]], torch.int64, state.device)
    state.counts.index_put_((ids[0], ids[1]), torch.ones(len(slots), device=state.device), accumulate=True)


class BurstCounts(NamedTuple):
    """Where a decode burst counts each step's choices, on the device (the burst's next step reads them): the rows of
    its penalized sessions, their slots, a one for each."""

    state: PenaltyState
    rows: torch.Tensor
    slots: torch.Tensor
    ones: torch.Tensor

    @classmethod
    def of(cls, adjusted: list[tuple[int, LogitAdjustment]]) -> BurstCounts | None:
        """`adjusted`: (row, adjustment) of the burst's sessions that adjust; None when no penalty reads counts."""
        penalized = [(row, adjustment) for row, adjustment in adjusted if adjustment.params.penalized]
        if not penalized:
            return None
        state = penalized[0][1].state
        at = upload([[row for row, _ in penalized], [adjustment.slot for _, adjustment in penalized]], torch.int64,
                    state.device)
        return cls(state, at[0], at[1], torch.ones(len(penalized), device=state.device))

    def count(self, chosen: torch.Tensor) -> None:
        """A step's choices, [B] on the device (one a session), join the outputs."""
        self.state.counts.index_put_((self.slots, chosen[self.rows]), self.ones, accumulate=True)


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
        at = upload([rows, tokens], torch.int64, device)
        logits.index_put_((at[0], at[1]), upload(biases, torch.float32, device), accumulate=True)
    penalized = [s for s in sessions if s.adjustment.params.penalized]
    if not penalized:
        return logits
    slots, rows, settings, path_rows, path_ids = [], [], [], [], []
    for s in penalized:
        path_row, path = path_tokens(s.tokens, s.parent_rows)
        path_rows += [len(rows) + row for row in path_row]
        path_ids += path
        slots += [s.adjustment.slot] * len(s.tokens)
        rows += range(s.start, s.start + len(s.tokens))
        params = s.adjustment.params
        settings += [(params.repetition_penalty, params.frequency_penalty, params.presence_penalty)] * len(s.tokens)
    state = penalized[0].adjustment.state
    row_index, slot_index = upload([rows, slots], torch.int64, device)
    counts = state.counts.index_select(0, slot_index)  # NOTE: [R, V], a row's session's at each row
    if path_rows:
        at = upload([path_rows, path_ids], torch.int64, device)
        counts.index_put_((at[0], at[1]), torch.ones(len(path_rows), device=device), accumulate=True)
    in_prompt = state.in_prompt.index_select(0, slot_index)
    repetition, frequency, presence = upload(settings, torch.float32, device).T[:, :, None]
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
