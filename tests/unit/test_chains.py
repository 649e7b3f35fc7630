"""A keyed batch split into chains (docs/decisions/0009), against the in-memory store and scripted
publishers: the orders of events between the parts that the split makes possible."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from relay.core import loop, model
from tests.support.fakes import MemoryStore, Row, ScriptedPublisher
from tests.support.wait import until_async

Outcome = model.Outcome
LEASE = 30.0


class Clock:
    """The relay's clock, moved by the test (the keeper trusts holds by it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def relay_with(
    store: MemoryStore, publishers: list[ScriptedPublisher], clock: Clock, **options: Any
) -> loop.Relay:
    defaults: dict[str, Any] = {
        "batch_size": 100,
        "lease": LEASE,
        "retry_delay": 1.0,
        "prefetch": True,
        "min_chain": 2,
        "shutdown_grace": 0.05,
    }
    return loop.Relay(
        store,
        publishers[0],
        loop.Options(**(defaults | options)),
        chain_publishers=publishers[1:],
        clock=clock,
    )


def keyed_rows(store: MemoryStore, keys: int, each: int) -> list[Row]:
    """`each` rows for each of `keys` keys, written round-robin (ids 1..keys are the heads)."""
    return [store.add(ordering_key=f"k{k}") for _ in range(each) for k in range(keys)]


def recording(
    log: list[model.OutboxMessage], outcome: Outcome = Outcome.ACKED
) -> ScriptedPublisher:
    def script(message: model.OutboxMessage) -> model.PublishResult:
        log.append(message)
        return model.PublishResult(outcome)

    return ScriptedPublisher(script)


def assert_in_key_order(sent: list[model.OutboxMessage]) -> None:
    """Per key, every send is of the key's oldest unsettled row: ids never go down, and no row is
    sent after a later row of its key was."""
    last: dict[str, int] = {}
    for message in sent:
        assert message.ordering_key is not None
        assert message.id >= last.get(message.ordering_key, 0), (message.ordering_key, message.id)
        last[message.ordering_key] = message.id


async def until(predicate: Callable[[], bool]) -> None:
    async def check() -> bool:
        return predicate()

    await until_async(check, timeout=5.0, interval=0.001)


async def test_a_short_keyed_batch_goes_on_as_chains_each_on_its_own_publisher() -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), recording(sent)
    rows = keyed_rows(store, keys=8, each=5)
    relay = relay_with(store, [a, b], clock)
    report = await relay.run_once()
    assert len(store.archive) == 40
    assert not store.rows
    assert report.claimed == 40
    assert report.settled.archived == 40
    # The cycle's claim of the 8 heads, then each chain's claims with its settles: 4 rows each.
    assert sorted(report.batch_sizes) == [4] * 8 + [8]
    assert store.calls.count("claim") == 1  # nothing claimed ahead: each chain claims its own
    assert store.calls.count("settle_then_claim") >= 8
    assert_in_key_order(sent)
    # The parts split the keys, and each chain kept its own: a's keys never reach b.
    a_keys = {m.ordering_key for m in a.published}
    b_keys = {m.ordering_key for m in b.published}
    assert a_keys
    assert b_keys
    assert not a_keys & b_keys
    assert {m.id for m in sent} == {r.id for r in rows}
    assert not relay.leases.held()


@pytest.mark.parametrize(
    ("keys", "unkeyed", "chains", "batch_size"),
    [
        (3, 0, 2, 100),  # too few keyed rows for two parts of min_chain
        (8, 0, 1, 100),  # one publisher: nothing to split across
        (8, 0, 2, 8),  # a full batch: claimed ahead instead, as unkeyed ones are
        (0, 20, 2, 100),  # unkeyed rows are not held back by a gate: no chain gains
    ],
)
async def test_batches_that_chains_would_not_help_are_not_split(
    keys: int, unkeyed: int, chains: int, batch_size: int
) -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    publishers = [recording(sent) for _ in range(chains)]
    keyed_rows(store, keys=keys, each=2)
    for _ in range(unkeyed):
        store.add()
    relay = relay_with(store, publishers, clock, batch_size=batch_size)
    await relay.run_once()
    assert publishers[0].batches == 1
    assert all(p.batches == 0 for p in publishers[1:])


