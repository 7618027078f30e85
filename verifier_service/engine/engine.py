"""The verifier engine: sessions over a paged KV cache, chunked prefill, and the batched
verify -> accept -> commit step (plain decoding is the step with an empty tree)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modeling.checkpoint import load_causal_lm
from modeling.target import CausalLM
from modeling.tokenizer import Tokenizer
from modeling.tree import DraftTree
from verifier_service.engine.acceptance import accept_path
from verifier_service.engine.attention import PagedPrefillAttention, PagedVerifyAttention, TritonBackend, make_backend
from verifier_service.engine.block_table import BlockTable
from verifier_service.engine.config import TRITON_MAX_BLOCK, EngineConfig
from verifier_service.engine.kv_cache import KVCache, TreeScratch
from verifier_service.engine.logprobs import RowLogprobs, TokenLogprob, asking_spans, ranked_logprobs, read_back
from verifier_service.engine.page_pool import PagePool
from verifier_service.engine.penalties import AdjustedRows, BurstCounts, PenaltyState, adjust, count
from verifier_service.engine.prefill import Prefill
from verifier_service.engine.prefix_cache import PrefixCache
from verifier_service.engine.sampling import MAX_LOGPROBS, RowSampling, SamplingParams, choose_tokens
from verifier_service.engine.session import Generation, Session
from verifier_service.engine.stopping import StopChecker, StopReason
from verifier_service.engine.uploads import upload
from verifier_service.engine.verify_batch import (
    BlockSpec,
    PrefillChunk,
    VerifyBatch,
    build_prefill_chunk,
    build_verify_batch,
)
from verifier_service.errors import CapacityError, InvalidArgument, NoFreePages, SessionNotFound

log = logging.getLogger(__name__)


def _never() -> bool:
    return False


def _quiet(done: int, total: int) -> None:
    pass


@dataclass(frozen=True)
class StepResult:
    session_id: str
    accepted: list[int]  # draft tokens the target accepted (the root excluded)
    path: list[int]  # their node indices in the tree as drafted
    emitted: list[int]  # tokens for the client: accepted + the next root, cut at a stop
    commit_start: int  # KV position of committed[0]
    committed: list[int]  # tokens this step put into the KV (root + accepted, cut at a stop)
    features: torch.Tensor | None  # [len(committed), F] target hidden features for the drafter
    finished: StopReason | None
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when the generation asks for them

    @property
    def acceptance_length(self) -> int:
        """Tokens this verify step produced: accepted drafts plus the target's own next token."""
        return len(self.accepted) + 1


