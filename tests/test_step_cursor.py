"""A session's step cursor: what its next draft request carries after steps that skipped the drafter."""

from __future__ import annotations

import torch

from modeling.speculation import StepCursor


def test_skipped_steps_features_are_joined_once_when_a_draft_reads_them() -> None:
    """Steps at budget 0 add their tokens and features to what the next draft carries; the features are kept apart
    until read (joined at every step, a long run of plain steps copied them all again at each one)."""
    cursor = StepCursor("s", 10)
    rows = [torch.full((n, 4), float(i), dtype=torch.bfloat16) for i, n in enumerate((2, 1, 3))]
    cursor.advance([1, 2], rows[0], 10)  # NOTE: a drafted step: the cursor starts over from it
    cursor.advance([3], rows[1], 12, drafted=False)
    cursor.advance([4, 5, 6], rows[2], 13, drafted=False)
    assert len(cursor.feature_chunks) == 3
    step = cursor.draft_step(7, 3)
    assert step.committed == [1, 2, 3, 4, 5, 6] and step.position == 10
    assert torch.equal(step.features, torch.cat(rows)) and len(cursor.feature_chunks) == 1
    cursor.advance([7, 8], rows[0], 16)
    assert cursor.committed == [7, 8] and cursor.position == 16 and torch.equal(cursor.features, rows[0])


def test_an_ngram_sessions_cursor_carries_no_features() -> None:
    cursor = StepCursor("s", 4)
    cursor.advance([1], None, 4)
    cursor.advance([2], None, 5, drafted=False)
    step = cursor.draft_step(3, 7)
    assert step.committed == [1, 2] and step.features is None
