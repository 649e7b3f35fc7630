"""The project's benchmark: how close the relay comes to the machine's limit (not part of the
test suite).

    .venv/bin/python tests/benchmarks/perf.py [--messages 100000] [--deep 1000000] [--quick]

In one run, on the local servers (OUTBOX_TEST_DATABASE_URL / OUTBOX_TEST_AMQP_URL), each
scenario in a scratch database of its own, messages of 1 KiB, persistent and confirmed:

1. limit: the relay's own publish path (its encoding, frames, mandatory publishing and confirms,
   uvloop) fed the same messages from memory, with no database, at the best of a few batch
   sizes — the ceiling, so that a drain's share of it is what the database work costs;
2. drain: `outbox-relay run --until-empty` on a backlog of `--messages`, 1 and 2 replicas;
3. steady: producers committing one message per transaction at 500/s and 2,000/s while one relay
   keeps up; a consumer measures commit-to-delivery latency (from just before COMMIT is sent);
4. keyed: the drain with the messages spread over 100 ordering keys, and over 10,000;
5. backlog scale: the drain rate with 10,000 rows against `--deep` rows;
6. horizon: the drain while another session holds a REPEATABLE READ snapshot open from before
   the backlog is written until it is drained (vacuum can remove nothing);
7. pinned: steady load at `--rates` through clean, pinned, pinned with readers and recovery
   phases, with autovacuum on (tests/benchmarks/horizon.py says how; `--json` keeps the
   timeline for tests/benchmarks/plot.py); `--control` runs the same phases with nothing
   pinned, which tells the pin's after-effects from the machine's own noise.

The limit and the drains publish to a queue that keeps only the newest 10,000 messages, as if a
consumer kept up (a queue holding a million would slow the broker, not the relay); the drains
check that every message was archived, which the relay does only on the broker's confirm.
It prints a line per figure, each drain rate's ratio to the limit, and CPU seconds per 1,000
messages of the relay, PostgreSQL and RabbitMQ (from /proc, when the servers run on this host).
`--quick` divides every size by ten, to try the benchmark out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from relay.amqp.publisher import AmqpPublisher
from relay.core.model import OutboxMessage, Outcome
from tests.benchmarks import horizon
from tests.benchmarks.drain import delete
from tests.support import services
from tests.support.processes import RelayProcess, clean_env

BODY = 1024
#: The drains' queues keep the newest this many messages and drop older ones, as if a consumer
#: kept up: a queue holding the whole backlog would make the broker, not the relay, slower as the
#: backlog grows. Every message is still persisted and confirmed.
KEEP = 10_000


async def declare(amqp_url: str, exchange: str, queue: str, keep: int | None = KEEP) -> None:
    async with await aio_pika.connect(amqp_url) as connection:
        channel = await connection.channel()
        x = await channel.declare_exchange(exchange, aio_pika.ExchangeType.TOPIC, durable=True)
        bounded: dict[str, Any] | None = (
            {"x-max-length": keep, "x-overflow": "drop-head"} if keep else None
        )
        q = await channel.declare_queue(queue, durable=True, arguments=bounded)
        await q.bind(x, "#")


@dataclass
class Cpu:
    """CPU seconds used by the relay processes, PostgreSQL and RabbitMQ over one scenario."""

    relay: float = 0.0
    postgres: float | None = None
    rabbitmq: float | None = None
    #: CPU used inside `paused()` blocks (filling the outbox), taken out of the totals.
    excluded: tuple[float, float | None, float | None] = (0.0, 0.0, 0.0)

    def per_thousand(self, messages: int, client: str = "relay") -> str:
        def one(seconds: float | None) -> str:
            return "n/a" if seconds is None else f"{seconds * 1000 / messages:.3f}s"

        return (
            f"CPU per 1,000: {client} {one(self.relay)}, postgres {one(self.postgres)}, "
            f"rabbitmq {one(self.rabbitmq)}"
        )

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Leave the CPU used by this block out of the figures."""
        before = _snapshot()
        yield
        self.excluded = _add(self.excluded, _minus(_snapshot(), before))


Sample = tuple[float, float | None, float | None]


def _snapshot() -> Sample:
    return _self_and_children(), _server_cpu("postgres"), _server_cpu("beam.smp")


