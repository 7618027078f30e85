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

import math

import numpy as np

from modeling.tree import DraftTree


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
        self.tokens.extend(int(t) for t in new_tokens)
        end = len(self.tokens)
        if end > len(self.buffer):
            self.buffer, self.pairs = _grown(self.buffer, start, 2 * end), _grown(self.pairs, start, 2 * end)
        self.buffer[start:end] = self.tokens[start:end]
        first = max(start, 1)
        self.pairs[first:end] = (self.buffer[first - 1:end - 1] << 32) | self.buffer[first:end]


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
        tokens = session.tokens
        return _trie_tree([_continuation(tokens, p, max_depth) for p in self._match_starts(session)], budget)

    def _match_starts(self, session: _Session) -> list[int]:
        """Continuation starts of the longest earlier-seen suffix n-gram, most recent first: the ends p < len of
        its earlier occurrences (tokens[p - n:p] equal to the suffix; p = len is the suffix itself). One scan finds
        the suffix bigram's earlier ends, and each longer n narrows them by one more token; with no earlier bigram,
        a scan for the last token."""
        length = len(session.tokens)
        history = session.buffer[:length]
        ends = np.flatnonzero(session.pairs[1:length - 1] == session.pairs[length - 1]) + 2 if length > 2 else []
        if not len(ends) or self.max_n < 2:
            if self.min_n > 1:
                return []
            return _recent(np.flatnonzero(history[:length - 1] == history[length - 1]) + 1, self.max_matches)
        found = ends if self.min_n <= 2 else ends[:0]
        for n in range(3, min(self.max_n, length) + 1):
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
    and the child is deeper, so sorting by (-count, depth, creation order) lists parents first: the kept
    prefix is a tree in topological order.
    """
    # NOTE: periodic text repeats whole continuations: insert each distinct one once, with its multiplicity
    # (same trie, same creation order: a repeat never creates a node).
    repeats: dict[tuple[int, ...], int] = {}
    for continuation in continuations:
        key = tuple(continuation)
        repeats[key] = repeats.get(key, 0) + 1
    children: list[dict[int, int]] = [{}]  # trie node 0 = the root
    token_of, parent_of, depth_of, count = [-1], [-1], [0], [len(continuations)]
    for continuation, times in repeats.items():
        node = 0
        for token in continuation:
            child = children[node].get(token)
            if child is None:
                child = len(token_of)
                children[node][token] = child
                children.append({})
                token_of.append(token)
                parent_of.append(node)
                depth_of.append(depth_of[node] + 1)
                count.append(0)
            count[child] += times
            node = child
    kept = sorted(range(1, len(token_of)), key=lambda i: (-count[i], depth_of[i], i))[:budget]
    position = {0: -1}
    tokens, parents, depths, logprobs = [], [], [], []
    for i in kept:
        parent = position[parent_of[i]]
        position[i] = len(tokens)
        tokens.append(token_of[i])
        parents.append(parent)
        depths.append(depth_of[i])
        logprobs.append(math.log(count[i] / count[0]))
    return DraftTree(tuple(tokens), tuple(parents), tuple(depths), tuple(logprobs))
