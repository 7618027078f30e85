"""A prompt, or a turn appended to a session, going into the session's pages one chunk at a time.

Between two `advance()` calls the engine is free: the verifier runs the other sessions' verify steps there, so a
128k-token prompt holds them up for one chunk at a time rather than for the whole prefill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verifier_service.engine.block_table import BlockTable
from verifier_service.engine.kv_cache import KVCache
from verifier_service.engine.logprobs import TokenLogprob
from verifier_service.engine.session import Session
from verifier_service.errors import NoFreePages, PrefillStopped

# (block table, tokens, chunk start, chunk end, prompt logprobs' alternatives or None) -> the chunk's target features
# (None without feature layers), and the logprobs of the tokens its rows predict (None unless asked for)
ChunkForward = Callable[..., tuple[torch.Tensor | None, list[TokenLogprob] | None]]
# (block table, tokens, start, feature tail) -> the prefix cache's pages for the positions from `start` on
CachedPages = Callable[[BlockTable, list[int], int, int], list[int]]


def _no_cache(table: BlockTable, tokens: list[int], start: int, feature_tail: int) -> list[int]:
    return []


def chunk_end(start: int, end: int, chunk: int) -> int:
    """Where the chunk from `start` ends: at `end` if the rest fits, else at the next multiple of `chunk` (so the
    first may be shorter): the prefix lengths a long prompt's chunks attend over then come from a small set, whose
    per-shape kernel plans are built once and reused."""
    return end if end - start <= chunk else start - start % chunk + chunk


class Prefill:
    def __init__(self, session: Session, new_tokens: list[int], feature_tail: int, chunk: int, kv: KVCache,
                 forward_chunk: ChunkForward, register: Callable[[Session], None] | None, room: Callable[[], int],
                 grows_to: int, promised: dict[str, int], prompt_logprobs: int | None = None,
                 cached_pages: CachedPages = _no_cache):
        """Holds nothing until `reserve()` or the first `advance()` takes the pages of all new positions (a
        prefill object dropped before that leaks nothing). `register` adds a new session to the engine once its
        prompt is in (None: the session exists already); `room()`: the free pages it may take (Engine.room);
        `grows_to`: the positions the session may reach, its generation after the prompt included: the pages up
        to there must be free too, and `promised` (Engine.promised) keeps those beyond the prompt's for the generation
        from then on, until the generation ends or this prefill aborts. `prompt_logprobs`: the alternatives of each
        new token's logprob (`logprobs`), None for none. `cached_pages`: the prefix cache's pages
        that hold the first new positions already (Engine._cached_pages); `reserve()` takes them, and the prefill
        computes the positions after them (all of them when asked for their logprobs)."""
        self.session, self.feature_tail, self.kv = session, feature_tail, kv
        self.tokens = session.tokens + new_tokens
        self.start, self.end = (session.kv_len if session.tokens else 0), len(self.tokens) - 1
        self.chunk, self.next_start = chunk, self.start
        self.forward_chunk, self.register, self.room = forward_chunk, register, room
        self.grows_to, self.promised = grows_to, promised
        self.finished, self.aborted, self.reserved = False, False, False
        self.tail: list[torch.Tensor] = []
        self.prompt_logprobs = prompt_logprobs
        # NOTE: the logprobs of tokens[start + 1:end + 1], chunk by chunk: a chunk's rows predict the tokens after them
        self.logprobs: list[TokenLogprob] | None = None if prompt_logprobs is None else []
        self.cached_pages = cached_pages
        self.hits = self._hits()

    def _hits(self) -> list[int]:
        if self.prompt_logprobs is not None:  # NOTE: every new position's row is needed
            return []
        return self.cached_pages(self.session.block_table, self.tokens, self.start, self.feature_tail)

    @property
    def cached_tokens(self) -> int:
        """New positions whose K/V came from the prefix cache (final once reserved)."""
        return len(self.hits) * self.session.block_table.page_size

    @property
    def pages_needed(self) -> int:
        """The free pages the new positions take beyond what the session holds (fresh copies of shared ones
        included): cached pages only where nobody holds them (until taken they count as free); 0 once reserved,
        when it has taken them."""
        if self.reserved:
            return 0
        table = self.session.block_table
        revived = sum(table.pool.refcount[page] == 0 for page in self.hits)
        return table.pages_needed(self.start, self.end) - len(self.hits) + revived

    @property
    def pages_to_keep(self) -> int:
        """pages_needed, plus the pages the generation after it may take."""
        table = self.session.block_table
        return self.pages_needed + max(0, table.pages_for(self.grows_to) - max(len(table.pages),
                                                                               table.pages_for(self.end)))

    def reserve(self) -> bool:
        """Take the pages of every new position if they, and those of the generation after, are free beside what
        the generations under way may take; False (nothing taken) if they are not."""
        if not self.reserved:
            self.hits = self._hits()  # NOTE: the cache may have changed since: pages evicted, others indexed
            if self.pages_to_keep > self.room():
                return False
            table = self.session.block_table
            table.pool.take(self.hits)
            table.pages.extend(self.hits)
            self.next_start = self.start + self.cached_tokens
            try:
                table.prepare_write(self.next_start, self.end, self.kv)
            except BaseException:
                self.abort()
                raise
            self.reserved = True
            if self.grows_to > self.end:
                self.promised[self.session.session_id] = self.grows_to
        return True

    @property
    def done(self) -> int:
        """Tokens prefilled so far."""
        return self.next_start - self.start

    @property
    def total(self) -> int:
        return self.end - self.start

    @property
    def features(self) -> torch.Tensor | None:
        """The target features of the last `feature_tail` prefilled tokens (the drafter's seed)."""
        return torch.cat(self.tail)[-self.feature_tail:] if self.tail else None

    def advance(self, chunk: int | None = None) -> bool:
        """Prefill the next chunk (up to `chunk` tokens, by default the engine's); True once the whole prompt is in
        (the session then holds its tokens). The first takes the pages of every new position: NoFreePages, with
        nothing taken and nothing aborted, when the pool does not have them now (the caller may wait for pages and
        call again). On any other error the prefill is aborted: the session is as it was before."""
        if self.aborted:
            raise PrefillStopped("the prefill was aborted")
        if not self.reserve():
            raise NoFreePages(f"KV cache full: a prompt of {len(self.tokens)} tokens needs {self.pages_to_keep} more "
                              f"pages, {self.room()} free beside what the generations under way may take")
        try:
            if self.next_start < self.end:
                end = chunk_end(self.next_start, self.end, chunk or self.chunk)
                features, logprobs = self.forward_chunk(self.session.block_table, self.tokens, self.next_start, end,
                                                        self.prompt_logprobs)
                if features is not None and self.feature_tail:
                    self.tail.append(features[-self.feature_tail:])
                if logprobs is not None:
                    self.logprobs += logprobs
                self.next_start = end
            if self.next_start == self.end:
                self._finish()
        except BaseException:
            self.abort()
            raise
        return self.finished

    def _finish(self) -> None:
        self.session.tokens = self.tokens
        self.session.cached_tokens = self.cached_tokens
        if self.register is not None:
            self.register(self.session)
        self.finished = True

    def abort(self) -> None:
        """Give back the pages of the new positions and the generation's promise (a no-op once finished or
        aborted)."""
        if not self.finished and not self.aborted:
            self.aborted = True
            if self.reserved:
                self.promised.pop(self.session.session_id, None)
            self.session.block_table.truncate(self.start)  # NOTE: positions before `start` were never touched

    def run(self, should_stop: Callable[[], bool], on_progress: Callable[[int, int], None]) -> torch.Tensor | None:
        """All chunks now; between two it reports the tokens done to `on_progress` and stops (PrefillStopped,
        aborted) once `should_stop()`."""
        while not self.finished:
            if self.done:
                on_progress(self.done, self.total)
            if should_stop():
                self.abort()
                raise PrefillStopped(f"prefill stopped after {self.done} of {self.total} tokens")
            self.advance()
        return self.features
