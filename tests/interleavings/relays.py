"""The interleaving world's steps of relays: grants, held settles and claims, chores, freezes,
crashes and time (tests/interleavings/world.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from relay.core import errors, model
from relay.postgres import rows
from relay.postgres.sql import load
from tests.interleavings import legacy
from tests.interleavings.actors import (
    SESSION_SETUP,
    Call,
    Held,
    HeldClaim,
    RelayActor,
    connect,
)
from tests.interleavings.base import WorldBase
from tests.interleavings.ledger import RowNow, Send, outcome


class RelaySteps(WorldBase):
    """What relays do, step by step."""

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
