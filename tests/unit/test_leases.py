"""The lease keeper and the loop's use of it, on the in-memory store. The relay's clock is the
store's clock here, so a lease runs out exactly when the test says so."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from relay.core import errors, leases, loop, model
from tests.support.fakes import MemoryStore, ScriptedPublisher

LEASE = 10.0


def relay_for(store: MemoryStore, publisher: ScriptedPublisher, **options: Any) -> loop.Relay:
    defaults: dict[str, Any] = {"batch_size": 2, "lease": LEASE, "prefetch": True}
    return loop.Relay(
        store, publisher, loop.Options(**(defaults | options)), clock=lambda: clock(store)
    )


def clock(store: MemoryStore) -> float:
    return store.now.timestamp()


async def test_a_hold_is_trusted_for_most_of_the_lease_from_when_the_claim_was_sent() -> None:
    store = MemoryStore()
    store.add()
    keeper = leases.Keeper(store, LEASE, lambda: clock(store))
    sent = clock(store)
    claim = await store.claim(model.Ask(10, LEASE, 10))
    keeper.hold(claim, sent)
    ids = frozenset(m.id for m in claim.messages)
    store.advance(LEASE * leases.TRUST - 0.01)
    assert keeper.valid(claim.claim_id, ids)
    store.advance(0.02)
    assert not keeper.valid(claim.claim_id, ids)  # the database may not have run out yet: no matter
    assert keeper.held() == {}


async def test_the_keeper_renews_every_hold_and_lets_go_of_rows_taken_over() -> None:
    store = MemoryStore()
    for _ in range(2):
        store.add()
    keeper = leases.Keeper(store, LEASE, lambda: clock(store))
    claim = await store.claim(model.Ask(10, LEASE, 10))
    keeper.hold(claim, clock(store))
    store.advance(LEASE)  # no renewal in time: another relay takes one of them
    taken = await store.claim(model.Ask(1, LEASE, 10))
    await keeper.run_once()
    (lost,) = [m.id for m in taken.messages]
    everything = frozenset(m.id for m in claim.messages)
    assert keeper.held() == {claim.claim_id: everything - {lost}}
    store.advance(LEASE * leases.TRUST - 0.01)  # the renewal counts from when it was sent
    assert keeper.valid(claim.claim_id, everything - {lost})
    # The claim is trusted again, but not with the row taken over: a publisher re-sending the
    # batch (after a channel error) must not write it.
    assert not keeper.valid(claim.claim_id, everything)


async def test_a_heartbeat_leaves_a_fresh_hold_alone_and_renews_it_in_time() -> None:
    store = MemoryStore()
    store.add()
    keeper = leases.Keeper(store, LEASE, lambda: clock(store))
    claim = await store.claim(model.Ask(10, LEASE, 10))
    keeper.hold(claim, clock(store))
    await keeper.run_once()  # claimed a moment ago: rewriting its rows would be waste
    assert store.calls.count("extend") == 0
    store.advance(LEASE / 3)  # the next heartbeat renews it, well before its trust runs out
    await keeper.run_once()
    assert store.calls.count("extend") == 1
    store.advance(LEASE / 3)
    assert keeper.valid(claim.claim_id, frozenset(m.id for m in claim.messages))


async def test_confirm_renews_a_hold_with_little_trust_left_and_names_what_is_still_held() -> None:
    store = MemoryStore()
    store.add()
    keeper = leases.Keeper(store, LEASE, lambda: clock(store))
    claim = await store.claim(model.Ask(10, LEASE, 10))
    keeper.hold(claim, clock(store))
    assert await keeper.confirm(claim.claim_id) == {claim.messages[0].id}
    assert store.calls.count("extend") == 0  # plenty of trust left: no round trip
    store.advance(LEASE * 0.6)
    assert await keeper.confirm(claim.claim_id) == {claim.messages[0].id}
    assert store.calls.count("extend") == 1
    store.advance(LEASE)  # lapsed, and taken over meanwhile
    await store.claim(model.Ask(1, LEASE, 10))
    assert await keeper.confirm(claim.claim_id) == frozenset()


async def test_confirm_raises_when_the_database_cannot_say() -> None:
    store = MemoryStore()
    store.add()
    keeper = leases.Keeper(store, LEASE, lambda: clock(store))
    claim = await store.claim(model.Ask(10, LEASE, 10))
    keeper.hold(claim, clock(store))
    store.advance(LEASE * 0.6)
    store.fail_next["extend"] = 1
    with pytest.raises(errors.DatabaseUnavailable):
        await keeper.confirm(claim.claim_id)


async def test_a_batch_claimed_ahead_that_lapsed_is_not_published() -> None:
    # The relay claims the next batch while publishing a full one, then nothing renews it for
    # a whole lease; another relay takes it over. The first must not send its stale claim.
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(4)]
    relay = relay_for(store, publisher)
    await relay.run_once()
    await asyncio.sleep(0)  # the claim ahead runs in the background
    assert all(r.claim_id is not None for r in rows[2:])
    store.advance(LEASE)
    other = ScriptedPublisher()
    await relay_for(store, other).run_until_empty()  # takes rows 3 and 4 over as orphans
    assert [m.id for m in other.published] == [rows[2].id, rows[3].id]
    await relay.run_once()
    assert [m.id for m in publisher.published] == [rows[0].id, rows[1].id]


async def test_an_unreachable_broker_gives_back_the_batch_claimed_ahead() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(4)]
    relay = relay_for(store, publisher)
    await relay.run_once()
    await asyncio.sleep(0)
    assert all(r.claim_id is not None for r in rows[2:])
    publisher.down = 1
    with pytest.raises(errors.BrokerUnavailable):
        await relay.run_once()
    for row in rows[2:]:  # due at once for a replica whose broker works, attempt refunded
        assert (row.claim_id, row.attempts, row.available_at) == (None, 0, store.now)
    assert relay.leases.held() == {}


async def test_what_the_lease_lost_before_the_write_is_given_back_unsent() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    row = store.add()
    relay = relay_for(store, publisher)

    async def slow_exchange_check(*args: Any) -> list[model.PublishResult]:
        store.advance(LEASE)  # the broker took a whole lease before we could write
        return await ScriptedPublisher.publish(publisher, *args)

    publisher.publish = slow_exchange_check  # type: ignore[method-assign,assignment]
    report = await relay.run_once()
    assert publisher.published == []
    assert report.outcomes == {model.Outcome.UNSENT: 1}
    assert report.retried == {"released": 1}
    assert (row.claim_id, row.attempts) == (None, 0)


async def test_the_relay_keeps_its_claims_alive_for_its_whole_life() -> None:
    # Not only while a batch is published: the batch claimed ahead is renewed while the relay
    # settles, works through orphans, or waits out an outage.
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(4)]
    relay = relay_for(store, publisher)
    await relay.run_once()
    await asyncio.sleep(0)
    ahead = {r.id: r.available_at for r in rows[2:]}
    store.advance(LEASE * 0.5)
    await relay.heartbeat.run_once()
    assert all(r.available_at > ahead[r.id] for r in rows[2:])
    store.advance(LEASE * 0.8)  # past the claim's own lease: only the renewal holds it
    assert (await relay.run_once()).settled.archived == 2
    assert len(store.archive) == 4


async def test_a_claim_settled_in_parts_stays_held_and_renewed_for_the_part_left() -> None:
    store = MemoryStore()
    for _ in range(4):
        store.add()
    keeper = leases.Keeper(store, LEASE, lambda: clock(store))
    claim = await store.claim(model.Ask(10, LEASE, 10))
    keeper.hold(claim, clock(store))
    first, rest = frozenset({1, 2}), frozenset({3, 4})
    keeper.drop(claim.claim_id, first)  # one chain's part settled (docs/decisions/0009)
    assert keeper.held() == {claim.claim_id: rest}
    assert keeper.valid(claim.claim_id, rest)
    assert not keeper.valid(claim.claim_id, first)
    store.advance(LEASE * 0.5)
    store.calls.clear()
    extended: list[list[int]] = []
    real = store.extend

    async def extend(claim_id: Any, ids: Any, lease: float) -> frozenset[int]:
        extended.append(list(ids))
        return await real(claim_id, ids, lease)

    store.extend = extend  # type: ignore[method-assign]
    await keeper.run_once()
    assert extended == [[3, 4]]  # only what is still the relay's to settle is renewed
    assert keeper.held() == {claim.claim_id: rest}
    keeper.drop(claim.claim_id, rest)  # the other part settled: nothing of the claim is left
    assert keeper.held() == {}
    keeper.drop(claim.claim_id, rest)  # and a second drop is harmless
