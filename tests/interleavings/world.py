"""A world of relays, producers and an operator over one real outbox database, where the test
decides every step anyone takes.

Each relay is the real `loop.Relay` over the real `PgStore` and SQL; only the broker is faked.
Every call it makes to the store or the broker waits at a gate until the test grants it. A granted
database call runs for real and may wait on a lock (seen in pg_stat_activity): it then stays in
flight while other steps go on. A relay's settle or claim can also be *held*: run in a transaction
left open, so that producers, operators and the other relays act while it is in progress (a held
claim then commits, rolls back as when its connection breaks, or commits with the relay told it
failed, as when the connection breaks just after). A relay can freeze (SIGSTOP: it takes no step
again, and a transaction it holds stays open) and a relay of the previous release can run beside
the others (tests/interleavings/legacy.py: its own statements). Its rescue chore runs when the
test says. Time is virtual: advancing it moves the relays' clocks forward and every stored time
(and each relay's cursors) back. Each send is judged the moment it happens
(tests/interleavings/ledger.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, LiteralString, TypeVar
from uuid import UUID

import psycopg
from psycopg import sql as pgsql

import relay
from relay.core import errors, loop, model
from relay.postgres import rows
from relay.postgres import store as pgstore
from relay.postgres.sql import load
from tests.interleavings import legacy
from tests.interleavings.ledger import Ledger, RowNow, Send, outcome

T = TypeVar("T")
#: Long, so that the real time an example takes (about a second) is far from every boundary the
#: virtual time crosses: a run and its replay make the same decisions.
LEASE = 100.0
#: A held claim's own rows, moved back by the seconds the world advanced while it was held.
SHIFT_HELD: tuple[LiteralString, ...] = (
    "UPDATE outbox.messages SET available_at = available_at - make_interval(secs => %s)"
    " WHERE claim_id IS NOT NULL AND claimed_at = now()",
)
OPTIONS = loop.Options(
    batch_size=3,
    lease=LEASE,
    prefetch=True,
    max_attempts=4,
    max_ambiguous=2,
    retry_delay=10.0,
    retry_max_delay=50.0,
)
KEYS = ("a", "b")  # the keys the state machine draws from (tests/interleavings/test_protocol.py)
#: Every session of the world fails a lock wait after this rather than hang the test, and finds
#: deadlocks quickly.
SESSION = "-c lock_timeout=30s -c deadlock_timeout=100ms"
#: The relay's own session set-up (relay.sql's relay_session), with the world's lock timeout.
SESSION_SETUP = {"lock_timeout": "30000"}
TABLES = ("messages", "archive", "dead", "keys", "key_releases", "blocked_keys", "key_checks")


@dataclasses.dataclass(eq=False)
class Call:
    """A relay's call to the store or the broker, waiting for the test to let it through."""

    actor: RelayActor
    method: str
    run: Callable[[], Awaitable[Any]] | None
    future: asyncio.Future[Any]
    messages: tuple[model.OutboxMessage, ...] = ()
    still_held: Callable[[], bool] | None = None
    claim_id: UUID | None = None
    settlement: model.Settlement | None = None
    #: A settle that claims the next batch in the same transaction.
    then: model.Ask | None = None

    def __repr__(self) -> str:
        return f"<{self.actor.name} {self.method}>"


@dataclasses.dataclass(eq=False)
class HeldClaim:
    """A relay's claim whose statement ran in a transaction left open: its rows are locked and
    its claims inserted, seen by no one else yet; its relay waits for the commit."""

    call: Call
    #: How it ends, and the seconds the world advanced while it was held: "commit"; "rollback"
    #: (the connection broke before the commit); "lost" (it committed, but the connection broke
    #: before the relay heard so).
    release: asyncio.Future[tuple[str, float]]
    task: asyncio.Task[Any]
    #: The world's offset when it was held.
    offset: float


@dataclasses.dataclass(eq=False)
class Held:
    """A relay's settle running in a transaction left open. Its statement may itself still be
    waiting on a lock (`task` not done); it can be ended once it is done. A settle that claims
    the next batch too (`then`) runs on its relay's own store, in a transaction that ends as
    `release` says (as HeldClaim's), once `ran`."""

    call: Call
    conn: psycopg.AsyncConnection[Any] | None
    task: asyncio.Task[Any]
    release: asyncio.Future[tuple[str, float]] | None = None
    ran: asyncio.Event | None = None
    offset: float = 0.0

    @property
    def done(self) -> bool:
        return self.ran.is_set() if self.ran is not None else self.task.done()


