"""The pinned-horizon scenario of the benchmark: steady load while a transaction pins vacuum.

    .venv/bin/python tests/benchmarks/perf.py --only pinned [--rates 500 2000]
        [--phases 120 600 180 120] [--json results.json]

With PostgreSQL's autovacuum switched on for the run (production has it on; our CI machines turn
it off in conf.d, so the scenario turns it on with ALTER SYSTEM and a reload, and restores it
afterwards), producers commit one message per transaction at a fixed rate while one relay with
its defaults keeps up, and a consumer times each message from just before its COMMIT to its
delivery. The producers are pgbench (`--rate`, PRODUCERS clients, one single-statement
transaction each: the enqueue, then its commit): a Python producer in this process cost the
consumer beside it enough of the two cores that the consumer, not the relay, fell behind. Each
body starts with the enqueue's clock_timestamp() (the commit follows at once); the consumer
compares it with its own clock, the same one. The run goes through four phases:

1. clean: nothing pins the horizon;
2. pinned: a session holds a transaction with an xid, idle (vacuum can remove nothing newer);
3. readers: the same, plus 4 REPEATABLE READ readers scanning the outbox tables in overlapping
   transactions of 30 s (counting every queue table, and the archive's newest minute);
4. recovery: all of them gone.

Per phase it prints commit-to-delivery p50/p95/p99/max, the committed (as pgbench counts them)
and delivered rates against the offered load, and the exact dead tuples of every outbox table at
the phase's end (`pgstattuple`; `n_dead_tup` overstates). Dead tuples are also sampled every
15 s (the archive and dead tables, which only grow, at phase ends only: scanning a growing
archive every few seconds would measure the scan). `--json FILE` keeps the timeline for
`tests/benchmarks/plot.py`, which draws the pinned scenario's chart.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, LiteralString

import aio_pika
import psycopg
import uvloop
from psycopg import sql

from relay.postgres import sql as queries
from tests.benchmarks.drain import declare, delete
from tests.support import services
from tests.support.processes import RelayProcess, clean_env, end

BODY = 1024
PHASES = ("clean", "pinned", "readers", "recovery")
#: Tables only written by appends: their dead tuples are counted at phase ends only.
GROWING = ("archive", "dead")
SAMPLE_EVERY = 15.0
READERS = 4
#: The database's active sessions but the watcher's own: what each waits for, and its statement.
ACTIVITY_SQL: LiteralString = (
    "SELECT wait_event_type || ':' || wait_event, left(regexp_replace(query, '\\s+', ' ', 'g'), 60)"
    " FROM pg_stat_activity WHERE datname = current_database() AND state = 'active'"
    " AND pid <> pg_backend_pid()"
)
#: The outbox functions' calls and total time (ms) so far, with track_functions = all.
FUNCTIONS_SQL: LiteralString = (
    "SELECT funcname, calls, total_time FROM pg_stat_user_functions WHERE schemaname = 'outbox'"
)
#: The target: back within 1.2x of the clean p99 this long after the pin ends.
RECOVERED_WITHIN = 30.0
READER_TRANSACTION = 30.0
#: Producer connections: enough that one commit's round trips never cap the rate they offer.
PRODUCERS = 16
#: A transaction this far behind pgbench's schedule (ms) is skipped, not sent in a burst: the load
#: offered stays the rate, and `committed` shows what the database took.
LATE_MS = 500


@dataclass
class Phase:
    name: str
    seconds: float
    offered: int = 0  # messages per second asked of the producers
    committed: int = 0
    delivered: int = 0
    rings: int = 0  # notifications on the outbox's channel: commits that woke a relay
    latencies: list[float] = field(default_factory=list)
    dead_at_end: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        cuts = statistics.quantiles(self.latencies, n=100, method="inclusive")
        return {
            "phase": self.name,
            "seconds": self.seconds,
            "offered": self.offered,
            "committed_per_s": self.committed / self.seconds,
            "delivered_per_s": self.delivered / self.seconds,
            "rings_per_s": self.rings / self.seconds,
            "p50_ms": cuts[49] * 1000,
            "p95_ms": cuts[94] * 1000,
            "p99_ms": cuts[98] * 1000,
            "max_ms": max(self.latencies) * 1000,
            "dead_tuples": sum(self.dead_at_end.values()),
            "dead_by_table": self.dead_at_end,
        }


@contextlib.contextmanager
def autovacuum_on(admin_url: str) -> Iterator[str]:
    """Autovacuum on for the block (ALTER SYSTEM and a reload), as it was afterwards; yields
    what it was before."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        was = _setting(conn, "autovacuum")
        own = conn.execute(
            "SELECT setting FROM pg_file_settings"
            " WHERE name = 'autovacuum' AND sourcefile LIKE '%%postgresql.auto.conf'"
        ).fetchone()
        if was != "on":
            conn.execute("ALTER SYSTEM SET autovacuum = on")
            conn.execute("SELECT pg_reload_conf()")
            _until(lambda: _setting(conn, "autovacuum") == "on", "autovacuum to switch on")
    try:
        yield was
    finally:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            if was != "on":
                if own is None:
                    conn.execute("ALTER SYSTEM RESET autovacuum")
                else:
                    conn.execute(f"ALTER SYSTEM SET autovacuum = {own[0]}")  # 'on'/'off' only
                conn.execute("SELECT pg_reload_conf()")
                _until(lambda: _setting(conn, "autovacuum") == was, "autovacuum to be restored")


