"""The pipeline's fixtures: one local SparkSession for the whole session, and an archive with
thousands of rows over several days, dead letters, and rows too young to export."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest

if not os.environ.get("CI"):  # CI installs the spark extra: there, its absence is a failure
    pytest.importorskip("pyspark", reason="the spark extra is not installed")

from pyspark.sql import SparkSession

from relay.core import config
from relay.pipeline import session
from tests.support import spark_classes

# The tests' Spark jobs are small and short: the JVM's quick compiler alone runs them about a
# fifth faster, and the serial collector spares the two cores the parallel one's threads (this
# process's JVM and the pipelines the tests start as subprocesses). Each JVM maps the classes
# it loads at its start from an archive, if `deploy/dev test` made one (tests/support/
# spark_classes.py). Set before this process's first JVM, and inherited by every other.
os.environ.setdefault(
    "JAVA_TOOL_OPTIONS", f"{spark_classes.BASE} {spark_classes.java_options()}".strip()
)

#: Rows published before this are exported; the test data straddles it.
CUTOFF_AGO = timedelta(days=2)
#: A row published one microsecond before midnight UTC: its day must be that day.
LAST_MICROSECOND = datetime(2026, 11, 10, 23, 59, 59, 999999, tzinfo=UTC)


# Each xdist worker that runs a Spark test starts this session's JVM once (~5 s alone, 15-20 s in
# the parallel run): whichever Spark test comes first on a worker pays it, and says so.
@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    if shutil.which("java") is None and not Path("/usr/share/java/postgresql.jar").exists():
        pytest.fail("the pipeline tests need Java and the JDBC driver (deploy/dev installs them)")
    settings = config.load_pipeline(spark_master="local[2]")
    conf = {"spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "2"}
    with session.spark_session(settings, conf) as s:
        yield s


@pytest.fixture
def lake(tmp_path: Path) -> str:
    return (tmp_path / "lake").as_uri()


def fill(url: str, *, old: int = 3000, young: int = 200, dead: int = 150) -> datetime:
    """Archive `old` rows published over 7 days before the cutoff, then the one at midnight,
    then `young` rows after the cutoff, with ids in publish order as the relay makes them; and
    `dead` dead rows before the cutoff. Returns the cutoff."""
    cutoff = datetime.now(UTC) - CUTOFF_AGO
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, created_at, published_at)"
            " SELECT gen_random_uuid(), e, rk, convert_to('{\"i\": ' || i || '}', 'UTF8'),"
            " '{}', '{}', a, p - l, p FROM ("
            "   SELECT i, (ARRAY['orders', 'orders', 'billing'])[1 + i %% 3] AS e,"
            "          (ARRAY['order.created', 'order.paid', 'invoice.sent', 'order.paid'])"
            "            [1 + i %% 4] AS rk,"
            "          CASE WHEN i %% 10 = 0 THEN 2 + i %% 3 ELSE 1 END AS a,"
            "          (i * 7919 %% 997) * interval '1 ms' + (i %% 3) * interval '1 s' AS l,"
            "          %(start)s + i * %(step)s AS p"
            "   FROM generate_series(0, %(old)s - 1) AS i) AS g"
            " ORDER BY p",
            {"start": cutoff - timedelta(days=7), "step": timedelta(days=7) / old, "old": old},
        )
        conn.execute(
            "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, created_at, published_at)"
            " VALUES (gen_random_uuid(), 'orders', 'order.created', '', '{}', '{}', 1,"
            " %(t)s - interval '5 ms', %(t)s)",
            {"t": LAST_MICROSECOND},
        )
        conn.execute(
            "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, created_at, published_at)"
            " SELECT gen_random_uuid(), 'orders', 'order.created', '', '{}', '{}', 1,"
            " p - interval '3 ms', p"
            " FROM (SELECT now() - i * interval '1 s' AS p FROM generate_series(1, %(n)s) i) g"
            " ORDER BY p",
            {"n": young},
        )
        conn.execute("ALTER TABLE outbox.dead DISABLE TRIGGER USER")  # no WARNING per row
        conn.execute(
            "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, reason, detail, created_at, failed_at)"
            " SELECT gen_random_uuid(), 'orders', 'order.lost', '', '{}', '{}', 1,"
            " (ARRAY['unroutable', 'unroutable', 'rejected', 'max_attempts'])[1 + i %% 4], '',"
            " f - interval '1 s', f"
            " FROM (SELECT i, %(start)s + i * interval '1 hour' AS f"
            "       FROM generate_series(1, %(n)s) i) g ORDER BY f",
            {"start": cutoff - timedelta(days=7), "n": dead},
        )
        conn.execute("ALTER TABLE outbox.dead ENABLE TRIGGER USER")
    return cutoff
