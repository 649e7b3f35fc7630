"""The orders of events that once broke the protocol (issue 17's findings, one found while fixing
them, and issue 43's: frozen relays, a settle against its own renewal, ids given twice, relays of
the previous release), each replayed step by step in the interleaving world. Every case ends with
the world's own checks: nothing sent that should not have been, and everything drained in
order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from relay.postgres.doorbell import Doorbell
from tests.interleavings.world import LEASE, World, reset


@pytest.fixture
def world(database_url: str) -> Iterator[World]:
    reset(database_url)
    here = World(database_url)
    here.start_relay()
    here.start_relay()
    try:
        yield here
    finally:
        here.close()


def sent(world: World, key: str) -> list[tuple[int | None, int, str]]:
    return [(s.seq, s.attempt, s.relay) for s in world.ledger.sends if s.key == key]


def test_a_batch_claimed_ahead_is_given_back_when_the_broker_is_gone(world: World) -> None:
    a, b = world.relays
    world.commit_now(None, None, None, "k", "k", "k")
    world.until(a, "publish")  # a full batch of three: a claims the next one ahead…
    world.grant(world.first(a, "claim"))  # …which holds k#1
    world.until(a, "connect")  # published and settled
    a.broker_down = True
    world.grant(world.first(a, "connect"))  # no broker: a gives k#1 back at once
    world.until(a, "connect")
    world.advance(LEASE * 1.1)
    for _ in range(6):
        world.until(b, "connect")
        world.grant(world.first(b, "connect"))
    a.broker_down = False
    assert world.finish() == []
    assert [seq for seq, _, _ in sent(world, "k")] == [1, 2, 3]


def test_a_stale_claim_ahead_sends_nothing_after_its_rows_were_taken_over(world: World) -> None:
    # Nothing renews a's claim ahead for a whole lease (no heartbeat step); b takes k#1 over
    # with the rest of a's leases and sends it. a's next cycle finds its claim lost and must not
    # send it too.
    a, b = world.relays
    world.commit_now(None, None, None, "k", "k", "k")
    world.until(a, "publish")
    world.grant(world.first(a, "claim"))  # the claim ahead: k#1
    world.grant(world.first(a, "publish"), "ack")
    world.advance(LEASE * 1.1)
    for _ in range(2):  # b takes a's leases over, three at a time: k#1 in the second batch
        world.grant(world.until(b, "publish"), "ack")
    world.until(a, "claim")  # a settles (fenced), takes its claim ahead: lost, so sends nothing
    assert world.finish() == []
    assert sent(world, "k")[0] == (1, 2, b.name)
    assert all(relay != a.name for seq, _, relay in sent(world, "k") if seq == 1)


def test_a_renewal_that_lands_after_a_takeover_does_not_make_a_late_send_safe(
    world: World,
) -> None:
    # a's renewal is sent in time but held up in the network while its lease runs out and c
    # (batches of one) takes one of a's rows over. When it lands it keeps only the other row: a
    # sends neither (its batch is no longer all its own), and certainly not the one c sent.
    a, _ = world.relays
    c = world.start_relay(batch_size=1)
    world.commit_now(None, None)
    world.until(a, "publish")
    world.advance(LEASE * 0.4)
    world.heartbeat(a)  # the renewal is on its way…
    world.advance(LEASE * 0.7)  # …held up past the lease
    world.grant(world.until(c, "publish"), "ack")  # c takes one of a's rows and sends it
    world.grant(world.first(a, "extend"))  # a's renewal lands: one row lost, one kept
    world.grant(world.first(a, "publish"), "ack")
    assert [s.relay for s in world.ledger.sends] == [c.name]
    assert world.finish() == []


def test_a_recheck_queued_behind_a_settle_waits_for_nothing_and_the_next_claim_releases(
    world: World,
) -> None:
    # A producer commits k#2 while a's settle of k#1 is open, so its commit queues a recheck; b
    # claims before a commits, and its claim runs the rechecks: it must neither wait for a's
    # settle nor decide on the k#1 it still sees (that would strand k#2 for good), but leave
    # the check for a claim after a's outcome.
    a, b = world.relays
    world.commit_now("k")
    world.until(a, "settle")
    world.hold(world.first(a, "settle"))
    world.commit_now("k")  # never waits for a (its predecessor is locked: a recheck is queued)
    world.grant(world.until(b, "claim"))
    assert world.in_flight == []  # b's claim did not wait for a's settle
    world.finish_held(world.held[0])
    assert world.finish() == []
    assert [seq for seq, _, _ in sent(world, "k")] == [1, 2]


def test_a_repeatable_read_producer_older_than_a_release_retries_instead_of_stranding(
    world: World,
) -> None:
    a, _ = world.relays
    world.commit_now("k")
    world.until(a, "publish")
    world.grant(world.first(a, "publish"), "return")  # k#1 dead: the key is blocked
    world.until(a, "connect")
    producer = world.producers[0]
    world.begin(producer, repeatable=True)  # its snapshot sees the block
    world.release("k", replay=False)
    world.enqueue(producer, "k")  # a serialization failure: the transaction is rolled back
    assert not producer.open
    world.commit_now("k")  # the retry
    assert world.finish() == []
    assert [seq for seq, _, _ in sent(world, "k")] == [1, 2]


def test_a_repeatable_read_producer_older_than_a_replay_retries_instead_of_stranding(
    world: World,
) -> None:
    a, _ = world.relays
    world.commit_now("k")
    world.until(a, "publish")
    world.grant(world.first(a, "publish"), "return")
    world.until(a, "connect")
    producer = world.producers[0]
    world.begin(producer, repeatable=True)
    world.replay(world.dead_ids()[0])  # k#1 back in its place…
    world.until(a, "publish")
    world.grant(world.first(a, "publish"), "ack")  # …and published again, archived
    world.until(a, "connect")
    world.enqueue(producer, "k")
    assert not producer.open
    world.commit_now("k")
    assert world.finish() == []
    assert [seq for seq, _, _ in sent(world, "k")] == [1, 1, 2]


def test_a_release_waits_for_a_settle_that_saw_the_key_blocked(world: World) -> None:
    a, b = world.relays
    world.policy("block", 3)
    world.commit_now("k")
    world.until(a, "publish")  # a holds k#1 alone
    world.commit_now("k", "k", "k", "k", "k")  # k#2, k#3 may go too (three at a time)
    world.until(b, "publish")  # b holds k#2 and k#3
    world.grant(world.first(a, "publish"), "return")  # k#1 dies: the key blocks
    world.until(a, "connect")
    world.grant(world.first(b, "publish"), "ack")
    world.hold(world.until(b, "settle"))  # b archives k#2, k#3 and finds the key blocked
    world.release("k", replay=False)  # the operator waits for b's settle…
    assert [who for who, _ in world.in_flight] == ["operator"]
    world.finish_held(world.held[0])  # …and then sees k#2 and k#3 gone
    assert world.finish() == []
    assert sorted(seq or 0 for seq, _, _ in sent(world, "k")) == [1, 2, 3, 4, 5, 6]


def test_a_producer_commit_never_waits_for_a_settle_of_its_predecessors(world: World) -> None:
    a, _ = world.relays
    world.commit_now("a", "b")
    world.until(a, "settle")
    world.hold(world.first(a, "settle"))  # a's settle deleted a#1 and b#1, not yet committed
    world.commit_now("a", "b")  # checks that the COMMIT did not wait (and did not fail)
    world.finish_held(world.held[0])
    assert world.finish() == []
    assert [seq for seq, _, _ in sent(world, "a")] == [1, 2]
    assert [seq for seq, _, _ in sent(world, "b")] == [1, 2]


def test_a_keyed_row_released_at_commit_while_a_relay_holds_the_doorbell_never_waits(
    world: World,
) -> None:
    # Migration 0023: while a relay sleeps holding the doorbell, a producer's ring fails NOWAIT —
    # here inside the key gate's trigger at COMMIT, releasing a row whose predecessor a settle
    # removed meanwhile — and notifies instead. The COMMIT must neither wait nor fail, and the
    # key keeps its order. (Every other case runs with the doorbell on and nobody holding it:
    # each ring then takes the lock instead.)
    a, _ = world.relays
    bell = Doorbell(world.url, "outbox")
    serving = world.loop.create_task(bell.run())
    try:
        bell.arm()
        world.run(asyncio.wait_for(bell.armed.wait(), 10))
        world.commit_now("k")
        late = world.producers[0]
        world.begin(late, repeatable=False)
        world.enqueue(late, "k")  # k#2, gated behind k#1
        world.grant(world.until(a, "publish"), "ack")
        world.grant(world.until(a, "settle"))  # k#1 settled: k#2 is released at late's COMMIT
        world.commit(late)  # checks that the COMMIT did not wait (and did not fail)
        assert bell.armed.is_set()
    finally:
        serving.cancel()
        world.run(asyncio.gather(serving, return_exceptions=True))
    assert world.finish() == []
    assert [seq for seq, _, _ in sent(world, "k")] == [1, 2]


# -- one lane (issue 43): cursors, the rescue, frozen relays ------------------------------


def test_a_row_whose_producer_commits_after_later_ones_is_sent(world: World) -> None:
    # The first producer's transaction takes its row first and commits last: relay a's cursor
    # has passed the later rows by then, and a must still find it (its claim looks back a
    # second behind its cursor).
    a, _ = world.relays
    early = world.producers[0]
    world.begin(early, repeatable=False)
    world.enqueue(early, None)
    world.commit_now(None, None)
    world.grant(world.until(a, "publish"), "ack")  # the two later rows
    world.until(a, "claim")  # settled; a's next claim finds nothing new…
    world.grant(world.first(a, "claim"))
    world.commit(early)  # …until the early one commits
    world.grant(world.until(a, "publish"), "ack")
    first, second, third = world.ledger.sends[:3]
    assert third.relay == a.name
    assert third.attempt == 1
    assert third.message_id not in {first.message_id, second.message_id}
    assert world.finish() == []


def test_a_row_placed_long_before_its_commit_waits_for_the_rescue(world: World) -> None:
    # A row committed far behind every cursor (placed at its insert, which was long ago: a long
    # transaction, a stalled flush): claims do not look back that far; the rescue finds it, and
    # the next claim sends it, once, at its first attempt.
    a, _ = world.relays
    world.grant(world.until(a, "claim"))  # a's cursors: now
    world.run(
        world.monitor.execute(
            "SELECT outbox.enqueue('x', 'k', '', available_at => now() - interval '1 minute')"
        )
    )
    world.ledger.committed.update(world.waiting_ids())
    world.grant(world.until(a, "claim"))
    assert world.ledger.sends == []  # behind the cursor and its look-back
    assert world.rescue(a) == 1
    world.grant(world.until(a, "publish"), "ack")
    assert [(s.relay, s.attempt) for s in world.ledger.sends] == [(a.name, 1)]
    assert world.finish() == []


def test_a_late_settle_of_a_row_taken_over_after_its_lease_is_fenced(world: World) -> None:
    # a publishes a row and stalls before settling; its lease runs out, b claims the row again
    # and sends it (attempt 2). a's settle then lands: it must not archive the row a second time,
    # nor undo b's claim.
    a, b = world.relays
    world.commit_now(None)
    world.grant(world.until(a, "publish"), "ack")
    settle = world.until(a, "settle")
    world.advance(LEASE * 1.1)
    world.grant(world.until(b, "publish"), "ack")
    world.grant(settle)
    assert [(s.relay, s.attempt) for s in world.ledger.sends] == [(a.name, 1), (b.name, 2)]
    assert world.finish() == []


def test_rows_of_a_claim_held_open_are_sent_once_it_rolls_back(world: World) -> None:
    # a's claim locks both rows, uncommitted; b's claims skip them (SKIP LOCKED). a dies before
    # its commit: b, alone now, must send both, once.
    a, b = world.relays
    world.commit_now(None, None)
    world.hold_claim(world.until(a, "claim"))
    world.grant(world.until(b, "claim"))
    world.crash(a)
    world.grant(world.until(b, "publish"), "ack")
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert {s.relay for s in world.ledger.sends} == {b.name}
    assert world.finish() == []


def test_rows_a_rolled_back_claim_leaves_behind_the_cursors_are_found_by_the_rescue(
    world: World,
) -> None:
    # The same, but the rows are old (due a minute ago) and b's claims moved past them while a's
    # claim held them: when it rolls back they are behind b's cursor and its look-back. Nothing
    # may send them twice; b's rescue finds them, and b sends them, once, as first attempts.
    a, b = world.relays
    for _ in range(2):
        world.run(
            world.monitor.execute(
                "SELECT outbox.enqueue('x', 'k', '', available_at => now() - interval '1 minute')"
            )
        )
    world.ledger.committed.update(world.waiting_ids())
    world.hold_claim(world.until(a, "claim"))
    world.grant(world.until(b, "claim"))  # skips them: b's cursor is past them now
    world.crash(a)
    world.grant(world.until(b, "claim"))
    assert world.ledger.sends == []
    assert world.rescue(b) == 1
    world.grant(world.until(b, "publish"), "ack")
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert [s.attempt for s in world.ledger.sends] == [1, 1]
    assert world.finish() == []


def test_a_rescue_under_an_open_claim_takes_nothing_and_the_claim_sends_its_rows(
    world: World,
) -> None:
    # b's rescue runs while a's claim of old rows is still open (a relay stalled mid-claim): it
    # moves b's cursor back to them but takes nothing, b's claim skips them without waiting, and
    # when a's claim commits after all, a sends them, and no one else.
    a, b = world.relays
    world.run(
        world.monitor.execute(
            "SELECT outbox.enqueue('x', 'k', '', available_at => now() - interval '1 minute')"
        )
    )
    world.ledger.committed.update(world.waiting_ids())
    world.hold_claim(world.until(a, "claim"))
    world.grant(world.until(b, "claim"))
    world.rescue(b)
    world.grant(world.until(b, "claim"))
    assert world.in_flight == []
    world.end_held_claim(world.held_claims[0], "commit")
    world.grant(world.until(a, "publish"), "ack")
    assert {s.relay for s in world.ledger.sends} == {a.name}
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert world.finish() == []


def test_a_relay_starting_while_a_claim_holds_rows_takes_them_when_it_rolls_back(
    world: World,
) -> None:
    # A new relay's first claim starts from the beginning; a's rows are locked by its open claim
    # and skipped; when that claim rolls back, the new relay sends them.
    a, _ = world.relays
    world.commit_now(None, None)
    world.hold_claim(world.until(a, "claim"))
    c = world.start_relay()
    world.grant(world.until(c, "claim"))
    world.crash(a)
    world.grant(world.until(c, "publish"), "ack")
    assert {s.relay for s in world.ledger.sends} == {c.name}
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert world.finish() == []


def test_a_claim_that_commits_after_its_lease_ran_out_is_sent_once_by_another(
    world: World,
) -> None:
    # a's claim is held open until its lease (which runs from the claim's start) has ended, then
    # commits, lost to a, which never sends it. b's claims and rescues must find it, and b send
    # it, once, as a second attempt.
    a, b = world.relays
    world.commit_now(None)
    world.hold_claim(world.until(a, "claim"))
    held = world.held_claims[-1]
    world.advance(LEASE * 1.5)
    world.grant(world.until(b, "claim"))  # nothing to see yet
    world.end_held_claim(held, "lost")
    world.rescue(b)
    world.grant(world.until(b, "publish"), "ack")
    assert [(s.relay, s.attempt) for s in world.ledger.sends] == [(b.name, 2)]
    assert world.finish() == []


def test_a_frozen_relay_holds_nothing_the_others_need(world: World) -> None:
    # a claims k#1 and unkeyed rows, and freezes before publishing (SIGSTOP while it reads its
    # claim: the claim has committed). b sends what commits meanwhile — another key, unkeyed —
    # at once; k#2 waits behind k#1, and once a's lease runs out b sends k#1 (attempt 2), then
    # k#2: a's rows waited for their lease, and nothing else waited at all.
    a, b = world.relays
    world.commit_now("k", None)
    world.until(a, "publish")
    world.freeze(a)
    world.commit_now("k", "j", None)
    world.grant(world.until(b, "publish"), "ack")
    assert sorted(s.key or "-" for s in world.ledger.sends) == ["-", "j"]
    assert world.in_flight == []
    world.advance(LEASE * 1.1)
    assert world.finish() == []
    assert [(seq, attempt) for seq, attempt, _ in sent(world, "k")] == [(1, 2), (2, 1)]


def test_a_settle_and_a_renewal_of_one_claim_never_wait_on_each_other(world: World) -> None:
    # a's settle is held open while its heartbeat renews the same claim: the renewal must not
    # wait for the settle (it skips the rows being settled), so the two cannot deadlock.
    a, _ = world.relays
    world.commit_now("k", None)
    world.grant(world.until(a, "publish"), "ack")
    world.hold(world.until(a, "settle"))
    world.advance(LEASE * 0.5)
    world.heartbeat(a)
    for call in [c for c in a.pending if c.method == "extend"]:
        world.grant(call)
    assert world.in_flight == []
    world.finish_held(world.held[0])
    assert world.finish() == []


def test_an_id_given_twice_is_refused_and_sent_once(world: World) -> None:
    # p begins (REPEATABLE READ) before another transaction commits id X; then p passes X too.
    # Its snapshot does not see X: the unique index refuses it all the same (DuplicateMessage,
    # and p's transaction is over), and X goes out once.
    producer = world.producers[0]
    world.begin(producer, repeatable=True)
    world.commit_now(None)
    (given,) = world.waiting_ids()
    world.enqueue(producer, None, given)
    assert not producer.open
    assert world.finish() == []
    assert [s.message_id for s in world.ledger.sends] == [given]


def test_an_id_given_again_while_a_settle_of_it_is_open_waits_for_that_settle_alone(
    world: World,
) -> None:
    # p begins (REPEATABLE READ) before X commits, so its own look for X finds nothing. Relay a
    # claims X, publishes it, and its settle (archiving X) is held open. p passes X: the unique
    # index cannot decide until a's transaction ends, so the insert waits for it, as any unique
    # check must (found by the property test as a hang: the world gives such an enqueue up,
    # since it cannot wait on an actor it drives). X goes out exactly once.
    a, _ = world.relays
    producer = world.producers[0]
    world.begin(producer, repeatable=True)
    world.commit_now(None)
    (given,) = world.waiting_ids()
    world.until(a, "settle")
    world.hold(world.first(a, "settle"))
    world.enqueue(producer, None, given)
    assert not producer.open  # given up, its transaction rolled back: the world did not hang
    world.finish_held(world.held[0])
    assert world.finish() == []
    assert [s.message_id for s in world.ledger.sends] == [given]


def test_a_relay_of_the_previous_release_alone_releases_keys_a_race_left_gated(
    database_url: str,
) -> None:
    # Rolled back to the previous release (0.2): its relay knows nothing of rescues. A producer
    # commits k#2 while its settle of k#1 is open (a recheck is queued); its next claim — its
    # own statement — runs the rechecks all the same (migration 0026's trigger): k#2 goes.
    reset(database_url)
    world = World(database_url)
    try:
        old = world.start_relay(legacy_release=True)
        world.commit_now("k")
        world.hold(world.until(old, "settle"))
        world.commit_now("k")
        world.finish_held(world.held[0])
        world.grant(world.until(old, "publish"), "ack")
        assert [seq for seq, _, _ in sent(world, "k")] == [1, 2]
        assert [s.relay for s in world.ledger.sends] == [old.name, old.name]
        assert world.finish() == []
    finally:
        world.close()


def test_relays_of_two_releases_share_the_rows_and_keep_keys_in_order(
    database_url: str,
) -> None:
    # A rolling upgrade: a relay of the previous release beside one of this release, over keyed
    # and unkeyed rows, one dying mid-batch; each row goes out under one claim at a time, keys in
    # order.
    reset(database_url)
    world = World(database_url)
    try:
        old = world.start_relay(legacy_release=True)
        new = world.start_relay()
        world.commit_now("k", "k", None, "j", None, "k")
        world.grant(world.until(old, "publish"), "ack")
        world.grant(world.until(new, "publish"), "nack")
        world.until(old, "publish")
        world.crash(old)
        world.advance(LEASE * 1.1)
        world.commit_now("j", None)
        assert world.finish() == []
        assert [seq for seq, _, _ in sent(world, "k")][:3] == [1, 2, 3]
    finally:
        world.close()


def test_a_blocked_key_keeps_its_concurrency_until_released(world: World) -> None:
    # Two lanes: a#3 goes dead (blocking a), a#4 beside it is archived. The policy turns to one
    # lane and a#5 is enqueued while a is blocked; then a#3 is replayed. a#5 must wait for it: a
    # blocked key is not idle, so it keeps two lanes (a#5's predecessor is a#3) until released.
    # Until migration 0016, a#5 took the new policy, looked for its predecessor at a#4, found it
    # gone, and the replay let it go first.
    a, _ = world.relays
    world.policy("block", 2)
    world.commit_now("a", "a", "b", "a", "a")
    world.grant(world.until(a, "publish"), "ack")  # a#1, a#2, b#1
    world.grant(world.until(a, "publish"), "return_first")  # a#3 returned: dead; a#4 acked
    world.until(a, "claim")
    world.policy("block", 1)
    world.commit_now("a")
    world.replay(world.dead_ids()[0])
    assert world.finish() == []
    assert [seq for seq, _, _ in sent(world, "a")][-2:] == [3, 5]


def test_a_successor_claimed_by_its_predecessors_settle_is_no_ones_until_that_commits(
    world: World,
) -> None:
    # Migration 0020: a settle releases k#2 and claims it in the same UPDATE, for its relay's next
    # batch. While that settle is open, b's claim must not get k#2 (for b it is still gated, and
    # locked); once it commits, a sends k#2 with its first attempt — without claiming again.
    a, b = world.relays
    world.commit_now("k", "k")
    world.hold(world.until(a, "settle"))  # k#1 published and acked; its settle left open
    world.grant(world.until(b, "claim"))
    world.until(b, "connect")  # b's claim found nothing: it starts its next cycle
    world.finish_held(world.held[0])
    granted = []
    while not world.grantable("publish"):
        granted.append(a.pending[0].method)
        world.grant(a.pending[0])
    assert "claim" not in granted  # k#2 came with the settle
    world.grant(world.first(a, "publish"), "ack")
    assert sent(world, "k") == [(1, 1, a.name), (2, 1, a.name)]
    assert world.finish() == []


def test_a_settle_that_claims_and_rolls_back_changes_nothing(world: World) -> None:
    # The settle's connection breaks before it commits: k#1 is still a's claim (not archived),
    # k#2 still gated — b can take neither. a settles again, and k#2 goes once, after k#1.
    a, b = world.relays
    world.commit_now("k", "k")
    world.hold(world.until(a, "settle"))
    world.finish_held(world.held[0], "rollback")
    world.grant(world.until(b, "claim"))
    world.until(b, "connect")
    assert sent(world, "k") == [(1, 1, a.name)]
    world.grant(world.first(a, "settle"))  # the settle again, which claims k#2 this time
    world.grant(world.until(a, "publish"), "ack")
    assert sent(world, "k") == [(1, 1, a.name), (2, 1, a.name)]
    assert world.finish() == []


def test_a_settle_that_claimed_unbeknown_to_its_relay_leaves_the_successor_to_its_lease(
    world: World,
) -> None:
    # The settle commits but its relay hears of a broken connection: k#1 is archived and k#2
    # claimed under a claim id a never learnt. a settles again (nothing is left to settle) and
    # does not send k#2; nobody does until that claim's lease runs out — then once, attempt 2.
    a, b = world.relays
    world.commit_now("k", "k")
    world.hold(world.until(a, "settle"))
    world.finish_held(world.held[0], "lost")
    world.grant(world.first(a, "settle"))  # settles nothing; claims nothing of k
    for relay in (a, b):
        world.grant(world.until(relay, "claim"))
    assert sent(world, "k") == [(1, 1, a.name)]
    world.advance(LEASE * 1.1)
    assert world.finish() == []
    assert [(seq, attempt) for seq, attempt, _ in sent(world, "k")] == [(1, 1), (2, 2)]


def test_a_relay_stopping_while_its_claim_ahead_is_in_flight_gives_that_batch_back(
    world: World,
) -> None:
    # The batch claimed ahead lives in the lease keeper, not in the cycle that asked for it: a
    # relay told to stop before that claim returned must wait for it and give its rows back (due
    # at once, the attempt refunded), not leave them to run out their lease.
    a = world.relays[0]
    world.commit_now(None, None, None, "k", "k", "k")
    world.until(a, "publish")  # a full batch of three: a is claiming the next one ahead
    ahead = world.first(a, "claim")
    a.stopping = True
    world.grant(world.first(a, "publish"), "ack")
    world.grant(world.until(a, "settle"))  # the first batch settles…
    while [c for c in a.pending if c is not ahead]:  # …and the cycle ends
        world.grant(next(c for c in a.pending if c is not ahead))
    assert a.pending == [ahead]  # the cycle is over: the stop waits for the claim ahead
    world.grant(ahead)  # which lands only now, holding k#1…
    world.grant(world.until(a, "settle"))  # …and is given back
    assert a.stopped
    assert world.finish() == []
    # Sent by the others (the drain's), in order, each at its first attempt: a sent none of them.
    assert [(seq, attempt) for seq, attempt, _ in sent(world, "k")] == [(1, 1), (2, 1), (3, 1)]
    assert all(relay != a.name for _, _, relay in sent(world, "k"))


def test_an_expired_lease_taken_while_a_batch_of_one_is_claimed_ahead_claims_no_second(
    database_url: str,
) -> None:
    # With batches of one, every batch is full, so the relay claims the next one while it
    # publishes. A row whose lease ran out, taken in the same cycle, is a full batch of one too:
    # it must not claim a second batch ahead over the first (which crashed the relay, or left the
    # first held and renewed for ever, neither sent nor given back).
    reset(database_url)
    world = World(database_url)
    try:
        dying = world.start_relay(batch_size=1)
        world.commit_now(None)
        world.until(dying, "publish")  # it holds the row, and dies with it
        world.crash(dying)
        world.advance(LEASE * 1.1)  # its lease has run out
        world.commit_now(None, None, None)
        a = world.start_relay(batch_size=1)
        for _ in range(60):  # a's cycles: a batch of one, the one claimed ahead, the orphan…
            if not a.pending:
                break
            world.grant(a.pending[0], "ack")
        assert not a.task.done(), "the relay's loop ended"
        assert world.finish() == []
        assert len({s.message_id for s in world.ledger.sends}) == 4
    finally:
        world.close()


def test_a_successor_its_settle_has_no_room_for_is_released_and_sent_once_by_another(
    world: World,
) -> None:
    # Migration 0028: a settle's claim takes the successor it frees only in the room the due rows
    # leave. Here they fill a's next batch, so k#2 is released, not claimed: b takes it, once,
    # after k#1, while a sends the unkeyed rows.
    a, b = world.relays
    world.commit_now("k", "k")
    world.grant(world.until(a, "claim"))  # k#1 alone: k#2 is gated
    world.commit_now(None, None, None)  # three due rows: a full batch behind k#1
    world.grant(world.until(a, "settle"))  # archives k#1, claims the three, releases k#2
    world.grant(world.until(b, "claim"))
    world.grant(world.until(b, "publish"), "ack")
    assert sent(world, "k") == [(1, 1, a.name), (2, 1, b.name)]
    assert world.finish() == []
