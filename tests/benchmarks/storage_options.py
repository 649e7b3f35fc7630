"""The storage options of docs/decisions/0004, measured side by side (a spike, not the suite).

    .venv/bin/python tests/benchmarks/storage_options.py [--rate 2000] [--phases 30 180]
        [--drain 100000] [--only a b c d]

Each option is the smallest schema that shows its claim and settle (tests/benchmarks/storage/*.sql;
option a is the real outbox schema and the relay's own statements). For each, in a scratch
database: producers commit one 1 KiB message per transaction at `--rate`, one loop claims up to 500
due rows, "publishes" them (nothing: the broker is not what is compared) and settles them as
archived, polling every 2 ms when there is nothing to claim. After the clean phase a session
holds a transaction with an xid, idle, for the pinned phase. Per phase: commit-to-settled latency
p50/p99, claim time p50/p99, and the exact dead tuples (pgstattuple) of the option's queue tables
at its end. Then the drain of `--drain` rows written in one transaction, with nothing pinned and
with the horizon pinned from before the rows were written.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import services

HERE = Path(__file__).parent / "storage"
BODY = b"x" * 1024
LIMIT = 500
OPTIONS = {
    "a": "today: the claim updates the row, the settle deletes it",
    "b": "a narrow lease table",
    "c": "a claim that resumes from a cursor, with a full pass every second",
    "d": "append-only ring, claims by committed-transaction windows, TRUNCATE",
    "e": "one lane, cursors with a look-back, claim then fetch, a rescue off the loop",
}
#: Option e's look-back (seconds) and how often its rescue looks from the start.
LOOKBACK = 1.0
RESCUE_EVERY = 30


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    claims: list[float] = field(default_factory=list)
    settled: int = 0


class Loop:
    """Claims and settles as fast as it can; subclasses are the options."""

    schema = "opt"

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.tally = Tally()

    async def produce(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("SELECT opt.produce(%s)", [BODY])

    async def claim(self, claim_id: uuid.UUID) -> list[tuple[int, datetime]]:
        raise NotImplementedError

    async def settle(self, claim_id: uuid.UUID, ids: list[int]) -> None:
        row = await (
            await self.conn.execute("SELECT opt.settle(%s, %s)", [ids, claim_id])
        ).fetchone()
        assert row is not None
        assert row[0] == len(ids), (row, len(ids))

    async def chore(self) -> None:
        """Anything the option does now and then (once a second)."""

    async def once(self) -> int:
        claim_id = uuid.uuid4()
        started = time.perf_counter()
        rows = await self.claim(claim_id)
        self.tally.claims.append(time.perf_counter() - started)
        if rows:
            await self.settle(claim_id, [i for i, _ in rows])
            now = datetime.now(UTC)
            self.tally.latencies.extend((now - c).total_seconds() for _, c in rows)
            self.tally.settled += len(rows)
        return len(rows)


class Today(Loop):
    schema = "outbox"

    async def produce(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await conn.execute("SELECT outbox.enqueue('x', 'k', %s)", [BODY])

    async def claim(self, claim_id: uuid.UUID) -> list[tuple[int, datetime]]:
        # The slow lane's claim (migration 0015's _slow_claim): the statement every message
        # went through before the ready lane.
        rows = await (
            await self.conn.execute(
                "SELECT id, created_at FROM outbox._slow_claim(%s, %s, %s, 'spike', 30)",
                [LIMIT, 64 << 20, claim_id],
            )
        ).fetchall()
        return [(r[0], r[1]) for r in rows]

    async def settle(self, claim_id: uuid.UUID, ids: list[int]) -> None:
        e: list[Any] = []
        row = await (
            await self.conn.execute(
                "SELECT archived FROM outbox.settle(%s, %s::bigint[], %s::bigint[], %s::text[],"
                " %s::text[], %s::bigint[], %s::float8[], %s::text[], %s::boolean[],"
                " %s::boolean[], %s::bigint[], false)",
                [claim_id, ids, e, e, e, e, e, e, e, e, e],
            )
        ).fetchone()
        assert row is not None
        assert row[0] == len(ids)


class LeaseTable(Loop):
    async def claim(self, claim_id: uuid.UUID) -> list[tuple[int, datetime]]:
        rows = await (
            await self.conn.execute("SELECT * FROM opt.claim(%s, %s)", [LIMIT, claim_id])
        ).fetchall()
        return [(r[0], r[1]) for r in rows]


class Cursor(Loop):
    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        super().__init__(conn)
        self.after: tuple[datetime, int] | None = None

    async def claim(self, claim_id: uuid.UUID) -> list[tuple[int, datetime]]:
        at, id_ = self.after or (None, None)
        rows = await (
            await self.conn.execute(
                "SELECT * FROM opt.claim(%s, %s, %s, %s)", [LIMIT, claim_id, at, id_]
            )
        ).fetchall()
        if rows:
            self.after = max((r[2], r[0]) for r in rows)
        return [(r[0], r[1]) for r in rows]

    async def chore(self) -> None:
        self.after = None  # the next claim is a full pass


class Ring(Loop):
    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        super().__init__(conn)
        self.prev = "1:1:"  # a fresh relay walks everything first
        self.hi: str | None = None
        self.cursor: tuple[str, int] = ("0", 0)
        self.reclaimed = 0

    async def claim(self, claim_id: uuid.UUID) -> list[tuple[int, datetime]]:
        if self.hi is None:
            row = await (await self.conn.execute("SELECT pg_current_snapshot()::text")).fetchone()
            assert row is not None
            self.hi, self.cursor = row[0], ("0", 0)
        rows = await (
            await self.conn.execute(
                "SELECT id, created_at, xid::text, claimed"
                " FROM opt.claim(%s, %s, %s::pg_snapshot, %s::pg_snapshot, %s::xid8, %s)",
                [LIMIT, claim_id, self.prev, self.hi, *self.cursor],
            )
        ).fetchall()
        if rows:
            last = max(rows, key=lambda r: (int(r[2]), r[0]))
            self.cursor = (last[2], last[0])
        if len(rows) < LIMIT:
            row = await (
                await self.conn.execute(
                    "SELECT opt.window_open(%s::pg_snapshot, %s::pg_snapshot)", [self.prev, self.hi]
                )
            ).fetchone()
            assert row is not None
            if row[0]:
                self.cursor = ("0", 0)
            else:
                self.prev, self.hi = self.hi, None
        return [(r[0], r[1]) for r in rows if r[3]]

    async def chore(self) -> None:
        row = await (await self.conn.execute("SELECT last_value FROM opt.ready_id")).fetchone()
        assert row is not None
        current = row[0] // 20000 % 8
        for seg in range(8):
            if seg in (current, (current + 1) % 8):
                continue
            async with self.conn.transaction():
                done = await (await self.conn.execute("SELECT opt.reclaim(%s)", [seg])).fetchone()
            self.reclaimed += bool(done and done[0])


class OneLane(Loop):
    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        super().__init__(conn)
        self.due_from = datetime(1970, 1, 1, tzinfo=UTC)  # a fresh relay looks from the start
        self.orphans_from = self.due_from
        self.chores = 0
        self.rescues: list[asyncio.Task[None]] = []

    async def claim(self, claim_id: uuid.UUID) -> list[tuple[int, datetime]]:
        rows = await (
            await self.conn.execute(
                "SELECT * FROM opt.claim(%s, %s, %s, %s, %s)",
                [LIMIT, claim_id, self.due_from, self.orphans_from, LOOKBACK],
            )
        ).fetchall()
        if not rows:
            return []
        self.due_from, self.orphans_from = rows[0][1], rows[0][2]
        fetched = await (
            await self.conn.execute(
                "SELECT id, created_at FROM opt.fetch(%s, %s)", [[r[0] for r in rows], claim_id]
            )
        ).fetchall()
        return [(r[0], r[1]) for r in fetched]

    async def chore(self) -> None:
        self.chores += 1
        if self.chores % RESCUE_EVERY == 0:
            self.rescues.append(asyncio.create_task(self.rescue()))

    async def rescue(self) -> None:
        info = self.conn.info
        url = f"postgresql://{info.user}@{info.host}:{info.port}/{info.dbname}"
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            row = await (await conn.execute("SELECT * FROM opt.behind(%s)", [LOOKBACK])).fetchone()
        assert row is not None
        if row[0] is not None:
            self.due_from = min(self.due_from, row[0])
        if row[1] is not None:
            self.orphans_from = min(self.orphans_from, row[1])


LOOPS: dict[str, type[Loop]] = {
    "a": Today,
    "b": LeaseTable,
    "c": Cursor,
    "d": Ring,
    "e": OneLane,
}


async def dead_tuples(conn: psycopg.AsyncConnection[Any], schema: str) -> int:
    row = await (
        await conn.execute(
            "SELECT coalesce(sum((pgstattuple(c.oid)).dead_tuple_count), 0)"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s AND c.relkind = 'r' AND c.relname NOT IN ('archive', 'dead')",
            [schema],
        )
    ).fetchone()
    assert row is not None
    return int(row[0])


def quantile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


async def steady(url: str, option: str, rate: int, phases: list[float]) -> None:
    async with (
        await psycopg.AsyncConnection.connect(url, autocommit=True) as conn,
        await psycopg.AsyncConnection.connect(url, autocommit=True) as probe,
    ):
        loop = LOOPS[option](conn)
        stop = asyncio.Event()
        start = time.perf_counter() + 0.3
        total = sum(phases)

        async def produce(k: int, producers: int = 4) -> None:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as pc:
                for n in range(int(rate * total / producers)):
                    due = start + (n * producers + k) / rate
                    if (wait := due - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                    await loop.produce(pc)

        async def relay() -> None:
            next_chore = time.perf_counter() + 1
            while not stop.is_set():
                if not await loop.once():
                    await asyncio.sleep(0.002)
                if time.perf_counter() > next_chore:
                    await loop.chore()
                    next_chore = time.perf_counter() + 1

        relaying = asyncio.create_task(relay())
        producing = asyncio.gather(*(produce(k) for k in range(4)))
        pin: psycopg.AsyncConnection[Any] | None = None
        for name, seconds in zip(("clean", "pinned"), phases, strict=True):
            loop.tally = Tally()
            if name == "pinned":
                pin = await psycopg.AsyncConnection.connect(url)
                await pin.execute("SELECT pg_current_xact_id()")
            await asyncio.sleep(seconds)
            t = loop.tally
            dead = await dead_tuples(probe, loop.schema)
            print(
                f"  {option} {rate}/s {name} {seconds:.0f}s: settled {t.settled / seconds:,.0f}/s,"
                f" commit→settled p50 {quantile(t.latencies, 50) * 1000:.1f} ms"
                f" p99 {quantile(t.latencies, 99) * 1000:.1f} ms; claim p50"
                f" {quantile(t.claims, 50) * 1000:.2f} ms p99 {quantile(t.claims, 99) * 1000:.2f}"
                f" ms; dead tuples {dead:,}"
                + (f"; segments reclaimed {loop.reclaimed}" if isinstance(loop, Ring) else ""),
                flush=True,
            )
        await producing
        stop.set()
        await relaying
        if pin is not None:
            await pin.close()


async def drain(url: str, option: str, rows: int, pinned: bool) -> float:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        pin = None
        if pinned:
            pin = await psycopg.AsyncConnection.connect(url)
            await pin.execute("SELECT pg_current_xact_id()")
        loop = LOOPS[option](conn)
        async with conn.transaction():
            for _ in range(rows):
                await loop.produce(conn)
        await conn.execute("VACUUM ANALYZE")  # as autovacuum would have; pinned, it only analyzes
        started = time.perf_counter()
        while loop.tally.settled < rows:
            if not await loop.once():
                await asyncio.sleep(0.002)
        seconds = time.perf_counter() - started
        if pin is not None:
            await pin.close()
        return rows / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=2000)
    parser.add_argument("--phases", type=float, nargs=2, default=[30, 180])
    parser.add_argument("--drain", type=int, default=100_000)
    parser.add_argument("--only", nargs="+", choices=sorted(OPTIONS), default=sorted(OPTIONS))
    args = parser.parse_args()
    with services.discover() as svc:
        for option in args.only:
            print(f"{option}: {OPTIONS[option]}", flush=True)
            with scratch(svc, option) as url:
                uvloop.run(steady(url, option, args.rate, args.phases))
            rates = []
            for pinned in (False, True):
                with scratch(svc, option) as url:
                    rates.append(uvloop.run(drain(url, option, args.drain, pinned)))
            print(
                f"  {option} drain {args.drain:,}: {rates[0]:,.0f}/s; horizon pinned"
                f" {rates[1]:,.0f}/s = {rates[1] / rates[0]:.0%}",
                flush=True,
            )


@contextlib.contextmanager
def scratch(svc: services.Services, option: str) -> Iterator[str]:
    """A scratch database with the outbox schema, pgstattuple and the option's schema."""
    with svc.scratch_database("outbox_spike") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pgstattuple")
            if option != "a":
                conn.execute((HERE / f"{option}_{_file(option)}.sql").read_text())
        yield url


def _file(option: str) -> str:
    return {"b": "lease_table", "c": "cursor", "d": "ring", "e": "one_lane"}[option]


if __name__ == "__main__":
    main()
