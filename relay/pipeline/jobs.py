"""Pipeline runs: export, report and prune over one Spark session, with a line per phase; and
replays from the lake."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import date, datetime
from pathlib import Path
from typing import Literal

from pyspark.sql import DataFrame, SparkSession

from relay.core import config, errors, render
from relay.pipeline import charts, replay, report, session
from relay.pipeline.database import PipelineDatabase, ReplayDatabase, ReplayState
from relay.pipeline.export import Source, export
from relay.pipeline.prune import prune

Phase = Literal["export", "report", "prune"]
Say = Callable[[str], object]


def run(
    settings: config.PipelineSettings,
    phases: Sequence[Phase],
    *,
    cutoff: datetime,
    since: date | None = None,
    conf: Mapping[str, str] | None = None,
    say: Say = print,
    spark: SparkSession | None = None,
) -> None:
    """Run `phases` in order (export before prune, so a prune never outruns its export), in a
    session of their own or in `spark`, a running one (then `conf` and the master are its own)."""
    started = time.monotonic()
    running = session.spark_session(settings, conf) if spark is None else session.borrowed(spark)
    with running as spark:
        lake = session.lake_path(settings)
        say(f"spark {spark.version} on {spark.sparkContext.master}, lake {lake}")
        with _database(settings, phases) as db:
            if "export" in phases:
                assert db is not None
                source = Source(
                    settings.database_url.get_secret_value(),
                    settings.db_schema,
                    settings.export_partitions,
                    settings.fetch_size,
                    settings.transaction_pooler,
                )
                phase = time.monotonic()
                rows = export(spark, lake, source, db, cutoff, chunk=settings.export_chunk, say=say)
                say(f"export: {render.count(rows, 'row')} in {time.monotonic() - phase:.1f}s")
            if "report" in phases:
                phase = time.monotonic()
                built = report.build(spark, lake, since)
                path = charts.write(built, Path(settings.report_dir), lake)
                say(f"report: {path} in {time.monotonic() - phase:.1f}s")
            if "prune" in phases:
                assert db is not None
                phase = time.monotonic()
                pruned = prune(spark, lake, db, say=say)
                kept = f", {pruned.kept:,} kept" if pruned.kept else ""
                took = time.monotonic() - phase
                say(f"prune: {render.count(pruned.deleted, 'row')} deleted{kept} in {took:.1f}s")
    say(f"done in {time.monotonic() - started:.1f}s")


@contextlib.contextmanager
def _database(
    settings: config.PipelineSettings, phases: Sequence[Phase]
) -> Iterator[PipelineDatabase | None]:
    """The database session (and the pipeline lock) when a phase touches PostgreSQL."""
    if not {"export", "prune"} & set(phases):
        yield None
        return
    url = settings.database_url.get_secret_value()
    with PipelineDatabase.connect(
        url, settings.db_schema, pooled=settings.transaction_pooler
    ) as db:
        yield db


def _no_bar(total: int) -> AbstractContextManager[replay.Progress]:
    return contextlib.nullcontext(lambda _: None)


def replay_lake(
    settings: config.PipelineSettings,
    selection: replay.Selection,
    *,
    name: str | None = None,
    given: Mapping[str, object] | None = None,
    rate: float = 1000.0,
    batch: int = 500,
    dry_run: bool = False,
    conf: Mapping[str, str] | None = None,
    say: Say = print,
    bar: Callable[[int], AbstractContextManager[replay.Progress]] = _no_bar,
    spark: SparkSession | None = None,
) -> replay.Outcome:
    """Replay the lake's archived messages `selection` takes into the outbox
    (docs/guides/replay-from-lake.md); what this run found to do and did (a dry run: found).

    A replay is known by `name` (default: made from `given`, the options as the caller was given
    them, else from `selection`). Run again, it goes on after its last batch with the selection
    of its first run (`selection` is then not used: relative times stay as they were first
    resolved), and adds nothing it added before; `given` must be what it was. A first run that
    selects nothing records nothing."""
    given = json_safe(given if given is not None else selection.document())
    name = replay.check_name(name or replay.default_name(given))
    running = session.spark_session(settings, conf) if spark is None else session.borrowed(spark)
    url = settings.database_url.get_secret_value()
    with (
        running as spark,
        ReplayDatabase.connect(url, settings.db_schema, pooled=settings.transaction_pooler) as db,
    ):
        lake = session.lake_path(settings)
        state = db.find(name)
        data, total = None, 0
        if state is None:
            selection = selection.checked()
            data = replay.selected(spark, lake, selection)
            total = 0 if data is None else data.count()
            if dry_run:
                return _dry_run(name, selection, None, data, say)
            if total == 0:
                say(f"replay {name}: nothing in the lake to replay; nothing recorded")
                return replay.Outcome(0)
            state = db.start(name, {"selection": selection.document(), "given": given})
        if state.selection.get("given") != given:  # also: a first run of it made it meanwhile
            raise errors.InvalidArgument(
                f"replay {name} was started with other options "
                f"({state.selection.get('given')}); give this one another --name"
            )
        stored = replay.Selection.from_document(state.selection["selection"])
        # Selected afresh unless this run made the row: another first run of it may have made
        # it meanwhile, with times resolved a moment earlier or later.
        if data is None or state.position > 0 or stored != selection:
            selection = stored
            data = replay.selected(spark, lake, selection, state.position)
            if dry_run:
                return _dry_run(name, selection, state, data, say)
            total = 0 if data is None else data.count()
        done = f" ({state.enqueued:,} enqueued before)" if state.enqueued else ""
        say(f"replay {name}: {render.count(total, 'message')} to go{done}{selection.target()}")
        if data is None or total == 0:
            return replay.Outcome(0)
        started = time.monotonic()
        with bar(total) as advance:
            outcome = replay.replay(
                data,
                db,
                name,
                selection,
                after=state.position,
                rate=rate,
                batch=batch,
                progress=advance,
            )
        took = time.monotonic() - started
        say(f"replay {name}: {render.count(outcome.enqueued, 'message')} enqueued in {took:.1f}s")
        _tell_skipped(name, settings.db_schema, outcome, say)
        return outcome


def json_safe(given: Mapping[str, object]) -> dict[str, object]:
    """`given` as it comes back from a jsonb column."""
    loaded: dict[str, object] = json.loads(json.dumps(dict(given), default=str))
    return loaded


def _tell_skipped(name: str, schema: str, outcome: replay.Outcome, say: Say) -> None:
    if not outcome.skipped:
        return
    say(
        f"replay {name}: {render.count(outcome.skipped, 'message')} skipped: the outbox "
        f'refuses them today (the first 100 are in "{schema}".replays.skips)'
    )
    for lake_id, message_id, reason in outcome.first_skipped[:10]:
        say(f"  lake id {lake_id} (message {message_id}): {reason}")


def _dry_run(
    name: str,
    selection: replay.Selection,
    state: ReplayState | None,
    data: DataFrame | None,
    say: Say,
) -> replay.Outcome:
    found = [] if data is None else replay.routes(data)
    total = sum(r.messages for r in found)
    before = f"; {state.enqueued:,} enqueued by earlier runs" if state is not None else ""
    say(f"replay {name} (dry run): {render.count(total, 'message')} to go{before}")
    for r in found:
        say(
            f"  {r.messages:>10,}  {r.exchange} {r.routing_key}{selection.target()}  "
            f"{r.first:%Y-%m-%d %H:%M:%S}Z … {r.last:%Y-%m-%d %H:%M:%S}Z"
        )
    return replay.Outcome(total)
