"""What the console's in-process tests share: the application under Starlette's test client
(addressed as this machine, which an open console insists on), the page's CSRF token, and
what the database holds."""

from __future__ import annotations

import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from starlette.testclient import TestClient

from relay.web import app


def client(database_url: str, **config: Any) -> TestClient:
    return TestClient(
        app.create_app(app.Config(database_url, **config)), base_url="http://127.0.0.1:8089"
    )


def csrf(page: str) -> str:
    found = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
    assert found, "the page has no CSRF token"
    return found[1]


def dead_ids(url: str) -> set[uuid.UUID]:
    with psycopg.connect(url) as conn:
        return {row[0] for row in conn.execute("SELECT message_id FROM outbox.dead")}


def waiting(url: str) -> list[uuid.UUID]:
    with psycopg.connect(url) as conn:
        return [row[0] for row in conn.execute("SELECT message_id FROM outbox.messages")]


def until_ended(web: TestClient, action_id: int) -> str:
    deadline = datetime.now(UTC) + timedelta(seconds=60)
    while datetime.now(UTC) < deadline:
        page = web.get(f"/actions/{action_id}", headers={"HX-Request": "true"}).text
        state = re.search(r'data-state="(\w+)"', page)
        assert state
        if state[1] != "running":
            return state[1]
    raise AssertionError(f"action {action_id} still running after 60 s")
