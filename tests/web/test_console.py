"""The web console against a real PostgreSQL, through Starlette's test client (HTTP without a
socket): pages, filters, and the boundary (auth, CSRF, roles, bad input, security headers).
Bulk actions: tests/web/test_actions.py; in Chromium: tests/web/test_browser.py."""

from __future__ import annotations

import html
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from starlette.testclient import TestClient

from relay.cli.commands import main
from relay.postgres import browse
from relay.web import app, security
from tests.integration.test_dead_letters import insert_dead
from tests.web.support import block_key, client, csrf, dead_ids, waiting


def test_every_page_answers_with_the_security_headers(web: TestClient, database_url: str) -> None:
    insert_dead(database_url, [{"ordering_key": "k1", "seq": 1}])
    for path in ("/", "/dead", "/keys", "/actions", "/static/htmx.min.js"):
        response = web.get(path)
        assert response.status_code == 200, path
        csp = response.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp
        assert "script-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert response.headers["x-frame-options"] == "DENY"
    page = web.get("/").text
    assert not re.search(r"<script(?![^>]*\bsrc=)", page)
    assert not re.search(r"\son[a-z]+=", page)


def test_the_overview_shows_backlog_relays_horizon_and_dead_by_reason(
    web: TestClient, database_url: str
) -> None:
    insert_dead(database_url, [{"reason": "unroutable"}, {"reason": "rejected"}] * 2)
    with psycopg.connect(database_url) as conn:
        conn.execute("SELECT outbox.enqueue('orders', 'order.paid', 'x'::bytea)")
    page = web.get("/").text
    assert re.search(r"<td>orders</td><td>1</td>", page)
    assert "No relay is connected." in page
    assert 'id="horizon"' in page
    assert re.search(r"unroutable</a></td><td>2</td>", page)
    assert re.search(r"rejected</a></td><td>2</td>", page)
    live = web.get("/", headers={"HX-Request": "true"}).text
    assert "<html" not in live
    assert "orders" in live


def test_filters_and_keyset_pages(web: TestClient, database_url: str) -> None:
    now = datetime.now(UTC)
    rows = [
        {
            "reason": "unroutable",
            "routing_key": f"order.{i}",
            "failed_at": now - timedelta(minutes=i),
        }
        for i in range(7)
    ] + [{"reason": "rejected", "routing_key": "invoice.1", "failed_at": now}]
    ids = insert_dead(database_url, rows)
    page = web.get("/dead", params={"reason": "unroutable", "limit": "3"}).text
    shown = re.findall(r"<code>([0-9a-f-]{36})</code>", page)
    assert shown == [str(i) for i in ids[:3]]  # newest first
    seen = list(shown)
    while (more := re.search(r'id="next" href="/dead\?([^"]+)"', page)) is not None:
        page = web.get("/dead?" + more[1].replace("&amp;", "&")).text
        seen += re.findall(r"<code>([0-9a-f-]{36})</code>", page)
    assert seen == [str(i) for i in ids[:7]]
    page = web.get("/dead", params={"routing_key": "invoice.*"}).text
    assert re.findall(r"<code>([0-9a-f-]{36})</code>", page) == [str(ids[7])]
    page = web.get("/dead", params={"id": str(ids[4])[:8]}).text
    assert str(ids[4]) in page
    page = web.get("/dead", params={"text": str(ids[5])}).text  # the body is the id's text
    assert re.findall(r"<code>([0-9a-f-]{36})</code>", page) == [str(ids[5])]
    assert 'id="search-bound"' in page
    page = web.get("/dead", params={"exchange": "nothing-here"}).text
    assert 'id="nothing"' in page


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"reason": "bogus"}, "unknown reason"),
        ({"limit": "100000"}, "a page shows 1 to 500 rows"),
        ({"limit": "many"}, "limit must be a whole number"),
        ({"since": "yesterday-ish"}, "not a time"),
        ({"since": "1h", "until": "2h"}, "--since must be before --until"),
        ({"id": "xyz"}, "not a message id or the start of one"),
        ({"before": "!!"}, "not a page position"),
        ({"exchange": "e" * 400}, "longer than 300 characters"),
    ],
)
def test_bad_input_is_a_400_with_one_line(
    web: TestClient, params: dict[str, str], says: str
) -> None:
    response = web.get("/dead", params=params)
    assert response.status_code == 400
    assert says in response.text
    assert "Traceback" not in response.text


def test_unknown_rows_and_actions_are_404(web: TestClient) -> None:
    for path in ("/dead/999999", "/dead/abc", "/actions/424242"):
        response = web.get(path)
        assert response.status_code == 404, path
    assert web.get("/where", params={"message_id": "nope"}).status_code == 400