def _minus(a: Sample, b: Sample) -> Sample:
    return (
        a[0] - b[0],
        None if a[1] is None or b[1] is None else a[1] - b[1],
        None if a[2] is None or b[2] is None else a[2] - b[2],
    )


def _add(a: Sample, b: Sample) -> Sample:
    return (
        a[0] + b[0],
        None if a[1] is None or b[1] is None else a[1] + b[1],
        None if a[2] is None or b[2] is None else a[2] + b[2],
    )


def _ticks(pid: int, children: bool) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    used = int(fields[11]) + int(fields[12])  # utime, stime
    if children:
        used += int(fields[13]) + int(fields[14])  # reaped children: exited backends
    return used / os.sysconf("SC_CLK_TCK")


def _server_cpu(command: str) -> float | None:
    """CPU seconds of every live process named `command`, and of the children they reaped."""
    total, found = 0.0, False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != command:
                continue
            total += _ticks(int(entry.name), children=True)
            found = True
        except (OSError, IndexError):
            continue  # gone meanwhile
    return total if found else None


@contextmanager
def measured_cpu() -> Iterator[Cpu]:
    """CPU used while the block runs: by this process and its reaped children (the relays; this
    process only waits for them, except when it publishes or produces itself), and by the
    servers."""
    cpu = Cpu()
    before = _snapshot()
    yield cpu
    cpu.relay, cpu.postgres, cpu.rabbitmq = _minus(_minus(_snapshot(), before), cpu.excluded)


def _self_and_children() -> float:
    used = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        used += usage.ru_utime + usage.ru_stime
    return used


# -- limit ----------------------------------------------------------------------------------------


async def _publish_batches(amqp_url: str, exchange: str, messages: int, batch: int) -> float:
    """The relay's own publish path (its encoding, frames and confirm handling), fed batches
    built in memory: what a relay would reach if the database cost nothing."""
    publisher = AmqpPublisher(amqp_url)
    await publisher.connect()
    try:
        body = b"x" * BODY
        now = datetime.now(UTC)
        started = time.perf_counter()
        for lo in range(0, messages, batch):
            rows = [
                OutboxMessage(
                    id=i,
                    message_id=uuid.uuid4(),
                    exchange=exchange,
                    routing_key=f"bench.{i}",
                    body=body,
                    headers={},
                    properties={"content_type": "application/octet-stream"},
                    ordering_key=None,
                    created_at=now,
                    attempts=1,
                )
                for i in range(lo, min(lo + batch, messages))
            ]
            results = await publisher.publish(rows)
            if bad := [r for r in results if r.outcome is not Outcome.ACKED]:
                raise SystemExit(f"limit: {len(bad)} not confirmed, e.g. {bad[0]}")
        return time.perf_counter() - started
    finally:
        await publisher.close()


def limit(svc: services.Services, messages: int) -> float:
    """The best rate of the relay's publish path with no database, at a few batch sizes (the
    relay's default is 500)."""
    best = 0.0
    for batch in (500, 1000, 2000):
        exchange = queue = f"outbox-perf.{uuid.uuid4().hex[:8]}"
        asyncio.run(declare(svc.amqp_url, exchange, queue))
        with measured_cpu() as cpu:
            seconds = uvloop.run(_publish_batches(svc.amqp_url, exchange, messages, batch))
        asyncio.run(delete(svc.amqp_url, exchange, queue))
        rate = messages / seconds
        print(f"limit: batch {batch}: {rate:,.0f} msg/s; {cpu.per_thousand(messages, 'publisher')}")
        best = max(best, rate)
    return best


# -- drains ---------------------------------------------------------------------------------------


def fill(url: str, exchange: str, messages: int, keys: int = 0) -> None:
    """Write the backlog, then vacuum and analyze it as autovacuum would have while it built up
    (migration 0005 sets it to act every few thousand rows). Without that the first claims plan
    on an empty table's statistics: on a server with autovacuum off, as on our CI machines, a
    backlog of 10,000 was claimed by sorting every due row (20 ms a claim, not 8)."""
    with psycopg.connect(url) as conn:
        for lo in range(0, messages, 100_000):
            conn.execute(
                "SELECT outbox.enqueue(%s, 'bench.' || i, convert_to(repeat('x', %s), 'UTF8'),"
                " ordering_key => CASE WHEN %s > 0 THEN 'key-' || i %% %s END)"
                " FROM generate_series(%s::bigint, %s::bigint) AS i",
                [exchange, BODY, keys, max(keys, 1), lo + 1, min(lo + 100_000, messages)],
            )
            conn.commit()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM (ANALYZE) outbox.messages")


