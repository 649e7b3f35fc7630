"""A running relay as an operator sees it: its metrics after a known workload, its probes while
the services come and go, and its logs."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

import relay
from relay.ops import metrics
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env
from tests.support.proxy import TcpProxy
from tests.support.wait import until

pytestmark = pytest.mark.slow


def endpoint(proc: RelayProcess) -> str:
    line = proc.wait_for("metrics and probes on")
    match = re.search(r"http://[^:]+:(\d+)/metrics", line)
    assert match, line
    return f"http://127.0.0.1:{match[1]}"


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:  # noqa: S310  # a local URL
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, by (name, sorted labels)."""
    status, text = get(base + "/metrics")
    assert status == 200
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict[Any, float], name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def enqueue(
    url: str, exchange: str, routing_key: str, *, body: bytes = b"x", key: str | None = None
) -> None:
    with psycopg.connect(url) as conn:
        relay.enqueue(conn, exchange, routing_key, body, ordering_key=key)
        conn.commit()


async def test_a_scrape_counts_exactly_the_workload(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    await broker.declare(binding="ok.#")
    async with broker.channel() as channel:  # a queue that refuses everything: nacks
        full = await channel.declare_queue(
            f"{broker.queue}.full",
            auto_delete=True,
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await full.bind(broker.exchange, "nack")
    for _ in range(10):
        enqueue(database_url, broker.exchange, "ok.a")
    for _ in range(2):
        enqueue(database_url, broker.exchange, "nowhere")
    enqueue(database_url, f"{broker.exchange}.missing", "ok.a")
    enqueue(database_url, broker.exchange, "nack")
    enqueue(database_url, broker.exchange, "nowhere", key="acct-1")  # blocks its key…
    enqueue(database_url, broker.exchange, "ok.b", key="acct-1")  # …holding this one back
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_MAX_ATTEMPTS="2",
        OUTBOX_RETRY_DELAY="0.05",
        OUTBOX_POLL_INTERVAL="0.2",
        OUTBOX_STATS_INTERVAL="0.5",
    )
    with RelayProcess(env) as proc:
        base = endpoint(proc)

        def settled() -> dict[Any, float] | None:
            samples = scrape(base)
            done = (
                value(samples, "outbox_published_total") == 10
                and value(samples, "outbox_dead_messages") == 5
                and value(samples, "outbox_blocked_keys") == 1
            )
            return samples if done else None

        found = until(settled, timeout=30, interval=0.2, message="the workload to settle")
        assert found is not None
        samples = found
        assert proc.stop() == 0
    outcome = {
        o: value(samples, "outbox_publish_outcomes_total", outcome=o)
        for o in ("acked", "returned", "no_exchange", "nacked", "ambiguous")
    }
    assert outcome == {"acked": 10, "returned": 3, "no_exchange": 1, "nacked": 2, "ambiguous": 0}
    dead = {
        r: value(samples, "outbox_dead_lettered_total", reason=r)
        for r in ("unroutable", "no_exchange", "max_attempts", "invalid")
    }
    assert dead == {"unroutable": 3, "no_exchange": 1, "max_attempts": 1, "invalid": 0}
    assert value(samples, "outbox_retried_total", outcome="nacked") == 1
    assert value(samples, "outbox_keys_blocked_total") == 1
    assert value(samples, "outbox_fenced_settles_total") == 0
    assert value(samples, "outbox_publish_confirm_seconds_count") == 10
    assert value(samples, "outbox_commit_confirm_seconds_count") == 10
    assert (value(samples, "outbox_batch_size_count") or 0) >= 1
    assert (value(samples, "outbox_claim_seconds_count") or 0) >= 1
    backlog = {
        s: value(samples, "outbox_messages", state=s)
        for s in ("due", "scheduled", "gated", "in_flight")
    }
    assert backlog == {"due": 0, "scheduled": 0, "gated": 1, "in_flight": 0}
    assert value(samples, "outbox_oldest_due_seconds") == 0
    assert value(samples, "outbox_broker_connected") == 1
    assert value(samples, "outbox_broker_blocked") == 0
    assert (value(samples, "outbox_db_dead_tuples") or 0) >= 0
    assert value(samples, "outbox_db_oldest_xmin_seconds") is not None
    names = {name for name, _ in samples}
    for family in metrics.Metrics().registry.collect():  # every metric the relay defines
        assert any(n.startswith(family.name) for n in names), family.name


def test_autovacuum_off_for_the_queue_is_warned_once_and_shown(
    database_url: str, amqp_url: str
) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:  # this test's own database
        conn.execute("ALTER TABLE outbox.messages SET (autovacuum_enabled = false)")
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url, OUTBOX_AMQP_URL=amqp_url, OUTBOX_STATS_INTERVAL="0.2"
    )
    with RelayProcess(env) as proc:
        base = endpoint(proc)
        proc.wait_for("autovacuum is off for the messages table")
        first = value(scrape(base), "outbox_observed_timestamp_seconds") or 0.0

        def observed_again() -> bool:  # a few more looks, each finding it still off
            return (value(scrape(base), "outbox_observed_timestamp_seconds") or 0.0) > first + 1

        until(observed_again, timeout=30, interval=0.1, message="more observations")
        assert value(scrape(base), "outbox_db_autovacuum_enabled") == 0
        assert proc.stop() == 0
    assert proc.output.count("autovacuum is off") == 1


