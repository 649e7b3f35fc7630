"""The ready lane's window (relay/postgres/store.py, docs/decisions/0004): when a relay closes
it, with a clock the test moves."""

from __future__ import annotations

from types import SimpleNamespace

from relay.postgres.window import MARK_EVERY, STRAGGLER_WAIT, SWEEP_AFTER, Window


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def trailer(xid: int, id: int, closed: bool = False, hi: str = "50:60:") -> SimpleNamespace:
    return SimpleNamespace(window_hi=hi, window_xid=xid, window_id=id, window_closed=closed)


def test_a_window_whose_cursor_keeps_coming_back_to_a_held_row_closes_after_the_wait() -> None:
    # A row in the window is held by another relay's claim that never commits: each claim walks
    # back to it (the cursor lands on the same place every time). That is no progress, however
    # often it repeats; after STRAGGLER_WAIT the window closes and the next one opens.
    clock = Clock()
    window = Window(clock=clock)
    window.params()
    window.moved(trailer(40, 10))  # a page: the cursor moves on
    window.moved(trailer(40, 4))  # verified: row 5 is still unclaimed, back to it
    stuck_at = clock.now
    while window.hi is not None and clock.now < stuck_at + 10 * STRAGGLER_WAIT:
        clock.now += STRAGGLER_WAIT / 8
        window.moved(trailer(40, 4))  # the same row, still held
    assert STRAGGLER_WAIT <= clock.now - stuck_at < STRAGGLER_WAIT * 1.2
    assert window.hi is None
    assert window.prev == "50:60:"
    assert (window.xid, window.id) == ("0", 0)


def test_a_window_that_moves_forward_stays_open_however_long_it_takes() -> None:
    clock = Clock()
    window = Window(clock=clock)
    window.params()
    for step in range(1, 40):
        clock.now += STRAGGLER_WAIT / 4
        window.moved(trailer(40, step * 500))
        assert window.hi == "50:60:"
    window.moved(trailer(40, 0, closed=True))
    assert window.hi is None


def test_a_first_window_starts_at_the_first_row_with_no_claim_and_is_verified() -> None:
    # lane_start said: up to snapshot 30:35:, the first row nobody claimed is (28, 700). The
    # window is every transaction from 28 on that had committed at 30:35: (those before it are
    # claimed or, running at 30:35:, in the next window), walked from that row (the cursor is
    # exclusive) and verified like any other, not from the lane's start.
    window = Window(clock=Clock())
    needed = window.needs_start
    window.start("30:35:", 28, 700)
    assert (needed, window.needs_start) == (True, False)
    params = window.params()
    assert (params["prev"], params["hi"]) == ("28:28:", "30:35:")
    assert (params["xid"], params["cursor"], params["verify"]) == ("28", 699, True)
    window.moved(trailer(0, 0, closed=True, hi="30:35:"))
    params = window.params()
    assert (params["prev"], params["hi"], params["verify"]) == ("30:35:", None, False)


def test_a_first_window_with_nothing_unclaimed_starts_after_the_start_snapshot() -> None:
    window = Window(clock=Clock())
    window.start("30:35:31", None, None)
    params = window.params()
    assert (params["prev"], params["hi"], params["xid"], params["cursor"]) == (
        "30:35:31",
        None,
        "0",
        0,
    )


def test_later_windows_closed_unverified_are_verified_a_second_later() -> None:
    clock = Clock()
    window = Window(clock=clock)
    window.start("30:35:", None, None)
    window.moved(trailer(0, 0, closed=True, hi="40:40:"))
    assert window.params()["verify"] is False  # not yet: the verify waits a second
    window.moved(trailer(0, 0, closed=True, hi="45:45:"))
    clock.now += 1
    params = window.params()
    assert (params["prev"], params["verify"]) == ("30:35:", True)


def test_passed_is_a_snapshot_every_window_ended_after_long_enough_ago() -> None:
    clock = Clock()
    window = Window(clock=clock)
    window.start("1:1:", None, None)
    assert window.passed() is None  # nothing closed yet
    for n in range(20):  # a window closes every second, at 10:10:, 11:11:, …
        window.moved(trailer(0, 0, closed=True, hi=f"{10 + n}:{10 + n}:"))
        clock.now += 1
    assert window.passed() is None  # the oldest close is 20 s old: not yet SWEEP_AFTER
    clock.now += SWEEP_AFTER - 20 + MARK_EVERY
    passed = window.passed()
    # The newest mark at least SWEEP_AFTER old: the close of MARK_EVERY seconds after the first.
    assert passed == f"{10 + int(MARK_EVERY)}:{10 + int(MARK_EVERY)}:"
    assert window.passed() == passed  # asked again, the same (or newer), never older


def test_after_an_outage_the_window_asks_where_to_start_and_forgets_what_it_passed() -> None:
    clock = Clock()
    window = Window(clock=clock)
    window.start("30:35:", None, None)
    window.moved(trailer(40, 900))
    window.moved(trailer(0, 0, closed=True))
    clock.now += SWEEP_AFTER
    assert window.passed() is not None
    window.forget()
    assert window.needs_start
    assert window.passed() is None
    params = window.params()
    assert (params["xid"], params["cursor"], params["verify"]) == ("0", 0, False)


def test_a_server_whose_transaction_ids_went_backwards_makes_the_window_start_again() -> None:
    # claim_batch saw the server's snapshot behind the window's (a failover to an asynchronous
    # standby) and walked the whole lane; the window must not keep a lower snapshot of the old
    # timeline, which every new transaction would be behind.
    clock = Clock()
    window = Window(clock=clock)
    window.start("900:1000:", None, None)
    window.moved(trailer(0, 0, closed=True, hi="980:990:"))
    assert window.needs_start
    assert window.passed(0) is None
