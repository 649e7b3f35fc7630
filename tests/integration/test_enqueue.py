"""enqueue() and enqueue_json() in SQL, and relay.enqueue / enqueue_async, on real PostgreSQL."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import psycopg.errors
import pytest

import relay
from relay.core import errors


def count(url: str, table: str = "messages") -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute(f"SELECT count(*) FROM outbox.{table}").fetchone()
        assert row is not None
        return int(row[0])


def fetch(url: str, message_id: uuid.UUID) -> dict[str, Any]:
    with psycopg.connect(url) as conn:
        cur = conn.execute(
            "SELECT exchange, routing_key, body, headers, properties, ordering_key, attempts,"
            " created_at, available_at FROM outbox.messages WHERE message_id = %s",
            [message_id],
        )
        row = cur.fetchone()
        assert row is not None, f"no row for {message_id}"
        return dict(zip([c.name for c in cur.description or ()], row, strict=True))


def wake_ups(listener: psycopg.Connection[Any], producer: psycopg.Connection[Any]) -> list[str]:
    """The payloads `listener` got on outbox_new so far: a sentinel NOTIFY, delivered after
    everything committed before it, ends the wait."""
    producer.execute("NOTIFY outbox_new, 'sentinel'")
    producer.commit()
    payloads = []
    for note in listener.notifies(timeout=10):
        if note.payload == "sentinel":
            break
        payloads.append(note.payload)
    return payloads


def test_python_enqueue_writes_in_the_callers_transaction(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        message_id = relay.enqueue(
            conn,
            "orders",
            "order.created",
            b"\x00\x01binary",
            headers={"tenant": "acme", "n": 7},
            properties={"correlation_id": "c-1", "priority": 5},
        )
        assert count(database_url) == 0  # not visible until the caller commits
        conn.commit()
    row = fetch(database_url, message_id)
    assert row["exchange"] == "orders"
    assert row["routing_key"] == "order.created"
    assert bytes(row["body"]) == b"\x00\x01binary"
    assert row["headers"] == {"tenant": "acme", "n": 7}
    assert row["properties"] == {
        "correlation_id": "c-1",
        "priority": 5,
        "content_type": "application/octet-stream",
    }
    assert row["attempts"] == 0


def test_rolled_back_enqueue_leaves_nothing(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        relay.enqueue(conn, "orders", "order.created", b"x")
        conn.rollback()
    assert count(database_url) == 0


def test_dict_body_is_json_and_str_body_is_text(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        as_json = relay.enqueue(conn, "x", "k", {"b": 1, "a": ["é", None]})
        as_text = relay.enqueue(conn, "x", "k", "héllo")
        own_type = relay.enqueue(
            conn, "x", "k", [1, 2], properties={"content_type": "application/vnd.x+json"}
        )
        conn.commit()
    json_row = fetch(database_url, as_json)
    assert json.loads(bytes(json_row["body"])) == {"b": 1, "a": ["é", None]}
    assert bytes(json_row["body"]) == '{"b":1,"a":["é",null]}'.encode()  # the producer's key order
    assert json_row["properties"]["content_type"] == "application/json"
    assert bytes(fetch(database_url, as_text)["body"]) == "héllo".encode()
    assert fetch(database_url, as_text)["properties"]["content_type"] == "text/plain; charset=utf-8"
    assert fetch(database_url, own_type)["properties"]["content_type"] == "application/vnd.x+json"


async def test_async_enqueue(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        message_id = await relay.enqueue_async(conn, "", "queue-name", b"to the default exchange")
        await conn.commit()
    assert fetch(database_url, message_id)["exchange"] == ""


def test_given_message_id_is_kept_and_duplicates_are_refused(database_url: str) -> None:
    mine = uuid.uuid4()
    with psycopg.connect(database_url) as conn:
        assert relay.enqueue(conn, "x", "k", b"1", message_id=mine) == mine
        conn.commit()
        with pytest.raises(errors.DuplicateMessage, match=str(mine)):
            relay.enqueue(conn, "x", "k", b"2", message_id=mine)
        conn.rollback()
    assert count(database_url) == 1


def test_available_at_accepts_a_time_or_a_delay(database_url: str) -> None:
    at = datetime(2030, 5, 17, 12, 0, tzinfo=UTC)
    with psycopg.connect(database_url) as conn:
        scheduled = relay.enqueue(conn, "x", "k", b"", available_at=at)
        delayed = relay.enqueue(conn, "x", "k", b"", available_at=timedelta(hours=1))
        conn.commit()
    assert fetch(database_url, scheduled)["available_at"] == at
    row = fetch(database_url, delayed)
    assert timedelta(minutes=59) < row["available_at"] - row["created_at"] < timedelta(minutes=61)


def test_sql_enqueue_from_plain_sql_with_named_arguments(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        cur = conn.execute(
            "SELECT outbox.enqueue(exchange => 'billing', routing_key => 'invoice.paid',"
            " body => convert_to('paid', 'UTF8'), ordering_key => 'invoice-42')"
        )
        row = cur.fetchone()
        assert row is not None
        conn.commit()
    stored = fetch(database_url, row[0])
    assert (stored["exchange"], stored["ordering_key"]) == ("billing", "invoice-42")


def test_enqueue_json_sets_content_type(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        row = conn.execute(
            "SELECT outbox.enqueue_json('x', 'k', '{\"total\": 12.50}'::jsonb)"
        ).fetchone()
        assert row is not None
        conn.commit()
    stored = fetch(database_url, row[0])
    assert json.loads(bytes(stored["body"])) == {"total": 12.50}
    assert stored["properties"]["content_type"] == "application/json"


BAD_ARGUMENTS = [
    ("NULL, 'k', 'b'::bytea", "exchange must not be NULL"),
    ("'x', NULL, 'b'::bytea", "routing_key must not be NULL"),
    ("repeat('e', 256), 'k', 'b'::bytea", "exchange is 256 bytes long"),
    ("'x', repeat('é', 128), 'b'::bytea", "routing_key is 256 bytes long"),
    ("'x', 'k', NULL::bytea", "body must not be NULL"),
    ("'x', 'k', 'b'::bytea, headers => '[1]'", "headers must be a JSON object, not array"),
    ("'x', 'k', 'b'::bytea, headers => '{\"x-outbox-attempt\": 1}'", "reserved prefix"),
    ("'x', 'k', 'b'::bytea, properties => '\"text\"'", "properties must be a JSON object"),
    (
        "'x', 'k', 'b'::bytea, properties => '{\"colour\": \"red\"}'",
        'unknown AMQP property "colour"',
    ),
    ("'x', 'k', 'b'::bytea, properties => '{\"message_id\": \"m\"}'", "set by the relay"),
    ("'x', 'k', 'b'::bytea, properties => '{\"priority\": 256}'", "priority must be an integer"),
    ("'x', 'k', 'b'::bytea, properties => '{\"delivery_mode\": 3}'", "delivery_mode must be 1"),
    ("'x', 'k', 'b'::bytea, properties => '{\"expiration\": \"soon\"}'", "expiration must be"),
    ("'x', 'k', 'b'::bytea, properties => '{\"reply_to\": 5}'", "reply_to must be a string"),
    ("'x', 'k', 'b'::bytea, ordering_key => ''", "ordering_key must be 1 to 255 bytes"),
    ("'x', 'k', 'b'::bytea, available_at => 'infinity'", "available_at must be a finite time"),
    ("'x', 'k', 'b'::bytea, available_at => '-infinity'", "available_at must be a finite time"),
]


@pytest.mark.parametrize(("arguments", "message"), BAD_ARGUMENTS, ids=[m for _, m in BAD_ARGUMENTS])
def test_bad_arguments_raise_a_clear_sql_error_and_write_nothing(
    database_url: str, arguments: str, message: str
) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute("SELECT outbox.enqueue('x', 'k', 'kept'::bytea)")
        conn.commit()
        with pytest.raises(psycopg.errors.InvalidParameterValue, match=message) as info:
            conn.execute(f"SELECT outbox.enqueue({arguments})")
        assert info.value.sqlstate == "22023"
        conn.rollback()
    assert count(database_url) == 1


def test_body_limit_is_a_setting(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.settings SET max_body_bytes = 10")
        conn.commit()
        relay.enqueue(conn, "x", "k", b"0123456789")
        with pytest.raises(errors.InvalidMessage, match="body is 11 bytes; the limit is 10 bytes"):
            relay.enqueue(conn, "x", "k", b"0123456789A")
        conn.rollback()


def test_empty_exchange_is_valid_the_default_exchange(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        relay.enqueue(conn, "", "some-queue", b"")
        conn.commit()
    assert count(database_url) == 1


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"body": 12}, errors.InvalidMessageType),
        ({"exchange": 5}, errors.InvalidMessageType),
        ({"headers": [("a", 1)]}, errors.InvalidMessageType),
        ({"headers": {"when": datetime.now(UTC)}}, errors.InvalidMessage),
        ({"body": {"x": float("nan")}}, errors.InvalidMessage),
        ({"available_at": datetime(2030, 1, 1)}, errors.InvalidMessage),
        ({"available_at": "tomorrow"}, errors.InvalidMessageType),
    ],
)
def test_python_api_rejects_bad_types_before_sql(
    database_url: str, kwargs: dict[str, Any], error: type[Exception]
) -> None:
    """Every bad argument is an InvalidMessage (those of the wrong type a TypeError too), raised
    before any SQL, so the caller's transaction is still usable."""
    arguments: dict[str, Any] = {"exchange": "x", "routing_key": "k", "body": b""} | kwargs
    with psycopg.connect(database_url) as conn:
        with pytest.raises(error) as raised:
            relay.enqueue(conn, **arguments)
        assert isinstance(raised.value, errors.InvalidMessage)
        assert conn.info.transaction_status != psycopg.pq.TransactionStatus.INERROR