@contextmanager
def proxied(url: str, default_port: int) -> Iterator[tuple[TcpProxy, str]]:
    parts = urlsplit(url)
    with TcpProxy(parts.hostname or "127.0.0.1", parts.port or default_port) as proxy:
        credentials = parts.netloc.rpartition("@")[0]
        netloc = (
            f"{credentials}@127.0.0.1:{proxy.port}" if credentials else f"127.0.0.1:{proxy.port}"
        )
        yield proxy, parts._replace(netloc=netloc).geturl()


def test_readiness_says_what_start_up_waits_for(database_url: str, closed_port: int) -> None:
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=f"amqp://guest:guest@127.0.0.1:{closed_port}/",
        OUTBOX_STARTUP_TIMEOUT="60",
    )
    with RelayProcess(env) as proc:
        base = endpoint(proc)

        def waiting_for_the_broker() -> bool:
            status, body = get(base + "/readyz")
            return status == 503 and body.startswith("starting: waiting for RabbitMQ")

        until(waiting_for_the_broker, message="/readyz to name the broker start-up waits for")
        assert get(base + "/livez")[0] == 200  # waiting at start is not hanging
        assert proc.stop() == 0


# Slow (~7 s): a relay process and two outages (the broker's, then the database's), each lasting
# until /readyz reports it, then waited out through the relay's reconnect back-off.
def test_probes_follow_the_services(database_url: str, amqp_url: str) -> None:
    with proxied(database_url, 5432) as (db, db_url), proxied(amqp_url, 5672) as (mq, mq_url):
        env = clean_env(
            OUTBOX_DATABASE_URL=db_url, OUTBOX_AMQP_URL=mq_url, OUTBOX_POLL_INTERVAL="0.2"
        )
        with RelayProcess(env) as proc:
            base = endpoint(proc)
            proc.wait_ready()

            def readyz(expected: int, fragment: str) -> bool:
                status, body = get(base + "/readyz")
                return status == expected and fragment in body

            until(lambda: readyz(200, "database: ok"), message="ready")
            mq.cut()  # the broker goes away
            until(lambda: readyz(503, "broker: not connected"), message="not ready (broker)")
            mq.restore()
            until(lambda: readyz(200, "broker: ok"), message="ready again")
            db.cut()  # the database goes away
            until(lambda: readyz(503, "database: unreachable"), message="not ready (database)")
            assert get(base + "/livez")[0] == 200  # waiting out an outage is not hanging
            db.restore()
            until(lambda: readyz(200, "database: ok"), message="ready again")
            assert get(base + "/livez") == (200, "ok\n")
            assert get(base + "/nowhere")[0] == 404
            assert proc.stop() == 0


