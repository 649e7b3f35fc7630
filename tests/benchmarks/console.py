"""Console benchmark: the web console's first page of each filter at 1,000,000 dead rows, and a
bulk replay of 100,000 (not part of the test suite).

    .venv/bin/python tests/benchmarks/console.py [--dead 1000000] [--replay 100000] [--tries 5]

It creates a scratch database, migrates it, and fills `dead` with `--dead` rows spread over 30
days: six reasons (two common, four rare; `invalid` none), 20 exchanges, routing keys
`<noun>.<verb>.<n>`, ordering keys on a third of them, JSON bodies and headers. Then, for each
filter the console offers, alone, combined, and matching nothing, it asks the console (the
Starlette application, in-process: the server's own time, templates included) for the first page
`--tries` times and prints the median and the slowest (target: each ≤ 300 ms). Last, it replays
`--replay` rows that one filter matches through the console's bulk action and prints rows/s
(target ≥ 1,000) and the longest batch (each its own transaction). With `--beside N`, it then runs
N interleaved pairs of a relay (`outbox-relay run`) draining a backlog into RabbitMQ, once alone
and once while the same replay runs beside it, and prints the relay's rate in each (messages
archived a second over the same window) and their ratio (target ≥ 0.8). `--index-pairs N` times
the pages with and without migration 0030's four indexes, interleaved: what they buy. Services:
OUTBOX_TEST_DATABASE_URL / OUTBOX_TEST_AMQP_URL (default: the local ones).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from uuid import UUID, uuid4

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from starlette.testclient import TestClient

from relay.core.filters import DeadFilter
from relay.postgres import actions, browse
from relay.web import app
from tests.benchmarks.drain import declare, delete
from tests.support import services
from tests.support.processes import clean_env

TARGET_MS = 300.0


def fill(url: str, rows: int, replayable: int) -> None:
    """`rows` dead rows; the first `replayable` of them on exchange `replay-me`."""
    with psycopg.connect(url, autocommit=True) as conn:
        step = 200_000
        for start in range(0, rows, step):
            conn.execute(
                """
                INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers,
                    properties, ordering_key, seq, attempts, reason, detail, created_at,
                    failed_at)
                SELECT gen_random_uuid(),
                       CASE WHEN n <= %(replayable)s THEN 'replay-me'
                            ELSE 'exchange-' || (n %% 20) END,
                       (ARRAY['order', 'invoice', 'payment', 'user'])[1 + n %% 4] || '.'
                           || (ARRAY['created', 'paid', 'failed'])[1 + n %% 3] || '.' || (n %% 97),
                       convert_to(json_build_object('id', n, 'note', 'customer ' || (n %% 5000),
                                                    'pad', repeat('x', 120))::text, 'UTF8'),
                       json_build_object('tenant', 't-' || (n %% 50))::jsonb,
                       '{}',
                       CASE WHEN n %% 3 = 0 THEN 'customer-' || (n %% 10000) END,
                       CASE WHEN n %% 3 = 0 THEN n END,
                       3,
                       CASE WHEN n %% 100 < 60 THEN 'unroutable'
                            WHEN n %% 100 < 95 THEN 'max_attempts'
                            ELSE (ARRAY['no_exchange', 'access_refused', 'too_large',
                                        'rejected'])[1 + n %% 4] END,
                       'benchmark',
                       now() - interval '30 days',
                       now() - (n::float8 / %(rows)s) * interval '30 days'
                FROM generate_series(%(start)s + 1, %(end)s) AS n
                """,
                {
                    "start": start,
                    "end": min(start + step, rows),
                    "rows": rows,
                    "replayable": replayable,
                },
            )
        conn.execute("VACUUM ANALYZE outbox.dead")


def filters(some_id: UUID) -> list[tuple[str, dict[str, str]]]:
    return [
        ("no filter", {}),
        ("reason, common", {"reason": "unroutable"}),
        ("reason, rare", {"reason": "too_large"}),
        ("exchange", {"exchange": "exchange-7"}),
        ("routing key, prefix glob", {"routing_key": "payment.failed.*"}),
        ("routing key, inner glob", {"routing_key": "*.paid.4?"}),
        ("ordering key, exact", {"key": "customer-4242"}),
        ("ordering key, prefix glob", {"key": "customer-42*"}),
        ("since 1h", {"since": "1h"}),
        ("until 29d ago", {"until": "29d"}),
        ("message id start", {"id": str(some_id)[:6]}),
        ("text search", {"text": "customer 4242"}),
        (
            "combined: reason, exchange, key glob, since",
            {
                "reason": "max_attempts",
                "exchange": "exchange-3",
                "routing_key": "order.*",
                "since": "20d",
            },
        ),
        ("matches nothing: exchange", {"exchange": "nope"}),
        ("matches nothing: reason", {"reason": "invalid"}),
        (
            "matches nothing: rare reason + exchange",
            {"reason": "rejected", "exchange": "replay-me"},
        ),
        ("matches nothing: routing key glob", {"routing_key": "nope.*"}),
        ("matches nothing: inner glob", {"routing_key": "*.nope"}),
        ("matches nothing: key glob", {"key": "nobody-*"}),
        ("matches nothing: id start", {"id": "ffffffff0"}),
        ("matches nothing: text", {"text": "no such words anywhere"}),
        ("matches nothing: time", {"since": "2000-01-01", "until": "2000-01-02"}),
    ]


INDEXES = {
    "dead_reason_idx": "CREATE INDEX dead_reason_idx ON outbox.dead (reason, failed_at)",
    "dead_exchange_idx": "CREATE INDEX dead_exchange_idx ON outbox.dead (exchange, failed_at)",
    "dead_routing_key_idx": (
        "CREATE INDEX dead_routing_key_idx ON outbox.dead (routing_key text_pattern_ops)"
    ),
    "dead_ordering_key_prefix_idx": (
        "CREATE INDEX dead_ordering_key_prefix_idx ON outbox.dead"
        " (ordering_key text_pattern_ops) WHERE ordering_key IS NOT NULL"
    ),
}


def index_pairs(url: str, pairs: int, tries: int) -> None:
    """Migration 0030's four indexes against none of them, interleaved: what they buy."""
    slowest: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(pairs):
        for present in (True, False):
            with psycopg.connect(url, autocommit=True) as conn:
                for name, create in INDEXES.items():
                    conn.execute(f"DROP INDEX IF EXISTS outbox.{name}")
                    if present:
                        conn.execute(create)
                conn.execute("ANALYZE outbox.dead")
            print(f"pair {pair + 1}, {'with' if present else 'without'} 0030's indexes:")
            results = pages(url, tries)
            slowest[present].append(max(s for _, _, s in results))
    print(
        "slowest first page, with the indexes: "
        + ", ".join(f"{s:.0f}" for s in slowest[True])
        + " ms; without: "
        + ", ".join(f"{s:.0f}" for s in slowest[False])
        + " ms"
    )


