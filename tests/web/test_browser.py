"""The web console in a real browser (headless Chromium, Playwright) against real PostgreSQL
and RabbitMQ: what an operator does at 3 a.m., click by click."""

from __future__ import annotations

import asyncio
import re
import uuid

import psycopg
import pytest
from playwright.async_api import Browser, Page, expect

from relay.postgres import roles
from relay.web import security
from tests.integration.test_dead_letters import insert_dead
from tests.support import amqp, inprocess
from tests.web.conftest import config, serving
from tests.web.support import block_key

# Slow (~20 s in all): each test launches Chromium and serves the console on a real socket; the
# fast tier leaves them out (tests/web/test_console.py covers the same server in-process).
pytestmark = pytest.mark.slow


def messages(url: str) -> list[uuid.UUID]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT message_id FROM outbox.messages")]


async def confirm_all_matching(page: Page, base: str, exchange: str, expected: int) -> None:
    await page.goto(f"{base}/dead")
    await page.fill("input[name=exchange]", exchange)
    await page.click("#filter button[type=submit]")
    await expect(page.locator("#dead-rows tr")).to_have_count(min(expected, 50) + 1)
    await page.click("#all-matching button[value=replay]")
    await expect(page.locator("h1")).to_have_text(f"Replay {expected} dead letters?")


async def test_filter_replay_all_matching_and_the_messages_arrive(
    browser: Browser, database_url: str, amqp_url: str
) -> None:
    async with amqp.broker(amqp_url) as broker:
        await broker.declare()
        wanted = insert_dead(
            database_url, [{"exchange": broker.exchange, "routing_key": "order.paid"}] * 60
        )
        others = insert_dead(database_url, [{"exchange": "elsewhere"}] * 5)
        settings = inprocess.settings_for(database_url, amqp_url)
        with serving(config(database_url)) as (base, _):
            page = await browser.new_page()
            response = await page.goto(base)
            assert response is not None
            assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
            await expect(page.locator("h1")).to_have_text("Overview")
            await expect(page.locator("#dead-by-reason")).to_contain_text("unroutable")
            await confirm_all_matching(page, base, broker.exchange, 60)
            await page.click("#confirm button[type=submit]")
            await expect(page.locator("#state")).to_have_attribute(
                "data-state", "finished", timeout=30_000
            )
            await expect(page.locator("#state")).to_contain_text("60 of 60 replayed")
            async with inprocess.running(settings):
                received = await broker.collect(60, distinct=True, settle=0.5)
        assert sorted(uuid.UUID(r.message_id) for r in received) == sorted(wanted)
        assert len(received) == 60  # each once
        with psycopg.connect(database_url) as conn:
            left = {r[0] for r in conn.execute("SELECT message_id FROM outbox.dead")}
        assert left == set(others)


# Slow (~8 s): Chromium with two pages, and a relay that delivers the 1,000 rows to a real queue,
# which is then watched a second more for copies: delivery once is the promise judged.
async def test_two_replays_of_one_filter_at_once_each_row_once_and_the_second_is_told(
    browser: Browser, database_url: str, amqp_url: str
) -> None:
    async with amqp.broker(amqp_url) as broker:
        await broker.declare()
        wanted = insert_dead(database_url, [{"exchange": broker.exchange}] * 1000)
        with serving(config(database_url)) as (base, _):
            first, second = await browser.new_page(), await browser.new_page()
            await confirm_all_matching(first, base, broker.exchange, 1000)
            await confirm_all_matching(second, base, broker.exchange, 1000)
            await asyncio.gather(
                first.click("#confirm button[type=submit]"),
                second.click("#confirm button[type=submit]"),
            )
            pages = (first, second)
            headings = [await p.locator("h1").inner_text() for p in pages]
            started = [p for p, h in zip(pages, headings, strict=True) if "Action #" in h]
            told = [p for p, h in zip(pages, headings, strict=True) if "Action #" not in h]
            assert len(started) == 1, headings
            assert len(told) == 1, headings
            await expect(told[0].locator("#already")).to_have_text(
                re.compile("Someone is already at it|Nothing to replay")
            )
            action = (await started[0].locator("h1").inner_text()).split(":")[0]
            await expect(told[0].locator("main")).to_contain_text(action[len("Action ") :])
            await expect(started[0].locator("#state")).to_have_attribute(
                "data-state", "finished", timeout=60_000
            )
        settings = inprocess.settings_for(database_url, amqp_url)
        async with inprocess.running(settings):
            received = await broker.collect(1000, settle=1.0)
    assert len(received) == 1000  # none twice (collect waits a second more for extra copies)
    assert sorted(uuid.UUID(r.message_id) for r in received) == sorted(wanted)


