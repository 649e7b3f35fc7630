"""Take the screenshots of docs/guides/console.md: each page of the console over a scratch
database with a little of everything (dead letters, a blocked key, held messages, an action),
in the machine's Chromium. Run it after changing a page:

    .venv/bin/python -m tests.web.screenshots
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psycopg
from playwright.async_api import async_playwright

from relay.core.filters import DeadFilter
from relay.postgres import actions, browse
from relay.web import app
from tests.integration.test_dead_letters import insert_dead
from tests.support import services
from tests.web.conftest import chromium, serving
from tests.web.support import block_key

IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
PAGES = {
    "overview": "/",
    "dead-letters": "/dead?reason=unroutable&reason=no_exchange",
    "dead-letter": None,  # the first dead letter's own page
    "confirm": None,  # a replay of all that match, asked
    "keys": "/keys",
    "actions": "/actions",
}


def fill(url: str) -> None:
    insert_dead(
        url,
        [
            {"reason": "unroutable", "exchange": "orders", "routing_key": f"order.paid.{i}"}
            for i in range(12)
        ]
        + [{"reason": "no_exchange", "exchange": "invoices", "routing_key": "invoice.sent"}] * 4
        + [
            {"reason": "max_attempts", "exchange": "orders", "ordering_key": "customer-7", "seq": 3}
        ],
    )
    with psycopg.connect(url) as conn:
        (blocker,) = (
            conn.execute(
                "SELECT message_id FROM outbox.dead WHERE ordering_key = 'customer-7'"
            ).fetchone()
            or ()
        )
    block_key(url, "customer-7", blocker, 3, reason="max_attempts")
    with psycopg.connect(url) as conn:
        conn.execute(
            "UPDATE outbox.dead SET body = convert_to("
            """'{"order_id": 42, "amount": "19.90", "currency": "EUR"}', 'UTF8'),"""
            " headers = jsonb_build_object('traceparent',"
            " '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01')"
            " WHERE routing_key LIKE 'order.paid.%'"
        )
        for i in range(5):
            conn.execute(
                "SELECT outbox.enqueue('orders', 'order.shipped', %s::bytea,"
                " ordering_key => 'customer-7')",
                (f'{{"n": {i}}}'.encode(),),
            )
    browser = browse.Browser(url)
    browser.open()
    try:
        runner = actions.Actions(url, browser.count)
        runner.start("purge", "alice", DeadFilter(exchange="invoices"), browser.last_dead())
        runner.join()
    finally:
        browser.close()


async def shoot(url: str) -> None:
    IMAGES.mkdir(exist_ok=True)
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    with serving(app.Config(url)) as (base, _):
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=chromium(), args=args)
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            for name, path in PAGES.items():
                if name == "dead-letter":
                    await page.goto(f"{base}/dead")
                    await page.click("#dead-rows a")
                elif name == "confirm":
                    await page.goto(f"{base}/dead?exchange=orders")
                    await page.click("#all-matching button[value=replay]")
                else:
                    await page.goto(base + str(path))
                target = IMAGES / f"console-{name}.png"
                await page.screenshot(path=str(target), full_page=True)
                print(f"wrote {target}")
            await browser.close()


def main() -> None:
    with services.discover() as svc, svc.scratch_database("outbox_screenshots") as url:
        fill(url)
        asyncio.run(shoot(url))


if __name__ == "__main__":
    main()