def pages(url: str, tries: int) -> list[tuple[str, float, float]]:
    with psycopg.connect(url) as conn:
        (some_id,) = conn.execute("SELECT message_id FROM outbox.dead LIMIT 1").fetchone() or ()
    results = []
    with TestClient(app.create_app(app.Config(url)), base_url="http://127.0.0.1") as client:
        for label, params in filters(some_id):
            times = []
            for _ in range(tries):
                began = time.perf_counter()
                response = client.get("/dead", params=params)
                times.append((time.perf_counter() - began) * 1000)
                assert response.status_code == 200, (label, response.text[:300])
            results.append((label, statistics.median(times), max(times)))
            verdict = "ok" if max(times) <= TARGET_MS else "OVER"
            print(
                f"{label:<45} median {statistics.median(times):7.1f} ms  "
                f"slowest {max(times):7.1f} ms  {verdict}",
                flush=True,
            )
        page = client.get("/dead").text
        token = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        others: list[tuple[str, dict[str, str] | None]] = [
            ("overview", None),
            ("confirm count: everything", {}),
            ("confirm count: reason, common", {"reason": "unroutable"}),
            ("confirm count: exchange", {"exchange": "exchange-7"}),
            ("confirm count: routing key glob", {"routing_key": "payment.*"}),
        ]
        for label, asked in others:
            times = []
            for _ in range(tries):
                began = time.perf_counter()
                if asked is None:
                    response = client.get("/")
                else:
                    form = {"csrf": token, "kind": "replay", "scope": "all"} | asked
                    response = client.post("/dead/confirm", data=form)
                times.append((time.perf_counter() - began) * 1000)
                assert response.status_code == 200, (label, response.text[:300])
            print(
                f"{label:<45} median {statistics.median(times):7.1f} ms  "
                f"slowest {max(times):7.1f} ms  (not a first page)",
                flush=True,
            )
    return results


def replay(url: str) -> float:
    browser = browse.Browser(url)
    browser.open()
    runner = actions.Actions(url, browser.count)
    where = DeadFilter(exchange="replay-me")
    batches: list[float] = []
    last = [time.perf_counter()]

    def beat() -> None:
        now = time.perf_counter()
        batches.append(now - last[0])
        last[0] = now

    began = time.perf_counter()
    started = runner.start("replay", "benchmark", where, browser.last_dead())
    assert isinstance(started, actions.Started)
    # The batches' lengths, from the record's beats.
    with psycopg.connect(url, autocommit=True) as conn:
        done = 0
        while True:
            row = conn.execute(
                "SELECT done, state FROM outbox.console_actions WHERE id = %s",
                (started.action.id,),
            ).fetchone()
            assert row is not None
            if row[0] != done:
                done = row[0]
                beat()
            if row[1] != "running":
                break
            time.sleep(0.01)
    runner.join()
    seconds = time.perf_counter() - began
    final = runner.get(started.action.id)
    browser.close()
    assert final is not None
    print(
        f"replay: {final.done:,} rows in {seconds:.1f} s = {final.done / seconds:,.0f} rows/s "
        f"(target >= 1,000), {final.state}; longest gap between batches "
        f"{max(batches) * 1000:.0f} ms"
    )
    return seconds


