"""The pipeline on a real Spark standalone cluster (a master and one worker on this machine): run
by `outbox-relay pipeline all --spark-master spark://…` and by spark-submit, each is an
application of the master's whose tasks ran in an executor JVM of the worker's, and each leaves
the lake and the archive as a local run on the same data does."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from relay.core import config
from relay.pipeline import jobs, submit
from tests.pipeline.conftest import fill
from tests.pipeline.standalone import SPARK_HOME, Cluster, standalone
from tests.support import services
from tests.support.processes import clean_env
from tests.support.wait import until

pytestmark = pytest.mark.slow

JAR = "/usr/share/java/postgresql.jar"
#: The executors run in another zone than UTC (their JVMs take it from TZ): days stay UTC days.
ZONE = "Asia/Tokyo"
#: No Python on the executors: the pipeline uses Spark's built-in functions only, so the path
#: the driver gives them for Python workers (PYSPARK_PYTHON) must never be used.
NO_PYTHON = "/nonexistent/python3"
#: Small ranges (1,000 ids, the least), each read by 2 parallel JDBC partitions.
CHUNK, PARTITIONS = 1000, 2
SHUFFLE = "spark.sql.shuffle.partitions=4"  # as the local session's: 200 tasks would be slow
DATASETS = (
    "archive",
    "dead",
    *(f"report/{t}" for t in ("by_route", "attempts", "dead_by_reason", "daily")),
)
APP = "outbox-relay pipeline"


@dataclasses.dataclass(frozen=True)
class Archive:
    database: str  # filled once; each run gets a copy (CREATE DATABASE … TEMPLATE)
    cutoff: datetime


@dataclasses.dataclass(frozen=True)
class Outcome:
    lake: dict[str, Any]  # contents(), whatever the file names
    left: list[int]  # the archive's ids after the run's prune


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if not Path(JAR).is_file():
        pytest.fail("the cluster tests need the JDBC driver (deploy/dev installs it)")
    with standalone(tmp_path_factory.mktemp("spark"), clean_env(TZ=ZONE)) as started:
        yield started


def _admin(svc: services.Services, sql: str) -> None:
    with psycopg.connect(svc.database_url, autocommit=True) as conn:
        conn.execute(sql)


@pytest.fixture(scope="module")
def archive(svc: services.Services, template_db: str) -> Iterator[Archive]:
    name = f"outbox_cluster_{uuid.uuid4().hex[:8]}"
    _admin(svc, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    try:
        # Two archive ranges (the second partly young: the cutoff falls in it) and one dead.
        yield Archive(name, fill(svc.with_database(name), old=1500, young=50, dead=40))
    finally:
        _admin(svc, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def copy(svc: services.Services, archive: Archive) -> Iterator[str]:
    """A database holding exactly the archive's rows (ids, message ids and times alike)."""
    name = f"outbox_t_{uuid.uuid4().hex[:12]}"
    _admin(svc, f'CREATE DATABASE "{name}" TEMPLATE "{archive.database}"')
    try:
        yield svc.with_database(name)
    finally:
        _admin(svc, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="module")
