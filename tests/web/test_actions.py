"""The console's bulk actions against a real PostgreSQL: asked once, acting on what was counted,
recorded, each row once however two operators start them, and the orders of events worried
about (a slow runner, an action that ends while another starts)."""

from __future__ import annotations

import re
import threading
from typing import Any

import psycopg
from starlette.testclient import TestClient

from relay.core.filters import DeadFilter
from relay.postgres import actions, browse
from tests.integration.test_dead_letters import insert_dead
from tests.web.support import csrf, dead_ids, until_ended, waiting


def test_replay_all_matching_asks_once_moves_each_row_and_is_recorded(
    web: TestClient, database_url: str
) -> None:
    ids = insert_dead(database_url, [{"reason": "unroutable"}] * 5 + [{"reason": "rejected"}])
    page = web.get("/dead", params={"reason": "unroutable"}).text
    token = csrf(page)
    confirm = web.post(
        "/dead/confirm",
        data={"csrf": token, "kind": "replay", "scope": "all", "reason": "unroutable"},
    )
    assert confirm.status_code == 200
    assert "Replay 5 dead letters?" in confirm.text
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', confirm.text))
    done = web.post("/dead/act", data=fields, follow_redirects=False)
    assert done.status_code == 303
    action_id = int(done.headers["location"].rsplit("/", 1)[1])
    assert until_ended(web, action_id) == "finished"
    assert sorted(waiting(database_url)) == sorted(ids[:5])
    assert dead_ids(database_url) == {ids[5]}
    with psycopg.connect(database_url) as conn:
        who, kind, flt, matched, done_rows, state = (
            conn.execute(
                "SELECT who, kind, filter, matched, done, state FROM outbox.console_actions"
            ).fetchone()
            or ()
        )
    assert (kind, flt, matched, done_rows, state) == (
        "replay",
        {"reasons": ["unroutable"]},
        5,
        5,
        "finished",
    )
    assert who.endswith("@localhost")
    again = web.post("/dead/act", data=fields)
    assert again.status_code == 409
    assert f"#{action_id}" in again.text
    assert "No row matches this filter any more" in again.text


def test_two_replays_of_one_filter_at_once_send_each_row_once(database_url: str) -> None:
    ids = insert_dead(database_url, [{"reason": "unroutable"}] * 3000)
    browser = browse.Browser(database_url)
    browser.open()
    runner = actions.Actions(database_url, browser.count)
    where = DeadFilter(reasons=("unroutable",))
    upto = browser.last_dead()
    outcomes: list[Any] = []
    go = threading.Barrier(2)

    def start(who: str) -> None:
        go.wait()
        outcomes.append(runner.start("replay", who, where, upto, batch=100))

    threads = [threading.Thread(target=start, args=(w,)) for w in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    runner.join(timeout=120)
    browser.close()
    started = [o for o in outcomes if isinstance(o, actions.Started)]
    told = [o for o in outcomes if isinstance(o, actions.Already)]
    assert len(started) == 1
    assert len(told) == 1
    assert told[0].action is not None
    assert told[0].action.id == started[0].action.id
    sent = waiting(database_url)
    assert sorted(sent) == sorted(ids)  # every row once: no message_id twice
    final = runner.get(started[0].action.id)
    assert final is not None
    assert (final.state, final.done) == ("finished", 3000)


def test_an_action_acts_on_what_its_confirm_page_counted(
    web: TestClient, database_url: str
) -> None:
    insert_dead(database_url, [{"exchange": "e"}] * 3)
    token = csrf(web.get("/dead").text)
    confirm = web.post(
        "/dead/confirm", data={"csrf": token, "kind": "purge", "scope": "all", "exchange": "e"}
    )
    assert "Purge 3 dead letters?" in confirm.text
    fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', confirm.text))
    (later,) = insert_dead(database_url, [{"exchange": "e"}])  # died after the count was shown
    done = web.post("/dead/act", data=fields, follow_redirects=False)
    assert done.status_code == 303
    action_id = int(done.headers["location"].rsplit("/", 1)[1])
    assert until_ended(web, action_id) == "finished"
    assert dead_ids(database_url) == {later}
    assert web.post("/dead/act", data=fields | {"upto": "x"}).status_code == 400


def test_a_slow_action_whose_runner_is_alive_is_never_taken_over(database_url: str) -> None:
    """The order of events worried about: a runner stuck in a long batch (no beat for over a
    minute) while a second operator starts the same action."""
    insert_dead(database_url, [{"exchange": "slow"}] * 10)
    browser = browse.Browser(database_url)
    browser.open()
    runner = actions.Actions(database_url, browser.count)
    where = DeadFilter(exchange="slow")
    chosen = actions.selection("replay", where)
    lock_class = runner._lock_class
    try:
        with psycopg.connect(database_url, autocommit=True) as alive:
            (old,) = (
                alive.execute(
                    "INSERT INTO outbox.console_actions (kind, who, filter, selection, upto,"
                    " matched, beat_at) VALUES ('replay', 'alice', '{}', %s, 0, 10,"
                    " now() - interval '1 hour') RETURNING id",
                    (chosen,),
                ).fetchone()
                or ()
            )
            alive.execute("SELECT pg_advisory_lock(%s, %s)", (lock_class, old))
            told = runner.start("replay", "bob", where, browser.last_dead())
            assert isinstance(told, actions.Already)
            assert told.running
            assert told.action is not None
            assert told.action.id == old
        # Its session is gone: the lock with it. Now it is stale, and a new start goes on.
        started = runner.start("replay", "bob", where, browser.last_dead())
        assert isinstance(started, actions.Started)
        runner.join(timeout=60)
        interrupted = runner.get(old)
        assert interrupted is not None
        assert interrupted.state == "interrupted"
        assert len(waiting(database_url)) == 10
    finally:
        browser.close()


def test_an_action_that_ends_between_the_count_and_the_record_is_named_not_repeated(
    database_url: str,
) -> None:
    """The order of events worried about: bob's start counts the rows (some left), alice's
    action of the same filter takes the last of them and ends, then bob's start records its
    own. Bob is told about alice's action; his own is recorded as having found nothing."""
    insert_dead(database_url, [{"exchange": "raced"}] * 4)
    browser = browse.Browser(database_url)
    browser.open()
    where = DeadFilter(exchange="raced")
    counts = 0

    def count(where: DeadFilter, upto: int) -> int:
        nonlocal counts
        counts += 1
        if counts == 2:  # after bob's first count and his record: alice came and went between
            with psycopg.connect(database_url, autocommit=True) as conn:
                conn.execute(
                    "INSERT INTO outbox.console_actions (kind, who, filter, selection, upto,"
                    " matched, done, state, finished_at) VALUES ('purge', 'alice', '{}', %s, 0,"
                    " 4, 4, 'finished', now())",
                    (actions.selection("purge", where),),
                )
                conn.execute("DELETE FROM outbox.dead WHERE exchange = 'raced'")
        return browser.count(where, upto)

    try:
        runner = actions.Actions(database_url, count)
        told = runner.start("purge", "bob", where, browser.last_dead())
        assert isinstance(told, actions.Already)
        assert not told.running
        assert told.action is not None
        assert told.action.who == "alice"
        with psycopg.connect(database_url) as conn:
            bobs = conn.execute(
                "SELECT state, done, detail FROM outbox.console_actions WHERE who = 'bob'"
            ).fetchall()
        assert bobs == [("finished", 0, "nothing left to act on")]
    finally:
        browser.close()
