"""The orders of events that once broke the protocol (issue 17's findings, and one found while
fixing them), each replayed step by step in the interleaving world. Every case ends with the
world's own checks: nothing sent that should not have been, and everything drained in order."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from relay.postgres.doorbell import Doorbell
from relay.postgres.store import FULL_ORPHAN_PASS_EVERY, LATE_COMMIT
from relay.postgres.window import STRAGGLER_WAIT, SWEEP_AFTER
from tests.interleavings.world import LEASE, RelayActor, World, reset


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
    # Nothing renews a's claim ahead for a whole lease (no heartbeat step); b takes k#1 over as
    # an orphan and sends it. a's next cycle finds its claim lost and must not send it too.
    a, b = world.relays
    world.commit_now(None, None, None, "k", "k", "k")
    world.until(a, "publish")
    world.grant(world.first(a, "claim"))  # the claim ahead: k#1
    world.grant(world.first(a, "publish"), "ack")
    world.advance(LEASE * 1.1)
    for _ in range(3):  # b takes a's first batch over, one orphan at a time…
        world.grant(world.until(b, "publish"), "ack")
    world.advance(LEASE * 0.6)  # …and, at its next look for orphans, k#1
    world.grant(world.until(b, "publish"), "ack")
    world.until(a, "claim")  # a settles (fenced), takes its claim ahead: lost, so sends nothing
    assert world.finish() == []
    assert sent(world, "k")[0] == (1, 2, b.name)
    assert all(relay != a.name for seq, _, relay in sent(world, "k") if seq == 1)


def test_a_renewal_that_lands_after_a_takeover_does_not_make_a_late_send_safe(
    world: World,
) -> None:
    # a's renewal is sent in time but held up in the network while its lease runs out and b takes
    # one of a's rows over. When it lands it keeps only the other row: a sends neither (its
    # batch is no longer all its own), and certainly not the one b sent.
    a, b = world.relays
    world.commit_now(None, None)
    world.until(a, "publish")
    world.advance(LEASE * 0.4)
    world.heartbeat(a)  # the renewal is on its way…
    world.advance(LEASE * 0.7)  # …held up past the lease
    world.grant(world.until(b, "publish"), "ack")  # b's orphan pass takes one row and sends it
    world.grant(world.first(a, "extend"))  # a's renewal lands: one row lost, one kept
    world.grant(world.first(a, "publish"), "ack")
    assert [s.relay for s in world.ledger.sends] == [b.name]
    assert world.finish() == []


def test_a_recheck_waits_for_the_settle_it_was_queued_behind(world: World) -> None:
    # Found while fixing the key gate: a producer commits k#2 while a's settle of k#1 is open, so
    # its commit queues a recheck; b looks at the recheck before a commits. It must wait for a's
    # outcome — deciding on the k#1 it still sees would strand k#2 for good.
    a, b = world.relays
    world.commit_now("k")
    world.until(a, "settle")
    world.hold(world.first(a, "settle"))
    world.commit_now("k")  # never waits for a (its predecessor is locked: a recheck is queued)
    release = world.until(b, "release_stranded")
    world.grant(release)
    assert [who for who, _ in world.in_flight] == [b.name]  # b waits for a's settle
    world.finish_held(world.held[0])
    assert world.in_flight == []
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


# -- the ready lane (issue 18): unkeyed messages that are due at once -------------------------


def test_a_ready_row_whose_producer_commits_after_later_ones_is_sent(world: World) -> None:
    # The first producer's transaction takes its row (and xid) first and commits last: relay a's
    # window has long passed the later rows by then, and a must still find it, at once.
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


def test_a_late_settle_of_a_ready_row_taken_over_as_an_orphan_is_fenced(world: World) -> None:
    # a publishes a ready row and stalls before settling; its lease runs out, b moves the row to
    # messages as an orphan and sends it again (attempt 2). a's settle then lands: it must not
    # archive the row a second time, nor undo b's claim.
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
    # a's claim locks both ready rows and inserts their claims, uncommitted; b's claims skip them
    # (SKIP LOCKED) and find them unclaimed, so b's window stays open on them. a dies before its
    # commit: b, alone now, must send both, once.
    a, b = world.relays
    world.commit_now(None, None)
    world.hold_claim(world.until(a, "claim"))
    world.grant(world.until(b, "claim"))
    world.crash(a)
    world.grant(world.until(b, "publish"), "ack")
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert {s.relay for s in world.ledger.sends} == {b.name}
    assert world.finish() == []


def test_rows_of_a_claim_held_open_past_the_straggler_wait_are_moved_by_the_sweep(
    world: World,
) -> None:
    # The same, but a's claim stays open longer than b waits for a row it cannot claim: b's
    # window closes over the rows, and when a's claim rolls back they are behind it. Nothing may
    # send them before b's straggler sweep moves them to messages (SWEEP_AFTER after b's windows
    # passed them), and then b must, once, as a first attempt.
    a, b = world.relays
    world.commit_now(None, None)
    give_up_on_held_rows(world, a, b)
    world.crash(a)
    for _ in range(3):
        world.grant(world.until(b, "claim"))
    assert world.sweep(b) == 0  # b's windows passed them too recently
    assert world.ledger.sends == []
    world.advance(SWEEP_AFTER)
    assert world.sweep(b) == 2
    world.grant(world.until(b, "publish"), "ack")
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert [s.attempt for s in world.ledger.sends] == [1, 1]
    assert world.finish() == []


def test_a_sweep_leaves_rows_whose_claim_is_still_open_and_their_claim_sends_them(
    world: World,
) -> None:
    # b gave up on a's rows and sweeps long after, while a's claim is still open (a relay
    # stalled mid-claim): the sweep must skip them, not wait for them nor take them, and when
    # a's claim commits after all, a sends them, and no one else.
    a, b = world.relays
    world.commit_now(None, None)
    give_up_on_held_rows(world, a, b)
    world.advance(SWEEP_AFTER)
    assert world.sweep(b) == 0
    world.end_held_claim(world.held_claims[0], "commit")
    assert world.sweep(b) == 0
    world.grant(world.until(a, "publish"), "ack")
    assert {s.relay for s in world.ledger.sends} == {a.name}
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert world.finish() == []


def test_a_sweep_moves_nothing_its_relays_windows_have_not_passed(world: World) -> None:
    # Rows committed after b's windows last closed wait, unclaimed, however long: a sweep then
    # must leave them in the ready lane for the windows to claim.
    a, b = world.relays
    world.grant(world.until(b, "claim"))  # b's first window: the lane is empty
    world.commit_now(None, None, None)
    world.advance(SWEEP_AFTER * 3)
    assert world.sweep(b) == 0
    assert world.sweep(a) == 0
    world.grant(world.until(b, "publish"), "ack")
    assert {s.message_id for s in world.ledger.sends} == world.ledger.committed
    assert world.finish() == []


def test_a_relay_starting_while_a_claim_holds_rows_takes_them_when_it_rolls_back(
    world: World,
) -> None:
    # A new relay's first window starts at the first row with no committed claim (lane_start):
    # a's rows, held by its open claim. The window is verified like any other, so it stays on
    # them while they are held, and when a's claim rolls back the new relay sends them.
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


def give_up_on_held_rows(world: World, a: RelayActor, b: RelayActor) -> None:
    """a's claim of every ready row is held open; b's window stays on them past STRAGGLER_WAIT,
    then closes over them."""
    world.hold_claim(world.until(a, "claim"))
    for _ in range(2):  # the first moves b's cursor onto a's rows; from the second b waits
        world.grant(world.until(b, "claim"))
    world.advance(STRAGGLER_WAIT + 1)
    world.grant(world.until(b, "claim"))  # b gives up on them: its window closes


def test_a_claim_that_commits_just_after_its_lease_ran_out_is_found_by_the_next_look(
    world: World,
) -> None:
    # a's claim of a ready row is held open until its lease (which runs from the claim's start)
    # has ended; b looks for orphans meanwhile and cannot see it. Then it commits, lost to a,
    # which never sends it. b's next look starts where the last one ended, less LATE_COMMIT: the
    # claim's lease ended within that of the look that missed it, so b finds it and sends it.
    a, b = world.relays
    world.commit_now(None)
    world.hold_claim(world.until(a, "claim"))
    held = world.held_claims[-1]
    world.advance(LEASE + LATE_COMMIT / 2)
    world.grant(world.until(b, "release_orphans"))  # nothing to see yet
    world.end_held_claim(held, "lost")
    world.advance(LEASE * 0.6)  # b's next look
    world.grant(world.until(b, "publish"), "ack")
    assert [(s.relay, s.attempt) for s in world.ledger.sends] == [(b.name, 2)]
    assert world.finish() == []


def test_a_claim_that_commits_long_after_its_lease_ran_out_waits_for_the_look_at_every_lease(
    world: World,
) -> None:
    # The same, but the claim commits more than LATE_COMMIT after its lease ended: b's looks
    # go back no further (going back a whole lease made every look read each claim three
    # times), so the row waits for b's next look at every lease (a chore beside its loop, every
    # FULL_ORPHAN_PASS_EVERY), which must move it, and b then send it.
    a, b = world.relays
    world.commit_now(None)
    world.hold_claim(world.until(a, "claim"))
    held = world.held_claims[-1]
    world.advance(LEASE + LATE_COMMIT * 5)
    world.grant(world.until(b, "release_orphans"))
    world.end_held_claim(held, "lost")
    for _ in range(2):
        world.advance(LEASE * 0.6)
        world.grant(world.until(b, "release_orphans"))
    for _ in range(2):
        world.grant(world.until(b, "claim"))
    assert world.ledger.sends == []  # missed by the looks since: the case this is about
    world.advance(FULL_ORPHAN_PASS_EVERY)
    assert world.look_for_all_orphans(b) == 1
    world.grant(world.until(b, "publish"), "ack")
    assert [(s.relay, s.attempt) for s in world.ledger.sends] == [(b.name, 2)]
    assert world.finish() == []


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


def test_an_orphan_taken_while_a_batch_of_one_is_claimed_ahead_claims_no_second(
    database_url: str,
) -> None:
    # With batches of one, every batch is full, so the relay claims the next one while it
    # publishes. An orphan taken in the same cycle is a full batch of one too: it must not claim
    # a second batch ahead over the first (which crashed the relay, or left the first held and
    # renewed for ever, neither sent nor given back).
    reset(database_url)
    world = World(database_url)
    try:
        dying = world.start_relay(batch_size=1)
        world.commit_now(None)
        world.until(dying, "publish")  # it holds the row, and dies with it
        world.crash(dying)
        world.advance(LEASE * 1.1)  # an orphan now
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


def test_a_batch_split_in_chains_settles_its_parts_apart_with_a_renewal_between(
    world: World,
) -> None:
    # docs/decisions/0009: c splits a batch of both keys' heads in two parts, one per publisher.
    # a#1's part is confirmed and settled, claiming a#2 with that settle under a claim of its own,
    # while b#1 still waits for its confirm. A renewal between the two settles extends b#1 and
    # a#2 only; b#1's settle, under the first claim's id, still finds its row: nothing fenced,
    # nothing sent twice, every key in order.
    c = world.start_relay(chains=2)
    world.commit_now("a", "b", "a", "b")
    while len([p for p in c.pending if p.method == "publish"]) < 2:
        world.grant(next(p for p in c.pending if p.method != "publish"))
    parts = {p.messages[0].ordering_key: p for p in c.pending if p.method == "publish"}
    assert [len(p.messages) for p in parts.values()] == [1, 1]  # one head of each key per part
    (first_claim,) = c.relay.leases.held()  # both parts are of one claim
    b1 = parts["b"].messages[0].id
    world.grant(parts["a"], "ack")
    world.grant(world.until(c, "settle"))  # a#1 archived, a#2 claimed with it
    while not (others := [p for p in c.pending if p.method == "publish" and p is not parts["b"]]):
        world.grant(next(p for p in c.pending if p.method != "publish"))
    (a2,) = others
    assert a2.messages[0].ordering_key == "a"
    held = c.relay.leases.held()
    assert held[first_claim] == frozenset({b1})  # a#1 let go, b#1 still held
    assert [ids for claim, ids in held.items() if claim != first_claim] == [
        frozenset({a2.messages[0].id})  # a#2, under the claim its settle made
    ]
    world.advance(LEASE * 0.5)
    world.heartbeat(c)
    while extends := [p for p in c.pending if p.method == "extend"]:
        world.grant(extends[0])
    assert c.relay.leases.held()[first_claim] == frozenset({b1})  # the renewal kept b#1
    world.grant(parts["b"], "ack")
    settles = [p for p in c.pending if p.method == "settle"]
    while not settles:
        world.grant(next(p for p in c.pending if p.method != "publish"))
        settles = [p for p in c.pending if p.method == "settle"]
    assert settles[0].claim_id == first_claim
    world.grant(settles[0])
    world.grant(a2, "ack")
    assert world.finish() == []
    assert sent(world, "a")[:2] == [(1, 1, c.name), (2, 1, c.name)]
    assert sent(world, "b")[0] == (1, 1, c.name)
    assert [seq for seq, _, _ in sent(world, "b")] == [1, 2]
