"""Hostile input, fuzzed: whatever a producer passes to enqueue, or writes into the table behind
its back, ends in a clear error at enqueue or in the row dead-lettered with a reason. The relay
never crashes, never stalls the other rows, and never publishes a message other than the stored one.

OUTBOX_FUZZ_EXAMPLES (default 60, 6 in the fast tier) sets the examples per test;
OUTBOX_FUZZ_REPORT names a JSON file that receives the outcome counts (the closing note of issue 9
quotes one such run)."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

import relay
from relay import app
from relay.core import errors, model
from tests.support import tier
from tests.support.amqp import Broker
from tests.support.inprocess import settings_for

EXAMPLES = tier.examples(60, "OUTBOX_FUZZ_EXAMPLES")
LIMIT = 16_384  # max_body_bytes for these tests: bodies up to and past it stay cheap
OUTCOMES: collections.Counter[str] = collections.Counter()

fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- strategies -------------------------------------------------------------------------------

#: Any Unicode, lone surrogates (not valid UTF-8) and NUL (not valid in PostgreSQL text) included.
anything = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)  # past AMQP's 64-bit integers too
    | st.floats(allow_nan=True, allow_infinity=True)
    | anything
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(anything, inner, max_size=4),
    max_leaves=20,
)


@st.composite
def deep(draw: st.DrawFn) -> Any:
    """Nesting far past what AMQP tables or Python's JSON parser are built for (a few draws, not
    one per level: Hypothesis must be able to replay and shrink it)."""
    value: Any = draw(scalars)
    depth, shape = draw(st.integers(10, 1200)), draw(st.sampled_from(["list", "dict", "mixed"]))
    for level in range(depth):
        as_list = shape == "list" or (shape == "mixed" and level % 2 == 0)
        value = [value] if as_list else {"n": value}
    return value


json_objects = st.dictionaries(st.text(max_size=20), json_values, max_size=5)
headers = st.dictionaries(anything, json_values | deep(), max_size=5) | st.integers(1, 200_000).map(
    lambda n: {"huge": "h" * n}  # up to past the header limit and a frame
)
#: The properties a producer may set, two the relay sets itself, and one AMQP does not have.
property_values = st.sampled_from(
    [*sorted(model.SETTABLE_PROPERTIES), "timestamp", "message_id", "bogus"]
)
properties = st.dictionaries(property_values | anything, json_values, max_size=4)
bodies = st.one_of(
    st.binary(max_size=64),
    st.integers(LIMIT - 2, LIMIT + 2).map(lambda n: b"\xff" * n),  # at the limit and past it
)
exchanges = st.sampled_from(["", "amq.topic", "fuzz.x", "bad!name", "x" * 300]) | anything
routing_keys = st.sampled_from(["", "a.b", "k" * 256]) | anything


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def report() -> Iterator[None]:
    yield
    print(f"\nfuzzed outcomes: {dict(sorted(OUTCOMES.items()))}")
    if target := os.environ.get("OUTBOX_FUZZ_REPORT"):
        Path(target).write_text(json.dumps(dict(sorted(OUTCOMES.items())), indent=2) + "\n")


@pytest.fixture
def limited(database_url: str) -> str:
    with psycopg.connect(database_url) as conn:
        conn.execute("UPDATE outbox.settings SET max_body_bytes = %s", [LIMIT])
    return database_url


def count(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM outbox.messages").fetchone()
    assert row is not None
    return int(row[0])


# -- enqueue ----------------------------------------------------------------------------------


@fuzz
@given(
    exchange=exchanges,
    routing_key=routing_keys,
    body=bodies,
    header_map=headers,
    props=properties,
    key=st.none() | anything,
)
def test_enqueue_takes_a_message_or_refuses_it_clearly(
    limited: str,
    exchange: str,
    routing_key: str,
    body: bytes,
    header_map: dict[str, Any],
    props: dict[str, Any],
    key: str | None,
) -> None:
    before = count(limited)
    with psycopg.connect(limited) as conn:
        try:
            relay.enqueue(
                conn,
                exchange,
                routing_key,
                body,
                headers=header_map,
                properties=props,
                ordering_key=key,
            )
            conn.commit()
        except errors.InvalidMessage as exc:
            message = str(exc).strip()
            OUTCOMES["enqueue: refused (InvalidMessage)"] += 1
            conn.rollback()
            assert message, "an error must say what is wrong"
            assert count(limited) == before
            return
    OUTCOMES["enqueue: accepted"] += 1
    assert count(limited) == before + 1


# -- the relay on rows written behind enqueue's back -------------------------------------------


@st.composite
def raw_rows(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Rows as a careless producer might INSERT them; jsonb takes what PostgreSQL accepts."""
    return draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "exchange": st.sampled_from(["valid", "valid", "missing", "bad!", "x" * 200]),
                    "routing_key": st.sampled_from(["fuzz.a", "fuzz.b", "unrouted", "é" * 127]),
                    "body": st.binary(max_size=256) | st.just(b"\x00" * 70_000),
                    # Half the rows clean enough to be published, so the test also checks
                    # what arrives; the rest as hostile as the strategies go.
                    "headers": (st.just({}) | json_objects | headers).filter(_storable),
                    "properties": (st.just({}) | properties).filter(_storable),
                }
            ),
            min_size=1,
            max_size=12,
        )
    )


