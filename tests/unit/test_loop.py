"""The relay loop against an in-memory store and a scripted publisher."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any
from uuid import uuid4

import pytest

from relay.core import errors, loop, model, waking
from tests.support.fakes import MemoryStore, Script, ScriptedPublisher
from tests.support.wait import until_async

Outcome = model.Outcome


def outcome(kind: Outcome, detail: str = "") -> Script:
    return lambda _message: model.PublishResult(kind, detail)


def relay_for(store: MemoryStore, publisher: ScriptedPublisher, **options: Any) -> loop.Relay:
    defaults: dict[str, Any] = {"batch_size": 10, "lease": 30.0, "retry_delay": 1.0}
    return loop.Relay(store, publisher, loop.Options(**(defaults | options)))


async def test_acked_messages_are_archived() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add(routing_key=f"k{i}") for i in range(3)]
    report = await relay_for(store, publisher).run_once()
    assert report.claimed == 3
    assert report.settled == model.SettleCounts(archived=3)
    assert [s.row.message_id for s in store.archive] == [r.message_id for r in rows]
    assert store.rows == {}


async def test_batch_is_published_in_id_order_and_limited_to_batch_size() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(25)]
    relay = relay_for(store, publisher, batch_size=10)
    assert (await relay.run_once()).claimed == 10
    assert [m.id for m in publisher.published] == [r.id for r in rows[:10]]


async def test_run_until_empty_sweeps_the_whole_backlog() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    for _ in range(25):
        store.add()
    report = await relay_for(store, publisher, batch_size=10).run_until_empty()
    assert report.claimed == 25
    assert report.settled.archived == 25
    assert publisher.batches == 3
    # The sum holds counts only: one entry per message for a whole drain grew without bound.
    assert report.publish_seconds == ()
    assert report.batch_sizes == ()


async def test_run_until_empty_stops_after_the_batch_in_flight_when_told() -> None:
    """A stop (SIGTERM) during a drain ends it as it ends `run`: the batch in flight is settled,
    the one claimed ahead is given back, nothing more is claimed."""
    store, publisher = MemoryStore(), ScriptedPublisher()
    for _ in range(25):
        store.add()
    publisher.gate = asyncio.Event()
    stop = asyncio.Event()
    draining = asyncio.create_task(relay_for(store, publisher, batch_size=10).run_until_empty(stop))
    await publisher.publishing.wait()
    stop.set()
    publisher.gate.set()
    report = await draining
    assert report.claimed == 10
    assert report.settled.archived == 10
    assert publisher.batches == 1
    assert len(store.rows) == 15
    assert all(r.claim_id is None and r.available_at <= store.now for r in store.rows.values())


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        (Outcome.RETURNED, "unroutable"),
        (Outcome.NO_EXCHANGE, "no_exchange"),
        (Outcome.INVALID, "invalid"),
    ],
)
async def test_final_outcomes_dead_letter_at_once(kind: Outcome, reason: str) -> None:
    store, publisher = MemoryStore(), ScriptedPublisher(outcome(kind, "why"))
    store.add()
    report = await relay_for(store, publisher).run_once()
    assert [(d.reason, d.detail, d.row.attempts) for d in store.dead] == [(reason, "why", 1)]
    assert report.dead == {model.DeadReason(reason): 1}
    assert store.rows == {}


async def test_nack_retries_with_backoff_then_dead_letters_at_max_attempts() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher(outcome(Outcome.NACKED, "nacked"))
    row = store.add()
    relay = relay_for(store, publisher, max_attempts=3, retry_delay=1.0, retry_max_delay=100.0)
    for attempt in (1, 2):
        await relay.run_once()
        assert row.attempts == attempt
        assert row.claim_id is None
        assert (await relay.run_once()).claimed == 0  # backing off: not due yet
        store.advance(2.0**attempt)  # the delay for attempt n is at most 2^(n-1) seconds
    await relay.run_once()
    assert [(d.reason, d.row.attempts) for d in store.dead] == [("max_attempts", 3)]
    assert "nacked" in store.dead[0].detail
    assert len(publisher.published) == 3


async def test_ambiguous_outcome_is_resent_without_spending_an_attempt() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher(outcome(Outcome.AMBIGUOUS, "lost"))
    row = store.add()
    relay = relay_for(store, publisher, max_attempts=2, max_ambiguous=3)
    for n in range(1, 4):
        await relay.run_once()
        assert (row.attempts, row.ambiguous) == (0, n)
        store.advance(1.0)
    # Past its own cap, an unknown outcome spends attempts like a nack, so it cannot loop forever.
    await relay.run_once()
    assert row.attempts == 1
    store.advance(10.0)
    await relay.run_once()
    assert [d.reason for d in store.dead] == ["max_attempts"]


async def test_row_whose_relays_keep_dying_is_buried_without_publishing() -> None:
    # A relay that dies while publishing a row never settles it: each lease expiry and re-claim
    # counts an attempt, so a row that kills every relay still ends in `dead`, moved there unread.
    store, publisher = MemoryStore(), ScriptedPublisher()
    row = store.add()
    await store.claim(model.Ask(10, 5.0, 10))  # a relay claims it, then dies
    for _ in range(2):
        store.advance(5.0)
        await store.claim(model.Ask(1, 5.0, 10))  # another claims it, and dies
    store.advance(5.0)
    report = await relay_for(store, publisher, max_attempts=3).run_once()
    assert publisher.published == []
    assert [(d.reason, d.row.message_id) for d in store.dead] == [("max_attempts", row.message_id)]
    assert (report.buried, report.dead) == (1, {model.DeadReason.MAX_ATTEMPTS: 1})


async def test_row_claimed_past_max_attempts_is_dead_lettered_without_publishing() -> None:
    # Rows can also be over the limit when max_attempts was lowered: no publish for them either.
    store, publisher = MemoryStore(), ScriptedPublisher()
    row = store.add()
    row.attempts = 7
    report = await relay_for(store, publisher, max_attempts=3).run_once()
    assert publisher.published == []
    assert [(d.reason, d.row.message_id) for d in store.dead] == [("max_attempts", row.message_id)]
    assert report.buried == 1  # moved by the claim, unread


async def test_a_claim_that_only_buried_rows_says_more_may_wait() -> None:
    # A whole batch of rows over the limit is buried and nothing is sent; the rows behind them
    # must not wait for the next poll: the cycle says the claim was cut short.
    store, publisher = MemoryStore(), ScriptedPublisher()
    for _ in range(3):
        store.add().attempts = 7
    fresh = store.add()
    report = await relay_for(store, publisher, max_attempts=3, batch_size=3).run_once()
    assert (report.buried, report.claimed, report.cut_short) == (3, 0, True)
    await relay_for(store, publisher, max_attempts=3, batch_size=3).run_once()
    assert [m.message_id for m in publisher.published] == [fresh.message_id]


async def test_a_dead_relays_rows_go_first_and_one_lost_twice_goes_alone() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    twice = store.add(routing_key="twice")
    await store.claim(model.Ask(1, 5.0, 10))  # a relay took it and died
    store.advance(5.0)
    await store.claim(model.Ask(1, 6.0, 10))  # another took it again, and died too
    once = [store.add(routing_key=f"once.{i}") for i in range(2)]
    await store.claim(model.Ask(10, 5.0, 10))  # a third took these and died
    store.advance(6.0)
    store.add(routing_key="fresh")
    batches: list[list[str]] = []
    real_publish = publisher.publish

    async def recording(
        messages: Any, abort: Any = None, still_held: Any = None
    ) -> list[model.PublishResult]:
        batches.append([m.routing_key for m in messages])
        return await real_publish(messages, abort, still_held)

    publisher.publish = recording  # type: ignore[method-assign]
    report = await relay_for(store, publisher).run_until_empty()
    # Expired leases first, in the order they ran out (`twice` ran out last and goes alone: a
    # row that kills its relay takes no other down), then what is due.
    assert batches == [["once.0", "once.1"], ["twice"], ["fresh"]]
    assert report.settled.archived == 4
    assert {s.row.message_id for s in store.archive} >= {r.message_id for r in [*once, twice]}


async def test_unexpected_publish_error_counts_an_attempt() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher(outcome(Outcome.FAILED, "boom"))
    row = store.add()
    await relay_for(store, publisher).run_once()
    assert (row.attempts, row.ambiguous, row.last_error) == (1, 0, "boom")


async def test_broker_down_claims_nothing() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    store.add()
    publisher.down = 1
    with pytest.raises(errors.BrokerUnavailable):
        await relay_for(store, publisher).run_once()
    assert "claim" not in store.calls
    assert next(iter(store.rows.values())).claim_id is None


async def test_settle_is_retried_through_a_database_outage() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    store.add()
    store.fail_next["settle"] = 2
    report = await relay_for(store, publisher).run_once()
    assert report.settled.archived == 1
    assert store.calls.count("settle") == 3


async def test_a_settle_retry_waits_by_the_sleep_the_relay_was_given() -> None:
    # The interleaving world passes one that returns at once: a retry's timing is then the test's,
    # never the machine's (a real wait made Hypothesis replay a case differently).
    store, publisher = MemoryStore(), ScriptedPublisher()
    store.add()
    store.fail_next["settle"] = 2
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)

    relay = loop.Relay(store, publisher, loop.Options(), sleep=sleep)
    assert (await relay.run_once()).settled.archived == 1
    assert len(waits) == 2, waits
    assert min(waits) > 0, waits


async def test_settle_of_a_row_reclaimed_elsewhere_is_a_counted_no_op() -> None:
    # A relay stalls past its lease (its heartbeats cannot reach the database), another claims the
    # orphan and archives it; the first relay's late settle must change nothing.
    store, publisher = MemoryStore(), ScriptedPublisher()
    row = store.add()
    store.fail_next["extend"] = 10**6
    publisher.gate = asyncio.Event()
    relay = relay_for(store, publisher, lease=0.05)
    stalled = asyncio.create_task(relay.run_once())
    await asyncio.wait_for(publisher.publishing.wait(), 5)
    store.advance(1.0)
    rescuer = relay_for(store, ScriptedPublisher())
    assert (await rescuer.run_once()).settled.archived == 1
    publisher.gate.set()
    late = await asyncio.wait_for(stalled, 5)
    assert late.settled == model.SettleCounts(fenced=1)
    assert [s.row.message_id for s in store.archive] == [row.message_id]


async def test_heartbeat_renews_the_lease_while_the_broker_is_slow() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    row = store.add()
    publisher.gate = asyncio.Event()
    relay = relay_for(store, publisher, lease=0.06)
    beating = asyncio.create_task(relay.heartbeat.run())  # as run() and run_until_empty() do
    stalled = asyncio.create_task(relay.run_once())
    await asyncio.wait_for(publisher.publishing.wait(), 5)
    first = row.available_at
    store.advance(0.05)  # most of the lease passes…
    await _until(lambda: row.available_at > first)  # …and a beat renews it from the new "now"
    publisher.gate.set()
    assert (await asyncio.wait_for(stalled, 5)).settled.archived == 1
    beating.cancel()


async def test_stop_gives_unconfirmed_rows_back_at_once_after_the_grace() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(3)]
    publisher.gate = asyncio.Event()  # the broker never confirms
    relay = relay_for(store, publisher, shutdown_grace=0.05, poll_interval=3600.0)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await asyncio.wait_for(publisher.publishing.wait(), 5)
    stop.set()
    await asyncio.wait_for(task, 5)
    for row in rows:  # back in the queue, due now, attempt refunded, counted as ambiguous
        assert (row.claim_id, row.available_at, row.attempts, row.ambiguous) == (
            None,
            store.now,
            0,
            1,
        )


async def test_rows_claimed_when_stopping_are_released_unsent() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(3)]
    relay = relay_for(store, publisher)
    relay._stopping.set()  # the stop arrived between the claim and the publish
    report = await relay.run_once()
    assert publisher.published == []
    assert report.settled.retried == 3
    assert all((r.claim_id, r.attempts, r.ambiguous) == (None, 0, 0) for r in rows)


async def test_blocked_broker_claims_nothing_until_it_unblocks() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    store.add()
    publisher.blocked = True
    relay = relay_for(store, publisher, poll_interval=0.01)
    assert (await relay.run_once()).blocked
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: store.calls.count("claim") == 0 and publisher.batches == 0)
    publisher.blocked = False
    publisher.unblocked.set()
    await _until(lambda: len(store.archive) == 1)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert store.calls.count("claim") >= 1


async def test_claim_ahead_leases_the_next_batch_while_one_is_published() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(25)]
    publisher.gate = asyncio.Event()
    relay = relay_for(store, publisher, batch_size=10, prefetch=True)
    first = asyncio.create_task(relay.run_once())
    await asyncio.wait_for(publisher.publishing.wait(), 5)
    # The first batch awaits its confirms; the second is already leased by then.
    await _until(lambda: rows[19].claim_id is not None)
    assert rows[20].claim_id is None
    publisher.gate.set()
    assert (await asyncio.wait_for(first, 5)).claimed == 10
    report = await relay.run_until_empty()
    assert (report.claimed, report.settled.archived) == (15, 15)
    assert [m.id for m in publisher.published] == [r.id for r in rows]
    assert store.rows == {}
    assert store.calls.count("claim") == 4  # 10 + 10 + 5, and the empty one that ends it


async def test_claim_ahead_only_after_a_full_batch() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    for _ in range(9):
        store.add()
    await relay_for(store, publisher, batch_size=10, prefetch=True).run_once()
    assert store.calls.count("claim") == 1


async def test_a_batch_cut_short_by_its_byte_budget_is_followed_at_once() -> None:
    # Fewer rows than batch_size, yet more are due: run() claims again without waiting for a
    # notification or the (here: hour-long) poll interval.
    store, publisher = MemoryStore(batch_max_bytes=3000), ScriptedPublisher()
    for _ in range(10):
        store.add(body=b"x" * 1000)
    relay = relay_for(store, publisher, batch_size=10, poll_interval=3600.0, prefetch=True)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: len(store.archive) == 10)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert publisher.batches >= 5  # two messages a batch at most


async def test_batch_claimed_ahead_is_given_back_when_the_relay_stops() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(20)]
    publisher.gate = asyncio.Event()
    relay = relay_for(store, publisher, batch_size=10, prefetch=True, poll_interval=3600.0)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await asyncio.wait_for(publisher.publishing.wait(), 5)
    await _until(lambda: rows[19].claim_id is not None)
    stop.set()
    publisher.gate.set()
    await asyncio.wait_for(task, 5)
    assert len(store.archive) == 10
    for row in rows[10:]:  # unsent, due now for any replica, attempt refunded
        assert (row.claim_id, row.available_at, row.attempts) == (None, store.now, 0)


async def test_heartbeat_renews_the_batch_claimed_ahead_too() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(4)]
    publisher.gate = asyncio.Event()
    relay = relay_for(store, publisher, batch_size=2, lease=0.06, prefetch=True)
    beating = asyncio.create_task(relay.heartbeat.run())  # as run() and run_until_empty() do
    stalled = asyncio.create_task(relay.run_once())
    await asyncio.wait_for(publisher.publishing.wait(), 5)
    await _until(lambda: rows[3].claim_id is not None)
    ahead = rows[3].available_at
    store.advance(0.05)
    await _until(lambda: rows[3].available_at > ahead)
    publisher.gate.set()
    await asyncio.wait_for(stalled, 5)
    beating.cancel()
    assert (await relay.run_until_empty()).settled.archived == 2
    assert len(store.archive) == 4


async def test_blocked_broker_gives_back_the_batch_claimed_ahead() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    rows = [store.add() for _ in range(20)]
    relay = relay_for(store, publisher, batch_size=10, prefetch=True)
    await relay.run_once()
    await _until(lambda: rows[19].claim_id is not None)  # claimed ahead, in the background
    publisher.blocked = True
    assert (await relay.run_once()).blocked
    assert all(r.claim_id is None and r.attempts == 0 for r in rows[10:])


def test_rejected_message_is_dead_with_the_reason_the_publisher_named() -> None:
    result = model.PublishResult(Outcome.REJECTED, "406 too big", reason=model.DeadReason.TOO_LARGE)
    plan = loop.plan([_message(1)], [result], loop.Options())
    assert [(d.reason, d.detail) for d in plan.dead] == [
        (model.DeadReason.TOO_LARGE, "406 too big")
    ]


def test_resent_results_are_recorded() -> None:
    result = model.PublishResult(Outcome.ACKED, resent=True)
    assert loop.plan([_message(7)], [result], loop.Options()).resent == (7,)


async def test_run_wakes_on_the_event_and_stops_when_told() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    relay = relay_for(store, publisher, poll_interval=3600.0)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: "claim" in store.calls)
    store.add()
    relay.wake.set()
    await _until(lambda: len(store.archive) == 1)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_run_polls_when_no_notification_comes() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    relay = relay_for(store, publisher, poll_interval=0.01)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: store.calls.count("claim") >= 3)
    store.add()  # nobody sets relay.wake: only polling can find it
    await _until(lambda: len(store.archive) == 1)
    stop.set()
    await asyncio.wait_for(task, 5)


def waker(bell: FakeDoorbell) -> waking.Waker:
    return waking.Waker(asyncio.Event(), bell, 3600.0)


class FakeDoorbell:
    """Held once the test grants it; arm and disarm are noted in the store's calls, in order."""

    def __init__(self, calls: list[str]) -> None:
        self.armed = asyncio.Event()
        self.lost = asyncio.Event()
        self.arms = 0
        self.granted = asyncio.Event()
        self._calls = calls
        self._wanted = False
        self._tasks: set[asyncio.Task[None]] = set()

    def arm(self) -> None:
        self._calls.append("arm")
        self._wanted = True
        task = asyncio.get_running_loop().create_task(self._grant())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _grant(self) -> None:
        await self.granted.wait()
        self.grant_now()

    def grant_now(self) -> None:
        if self._wanted and not self.armed.is_set():
            self.arms += 1
            self.armed.set()

    def lose(self) -> None:
        self.armed.clear()
        self.lost.set()

    def disarm(self) -> None:
        self._calls.append("disarm")
        self._wanted = False
        self.armed.clear()


