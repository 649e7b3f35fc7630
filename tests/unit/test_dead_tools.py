"""The pure parts of the dead-letter tools: time bounds, bodies shown safely, and the pruner's
schedule (with a fake prune; the real one is tested against PostgreSQL)."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.core import errors, filters, render
from relay.core.filters import DeadFilter, when
from relay.ops import metrics
from relay.ops.retention import Pruner

NOW = datetime(2026, 11, 21, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2h", NOW - timedelta(hours=2)),
        ("90s", NOW - timedelta(seconds=90)),
        ("7d", NOW - timedelta(days=7)),
        ("2026-11-20T08:30", datetime(2026, 11, 20, 8, 30, tzinfo=UTC)),
        ("2026-11-20T08:30+02:00", datetime(2026, 11, 20, 6, 30, tzinfo=UTC)),
    ],
)
def test_when_takes_a_time_or_a_duration_ago(text: str, expected: datetime) -> None:
    assert when(text, NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "", "2026-13-01", "-"])
def test_when_rejects_anything_else(text: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="not a time"):
        when(text, NOW)


def test_an_empty_filter_is_everything() -> None:
    assert DeadFilter.build().is_everything
    assert not DeadFilter.build(reasons=["rejected"]).is_everything
    assert DeadFilter.build(routing_key="a_b*").params()["routing_key"] == "a\\_b%"


def test_a_text_body_is_shown_as_text_and_cut() -> None:
    shown = render.body("héllo\nwörld".encode(), limit=8)
    assert (shown.encoding, shown.bytes, shown.text, shown.truncated) == (
        "utf-8",
        13,
        "héllo\nwö",
        True,
    )


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"\x1b[2J", b"nul\x00", "bell\u0007".encode()])
def test_a_binary_or_unprintable_body_is_base64(raw: bytes) -> None:
    shown = render.body(raw)
    assert shown.encoding == "base64"
    assert not shown.truncated


@given(st.binary(max_size=200))
def test_no_body_prints_a_control_character(raw: bytes) -> None:
    text = render.body(raw).text
    assert all(c.isprintable() or c in "\n\r\t" for c in text)


@given(st.text(max_size=50))
def test_printable_escapes_every_control_character(text: str) -> None:
    assert render.printable(text).isprintable()


async def test_a_cancelled_pruner_stops_its_run_after_the_batch() -> None:
    started = threading.Event()
    seen: list[threading.Event] = []

    def prune(stop: threading.Event) -> int:
        seen.append(stop)
        started.set()
        stop.wait(10)  # a batch loop that checks `stop` between batches
        return 0

    task = asyncio.create_task(Pruner(prune, 3600, metrics.Metrics()).run_once())
    await asyncio.to_thread(started.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen[0].is_set()


async def test_a_pruner_bug_is_counted_and_does_not_end_the_schedule() -> None:
    counters = metrics.Metrics()

    def prune(stop: threading.Event) -> int:
        raise RuntimeError("bug")

    pruner = Pruner(prune, 3600, counters)
    assert await pruner.run_once() is None
    assert await pruner.run_once() is None
    assert (
        counters.registry.get_sample_value("outbox_archive_prune_runs_total", {"result": "failed"})
        == 2
    )


@pytest.mark.parametrize(
    ("given", "prefix"),
    [
        ("F54A", "f54a"),
        ("f54a159c", "f54a159c"),
        ("f54a159c6b1f", "f54a159c-6b1f"),
        ("f54a159c-6b1f-4", "f54a159c-6b1f-4"),
        (" f54a159c6b1f4a2b9c3d ", "f54a159c-6b1f-4a2b-9c3d"),
        ("f54a159c-6b1f-4a2b-9c3d-0123456789ab", "f54a159c-6b1f-4a2b-9c3d-0123456789ab"),
    ],
)
def test_an_ids_start_is_written_as_postgresql_writes_uuids(given: str, prefix: str) -> None:
    assert filters.id_prefix(given) == prefix


@pytest.mark.parametrize("given", ["f54", "", "xyz1", "f54a%", "f54a_", "0" * 33])
def test_what_is_not_an_ids_start_is_refused(given: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="not a message id or the start of one"):
        filters.id_prefix(given)
