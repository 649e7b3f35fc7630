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
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql as pgsql

import relay
from relay.core import errors
from tests.interleavings.actors import (
    LEASE,
    TABLES,
    Call,
    Producer,
    RelayActor,
)
from tests.interleavings.relays import RelaySteps

__all__ = ["LEASE", "World", "reset"]


class World(RelaySteps):
    """See the module's docstring. Every public method is one step, run to quiescence."""

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