async def test_a_relay_with_nothing_to_do_arms_the_doorbell_and_looks_once_more_when_held() -> None:
    """A producer that committed without ringing (no relay held the doorbell) did so before the
    doorbell was held: the relay must look again then, not sleep until its poll."""
    store, publisher = MemoryStore(), ScriptedPublisher()
    bell = FakeDoorbell(store.calls)
    relay = loop.Relay(store, publisher, loop.Options(poll_interval=3600.0), waker=waker(bell))
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: "arm" in store.calls)
    for _ in range(20):
        await asyncio.sleep(0)  # let it run on: it must wait for the doorbell, not claim
    assert store.calls[-1] == "arm"
    store.add()  # committed by a producer that did not ring
    bell.granted.set()
    await _until(lambda: len(store.archive) == 1)
    claims = store.calls.count("claim") + store.calls.count("settle")
    for _ in range(20):
        await asyncio.sleep(0)
    # Held now: it sleeps until woken (or its poll), without arming again.
    assert store.calls.count("arm") == 1
    assert store.calls.count("claim") + store.calls.count("settle") == claims
    stop.set()
    await asyncio.wait_for(task, 5)
    assert store.calls[-1] == "disarm"  # a stopped relay lets go


async def test_a_doorbell_taken_during_a_look_makes_the_relay_look_once_more() -> None:
    """The order of events a review found: the arm waits behind producer P (who did not ring); a
    NOTIFY from another wakes the relay, whose claim takes its snapshot; P commits and the arm is
    granted while that claim runs. The claim did not see P's row, and no look began after the
    arm: the relay must look again, not sleep until its poll."""
    store, publisher = MemoryStore(), ScriptedPublisher()
    bell = FakeDoorbell(store.calls)
    claim = store.claim
    looks = 0

    async def claim_then_grant(ask: model.Ask) -> model.Claim:
        nonlocal looks
        looks += 1
        found = await claim(ask)
        if looks == 2:  # the look woken by the NOTIFY
            store.add()  # P commits after that look's snapshot...
            bell.grant_now()  # ...and the arm it waited for is granted
        return found

    store.claim = claim_then_grant  # type: ignore[method-assign]
    relay = loop.Relay(store, publisher, loop.Options(poll_interval=3600.0), waker=waker(bell))
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: "arm" in store.calls)
    relay.wake.set()
    await _until(lambda: len(store.archive) == 1)
    assert looks == 3
    assert store.calls.count("arm") == 1
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_relay_whose_doorbell_went_with_its_session_arms_it_again() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    bell = FakeDoorbell(store.calls)
    bell.granted.set()
    relay = loop.Relay(store, publisher, loop.Options(poll_interval=3600.0), waker=waker(bell))
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await asyncio.wait_for(bell.armed.wait(), 5)
    await _until(lambda: store.calls.count("claim") == 2)  # the look after the arm
    bell.lose()
    await _until(lambda: store.calls.count("arm") == 2)

    # and, once it holds it again, looks for what was committed while none was held
    def looked_after_the_last_arm() -> bool:
        last_arm = len(store.calls) - 1 - store.calls[::-1].index("arm")
        return "claim" in store.calls[last_arm:]

    await _until(looked_after_the_last_arm)
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_a_relay_working_back_to_back_lets_go_of_the_doorbell() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    bell = FakeDoorbell(store.calls)
    bell.granted.set()
    relay = loop.Relay(
        store, publisher, loop.Options(batch_size=2, poll_interval=3600.0), waker=waker(bell)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await asyncio.wait_for(bell.armed.wait(), 5)
    for _ in range(5):
        store.add()
    relay.wake.set()
    await _until(lambda: len(store.archive) == 5)
    woken = store.calls[store.calls.index("arm") + 1 :]
    assert "disarm" in woken  # full batches: producers need not ring meanwhile
    await asyncio.wait_for(bell.armed.wait(), 5)  # and once idle again, it holds it again
    stop.set()
    await asyncio.wait_for(task, 5)


async def test_run_rides_out_outages_with_backoff() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    store.add()
    publisher.down = 3
    store.fail_next["claim"] = 2
    relay = relay_for(store, publisher, poll_interval=0.01, reconnect_max_delay=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: len(store.archive) == 1)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert publisher.down == 0


async def test_run_propagates_a_bug() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    store.add()

    async def broken(*_: object) -> model.Claim:
        raise ZeroDivisionError("a bug")

    store.claim = broken  # type: ignore[method-assign,assignment]
    with pytest.raises(ZeroDivisionError):
        await asyncio.wait_for(relay_for(store, publisher).run(asyncio.Event()), 5)


async def test_stop_during_backoff_returns_promptly() -> None:
    store, publisher = MemoryStore(), ScriptedPublisher()
    publisher.down = 10**6
    relay = relay_for(store, publisher, reconnect_max_delay=3600.0)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    await _until(lambda: publisher.down < 10**6 - 3)
    stop.set()
    await asyncio.wait_for(task, 5)


def test_plan_maps_every_outcome() -> None:
    messages = [_message(i) for i in range(6)]
    results = [
        model.PublishResult(kind, kind.value)
        for kind in (
            Outcome.ACKED,
            Outcome.RETURNED,
            Outcome.NACKED,
            Outcome.NO_EXCHANGE,
            Outcome.INVALID,
            Outcome.AMBIGUOUS,
        )
    ]
    plan = loop.plan(messages, results, loop.Options())
    assert plan.archive == (0,)
    assert [(d.id, d.reason.value) for d in plan.dead] == [
        (1, "unroutable"),
        (3, "no_exchange"),
        (4, "invalid"),
    ]
    assert [(r.id, r.refund) for r in plan.retry] == [(2, False), (5, True)]


def _message(id_: int) -> model.OutboxMessage:
    return model.OutboxMessage(
        id_, uuid4(), "x", "rk", b"", {}, {}, None, datetime.now(UTC), attempts=1
    )


async def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    async def check() -> bool:
        return predicate()

    await until_async(check, timeout=timeout, interval=0.001)
