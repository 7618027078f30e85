"""The gateway's session registry and API-key check, without gRPC."""

from __future__ import annotations

import pytest

from gateway.auth import ApiKeys, key_digest
from gateway.errors import SessionForbidden, SessionNotFound, TooManySessions, Unauthenticated
from gateway.sessions import SessionRegistry

TTL = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(clock: Clock) -> SessionRegistry:
    return SessionRegistry(idle_ttl_s=TTL, max_sessions_per_key=2, clock=clock)


def test_handles_are_opaque_unique_and_map_to_the_verifier_session(registry: SessionRegistry) -> None:
    a = registry.create("alice", "verifier-0:50051", "v-1", account="alice")
    b = registry.create("alice", "verifier-1:50051", "v-1", account="alice")
    assert a.handle != b.handle and len(a.handle) >= 32
    assert "v-1" not in a.handle and "verifier" not in a.handle
    got = registry.get(b.handle, "alice")
    assert (got.verifier, got.verifier_session_id) == ("verifier-1:50051", "v-1")


def test_unknown_handle_is_not_found(registry: SessionRegistry) -> None:
    with pytest.raises(SessionNotFound, match="session"):
        registry.get("no-such-handle", "alice")


def test_another_keys_handle_is_forbidden(registry: SessionRegistry) -> None:
    entry = registry.create("alice", "v:1", "s", account="alice")
    for intruder in ("bob", None):
        with pytest.raises(SessionForbidden, match="another API key"):
            registry.get(entry.handle, intruder)
        with pytest.raises(SessionForbidden):
            registry.remove(entry.handle, intruder)
    assert registry.get(entry.handle, "alice") is entry


def test_idle_session_expires_and_is_handed_back_once(registry: SessionRegistry, clock: Clock) -> None:
    old = registry.create("alice", "v:1", "old", account="alice")
    clock.now += TTL / 2
    fresh = registry.create("alice", "v:1", "fresh", account="alice")
    clock.now += TTL / 2 + 1
    with pytest.raises(SessionNotFound):
        registry.get(old.handle, "alice")
    assert registry.expire_idle() == [old]
    assert registry.expire_idle() == []
    assert registry.get(fresh.handle, "alice") is fresh
    assert len(registry) == 1


def test_use_restarts_the_idle_timer(registry: SessionRegistry, clock: Clock) -> None:
    entry = registry.create("alice", "v:1", "s", account="alice")
    for _ in range(3):
        clock.now += TTL - 1
        registry.get(entry.handle, "alice")
    assert registry.expire_idle() == []
    assert registry.expire_idle(now=clock.now + TTL + 1) == [entry]


def test_session_in_use_never_expires(registry: SessionRegistry, clock: Clock) -> None:
    entry = registry.create("alice", "v:1", "s", account="alice")
    with registry.using(entry.handle, "alice"):
        clock.now += 10 * TTL  # a long generation
        assert registry.expire_idle() == []
        assert registry.idle_for(entry) == 0.0
    assert registry.idle_for(entry) == 0.0  # the call's end counts as use
    clock.now += TTL + 1
    assert registry.expire_idle() == [entry]


def test_too_many_sessions_per_key(registry: SessionRegistry, clock: Clock) -> None:
    first = registry.create("alice", "v:1", "a", account="alice")
    registry.create("alice", "v:1", "b", account="alice")
    assert not registry.can_create("alice")
    with pytest.raises(TooManySessions, match="2 sessions"):
        registry.create("alice", "v:1", "c", account="alice")
    assert registry.can_create("bob")  # the limit is per key
    registry.remove(first.handle, "alice")
    assert registry.can_create("alice")
    clock.now += TTL + 1  # expired sessions no longer count, even before they are collected
    assert registry.can_create("alice") and len(registry) == 1


def test_removed_handle_is_gone(registry: SessionRegistry) -> None:
    entry = registry.create(None, "v:1", "s", account=None)
    assert registry.remove(entry.handle, None) is entry
    with pytest.raises(SessionNotFound):
        registry.remove(entry.handle, None)


def test_listing_shows_only_the_owners_live_sessions(registry: SessionRegistry, clock: Clock) -> None:
    a = registry.create("alice", "v:1", "a", account="alice")
    registry.create("bob", "v:1", "b", account="bob")
    clock.now += 1
    a2 = registry.create("alice", "v:1", "a2", account="alice")
    assert registry.owned_by("alice") == [a, a2]
    assert registry.owned_by(None) == []
    clock.now += TTL
    assert registry.owned_by("alice") == [a2]


def test_registry_rejects_nonsense_limits() -> None:
    with pytest.raises(ValueError):
        SessionRegistry(idle_ttl_s=0, max_sessions_per_key=1)
    with pytest.raises(ValueError):
        SessionRegistry(idle_ttl_s=1, max_sessions_per_key=0)


def test_auth_off_lets_everyone_in_as_none() -> None:
    keys = ApiKeys()
    assert not keys.enabled
    assert keys.authenticate([]) is None
    assert keys.authenticate([("authorization", "Bearer anything")]) is None


def test_valid_key_yields_its_digest_not_the_key() -> None:
    keys = ApiKeys(["k-alice", "k-bob"])
    who = keys.authenticate([("user-agent", "x"), ("authorization", "Bearer k-bob")])
    assert who == key_digest("k-bob") and "k-bob" not in who
    assert keys.authenticate([("authorization", b"bearer  k-alice ")]) == key_digest("k-alice")


@pytest.mark.parametrize("metadata", [
    [],
    [("authorization", "Bearer nope")],
    [("authorization", "Basic k-alice")],
    [("authorization", "Bearer ")],
    [("authorization", "k-alice")],
])
def test_missing_or_wrong_key_is_unauthenticated(metadata: list[tuple[str, str]]) -> None:
    with pytest.raises(Unauthenticated):
        ApiKeys(["k-alice"]).authenticate(metadata)


@pytest.mark.parametrize("bad", ["", " k", "two words"])
def test_malformed_configured_keys_are_rejected(bad: str) -> None:
    with pytest.raises(ValueError):
        ApiKeys([bad])
