"""The relay's cycle: claim due rows, publish them with confirms, and settle each by its outcome."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from uuid import UUID

import tenacity

from relay.core import chores, errors, leases, model, policy, ports, retry, waiting
from relay.core.policy import Options, plan, release

__all__ = ["Options", "Relay", "plan", "release"]

log = logging.getLogger("relay.loop")  # the name log lines carry: as before the folders

Outcome = model.Outcome


class Relay:
    """One relay's loop. `run_once()` is a single cycle; `run()` cycles until told to stop.

    Everything it holds is in `leases` (a lease keeper), renewed every third of a lease while
    `run()` or `run_until_empty()` is going; tests that call `run_once()` directly renew by
    calling `leases.run_once()`. A claim is published only while its hold is trusted."""

    def __init__(
        self,
        store: ports.Store,
        publisher: ports.Publisher,
        options: Options = Options(),  # frozen, so sharing the default is safe
        *,
        chain_publishers: Sequence[ports.Publisher] = (),
        wake: asyncio.Event | None = None,
        recheck: asyncio.Event | None = None,
        doorbell: ports.Doorbell | None = None,
        on_cycle: Callable[[model.CycleReport], None] | None = None,
        on_chore_error: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._publisher = publisher
        #: One publisher per chain of a split keyed batch, the first being `publisher`
        #: (docs/decisions/0009); a single one: batches are never split.
        self._chain_publishers = (publisher, *chain_publishers)
        self._options = options
        self._clock = clock
        self.wake = wake or asyncio.Event()
        #: Set when a producer's commit queued a key recheck (a NOTIFY: a hint); rechecks also run
        #: with every look for orphans (the guarantee). Set at start: something may be queued.
        self.recheck = recheck or asyncio.Event()
        self.recheck.set()
        self._doorbell = doorbell
        self._looking_after: int | None = None  # the arm the current cycle's look began after
        self._on_cycle = on_cycle
        self._stopping = asyncio.Event()  # claim nothing more; give back what is not yet sent
        self._abort = asyncio.Event()  # the shutdown grace is over: stop waiting for confirms
        self._next_orphan_check = 0.0
        self._split_from = 0.0  # no keyed batch is split before this (a chain's broker failed)
        self.leases = leases.Keeper(store, options.lease, clock)
        #: The keeper's heartbeat, as a supervised chore (the composition root watches it).
        self.heartbeat = chores.Chore(
            "leases",
            self.leases.run_once,
            options.heartbeat,
            stall_after=options.lease * 3,
            on_error=on_chore_error,
        )
        #: For /livez: the loop is cycling, or waiting on purpose.
        self.last_progress = time.monotonic()

    def tick(self) -> None:
        """Note that the loop is alive: it cycled, or is deliberately waiting (for work, an outage
        to end, or the broker to unblock)."""
        self.last_progress = time.monotonic()

    def _outage(self, state: tenacity.RetryCallState) -> None:
        self.tick()  # waiting out an outage is not hanging
        _log_outage(state)

    def _retrying(self, sleep: Callable[[float], Awaitable[None]]) -> tenacity.AsyncRetrying:
        """Retry outages with back-off (noting progress: waiting one out is not hanging)."""
        return tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retry.is_transient),
            wait=retry.reconnect_wait(maximum=self._options.reconnect_max_delay),
            sleep=sleep,
            before_sleep=self._outage,
            reraise=True,
        )

    async def run_once(self) -> model.CycleReport:
        """One cycle: publish a batch of due rows, then (twice a lease) bury orphans that used up
        their attempts and take the others one at a time (a row that kills its relay must not
        take a batch with it), then, when told to (`recheck`) or twice a lease, release keyed
        rows a producer's commit left to the relays.
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
        if self._clock() >= self._next_orphan_check:
            report = report.combine(await self._orphans())
            self.recheck.set()
        if self.recheck.is_set():
            self.recheck.clear()
            released = await self._store.release_stranded()
            if released:
                freed = model.CycleReport(settled=model.SettleCounts(released=released))
                report = report.combine(freed)
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
        return await self._held(self._store.claim(self._options.batch_size, self._options.lease))

    async def _held(self, claiming: Awaitable[model.Claim]) -> tuple[model.Claim, float]:
        """Claim, and hand what was claimed to the keeper, trusted from before the request."""
        sent = self._clock()
        claim, seconds = await _timed(claiming)
        self.leases.hold(claim, sent)
        return claim, seconds

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
                await self._settle(claim.claim_id, release(claim.messages, "released unsent"))
            finally:
                self.leases.drop(claim.claim_id)

    async def _orphans(self) -> model.CycleReport:
        """Bury orphans that used up their attempts, then take the others one at a time. Orphans
        appear only when a lease runs out, so looking twice per lease is often enough."""
        self._next_orphan_check = self._clock() + self._options.lease / 2
        await self._store.release_orphans(self._options.lease)
        report = await self._bury()
        for _ in range(self._options.batch_size):
            if self._stopping.is_set() or self._publisher.blocked:
                break
            orphan, seconds = await self._held(
                self._store.claim_orphans(1, self._options.lease, self._options.max_attempts)
            )
            if not orphan.messages:
                break
            # Not chained: the next batch would wait, claimed, behind every orphan still to come
            # (and a row that kills its relay would take it down too).
            report = report.combine(await self._work(orphan, seconds, chain=False))
        return report

    async def run_until_empty(self, stop: asyncio.Event | None = None) -> model.CycleReport:
        """Cycle until a cycle finds nothing to do (no due rows, nothing to bury, no keyed row to
        release), or until `stop` is set (then as `run` stops: nothing more is claimed, and the
        batch in flight gets `shutdown_grace` for its confirms); return the sum of the cycles'
        counts (their measurements went to `on_cycle`)."""
        stop = stop or asyncio.Event()
        total = model.CycleReport()
        grace = asyncio.create_task(self._abort_after_grace(stop))
        async with self._keeping():
            try:
                while not stop.is_set():
                    report = await self.run_once()
                    total = total.combine(report.counts())
                    if not (report.claimed or report.buried or report.settled.released):
                        break
                return total
            finally:
                await waiting.finish(grace)
                await self.drop_prefetched()

    async def run(self, stop: asyncio.Event) -> None:
        """Cycle until `stop` is set: back-to-back while batches come back full (which sweeps any
        backlog at start-up), otherwise waiting for a NOTIFY (`wake`) or the poll interval (with
        the doorbell armed first, when there is one: `_sleep`); while
        the broker blocks publishing, waiting for it to unblock. Once `stop` is set, nothing more is
        claimed and the batch in flight gets `shutdown_grace` seconds for its confirms before what
        is unconfirmed is given back. Outages are retried with back-off; other errors propagate."""
        grace = asyncio.create_task(self._abort_after_grace(stop))
        async with self._keeping():
            try:
                while not stop.is_set():
                    self.tick()
                    # A wake-up that came after the next batch was claimed (with the last settle)
                    # is for rows that claim did not see: keep it for after that batch.
                    if not self.leases.claimed_ahead:
                        self.wake.clear()
                    self._looking_after = self._held_since()
                    report = await self._cycle(stop)
                    # Straight on while the next batch is already claimed, while batches come
                    # back full (in rows, or in bytes: cut short), or when settles freed keyed
                    # rows.
                    if report is None or self.leases.claimed_ahead or report.cut_short:
                        self._disarm()
                        continue
                    if report.claimed >= self._options.batch_size or report.settled.released:
                        self._disarm()
                        continue
                    if report.blocked:
                        await self._wait_unblocked(stop)
                        continue
                    await self._sleep(stop)
            finally:
                self._disarm()
                await waiting.finish(grace)
                await self.drop_prefetched()

    def _disarm(self) -> None:
        """Working back to back: producers need not wake this relay (docs/decisions/0008)."""
        if self._doorbell is not None:
            self._doorbell.disarm()

    def _held_since(self) -> int | None:
        """Which arm of the doorbell this relay holds now (None: it holds none)."""
        bell = self._doorbell
        return bell.arms if bell is not None and bell.armed.is_set() else None

    async def _sleep(self, stop: asyncio.Event) -> None:
        """Wait for a NOTIFY (`wake`) or the poll interval. Producers notify only while a relay
        holds the doorbell, and one that did not notify committed before the doorbell was taken:
        so the relay sleeps only once a look that began after it took the doorbell found nothing.
        A relay that does not hold it yet arms it and ends this wait once it is held (or taken
        during the last look: it ends at once), and the next cycle looks once more; one whose
        doorbell went with its session looks again too."""
        bell = self._doorbell
        if bell is None:
            await waiting.any_event((self.wake, stop), self._options.poll_interval)
        elif not bell.armed.is_set():
            bell.arm()
            await waiting.any_event((self.wake, stop, bell.armed), self._options.poll_interval)
        elif self._looking_after == bell.arms:
            await waiting.any_event((self.wake, stop, bell.lost), self._options.poll_interval)

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

    async def _bury(self) -> model.CycleReport:
        buried = await self._store.bury_exhausted(self._options.max_attempts)
        policy.log_buried(buried)
        if not buried:
            return model.CycleReport()
        return model.CycleReport(
            buried=len(buried), dead={model.DeadReason.MAX_ATTEMPTS: len(buried)}
        )

    async def _work(
        self, claim: model.Claim, claim_seconds: float, *, chain: bool = True
    ) -> model.CycleReport:
        """Publish one claim's rows and settle them (claiming the next batch with the settle,
        when `chain`)."""
        if not claim.messages:
            return model.CycleReport(claim_seconds=(claim_seconds,))
        batch = sorted(claim.messages, key=lambda m: m.id)
        if chain and self._splits(claim):
            return await self._chains(claim, claim_seconds, batch)
        to_send: list[model.OutboxMessage] = []
        results: list[model.PublishResult] = []
        try:
            if self._stopping.is_set():
                settlement = release(batch, "released unsent: the relay was stopping")
            else:
                to_send, results, settlement = await self._publish(claim, batch, ahead=chain)
            counts = await self._settle(claim.claim_id, settlement, chain=chain)
        finally:
            self.leases.drop(claim.claim_id)
        policy.log_transitions(batch, settlement, counts)
        return policy.report(claim, claim_seconds, to_send, results, settlement, counts)

    def _splits(self, claim: model.Claim) -> bool:
        """Whether to publish a claim as several chains (docs/decisions/0009): only a batch the
        key gate kept short (keyed rows, fewer than the limit, not cut by its byte budget), big
        enough that each chain's part is worth a settle of its own."""
        chains = len(self._chain_publishers)
        if chains < 2 or claim.cut_short or len(claim.messages) >= self._options.batch_size:
            return False
        keyed = sum(1 for m in claim.messages if m.ordering_key is not None)
        if self._clock() < self._split_from:
            return False
        return keyed >= chains * self._options.min_chain and not self._stopping.is_set()

    async def _chains(
        self, claim: model.Claim, claim_seconds: float, batch: list[model.OutboxMessage]
    ) -> model.CycleReport:
        """Publish a keyed batch as parts, each on a publisher of its own, and settle each part
        as soon as its own confirms are in, claiming with that settle what it freed (its keys'
        next rows): each part goes on as a chain of its own, so one chain's settle overlaps the
        others' publishing. The key gate keeps the chains' keys apart, as it keeps two relays'
        apart. Chains stop claiming after half a lease (the cycle's chores are due), when the
        relay stops, the broker blocks, or a part goes wrong; the cycle ends when all have
        settled."""
        count = len(self._chain_publishers)
        until = self._clock() + self._options.lease / 2
        # A recheck a producer queues meanwhile waits for the cycle's end: end the chains soon.
        # (One already queued, at start-up say, waits for them: it can only be older than them.)
        heed = not self.recheck.is_set()

        def go_on(publisher: ports.Publisher) -> bool:
            rechecked = heed and self.recheck.is_set()
            return self._clock() < until and not publisher.blocked and not rechecked

        try:
            async with asyncio.TaskGroup() as group:
                running = [
                    group.create_task(self._chain(claim, batch[i::count], publisher, go_on))
                    for i, publisher in enumerate(self._chain_publishers)
                ]
        except* Exception as failed:
            # The other chains are cancelled (their rows keep their leases, as after a crash);
            # the cycle fails as an unsplit one would, with the error itself (an outage stays
            # an outage for the retries around the cycle).
            raise failed.exceptions[0] from None
        report = model.CycleReport(
            claimed=len(batch), batch_sizes=(len(batch),), claim_seconds=(claim_seconds,)
        )
        for task in running:
            report = report.combine(task.result())
        return report

    async def _chain(
        self,
        claim: model.Claim,
        part: list[model.OutboxMessage],
        publisher: ports.Publisher,
        go_on: Callable[[ports.Publisher], bool],
    ) -> model.CycleReport:
        """One chain: publish `part` of `claim`, settle it (claiming the next rows with it while
        the chain goes on), and the same with what that claimed, until nothing comes back. Its
        report counts what it claimed after the first part (the first is the cycle's)."""
        report = model.CycleReport()
        first, seconds = True, 0.0
        while part:
            self.tick()
            ids = frozenset(m.id for m in part)
            to_send: list[model.OutboxMessage] = []
            results: list[model.PublishResult] = []
            try:
                if self._stopping.is_set():
                    settlement = release(part, "released unsent: the relay was stopping")
                else:
                    to_send, results, settlement = await self._publish_part(claim, part, publisher)
                if any(r.outcome is Outcome.AMBIGUOUS for r in results):
                    await self._forget_late_copies(publisher)
                counts, following, claimed_in = await self._settled(
                    claim.claim_id,
                    settlement,
                    claim=self._may_chain(settlement) and go_on(publisher),
                )
            finally:
                self.leases.drop(claim.claim_id, ids)
            policy.log_transitions(part, settlement, counts)
            step = policy.report(
                model.Claim(claim.claim_id, tuple(part)),
                seconds,
                to_send,
                results,
                settlement,
                counts,
            )
            if first:  # the cycle's report counts the claim that started it
                step = dataclasses.replace(step, claimed=0, batch_sizes=(), claim_seconds=())
            report = report.combine(step)
            first = False
            claim, part = following, sorted(following.messages, key=lambda m: m.id)
            seconds = claimed_in
        return report

    async def _publish_part(
        self, claim: model.Claim, part: list[model.OutboxMessage], publisher: ports.Publisher
    ) -> tuple[list[model.OutboxMessage], list[model.PublishResult], model.Settlement]:
        """A chain's publish: its own publisher, connected first (a broker that cannot be
        reached or blocks gives the part back unsent)."""
        try:
            await publisher.connect()
        except errors.TransientError as exc:
            return [], [], self._chain_failed(part, f"not sent: {exc}")
        if publisher.blocked:
            return [], [], self._chain_failed(part, "not sent: the broker is blocking publishes")
        return await self._publish(claim, part, ahead=False, publisher=publisher)

    def _chain_failed(self, part: list[model.OutboxMessage], why: str) -> model.Settlement:
        """A chain's publisher cannot publish: give its part back (due at once: the other
        chain's next claim takes it), and split no batch for a lease."""
        log.warning(
            "a keyed chain's publisher cannot publish (%s): giving back %d rows, and not "
            "splitting keyed batches for %gs",
            why,
            len(part),
            self._options.lease,
        )
        self._split_from = self._clock() + self._options.lease
        return release(part, why)

    async def _forget_late_copies(self, publisher: ports.Publisher) -> None:
        """A part's confirm did not come: close its publisher's connection (the broker answers
        the close only after every frame before it) before the settle makes the rows due again,
        so that a late copy cannot reach the broker after a copy sent again on another chain's
        connection, nor after its key's next message. Within one connection that order holds
        by itself; across connections only a link that stalls past the close can break it (the
        README's "a stalled link that delivers late")."""
        await publisher.close()

    async def _publish(
        self,
        claim: model.Claim,
        batch: list[model.OutboxMessage],
        *,
        ahead: bool,
        publisher: ports.Publisher | None = None,
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
        exhausted = [m for m in mine if m.attempts > self._options.max_attempts]
        to_send = [m for m in mine if m.attempts <= self._options.max_attempts]
        # Only the main path claims ahead, and one batch at a time: an orphan taken in the same
        # cycle (a full batch of one) must not claim a second batch over the first.
        full = len(batch) >= self._options.batch_size or claim.cut_short
        if ahead and self._options.prefetch and full and not self.leases.claimed_ahead:
            self.leases.keep_ahead(asyncio.ensure_future(self._claim_now()))
        results: list[model.PublishResult] = []
        if to_send:
            sending = frozenset(m.id for m in to_send)
            results = await (publisher or self._publisher).publish(
                to_send, self._abort, lambda: self.leases.valid(claim.claim_id, sending)
            )
        settlement = plan(
            to_send, results, exhausted, self._options, stopping=self._stopping.is_set()
        )
        return to_send, results, settlement

    async def _settle(
        self, claim_id: UUID, settlement: model.Settlement, *, chain: bool = False
    ) -> model.SettleCounts:
        """Settle the batch; when `chain`, claim the next one in the same round trip
        (docs/decisions/0005) — unless a batch is claimed ahead already, or something went wrong
        with this one (it gives rows back: then another replica may do better), or the relay is
        stopping."""
        chain = (
            chain
            and self._may_chain(settlement)
            and not self.leases.claimed_ahead
            and not self._publisher.blocked
        )
        counts, following, seconds = await self._settled(claim_id, settlement, claim=chain)
        if following.messages:
            self.leases.keep_ahead(waiting.ready((following, seconds)))
        return counts

    def _may_chain(self, settlement: model.Settlement) -> bool:
        """Whether a settle may claim the next rows too: not when something went wrong with this
        batch (it gives rows back: then another replica may do better), nor when stopping."""
        return self._options.prefetch and not settlement.retry and not self._stopping.is_set()

    async def _settled(
        self, claim_id: UUID, settlement: model.Settlement, *, claim: bool
    ) -> tuple[model.SettleCounts, model.Claim, float]:
        """Settle; with `claim`, claim the next rows in the same round trip (held from the moment
        the request was sent), and say how long that took. The broker has spoken; forgetting
        what it said would re-send the batch after the lease. So a settle is retried for as long
        as it takes (shutdown's timeout is the outer bound)."""
        async for attempt in self._retrying(asyncio.sleep):
            with attempt:
                if not claim:
                    counts = await self._store.settle(claim_id, settlement)
                    return counts, model.Claim(claim_id, ()), 0.0
                sent = self._clock()
                counts, following = await self._store.settle_then_claim(
                    claim_id, settlement, self._options.batch_size, self._options.lease
                )
                self.leases.hold(following, sent)
                return counts, following, self._clock() - sent
        raise AssertionError("unreachable")  # pragma: no cover


async def _timed(claiming: Awaitable[model.Claim]) -> tuple[model.Claim, float]:
    started = time.perf_counter()
    claim = await claiming
    return claim, time.perf_counter() - started


def _log_outage(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    log.warning("%s; retrying in %.1fs (attempt %d)", exc, wait, state.attempt_number)