def local(
    spark: SparkSession,
    svc: services.Services,
    archive: Archive,
    tmp_path_factory: pytest.TempPathFactory,
) -> Outcome:
    """What a local run (the suite's local[2] session) leaves, on a copy of the same archive."""
    folder = tmp_path_factory.mktemp("local")
    name = f"outbox_t_{uuid.uuid4().hex[:12]}"
    _admin(svc, f'CREATE DATABASE "{name}" TEMPLATE "{archive.database}"')
    try:
        url = svc.with_database(name)
        settings = config.load_pipeline(
            database_url=url,
            lake=(folder / "lake").as_uri(),
            export_chunk=CHUNK,
            export_partitions=PARTITIONS,
            report_dir=str(folder / "report"),
        )
        before = ids(url)
        jobs.run(
            settings, ["export", "report", "prune"], cutoff=archive.cutoff, say=quiet, spark=spark
        )
        outcome = Outcome(contents(folder / "lake"), ids(url))
    finally:
        _admin(svc, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    # What the cluster's runs are held to: every row before the cutoff in the lake, and gone.
    exported = sorted(row["id"] for row in outcome.lake["archive"][1])
    assert exported == [i for i in before if i not in outcome.left]
    # 1,500 old rows and the one at midnight; the 50 young ones stay; every dead row.
    assert (len(exported), len(outcome.left), len(outcome.lake["dead"][1])) == (1501, 50, 40)
    return outcome


def quiet(_: str) -> None:
    pass


def ids(url: str) -> list[int]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM outbox.archive ORDER BY id")]


def contents(lake: Path) -> dict[str, Any]:
    """Everything in the lake that does not depend on how Spark split the work: each dataset's
    schema and its rows (partition columns included) in order, and the export record without
    the times its markers were written at."""
    found: dict[str, Any] = {}
    for dataset in DATASETS:
        table = pq.read_table(lake / dataset)  # hive partitions: day=…/id_range=… are columns
        found[dataset] = (table.schema, sorted(table.to_pylist(), key=repr))
    found["_exports"] = {
        marker.name: {k: v for k, v in json.loads(marker.read_text()).items() if k != "at"}
        for marker in (lake / "_exports").iterdir()
        if not marker.name.startswith(".")  # Hadoop's checksums, and none half-written
    }
    return found


def driver_env(url: str, **more: str) -> dict[str, str]:
    return clean_env(
        OUTBOX_DATABASE_URL=url,  # the environment, not the command line, as README says
        # The driver listens for its executors on 127.0.0.1, and tells them so.
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOCAL_HOSTNAME="127.0.0.1",
        PYSPARK_PYTHON=NO_PYTHON,
        TZ=ZONE,
        **more,
    )


def flags(archive: Archive, folder: Path) -> list[str]:
    return [
        *("--until", archive.cutoff.isoformat()),
        # A plain absolute path: on one machine, one every process of the cluster reaches.
        *("--lake", str(folder / "lake"), "--report-dir", str(folder / "report")),
        *("--export-chunk", str(CHUNK), "--export-partitions", str(PARTITIONS)),
    ]


def ran_on(cluster: Cluster, before: set[str]) -> dict[str, Any]:
    """The one application the master saw since `before`, once it is finished; its tasks ran
    in one executor, a JVM the worker started (its log is in the worker's folder)."""
    new = until(
        lambda: [a for i, a in cluster.applications().items() if i not in before],
        timeout=30,
        message="the master to list the application",
    )
    assert len(new) == 1, new
    (app,) = new
    until(
        lambda: cluster.applications()[app["id"]]["state"] == "FINISHED",
        timeout=30,
        message=f"{app['id']} to finish",
    )
    assert app["name"] == APP
    executors = list((cluster.work_dir / app["id"]).iterdir())
    assert len(executors) == 1, executors
    log = (executors[0] / "stderr").read_text()
    assert "Finished task" in log, log[-3000:]
    return app


def check(
    cluster: Cluster, result: subprocess.CompletedProcess[str], output: str, lake: Path
) -> None:
    """The run succeeded, and `output` (where its lines went) has a line per phase."""
    assert result.returncode == 0, result.stderr[-5000:]
    lines = output.splitlines()
    heads = [line for line in lines if line.startswith("spark ")]
    assert len(heads) == 1, output[-5000:]
    assert heads[0].endswith(f" on {cluster.url}, lake {lake}"), heads
    for step in ("export: ", "report: ", "prune: ", "done in "):
        assert any(line.startswith(step) for line in lines), output[-5000:]


# Slow (~55 s): the module's fixtures (the master's and the worker's JVMs, the archive, the local
# run to compare with), then the command's driver JVM and the executor JVM the worker starts; the
# promise is a real cluster's, and its data is already small (1,500 rows, 4 shuffle partitions).
def test_the_command_runs_the_pipeline_on_the_cluster(
    cluster: Cluster, archive: Archive, copy: str, local: Outcome, tmp_path: Path
) -> None:
    before = set(cluster.applications())
    command = [sys.executable, "-m", "relay", "pipeline", "all", "--spark-master", cluster.url]
    result = _run([*command, *flags(archive, tmp_path), "--conf", SHUFFLE], driver_env(copy))
    check(cluster, result, result.stderr, tmp_path / "lake")
    # Its own lines and the JVM's notices only: the driver's logging is cut to errors.
    ours = ("spark 4.", "export", "report: ", "prune", "done in ", "Picked up", "WARNING: Using")
    assert all(line.startswith(ours) for line in result.stderr.splitlines()), result.stderr
    _same_as_local(cluster, before, copy, local, tmp_path)


# Slow (~28 s): spark-submit's JVM, the Python driver it starts and an executor JVM on the module's
# cluster (stopped after the last test); the promise is spark-submit as README runs it, so nothing
# stands in for it.
def test_spark_submit_runs_the_pipeline_on_the_cluster(
    cluster: Cluster, archive: Archive, copy: str, local: Outcome, tmp_path: Path
) -> None:
    before = set(cluster.applications())
    entry = Path(submit.__file__)  # relay/pipeline/submit.py, as README finds it
    options = ["--master", cluster.url, "--jars", JAR, "--conf", SHUFFLE]
    result = _run(
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            *options,
            str(entry),
            "all",
            *flags(archive, tmp_path),
        ],
        driver_env(copy, SPARK_HOME=str(SPARK_HOME), PYSPARK_DRIVER_PYTHON=sys.executable),
    )
    # spark-submit runs the Python driver with its stderr into its own stdout (Spark's log is
    # on its stderr).
    check(cluster, result, result.stdout, tmp_path / "lake")
    _same_as_local(cluster, before, copy, local, tmp_path)


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # our own command lines
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def _same_as_local(
    cluster: Cluster, before: set[str], copy: str, local: Outcome, tmp_path: Path
) -> None:
    """One application ran on the cluster, and left what the local run left."""
    ran_on(cluster, before)
    assert contents(tmp_path / "lake") == local.lake
    assert ids(copy) == local.left
    assert (tmp_path / "report" / "report.md").is_file()