def _storable(value: Any) -> bool:
    """What a jsonb column can hold: JSON without NaN/Infinity, text without NUL or surrogates."""
    try:
        text = json.dumps(value, allow_nan=False)
        text.encode("utf-8")
    except (ValueError, UnicodeEncodeError, RecursionError):
        return False
    return "\\u0000" not in text


# Slow (~11 s): 60 Hypothesis examples (6 in the fast tier), each an in-process relay started on
# up to 12 hostile rows and its deliveries consumed; each example is another set of rows the relay
# must survive.
@fuzz
@given(rows=raw_rows())
async def test_relay_dead_letters_bad_rows_and_delivers_the_rest_intact(
    limited: str, broker: Broker, amqp_url: str, rows: list[dict[str, Any]]
) -> None:
    exchange = broker.exchange
    await broker.declare(binding="fuzz.#")
    ids = []
    with psycopg.connect(limited) as conn:
        conn.execute("TRUNCATE outbox.messages, outbox.archive, outbox.dead")
        for row in rows:
            name = {"valid": exchange, "missing": f"{exchange}.missing"}.get(
                row["exchange"], row["exchange"]
            )
            message_id = uuid.uuid4()
            try:
                with conn.transaction():
                    conn.execute(
                        "INSERT INTO outbox.messages (message_id, exchange, routing_key, body,"
                        " headers, properties) VALUES (%s, %s, %s, %s, %s, %s)",
                        [
                            message_id,
                            name,
                            row["routing_key"],
                            row["body"],
                            Jsonb(row["headers"]),
                            Jsonb(row["properties"]),
                        ],
                    )
            except psycopg.errors.DataError:  # deeper than jsonb nests, for one
                OUTCOMES["table: refused by PostgreSQL"] += 1
                continue
            ids.append(message_id)
    parts_settings = settings_for(limited, amqp_url)
    async with app.components(parts_settings) as parts:
        await asyncio.wait_for(parts.relay.run_until_empty(), 60)  # never raises, never hangs
    assert count(limited) == 0  # nothing stalled
    with psycopg.connect(limited) as conn:
        archived = {
            m: (bytes(b), h)
            for m, b, h in conn.execute("SELECT message_id, body, headers FROM outbox.archive")
        }
        dead: dict[uuid.UUID, str] = dict(
            conn.execute("SELECT message_id, reason FROM outbox.dead").fetchall()
        )
    assert set(archived) | set(dead) == set(ids)
    assert not set(archived) & set(dead)
    assert set(dead.values()) <= {r.value for r in model.DeadReason}
    for reason in dead.values():
        OUTCOMES[f"relay: dead-lettered ({reason})"] += 1
    received = await _received(broker, len(archived))
    for message_id, (body, stored_headers) in archived.items():
        OUTCOMES["relay: published"] += 1
        got = received.get(str(message_id))
        assert got is not None, f"{message_id} archived (so confirmed) but never received"
        assert got[0] == body
        sent = {k: v for k, v in got[1].items() if not k.startswith("x-outbox-")}
        assert _same(sent, stored_headers), (sent, stored_headers)


async def _received(broker: Broker, n: int) -> dict[str, tuple[bytes, dict[str, Any]]]:
    got = await broker.collect(n, timeout=30) if n else []
    return {m.message_id: (m.body, m.headers) for m in got}


def _same(sent: Any, stored: Any) -> bool:
    """The headers a consumer got are the stored JSON: same structure, values and types (AMQP
    carries JSON's numbers as integers or doubles, strings as long strings). Iterative: nesting
    may be deeper than Python's recursion limit."""
    todo = [(sent, stored)]
    while todo:
        a, b = todo.pop()
        if isinstance(b, dict):
            if not isinstance(a, dict) or a.keys() != b.keys():
                return False
            todo.extend((a[k], b[k]) for k in b)
        elif isinstance(b, list):
            if not isinstance(a, list) or len(a) != len(b):
                return False
            todo.extend(zip(a, b, strict=True))
        elif isinstance(b, str) and isinstance(a, bytes):
            if a.decode("utf-8") != b:
                return False
        elif type(a) is not type(b) or a != b:
            return False
    return True
