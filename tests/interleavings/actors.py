"""The interleaving world's actors: relays whose every store and broker call waits at a gate
for the test (tests/interleavings/world.py), their calls, what they hold open, and producers."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, LiteralString, TypeVar
from uuid import UUID

import psycopg

from relay.core import errors, loop, model
from relay.postgres import store as pgstore
from relay.postgres.sql import load
from tests.interleavings import legacy

if TYPE_CHECKING:
    from tests.interleavings.relays import RelaySteps

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
        world: RelaySteps,
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