class Engine:
    def __init__(self, model: CausalLM, config: EngineConfig, tokenizer: Tokenizer | None = None):
        self.model, self.config, self.tokenizer = model, config, tokenizer
        if torch.device(config.device).type == "cuda":
            model.fuse_projections()
        self.model_config = model.config
        self.max_context = config.max_context or self.model_config.max_position_embeddings
        dtype, device = config.torch_dtype, torch.device(config.device)
        num_pages = config.kv_budget_bytes // KVCache.page_bytes(self.model_config, config.page_size, dtype)
        if num_pages < 1:
            raise ValueError("kv_budget_bytes is smaller than one KV page")
        self.prefix_cache = PrefixCache(config.page_size) if config.prefix_caching else None
        self.pool = PagePool(num_pages, self.prefix_cache)
        # NOTE: the page count comes from the whole model's page size, so every tensor-parallel rank agrees on
        # it; the tensors hold only the KV heads of this model instance (`shard_config`).
        self.kv = self._kv_cache(num_pages, dtype, device)
        latent = self.model_config.mla is not None
        self.prefill_chunk = config.prefill_chunk_tokens
        # NOTE: the rows one block may have in the verify kernels (and graphs); a longer one is a prefill chunk, run
        # by the prefill path (MLA: chunks longer than the latent verify kernel takes)
        latent_chunk = min(self.prefill_chunk, TRITON_MAX_BLOCK) if latent else 0
        self.verify_block_tokens = max(config.max_tree_tokens, latent_chunk)
        # NOTE: a longer prefill chunk writes its K/V straight to its pages (PagedPrefillAttention)
        self.scratch = TreeScratch(model.shard_config, max(config.max_batch_tokens, self.verify_block_tokens), dtype,
                                   device)
        self.backend = make_backend(config.attention)
        self.sm_scale = self.model_config.attention_scale
        # NOTE: an MLA layer's attention returns the attention-weighted latents: its first kv_lora_rank columns
        self.value_dim = self.model_config.mla.kv_lora_rank if self.model_config.mla else 0
        self.feature_layers = config.feature_layers  # NOTE: set by the service once a drafter says which
        self.sessions: dict[str, Session] = {}
        self.penalties = PenaltyState(self.model_config.vocab_size, device)  # NOTE: no memory until a request asks
        # NOTE: a session whose prompt is in (or going in) and whose generation has not started yet -> the positions
        # that generation may reach: their pages are kept free for it (pages_owed)
        self.promised: dict[str, int] = {}
        self.graphs = self._graphed_forward() if config.uses_cuda_graphs else None

    def _graphed_forward(self):  # -> GraphedForward; imported here: Triton loads only where it runs
        from verifier_service.engine.cuda_graphs import GraphedForward, Layout

        config = self.config
        layout = Layout(max_seqs=min(config.graph_max_sessions, config.max_batch_tokens),
                        max_tokens=config.max_batch_tokens, max_pages=-(-self.max_context // config.page_size) + 1)
        return GraphedForward(self._forward, layout, self.verify_block_tokens, self.max_context, self.device)

    def warm_up(self, tokens_per_session: int, progress: Callable[[list], Iterable] = iter) -> int:
        """Capture now every graph that a prefill chunk or a step of sessions with up to `tokens_per_session`
        rows each can need, and build the long prefill chunks' attention plans: a capture in mid-request stalls
        every session for as long as it takes. `progress` wraps the list of buckets (ddtree.progress.track).
        Returns the graphs held."""
        self._build_prefill_plans()
        if self.graphs is None:
            return 0
        buckets = self.graphs.buckets.reachable(tokens_per_session, min(self.prefill_chunk, self.verify_block_tokens))
        for sizes in progress(list(buckets.values())):
            # NOTE: blocks with no prefix touch only the tree scratch, never the pages
            self.forward([BlockSpec.chain(0, [0] * size, []) for size in sizes])
        return len(self.graphs.graphs)

    def _build_prefill_plans(self) -> int:
        """The fused prefill attention's per-shape plans for every full chunk a prompt up to max_context has, of the
        prefill chunk's size and of the lone chunk's (MLA: of its expanded form). Returns the shapes run."""
        if self.prefill_chunk <= self.verify_block_tokens or not isinstance(self.backend, TritonBackend):
            return 0
        from ddtree_kernels.prefill_attention import build_latent_plans, build_plans

        shard, built = self.model.shard_config, 0
        try:
            absorbed = self.model.model.layers[0].self_attn.absorbed_weights() if shard.mla is not None else None
            for chunk in {self.prefill_chunk, self.config.lone_prefill_chunk or self.prefill_chunk}:
                max_prefix = self.max_context - chunk
                if absorbed is not None:
                    built += build_latent_plans(*absorbed, shard.mla.qk_rope_head_dim, chunk, max_prefix)
                else:
                    built += build_plans(shard.num_heads, shard.num_kv_heads, shard.head_dim, chunk, max_prefix,
                                         self.config.torch_dtype, self.device)
        except RuntimeError as error:  # NOTE: out of memory, say: the plans are then built on first use, ~40 ms each
            log.warning("the prefill attention plans were not built ahead: %s", error)
            return 0
        log.info("built %d fused prefill attention plans", built)
        return built

    def _kv_cache(self, num_pages: int, dtype: torch.dtype, device: torch.device) -> KVCache:
        return KVCache(self.model.shard_config, num_pages, self.config.page_size, dtype, device)

    @staticmethod
    def from_checkpoint(path: str | Path, config: EngineConfig) -> Engine:
        return Engine(load_causal_lm(path, config.torch_dtype, config.device), config, checkpoint_tokenizer(path))

    @property
    def device(self) -> torch.device:
        return self.kv.k.device

    # ---- sessions -------------------------------------------------------------------------------

    def session(self, session_id: str) -> Session:
        if session_id not in self.sessions:
            raise SessionNotFound(f"unknown session {session_id!r}")
        return self.sessions[session_id]

    def create_session(self, prompt: list[int], session_id: str | None = None, feature_tail: int = 0,
                       should_stop: Callable[[], bool] = _never) -> tuple[Session, torch.Tensor | None]:
        """Prefill `prompt[:-1]` into fresh pages; returns the session and the features of the last
        `feature_tail` prefilled tokens (the drafter's seed). On any error, PrefillStopped included, nothing
        stays allocated."""
        prefill = self.begin_session(prompt, session_id, feature_tail)
        return prefill.session, prefill.run(should_stop, _quiet)

    def extend_session(self, session_id: str, tokens: list[int], feature_tail: int = 0,
                       should_stop: Callable[[], bool] = _never,
                       on_progress: Callable[[int, int], None] = _quiet) -> torch.Tensor | None:
        """Append a new turn; on error (PrefillStopped included) the session is unchanged. `on_progress(done,
        total)` is told the tokens prefilled between chunks."""
        return self.begin_extend(session_id, tokens, feature_tail).run(should_stop, on_progress)

    def begin_session(self, prompt: list[int], session_id: str | None = None, feature_tail: int = 0,
                      prompt_logprobs: int | None = None) -> Prefill:
        """create_session one chunk per `advance()`: the session exists once the last chunk is in. `prompt_logprobs`:
        the prefill also scores every prompt token but the first (Prefill.logprobs) with that many alternatives."""
        session_id = session_id or secrets.token_hex(8)
        self._refuse_taken(session_id)
        if not prompt:
            raise InvalidArgument("prompt must contain at least one token")
        session = Session(session_id, [], BlockTable(self.pool, self.config.page_size))
        return self._begin_prefill(session, prompt, feature_tail, self._register, prompt_logprobs=prompt_logprobs)

    def begin_extend(self, session_id: str, tokens: list[int], feature_tail: int = 0, then_generate: int = 0,
                     prompt_logprobs: int | None = None) -> Prefill:
        """extend_session one chunk per `advance()`. `then_generate`: the new tokens of the generation that follows
        (start_generation): the pages they may take are kept free from the moment the prefill takes its own, so the
        generation can always start (no admission stands between a prompt that is in and its generation).
        `prompt_logprobs`: the prefill also scores every new token, given the session before it."""
        if not tokens:
            raise InvalidArgument("tokens must contain at least one token")
        return self._begin_prefill(self.session(session_id), tokens, feature_tail, None, then_generate,
                                   prompt_logprobs)

    def _refuse_taken(self, session_id: str) -> None:
        if session_id in self.sessions:
            raise InvalidArgument(f"session_id {session_id!r} already exists")

    def _register(self, session: Session) -> None:
        self._refuse_taken(session.session_id)  # NOTE: the id may have been taken while the prompt went in
        self.sessions[session.session_id] = session
        self._index(session)

    def _index(self, session: Session) -> None:
        """Offer the session's full pages to the prefix cache (those of its KV: `tokens[:-1]`), from where its last
        index stopped."""
        if self.prefix_cache is not None:
            # NOTE: its KV's full pages only (its last token is not in the KV): cheaper than copying up to 128k tokens
            table = session.block_table
            full = table.pages[:session.kv_len // table.page_size]
            session.indexed = self.prefix_cache.insert(session.tokens, full, session.indexed)

    def fork_session(self, session_id: str, new_id: str | None = None) -> Session:
        """A new session sharing every page of the source copy-on-write."""
        source = self.session(session_id)
        new_id = new_id or secrets.token_hex(8)
        self._refuse_taken(new_id)
        # NOTE: the source's pages are the fork's, so is how far they are indexed
        fork = Session(new_id, list(source.tokens), source.block_table.fork(), indexed=source.indexed)
        self.sessions[new_id] = fork
        return fork

    def release_session(self, session_id: str) -> None:
        self.promised.pop(session_id, None)
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self._index(session)  # NOTE: before the release, so its pages stay indexed once nobody holds them
            session.block_table.release()

    def start_generation(self, session_id: str, params: SamplingParams) -> None:
        """Start generating on the session once the KV pages its generation may take (up to max_new_tokens) are free
        beside what the other generations under way may take: NoFreePages (nothing changed) when they are not now,
        CapacityError when the cache could never hold them."""
        params.validate()
        for token in params.stop_token_ids:
            if token >= self.model_config.vocab_size:
                raise InvalidArgument(f"stop_token_ids contains {token}, outside the vocabulary")
        if params.stop_strings and self.tokenizer is None:
            raise InvalidArgument("stop_strings need a tokenizer; the checkpoint has none")
        vocab = self.model_config.vocab_size
        bad = next((token for token, _ in params.logit_bias if token >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"logit_bias: token {bad} is outside the vocabulary (0..{vocab - 1})")
        generator = None
        if not params.greedy:  # NOTE: on the host: a row's draw is one number, uploaded with the batch's
            generator = np.random.default_rng(params.seed if params.seed is not None else secrets.randbits(63))
        session = self.session(session_id)
        growth = self._growth(session, params.max_new_tokens)
        if growth > self.pool.num_pages - len(session.block_table.pages):
            raise CapacityError(f"KV cache full: {params.max_new_tokens} new tokens after {session.kv_len} need more "
                                f"pages than the cache holds ({self.pool.num_pages} pages of {self.config.page_size} "
                                "tokens)")
        promised = self.promised.pop(session_id, None)  # NOTE: its prefill kept these pages free: now they are
        if growth > self.room():
            if promised is not None:
                self.promised[session_id] = promised
            raise NoFreePages(f"KV cache full: the generation needs {growth} more pages, {self.room()} free beside "
                              "what the generations under way may take")
        decode = self.tokenizer.decode if self.tokenizer else None
        stop = StopChecker(params, self.model_config.eos_token_ids, decode)
        # NOTE: the prompt of a generation is everything before it: earlier turns and their outputs too
        adjustment = self.penalties.adjustment(params, session.tokens) if params.adjusts_logits else None
        session.generation = Generation(params, stop, generator, adjustment)

    def end_generation(self, session_id: str) -> None:
        """The session's generation is over (stopped, or its caller went away, maybe before it started): its growth
        is no longer owed."""
        self.promised.pop(session_id, None)
        session = self.sessions.get(session_id)
        if session is not None:
            session.generation = None

    def pages_owed(self) -> int:
        """Pages the generations under way may still take beyond those they hold (each to its max_new_tokens; a
        step's tree never reaches past that): prompts and new generations wait until they fit beside these (the
        verifier's admission queue), so a generation under way never finds the cache full."""
        # NOTE: copies first: the service's Info reads this on the event loop while the engine thread works
        sessions, promised = dict(self.sessions), list(self.promised.items())
        running = sum(self._growth(s, s.generation.stop.max_new_tokens - len(s.generation.stop.generated))
                      for s in sessions.values() if s.generation is not None)
        tables = [(sessions[sid].block_table, end) for sid, end in promised if sid in sessions]
        return running + sum(max(0, table.pages_for(end) - len(table.pages)) for table, end in tables)

    def room(self) -> int:
        """Free pages that no generation under way may claim."""
        return self.pool.num_free - self.pages_owed()

    def _growth(self, session: Session, new_tokens: int) -> int:
        """New pages that `new_tokens` more positions take (a fork's copy of a shared page they write into too)."""
        end = min(session.kv_len + new_tokens, self.max_context)  # NOTE: a step's tree stops there too (_check_tree)
        return session.block_table.pages_needed(session.kv_len, max(end, session.kv_len))

    # ---- prefill --------------------------------------------------------------------------------

    def _begin_prefill(self, session: Session, new_tokens: list[int], feature_tail: int,
                       register: Callable[[Session], None] | None, then_generate: int = 0,
                       prompt_logprobs: int | None = None) -> Prefill:
        """Check the tokens, and that their pages would fit in a cache that held this session alone (whether they
        fit now is `Prefill.reserve`'s question: the first chunk takes them)."""
        vocab = self.model_config.vocab_size
        bad = next((t for t in new_tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"prompt token {bad} is outside the vocabulary [0, {vocab})")
        if prompt_logprobs is not None and not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidArgument(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}")
        grows_to = min(len(session.tokens) + len(new_tokens) - 1 + then_generate, self.max_context)
        prefill = Prefill(session, new_tokens, feature_tail, self.prefill_chunk, self.kv, self._prefill_chunk, register,
                          self.room, grows_to, self.promised, prompt_logprobs, self._cached_pages)
        if len(prefill.tokens) > self.max_context:
            raise InvalidArgument(f"prompt of {len(prefill.tokens)} tokens exceeds max_context {self.max_context}")
        if prefill.pages_to_keep > self.pool.num_pages - len(session.block_table.pages):
            raise CapacityError(f"KV cache full: a prompt of {len(prefill.tokens)} tokens"
                                + (f" and {then_generate} new tokens" if then_generate else "")
                                + f" need more pages than the cache holds ({self.pool.num_pages} pages of "
                                f"{self.config.page_size} tokens)")
        return prefill

    def _cached_pages(self, table: BlockTable, tokens: list[int], start: int, feature_tail: int) -> list[int]:
        """Cached pages that continue `table` over the full pages of `tokens` (a session's tokens with those a
        prefill adds; the table holds positions [0, start)), short of the positions the prefill must compute
        itself: the last token's (the pending root) and the drafter's seed features (`feature_tail`). None when
        the table's last page is partial, or its pages are not the cached run of its tokens."""
        held = len(table.pages)
        if self.prefix_cache is None or start != held * table.page_size:
            return []
        matched = self.prefix_cache.match(tokens, max(0, len(tokens) - 1 - feature_tail) // table.page_size)
        return matched[held:] if matched[:held] == table.pages else []

    def _prefill_chunk(self, block_table: BlockTable, tokens: list[int], start: int, end: int,
                       logprobs: int | None = None) -> tuple[torch.Tensor | None, list[TokenLogprob] | None]:
        """Positions [start, end) into the pages; returns their target features, and with `logprobs` (alternatives)
        the logprobs of the tokens their rows predict, tokens[start + 1:end + 1]."""
        hidden, features = self.forward([BlockSpec.chain(start, tokens[start:end], block_table.pages)])
        if not self._takes_prefill_path(end - start):  # NOTE: the prefill path writes its K/V to the pages itself
            self.commit(list(range(end - start)), [block_table.slot(position) for position in range(start, end)])
        if logprobs is None:
            return features, None
        return features, self.prompt_logprobs(hidden, tokens[start + 1:end + 1], logprobs)

    def prompt_logprobs(self, hidden: torch.Tensor, targets: list[int], width: int) -> list[TokenLogprob]:
        """The logprobs of `targets`, the tokens that `hidden`'s rows predict, with their ranks and `width`
        alternatives: the logits of `prompt_logprob_rows` rows at a time (a long prompt's [rows, V] logits would not
        fit), each slice read back once."""
        rows = self.config.prompt_logprob_rows
        predicted = torch.tensor(targets, device=self.device)
        scored: list[TokenLogprob] = []
        for lo in range(0, len(targets), rows):
            span = (lo, min(lo + rows, len(targets)))
            scored += ranked_logprobs(self.logits(hidden, [span]), predicted[span[0]:span[1]], width)
        return scored

    def _takes_prefill_path(self, rows: int) -> bool:
        """Whether a block of one session with this many rows is a prefill chunk rather than a verify block."""
        return rows > self.verify_block_tokens

    # ---- the operations on the model and the KV tensors (a tensor-parallel rank 0 mirrors each to its peers) --

    def forward(self, blocks: list[BlockSpec], input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over packed verify blocks: their K/V go to the tree scratch, never the pages. A block
        longer than any tree is a prefill chunk: it runs eagerly through the prefill path. `input_ids`: the rows'
        tokens already on the device (a decode burst's last choices), in place of the blocks' own."""
        if len(blocks) == 1 and self._takes_prefill_path(len(blocks[0].tokens)):
            chunk = build_prefill_chunk(blocks[0], self.config.page_size, self.device)
            return self._forward(chunk, PagedPrefillAttention)
        replayed = self.graphs.run(blocks, self.feature_layers, input_ids) if self.graphs is not None else None
        if replayed:
            return replayed
        batch = build_verify_batch(blocks, self.device)
        return self._forward(batch if input_ids is None else dataclasses.replace(batch, input_ids=input_ids))

    @torch.inference_mode()
    def _forward(self, batch: VerifyBatch | PrefillChunk, attention: type[PagedVerifyAttention] = PagedVerifyAttention
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attend = attention(self.backend, self.kv, self.scratch, batch, self.sm_scale, self.value_dim)
        return self.model(batch.input_ids, batch.positions, attend, self.feature_layers)

    def head(self, hidden: torch.Tensor, greedy: bool) -> torch.Tensor:
        """[N] argmax tokens when `greedy` (no full logits needed: the vocab may be sharded), else [N, V] logits."""
        return self.model.greedy_tokens(hidden) if greedy else self.model.logits(hidden)

    def logits(self, hidden: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """[R, V] fp32 logits of the rows in `spans` ([lo, hi) ranges of `hidden`'s rows) alone: the logprobs of the
        sessions of a greedy batch that ask for them (its head computes argmaxes only)."""
        return self.model.logits(_rows(hidden, spans))

    def commit(self, src_rows: list[int], dst_slots: list[int]) -> torch.Tensor:
        """Copy tree-scratch rows into page slots, in every layer -> the rows as uploaded ([2, N] on the device:
        src_rows, dst_slots), for whatever else gathers the same rows."""
        rows = upload([src_rows, dst_slots], torch.int64, self.device)
        self.backend.commit(self.kv, self.scratch, rows[0], rows[1])
        return rows

    # ---- the speculative step ---------------------------------------------------------------------

    def _check_tree(self, session: Session, tree: DraftTree) -> DraftTree:
        tree.validate(self.model_config.vocab_size, self.config.max_tree_nodes)
        if session.generation is None:
            raise InvalidArgument("the session has no generation in progress")
        room = self.max_context - len(session.tokens)
        if room < 1:
            raise InvalidArgument(f"the session holds {len(session.tokens)} tokens: the model's context of "
                                 f"{self.max_context} is full")
        # NOTE: the next root needs one position too; a deeper node than the tokens the generation may still emit
        # could never be emitted, and the pages for it were not kept free (pages_owed)
        left = session.generation.stop.max_new_tokens - len(session.generation.stop.generated)
        return tree.truncated(min(room, left) - 1)

    def _choose(self, hidden: torch.Tensor, generations: list[Generation], blocks: list[BlockSpec],
                offsets: list[int]) -> tuple[torch.Tensor, RowLogprobs | None]:
        """The target's own token at every verify row ([N], on the device), and the logprobs at the rows of the
        sessions that ask for them (None when none does: then nothing is computed beyond the tokens); session i
        has the rows of blocks[i], offsets[i]:offsets[i + 1] (_offsets). Unless every session takes the plain argmax,
        the head computes the full logits and each session's rows are adjusted (penalties.py) and chosen on their
        own."""
        argmax = all(g.params.raw_argmax for g in generations)
        chosen = self.head(hidden, argmax)  # [N] tokens, or [N, V] logits
        tokens = chosen if argmax else self._sample(chosen, generations, blocks, offsets)
        asks = [g.params.logprobs for g in generations]
        spans = asking_spans(asks, offsets)
        if not spans:
            return tokens, None
        logits = self.logits(hidden, spans) if argmax else _rows(chosen, spans)  # NOTE: raw, never adjusted
        return tokens, RowLogprobs.of(logits, _rows(tokens, spans), max(a for a in asks if a is not None))

    def _sample(self, logits: torch.Tensor, generations: list[Generation], blocks: list[BlockSpec],
                offsets: list[int]) -> torch.Tensor:
        """Every row's token, all sessions' rows at once: each session's rows adjusted (penalties.py), then chosen
        with its settings and its own draws (sampling.choose_tokens). `logits` stay raw, for the logprobs."""
        adjusted = [AdjustedRows(g.adjustment, b.tokens, b.parent_rows, lo)
                    for g, b, lo in zip(generations, blocks, offsets) if g.adjustment is not None]
        if adjusted:
            logits = adjust(logits, adjusted)
        counts = [hi - lo for lo, hi in zip(offsets, offsets[1:])]
        rows = RowSampling.of([g.params for g in generations], counts, logits.shape[-1], logits.device)
        draws = np.concatenate([g.generator.random(n, dtype=np.float32) if g.generator is not None
                                else np.zeros(n, dtype=np.float32) for g, n in zip(generations, counts)])
        return choose_tokens(logits, rows, upload(draws, torch.float32, logits.device))

    def _distinct_sessions(self, session_ids: list[str]) -> list[Session]:
        sessions = [self.session(sid) for sid in session_ids]
        if len({s.session_id for s in sessions}) != len(sessions):
            raise InvalidArgument("a session appears twice in one step")
        return sessions

    def _reserve(self, sessions: list[Session], positions: list[int]) -> None:
        """Make the next `positions[i]` positions of session i writable, or raise with nothing reserved."""
        needed = sum(s.block_table.pages_needed(s.kv_len, s.kv_len + n) for s, n in zip(sessions, positions))
        if not self.pool.can_allocate(needed):
            raise CapacityError(f"KV cache full: the step needs {needed} pages, {self.pool.num_free} free")
        for s, n in zip(sessions, positions):
            s.block_table.prepare_write(s.kv_len, s.kv_len + n, self.kv)

    def _targets(self, hidden: torch.Tensor, generations: list[Generation], blocks: list[BlockSpec],
                 offsets: list[int]) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """The target's own token at every verify row, per session, and the logprobs at every row of those that
        ask for them."""
        tokens, logprobs = self._choose(hidden, generations, blocks, offsets)
        sizes = [hi - lo for lo, hi in zip(offsets, offsets[1:])]
        # NOTE: one copy to the host for the batch
        tokens, per_session = read_back(tokens, logprobs, [g.params.logprobs for g in generations], sizes)
        return [tokens[lo:hi] for lo, hi in zip(offsets, offsets[1:])], per_session

    def step(self, work: list[tuple[str, DraftTree]]) -> list[StepResult]:
        """Verify each session's tree in one batched forward, accept, commit. All trees are validated
        and all pages reserved before anything runs: on error no session changes."""
        sessions = self._distinct_sessions([sid for sid, _ in work])
        trees = [self._check_tree(s, tree) for s, (_, tree) in zip(sessions, work)]
        if sum(len(t) + 1 for t in trees) > self.config.max_batch_tokens:
            raise InvalidArgument(f"the step's trees exceed max_batch_tokens {self.config.max_batch_tokens}")
        self._reserve(sessions, [t.max_depth() + 1 for t in trees])

        blocks = [BlockSpec.from_tree(s.kv_len, s.root, t, s.block_table.pages) for s, t in zip(sessions, trees)]
        hidden, features = self.forward(blocks)
        offsets = _offsets(blocks)
        targets, logprobs = self._targets(hidden, [s.generation for s in sessions], blocks, offsets)

        results, src_rows, dst_slots, counted = [], [], [], []
        for s, tree, (_, drafted), lo, session_targets, row_logprobs in zip(sessions, trees, work, offsets, targets,
                                                                            logprobs):
            generation = s.generation
            path, next_root = accept_path(tree, session_targets)
            drafted_path = path if tree is drafted else [drafted.kept(tree.max_depth())[i] for i in path]
            emitted, reason = generation.stop.feed([tree.tokens[i] for i in path] + [next_root])
            if generation.adjustment is not None:
                counted.append((generation.adjustment, emitted))
            # NOTE: KV keeps tokens[:-1], so the root and all emitted tokens but the last are committed; these are
            # also the rows that chose the emitted tokens, one each
            rows = [lo] + [lo + 1 + i for i in path[: len(emitted) - 1]]
            start = s.kv_len
            src_rows += rows
            dst_slots += [s.block_table.slot(start + j) for j in range(len(rows))]
            s.tokens += emitted
            if reason is None and len(s.tokens) >= self.max_context:
                reason = StopReason.CONTEXT_LIMIT
            results.append(StepResult(
                session_id=s.session_id,
                accepted=[tree.tokens[i] for i in path],
                path=drafted_path,
                emitted=emitted,
                commit_start=start,
                committed=[s.tokens[start + j] for j in range(len(rows))],
                features=None,
                finished=reason,
                logprobs=None if row_logprobs is None else [row_logprobs[row - lo] for row in rows],
            ))
        count(counted)
        rows = self.commit(src_rows, dst_slots)
        if features is not None:  # NOTE: one gather for the batch (the commit's upload), split into views per session
            per_session = features[rows[0]].split([len(r.committed) for r in results])
            results = [dataclasses.replace(r, features=f) for r, f in zip(results, per_session)]
        for s in sessions:
            s.block_table.truncate(s.kv_len)  # give back pages reserved for deeper paths
        return results


    # ---- plain decoding, several steps per call ---------------------------------------------------------------

    def burst_length(self, session_ids: list[str], wanted: int) -> int:
        """The plain steps a `decode` of these sessions runs: at most `wanted`, and none that every session would
        throw away (past its context room, or past its last token)."""
        sessions = [self.session(sid) for sid in session_ids]
        if any(s.generation is None for s in sessions):
            return 1
        room = min(self.max_context - len(s.tokens) for s in sessions)
        left = max(s.generation.stop.max_new_tokens - len(s.generation.stop.generated) for s in sessions)
        return max(1, min(wanted, room, left))

    def decode(self, session_ids: list[str], steps: int) -> list[StepResult]:
        """`steps` plain decoding steps of the sessions in one call (vLLM's multi-step scheduling): each step's
        tokens feed the next on the device, and the host reads them back once, so one step's host work (batch
        upload, read-back, stop checks, the loop's hand-over) serves several. Each session gets one result with
        up to `steps` tokens, cut at its stop; rows computed past a stop lie beyond its KV length and are
        overwritten later. Tokens are exactly those of `steps` calls of `step` with empty trees. All sessions
        are checked and their pages reserved first: on error none changes."""
        sessions = self._distinct_sessions(session_ids)
        for s in sessions:
            self._check_tree(s, DraftTree.empty())
        if steps < 1 or steps > min(self.max_context - len(s.tokens) for s in sessions):
            raise InvalidArgument(f"a decode burst of {steps} steps does not fit every session's context")
        self._reserve(sessions, [steps] * len(sessions))

        generations, rows = [s.generation for s in sessions], list(range(len(sessions)))
        offsets = [*rows, len(rows)]  # NOTE: one row a session
        counts = BurstCounts.of([(row, g.adjustment) for row, g in enumerate(generations) if g.adjustment is not None])
        ids, chosen, features, logprobs = None, [], [], []
        for offset in range(steps):
            # NOTE: the first step's tokens are the roots; later ones are the last step's choices, on the device
            blocks = [BlockSpec.chain(s.kv_len + offset, [s.root if ids is None else 0], s.block_table.pages)
                      for s in sessions]
            hidden, step_features = self.forward(blocks, ids)
            ids, step_logprobs = self._choose(hidden, generations, blocks, offsets)
            if counts is not None:  # NOTE: each step's choice counts for the next, on the device
                counts.count(ids)
            self.commit(rows, [s.block_table.slot(s.kv_len + offset) for s in sessions])
            chosen.append(ids)
            features.append(step_features)
            logprobs.append(step_logprobs)
        stacked = None if logprobs[0] is None else RowLogprobs.stacked(logprobs)  # each asking session's steps
        asks = [g.params.logprobs for g in generations]
        # NOTE: the burst's one wait for the GPU
        tokens, per_session = read_back(torch.stack(chosen, dim=1), stacked, asks, [steps] * len(sessions))
        per_row = None if features[0] is None else torch.stack(features, dim=1)  # [B, steps, F]

        results = []
        for row, (s, session_tokens, session_logprobs) in enumerate(zip(sessions, tokens, per_session)):
            emitted, reason = s.generation.stop.feed(session_tokens)
            start, committed = s.kv_len, [s.root, *emitted[:-1]]
            s.tokens += emitted
            if reason is None and len(s.tokens) >= self.max_context:
                reason = StopReason.CONTEXT_LIMIT
            results.append(StepResult(
                session_id=s.session_id, accepted=[], path=[], emitted=emitted, commit_start=start,
                committed=committed, features=None if per_row is None else per_row[row, : len(committed)],
                finished=reason, logprobs=None if session_logprobs is None else session_logprobs[: len(emitted)]))
            s.block_table.truncate(s.kv_len)
        return results


def _offsets(blocks: list[BlockSpec]) -> list[int]:
    """Where each block's rows start in the packed batch, and where the last ends."""
    return [0, *itertools.accumulate(len(b.tokens) for b in blocks)]


def _rows(tensor: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The rows of `tensor` in `spans` ([lo, hi) ranges), in order: slices, so no index is uploaded."""
    return torch.cat([tensor[lo:hi] for lo, hi in spans])


def checkpoint_tokenizer(path: str | Path) -> Tokenizer | None:
    return Tokenizer.from_dir(path) if (Path(path) / "tokenizer.json").is_file() else None