class _Pool:
    """Enough of psycopg_pool for PgStore: sessions named for their actor, opened on demand and
    set up as the relay's own pool sets them up."""

    def __init__(self, url: str, name: str) -> None:
        self._url, self._name = url, name
        self._idle: list[psycopg.AsyncConnection[Any]] = []
        self._all: list[psycopg.AsyncConnection[Any]] = []
        #: Set by World.hold_claim: the next connection runs in a transaction that ends as this
        #: says, once the statement has run (`held_ran` is then set).
        self.hold: asyncio.Future[tuple[str, float]] | None = None
        self.held_ran = asyncio.Event()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        if self.hold is not None:
            release, self.hold = self.hold, None
            async with self._held(release) as conn:
                yield conn
            return
        conn = self._idle.pop() if self._idle else await self._open()
        try:
            yield conn
        finally:
            self._idle.append(conn)

    @contextlib.asynccontextmanager
    async def _held(self, release: asyncio.Future[tuple[str, float]]) -> AsyncIterator[Any]:
        conn = await self._open()
        self._all.remove(conn)
        try:
            await conn.set_autocommit(False)
            yield conn
            self.held_ran.set()
            end, owed = await release
            if end == "rollback":
                await conn.rollback()
            else:
                # World.advance could not move the times this transaction wrote while it held
                # them: its leases end `owed` seconds earlier than they say, as they would have if
                # that time had really passed since it began (now() is when it began).
                for shift in SHIFT_HELD:
                    await conn.execute(shift, [owed])
                await conn.commit()
            if end != "commit":  # what the relay sees when its connection breaks
                raise psycopg.OperationalError(f"the connection broke ({end})")
        finally:
            await conn.close()

    async def _open(self) -> psycopg.AsyncConnection[Any]:
        conn = await connect(self._url, self._name)
        await conn.execute(load().relay_session, SESSION_SETUP)
        self._all.append(conn)
        return conn

    async def close(self) -> None:
        for conn in self._all:
            await conn.close()


