"""The relay's cycle: claim due rows, publish them with confirms, and settle each by its outcome."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from uuid import UUID

import tenacity

from relay.core import chores, errors, leases, model, policy, ports, retry, waiting, waking
from relay.core.policy import Options, plan, release

__all__ = ["Options", "Relay", "plan", "release"]

log = logging.getLogger("relay.loop")  # the name log lines carry: as before the folders


class Relay:
    """One relay's loop. `run_once()` is a single cycle; `run()` cycles until told to stop.

    Everything it holds is in `leases` (a lease keeper), renewed every third of a lease while
    `run()` or `run_until_empty()` is going; tests that call `run_once()` directly renew by
    calling `leases.run_once()`. A claim is published only while its hold is trusted. What is
    not the cycle — the rescue of rows left behind, the doorbell — runs beside it, as chores of
    the composition root's."""

    def __init__(
        self,
        store: ports.Store,
        publisher: ports.Publisher,
        options: Options = Options(),  # frozen, so sharing the default is safe
        *,
        waker: waking.Waker | None = None,
        on_cycle: Callable[[model.CycleReport], None] | None = None,
        on_chore_error: Callable[[str], None] | None = None,
        on_lock_retry: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._store = store
        self._sleep = sleep  # how a settle waits before its retry (a test's world: not at all)
        self._publisher = publisher
        self._options = options
        self._clock = clock
        self.waker = waker or waking.Waker(asyncio.Event(), None, options.poll_interval)
        self._on_cycle = on_cycle
        self._on_lock_retry = on_lock_retry
        self._stopping = asyncio.Event()  # claim nothing more; give back what is not yet sent
        self._abort = asyncio.Event()  # the shutdown grace is over: stop waiting for confirms
        self._ask = model.Ask(options.batch_size, options.lease, options.max_attempts)
        self.leases = leases.Keeper(store, options.lease, clock)
        #: The keeper's heartbeat, as a supervised chore (the composition root watches it).
        self.heartbeat = chores.Chore(
            "leases",
            self.leases.run_once,
            self.leases.heartbeat,
            stall_after=options.stalled_after,
            on_error=on_chore_error,
        )
        #: For /livez: the loop is cycling, or waiting on purpose.
        self.last_progress = time.monotonic()

    @property
    def wake(self) -> asyncio.Event:
        """Set by a producer's NOTIFY (the listener's): look again now."""
        return self.waker.wake

    def tick(self) -> None:
        """Note that the loop is alive: it cycled, or is deliberately waiting (for work, an outage
        to end, or the broker to unblock)."""
        self.last_progress = time.monotonic()

    def _outage(self, state: tenacity.RetryCallState) -> None:
        self.tick()  # waiting out an outage is not hanging
        exc = state.outcome.exception() if state.outcome else None
        if isinstance(exc, errors.LockTimeout) and self._on_lock_retry is not None:
            self._on_lock_retry()
        _log_outage(state)

    def _retrying(
        self,
        sleep: Callable[[float], Awaitable[None]],
        stop: Callable[[tenacity.RetryCallState], bool] = tenacity.stop_never,
    ) -> tenacity.AsyncRetrying:
        """Retry outages and lock time-outs with back-off (noting progress: waiting one out is
        not hanging)."""
        return tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retry.is_transient),
            wait=retry.reconnect_wait(maximum=self._options.reconnect_max_delay),
            stop=stop,
            sleep=sleep,
            before_sleep=self._outage,
            reraise=True,
        )

    async def run_once(self) -> model.CycleReport:
        """One cycle: publish a batch of due rows (expired leases first) and settle it.
        Raises errors.TransientError if a service is down before anything was claimed (giving
        back the batch claimed ahead first: another replica may have a broker); once rows are
        claimed, it settles them before returning."""
        try:
            await self._publisher.connect()  # never lease rows we could not publish
        except errors.TransientError:
            await self.drop_prefetched()
            raise
        if self._publisher.blocked:
            await self.drop_prefetched()
            return model.CycleReport(blocked=True)
        report = await self._work(*await self._claim())
        if self._on_cycle is not None:
            self._on_cycle(report)
        return report

    async def _claim(self) -> tuple[model.Claim, float]:
        """The batch claimed ahead during the last cycle, else a fresh claim."""
        prefetched = self.leases.take_ahead()
        if prefetched is not None:
            try:
                return await prefetched
            except errors.TransientError as exc:
                log.debug("claiming ahead failed (%s); claiming now", exc)
        return await self._claim_now()

    async def _claim_now(self) -> tuple[model.Claim, float]:
        sent = self._clock()
        claim = await self._store.claim(self._ask)
        self.leases.hold(claim, sent)
        return claim, self._clock() - sent

    async def drop_prefetched(self) -> None:
        """Give back a batch claimed ahead that no cycle will publish (stopping, blocked, or no
        broker to publish it to): due at once, for any replica, its attempt refunded."""
        prefetched = self.leases.take_ahead()
        if prefetched is None:
            return
        try:
            claim, _ = await prefetched
        except errors.TransientError:
            return  # nothing was claimed
        if claim.messages:
            try:
                await self._settled(claim.claim_id, release(claim.messages, "released unsent"))
            finally:
                self.leases.drop(claim.claim_id)

    async def run_until_empty(self, stop: asyncio.Event | None = None) -> model.CycleReport:
        """Cycle until a cycle finds nothing to do, or until `stop` is set (then as `run` stops:
        nothing more is claimed, and the batch in flight gets `shutdown_grace` for its confirms);
        return the sum of the cycles' counts (their measurements went to `on_cycle`)."""
        stop = stop or asyncio.Event()
        total = model.CycleReport()
        grace = asyncio.create_task(self._abort_after_grace(stop))
        async with self._keeping():
            try:
                while not stop.is_set():
                    report = await self.run_once()
                    total = total.combine(report.counts())
                    if not (
                        report.claimed
                        or report.buried
                        or report.cut_short
                        or report.settled.released
                    ):
                        break
                return total
            finally:
                await waiting.finish(grace)
                await self.drop_prefetched()

    async def run(self, stop: asyncio.Event) -> None:
        """Cycle until `stop` is set: back-to-back while batches come back full (which sweeps any
        backlog at start-up), otherwise asleep until the waker says (a NOTIFY, the doorbell, the
        poll interval); while the broker blocks publishing, waiting for it to unblock. Once `stop`
        is set, nothing more is claimed and the batch in flight gets `shutdown_grace` seconds for
        its confirms before what is unconfirmed is given back. Outages are retried with back-off;
        other errors propagate."""
        grace = asyncio.create_task(self._abort_after_grace(stop))
        async with self._keeping():
            try:
                while not stop.is_set():
                    self.tick()
                    self.waker.looking(self.leases.claimed_ahead)
                    report = await self._cycle(stop)
                    # Straight on while the next batch is already claimed, while batches come
                    # back full (in rows or bytes), or when settles freed keyed rows.
                    if (
                        report is None
                        or self.leases.claimed_ahead
                        or report.cut_short
                        or report.settled.released
                    ):
                        self.waker.busy()
                        continue
                    if report.blocked:
                        await self._wait_unblocked(stop)
                        continue
                    await self.waker.sleep(stop)
            finally:
                self.waker.busy()
                await waiting.finish(grace)
                await self.drop_prefetched()

    @contextlib.asynccontextmanager
    async def _keeping(self) -> AsyncIterator[None]:
        """The lease keeper's heartbeat, for as long as the relay runs."""
        beating = asyncio.create_task(self.heartbeat.run(), name="outbox-leases")
        try:
            yield
        finally:
            await waiting.finish(beating)

    async def _abort_after_grace(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._stopping.set()
        await asyncio.sleep(self._options.shutdown_grace)
        log.warning(
            "no confirms after %gs of grace: giving unconfirmed rows back",
            self._options.shutdown_grace,
        )
        self._abort.set()

    async def _wait_unblocked(self, stop: asyncio.Event) -> None:
        log.warning(
            "RabbitMQ is blocking publishes (a memory or disk alarm): "
            "claiming nothing until it lifts"
        )
        while self._publisher.blocked and not stop.is_set():
            self.tick()
            await waiting.any_of(
                (self._publisher.until_unblocked(), stop.wait()), self._options.poll_interval
            )
        if not stop.is_set():
            log.info("RabbitMQ accepts publishes again")

    async def _cycle(self, stop: asyncio.Event) -> model.CycleReport | None:
        async for attempt in self._retrying(lambda seconds: waiting.any_event((stop,), seconds)):
            with attempt:
                if stop.is_set():
                    return None
                return await self.run_once()
        return None  # pragma: no cover  # tenacity either returns or re-raises

    async def _work(self, claim: model.Claim, claim_seconds: float) -> model.CycleReport:
        """Publish one claim's rows and settle them, claiming the next batch with the settle."""
        buried = _buried(claim)
        if not claim.messages:  # nothing to send; but more may wait past what it buried
            empty = model.CycleReport(claim_seconds=(claim_seconds,), cut_short=claim.cut_short)
            return buried.combine(empty)
        batch = list(claim.messages)
        to_send: list[model.OutboxMessage] = []
        results: list[model.PublishResult] = []
        try:
            if self._stopping.is_set():
                settlement = release(batch, "released unsent: the relay was stopping")
            else:
                to_send, results, settlement = await self._publish(claim, batch)
            counts = await self._settle(claim.claim_id, settlement)
        finally:
            self.leases.drop(claim.claim_id)
        policy.log_transitions(batch, settlement, counts)
        report = policy.report(claim, claim_seconds, to_send, results, settlement, counts)
        return buried.combine(report)

    async def _publish(
        self, claim: model.Claim, batch: list[model.OutboxMessage]
    ) -> tuple[list[model.OutboxMessage], list[model.PublishResult], model.Settlement]:
        """Publish what the claim still holds of `batch` (renewing its lease first if little of
        it is left) and plan the settle; claim the next batch meanwhile if this one is full."""
        try:
            held = await self.leases.confirm(claim.claim_id)
        except errors.TransientError as exc:
            log.warning("could not confirm a lease before publishing (%s): giving it back", exc)
            return [], [], release(batch, f"not sent: {exc}")
        mine = [m for m in batch if m.id in held]
        if len(mine) < len(batch):
            log.warning(
                "%d of %d rows claimed passed to another relay before they were sent; "
                "not sending them",
                len(batch) - len(mine),
                len(batch),
            )
        to_send = mine
        full = len(batch) >= self._options.batch_size or claim.cut_short
        if self._options.prefetch and full and not claim.alone and not self.leases.claimed_ahead:
            self.leases.keep_ahead(asyncio.ensure_future(self._claim_now()))
        results: list[model.PublishResult] = []
        if to_send:
            sending = frozenset(m.id for m in to_send)
            results = await self._publisher.publish(
                to_send, self._abort, lambda: self.leases.valid(claim.claim_id, sending)
            )
        settlement = plan(to_send, results, self._options, stopping=self._stopping.is_set())
        return to_send, results, settlement

    async def _settle(self, claim_id: UUID, settlement: model.Settlement) -> model.SettleCounts:
        """Settle the batch, claiming the next one in the same round trip (docs/decisions/0005)
        — unless a batch is claimed ahead already, or something went wrong with this one (it
        gives rows back: then another replica may do better), or the relay is stopping."""
        chain = (
            self._options.prefetch
            and not settlement.retry
            and not self._stopping.is_set()
            and not self.leases.claimed_ahead
            and not self._publisher.blocked
        )
        sent = self._clock()
        counts, following = await self._settled(claim_id, settlement, self._ask if chain else None)
        if following.messages or following.buried:
            self.leases.hold(following, sent)
            self.leases.keep_ahead(waiting.ready((following, self._clock() - sent)))
        return counts

    async def _settled(
        self, claim_id: UUID, settlement: model.Settlement, then: model.Ask | None = None
    ) -> tuple[model.SettleCounts, model.Claim]:
        """Settle; with `then`, claim the next rows in the same round trip. The broker has spoken:
        forgetting what it said would re-send the batch after the lease. So a settle is retried
        through outages for as long as it takes (shutdown's timeout is the outer bound), and
        through lock time-outs for as long as the claim is trusted: after that, another relay
        may hold its rows, and they are published again, as after a crash."""

        def given_up(state: tenacity.RetryCallState) -> bool:
            exc = state.outcome.exception() if state.outcome else None
            return isinstance(exc, errors.LockTimeout) and not self.leases.trusted(claim_id)

        async for attempt in self._retrying(self._sleep, given_up):
            with attempt:
                return await self._store.settle(claim_id, settlement, then)
        raise AssertionError("unreachable")  # pragma: no cover


def _buried(claim: model.Claim) -> model.CycleReport:
    """What the claim moved to dead unread (its relays kept dying on it)."""
    policy.log_buried(claim.buried)
    if not claim.buried:
        return model.CycleReport()
    return model.CycleReport(
        buried=len(claim.buried), dead={model.DeadReason.MAX_ATTEMPTS: len(claim.buried)}
    )


def _log_outage(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    log.warning("%s; retrying in %.1fs (attempt %d)", exc, wait, state.attempt_number)
