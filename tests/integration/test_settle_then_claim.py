"""settle_then_claim (migration 0020): a settle that claims the relay's next batch in the same
transaction — the keyed rows it releases by the UPDATE that releases them, then the rest as
claim_batch does — against real PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest

import relay
from relay.core import model
from relay.postgres import admin
from relay.postgres.store import PgStore

SETTLE_THEN_CLAIM = (
    "SELECT lane FROM outbox.settle_then_claim(%s, '{}', '{}', '{}', '{}', '{}', '{}', '{}',"
    " '{}', '{}', '{}', %s, %s, 1000000, %s, 't', 30, '1:1:', NULL, '0', 0, false, false)"
)


def enqueue(url: str, *keys: str | None, body: bytes = b"") -> None:
    with psycopg.connect(url) as conn:
        for key in keys:
            relay.enqueue(conn, "x", "k", body, ordering_key=key)
        conn.commit()


def rows(url: str, sql_text: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql_text, args).fetchall()


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[PgStore]:
    opened = await PgStore.open(database_url, "outbox", "t", batch_max_bytes=2500)
    try:
        yield opened
    finally:
        await opened.close()


def archive_all(claim: model.Claim) -> model.Settlement:
    return model.Settlement(archive=tuple(m.id for m in claim.messages))


async def test_the_keyed_rows_a_settle_releases_come_back_claimed(
    database_url: str, store: PgStore
) -> None:
    with admin.Admin.connect(database_url) as ops:
        ops.set_policy("paced.", min_interval=60)
    enqueue(database_url, "a", "a", "b", "b", "paced.1", "paced.1")
    first = await store.claim(10, 30)
    assert sorted((m.ordering_key, m.seq) for m in first.messages) == [
        ("a", 1),
        ("b", 1),
        ("paced.1", 1),
    ]
    counts, following = await store.settle_then_claim(first.claim_id, archive_all(first), 10, 30)
    assert (counts.archived, counts.released) == (3, 3)
    assert sorted((m.ordering_key, m.seq, m.attempts) for m in following.messages) == [
        ("a", 2, 1),
        ("b", 2, 1),
    ]
    # The paced key's successor is released, not claimed: it waits for its interval.
    assert rows(
        database_url,
        "SELECT gated, claim_id IS NULL, available_at > now() + interval '50 seconds'"
        " FROM outbox.messages WHERE ordering_key = 'paced.1'",
    ) == [(False, True, True)]
    assert rows(
        database_url,
        "SELECT DISTINCT claim_id, attempts FROM outbox.messages WHERE ordering_key IN ('a', 'b')",
    ) == [(following.claim_id, 1)]
    counts, last = await store.settle_then_claim(following.claim_id, archive_all(following), 10, 30)
    assert (counts.archived, counts.released, last.messages) == (2, 0, ())


async def test_a_settle_claims_no_more_than_a_batch_holds(
    database_url: str, store: PgStore
) -> None:
    enqueue(database_url, "a", "b", "c", "d", "a", "b", "c", "d")
    first = await store.claim(10, 30)
    counts, following = await store.settle_then_claim(first.claim_id, archive_all(first), 3, 30)
    # Every successor is released; at most limit - 1 are claimed with the release, and the
    # claim that follows in the same transaction takes the rest of the batch.
    assert counts.released == 4
    assert len(following.messages) == 3
    assert rows(
        database_url, "SELECT count(*) FROM outbox.messages WHERE claim_id IS NULL AND NOT gated"
    ) == [(1,)]


async def test_a_settle_claims_no_more_bytes_than_a_batch_holds(
    database_url: str, store: PgStore
) -> None:
    # 2,500 bytes a batch, rows of ~1,030: the released rows get half of it, so one (a#2) is
    # claimed with its release and b#2 is only released; the claim that follows, in the same
    # transaction, has the rest: the oldest due row, c#1, and no more.
    enqueue(database_url, "a", "b", "c", "d", "a", "b", "c", body=b"x" * 1000)
    first = await store.claim(10, 30)
    assert len(first.messages) == 2  # the budget held the first claim to two rows as well
    counts, following = await store.settle_then_claim(first.claim_id, archive_all(first), 10, 30)
    assert counts.released == 2
    assert sorted((m.ordering_key, m.seq) for m in following.messages) == [("a", 2), ("c", 1)]


@pytest.mark.parametrize("claims", [False, True])
def test_a_settle_that_claims_waits_for_the_flush(database_url: str, claims: bool) -> None:
    # The settle asked not to wait (p_durable false), in a session that does not wait either; a
    # claim must be durable before it returns.
    if claims:
        enqueue(database_url, None)
    with psycopg.connect(database_url) as conn:
        conn.execute("SET synchronous_commit = off")
        lanes = conn.execute(SETTLE_THEN_CLAIM, [_uuid(conn), False, 10, _uuid(conn)]).fetchall()
        assert [lane for (lane,) in lanes if lane not in (None, "settled")] == (
            ["messages"] if claims else []
        )
        expected = ("on",) if claims else ("off",)
        assert conn.execute("SHOW synchronous_commit").fetchone() == expected


@pytest.mark.parametrize(("limit", "same_id"), [(0, False), (10, True)])
def test_a_settle_that_claims_refuses_a_bad_call(
    database_url: str, limit: int, same_id: bool
) -> None:
    with psycopg.connect(database_url) as conn:
        claim_id = _uuid(conn)
        with pytest.raises(psycopg.errors.InvalidParameterValue):
            conn.execute(
                SETTLE_THEN_CLAIM, [claim_id, True, limit, claim_id if same_id else _uuid(conn)]
            )


def _uuid(conn: psycopg.Connection[Any]) -> Any:
    row = conn.execute("SELECT gen_random_uuid()").fetchone()
    assert row is not None
    return row[0]