def test_an_autocommit_connection_is_refused_and_writes_nothing(database_url: str) -> None:
    """In autocommit the message would commit on its own, outside the business transaction it
    announces: the one mistake an outbox exists to prevent."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        with pytest.raises(errors.InvalidArgument, match="autocommit"):
            relay.enqueue(conn, "x", "k", b"alone")
        with pytest.raises(errors.InvalidArgument, match=r"conn\.transaction"):
            relay.enqueue_many(conn, [relay.Message("x", "k", b"alone")])
        with conn.transaction():  # an explicit transaction on the same connection: accepted
            conn.execute("SELECT 1")  # the business change
            relay.enqueue(conn, "x", "k", b"with it")
    assert count(database_url) == 1


async def test_an_autocommit_async_connection_is_refused(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url, autocommit=True) as conn:
        with pytest.raises(errors.InvalidArgument, match="autocommit"):
            await relay.enqueue_async(conn, "x", "k", b"alone")
        async with conn.transaction():
            await relay.enqueue_async(conn, "x", "k", b"with it")
    assert count(database_url) == 1


def test_python_api_translates_sql_errors(database_url: str) -> None:
    with (
        psycopg.connect(database_url) as conn,
        pytest.raises(errors.InvalidMessage, match="exchange must not be NULL"),
    ):
        relay.enqueue(conn, None, "k", b"")  # type: ignore[arg-type]


def test_missing_schema_says_run_migrate(empty_database_url: str) -> None:
    with (
        psycopg.connect(empty_database_url) as conn,
        pytest.raises(errors.SchemaMissing, match="outbox-relay migrate"),
    ):
        relay.enqueue(conn, "x", "k", b"")


def test_one_notification_per_transaction_none_on_rollback(database_url: str) -> None:
    with (
        psycopg.connect(database_url, autocommit=True) as listener,
        psycopg.connect(database_url) as producer,
    ):
        listener.execute('LISTEN "outbox_new"')
        for _ in range(20):
            relay.enqueue(producer, "x", "k", b"")
        producer.commit()
        relay.enqueue(producer, "x", "k", b"")
        producer.rollback()
        relay.enqueue(producer, "x", "k", b"", available_at=timedelta(hours=1))  # scheduled: silent
        producer.commit()
        payloads = wake_ups(listener, producer)
    assert payloads == [""]


def test_a_dead_letter_is_visible_from_postgres_a_warning_and_a_notify(database_url: str) -> None:
    notices: list[str] = []
    with (
        psycopg.connect(database_url, autocommit=True) as listener,
        psycopg.connect(database_url) as conn,
    ):
        listener.execute('LISTEN "outbox_dead"')
        conn.add_notice_handler(
            lambda diag: notices.append(f"{diag.severity}: {diag.message_primary}")
        )
        message_id = uuid.uuid4()
        conn.execute(
            "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, reason, detail, created_at) VALUES (%s, 'x', 'k',"
            " 'secret body', '{}', '{}', 1, 'unroutable', '312 NO_ROUTE', now())",
            [message_id],
        )
        conn.commit()
        (note,) = list(listener.notifies(timeout=5, stop_after=1))
    payload = json.loads(note.payload)
    assert payload == {
        "message_id": str(message_id),
        "reason": "unroutable",
        "exchange": "x",
        "routing_key": "k",
        "ordering_key": None,
        "attempts": 1,
    }
    assert notices == [
        f"WARNING: outbox: message {message_id} dead-lettered (unroutable): 312 NO_ROUTE"
    ]


def test_enqueue_many_writes_in_order_in_the_callers_transaction(database_url: str) -> None:
    batch = [relay.Message("x", f"k.{i}", f"body {i}".encode()) for i in range(500)]
    batch[7] = relay.Message("x", "json", {"n": 7}, headers={"h": 1}, ordering_key="acct-1")
    batch[8] = relay.Message("x", "text", "eight", available_at=timedelta(hours=1))
    with (
        psycopg.connect(database_url, autocommit=True) as listener,
        psycopg.connect(database_url) as producer,
    ):
        listener.execute('LISTEN "outbox_new"')
        assert len(relay.enqueue_many(producer, batch[:3])) == 3
        assert count(database_url) == 0  # not committed yet
        producer.rollback()
        assert count(database_url) == 0  # rolled back: nothing
        ids = relay.enqueue_many(producer, batch)
        producer.commit()
        payloads = wake_ups(listener, producer)
    assert payloads == [""]  # one wake-up for the whole batch
    with psycopg.connect(database_url) as conn:
        stored = conn.execute("SELECT message_id, routing_key FROM outbox.messages ORDER BY id")
        expected = [(i, m.routing_key) for i, m in zip(ids, batch, strict=True)]
        assert [(m, k) for m, k in stored] == expected
    json_row, later = fetch(database_url, ids[7]), fetch(database_url, ids[8])
    assert (json_row["body"], json_row["headers"], json_row["ordering_key"]) == (
        b'{"n":7}',
        {"h": 1},
        "acct-1",
    )
    assert json_row["properties"]["content_type"] == "application/json"
    assert later["properties"]["content_type"] == "text/plain; charset=utf-8"
    assert later["available_at"] > later["created_at"] + timedelta(minutes=59)


async def test_enqueue_many_async(database_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        ids = await relay.enqueue_many_async(conn, [relay.Message("x", "a", b"1")] * 3)
        assert await relay.enqueue_many_async(conn, []) == []
        await conn.commit()
    assert len(set(ids)) == 3
    assert count(database_url) == 3


@pytest.mark.parametrize(
    ("bad", "error", "fragment"),
    [
        (relay.Message("x", "k" * 300, b""), errors.InvalidMessage, "message 3 of 4: enqueue: "),
        (
            relay.Message("x", "k", b"", headers={"a": float("nan")}),
            errors.InvalidMessage,
            "message 3 of 4: headers are not JSON",
        ),
        (
            relay.Message("x", "k", b"", message_id=uuid.UUID(int=1)),
            errors.DuplicateMessage,
            "message 3 of 4: enqueue: message_id",
        ),
    ],
)
def test_enqueue_many_names_the_bad_message_and_writes_nothing(
    database_url: str, bad: relay.Message, error: type[Exception], fragment: str
) -> None:
    first = relay.Message("x", "k", b"", message_id=uuid.UUID(int=1))
    with psycopg.connect(database_url) as conn:
        with pytest.raises(error, match=re.escape(fragment)):
            relay.enqueue_many(
                conn, [first, relay.Message("x", "k", b""), bad, relay.Message("x", "k", b"")]
            )
        conn.rollback()
    assert count(database_url) == 0


def test_sql_enqueue_many_checks_its_arrays(database_url: str) -> None:
    with psycopg.connect(database_url) as conn:
        ids = conn.execute(
            "SELECT * FROM outbox.enqueue_many(ARRAY['x', 'x'], ARRAY['a', 'b'],"
            " ARRAY['1', '2']::bytea[], ordering_keys => ARRAY[NULL, 'k'])"
        ).fetchall()
        conn.commit()
        assert len(ids) == 2
        with pytest.raises(psycopg.errors.InvalidParameterValue, match="one entry per message"):
            conn.execute(
                "SELECT outbox.enqueue_many(ARRAY['x'], ARRAY['a', 'b'], ARRAY[''::bytea])"
            )
    assert count(database_url) == 2


def test_many_enqueues_in_one_transaction_open_no_subtransactions(database_url: str) -> None:
    # Each subtransaction that writes gets an id of its own (the rows' xmin); past 64 in one
    # transaction PostgreSQL's snapshots overflow to pg_subtrans for every session. 200 single
    # enqueues and a batch of 200 use at most the transaction's id and one for the batch.
    with psycopg.connect(database_url) as conn:
        for _ in range(200):
            relay.enqueue(conn, "x", "k", b"")
        relay.enqueue_many(conn, [relay.Message("x", "k", b"")] * 200)
        row = conn.execute("SELECT count(DISTINCT xmin::text) FROM outbox.messages").fetchone()
        conn.commit()
    assert row is not None
    assert row[0] <= 2
