"""Automatic prefix caching: full KV pages indexed by the tokens they hold and every token before them.

A page's entry is keyed by its parent entry (the page before it in the same sequence) and its own tokens, so a
prompt finds the longest run of pages another sequence wrote with the same tokens from position 0: stateless
clients that resend a conversation or a system prompt skip prefilling it. Keys are compared exactly (a dict of
tuples), never by a digest alone, so two different prefixes can never share an entry.

Entries live as long as their page: a page nobody holds any more stays indexed and counts as free (PagePool keeps
it on an evictable list, least recently used first) until an allocation needs it, which forgets its entry. A
parent's serial number names it in its children's keys, never its page id: a page reused by another entry cannot
make an old child reachable under a prefix it does not continue.

A session is indexed after its prompt goes in and again when it is released: the second insert resumes where the
first stopped (`Indexed`) rather than keying every page again (~2000 pages of 64 tokens at 128k: ~4 ms of the
engine thread).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_ROOT = -1  # the parent of a sequence's first page


@dataclass(frozen=True)
class Indexed:
    """How far a sequence's full pages are indexed (PrefixCache.insert's answer, where its next insert resumes): its
    first `pages`, whose chain of entries ends on entry `serial`, and the entries of that chain that are other
    sequences' pages holding the same tokens (`borrowed`, as (page, serial)). Those may be evicted while the sequence
    lives, leaving its later pages under an entry no match reaches: a resumed insert checks them first. The entries
    in its own pages cannot go before one of them does: it holds those pages, and an insert through them by another
    holder (a fork, a session that took them from the cache) walks the same live chain to them."""

    pages: int = 0
    serial: int = _ROOT
    borrowed: tuple[tuple[int, int], ...] = ()


_UNINDEXED = Indexed()


class PrefixCache:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self._page_of: dict[tuple[int, tuple[int, ...]], int] = {}
        self._entry: dict[int, tuple[tuple[int, tuple[int, ...]], int]] = {}  # page -> (its key, its serial)
        self._next_serial = 0

    def __len__(self) -> int:
        return len(self._entry)

    def holds(self, page: int) -> bool:
        return page in self._entry

    def match(self, tokens: Sequence[int], max_pages: int) -> list[int]:
        """The pages holding the longest indexed run of `tokens`' full pages from position 0 (at most `max_pages`);
        the caller takes them (PagePool.take) before any other allocation can evict them."""
        pages: list[int] = []
        parent = _ROOT
        for key in self._keys(tokens, 0, max_pages):
            page = self._page_of.get((parent, key))
            if page is None:
                break
            pages.append(page)
            parent = self._entry[page][1]
        return pages

    def insert(self, tokens: Sequence[int], pages: Sequence[int], since: Indexed = _UNINDEXED) -> Indexed:
        """Index the full pages of a sequence: `pages` hold its positions from 0 on, `tokens` its tokens (those past
        the last page are not read). A page whose tokens are indexed already (in another page) is left out, its
        sequence's later pages chain on that entry; a page indexed under a parent that was evicted and indexed again
        since is indexed again under the live one (its K/V are the sequence's own, so it continues this prefix).
        `since`: the sequence's last insert's answer, if it has held its pages since and they and its tokens only
        grew: the pages it covers are not keyed again unless an entry it borrowed was evicted. Returns how far the
        pages are indexed now."""
        if not all(self._live(page, serial) for page, serial in since.borrowed):
            since = _UNINDEXED  # NOTE: its chain may be cut: index from the first page, as if never indexed
        parent, borrowed = since.serial, list(since.borrowed)
        keys = self._keys(tokens, since.pages, len(pages))
        for index, key in enumerate(keys, since.pages):
            page = pages[index]
            known = self._page_of.get((parent, key))
            if known is None:
                if page in self._entry:
                    self.forget(page)
                self._page_of[(parent, key)] = known = page
                self._entry[page] = ((parent, key), self._next_serial)
                self._next_serial += 1
            parent = self._entry[known][1]
            if known != page:
                borrowed.append((known, parent))
        return Indexed(since.pages + len(keys), parent, tuple(borrowed))

    def forget(self, page: int) -> None:
        """Drop the page's entry: its slots are about to hold something else."""
        key, _ = self._entry.pop(page)
        del self._page_of[key]

    def _live(self, page: int, serial: int) -> bool:
        entry = self._entry.get(page)
        return entry is not None and entry[1] == serial

    def _keys(self, tokens: Sequence[int], start: int, max_pages: int) -> list[tuple[int, ...]]:
        """The tokens of full pages `start` to `max_pages` (exclusive) of `tokens`."""
        full = min(len(tokens) // self.page_size, max_pages)
        size = self.page_size
        return [tuple(tokens[i * size:(i + 1) * size]) for i in range(start, full)]
