"""The lake's layout and its export manifest: which id ranges of which table were started,
finished and pruned, kept as small marker files beside the data (any Hadoop filesystem)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import uuid
from datetime import UTC, date, datetime
from typing import Any, Literal

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import StructType

Table = Literal["archive", "dead"]
TABLES: tuple[Table, ...] = ("archive", "dead")
#: The column each table's day partition comes from (UTC).
TIME_COLUMN: dict[Table, str] = {"archive": "published_at", "dead": "failed_at"}
State = Literal["started", "done", "pruned"]
_MARKER = re.compile(r"(archive|dead)\.(\d+)-(\d+)\.(started|done|pruned)")


@dataclasses.dataclass(frozen=True, order=True)
class Range:
    """Ids lo < id <= hi of one table: what one export writes and one prune verifies."""

    table: Table
    lo: int
    hi: int

    @property
    def name(self) -> str:
        """Its partition value in the lake (`id_range=…`), zero-padded so names sort by id."""
        return f"{self.lo + 1:019d}-{self.hi:019d}"


@dataclasses.dataclass
class Manifest:
    """Marker files under `<lake>/_exports/`, one per range and state reached. A marker is
    written only after what it records is complete, and never rewritten."""

    spark: SparkSession
    lake: str

    def __post_init__(self) -> None:
        jvm: Any = self.spark._jvm  # Hadoop's FileSystem has no Python API
        hadoop = jvm.org.apache.hadoop.fs
        self._path = hadoop.Path
        self._dir = hadoop.Path(f"{self.lake}/_exports")
        self._fs = self._dir.getFileSystem(self.spark._jsc.hadoopConfiguration())
        self._io = jvm.org.apache.commons.io.IOUtils

    def states(self) -> dict[Range, dict[State, dict[str, Any]]]:
        """Every range ever started, with the states it reached and what each recorded."""
        found: dict[Range, dict[State, dict[str, Any]]] = {}
        if not self._fs.exists(self._dir):
            return found
        for status in self._fs.listStatus(self._dir):
            match = _MARKER.fullmatch(status.getPath().getName())
            if match is None:
                continue
            table, lo, hi, state = match.groups()
            key = Range(table, int(lo), int(hi))  # type: ignore[arg-type]
            found.setdefault(key, {})[state] = self._read(status.getPath())  # type: ignore[index]
        return found

    def mark(self, r: Range, state: State, **facts: Any) -> None:
        """Record that `r` reached `state` (with `facts`, e.g. its row count)."""
        record: dict[str, Any] = {"table": r.table, "lo": r.lo, "hi": r.hi, "state": state}
        record |= {"at": datetime.now(UTC).isoformat(), **facts}
        name = f"{r.table}.{r.lo}-{r.hi}.{state}"
        # Written aside and renamed, so a marker is never seen half-written.
        temporary = self._path(self._dir, f".{name}.{uuid.uuid4().hex}")
        stream = self._fs.create(temporary, True)
        try:
            stream.write(bytearray(json.dumps(record).encode()))
        finally:
            stream.close()
        final = self._path(self._dir, name)
        self._fs.delete(final, False)  # a marker written again (a range re-exported)
        if not self._fs.rename(temporary, final):
            raise OSError(f"could not write the export marker {self.lake}/_exports/{name}")

    def _read(self, path: Any) -> dict[str, Any]:
        stream = self._fs.open(path)
        try:
            text = self._io.toString(stream, "UTF-8")
        finally:
            stream.close()
        loaded: dict[str, Any] = json.loads(text or "{}")
        return loaded


def read(
    spark: SparkSession,
    path: str,
    id_range: str | None = None,
    *,
    schema: StructType | None = None,
    days: tuple[date, date] | None = None,
) -> DataFrame | None:
    """The Parquet dataset at `path` (only the files of `id_range`, if given; only the folders of
    the days from `days[0]` to `days[1]`, if given, so that no other day's folder is even listed),
    or None if nothing was written there. The pipeline reads only columns every version of the
    tables had, so it does not merge the schemas of older and newer files (which would read every
    file's footer); given `schema`, it reads no footer to find one."""
    reader = spark.read.option("basePath", path)
    if schema is not None:
        reader = reader.schema(schema)
    try:
        if id_range is not None:
            return reader.parquet(f"{path}/day=*/id_range={id_range}")
        if days is not None:
            folders = _day_folders(spark, path, *days)
            return reader.parquet(*folders) if folders else None
        return reader.parquet(path)
    except AnalysisException as exc:
        if exc.getCondition() in ("PATH_NOT_FOUND", "UNABLE_TO_INFER_SCHEMA"):
            return None
        raise


def _day_folders(spark: SparkSession, path: str, first: date, last: date) -> list[str]:
    """The `day=…` folders of the dataset at `path` from `first` to `last` (one listing of
    `path`, not of every folder)."""
    jvm: Any = spark._jvm
    folder = jvm.org.apache.hadoop.fs.Path(path)
    fs = folder.getFileSystem(spark._jsc.hadoopConfiguration())
    if not fs.exists(folder):
        return []
    found = []
    for status in fs.listStatus(folder):
        name = status.getPath().getName()
        if status.isDirectory() and name.startswith("day="):
            with contextlib.suppress(ValueError):
                if first <= date.fromisoformat(name.removeprefix("day=")) <= last:
                    found.append(f"{path}/{name}")
    return sorted(found)


def table_path(lake: str, table: Table) -> str:
    return f"{lake}/{table}"


def report_path(lake: str, name: str) -> str:
    return f"{lake}/report/{name}"