async def test_a_part_awaiting_its_confirms_stays_held_and_renewed_while_the_other_settles() -> (
    None
):
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), recording(sent)
    b.gate = asyncio.Event()  # b's broker is slow to confirm its first part
    keyed_rows(store, keys=8, each=3)
    relay = relay_with(store, [a, b], clock)
    cycle = asyncio.create_task(relay.run_once())
    await asyncio.wait_for(b.publishing.wait(), 5)
    b_ids = frozenset(m.id for m in b.published)
    a_keys = {m.ordering_key for m in a.published}
    # a's chain runs to its end meanwhile: every row of its keys settled, its holds dropped…
    await until(lambda: sum(1 for s in store.archive if s.row.ordering_key in a_keys) == 12)
    # …while the claim that began both parts still holds b's part, and only b's.
    assert list(relay.leases.held().values()) == [b_ids]
    clock.now += LEASE * 0.4  # a renewal comes between the parts' settles
    store.calls.clear()
    await relay.leases.run_once()
    assert store.calls == ["extend"]
    assert all(store.rows[i].claim_id is not None for i in b_ids)
    b.gate.set()
    report = await asyncio.wait_for(cycle, 5)
    assert report.settled.archived == 24
    assert not store.rows
    assert report.settled.fenced == 0  # b's part was still its claim's when it settled
    assert_in_key_order(sent)


async def test_a_stop_between_the_parts_settles_leaves_nothing_claimed() -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    stop = asyncio.Event()
    a, b = recording(sent), recording(sent)
    b.gate = asyncio.Event()  # b's confirms never come
    rows = keyed_rows(store, keys=8, each=3)
    relay = relay_with(store, [a, b], clock)

    def stop_on_second_step(message: model.OutboxMessage) -> model.PublishResult:
        if message.id > 8:  # a's chain is on its keys' second rows: its first part settled
            stop.set()
            relay._stopping.set()  # as the stop's task does, at a store call that yields
        sent.append(message)
        return model.PublishResult(Outcome.ACKED)

    a.script = stop_on_second_step
    total = await asyncio.wait_for(relay.run_until_empty(stop), 5)
    assert stop.is_set()
    # a's first two parts were confirmed and archived; no third was claimed once stopping.
    assert sorted(s.row.id for s in store.archive) == sorted(m.id for m in a.published)
    assert len(store.archive) == 8
    assert total.settled.archived == 8
    # b's part was written before the stop and never confirmed: given back after the grace,
    # unclaimed, due, its attempt refunded, counted as ambiguous; and b's connection closed
    # before that settle, so no late copy can follow a copy sent again elsewhere.
    assert len(b.published) == 4
    assert b.closes == 1
    assert a.closes == 0
    for message in b.published:
        row = store.rows[message.id]
        assert (row.claim_id, row.attempts, row.ambiguous) == (None, 0, 1)
    assert all(r.claim_id is None for r in rows if r.id in store.rows)
    assert not relay.leases.held()
    assert not relay.leases.claimed_ahead
    assert_in_key_order(sent)


async def test_a_part_whose_confirms_fail_after_the_other_claimed_successors_is_retried_alone() -> (
    None
):
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), recording(sent, Outcome.NACKED)
    keyed_rows(store, keys=8, each=3)
    relay = relay_with(store, [a, b], clock)
    report = await relay.run_once()
    a_keys = {m.ordering_key for m in a.published}
    b_keys = {m.ordering_key for m in b.published}
    assert len(a_keys) == 4
    assert len(b_keys) == 4
    # a's chain went on with its successors; b's stopped at its nack: its heads wait for their
    # retry, and no successor of theirs was sent.
    assert {s.row.ordering_key for s in store.archive} == a_keys
    assert len(store.archive) == 12
    assert len(b.published) == 4
    assert report.retried == {"nacked": 4}
    heads = [r for r in store.rows.values() if r.id <= 8]
    assert all(r.claim_id is None and r.attempts == 1 for r in heads)
    assert all(r.available_at > store.now for r in heads)
    # Once due again, b's keys drain in order.
    b.script = recording(sent).script
    store.advance(5)
    await relay.run_until_empty()
    assert not store.rows
    assert_in_key_order(sent)