#: How long a drain may take before the benchmark gives up on it (the deep backlog's takes minutes).
DRAIN_TIMEOUT = 3600.0

#: Where `--profile` writes py-spy's flame graphs of the relays (None: no profiling).
PROFILE: Path | None = None


def launcher(label: str) -> list[str]:
    """What goes before `python -m relay`: py-spy when `--profile` is given, else nothing."""
    if PROFILE is None:
        return []
    PROFILE.mkdir(parents=True, exist_ok=True)
    name = "".join(c if c.isalnum() else "-" for c in label).strip("-")
    output = PROFILE / f"{name}-{uuid.uuid4().hex[:4]}.txt"
    return [
        *("py-spy", "record", "--rate", "250", "--nonblocking", "--format", "raw"),
        *("-o", str(output), "--"),
    ]


def run_relays(url: str, amqp_url: str, replicas: int, label: str = "drain") -> float:
    """Seconds from every relay being ready until the last reports an empty outbox. Each
    relay's output is read on a thread of its own: an unread pipe would stall a chatty one."""
    env = clean_env(OUTBOX_DATABASE_URL=url, OUTBOX_AMQP_URL=amqp_url, OUTBOX_LOG_FORMAT="text")
    with contextlib.ExitStack() as stack:
        relays = [
            stack.enter_context(RelayProcess(env, "--until-empty", launcher=launcher(label)))
            for _ in range(replicas)
        ]
        for relay in relays:
            relay.wait_ready(timeout=120)
        started = time.perf_counter()
        for relay in relays:
            relay.wait_for("no due rows left", timeout=DRAIN_TIMEOUT)
        elapsed = time.perf_counter() - started
        if codes := [c for c in (r.exited() for r in relays) if c]:
            raise SystemExit(f"relay exit codes {codes}")
    return elapsed


def drain(
    svc: services.Services,
    label: str,
    messages: int,
    *,
    replicas: int = 1,
    keys: int = 0,
    rounds: int = 1,
    during: Callable[[str], Iterator[None]] | None = None,
) -> float:
    """Fill a scratch outbox with `messages` and time the relays draining it, `rounds` times in
    the same outbox (a short drain measured once is mostly noise); prints the line."""
    total = messages * rounds
    with svc.scratch_database("outbox_perf") as url:
        exchange = queue = f"outbox-perf.{uuid.uuid4().hex[:8]}"
        asyncio.run(declare(svc.amqp_url, exchange, queue))
        seconds = 0.0
        wal = ServerWork()
        with contextmanager(during or _nothing)(url), measured_cpu() as cpu:
            for _ in range(rounds):
                with cpu.paused():
                    fill(url, exchange, messages, keys)
                    settle_server(url)
                with wal.counted(url):
                    seconds += run_relays(url, svc.amqp_url, replicas, label)
        in_queue = asyncio.run(delete(svc.amqp_url, exchange, queue))
        with psycopg.connect(url) as conn:
            row = conn.execute("SELECT count(*) FROM outbox.archive").fetchone()
    if in_queue != min(total, KEEP) or row is None or row[0] != total:
        raise SystemExit(f"{label}: {row} archived, {in_queue:,} in the queue of {total:,}")
    rate = total / seconds
    times = f" ({rounds} rounds of {messages:,})" if rounds > 1 else ""
    print(
        f"{label}: {total:,} messages{times} in {seconds:.1f}s = {rate:,.0f} msg/s; "
        f"{cpu.per_thousand(total)}; {wal.describe(total)}"
    )
    return rate


@dataclass
class ServerWork:
    """WAL written and checkpoints started while relays drained (the fill not counted): at the
    same WAL per message, a slower drain is the server's checkpoints, not a costlier claim."""

    wal_bytes: int = 0
    full_pages: int = 0
    checkpoints: int = 0

    @contextmanager
    def counted(self, url: str) -> Iterator[None]:
        before = _server_counters(url)
        yield
        after = _server_counters(url)
        self.wal_bytes += after[0] - before[0]
        self.full_pages += after[1] - before[1]
        self.checkpoints += after[2] - before[2]

    def describe(self, messages: int) -> str:
        return (
            f"WAL per message {self.wal_bytes / messages / 1024:.2f} KiB "
            f"({self.full_pages / messages:.2f} full pages), checkpoints {self.checkpoints}"
        )


