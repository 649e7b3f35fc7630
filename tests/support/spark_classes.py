"""A class archive for the tests' Spark JVMs, so that each starts in about half the CPU.

A Spark JVM spends most of its start loading and verifying the same few thousand classes from
pyspark's jars. Java's class data sharing (CDS) keeps them, already parsed, in an archive that
every later JVM maps instead. On this 2-core machine a local session with a small job took
10.1-10.8 CPU-seconds without it and 5.4-6.8 with it; `pytest -n 3 tests/pipeline` (each
worker's session, the pipelines run as subprocesses, the standalone cluster's daemons, drivers
and executors) took 222-228 CPU-seconds and 118-122 s without it, 165-175 and 89-97 s with it
(3 interleaved pairs). Making it takes about 25 CPU-seconds, once per virtualenv.

    python -m tests.support.spark_classes

makes the archive once per virtualenv (`deploy/dev test` runs it beside the linters): one local
session runs a small job with `-XX:ArchiveClassesAtExit`. The tests then add `java_options()` to
JAVA_TOOL_OPTIONS. A JVM uses the archive only if its class path is the one it was made with:
a Spark JVM whose is another (or an archive a newer pyspark made stale) starts as it would
without it, silently (the options turn CDS's own warnings off). Without the archive nothing
changes but the time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pyspark

#: In the virtualenv that holds pyspark: a new virtualenv (a fresh clone's) makes its own.
ARCHIVE = Path(sys.prefix) / f"spark-classes-{pyspark.__version__}.jsa"
#: The tests' JVM options (tests/pipeline/conftest.py says why), which the archive is made with.
BASE = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: CDS's own warnings off: a JVM whose class path is not the archive's starts without it, quietly.
QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"

#: The job whose classes are archived: a session as the pipeline starts it and a grouping with a
#: shuffle. (Parquet written and read back too made the archive take 4 s longer to make and the
#: pipeline tests no faster: most of a JVM's start is Spark's own classes.)
JOB = """
from relay.core import config
from relay.pipeline import session
settings = config.load_pipeline(spark_master="local[2]")
with session.spark_session(settings, {"spark.sql.shuffle.partitions": "4"}) as spark:
    spark.range(10_000).selectExpr("id % 7 AS k", "id").groupBy("k").count().collect()
"""


def java_options() -> str:
    """What JAVA_TOOL_OPTIONS gets besides BASE: the archive, if it has been made."""
    if not ARCHIVE.is_file():
        return ""
    return f"-XX:SharedArchiveFile={ARCHIVE} {QUIET}"


def make() -> None:
    """Run JOB with -XX:ArchiveClassesAtExit and put the archive in place whole (a rename, in
    the archive's own folder: /tmp may be another file system)."""
    with tempfile.TemporaryDirectory(dir=ARCHIVE.parent) as folder:
        made = Path(folder, "classes.jsa")
        env = {**os.environ, "JAVA_TOOL_OPTIONS": f"{BASE} -XX:ArchiveClassesAtExit={made} {QUIET}"}
        subprocess.run(  # our own command line
            [sys.executable, "-c", JOB],
            env=env,
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=300,
        )
        if not made.is_file():
            raise SystemExit("spark_classes: the JVM made no archive")
        os.replace(made, ARCHIVE)


def main() -> int:
    if ARCHIVE.is_file():
        return 0
    try:
        make()
    except subprocess.CalledProcessError as failed:
        tail = failed.stderr.decode(errors="replace")[-2000:] if failed.stderr else ""
        print(f"spark_classes: no archive (Spark JVMs start without it): {tail}", file=sys.stderr)
        return 1
    except (subprocess.TimeoutExpired, OSError) as failed:
        print(f"spark_classes: no archive (Spark JVMs start without it): {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
