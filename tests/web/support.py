"""What the console's in-process tests share: the application under Starlette's test client
(addressed as this machine, which an open console insists on), the page's CSRF token, and
what the database holds."""

from __future__ import annotations

import re
import uuid
from typing import Any

import psycopg
from starlette.testclient import TestClient

from relay.web import app
from tests.support.wait import until


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
    """The action's state once it is no longer running, as its page's live part says."""

    def ended() -> str | None:
        page = web.get(f"/actions/{action_id}", headers={"HX-Request": "true"}).text
        state = re.search(r'data-state="(\w+)"', page)
        assert state
        return None if state[1] == "running" else state[1]

    state = until(ended, timeout=60, message=f"action {action_id} to end")
    assert state is not None  # until returns only what is truthy
    return state


def block_key(
    url: str, key: str, message_id: uuid.UUID, seq: int, *, reason: str = "unroutable"
) -> None:
    """Block `key` behind its dead message `message_id` (number `seq`), as a dead-lettering
    under the 'block' policy leaves it; the key's next number is the one after."""
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO outbox.keys VALUES (%s, %s, 1, '0', NULL)", (key, seq + 1))
        conn.execute(
            "INSERT INTO outbox.blocked_keys (ordering_key, message_id, seq, reason)"
            " VALUES (%s, %s, %s, %s)",
            (key, message_id, seq, reason),
        )
