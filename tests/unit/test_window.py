"""The ready lane's window (relay/postgres/store.py, docs/decisions/0004): when a relay closes
it, with a clock the test moves."""

from __future__ import annotations

from types import SimpleNamespace

from relay.postgres.window import STRAGGLER_WAIT, WHOLE_LANE, Window


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


def test_after_an_outage_the_whole_lane_is_walked_from_its_start() -> None:
    clock = Clock()
    window = Window(clock=clock)
    window.params()
    window.moved(trailer(40, 900))
    window.forget()
    params = window.params()
    assert params["prev"] == WHOLE_LANE
    assert params["hi"] is None
    assert (params["xid"], params["cursor"]) == ("0", 0)
    assert params["verify"] is True