async def connect(url: str, name: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(
        url, autocommit=True, application_name=name, options=SESSION
    )


class GatedStore:
    """ports.Store whose every call waits for the test's grant, then runs on `real` (PgStore, or
    a relay of the previous release's statements)."""

    def __init__(self, actor: RelayActor, legacy_release: bool = False) -> None:
        self._actor = actor
        self.pool = _Pool(actor.world.url, actor.name)
        pool: Any = self.pool  # PgStore needs only .connection()
        self.real: pgstore.PgStore = (
            legacy.LegacyStore(pool, "outbox", actor.name)
            if legacy_release
            else pgstore.PgStore(pool, "outbox", actor.name, synchronous_commit=False)
        )

    async def claim(self, ask: model.Ask) -> model.Claim:
        return await self._actor.gate("claim", lambda: self.real.claim(ask))

    async def extend(self, claim_id: UUID, ids: Sequence[int], lease: float) -> frozenset[int]:
        run = lambda: self.real.extend(claim_id, ids, lease)  # noqa: E731
        return await self._actor.gate("extend", run)

    async def settle(
        self, claim_id: UUID, settlement: model.Settlement, then: model.Ask | None = None
    ) -> tuple[model.SettleCounts, model.Claim]:
        run = lambda: self.real.settle(claim_id, settlement, then)  # noqa: E731
        return await self._actor.gate(
            "settle", run, claim_id=claim_id, settlement=settlement, then=then
        )

    async def stats(self) -> model.Stats:
        return await self.real.stats()


class GatedBroker:
    """ports.Publisher whose connects and publishes wait for the test, which also decides what
    the broker answers. Nothing is written once `still_held` says the lease may be gone."""

    def __init__(self, actor: RelayActor) -> None:
        self._actor = actor
        self.blocked = False

    async def connect(self) -> None:
        await self._actor.ask("connect")

    async def until_unblocked(self) -> None:
        return None

    async def publish(
        self,
        messages: Sequence[model.OutboxMessage],
        abort: asyncio.Event | None = None,
        still_held: Callable[[], bool] | None = None,
    ) -> list[model.PublishResult]:
        answer = self._actor.ask("publish", messages=tuple(messages), still_held=still_held)
        return list(await answer)

    async def close(self) -> None:
        return None


async def _no_wait(seconds: float) -> None:
    await asyncio.sleep(0)


class RelayActor:
    """One relay: the real loop, cycling `run_once()` for ever, every call gated."""

    def __init__(
        self,
        world: World,
        name: str,
        *,
        auto: bool = False,
        batch_size: int | None = None,
        legacy_release: bool = False,
    ) -> None:
        self.world = world
        self.name = name
        self.auto = auto  # grant everything at once and acknowledge every publish (the drain)
        self.alive = True
        self.frozen = False  # SIGSTOP: no step again, its open transactions stay open
        self.broker_down = False
        self.pending: list[Call] = []
        self.claims: set[UUID] = set()
        self.store = GatedStore(self, legacy_release)
        options = dataclasses.replace(OPTIONS, batch_size=100) if auto else OPTIONS
        if batch_size is not None:
            options = dataclasses.replace(options, batch_size=batch_size)
        # A settle's retry waits no real time: how long a step takes on this machine must never
        # decide whether the retry is at its gate yet, or Hypothesis sees a different case when it
        # replays one (FlakyStrategyDefinition). Time passes in the world only as the test says.
        self.relay = loop.Relay(
            self.store, GatedBroker(self), options, clock=world.clock, sleep=_no_wait
        )
        self.beating: asyncio.Task[Any] | None = None
        self.cycles = 0  # run_once calls completed
        self.stopping = False  # told to stop: it ends the cycle it is in, then gives back
        self.stopped = False
        self.task = world.loop.create_task(self._cycle())

    def __repr__(self) -> str:
        return self.name

    async def _cycle(self) -> None:
        while not self.stopping:
            with contextlib.suppress(errors.TransientError):
                await self.relay.run_once()
            self.cycles += 1
        # What `Relay.run` does once told to stop: give back the batch claimed ahead.
        await self.relay.drop_prefetched()
        self.stopped = True

    async def gate(self, method: str, run: Callable[[], Awaitable[T]], **kw: Any) -> T:
        """A store call: runs on the real store once the test grants it."""
        result: T = await self._wait(Call(self, method, run, self.world.loop.create_future(), **kw))
        return result

    async def ask(self, method: str, **kw: Any) -> Any:
        """A broker call: the test decides what comes back."""
        return await self._wait(Call(self, method, None, self.world.loop.create_future(), **kw))

    async def _wait(self, call: Call) -> Any:
        if self.auto:
            self.world.loop.create_task(self.world.grant_now(call, "ack"))
        else:
            self.pending.append(call)
        return await call.future


class Producer:
    """A producer's connection and its open transaction, if any."""

    def __init__(self, name: str, conn: psycopg.AsyncConnection[Any]) -> None:
        self.name = name
        self.conn = conn
        self.open = False
        self.repeatable = False
        self.keys: set[str] = set()
        self.ids: list[UUID] = []

    def __repr__(self) -> str:
        return self.name


class World:
    """See the module's docstring. Every public method is one step, run to quiescence."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.loop = asyncio.new_event_loop()
        self.offset = 0.0
        self.ledger = Ledger()
        self.relays: list[RelayActor] = []
        self.held: list[Held] = []
        self.held_claims: list[HeldClaim] = []
        self.in_flight: list[tuple[str, asyncio.Task[Any]]] = []  # ops waiting on a lock
        self._names = itertools.count()
        self.monitor = self.run(connect(url, "monitor"))
        self.operator = self.run(connect(url, "operator"))
        self.producers = [Producer(f"producer-{n}", self.run(connect(url, f"producer-{n}")))
                          for n in range(2)]  # fmt: skip

    # -- time and plumbing -----------------------------------------------------------------

    def clock(self) -> float:
        return time.monotonic() + self.offset

    def virtual_time(self) -> float:
        """Only the time the test lets pass."""
        return self.offset

    def run(self, step: Awaitable[T]) -> T:
        return self.loop.run_until_complete(step)

    async def _quiet(self) -> None:
        """Let every actor run on until it waits at a gate (or on a lock): nothing they do
        between gates needs I/O, so a few hundred turns of the loop are plenty."""
        for _ in range(300):
            await asyncio.sleep(0)

    async def _until_done_or_waiting(
        self, who: str, task: asyncio.Task[Any], ran: asyncio.Event | None = None
    ) -> bool:
        """True once `task` is done (or `ran` is set); False if `who`'s session waits on a lock
        meanwhile."""
        deadline = time.monotonic() + 20
        while not task.done() and not (ran is not None and ran.is_set()):
            # Blocked by one of the world's sessions now: a session just woken by a commit may
            # still show its lock wait for a moment, but no longer has anyone blocking it. A
            # wait on a server process (autovacuum, where it is on, truncating a table's empty
            # tail holds ACCESS EXCLUSIVE for a moment) is only slowness: it passes.
            cur = await self.monitor.execute(
                "SELECT count(*) FROM pg_stat_activity w"
                " WHERE w.application_name = %s AND w.wait_event_type = 'Lock'"
                " AND EXISTS (SELECT 1 FROM pg_stat_activity b"
                "  WHERE b.pid = ANY(pg_blocking_pids(w.pid))"
                "  AND b.backend_type = 'client backend' AND b.application_name <> '')",
                [who],
            )
            row = await cur.fetchone()
            if row is not None and row[0] > 0:
                return False
            if time.monotonic() > deadline:
                raise AssertionError(f"{who}'s operation neither finished nor waited on a lock")
            await asyncio.sleep(0.001)
        return True

    async def _operate(self, who: str, work: Coroutine[Any, Any, Any]) -> bool:
        """Run `work`; leave it in flight if it waits on a lock. Whether it finished."""
        task = self.loop.create_task(work)
        done = await self._until_done_or_waiting(who, task)
        if done:
            task.result()
        else:
            self.in_flight.append((who, task))
        return done

    async def _catch_up(self) -> None:
        """Let operations in flight, and held settles' statements, finish where nothing blocks
        them any more. So what is finishable after a step is decided by the locks alone, never
        by how fast the server ran meanwhile: Hypothesis replays each case the same way."""
        for who, task in list(self.in_flight):
            if await self._until_done_or_waiting(who, task):
                self.in_flight.remove((who, task))
                task.result()
        await self._settle_held()
        await self._quiet()

    async def _settle_held(self) -> None:
        for held in self.held:
            if not held.done:
                await self._until_done_or_waiting(held.call.actor.name, held.task, held.ran)

    # -- relays ----------------------------------------------------------------------------

    def start_relay(
        self, *, auto: bool = False, batch_size: int | None = None, legacy_release: bool = False
    ) -> RelayActor:
        name = f"{'old-' if legacy_release else ''}relay-{next(self._names)}"
        actor = RelayActor(
            self, name, auto=auto, batch_size=batch_size, legacy_release=legacy_release
        )
        self.relays.append(actor)
        self.run(self._quiet())
        return actor

    def alive(self) -> list[RelayActor]:
        return [r for r in self.relays if r.alive and not r.auto and not r.frozen]

    def grantable(self, method: str | None = None) -> list[Call]:
        return [
            c
            for r in self.alive()
            for c in r.pending
            if (c.method == method if method else c.method != "publish")
        ]

    def grant(self, call: Call, kind: str = "ack") -> None:
        """Let `call` through; a publish gets the broker's answer `kind` (ledger.KINDS)."""
        call.actor.pending.remove(call)
        self.run(self.grant_now(call, kind))

    async def grant_now(self, call: Call, kind: str) -> None:
        if call.future.done():  # its relay was stopped meanwhile (the drain's)
            return
        if call.method == "connect":
            if call.actor.broker_down:
                call.future.set_exception(errors.BrokerUnavailable("the broker is down"))
            else:
                call.future.set_result(None)
        elif call.method == "publish":
            answer = await self._publish(call, kind)
            if not call.future.done():
                call.future.set_result(answer)
        else:
            await self._operate(call.actor.name, self._deliver(call))
        await self._quiet()

    async def _deliver(self, call: Call) -> None:
        assert call.run is not None
        try:
            result = await call.run()
        except errors.TransientError as exc:
            if not call.future.done():
                call.future.set_exception(exc)
            return
        claimed = result[1] if isinstance(result, tuple) else result
        if isinstance(claimed, model.Claim):
            call.actor.claims.add(claimed.claim_id)
        if not call.future.done():
            call.future.set_result(result)

    async def _publish(self, call: Call, kind: str) -> list[model.PublishResult]:
        if call.still_held is not None and not call.still_held():
            return [model.PublishResult(model.Outcome.UNSENT, "lease") for _ in call.messages]
        for m in call.messages:
            self.ledger.send(await self._send(call.actor, m), await self._row(m), call.actor.claims)
        return [outcome(kind, i) for i in range(len(call.messages))]

    async def _send(self, actor: RelayActor, m: model.OutboxMessage) -> Send:
        return Send(actor.name, m.message_id, m.ordering_key, m.seq, m.attempts, m.replays)

    async def _row(self, m: model.OutboxMessage) -> RowNow | None:
        """The message's row as the database has it now (None: settled)."""
        cur = await self.monitor.execute(
            "SELECT m.claim_id, m.attempts, m.available_at > now(),"
            " coalesce((SELECT k.concurrency FROM outbox.keys k"
            "           WHERE k.ordering_key = m.ordering_key), 1)"
            " FROM outbox.messages m WHERE m.id = %s",
            [m.id],
        )
        row = await cur.fetchone()
        return None if row is None else RowNow(*row)

    def hold(self, call: Call) -> None:
        """Run a pending settle in a transaction left open (its relay waits for the result)."""
        call.actor.pending.remove(call)
        self.run(self._hold(call))

    async def _hold(self, call: Call) -> None:
        if call.then is not None:  # it claims too: held on its relay's own store
            await self._hold_chained(call)
            return
        assert call.settlement is not None
        conn = await connect(self.url, call.actor.name)
        await conn.execute(load().relay_session, SESSION_SETUP)
        await conn.set_autocommit(False)
        params = rows.settle_params(call.claim_id, call.settlement, True)  # type: ignore[arg-type]
        legacy_release = isinstance(call.actor.store.real, legacy.LegacyStore)
        if legacy_release:
            query = legacy.SETTLE
            params = legacy.settle_params(params)
        else:
            query, params = load().settle, {**params, "request": None}

        async def settle() -> Any:
            cur = await conn.execute(query, params)
            return await cur.fetchone()

        task = self.loop.create_task(settle())
        await self._until_done_or_waiting(call.actor.name, task)
        self.held.append(Held(call, conn, task))
        await self._quiet()

    async def _hold_chained(self, call: Call) -> None:
        started = await self._start_held(call, may_wait=True)
        if started is not None:
            release, ran, task = started
            self.held.append(Held(call, None, task, release, ran, self.offset))
        await self._quiet()

    async def _start_held(
        self, call: Call, *, may_wait: bool
    ) -> tuple[asyncio.Future[tuple[str, float]], asyncio.Event, asyncio.Task[Any]] | None:
        """Run `call` on a connection of its relay's store left in a transaction that ends as the
        returned future says; return once its statement has run — or, if `may_wait`, waits on a
        lock. None if it failed before its statement ran (the relay has the error)."""
        pool = call.actor.store.pool
        release: asyncio.Future[tuple[str, float]] = self.loop.create_future()
        pool.hold = release
        ran = pool.held_ran = asyncio.Event()
        task = self.loop.create_task(self._deliver(call))
        waiting = self.loop.create_task(self._until_done_or_waiting(call.actor.name, task))
        statement = self.loop.create_task(ran.wait())
        await asyncio.wait((task, waiting, statement), return_when=asyncio.FIRST_COMPLETED)
        statement.cancel()
        if waiting.done():
            if waiting.result() is False and not may_wait:
                raise AssertionError(f"{call} waited on a lock")  # SKIP LOCKED: it never waits
        else:
            waiting.cancel()
        if task.done():
            task.result()
            return None
        return release, ran, task

    async def _drop(self, held: Held) -> None:
        """Its relay is gone: the transaction rolls back."""
        if held.conn is not None:
            await held.conn.close()
        elif held.release is not None and not held.release.done():
            if held.ran is not None and not held.ran.is_set():  # still waiting on a lock
                await self.monitor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = %s AND wait_event_type = 'Lock'",
                    [held.call.actor.name],
                )
            held.release.set_result(("rollback", 0.0))
            with contextlib.suppress(Exception):
                await held.task

    def finishable(self) -> list[Held]:
        """Held settles whose statement has run. One a commit just unblocked counts once it has
        run (waited for here), so the answer depends on the locks, not on the server's speed."""
        if any(not h.done for h in self.held):
            self.run(self._settle_held())
        return [h for h in self.held if h.done]

    def finish_held(self, held: Held, end: str = "commit") -> None:
        """End a held settle whose statement is done (one that claims too may also roll back or
        be lost, as HeldClaim.release says); its relay gets on."""
        self.held.remove(held)
        self.run(self._finish(held, end))

    async def _finish(self, held: Held, end: str) -> None:
        if held.release is not None:
            held.release.set_result((end, self.offset - held.offset))
            await held.task
            if end != "commit":  # its relay settles again after a real back-off: wait for it
                deadline = time.monotonic() + 20
                while not held.call.actor.pending:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"{held.call.actor} did not settle again")
                    await asyncio.sleep(0.01)
            await self._catch_up()
            return
        assert held.conn is not None
        archived, dead, retried, released, blocked, *_ = held.task.result()
        await held.conn.commit()
        await held.conn.close()
        assert held.call.settlement is not None
        fenced = held.call.settlement.size - archived - dead - retried
        counts = model.SettleCounts(archived, dead, retried, fenced, released, blocked)
        held.call.future.set_result((counts, model.Claim(uuid.uuid4(), ())))
        await self._catch_up()

    def hold_claim(self, call: Call) -> None:
        """Run a pending claim in a transaction left open (its relay waits for the result)."""
        call.actor.pending.remove(call)
        self.run(self._hold_claim(call))

    async def _hold_claim(self, call: Call) -> None:
        # A claim may wait only where it buries a keyed row an operator is releasing.
        started = await self._start_held(call, may_wait=True)
        if started is not None:
            release, _, task = started
            self.held_claims.append(HeldClaim(call, release, task, self.offset))
        await self._quiet()

    def end_held_claim(self, held: HeldClaim, end: str) -> None:
        """End a held claim as HeldClaim.release says."""
        self.held_claims.remove(held)
        self.run(self._end_claim(held, end))

    async def _end_claim(self, held: HeldClaim, end: str) -> None:
        held.release.set_result((end, self.offset - held.offset))
        await held.task
        await self._catch_up()

    def heartbeat(self, actor: RelayActor) -> None:
        """The keeper's heartbeat fires: its renewals become calls waiting for grants."""
        if actor.beating is None or actor.beating.done():
            actor.beating = self.loop.create_task(actor.relay.heartbeat.run_once())
        self.run(self._quiet())

    def rescue(self, actor: RelayActor) -> int:
        """The relay's rescue chore runs (beside its loop, on its own connection): its cursors
        move back to any row left behind them. How many moved."""
        return self._chore(actor, actor.store.real.rescue)

    def _chore(self, actor: RelayActor, chore: Callable[[], Awaitable[int]]) -> int:
        moved: list[int] = []

        async def run() -> None:
            moved.append(await chore())

        self.run(self._operate(actor.name, run()))
        self.run(self._catch_up())
        return sum(moved)

    def freeze(self, actor: RelayActor) -> None:
        """SIGSTOP (or a network that stopped): it takes no step again, and what it holds stays
        held — a settle or claim held open stays open — until the test kills it (`crash`)."""
        actor.frozen = True
        actor.pending.clear()

    def crash(self, actor: RelayActor) -> None:
        """kill -9: it takes no step again; a transaction it had open rolls back."""
        actor.alive = False
        actor.frozen = False
        actor.pending.clear()
        for held in [h for h in self.held if h.call.actor is actor]:
            self.held.remove(held)
            self.run(self._drop(held))
        for claim in [h for h in self.held_claims if h.call.actor is actor]:
            self.end_held_claim(claim, "rollback")
        ahead = actor.relay.leases.take_ahead()  # a dead relay reads no answer, failed or not
        if ahead is not None:
            ahead.add_done_callback(lambda done: done.cancelled() or done.exception())
        self.run(self._catch_up())

    def advance(self, seconds: float) -> None:
        """Time passes: the relays' clocks move on, and every stored time moves back (rows a held
        settle locks keep theirs: they only become due later than they might; a held claim's
        leases move back when it commits)."""
        self.offset += seconds
        self.run(
            self.monitor.execute(
                "UPDATE outbox.messages SET available_at = available_at - make_interval(secs => %s)"
                " WHERE id IN (SELECT id FROM outbox.messages FOR UPDATE SKIP LOCKED)",
                [seconds],
            )
        )
        for actor in self.relays:  # where each relay's next claim starts moves with them
            actor.store.real.shift_cursors(seconds)

    # -- producers -------------------------------------------------------------------------

    def begin(self, p: Producer, repeatable: bool) -> None:
        self.run(self._begin(p, repeatable))

    async def _begin(self, p: Producer, repeatable: bool) -> None:
        await p.conn.set_autocommit(False)
        await p.conn.set_isolation_level(
            psycopg.IsolationLevel.REPEATABLE_READ
            if repeatable
            else psycopg.IsolationLevel.READ_COMMITTED
        )
        await p.conn.execute("SELECT 1")  # the business reads: a snapshot from here on
        p.open, p.repeatable, p.keys, p.ids = True, repeatable, set(), []

    def enqueue(self, p: Producer, key: str | None, message_id: UUID | None = None) -> None:
        """An enqueue in `p`'s open transaction; with `message_id`, one another transaction used
        too: refused (DuplicateMessage), at once or once that one commits, and `p`'s transaction
        ends with it — unless that one rolled back. A message_id whose row a relay's open
        transaction holds (a claim or a settle at a gate) makes the insert's unique check wait
        for that transaction, as any unique check must: that enqueue is given up (cancelled, and
        `p`'s transaction rolled back), since the world would wait on an actor it drives."""
        task = self.loop.create_task(
            relay.enqueue_async(p.conn, "x", "k", b"", ordering_key=key, message_id=message_id)
        )
        try:
            if not self.run(self._until_done_or_waiting(p.name, task)):
                self.run(p.conn.cancel_safe())
                with contextlib.suppress(psycopg.Error, errors.RelayError):
                    self.run(task)
                self.run(self._abort(p))
                return
            given = task.result()
        except psycopg.errors.SerializationFailure as exc:
            if message_id is not None:  # one promise for an id given twice, whatever the timing
                self.ledger.violate(f"{p.name}'s second enqueue of {message_id} failed: {exc}")
            self.run(self._abort(p))
            return
        except errors.DuplicateMessage:
            self.run(self._abort(p))
            return
        p.ids.append(given)
        if key is not None:
            p.keys.add(key)

    def commit(self, p: Producer) -> None:
        task = self.loop.create_task(p.conn.commit())
        try:
            finished = self.run(self._until_done_or_waiting(p.name, task))
            if not finished:
                blockers = self.run(self._blockers(p.name))
                self.ledger.violate(f"{p.name}'s COMMIT waited for {blockers}")
                raise AssertionError(f"{p.name}'s COMMIT waited for {blockers}")
            task.result()
        except psycopg.errors.SerializationFailure:
            self.run(self._abort(p))
            return
        except psycopg.Error as exc:
            self.ledger.violate(f"{p.name}'s COMMIT failed: {exc}")
            raise
        twice = self.ledger.committed & set(p.ids)
        if twice:
            self.ledger.violate(f"{p.name} committed message_ids already committed: {twice}")
        self.ledger.committed.update(p.ids)
        p.open = False
        self.run(self._quiet())

    def rollback(self, p: Producer) -> None:
        self.run(self._abort(p))

    async def _abort(self, p: Producer) -> None:
        await p.conn.rollback()
        self.ledger.aborted.update(p.ids)
        p.open, p.ids, p.keys = False, [], set()

    async def _blockers(self, who: str) -> list[str]:
        cur = await self.monitor.execute(
            "SELECT coalesce(nullif(b.application_name, ''), b.backend_type)"
            " FROM pg_stat_activity w, pg_stat_activity b"
            " WHERE w.application_name = %s AND b.pid = ANY(pg_blocking_pids(w.pid))",
            [who],
        )
        return [str(name) for (name,) in await cur.fetchall()]

    def waiting_ids(self) -> list[UUID]:
        """message_ids of committed messages still in the outbox."""
        return [UUID(str(m)) for (m,) in self._fetch("SELECT message_id FROM outbox.messages")]

    def keys_in_use(self) -> set[str]:
        """Keys an open producer transaction has written to, or an operator is acting on."""
        held = {k for p in self.producers if p.open for k in p.keys}
        return held | ({"*"} if self.in_flight_operator() else set())

    def in_flight_operator(self) -> bool:
        return any(who == "operator" for who, _ in self.in_flight)

    # -- the operator ----------------------------------------------------------------------

    def blocked_keys(self) -> list[str]:
        return [str(k) for (k,) in self._fetch("SELECT ordering_key FROM outbox.blocked_keys")]

    def dead_ids(self) -> list[int]:
        return [int(i) for (i,) in self._fetch("SELECT id FROM outbox.dead ORDER BY id")]

    def release(self, key: str, replay: bool) -> None:
        self._note_skips()
        self.run(self._operator("SELECT outbox.release_key(%s, %s)", [key, replay]))

    def replay(self, dead_id: int) -> None:
        self._note_skips()
        self.run(self._operator("SELECT outbox.replay_dead(ARRAY[%s::bigint])", [dead_id]))

    def _note_skips(self) -> None:
        """Before a replay: which dead keyed messages were skipped (not what blocks their key)."""
        self.ledger.skipped.update(
            (str(k), int(s))
            for k, s in self._fetch(
                "SELECT d.ordering_key, d.seq FROM outbox.dead d"
                " WHERE d.ordering_key IS NOT NULL AND NOT EXISTS ("
                "  SELECT 1 FROM outbox.blocked_keys b"
                "  WHERE b.ordering_key = d.ordering_key AND b.message_id = d.message_id)"
            )
        )

    def policy(self, on_dead: str, concurrency: int) -> None:
        self.run(
            self._operator(
                "UPDATE outbox.key_policies SET on_dead = %s, concurrency = %s WHERE prefix = ''",
                [on_dead, concurrency],
            )
        )

    async def _operator(self, statement: str, args: list[Any]) -> None:
        await self._operate("operator", self.operator.execute(statement.encode(), args))
        await self._quiet()

    def _fetch(self, query: str, *args: Any) -> list[tuple[Any, ...]]:
        async def fetch() -> list[tuple[Any, ...]]:
            cur = await self.monitor.execute(query.encode(), args)
            return await cur.fetchall()

        return self.run(fetch())

    # -- scripted steps, for the named cases -----------------------------------------------

    def first(self, actor: RelayActor, method: str) -> Call:
        """`actor`'s first pending call of `method`; AssertionError if it has none."""
        calls = [c for c in actor.pending if c.method == method]
        assert calls, f"{actor.name} has no {method} waiting, only {actor.pending}"
        return calls[0]

    def until(self, actor: RelayActor, method: str, kind: str = "ack", limit: int = 40) -> Call:
        """Grant `actor`'s calls in order (publishes answered `kind`) until it has a call of
        `method` waiting; that call."""
        for _ in range(limit):
            calls = [c for c in actor.pending if c.method == method]
            if calls:
                return calls[0]
            if not actor.pending:
                blockers = self.run(self._blockers(actor.name))
                raise AssertionError(
                    f"{actor.name} is waiting on nothing the test can grant (blocked by"
                    f" {blockers or 'no one'})"
                )
            self.grant(actor.pending[0], kind)
        raise AssertionError(f"{actor.name} never got to {method}")

    def work_until(self, actor: RelayActor, method: str, limit: int = 20) -> Call | None:
        """As `until`, but None where `actor` waits on nothing the test can grant (a lock, a
        held call) or does not get there within `limit` grants."""
        for _ in range(limit):
            calls = [c for c in actor.pending if c.method == method]
            if calls:
                return calls[0]
            if not actor.pending or not actor.alive:
                return None
            self.grant(actor.pending[0], "ack")
        return None

    def commit_now(self, *keys: str | None) -> None:
        """One producer transaction that enqueues a message per key and commits."""
        producer = next(p for p in self.producers if not p.open)
        self.begin(producer, repeatable=False)
        for key in keys:
            self.enqueue(producer, key)
        self.commit(producer)

    # -- the checks ------------------------------------------------------------------------

    def overlapping_holds(self) -> list[str]:
        """Rows two live claims (by their relays' own clocks) both believe they hold."""
        seen: dict[int, str] = {}
        problems = []
        for actor in self.alive():
            for claim_id, ids in actor.relay.leases.held().items():
                for i in ids:
                    if i in seen:
                        problems.append(f"row {i} held by {seen[i]} and {actor.name}/{claim_id}")
                    seen[i] = f"{actor.name}/{claim_id}"
        return problems

    def finish(self) -> list[str]:
        """Stop every step, let the relays drain everything (an operator releasing blocked keys
        as needed), and say what is wrong with the end state."""
        for p in self.producers:
            if p.open:
                self.rollback(p)
        while self.finishable():
            self.finish_held(self.finishable()[0])
        while self.held_claims:
            self.end_held_claim(self.held_claims[0], "commit")
        self.run(self._catch_up())
        assert not self.held, f"held settles still waiting on locks: {self.held}"
        assert not self.in_flight, f"still waiting on locks: {self.in_flight}"
        for actor in [r for r in self.relays if r.alive and not r.auto]:
            self.crash(actor)  # the frozen ones too: killed at last
        for _ in range(20):
            self.advance(LEASE * 10)
            drainer = self.start_relay(auto=True)
            self.run(self._drained(drainer))
            drainer.alive = False
            drainer.task.cancel()
            for key in self.blocked_keys():
                self.release(key, replay=False)
            if not self._fetch("SELECT 1 FROM outbox.messages"):
                break
        waiting = [
            dict(zip(("key", "seq", "gated", "claimed", "attempts"), row, strict=True))
            for row in self._fetch(
                "SELECT ordering_key, seq, gated, claim_id IS NOT NULL, attempts"
                " FROM outbox.messages ORDER BY ordering_key, seq"
            )
        ]
        archived = {m: (k, s) for m, k, s in self._fetch(
            "SELECT message_id, ordering_key, seq FROM outbox.archive")}  # fmt: skip
        dead = {m: (k, s) for m, k, s in self._fetch(
            "SELECT message_id, ordering_key, seq FROM outbox.dead")}  # fmt: skip
        return self.ledger.final(waiting, archived, dead) + self.ledger.violations

    async def _drained(self, drainer: RelayActor) -> None:
        """Wait until the automatic relay has cycled twice since nothing was left to do: no due
        row, no claimed row, no recheck queued. Its rescue runs as it cycles."""
        idle_since: int | None = None
        for _ in range(2000):
            await self._quiet()
            await drainer.store.real.rescue()
            cur = await self.monitor.execute(
                "SELECT (SELECT count(*) FROM outbox.messages"
                "        WHERE (NOT gated AND available_at <= now()) OR claim_id IS NOT NULL)"
                "     + (SELECT count(*) FROM outbox.key_checks)"
            )
            row = await cur.fetchone()
            if row is None or row[0] > 0:
                idle_since = None
            elif idle_since is None:
                idle_since = drainer.cycles
            elif drainer.cycles >= idle_since + 2:
                return
            await asyncio.sleep(0.001)  # the automatic relay's calls run as tasks: let them

    def close(self) -> None:
        for actor in self.relays:
            actor.task.cancel()
            if actor.beating is not None:
                actor.beating.cancel()
        for held in self.held:
            self.run(self._drop(held))
        for claim in self.held_claims:
            claim.release.cancel()
        for _, task in self.in_flight:
            task.cancel()
        for _ in range(5):  # a task being cancelled may start others (a relay giving rows back)
            pending = asyncio.all_tasks(self.loop)
            if not pending:
                break
            for task in pending:
                task.cancel()
            # A task cancelled inside a driver call may linger: closing its session ends it.
            self.run(asyncio.wait(pending, timeout=5))
        for actor in self.relays:
            self.run(actor.store.real.close())
        for conn in (self.monitor, self.operator, *(p.conn for p in self.producers)):
            self.run(conn.close())
        self.loop.close()


def reset(url: str) -> None:
    """Empty every outbox table and put the default key policy back, between examples."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            pgsql.SQL("TRUNCATE {} RESTART IDENTITY").format(
                pgsql.SQL(", ").join(pgsql.Identifier("outbox", t) for t in TABLES)
            )
        )
        conn.execute("UPDATE outbox.key_policies SET on_dead = 'block', concurrency = 1")
        # Producers ring the doorbell (migration 0023) instead of notifying while no relay holds
        # it, as in production: their lock must never make a COMMIT wait (`commit` checks it).
        conn.execute("UPDATE outbox.settings SET doorbell = true")