async def test_chains_stop_claiming_after_half_a_lease_so_the_cycles_chores_run() -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), recording(sent)
    keyed_rows(store, keys=8, each=4)

    def slow(message: model.OutboxMessage) -> model.PublishResult:
        clock.now += LEASE / 8  # each publish takes an eighth of a lease
        sent.append(message)
        return model.PublishResult(Outcome.ACKED)

    a.script = b.script = slow
    relay = relay_with(store, [a, b], clock)
    report = await relay.run_once()
    assert 0 < report.settled.archived < 32  # the cycle ended with rows still to go…
    assert all(r.claim_id is None for r in store.rows.values())  # …none of them claimed
    assert not relay.leases.held()
    await relay.run_until_empty()
    assert not store.rows
    assert_in_key_order(sent)


async def test_a_chain_whose_broker_cannot_be_reached_gives_its_part_back_and_splits_pause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), recording(sent)
    b.down = 1  # b's connection is refused (a broker's connection limit, say)
    keyed_rows(store, keys=8, each=3)
    relay = relay_with(store, [a, b], clock)
    await relay.run_once()
    assert b.published == []
    assert "cannot publish" in caplog.text
    # b's part went back due at once, and a's chain took those keys on: nothing is left.
    assert not store.rows
    assert_in_key_order(sent)
    # For a lease no batch is split: the next ones go whole on the first publisher.
    keyed_rows(store, keys=8, each=1)
    await relay.run_once()
    assert b.batches == 0
    clock.now += LEASE
    keyed_rows(store, keys=8, each=1)
    await relay.run_once()
    assert b.batches == 1


async def test_a_bug_in_one_chain_fails_the_cycle_with_that_error() -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), recording(sent)

    def broken(message: model.OutboxMessage) -> model.PublishResult:
        raise RuntimeError("a bug")

    b.script = broken
    keyed_rows(store, keys=8, each=2)
    relay = relay_with(store, [a, b], clock)
    with pytest.raises(RuntimeError, match="a bug"):  # itself, not an exception group
        await relay.run_once()
    assert not relay.leases.held()  # the cancelled chain let go of what it held


async def test_a_recheck_queued_while_chains_run_ends_them_soon() -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), recording(sent)
    keyed_rows(store, keys=8, each=4)
    relay = relay_with(store, [a, b], clock)
    relay.recheck.clear()  # the start-up recheck is done

    def notify_on_first(message: model.OutboxMessage) -> model.PublishResult:
        relay.recheck.set()  # a producer's commit raced a settle: its NOTIFY arrives
        sent.append(message)
        return model.PublishResult(Outcome.ACKED)

    a.script = notify_on_first
    report = await relay.run_once()
    assert report.settled.archived == 8  # each chain settled its first part, claiming nothing
    assert all(r.claim_id is None for r in store.rows.values())
    assert store.calls.count("release_stranded") == 1  # the recheck ran in the same cycle


class SlowToWrite(ScriptedPublisher):
    """A publisher that takes a while between being asked and writing (an exchange probe, a
    reconnect): the lease's trust may run out meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = asyncio.Event()
        self.go = asyncio.Event()

    async def publish(
        self,
        messages: Any,
        abort: asyncio.Event | None = None,
        still_held: Callable[[], bool] | None = None,
    ) -> list[model.PublishResult]:
        self.asked.set()
        await self.go.wait()
        return await super().publish(messages, abort, still_held)


async def test_a_part_whose_lease_trust_ran_out_before_the_write_is_not_written() -> None:
    store, clock, sent = MemoryStore(), Clock(), list[model.OutboxMessage]()
    a, b = recording(sent), SlowToWrite()
    keyed_rows(store, keys=8, each=1)
    relay = relay_with(store, [a, b], clock)
    cycle = asyncio.create_task(relay.run_once())
    await asyncio.wait_for(b.asked.wait(), 5)
    clock.now += LEASE  # the relay can no longer be sure b's part is still its own
    b.go.set()
    report = await asyncio.wait_for(cycle, 5)
    assert b.published == []  # nothing written: `unsent`, given back
    assert report.outcomes == {Outcome.ACKED: 4, Outcome.UNSENT: 4}
    left = list(store.rows.values())
    assert len(left) == 4
    assert all((r.claim_id, r.attempts) == (None, 0) for r in left)
