"""Per-key commit order with racing producers and three relay processes."""

from __future__ import annotations

import asyncio
import collections
import random
import threading
import time
from typing import Any

import psycopg
import pytest

import relay
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env
from tests.support.wait import until

pytestmark = pytest.mark.slow

KEYS = [f"aggregate-{n}" for n in range(60)]


class Producers:
    """Eight connections enqueueing 1–3 messages of a random key per transaction, holding it open
    a random few milliseconds, one transaction in ten rolled back."""

    def __init__(self, url: str, exchange: str) -> None:
        self.committed: list[tuple[str, str, float, float]] = []  # key, id, started, committed
        self.rolled_back: set[str] = set()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(url, exchange, n)) for n in range(8)
        ]

    def run(self) -> None:
        for t in self._threads:
            t.start()
        for t in self._threads:
            t.join()

    def _run(self, url: str, exchange: str, n: int) -> None:
        rng = random.Random(n)
        with psycopg.connect(url) as conn:
            for _ in range(150):
                key = rng.choice(KEYS)
                started = time.monotonic()
                ids = [
                    str(relay.enqueue(conn, exchange, key, b"", ordering_key=key))
                    for _ in range(rng.randint(1, 3))
                ]
                time.sleep(rng.uniform(0, 0.005))  # the transaction stays open a while
                if rng.random() < 0.1:
                    conn.rollback()
                    with self._lock:
                        self.rolled_back.update(ids)
                    continue
                conn.commit()
                now = time.monotonic()
                with self._lock:
                    self.committed.extend((key, i, started, now) for i in ids)


def scalar(url: str, sql: str) -> Any:
    with psycopg.connect(url) as conn:
        row = conn.execute(sql).fetchone()
        return row[0] if row else None


# Slow (~7 s): three relay processes start, then 8 producers commit 1,200 transactions (each held
# open up to 5 ms) and the relays deliver over 2,000 messages: about 36 a key on 60 keys, enough
# for a key's messages to be spread over the three relays' claims.
async def test_every_key_arrives_in_commit_order_without_gaps_across_three_relays(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare()
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_BATCH_SIZE="50",
    )
    producers = Producers(database_url, broker.exchange)
    with RelayProcess(env) as a, RelayProcess(env) as b, RelayProcess(env) as c:
        for proc in (a, b, c):
            proc.wait_ready()
        await asyncio.to_thread(producers.run)
        total = len(producers.committed)
        until(
            lambda: scalar(database_url, "SELECT count(*) FROM outbox.archive") >= total,
            timeout=120,
            interval=0.2,
            message=f"{total} archived",
        )
        for proc in (a, b, c):
            assert proc.stop() == 0, proc.output
    assert total > 2000
    got = await broker.collect(total, timeout=60, settle=0.3)
    arrivals: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for g in got:
        arrivals[g.routing_key].append((g.headers["x-outbox-sequence"], g.message_id))
    committed_by_key: dict[str, set[str]] = collections.defaultdict(set)
    for key, message_id, _, _ in producers.committed:
        committed_by_key[key].add(message_id)
    assert len(committed_by_key) >= 50
    for key, ids in committed_by_key.items():
        seqs = [seq for seq, _ in arrivals[key]]
        assert seqs == list(range(1, len(ids) + 1)), f"{key}: {seqs[:20]}…"
        assert {m for _, m in arrivals[key]} == ids
    assert not {g.message_id for g in got} & producers.rolled_back
    # Commit order: a transaction that committed before another began has the lower numbers.
    seq_of = {m: seq for key in arrivals for seq, m in arrivals[key]}
    for key in committed_by_key:
        mine = sorted((c, s, m) for k, m, s, c in producers.committed if k == key)
        for committed_at, _, earlier in mine:
            for _, started, later in mine:
                if committed_at < started:
                    assert seq_of[earlier] < seq_of[later]