def settle_server(url: str) -> None:
    """A CHECKPOINT before a drain is timed, so that every drain starts from the same server state:
    the fill's WAL and the earlier scenarios' are written out, not left for checkpoints that
    would fall inside this drain (in a full run, the 1,000,000 drain inherited the previous
    drains' WAL, and ran 85 % of the shallow rate against 97-100 % alone). The drain's own WAL
    still triggers its checkpoints, and counts."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")


def _server_counters(url: str) -> tuple[int, int, int]:
    """The cluster's WAL bytes, full-page images and checkpoints so far."""
    with psycopg.connect(url, autocommit=True) as conn:
        wal = conn.execute("SELECT wal_bytes::bigint, wal_fpi FROM pg_stat_wal").fetchone()
        done = conn.execute(horizon.checkpoints_sql(conn.info.server_version)).fetchone()
    assert wal is not None
    assert done is not None
    return int(wal[0]), int(wal[1]), int(done[0])


def _nothing(url: str) -> Iterator[None]:
    yield


def pinned_horizon(url: str) -> Iterator[None]:
    """A REPEATABLE READ snapshot held open in another session."""
    with psycopg.connect(url) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.execute("SELECT count(*) FROM outbox.messages")  # takes the snapshot
        yield
        conn.rollback()


# -- steady ---------------------------------------------------------------------------------------


async def _steady(url: str, amqp_url: str, exchange: str, rate: int, seconds: float) -> list[float]:
    """Latencies (s) from just before COMMIT to the consumer's receipt, after a 1 s warm-up."""
    committing: dict[str, float] = {}
    received: dict[str, float] = {}
    connection = await aio_pika.connect(amqp_url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1000)
        queue = await channel.get_queue(exchange)

        producing = True
        all_in = asyncio.Event()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            received[str(message.message_id)] = time.perf_counter()
            if not producing and len(received) >= len(committing):
                all_in.set()

        await queue.consume(on_message, no_ack=True)
        producers = 8
        start = time.perf_counter() + 0.2

        async def produce(k: int) -> None:
            async with await psycopg.AsyncConnection.connect(url) as conn:
                for n in range(int(rate * seconds / producers)):
                    due = start + (n * producers + k) / rate
                    if (wait := due - time.perf_counter()) > 0:
                        await asyncio.sleep(wait)
                    row = await (
                        await conn.execute(
                            "SELECT outbox.enqueue(%s, 'bench.steady', %s)", [exchange, b"x" * BODY]
                        )
                    ).fetchone()
                    assert row is not None
                    committing[str(row[0])] = time.perf_counter()
                    await conn.commit()

        await asyncio.gather(*(produce(k) for k in range(producers)))
        producing = False
        if len(received) < len(committing):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), 30)
    lost = set(committing) - set(received)
    if lost:
        raise SystemExit(f"steady {rate}/s: {len(lost)} messages not received within 30 s")
    return [received[m] - t for m, t in committing.items() if t > start + 1]


def steady(svc: services.Services, rate: int, seconds: float) -> None:
    with svc.scratch_database("outbox_perf") as url:
        exchange = f"outbox-perf.{uuid.uuid4().hex[:8]}"
        asyncio.run(declare(svc.amqp_url, exchange, exchange, keep=None))
        env = clean_env(
            OUTBOX_DATABASE_URL=url, OUTBOX_AMQP_URL=svc.amqp_url, OUTBOX_LOG_FORMAT="text"
        )
        with RelayProcess(env, launcher=launcher(f"steady {rate}")) as relay:
            relay.wait_ready(timeout=120)
            with measured_cpu() as cpu:
                latencies = uvloop.run(_steady(url, svc.amqp_url, exchange, rate, seconds))
                relay.stop()
        asyncio.run(delete(svc.amqp_url, exchange, exchange))
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    sent = int(rate * seconds)
    print(
        f"steady {rate:,}/s for {seconds:.0f}s: commit-to-delivery p50 {cuts[49] * 1000:.1f} ms, "
        f"p95 {cuts[94] * 1000:.1f} ms, p99 {cuts[98] * 1000:.1f} ms, max "
        f"{max(latencies) * 1000:.1f} ms; {cpu.per_thousand(sent, 'relay + producers + consumer')}"
    )


