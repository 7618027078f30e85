"""BlockTable on its own: page growth across boundaries, slots, rollback, forks and copy-on-write."""

from __future__ import annotations

import pytest
import torch

from modeling.config import ModelConfig, RopeConfig
from verifier_service.engine.block_table import BlockTable
from verifier_service.engine.kv_cache import KVCache
from verifier_service.engine.page_pool import PagePool

P = 4  # tokens per page
NUM_PAGES = 8
MODEL = ModelConfig(architecture="Qwen3ForCausalLM", vocab_size=32, hidden_size=8, intermediate_size=16,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope=RopeConfig(),
                    max_position_embeddings=64)


@pytest.fixture
def pool() -> PagePool:
    return PagePool(NUM_PAGES)


@pytest.fixture
def kv() -> KVCache:
    cache = KVCache(MODEL, NUM_PAGES, P, torch.float32, "cpu")
    # every element distinct, so a copied page can be told from any other
    cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view_as(cache.k))
    cache.v.copy_(-cache.k)
    return cache


def write(table: BlockTable, start: int, end: int, kv: KVCache) -> int:
    """Check, then commit, as the engine does; returns the pages the write took."""
    needed = table.pages_needed(start, end)
    assert table.pool.can_allocate(needed)
    free = table.pool.num_free
    table.prepare_write(start, end, kv)
    assert free - table.pool.num_free == needed, "pages_needed must be what prepare_write takes"
    return needed


@pytest.mark.parametrize(("tokens", "pages"), [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_pages_for_rounds_up(pool, tokens, pages):
    assert BlockTable(pool, P).pages_for(tokens) == pages


def test_a_write_grows_the_table_to_cover_its_last_position(pool, kv):
    table = BlockTable(pool, P)
    assert write(table, 0, 6, kv) == 2
    assert len(table.pages) == 2
    assert pool.num_free == NUM_PAGES - 2


def test_a_write_inside_held_pages_takes_nothing(pool, kv):
    table = BlockTable(pool, P)
    write(table, 0, 8, kv)
    assert table.pages_needed(5, 8) == 0
    pages = list(table.pages)
    assert write(table, 5, 8, kv) == 0
    assert table.pages == pages


def test_a_write_across_a_page_boundary_adds_one_page(pool, kv):
    table = BlockTable(pool, P)
    write(table, 0, 4, kv)  # page 0 is full
    assert table.pages_needed(3, 5) == 1
    assert write(table, 3, 5, kv) == 1
    assert len(table.pages) == 2


def test_slot_is_page_times_page_size_plus_offset(pool):
    table = BlockTable(pool, P, pages=[5, 2])
    assert [table.slot(p) for p in range(8)] == [20, 21, 22, 23, 8, 9, 10, 11]


def test_truncate_gives_back_whole_pages_past_the_kept_positions(pool, kv):
    table = BlockTable(pool, P)
    write(table, 0, 12, kv)
    slots = [table.slot(p) for p in range(12)]

    table.truncate(5)  # position 4 still needs page 1
    assert len(table.pages) == 2
    assert pool.num_free == NUM_PAGES - 2
    assert [table.slot(p) for p in range(5)] == slots[:5]

    table.truncate(4)
    assert len(table.pages) == 1
    assert pool.num_free == NUM_PAGES - 1

    table.truncate(4)  # nothing past it: no change
    assert len(table.pages) == 1


def test_rolling_back_a_reservation_for_a_deep_tree(pool, kv):
    """A step reserves room for the deepest path, then keeps only what the accepted path used."""
    table = BlockTable(pool, P)
    write(table, 0, 4, kv)
    write(table, 4, 4 + 7, kv)  # a tree 6 deep + its root
    assert len(table.pages) == 3
    table.truncate(6)  # two tokens accepted
    assert len(table.pages) == 2
    assert pool.num_free == NUM_PAGES - 2


def test_release_returns_every_page(pool, kv):
    table = BlockTable(pool, P)
    write(table, 0, 10, kv)
    table.release()
    assert table.pages == []
    assert pool.num_free == NUM_PAGES


def test_a_fork_shares_every_page_and_takes_none(pool, kv):
    parent = BlockTable(pool, P)
    write(parent, 0, 6, kv)
    child = parent.fork()
    assert child.pages == parent.pages
    assert child.pages is not parent.pages
    assert all(pool.is_shared(page) for page in parent.pages)
    assert pool.num_free == NUM_PAGES - 2


def test_writing_into_a_shared_page_copies_it(pool, kv):
    parent = BlockTable(pool, P)
    write(parent, 0, 6, kv)  # pages 0 (full) and 1 (positions 4, 5)
    child = parent.fork()
    before_k, before_v = kv.k[:, parent.pages].clone(), kv.v[:, parent.pages].clone()

    assert child.pages_needed(6, 9) == 2  # a copy of page 1, and page 2 for position 8
    assert write(child, 6, 9, kv) == 2

    assert child.pages[0] == parent.pages[0]  # untouched by the write: still shared
    assert pool.is_shared(parent.pages[0])
    assert child.pages[1] != parent.pages[1]
    assert not pool.is_shared(parent.pages[1])
    assert torch.equal(kv.k[:, child.pages[1]], before_k[:, 1])  # the copy holds the parent's K/V
    assert torch.equal(kv.v[:, child.pages[1]], before_v[:, 1])
    assert torch.equal(kv.k[:, parent.pages], before_k)  # and the parent's pages are as they were
    assert torch.equal(kv.v[:, parent.pages], before_v)


def test_writing_past_the_shared_pages_copies_nothing(pool, kv):
    parent = BlockTable(pool, P)
    write(parent, 0, 8, kv)  # two full pages
    child = parent.fork()
    assert child.pages_needed(8, 10) == 1
    write(child, 8, 10, kv)
    assert child.pages[:2] == parent.pages
    assert all(pool.is_shared(page) for page in parent.pages)


def test_the_parent_writing_into_a_shared_page_copies_it_too(pool, kv):
    parent = BlockTable(pool, P)
    write(parent, 0, 6, kv)
    child = parent.fork()
    assert write(parent, 6, 7, kv) == 1
    assert parent.pages[1] != child.pages[1]
    assert parent.pages[0] == child.pages[0]


def test_releasing_a_fork_frees_only_what_nobody_else_holds(pool, kv):
    parent = BlockTable(pool, P)
    write(parent, 0, 6, kv)
    child = parent.fork()
    write(child, 6, 9, kv)  # child owns a copy of page 1 and a new page 2
    assert pool.num_free == NUM_PAGES - 4

    child.release()
    assert pool.num_free == NUM_PAGES - 2  # the two pages only the child held
    assert not any(pool.is_shared(page) for page in parent.pages)

    parent.release()
    assert pool.num_free == NUM_PAGES


def test_truncating_a_fork_keeps_the_parent_pages(pool, kv):
    parent = BlockTable(pool, P)
    write(parent, 0, 8, kv)
    child = parent.fork()
    child.truncate(3)
    assert len(child.pages) == 1
    assert pool.num_free == NUM_PAGES - 2  # page 1 is still the parent's
    assert pool.is_shared(parent.pages[0])
    assert not pool.is_shared(parent.pages[1])


def test_pages_needed_counts_against_the_pool_before_anything_is_taken(pool, kv):
    """The check half of check-then-commit: a write that does not fit is seen before it starts."""
    table = BlockTable(pool, P)
    write(table, 0, 4 * (NUM_PAGES - 1), kv)
    assert table.pages_needed(4 * (NUM_PAGES - 1), 4 * NUM_PAGES + 1) == 2
    assert not pool.can_allocate(2)
