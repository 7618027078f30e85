"""PagePool on its own: allocation, reference counts for forks, running out, double frees."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from verifier_service.engine import page_pool
from verifier_service.engine.page_pool import PagePool

# NOTE: taken from the module under test, so these tests follow the error class wherever it is defined.
CapacityError = page_pool.CapacityError


def test_a_fresh_pool_hands_out_every_page_once():
    pool = PagePool(5)
    assert pool.num_free == 5
    first = pool.allocate(2)
    rest = pool.allocate(3)
    assert sorted(first + rest) == [0, 1, 2, 3, 4]
    assert pool.num_free == 0
    assert not any(pool.is_shared(page) for page in first + rest)


def test_allocating_nothing_takes_nothing():
    pool = PagePool(3)
    assert pool.allocate(0) == []
    assert pool.num_free == 3


def test_can_allocate_is_exact_at_the_boundary():
    pool = PagePool(4)
    pool.allocate(1)
    assert pool.can_allocate(3)
    assert not pool.can_allocate(4)


def test_running_out_raises_and_allocates_nothing():
    pool = PagePool(4)
    held = pool.allocate(3)
    with pytest.raises(CapacityError, match="2 pages needed, 1 free of 4"):
        pool.allocate(2)
    assert pool.num_free == 1  # NOTE: a failed allocation takes no page at all
    assert pool.allocate(1) not in held


def test_released_pages_are_handed_out_again():
    pool = PagePool(3)
    pages = pool.allocate(3)
    pool.release(pages[1:])
    assert pool.num_free == 2
    assert sorted(pool.allocate(2)) == sorted(pages[1:])
    assert pool.num_free == 0


@pytest.mark.parametrize("owners", [2, 3])
def test_a_shared_page_is_freed_only_by_its_last_owner(owners):
    pool = PagePool(2)
    pages = pool.allocate(1)
    for _ in range(owners - 1):
        pool.share(pages)
    assert pool.is_shared(pages[0])

    for _ in range(owners - 1):
        pool.release(pages)
        assert pool.num_free == 1  # another owner still holds it
    assert not pool.is_shared(pages[0])

    pool.release(pages)
    assert pool.num_free == 2
    assert not any(pool.is_shared(page) for page in pool.allocate(2))  # handed out again, to one owner


def test_releasing_a_free_page_is_refused():
    pool = PagePool(2)
    pages = pool.allocate(1)
    pool.release(pages)
    with pytest.raises(AssertionError, match=f"page {pages[0]} released twice"):
        pool.release(pages)
    assert pool.num_free == 2  # the free list holds the page once, not twice


def test_releasing_a_never_allocated_page_is_refused():
    pool = PagePool(2)
    with pytest.raises(AssertionError, match="released twice"):
        pool.release([1])
    assert pool.num_free == 2


def test_num_free_follows_a_random_history_of_owners():
    """Against a plain model: a page is free exactly when no owner holds it."""
    rng = random.Random(0)
    pool = PagePool(16)
    owners: Counter[int] = Counter()  # page -> number of holders
    for _ in range(2000):
        held = sorted(owners.elements())
        action = rng.choice(["allocate", "share", "release"])
        if action == "allocate":
            count = rng.randrange(0, 5)
            if pool.can_allocate(count):
                new = pool.allocate(count)
                assert not set(new) & set(owners), "a held page was handed out again"
                owners.update(new)
            else:
                assert count > 16 - len(owners)
                with pytest.raises(CapacityError):
                    pool.allocate(count)
        elif held:
            page = rng.choice(held)
            if action == "share":
                pool.share([page])
                owners[page] += 1
            else:
                pool.release([page])
                owners[page] -= 1
                owners += Counter()  # drop pages nobody holds
        assert pool.num_free == 16 - len(owners)
        assert all(pool.is_shared(p) == (n > 1) for p, n in owners.items())
