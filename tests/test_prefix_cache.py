"""Automatic prefix caching: the index alone, the pool's evictable pages, an engine whose sessions start from
pages other sessions left behind, with every output equal to an engine that computes everything itself, and the
real stack (gateway, verifier, drafter as processes) reporting what its cache held."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ddtree.client import Client
from ddtree.local_stack import LocalStack, free_port
from modeling.tree import DraftTree
from tests.engine_helpers import GREEDY, make_engine, run_to_end
from tests.stack_helpers import verifier_metric
from verifier_service.engine.page_pool import PagePool
from verifier_service.engine.prefix_cache import PrefixCache
from verifier_service.engine.sampling import SamplingParams
from verifier_service.errors import CapacityError, PrefillStopped
from verifier_service.server import build_parser

P = 4  # page size of the index-only tests


def tokens_of(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(length)]


# ---- the index ----------------------------------------------------------------------------------------------


def test_a_match_is_the_longest_run_of_full_pages_from_the_first():
    cache = PrefixCache(P)
    cache.insert(list(range(10)), [7, 8, 9])  # NOTE: two full pages; the third holds 2 of 4 positions
    assert len(cache) == 2
    assert cache.match(list(range(12)), max_pages=3) == [7, 8]
    assert cache.match(list(range(12)), max_pages=1) == [7]
    assert cache.match([0, 1, 2, 3, 4, 5, 6, 99], max_pages=2) == [7]  # the second page differs
    assert cache.match([1, 1, 2, 3, 4, 5, 6, 7], max_pages=2) == []  # so does the first


def test_a_page_matches_only_after_the_pages_it_followed():
    cache = PrefixCache(P)
    cache.insert([0, 0, 0, 0, 5, 6, 7, 8], [1, 2])
    # NOTE: the same tokens at the same place after another first page: other K/V
    assert cache.match([9, 9, 9, 9, 5, 6, 7, 8], max_pages=2) == []


def test_an_indexed_run_is_not_indexed_twice_and_a_copy_chains_on_the_first():
    cache = PrefixCache(P)
    cache.insert(list(range(8)), [1, 2])
    cache.insert(list(range(12)), [5, 6, 3])  # NOTE: pages 5 and 6 hold what 1 and 2 do
    assert len(cache) == 3 and not cache.holds(5)
    assert cache.match(list(range(12)), max_pages=3) == [1, 2, 3]


def test_after_its_parent_is_forgotten_a_child_is_unreachable_until_indexed_again():
    cache = PrefixCache(P)
    cache.insert(list(range(8)), [1, 2])
    cache.forget(1)
    assert cache.match(list(range(8)), max_pages=2) == []
    cache.insert(list(range(8)), [4, 2])  # NOTE: page 2 again, behind a new entry for the first page
    assert cache.match(list(range(8)), max_pages=2) == [4, 2]


def test_an_insert_resumed_where_the_last_stopped_keys_only_the_new_pages_and_indexes_as_a_full_one(monkeypatch):
    tokens = tokens_of(50, seed=20)  # NOTE: 12 full pages, 2 positions of a thirteenth
    resumed, full = PrefixCache(P), PrefixCache(P)
    for cache in (resumed, full):
        cache.insert(tokens[:8], [20, 21])  # NOTE: another sequence's, holding what its pages 0 and 1 do
    built = []
    keys = resumed._keys

    def counting(*args):
        made = keys(*args)
        built.append(len(made))
        return made

    monkeypatch.setattr(resumed, "_keys", counting)
    since = resumed.insert(tokens[:30], list(range(8)))
    assert since == full.insert(tokens[:30], list(range(8)))
    assert since.pages == 7 and [page for page, _ in since.borrowed] == [20, 21] and built == [7]
    built.clear()
    assert resumed.insert(tokens, list(range(13)), since) == full.insert(tokens, list(range(13)))
    assert built == [5]  # NOTE: pages 7-11
    assert (resumed._entry, resumed._page_of) == (full._entry, full._page_of)
    assert resumed.match(tokens, 13) == [20, 21, *range(2, 12)]


def test_an_insert_resumed_after_an_entry_it_borrowed_was_evicted_indexes_from_the_first_page():
    """The sequence's own pages chain on another's entries; once one of them is evicted, resuming where the last
    insert stopped would leave the new pages under an entry no match reaches: it indexes as a full insert does."""
    tokens = tokens_of(24, seed=22)  # NOTE: 6 full pages
    resumed, full = PrefixCache(P), PrefixCache(P)
    for cache in (resumed, full):
        cache.insert(tokens[:12], [20, 21, 22])
    since = resumed.insert(tokens[:16], [0, 1, 2, 3])  # NOTE: pages 0-2 hold what 20-22 do: 3 chains on 22
    full.insert(tokens[:16], [0, 1, 2, 3])
    assert [page for page, _ in since.borrowed] == [20, 21, 22]
    for cache in (resumed, full):
        cache.forget(21)  # NOTE: one in the middle: the chain's last entry, and page 3's, are still indexed
    assert resumed.insert(tokens, list(range(6)), since) == full.insert(tokens, list(range(6)))
    assert (resumed._entry, resumed._page_of) == (full._entry, full._page_of)
    assert resumed.match(tokens, 6) == [20, 1, 2, 3, 4, 5]


# ---- the pool ------------------------------------------------------------------------------------------------


def test_released_indexed_pages_count_as_free_and_go_least_recently_released_first():
    cache = PrefixCache(P)
    pool = PagePool(4, cache)
    pages = pool.allocate(3)
    cache.insert(list(range(12)), pages)
    pool.release(pages[2:])
    pool.release(pages[:2])
    assert pool.num_free == 4 and len(pool.free_pages) == 1
    assert pool.allocate(2) == [3, pages[2]]  # NOTE: the free page, then the first released
    assert cache.match(list(range(12)), 3) == pages[:2]
    assert not cache.holds(pages[2])
    (evicted,) = pool.allocate(1)
    assert evicted == pages[0] and cache.match(list(range(12)), 3) == []


def test_taking_a_cached_page_holds_it_again():
    cache = PrefixCache(P)
    pool = PagePool(2, cache)
    pages = pool.allocate(2)
    cache.insert(list(range(8)), pages)
    pool.release(pages)
    pool.take(cache.match(list(range(8)), 2))
    assert pool.num_free == 0 and pool.refcount == [1, 1]
    with pytest.raises(CapacityError):
        pool.allocate(1)


# ---- the engine ----------------------------------------------------------------------------------------------


@pytest.fixture
def engines(tiny_target):
    """An engine with the prefix cache (16-token pages, 24-token chunks) and one without, counting prefilled
    positions."""
    cached, plain = make_engine(tiny_target), make_engine(tiny_target, prefix_caching=False)
    cached.prefilled = []
    forward = cached._prefill_chunk

    def counting(table, tokens, start, end, *rest):
        cached.prefilled.append((start, end))
        return forward(table, tokens, start, end, *rest)

    cached._prefill_chunk = counting
    return cached, plain


def generate(engine, prompt: list[int], params: SamplingParams = GREEDY, feature_tail: int = 0,
             keep: bool = False) -> tuple[list[int], str]:
    session, _ = engine.create_session(prompt, feature_tail=feature_tail)
    engine.start_generation(session.session_id, params)
    tokens, _ = run_to_end(engine, session.session_id, lambda _: DraftTree.empty())
    if not keep:
        engine.release_session(session.session_id)
    return tokens, session.session_id


def test_a_prompt_starts_after_the_pages_a_released_session_left_and_generates_the_same(engines) -> None:
    cached, plain = engines
    system = tokens_of(50, seed=1)  # NOTE: 3 full pages of 16, and 2 positions of a fourth
    first, second = system + tokens_of(20, seed=2), system + tokens_of(9, seed=3)
    generate(cached, first)
    cached.prefilled.clear()
    got, _ = generate(cached, second)
    assert cached.prefilled[0][0] == 48  # NOTE: positions 0-47 came from the cache
    assert got == generate(plain, second)[0]
    assert cached.pool.num_free == cached.pool.num_pages


@pytest.mark.gpu
def test_on_the_gpu_a_prompt_from_cached_pages_generates_what_a_fresh_prefill_does(tiny_target) -> None:
    """The Triton kernels and CUDA graphs read cached pages as their own (the chunks after them start where a fresh
    prefill's would: 48 is a multiple of the 24-token chunk)."""
    cuda = {"device": "cuda", "attention": "triton"}
    cached, plain = make_engine(tiny_target, **cuda), make_engine(tiny_target, prefix_caching=False, **cuda)
    system = tokens_of(50, seed=1)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    generate(cached, system + tokens_of(20, seed=2), params)
    prefill = cached.begin_session(system + tokens_of(9, seed=3))
    prefill.run(lambda: False, lambda done, total: None)
    assert prefill.cached_tokens == 48
    cached.start_generation(prefill.session.session_id, params)
    got, _ = run_to_end(cached, prefill.session.session_id, lambda _: DraftTree.empty())
    assert got == generate(plain, system + tokens_of(9, seed=3), params)[0]


def test_the_generated_tokens_of_a_turn_are_cached_for_the_next_request(engines) -> None:
    """A chat client resends the conversation: the answer's pages are found too."""
    cached, plain = engines
    prompt = tokens_of(20, seed=4)
    answer, _ = generate(cached, prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    follow_up = prompt + answer + tokens_of(7, seed=5)
    cached.prefilled.clear()
    got, _ = generate(cached, follow_up)
    assert cached.prefilled[0][0] == 48  # NOTE: 59 positions of KV held, 3 full pages
    assert got == generate(plain, follow_up)[0]


def test_the_pages_of_a_live_session_are_shared_and_both_stay_exact(engines) -> None:
    cached, plain = engines
    prompt = tokens_of(40, seed=6)
    live, _ = cached.create_session(prompt)  # NOTE: its pages are indexed once its prompt is in
    cached.prefilled.clear()
    other, _ = cached.create_session(prompt + [3, 4, 5])
    assert cached.prefilled[0][0] == 32 and other.block_table.pages[:2] == live.block_table.pages[:2]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    outputs = []
    for session in (live, other):
        cached.start_generation(session.session_id, params)
        outputs.append(run_to_end(cached, session.session_id, lambda _: DraftTree.empty())[0])
        cached.release_session(session.session_id)
    assert outputs == [generate(plain, prompt, params)[0], generate(plain, prompt + [3, 4, 5], params)[0]]
    assert cached.pool.num_free == cached.pool.num_pages


def test_a_session_chained_on_pages_evicted_while_it_lived_is_found_whole_after_its_release(engines) -> None:
    """Its prompt's logprobs make it compute every page itself: indexed after another session's with the same
    tokens, its pages chain on that one's entries, which are evicted once nobody holds them."""
    cached, _ = engines
    prompt = tokens_of(40, seed=23)
    generate(cached, prompt)
    prefill = cached.begin_session(prompt, prompt_logprobs=0)
    prefill.run(lambda: False, lambda done, total: None)
    session = prefill.session
    assert len(session.indexed.borrowed) == 2  # NOTE: its 2 full pages hold what the first session's did
    cached.pool.release(cached.pool.allocate(cached.pool.num_free))  # NOTE: evicts every page nobody holds
    cached.start_generation(session.session_id, SamplingParams(max_new_tokens=30, ignore_eos=True))
    run_to_end(cached, session.session_id, lambda _: DraftTree.empty())
    full = session.block_table.pages[:session.kv_len // 16]
    cached.release_session(session.session_id)
    assert len(full) == 4 and cached.prefix_cache.match(session.tokens, 4) == full


def test_a_fork_and_its_source_are_found_whole_after_their_release_and_generate_the_same(engines) -> None:
    """The fork starts from how far its source is indexed; the partial page they share is copied on write."""
    cached, plain = engines
    prompt = tokens_of(40, seed=24)  # NOTE: 2 full pages of 16, and a third that both write into
    source, _ = cached.create_session(prompt)
    fork = cached.fork_session(source.session_id)
    assert fork.indexed == source.indexed and source.indexed.pages == 2
    for session, seed in ((source, 1), (fork, 2)):
        params = SamplingParams(temperature=1.0, seed=seed, max_new_tokens=30, ignore_eos=True)
        cached.start_generation(session.session_id, params)
        run_to_end(cached, session.session_id, lambda _: DraftTree.empty())
    assert source.tokens[40:48] != fork.tokens[40:48]  # NOTE: their third pages differ
    for session in (source, fork):
        cached.release_session(session.session_id)
    for session in (source, fork):
        assert len(cached.prefix_cache.match(session.tokens[:-1], 5)) == 4
    follow_up = fork.tokens + tokens_of(5, seed=25)
    cached.prefilled.clear()
    got, _ = generate(cached, follow_up)
    assert cached.prefilled[0][0] == 64 and got == generate(plain, follow_up)[0]


def test_a_new_session_through_a_one_token_start_and_an_appended_prompt_finds_the_cache(engines) -> None:
    """The gateway's one-shot path: a session of the prompt's first token, the rest appended by Generate."""
    cached, _ = engines
    prompt = tokens_of(45, seed=7)
    generate(cached, prompt)
    session, _ = cached.create_session(prompt[:1])
    cached.prefilled.clear()
    prefill = cached.begin_extend(session.session_id, prompt[1:] + [9])
    prefill.run(lambda: False, lambda done, total: None)
    assert prefill.cached_tokens == 32 and cached.prefilled[0][0] == 32
    cached.release_session(session.session_id)


def test_the_drafters_seed_positions_are_always_computed(tiny_target) -> None:
    engine = make_engine(tiny_target, feature_layers=(0,))
    prompt = tokens_of(70, seed=8)
    generate(engine, prompt, feature_tail=20)
    prefill = engine.begin_session(prompt, feature_tail=20)
    features = prefill.run(lambda: False, lambda done, total: None)
    assert prefill.cached_tokens == 48 and features.shape[0] == 20  # NOTE: 69 - 20 = 49 positions: 3 full pages
    engine.release_session(prefill.session.session_id)


def test_an_aborted_prefill_gives_the_cached_pages_back(engines) -> None:
    cached, _ = engines
    prompt = tokens_of(80, seed=9)
    generate(cached, prompt)
    free = cached.pool.num_free
    with pytest.raises(PrefillStopped):
        cached.create_session(prompt + tokens_of(60, seed=10), should_stop=lambda: bool(cached.prefilled))
    assert cached.pool.num_free == free == cached.pool.num_pages and not cached.sessions
    assert all(count == 0 for count in cached.pool.refcount)


def test_cached_pages_make_room_for_new_prompts_and_outputs_stay_exact(tiny_target) -> None:
    """A cache of 8 pages: every released session leaves its pages indexed, and new prompts evict them."""
    cached = make_engine(tiny_target, kv_budget_bytes=8 * 16 * 2 * 4 * 2 * 16 * 4)
    plain = make_engine(tiny_target, prefix_caching=False)
    assert cached.pool.num_pages == 8
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = [tokens_of(60, seed=seed) for seed in range(11, 16)] + [tokens_of(60, seed=11)]
    for prompt in prompts:
        assert generate(cached, prompt, params)[0] == generate(plain, prompt, params)[0]
    assert cached.pool.num_free == 8 and len(cached.prefix_cache) <= 8


def test_without_prefix_caching_nothing_is_found(engines) -> None:
    _, plain = engines
    prompt = tokens_of(50, seed=17)
    generate(plain, prompt)
    prefill = plain.begin_session(prompt)
    prefill.run(lambda: False, lambda done, total: None)
    assert plain.prefix_cache is None and prefill.cached_tokens == 0
    plain.release_session(prefill.session.session_id)


# ---- the stack ---------------------------------------------------------------------------------------------------

SYSTEM = [1 + (i * 31) % 250 for i in range(100)]  # NOTE: 6 full pages of 16 and 4 positions of a seventh


@pytest.fixture(scope="module")
def stack(tiny_target, tmp_path_factory):
    logs = tmp_path_factory.mktemp("prefix-cache-logs")
    metrics_port = free_port()
    stack = LocalStack(str(tiny_target), "ngram", gateway_listen=f"127.0.0.1:{free_port()}", log_dir=logs,
                       verifier_args=("--page-size", "16", "--max-context", "1024", "--tree-budget", "8",
                                      "--metrics-port", str(metrics_port)))
    stack.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with stack:
        yield stack


def test_a_resent_prompt_reports_its_cached_tokens_and_answers_the_same(stack) -> None:
    import openai  # NOTE: here, so that the GPU tests of this file run where the openai client is not installed

    client = openai.OpenAI(base_url=stack.http_url, api_key="-", max_retries=0, timeout=60)

    def complete(prompt: list[int]):
        return client.completions.create(model=Path(stack.target).name, prompt=prompt, max_tokens=12,
                                         temperature=0)

    hits = verifier_metric(stack.metrics_url, "ddtree_verifier_prefix_cache_hit_tokens")
    first = complete(SYSTEM + [7, 8, 9])
    second = complete(SYSTEM + [7, 8, 9])
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96 and second.usage.prompt_tokens == 103
    assert second.choices[0].text == first.choices[0].text
    assert verifier_metric(stack.metrics_url, "ddtree_verifier_prefix_cache_hit_tokens") - hits == 96


def test_grpc_callers_see_the_cached_tokens_in_the_progress_the_summary_and_a_new_session(stack) -> None:
    client = Client(stack.addresses["gateway"], timeout=60)
    prompt = SYSTEM[:50] + [3] * 40  # NOTE: 3 full pages in common with SYSTEM, sent above or now
    list(client.generate(token_ids=SYSTEM, max_new_tokens=2))
    generation = client.generate(token_ids=prompt, max_new_tokens=4)
    progress = [event for event in generation.events() if not hasattr(event, "token_ids")]
    assert progress[-1].cached_tokens == 48 and generation.result().cached_tokens == 48
    created = client.create_session(token_ids=prompt)
    assert created.cached_tokens == 80  # NOTE: the generation just now left 5 full pages of it
    client.release_session(created.session.session)


def test_the_verifier_flag_turns_the_cache_off() -> None:
    on, off = (build_parser().parse_args(["--target", "t", *flags]) for flags in ([], ["--no-prefix-caching"]))
    assert (on.prefix_caching, off.prefix_caching) == (True, False)