def test_a_message_page_shows_json_pretty_and_binary_safely(
    web: TestClient, database_url: str
) -> None:
    insert_dead(database_url, [{}, {}])
    with psycopg.connect(database_url) as conn:
        first, second = (r[0] for r in conn.execute("SELECT id FROM outbox.dead ORDER BY id"))
        conn.execute("UPDATE outbox.dead SET body = %s WHERE id = %s", (b'{"a": [1, 2]}', first))
        conn.execute(
            "UPDATE outbox.dead SET body = %s WHERE id = %s", (b"\x00\xff<script>", second)
        )
    page = html.unescape(web.get(f"/dead/{first}").text)
    assert 'data-kind="json"' in page
    assert '"a": [\n    1,' in page
    page = web.get(f"/dead/{second}").text
    assert 'data-kind="binary"' in page
    assert "00 ff 3c 73" in page
    assert "<script>" not in page.split('id="body"')[1]


def test_a_write_without_its_csrf_token_is_refused(web: TestClient, database_url: str) -> None:
    insert_dead(database_url, [{}])
    for token in (None, "0" * 64):
        form = {"kind": "replay", "scope": "all"} | ({"csrf": token} if token else {})
        response = web.post("/dead/act", data=form)
        assert response.status_code == 403
        assert "CSRF" in response.text
    assert len(dead_ids(database_url)) == 1


def test_a_viewer_login_sees_no_buttons_and_a_forged_write_is_refused(
    database_url: str,
) -> None:
    from relay.postgres import roles

    insert_dead(database_url, [{}])
    made = roles.ensure(database_url, "outbox")
    login = f"viewer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{login}" LOGIN IN ROLE "{made.viewer}"')
    url = database_url.replace("postgres@", f"{login}@", 1)
    try:
        with client(url) as c:
            page = c.get("/dead").text
            assert "Replay" not in page
            assert "select" not in page.split("<table")[1][:200]
            assert "read-only" in page
            assert 'method="post"' not in page
            who = re.search(r'id="who">([^<]+)<', page)
            assert who
            # A valid token (the page offers none): the refusal is the login's, not the form's.
            token = c.app.state.console.csrf.token(who[1])  # type: ignore[attr-defined]
            forged = c.post("/dead/act", data={"csrf": token, "kind": "purge", "scope": "all"})
            assert forged.status_code == 403
            assert "reads only" in forged.text
        assert len(dead_ids(database_url)) == 1
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{login}"')
            conn.execute(f'DROP ROLE "{login}"')


def test_read_only_mode_refuses_writes(database_url: str) -> None:
    insert_dead(database_url, [{}])
    with client(database_url, read_only=True) as c:
        page = c.get("/dead").text
        assert "Purge" not in page
        who = re.findall(r'id="who">([^<]+)<', page)[0]
        token = c.app.state.console.csrf.token(who)  # type: ignore[attr-defined]
        response = c.post("/dead/act", data={"csrf": token, "kind": "purge", "scope": "all"})
        assert response.status_code == 403
        assert "read-only mode" in response.text
    assert len(dead_ids(database_url)) == 1


def test_a_login_is_asked_for_and_checked(database_url: str, tmp_path: Any) -> None:
    users = tmp_path / "users"
    security.add_user(users, "alice", "correct horse")
    assert "correct horse" not in users.read_text()
    access = security.Access(security.read_users(users))
    with client(database_url, access=access) as c:
        response = c.get("/")
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Basic")
        health = c.get("/healthz")  # for probes: no login, and nothing but that it is up
        assert health.status_code == 200
        assert health.text == "ok"
        assert c.get("/", auth=("alice", "wrong")).status_code == 401
        assert c.get("/", auth=("mallory", "correct horse")).status_code == 401
        assert c.get("/", auth=("alice", "correct horse")).status_code == 200
        assert c.get("/static/console.css").status_code == 401
    with client(database_url, access=security.Access(trusted_header="X-Forwarded-User")) as c:
        assert c.get("/").status_code == 401
        page = c.get("/", headers={"X-Forwarded-User": "bob"})
        assert page.status_code == 200
        assert "bob" in page.text


def test_the_keys_page_releases_a_blocked_key_saying_what_it_does(
    web: TestClient, database_url: str
) -> None:
    (dead_id,) = insert_dead(database_url, [{"ordering_key": "k1", "seq": 1}])
    block_key(database_url, "k1", dead_id, 1)
    page = web.get("/keys").text
    assert "Replay it, then go on" in page
    assert "Skip it" in page
    response = web.post("/keys/release", data={"csrf": csrf(page), "key": "k1", "mode": "replay"})
    assert response.status_code == 200
    assert "goes on" in response.text
    assert waiting(database_url) == [dead_id]
    again = web.post("/keys/release", data={"csrf": csrf(page), "key": "k1", "mode": "skip"})
    assert again.status_code == 409
    assert "was not blocked" in again.text