def archived(url: str) -> int:
    with psycopg.connect(url) as conn:
        (n,) = conn.execute("SELECT count(*) FROM outbox.archive").fetchone() or (0,)
    return int(n)


def relay_rate(
    url: str, amqp_url: str, exchange: str, backlog: int, replayed: int, window: float, beside: bool
) -> float:
    """Messages a second one relay archives over `window` seconds, once it is draining a backlog
    of `backlog`, with a replay of `replayed` dead rows started at the window's start or not."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "TRUNCATE outbox.messages, outbox.archive, outbox.dead, outbox.console_actions"
        )
        conn.execute(
            "SELECT outbox.enqueue(%s, 'bench.' || i, convert_to(repeat('x', 256), 'UTF8'))"
            " FROM generate_series(1, %s) AS i",
            [exchange, backlog],
        )
    fill_replayable(url, replayed, exchange)
    env = clean_env(OUTBOX_DATABASE_URL=url, OUTBOX_AMQP_URL=amqp_url, OUTBOX_LOG_FORMAT="text")
    proc = subprocess.Popen(
        [sys.executable, "-m", "relay", "run"], env=env, stderr=subprocess.PIPE, text=True
    )
    ready = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            if " ready: schema=" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(60):
            raise SystemExit("the relay did not start")
        while archived(url) < 2000:  # draining at its pace
            time.sleep(0.05)
        browser = browse.Browser(url)
        browser.open()
        runner = actions.Actions(url, browser.count)
        start, count = time.perf_counter(), archived(url)
        if beside:
            where = DeadFilter(routing_key="replayed.*")
            started = runner.start("replay", "benchmark", where, browser.last_dead())
            assert isinstance(started, actions.Started)
        time.sleep(max(0.0, window - (time.perf_counter() - start)))
        rate = (archived(url) - count) / (time.perf_counter() - start)
        runner.join()
        browser.close()
    finally:
        proc.terminate()
        proc.wait(60)
    return rate


def fill_replayable(url: str, rows: int, exchange: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers, properties,"
            " attempts, reason, created_at) SELECT gen_random_uuid(), %s, 'replayed.' || n,"
            " convert_to(repeat('y', 256), 'UTF8'), '{}', '{}', 3, 'unroutable', now()"
            " FROM generate_series(1, %s) AS n",
            [exchange, rows],
        )
        conn.execute("VACUUM ANALYZE outbox.dead")


def beside(url: str, amqp_url: str, pairs: int, replayed: int, window: float) -> None:
    exchange = queue = f"outbox-bench.{uuid4().hex[:8]}"
    asyncio.run(declare(amqp_url, exchange, queue))
    backlog = 200_000
    ratios = []
    try:
        for pair in range(pairs):
            alone = relay_rate(url, amqp_url, exchange, backlog, replayed, window, beside=False)
            with_replay = relay_rate(
                url, amqp_url, exchange, backlog, replayed, window, beside=True
            )
            ratios.append(with_replay / alone)
            print(
                f"pair {pair + 1}: relay alone {alone:,.0f} msg/s, beside a replay of "
                f"{replayed:,} {with_replay:,.0f} msg/s: {with_replay / alone:.2f}",
                flush=True,
            )
    finally:
        asyncio.run(delete(amqp_url, exchange, queue))
    print(
        f"relay beside a replay / alone: median {statistics.median(ratios):.2f} "
        f"({min(ratios):.2f}-{max(ratios):.2f}), target >= 0.8"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dead", type=int, default=1_000_000)
    parser.add_argument("--replay", type=int, default=100_000)
    parser.add_argument("--tries", type=int, default=5)
    parser.add_argument("--beside", type=int, default=0, help="pairs of the relay-beside run")
    parser.add_argument("--window", type=float, default=8.0, help="seconds each pair's run counts")
    parser.add_argument("--skip-pages", action="store_true")
    parser.add_argument(
        "--index-pairs", type=int, default=0, help="pairs of pages with and without 0030's indexes"
    )
    args = parser.parse_args()
    with services.discover() as svc, svc.scratch_database("outbox_bench_console") as url:
        if not args.skip_pages:
            began = time.perf_counter()
            fill(url, args.dead, args.replay)
            print(f"filled dead with {args.dead:,} rows in {time.perf_counter() - began:.0f} s")
            results = pages(url, args.tries)
            over = [label for label, _, slowest in results if slowest > TARGET_MS]
            print(f"first pages over {TARGET_MS:.0f} ms: {len(over)} of {len(results)} {over}")
            if args.index_pairs:
                index_pairs(url, args.index_pairs, args.tries)
            replay(url)
        if args.beside:
            beside(url, svc.amqp_url, args.beside, args.replay, args.window)


if __name__ == "__main__":
    main()