def _setting(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute("SELECT current_setting(%s)", [name]).fetchone()
    assert row is not None
    return str(row[0])


def _until(condition: Any, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def checkpoints_sql(server_version: int) -> LiteralString:
    """The statement that counts the checkpoints so far (PostgreSQL 17 moved the counters)."""
    if server_version >= 170000:
        return "SELECT num_timed + num_requested FROM pg_stat_checkpointer"
    return "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"


async def dead_tuples(conn: psycopg.AsyncConnection[Any], growing: bool) -> dict[str, int]:
    """Exact dead tuples of every table in the outbox schema (partitions included)."""
    rows = await (
        await conn.execute(
            "SELECT c.relname, (pgstattuple(c.oid)).dead_tuple_count"
            " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = 'outbox' AND c.relkind = 'r'"
            " AND (%s OR c.relname <> ALL(%s)) ORDER BY c.relname",
            [growing, list(GROWING)],
        )
    ).fetchall()
    return {name: int(dead) for name, dead in rows}


class Run:
    """One rate's run through the phases."""

    def __init__(
        self,
        url: str,
        amqp_url: str,
        exchange: str,
        rate: int,
        seconds: list[float],
        control: bool = False,
    ):
        self.url, self.amqp_url, self.exchange, self.rate = url, amqp_url, exchange, rate
        self.control = control  # the same phases with nothing pinned and no readers
        self.phases = [Phase(n, s, offered=rate) for n, s in zip(PHASES, seconds, strict=True)]
        self.committing: dict[str, tuple[float, int]] = {}  # message id -> (time, phase)
        self.received: dict[str, float] = {}
        self.samples: list[dict[str, Any]] = []  # the timeline
        #: What the server did on its own, second by second: (auto)vacuums in progress by
        #: table, and checkpoints — to set beside latency stalls.
        self.server: list[dict[str, Any]] = []
        self.start = 0.0

    async def main(self) -> None:
        connection = await aio_pika.connect(self.amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=1000)
            queue = await channel.get_queue(self.exchange)

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                now = time.time()
                committed = float(message.body[: message.body.index(b"x")])
                self.received[str(message.message_id)] = now
                self.committing[str(message.message_id)] = (committed, self._phase_at(committed))
                self.phases[self._phase_at(now)].delivered += 1

            await queue.consume(on_message, no_ack=True)
            async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as probe:
                await probe.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
                self.start = time.time() + 0.5
                producing = asyncio.create_task(self._produce())
                conducting = asyncio.create_task(self._conduct(probe))
                watching = asyncio.create_task(self._watch_server())
                listening = asyncio.create_task(self._count_rings())
                await producing
                await conducting
                watching.cancel()
                listening.cancel()
                await asyncio.gather(watching, listening, return_exceptions=True)
                await self._drain_tail(probe)

    async def _count_rings(self) -> None:
        """Count the notifications on the outbox's channel, per phase: one per transaction that
        notified (the doorbell's rings, docs/decisions/0008), each of which serialised its commit
        on PostgreSQL's lock for notifying transactions."""
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            await conn.execute(queries.load("outbox").listen)
            async for _ in conn.notifies():
                self.phases[self._phase_at(time.time())].rings += 1

    async def _watch_server(self) -> None:
        """Once a second: which tables a vacuum is working on, and the checkpoints so far."""
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            checkpoints = checkpoints_sql(conn.info.server_version)
            while True:
                vacuums = await (
                    await conn.execute(
                        "SELECT p.relid::regclass::text, p.phase FROM pg_stat_progress_vacuum p"
                    )
                ).fetchall()
                row = await (await conn.execute(checkpoints)).fetchone()
                busy = await (await conn.execute(ACTIVITY_SQL)).fetchall()
                functions = await (await conn.execute(FUNCTIONS_SQL)).fetchall()
                self.server.append(
                    {
                        "t": time.time() - self.start,
                        "vacuums": {name: phase for name, phase in vacuums},
                        "checkpoints": int(row[0]) if row else 0,
                        # What the database's other sessions were doing: (wait, statement) of
                        # each active one, and the outbox functions' calls and time so far
                        # (with track_functions = all; empty otherwise).
                        "busy": [f"{wait or 'cpu'} {query}" for wait, query in busy],
                        "functions": {name: [calls, ms] for name, calls, ms in functions},
                    }
                )
                await asyncio.sleep(1.0)

    def stalls(self, clean_p99_ms: float) -> list[str]:
        """Every 5-s bucket whose p99 is above 3x the clean phase's, beside what the server was
        doing in it (vacuums, checkpoints)."""
        out = []
        for bucket in self.timeline():
            if bucket["p99_ms"] <= 3 * clean_p99_ms:
                continue
            seen = [s for s in self.server if bucket["t"] - 5 <= s["t"] < bucket["t"] + 10]
            vacuumed = sorted({name for s in seen for name in s["vacuums"]})
            checkpoints = {s["checkpoints"] for s in seen}
            out.append(
                f"t={bucket['t']:.0f}s p99 {bucket['p99_ms']:,.0f} ms: vacuum "
                f"{', '.join(vacuumed) or 'none'}; checkpoint "
                f"{'yes' if len(checkpoints) > 1 else 'no'} (5 s either side); "
                f"{_busy(seen)}; {_functions(seen)}"
            )
        return out

    def _phase_at(self, now: float) -> int:
        elapsed = now - self.start
        for i, phase in enumerate(self.phases):
            elapsed -= phase.seconds
            if elapsed < 0:
                return i
        return len(self.phases) - 1

    async def _produce(self) -> None:
        """pgbench at the rate through each phase in turn, PRODUCERS clients; what it committed
        counts for the phase. Its schedule skips what is LATE_MS behind instead of bursting."""
        parts = psycopg.conninfo.conninfo_to_dict(self.url)
        script = (
            f"SELECT outbox.enqueue('{self.exchange}', 'bench.steady', convert_to(rpad("
            f"extract(epoch FROM clock_timestamp())::text, {BODY}, 'x'), 'UTF8'));\n"
        )
        with tempfile.NamedTemporaryFile("w", suffix=".sql") as file:
            file.write(script)
            file.flush()
            env = {**os.environ, "PGPASSWORD": str(parts.get("password") or "")}
            end = self.start
            for phase in self.phases:
                end += phase.seconds
                await asyncio.sleep(max(0.0, end - phase.seconds - time.time()))
                seconds = max(1, round(end - time.time()))
                pgbench = await asyncio.create_subprocess_exec(
                    "pgbench", "--no-vacuum", "--file", file.name, "--rate", str(self.rate),
                    "--latency-limit", str(LATE_MS), "--time", str(seconds),
                    "--client", str(PRODUCERS), "--jobs", "2",
                    "--host", str(parts.get("host") or "127.0.0.1"),
                    "--port", str(parts.get("port") or 5432),
                    "--username", str(parts.get("user") or "postgres"),
                    str(parts["dbname"]),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=env,
                )  # fmt: skip
                out, _ = await pgbench.communicate()
                text = out.decode()
                done = re.search(r"number of transactions actually processed: (\d+)", text)
                failed = re.search(r"number of failed transactions: (\d+)", text)
                if pgbench.returncode != 0 or done is None or (failed and int(failed[1])):
                    raise SystemExit(f"pgbench failed in phase {phase.name}:\n{text}")
                phase.committed = int(done[1])

    async def _conduct(self, probe: psycopg.AsyncConnection[Any]) -> None:
        """Start and end the pin and the readers at the phase boundaries; sample dead tuples."""
        pin: psycopg.AsyncConnection[Any] | None = None
        readers: list[asyncio.Task[None]] = []
        ends = []
        t = self.start
        for phase in self.phases:
            t += phase.seconds
            ends.append(t)
        for i, phase in enumerate(self.phases):
            if phase.name == "pinned" and not self.control:
                pin = await psycopg.AsyncConnection.connect(self.url)
                await pin.execute("SELECT pg_current_xact_id()")  # idle in transaction, with an xid
            if phase.name == "readers" and not self.control:
                readers = [asyncio.create_task(self._read(r)) for r in range(READERS)]
            if phase.name == "recovery":
                for task in readers:
                    task.cancel()
                await asyncio.gather(*readers, return_exceptions=True)
                if pin is not None:
                    await pin.close()  # rolls back
            while (left := ends[i] - time.time()) > 0:
                await asyncio.sleep(min(SAMPLE_EVERY, left))
                if ends[i] - time.time() > 1:
                    await self._sample(probe, i, growing=False)
            phase.dead_at_end = await self._sample(probe, i, growing=True)

    async def _sample(
        self, probe: psycopg.AsyncConnection[Any], phase: int, growing: bool
    ) -> dict[str, int]:
        dead = await dead_tuples(probe, growing)
        self.samples.append({"t": time.time() - self.start, "phase": PHASES[phase], "dead": dead})
        return dead

    async def _read(self, r: int) -> None:
        """A REPEATABLE READ reader: scans the queue tables (and the archive's newest minute)
        three times over 30 s, commits, starts again; staggered against the others."""
        await asyncio.sleep(r * READER_TRANSACTION / READERS)
        async with await psycopg.AsyncConnection.connect(self.url) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            tables = [
                name
                for (name,) in await (
                    await conn.execute(
                        "SELECT c.relname FROM pg_class c"
                        " JOIN pg_namespace n ON n.oid = c.relnamespace"
                        " WHERE n.nspname = 'outbox' AND c.relkind IN ('r', 'p')"
                        " AND NOT c.relispartition AND c.relname <> ALL(%s)",
                        [list(GROWING)],
                    )
                ).fetchall()
            ]
            await conn.commit()
            while True:
                for _ in range(3):
                    for name in tables:
                        await conn.execute(
                            sql.SQL("SELECT count(*) FROM outbox.{}").format(sql.Identifier(name))
                        )
                    await conn.execute(
                        "SELECT count(*) FROM outbox.archive"
                        " WHERE published_at > now() - interval '1 minute'"
                    )
                    await asyncio.sleep(READER_TRANSACTION / 3)
                await conn.commit()

    async def _drain_tail(self, probe: psycopg.AsyncConnection[Any]) -> None:
        """Wait (60 s at most) until every message archived has been received and nothing is
        left to send; then each message's latency counts for the phase it was committed in."""
        deadline = time.time() + 60
        while True:
            row = await (
                await probe.execute(
                    "SELECT (SELECT count(*) FROM outbox.archive),"
                    " (SELECT count(*) FROM outbox.messages)"
                )
            ).fetchone()
            assert row is not None
            if row[0] <= len(self.received) and row[1] == 0:
                break
            if time.time() > deadline:
                raise SystemExit(
                    f"pinned {self.rate}/s: after 60 s, {row[0] - len(self.received)} archived"
                    f" messages not received and {row[1]} still waiting\n" + await _stuck(probe)
                )
            await asyncio.sleep(0.5)
        archived = {
            str(m)
            for (m,) in await (
                await probe.execute("SELECT message_id FROM outbox.archive")
            ).fetchall()
        }
        if archived != set(self.received):
            raise SystemExit(
                f"pinned {self.rate}/s: {len(archived - set(self.received))} archived, never"
                f" received; {len(set(self.received) - archived)} received, never archived"
            )
        for message_id, (committed, phase) in self.committing.items():
            if committed > self.start + 1:  # after a second of warm-up
                self.phases[phase].latencies.append(self.received[message_id] - committed)

    def timeline(self, bucket: float = 5.0) -> list[dict[str, Any]]:
        """p50/p99 latency by commit time, in buckets of `bucket` seconds."""
        buckets: dict[int, list[float]] = {}
        for message_id, (committed, _) in self.committing.items():
            if message_id in self.received:
                key = int((committed - self.start) // bucket)
                buckets.setdefault(key, []).append(self.received[message_id] - committed)
        out = []
        for key in sorted(buckets):
            values = sorted(buckets[key])
            out.append(
                {
                    "t": key * bucket,
                    "p50_ms": values[len(values) // 2] * 1000,
                    "p99_ms": values[min(len(values) - 1, int(len(values) * 0.99))] * 1000,
                    "n": len(values),
                }
            )
        return out


#: What the rows left waiting look like, by lane and lease state, and the database's sessions.
STUCK_SQL: LiteralString = (
    "SELECT lane, attempts, claim_id IS NOT NULL, available_at > now(), count(*),"
    " min(available_at - now())::text, max(claimed_at)::text, max(last_error)"
    " FROM outbox.messages GROUP BY 1, 2, 3, 4"
)
SESSIONS_SQL: LiteralString = (
    "SELECT application_name, state, wait_event_type || ':' || wait_event,"
    " (now() - state_change)::text, left(regexp_replace(query, '\\s+', ' ', 'g'), 80)"
    " FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
)


async def _stuck(probe: psycopg.AsyncConnection[Any]) -> str:
    """The waiting rows grouped by lane and lease state, and every session of the database: what
    a run that did not drain leaves to look at."""
    rows = await (await probe.execute(STUCK_SQL)).fetchall()
    sessions = await (await probe.execute(SESSIONS_SQL)).fetchall()
    lines = ["waiting (lane, attempts, claimed, not yet due, rows, due in, claimed at, error):"]
    lines += [f"  {row}" for row in rows]
    lines += ["sessions (application, state, wait, since, statement):"]
    lines += [f"  {row}" for row in sessions]
    return "\n".join(lines)


def _spy(pid: int) -> None:
    """Every thread's stack of a relay that did not drain, if py-spy is installed."""
    if shutil.which("py-spy") is None:
        print("(py-spy is not installed: no stack of the relay)")
        return
    subprocess.run(["py-spy", "dump", "--pid", str(pid)], check=False, timeout=60)


def _busy(seen: list[dict[str, Any]]) -> str:
    """The commonest (wait, statement) pairs of the other sessions in these samples."""
    counts = collections.Counter(b for s in seen for b in s.get("busy", []))
    top = ", ".join(f"{n}x {what}" for what, n in counts.most_common(6))
    return f"sessions active in {len(seen)} samples: {top or 'none'}"


def _functions(seen: list[dict[str, Any]]) -> str:
    """The outbox functions' calls and ms per second between the first and last of the samples
    (nothing without track_functions = all)."""
    if len(seen) < 2 or not seen[-1].get("functions"):
        return "functions: not tracked"
    first, last = seen[0]["functions"], seen[-1]["functions"]
    span = seen[-1]["t"] - seen[0]["t"]
    rates = {
        name: (
            (calls - first.get(name, [0, 0])[0]) / span,
            (ms - first.get(name, [0, 0])[1]) / span,
        )
        for name, (calls, ms) in last.items()
    }
    top = sorted(rates.items(), key=lambda kv: -kv[1][1])[:5]
    return "functions per s: " + ", ".join(
        f"{name} {calls:.1f} calls {ms:.0f} ms" for name, (calls, ms) in top
    )


def pinned(
    svc: services.Services,
    rate: int,
    seconds: list[float],
    launcher: list[str],
    control: bool = False,
) -> dict[str, Any]:
    """One rate through the four phases; prints a line per phase and returns the results.
    `control`: the same phases with nothing pinned and no readers, to tell what the pin does
    from what the machine does anyway (its lines say "control" where they say "pinned")."""
    name = "control" if control else "pinned"
    if shutil.which("pgbench") is None:
        raise SystemExit("pinned: pgbench offers the load; install PostgreSQL's client package")
    with svc.scratch_database("outbox_perf") as url:
        exchange = f"outbox-perf.{uuid.uuid4().hex[:8]}"
        asyncio.run(declare(svc.amqp_url, exchange, exchange))
        env = clean_env(
            OUTBOX_DATABASE_URL=url, OUTBOX_AMQP_URL=svc.amqp_url, OUTBOX_LOG_FORMAT="text"
        )
        run = Run(url, svc.amqp_url, exchange, rate, seconds, control)
        # Its output is read to the end on a thread of its own (an unread pipe would block the
        # relay once it filled), and a failed run shows what it said.
        with RelayProcess(env, launcher=launcher) as relay:
            try:
                relay.wait_ready(timeout=120)
                try:
                    uvloop.run(run.main())
                except SystemExit:
                    _spy(relay.proc.pid)
                    last = relay.output.splitlines()[-200:]
                    print(f"{name} {rate:,}/s: the relay's last lines:", *last, sep="\n")
                    raise
                lines = relay.output.splitlines()
                said = [line for line in lines if " WARNING " in line or " ERROR " in line]
                print(
                    f"{name} {rate:,}/s: the relay logged {len(lines)} lines, {len(said)}"
                    " warnings or errors" + "".join(f"\n  {w}" for w in said[-5:])
                )
            finally:
                end(relay.proc, 30)
        asyncio.run(delete(svc.amqp_url, exchange, exchange))
    phases = [p.summary() for p in run.phases]
    for p in phases:
        tables = ", ".join(f"{k} {v:,}" for k, v in p["dead_by_table"].items() if v)
        print(
            f"{name} {rate:,}/s, {p['phase']} ({p['seconds']:.0f}s): p50 {p['p50_ms']:.1f} ms, "
            f"p95 {p['p95_ms']:.1f} ms, p99 {p['p99_ms']:.1f} ms, max {p['max_ms']:.0f} ms; "
            f"committed {p['committed_per_s']:,.0f}/s, delivered {p['delivered_per_s']:,.0f}/s "
            f"of {rate:,}/s offered, {p['rings_per_s']:,.0f}/s notified; "
            f"dead tuples at its end {p['dead_tuples']:,}" + (f" ({tables})" if tables else "")
        )
    clean, pin = phases[0], phases[1]
    print(
        f"{name} {rate:,}/s: p99 pinned / clean {pin['p99_ms'] / clean['p99_ms']:.2f}x; "
        f"recovery {_recovery(run, clean['p99_ms']):s}; {_settled(run, clean['p99_ms'])}"
    )
    for line in run.stalls(clean["p99_ms"]):
        print(f"{name} {rate:,}/s, stall: {line}")
    return {
        "rate": rate,
        "control": control,
        "phases": phases,
        "samples": run.samples,
        "latency": run.timeline(),
        "server": run.server,
    }


def _settled(run: Run, clean_p99_ms: float) -> str:
    """The p99 of every message committed from 30 s after the pin's end to the run's end, against
    the clean phase's: whether latency is back within 1.2x by 30 s, as a phase's figure."""
    since = run.start + sum(p.seconds for p in run.phases[:3]) + RECOVERED_WITHIN
    late = sorted(
        run.received[m] - committed
        for m, (committed, _) in run.committing.items()
        if committed >= since and m in run.received
    )
    if len(late) < 100:
        return f"too few messages after {RECOVERED_WITHIN:.0f}s of recovery to judge"
    p99 = statistics.quantiles(late, n=100, method="inclusive")[98] * 1000
    return (
        f"p99 from {RECOVERED_WITHIN:.0f}s after the pin's end {p99:.1f} ms "
        f"= {p99 / clean_p99_ms:.2f}x clean"
    )


def _recovery(run: Run, clean_p99_ms: float) -> str:
    """How long after the pin's end the 5-s p99 stays within 1.2x the clean phase's p99; and, as
    a control, how many of the clean phase's own 5-s buckets (after its first) are above that:
    a bucket's p99 is a noisier figure than a phase's."""
    end = sum(p.seconds for p in run.phases[:3])
    buckets = run.timeline()
    limit = 1.2 * clean_p99_ms
    clean = [b for b in buckets if 5 <= b["t"] < run.phases[0].seconds]
    control = f" (control: {sum(b['p99_ms'] > limit for b in clean)} of the clean phase's"
    control += f" {len(clean)} buckets are above it)"
    after = [b for b in buckets if b["t"] >= end]
    for i, bucket in enumerate(after):
        if all(b["p99_ms"] <= limit for b in after[i:]):
            return f"within 1.2x of clean p99 after {bucket['t'] - end:.0f}s" + control
    return "never back within 1.2x of clean p99" + control


def write_json(path: Path, results: list[dict[str, Any]], autovacuum_was: str) -> None:
    path.write_text(json.dumps({"autovacuum_was": autovacuum_was, "runs": results}, indent=1))