def test_the_command_refuses_to_listen_beyond_loopback_without_a_login(tmp_path: Any) -> None:
    result = CliRunner().invoke(main, ["console", "--host", "0.0.0.0"], prog_name="outbox-relay")
    assert result.exit_code == 2
    assert "no login" in result.output
    assert "Traceback" not in result.output
    users = tmp_path / "users"
    added = CliRunner().invoke(
        main,
        ["console", "add-user", "alice", "--users-file", str(users)],
        input="s3cret\n",
        prog_name="outbox-relay",
    )
    assert added.exit_code == 0, added.output
    assert "s3cret" not in added.output
    assert "s3cret" not in users.read_text()
    assert security.check_password(security.read_users(users)["alice"], "s3cret")
    bad = CliRunner().invoke(
        main,
        ["console", "add-user", "no spaces", "--users-file", str(users)],
        input="x\n",
        prog_name="outbox-relay",
    )
    assert bad.exit_code == 2
    assert "not a user name" in bad.output


def test_without_a_login_only_this_machine_by_name_is_answered(database_url: str) -> None:
    """DNS rebinding: a page on another site that points its own name at 127.0.0.1 reaches an
    open console by that name, and is refused."""
    with TestClient(app.create_app(app.Config(database_url)), base_url="http://evil.example") as c:
        assert c.get("/").status_code == 400
    with TestClient(app.create_app(app.Config(database_url)), base_url="http://localhost") as c:
        assert c.get("/").status_code == 200


@pytest.mark.parametrize(
    ("path", "form", "says"),
    [
        ("/dead/confirm", {"kind": "delete-everything", "scope": "all"}, "replay or purge"),
        ("/dead/act", {"kind": "replay", "scope": "all", "since": "later"}, "not a time"),
        ("/dead/act", {"kind": "replay", "scope": "selected"}, "select at least one row"),
        ("/dead/act", {"kind": "replay", "scope": "all", "ids": "nope"}, "not a message id"),
        ("/dead/confirm", {"kind": "replay", "scope": "all", "text": "x"}, "act on the rows"),
        ("/keys/release", {"key": "k1", "mode": "maybe"}, "replay or skip"),
        ("/keys/release", {"mode": "skip"}, "name a key"),
    ],
)
def test_bad_input_in_a_write_is_a_400_and_changes_nothing(
    web: TestClient, database_url: str, path: str, form: dict[str, str], says: str
) -> None:
    insert_dead(database_url, [{}])
    token = csrf(web.get("/dead").text)
    response = web.post(path, data=form | {"csrf": token})
    assert response.status_code == 400
    assert says in response.text
    assert len(dead_ids(database_url)) == 1


def test_a_nul_byte_a_foreign_token_and_a_body_nested_too_deep_are_not_500s(
    web: TestClient, database_url: str
) -> None:
    (dead_id,) = insert_dead(database_url, [{}])
    for field in ("exchange", "routing_key", "key", "text", "id"):
        response = web.get("/dead", params={field: "a\x00b"})
        assert response.status_code == 400, field
        assert "control character" in response.text
    response = web.post("/dead/act", data={"csrf": "é" * 64, "kind": "purge", "scope": "all"})
    assert response.status_code == 403
    with psycopg.connect(database_url) as conn:
        (row,) = conn.execute("SELECT id FROM outbox.dead").fetchone() or ()
        conn.execute("UPDATE outbox.dead SET body = %s WHERE id = %s", (b"[" * 100_000, row))
    page = web.get(f"/dead/{row}")
    assert page.status_code == 200
    assert 'data-kind="text"' in page.text
    assert str(dead_id) in page.text


def test_a_text_search_past_its_window_offers_to_search_on(
    web: TestClient, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from relay.core import filters

    monkeypatch.setattr(filters, "SEARCH_SCAN", 5)
    now = datetime.now(UTC)
    ids = insert_dead(database_url, [{"failed_at": now - timedelta(minutes=i)} for i in range(12)])
    page = web.get("/dead", params={"text": str(ids[11])}).text  # the oldest: past the window
    assert 'id="nothing"' in page
    seen = []
    while (more := re.search(r'id="search-on" href="/dead\?([^"]+)"', page)) is not None:
        page = web.get("/dead?" + html.unescape(more[1])).text
        seen += re.findall(r"<code>([0-9a-f-]{36})</code>", page)
    assert seen == [str(ids[11])]


def test_the_overview_counts_each_reason_up_to_a_cap(
    web: TestClient, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(browse, "COUNT_CAP", 3)
    insert_dead(database_url, [{"reason": "unroutable"}] * 5 + [{"reason": "rejected"}] * 2)
    page = web.get("/").text
    assert re.search(r"unroutable</a></td><td>3\+</td>", page)
    assert re.search(r"rejected</a></td><td>2</td>", page)
