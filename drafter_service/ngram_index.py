"""The n-gram (prompt lookup) drafter: no weights, CPU.

It guesses that the text repeats itself: the longest suffix n-gram of a session's history that occurred
before is looked up, and what followed its earlier occurrences becomes the draft. The lookup scans the history
(numpy arrays of its tokens and of its adjacent pairs) instead of keeping an index of every n-gram: an index costs a
dict insert per token and n-gram size on every step and on every seed (0.9 s for a 128k-token history, on the round
of the session's first draft), a scan ~50 us per step at 128k and less below (benchmarks/results/ngram_drafter.md).

Continuations of different occurrences share prefixes, so they form a trie; the tree keeps the `budget` trie nodes
that the most occurrences pass through (the most frequent prefixes: DDTree's rule with the empirical
conditional distribution), shallower first on equal counts.

Why a trie rather than per-depth distributions fed to the DDTree builder: continuations keep their
conditioning (a node's count is the occurrences that pass through its whole path), there are no V-wide
rows to build, and replayed text accepted as much or more (benchmarks/results/ngram_trie.md).

The history holds the committed tokens followed by the pending token (the tree's root): after a verify
step, extend() it with the accepted tokens and the new pending token.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter

import numpy as np

from modeling.tree import DraftTree

FEW_TOKENS = 16  # appends up to this many tokens go one by one (a step's), longer ones through numpy (a seed's)


class _Session:
    """One session's tokens: as a list (what the drafter reads and slices), in a numpy buffer, and as the key of
    each adjacent pair (`pairs[p]` packs tokens p - 1 and p: one scan over it finds a bigram's occurrences, which
    are far rarer than a token's), the buffers grown by doubling."""

    def __init__(self, tokens: list[int]):
        self.tokens: list[int] = []
        self.buffer = np.empty(max(64, 2 * len(tokens)), dtype=np.int64)
        self.pairs = np.empty_like(self.buffer)
        self.append(tokens)

    def append(self, new_tokens: list[int]) -> None:
        start = len(self.tokens)
        self.tokens.extend(map(int, new_tokens))
        end = len(self.tokens)
        if end > len(self.buffer):
            self.buffer, self.pairs = _grown(self.buffer, start, 2 * end), _grown(self.pairs, start, 2 * end)
        if 0 < start and end - start <= FEW_TOKENS:
            self._append_few(start, end)
            return
        self.buffer[start:end] = self.tokens[start:end]
        first = max(start, 1)
        self.pairs[first:end] = (self.buffer[first - 1:end - 1] << 32) | self.buffer[first:end]

    def _append_few(self, start: int, end: int) -> None:
        """A step's few tokens one by one: cheaper than numpy's per-call cost. NOTE: tokens are int32 (proto), so a
        pair's key fits int64 exactly as numpy computes it."""
        tokens, buffer, pairs = self.tokens, self.buffer, self.pairs
        previous = tokens[start - 1]
        for p in range(start, end):
            token = tokens[p]
            buffer[p] = token
            pairs[p] = (previous << 32) | token
            previous = token


def _grown(array: np.ndarray, used: int, size: int) -> np.ndarray:
    grown = np.empty(size, dtype=array.dtype)
    grown[:used] = array[:used]
    return grown


class NgramIndex:
    """Per-session prompt-lookup drafting from an incrementally updated n-gram index.

    min_n, max_n: n-gram sizes tried, longest first; the longest one that occurred before wins.
    max_matches: the most recent occurrences used (bounds the trie at max_matches x max_depth nodes).
    """

    def __init__(self, min_n: int = 1, max_n: int = 4, max_matches: int = 64) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n ({min_n}) <= max_n ({max_n})")
        if max_matches < 1:
            raise ValueError(f"max_matches ({max_matches}) must be at least 1")
        self.min_n, self.max_n, self.max_matches = min_n, max_n, max_matches
        self._sessions: dict[str, _Session] = {}

    def open(self, session_id: str, tokens: list[int]) -> None:
        """Start (or restart) a session from its history; the last token is the pending token."""
        self._sessions[session_id] = _Session(tokens)

    def extend(self, session_id: str, new_tokens: list[int]) -> None:
        """Append newly committed tokens and the new pending token."""
        self._sessions[session_id].append(new_tokens)

    def close(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def history(self, session_id: str) -> list[int]:
        """The session's tokens: committed ones, then the pending token once a step added it."""
        return self._sessions[session_id].tokens

    def draft(self, session_id: str, budget: int, max_depth: int) -> DraftTree:
        """A tree of at most `budget` nodes and depth `max_depth` under the last history token."""
        session = self._sessions[session_id]
        if budget <= 0 or max_depth <= 0:
            return DraftTree.empty()
        # NOTE: a kept node's ancestors are kept before it, so no node deeper than the budget is ever kept
        return _trie_tree(_continuations(session.tokens, self._match_starts(session), min(max_depth, budget)), budget)

    def _match_starts(self, session: _Session) -> list[int]:
        """Continuation starts of the longest earlier-seen suffix n-gram, most recent first: the ends p < len of
        its earlier occurrences (tokens[p - n:p] equal to the suffix; p = len is the suffix itself). One scan finds
        the suffix bigram's earlier ends, and each longer n narrows them by one more token; with no earlier bigram,
        a scan for the last token."""
        length = len(session.tokens)
        history = session.buffer[:length]
        ends = (session.pairs[1:length - 1] == session.pairs[length - 1]).nonzero()[0] + 2 if length > 2 else []
        if not len(ends) or self.max_n < 2:
            if self.min_n > 1:
                return []
            return _recent((history[:length - 1] == history[length - 1]).nonzero()[0] + 1, self.max_matches)
        found = ends if self.min_n <= 2 else ends[:0]
        for n in range(3, min(self.max_n, length) + 1):
            if ends[0] < n:  # NOTE: ends ascend: only the earliest ones can be too close to the start
                ends = ends[ends >= n]
            ends = ends[history[ends - n] == history[length - n]]
            if not len(ends):
                break
            if n >= self.min_n:
                found = ends
        return _recent(found, self.max_matches)


def _recent(ends: np.ndarray, count: int) -> list[int]:
    """The last `count` ends, most recent first."""
    return ends[-count:][::-1].tolist()


def _continuations(tokens: list[int], starts: list[int], length: int) -> list[list[int]]:
    """The `length` tokens that followed each start (see `_continuation`)."""
    last = len(tokens) - length  # NOTE: a start past it runs out of history
    return [tokens[p:p + length] if p <= last else _continuation(tokens, p, length) for p in starts]


def _continuation(tokens: list[int], start: int, length: int) -> list[int]:
    """What followed position `start`, as if the text after the history repeats what followed `start`.

    A match close to the end runs out of history; the match itself says the text is periodic with
    period len(tokens) - start there, so the continuation wraps (a repeated token drafts a full chain).
    """
    head = tokens[start:start + length]
    return head if len(head) == length else (head * -(-length // len(head)))[:length]


def _trie_tree(continuations: list[list[int]], budget: int) -> DraftTree:
    """Keep the `budget` trie nodes with the highest counts; ties go shallower, then earlier-created.

    Continuations come most recent first, so among equal counts and depths the recent occurrence wins;
    shallower-first on ties spreads the budget over alternatives instead of one long single-match chain
    (better acceptance: benchmarks/results/ngram_trie.md). A child's count never exceeds its parent's
    and the child is deeper, so the order (-count, depth, creation order) lists parents first: the kept
    prefix is a tree in topological order, and popping nodes best-first from a heap of the kept nodes' children
    yields it without building the rest of the trie. All continuations have the same length.
    """
    total = len(continuations)
    if not total:
        return DraftTree.empty()
    if continuations.count(continuations[0]) == total:  # all agree: a chain, every count the total
        n = min(budget, len(continuations[0]))
        return DraftTree(tuple(continuations[0][:n]), tuple(range(-1, n - 1)), tuple(range(1, n + 1)), (0.0,) * n)
    # NOTE: periodic text repeats whole continuations: each distinct one once, with its multiplicity. A node is
    # created by the first continuation through it, so (its first-seen index, depth) is its creation order.
    members = [(first, continuation, times)
               for first, (continuation, times) in enumerate(Counter(map(tuple, continuations)).items())]
    length = len(continuations[0])
    heap = _children(members, 0, -1)
    heapq.heapify(heap)
    tokens, parents, depths, logprobs = [], [], [], []
    while heap and len(tokens) < budget:
        negative_count, depth, _, parent, token, through = heapq.heappop(heap)
        if depth < length:
            for child in _children(through, depth, len(tokens)):
                heapq.heappush(heap, child)
        tokens.append(token)
        parents.append(parent)
        depths.append(depth)
        logprobs.append(math.log(-negative_count / total))
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(logprobs))


_Member = tuple[int, tuple[int, ...], int]  # (first-seen index, continuation, multiplicity)
_Node = tuple[int, int, int, int, int, list[_Member]]  # (-count, depth, first-seen index, parent, token, members)
# NOTE: no two nodes share their first three fields, so the heap never compares the rest


def _children(members: list[_Member], depth: int, parent: int) -> list[_Node]:
    """The children of the node at `depth` (at output position `parent`) that `members` pass through, as heap
    entries: the continuations grouped by their token at `depth`, each group in first-seen order."""
    if len(members) == 1:
        ((first, continuation, times),) = members
        return [(-times, depth + 1, first, parent, continuation[depth], members)]
    groups: dict[int, list[_Member]] = {}
    for member in members:
        groups.setdefault(member[1][depth], []).append(member)
    return [(-sum(times for _, _, times in group), depth + 1, group[0][0], parent, token, group)
            for token, group in groups.items()]