async def test_a_viewer_sees_no_buttons_and_the_server_refuses_a_forged_post(
    browser: Browser, database_url: str
) -> None:
    insert_dead(database_url, [{"ordering_key": "k1", "seq": 1}])
    with psycopg.connect(database_url) as conn:
        (dead_row,) = conn.execute("SELECT id FROM outbox.dead").fetchone() or ()
    made = roles.ensure(database_url, "outbox")
    login = f"viewer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{login}" LOGIN IN ROLE "{made.viewer}"')
    try:
        viewer_url = database_url.replace("postgres@", f"{login}@", 1)
        with serving(config(viewer_url)) as (base, console):
            page = await browser.new_page()
            for path in ("/dead", "/keys", "/", f"/dead/{dead_row}", "/actions"):
                response = await page.goto(base + path)
                assert response is not None
                assert response.status == 200, path
                await expect(page.locator("form[method=post]")).to_have_count(0)
                await expect(page.locator("button:not(#filter button)")).to_have_count(0)
            await page.goto(f"{base}/dead")
            await expect(page.locator("header")).to_contain_text("read-only")
            # A valid token (the page offers none): the refusal is the login's, not the form's.
            token = console.csrf.token(await page.locator("#who").inner_text())
            forged = await page.request.post(
                f"{base}/dead/act", form={"kind": "purge", "scope": "all", "csrf": token}
            )
            assert forged.status == 403
            assert "reads only" in await forged.text()
        with psycopg.connect(database_url) as conn:
            assert conn.execute("SELECT count(*) FROM outbox.dead").fetchone() == (1,)
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{login}"')
            conn.execute(f'DROP ROLE "{login}"')


async def test_beyond_loopback_a_login_is_asked_and_a_post_without_its_token_is_403(
    browser: Browser, database_url: str, tmp_path: object
) -> None:
    from pathlib import Path

    users = Path(str(tmp_path)) / "users"
    security.add_user(users, "alice", "pw-of-alice")
    insert_dead(database_url, [{}])
    access = security.Access(security.read_users(users))
    with serving(config(database_url, access=access), host="0.0.0.0") as (base, _):
        anonymous = await browser.new_context()
        asked = await anonymous.request.get(base)  # a page would stop at the browser's prompt
        assert asked.status == 401
        assert asked.headers["www-authenticate"].startswith("Basic")
        context = await browser.new_context(
            http_credentials={"username": "alice", "password": "pw-of-alice"}
        )
        page = await context.new_page()
        response = await page.goto(f"{base}/dead")
        assert response is not None
        assert response.status == 200
        await expect(page.locator("header .who")).to_contain_text("alice")
        no_token = await page.request.post(f"{base}/dead/act", form={"kind": "purge"})
        assert no_token.status == 403
        assert "CSRF" in await no_token.text()


async def test_the_keys_page_releases_a_blocked_key(browser: Browser, database_url: str) -> None:
    (dead_id,) = insert_dead(database_url, [{"ordering_key": "k1", "seq": 1}])
    block_key(database_url, "k1", dead_id, 1)
    with serving(config(database_url)) as (base, _):
        page = await browser.new_page()
        await page.goto(f"{base}/keys")
        await expect(page.locator("#blocked")).to_contain_text("k1")
        await page.click("#blocked button[value=replay]")
        await expect(page.locator("#released")).to_have_text("Key k1 goes on")
        await page.goto(f"{base}/keys")
        await expect(page.locator("#blocked")).to_have_text("No key is blocked.")
    assert messages(database_url) == [dead_id]


async def test_bad_input_in_each_form_is_a_4xx_with_a_message(
    browser: Browser, database_url: str
) -> None:
    with serving(config(database_url)) as (base, console):
        page = await browser.new_page()
        for query, says in (
            ("reason=bogus", "unknown reason"),
            ("since=soonish", "not a time"),
            ("id=zz", "not a message id"),
            ("limit=100000", "a page shows 1 to 500 rows"),
            ("before=garbage", "not a page position"),
        ):
            response = await page.goto(f"{base}/dead?{query}")
            assert response is not None
            assert response.status == 400, query
            await expect(page.locator(".problem")).to_contain_text(says)
        await page.goto(f"{base}/dead")
        await page.fill("input[name=until]", "the day after")
        await page.click("#filter button[type=submit]")
        await expect(page.locator(".problem")).to_contain_text("not a time")
        response = await page.goto(f"{base}/dead/12345678")
        assert response is not None
        assert response.status == 404
        # The write forms, sent with the page's own token and values no button sends.
        await page.goto(f"{base}/keys")
        token = console.csrf.token(await page.locator("#who").inner_text())
        for path, form, says in (
            ("/keys/release", {"key": "k1", "mode": "maybe"}, "replay or skip"),
            ("/dead/confirm", {"kind": "erase", "scope": "all"}, "replay or purge"),
            ("/dead/act", {"kind": "purge", "scope": "all", "upto": "-1"}, "confirm it again"),
        ):
            sent: dict[str, str | float | bool] = {**form, "csrf": token}
            answer = await page.request.post(base + path, form=sent)
            assert answer.status == 400, path
            assert says in await answer.text()