def shown_by_ps(pid: int) -> bytes:
    """What `ps` (the command line) and `ps e` (the environment) can show of a process."""
    return b"".join(Path(f"/proc/{pid}/{part}").read_bytes() for part in ("cmdline", "environ"))


async def test_logs_are_json_events_without_bodies_or_passwords(
    database_url: str, amqp_url: str, broker: Broker, tmp_path: Path
) -> None:
    await broker.declare(binding="ok")
    secret_db = (
        urlsplit(database_url)
        ._replace(
            netloc=f"postgres:sup3rsecret@{urlsplit(database_url).hostname}:"
            f"{urlsplit(database_url).port or 5432}"
        )
        .geturl()
    )
    enqueue(database_url, broker.exchange, "nowhere", body=b"BODY-MARKER-7f3a")
    secret_file = tmp_path / "database-url"  # as a Kubernetes secret would be mounted
    secret_file.write_text(secret_db + "\n")
    env = clean_env(OUTBOX_DATABASE_URL_FILE=str(secret_file), OUTBOX_AMQP_URL=amqp_url)
    with RelayProcess(env) as proc:
        base = endpoint(proc)
        line = proc.wait_for("dead-lettered")
        assert "sup3rsecret" not in get(base + "/readyz")[1] + get(base + "/metrics")[1]
        assert b"sup3rsecret" not in shown_by_ps(proc.proc.pid)
        assert proc.stop() == 0
    event = json.loads(line)
    assert event["event"] == "dead_lettered"
    assert event["reason"] == "unroutable"
    assert event["attempt"] == 1
    assert event["level"] == "WARNING"
    assert re.fullmatch(r"[0-9a-f-]{36}", event["message_id"])
    for raw in proc.lines:
        record = json.loads(raw)  # every line is one JSON object
        assert {"time", "level", "logger", "message"} <= set(record)
    assert "BODY-MARKER" not in proc.output
    assert "sup3rsecret" not in proc.output


async def test_a_failing_gauge_query_is_retried_loudly_and_never_stops_relaying(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    # The gauges' query fails with an error that is no outage (a table only it reads is gone):
    # the watcher must say so, keep trying, and come back by itself; the relay relays throughout
    # and stays live (restarting it would fix nothing).
    await broker.declare(binding="ok")
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=amqp_url,
        OUTBOX_STATS_INTERVAL="0.2",
        OUTBOX_POLL_INTERVAL="0.2",
    )
    with RelayProcess(env) as proc, psycopg.connect(database_url, autocommit=True) as owner:
        base = endpoint(proc)
        proc.wait_ready()
        owner.execute("ALTER TABLE outbox.blocked_keys RENAME TO blocked_elsewhere")
        line = proc.wait_for("chore watcher failed")
        assert "ERROR" in line or '"level": "ERROR"' in line
        enqueue(database_url, broker.exchange, "ok")
        assert len(await broker.collect(1)) == 1  # relaying goes on
        assert get(base + "/livez")[0] == 200
        assert (value(scrape(base), "outbox_chore_errors_total", chore="watcher") or 0) >= 1
        owner.execute("ALTER TABLE outbox.blocked_elsewhere RENAME TO blocked_keys")
        with psycopg.connect(database_url) as conn:  # something only a fresh observation shows
            relay.enqueue(conn, broker.exchange, "ok", b"later", available_at=timedelta(hours=1))

        def scheduled_seen() -> bool:
            return value(scrape(base), "outbox_messages", state="scheduled") == 1

        until(scheduled_seen, timeout=30, interval=0.1, message="the gauges to come back")
        assert proc.stop() == 0