# -- main -----------------------------------------------------------------------------------------


SCENARIOS = ("limit", "drain", "steady", "keyed", "backlog", "horizon", "pinned")


def main() -> None:
    global PROFILE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=100_000, help="backlog of the drains")
    parser.add_argument("--deep", type=int, default=1_000_000, help="the deep backlog")
    parser.add_argument("--steady-seconds", type=float, default=15.0)
    parser.add_argument("--quick", action="store_true", help="every size divided by ten")
    parser.add_argument(
        "--rates", type=int, nargs="+", default=[500, 2000], help="the pinned scenario's loads"
    )
    parser.add_argument(
        "--phases",
        type=float,
        nargs=4,
        metavar=("CLEAN", "PINNED", "READERS", "RECOVERY"),
        help="seconds of each phase of the pinned scenario (default 120 600 180 120, a tenth"
        " of that with --quick; given, they are used as they are)",
    )
    parser.add_argument("--json", type=Path, help="write the pinned scenario's results here")
    parser.add_argument(
        "--control",
        action="store_true",
        help="run the pinned scenario's phases with nothing pinned and no readers: what the"
        " machine does on its own over the same time (its lines say control)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=SCENARIOS,
        default=SCENARIOS,
        help="run these scenarios only (ratios need limit, and horizon needs drain)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="record each relay with py-spy (pip install py-spy): folded stacks in "
        "DIR/<scenario>-*.txt, for speedscope or flamegraph.pl",
    )
    args = parser.parse_args()
    if args.phases and min(args.phases) < 5:
        parser.error("--phases: each phase needs 5 seconds at least, to have latencies to report")
    PROFILE = args.profile
    only = set(args.only)
    scale = 10 if args.quick else 1
    n, deep, shallow = args.messages // scale, args.deep // scale, 10_000 // scale
    started = time.perf_counter()
    rates: dict[str, float] = {}
    with services.discover() as svc:
        ceiling = limit(svc, n) if "limit" in only else None
        if "drain" in only:
            rates["drain, 1 replica"] = drain(svc, "drain, 1 replica", n)
            rates["drain, 2 replicas"] = drain(svc, "drain, 2 replicas", n, replicas=2)
        if "steady" in only:
            for per_second in (500, 2000):
                steady(svc, per_second, args.steady_seconds / (1 if scale == 1 else 3))
        if "keyed" in only:
            rates["keyed, 100 keys"] = drain(svc, "keyed, 100 keys", n, keys=100)
            rates["keyed, 10,000 keys"] = drain(svc, "keyed, 10,000 keys", n, keys=10_000)
        if "backlog" in only:
            shallow_rate = drain(svc, f"backlog {shallow:,}", shallow, rounds=5)
            deep_rate = drain(svc, f"backlog {deep:,}", deep)
        if "horizon" in only:
            pinned = drain(svc, "drain, horizon pinned", n, during=pinned_horizon)
        if "pinned" in only:
            phases = args.phases or [t / scale for t in (120, 600, 180, 120)]
            with horizon.autovacuum_on(svc.database_url) as was:
                print(
                    f"pinned: autovacuum on for the run (it was {was})"
                    + ("; control: nothing is pinned, no readers" if args.control else "")
                )
                runs = [
                    horizon.pinned(svc, r, phases, launcher(f"pinned {r}"), args.control)
                    for r in args.rates
                ]
            if args.json:
                horizon.write_json(args.json, runs, was)
    print()
    if ceiling is not None:
        print(f"limit (best window): {ceiling:,.0f} msg/s")
        for label, rate in rates.items():
            print(f"{label}: {rate:,.0f} msg/s = {rate / ceiling:.0%} of the limit")
    if "backlog" in only:
        print(f"backlog {deep:,} vs {shallow:,}: {deep_rate / shallow_rate:.0%}")
    if "horizon" in only and "drain, 1 replica" in rates:
        print(f"horizon pinned vs not: {pinned / rates['drain, 1 replica']:.0%}")
    if "keyed" in only and "drain, 1 replica" in rates:
        for keys in ("100", "10,000"):
            keyed = rates[f"keyed, {keys} keys"] / rates["drain, 1 replica"]
            print(f"keyed drain, {keys} keys, vs unkeyed: {keyed:.0%}")
    print(f"benchmark took {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
