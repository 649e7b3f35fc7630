"""Pipeline benchmark: export, report and prune of a big archive on Spark, against a single
process without Spark (not part of the test suite).

    .venv/bin/python tests/benchmarks/pipeline.py [--rows 1000000] [--master local[2]]
                                                  [--skip-prune]

It creates a scratch database whose archive holds `--rows` rows (200-byte bodies, ten days) and
whose dead table holds 1 % as many, then, each in a fresh process so that peak memory is its
own:

- baseline: the same export (archive and dead) without Spark: psycopg COPY in id chunks →
  pyarrow → Parquet partitioned by day;
- spark: `export`, `report` and `prune` as `outbox-relay pipeline all` runs them, timed per
  phase, with the JVM's and Python's peak resident memory.

It prints both and the ratio of the export times. Services come from OUTBOX_TEST_DATABASE_URL
(default: the local one).
"""

from __future__ import annotations

import argparse
import io
import json
import resource
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import services

COMMON = ["id", "message_id", "exchange", "routing_key", "body", "headers", "properties"]
COMMON += ["ordering_key", "attempts", "created_at"]
ARCHIVE = [*COMMON, "published_at", "ambiguous", "seq"]
DEAD = [*COMMON, "failed_at", "reason", "detail"]


def fill(url: str, rows: int) -> datetime:
    """The archive and dead rows; returns a cutoff after all of them."""
    start = datetime.now(UTC) - timedelta(days=11)
    with psycopg.connect(url) as conn:
        for lo in range(0, rows, 250_000):
            conn.execute(
                "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers,"
                " properties, attempts, created_at, published_at)"
                " SELECT gen_random_uuid(), 'orders', 'order.' || (i %% 20),"
                " convert_to(repeat('x', 200), 'UTF8'), '{\"trace\": \"abc\"}', '{}',"
                " 1 + (i %% 50 = 0)::int, p - (i::bigint * 7919 %% 997) * interval '1 ms', p"
                " FROM (SELECT i, %(start)s + i * %(step)s AS p"
                "       FROM generate_series(%(lo)s, %(hi)s) AS i) AS g ORDER BY p",
                {
                    "start": start,
                    "step": timedelta(days=10) / rows,
                    "lo": lo,
                    "hi": min(lo + 250_000, rows) - 1,
                },
            )
            conn.commit()
        conn.execute("ALTER TABLE outbox.dead DISABLE TRIGGER USER")
        conn.execute(
            "INSERT INTO outbox.dead (message_id, exchange, routing_key, body, headers,"
            " properties, attempts, reason, detail, created_at, failed_at)"
            " SELECT gen_random_uuid(), 'orders', 'order.lost', '', '{}', '{}', 1, 'unroutable',"
            " '', p, p FROM (SELECT %(start)s + i * %(step)s AS p"
            "               FROM generate_series(1, %(n)s) AS i) AS g ORDER BY p",
            {"start": start, "step": timedelta(days=10) / (rows // 100), "n": rows // 100},
        )
        conn.execute("ALTER TABLE outbox.dead ENABLE TRIGGER USER")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox.archive, outbox.dead")
    return start + timedelta(days=10, hours=12)


def baseline(url: str, lake: Path, chunk: int = 100_000) -> dict[str, Any]:
    """The export in this process, archive and dead as Spark's does: COPY → pyarrow → Parquet
    partitioned by day."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pv
    import pyarrow.parquet as pq

    started = time.perf_counter()
    written = 0
    with psycopg.connect(url) as conn:
        for table, columns, when in (
            ("archive", ARCHIVE, "published_at"),
            ("dead", DEAD, "failed_at"),
        ):
            types = {name: pa.string() for name in ("message_id", "body", "headers", "properties")}
            types |= {
                name: pa.timestamp("us", tz="UTC") for name in columns if name.endswith("_at")
            }
            select = ", ".join(_as_text(name) for name in columns)
            query = f"SELECT coalesce(max(id), 0) FROM outbox.{table}"
            (last,) = conn.execute(query.encode()).fetchone() or (0,)
            for lo in range(0, last, chunk):
                buffer = io.BytesIO()
                copy = (
                    f"COPY (SELECT {select} FROM outbox.{table} WHERE id > %s AND id <= %s)"
                    " TO STDOUT (FORMAT csv)"
                )
                with conn.cursor().copy(copy.encode(), (lo, lo + chunk)) as rows:
                    for data in rows:
                        buffer.write(data)
                buffer.seek(0)
                frame = pv.read_csv(
                    buffer,
                    read_options=pv.ReadOptions(column_names=columns),
                    convert_options=pv.ConvertOptions(column_types=types),
                )
                body = pa.array([bytes.fromhex(h) for h in frame["body"].to_pylist()], pa.binary())
                frame = frame.set_column(columns.index("body"), "body", body)
                day = pc.strftime(frame[when], format="%Y-%m-%d")
                frame = frame.append_column("day", day)
                pq.write_to_dataset(frame, str(lake / table), partition_cols=["day"])
                written += frame.num_rows
    return {
        "rows": written,
        "seconds": time.perf_counter() - started,
        "python_peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _as_text(column: str) -> str:
    if column == "body":
        return "encode(body, 'hex')"
    if column in ("headers", "properties"):
        return f"{column}::text"
    if column.endswith("_at"):
        return f"to_char({column} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')"
    return column


def spark(
    url: str, lake: Path, report: Path, master: str, cutoff: datetime, *, pruning: bool = True
) -> dict[str, Any]:
    """export, report and prune as the pipeline runs them, timed per phase."""
    from relay.core import config
    from relay.pipeline import charts, session
    from relay.pipeline import report as reporting
    from relay.pipeline.database import PipelineDatabase
    from relay.pipeline.export import Source, export
    from relay.pipeline.prune import prune

    settings = config.load_pipeline(database_url=url, spark_master=master, lake=str(lake))
    figures: dict[str, Any] = {}
    started = time.perf_counter()
    with session.spark_session(settings) as s, PipelineDatabase.connect(url, "outbox") as db:
        figures["start_seconds"] = time.perf_counter() - started
        where = session.lake_path(settings)
        source = Source(url, "outbox", settings.export_partitions, settings.fetch_size)
        phase = time.perf_counter()
        figures["rows"] = export(s, where, source, db, cutoff, chunk=settings.export_chunk)
        figures["export_seconds"] = time.perf_counter() - phase
        phase = time.perf_counter()
        built = reporting.build(s, where)
        figures["tables_seconds"] = time.perf_counter() - phase
        charts.write(built, report, where)
        figures["report_seconds"] = time.perf_counter() - phase
        phase = time.perf_counter()
        figures["pruned"] = prune(s, where, db).deleted if pruning else 0
        figures["prune_seconds"] = time.perf_counter() - phase
        jvm = s.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
        figures["jvm_peak_mib"] = _peak_kib(jvm) / 1024
    figures["total_seconds"] = time.perf_counter() - started
    figures["python_peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def _peak_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="archived rows")
    parser.add_argument("--master", default="local[2]", help="Spark master")
    parser.add_argument(
        "--skip-prune", action="store_true", help="no prune (paced: 10 minutes at 10,000,000)"
    )
    parser.add_argument("--phase", choices=["baseline", "spark"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--lake", help=argparse.SUPPRESS)
    parser.add_argument("--cutoff", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase == "baseline":
        print(json.dumps(baseline(args.url, Path(args.lake))))
        return
    if args.phase == "spark":
        report = Path(args.lake).with_name("report")
        cutoff = datetime.fromisoformat(args.cutoff)
        figures = spark(
            args.url, Path(args.lake), report, args.master, cutoff, pruning=not args.skip_prune
        )
        print(json.dumps(figures))
        return
    with (
        services.discover() as svc,
        svc.scratch_database("outbox_bench_pipeline") as url,
        tempfile.TemporaryDirectory() as scratch,
    ):
        started = time.perf_counter()
        cutoff = fill(url, args.rows)
        print(
            f"filled {args.rows:,} archived and {args.rows // 100:,} dead rows in "
            f"{time.perf_counter() - started:.1f}s"
        )
        base = _phase("baseline", url, Path(scratch, "baseline", "lake"), cutoff, args.master)
        print(
            f"baseline (COPY → pyarrow → Parquet, one process): {base['rows']:,} rows "
            "(archive and dead) in "
            f"{base['seconds']:.1f}s, Python peak {base['python_peak_mib']:.0f} MiB"
        )
        extra = ["--skip-prune"] if args.skip_prune else []
        run = _phase("spark", url, Path(scratch, "spark", "lake"), cutoff, args.master, *extra)
        print(
            f"spark on {args.master}: start {run['start_seconds']:.1f}s, export "
            f"{run['rows']:,} rows (archive and dead) in {run['export_seconds']:.1f}s, report "
            f"{run['report_seconds']:.1f}s (its tables {run['tables_seconds']:.1f}s, then the "
            "charts), "
            + (
                "no prune"
                if args.skip_prune
                else f"prune {run['pruned']:,} rows in {run['prune_seconds']:.1f}s (paced: "
                "1,000 rows per transaction, 50 ms apart)"
            )
        )
        print(
            f"spark total {run['total_seconds']:.1f}s; peak memory: JVM "
            f"{run['jvm_peak_mib']:.0f} MiB, Python {run['python_peak_mib']:.0f} MiB"
        )
        print(f"export time, spark / baseline: {run['export_seconds'] / base['seconds']:.2f}x")


def _phase(
    name: str, url: str, lake: Path, cutoff: datetime, master: str, *extra: str
) -> dict[str, Any]:
    lake.parent.mkdir(parents=True)
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--phase",
            name,
            "--url",
            url,
            "--lake",
            str(lake),
            "--cutoff",
            cutoff.isoformat(),
            "--master",
            master,
            *extra,
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr}")
    figures: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


if __name__ == "__main__":
    main()
