"""The relay's cycle: claim due rows, publish them with confirms, and settle each by its outcome."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from uuid import UUID

import tenacity

from relay import model, ports, retry

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """The knobs the loop reads (built from config.Settings by the composition root)."""

    batch_size: int = 500
    lease: float = 30.0
    poll_interval: float = 1.0
    max_attempts: int = 10
    max_ambiguous: int = 5
    retry_delay: float = 1.0
    retry_max_delay: float = 300.0
    reconnect_max_delay: float = 30.0


def plan(
    published: Sequence[model.OutboxMessage],
    results: Sequence[model.PublishResult],
    exhausted: Sequence[model.OutboxMessage],
    options: Options,
) -> model.Settlement:
    """Map each message's outcome to its row transition. Pure: the policy lives here, only here."""
    archive: list[int] = []
    dead = [_exhausted(m) for m in exhausted]
    retries: list[model.Retry] = []
    for message, result in zip(published, results, strict=True):
        match result.outcome:
            case model.Outcome.ACKED:
                archive.append(message.id)
            case model.Outcome.RETURNED:
                dead.append(
                    model.DeadLetter(message.id, model.DeadReason.UNROUTABLE, result.detail)
                )
            case model.Outcome.NO_EXCHANGE:
                dead.append(
                    model.DeadLetter(message.id, model.DeadReason.NO_EXCHANGE, result.detail)
                )
            case model.Outcome.INVALID:
                dead.append(model.DeadLetter(message.id, model.DeadReason.INVALID, result.detail))
            case model.Outcome.AMBIGUOUS if message.ambiguous < options.max_ambiguous:
                # It may have arrived: send it again soon, without spending one of its attempts.
                retries.append(
                    model.Retry(message.id, options.retry_delay, result.detail, refund=True)
                )
            case model.Outcome.NACKED | model.Outcome.AMBIGUOUS | model.Outcome.FAILED:
                if message.attempts >= options.max_attempts:
                    detail = f"attempt {message.attempts} {result.outcome.value}: {result.detail}"
                    dead.append(model.DeadLetter(message.id, model.DeadReason.MAX_ATTEMPTS, detail))
                else:
                    delay = retry.message_delay(
                        message.attempts, options.retry_delay, options.retry_max_delay
                    )
                    retries.append(model.Retry(message.id, delay, result.detail))
    return model.Settlement(tuple(archive), tuple(dead), tuple(retries))


def _exhausted(message: model.OutboxMessage) -> model.DeadLetter:
    cause = message.last_error or "no error was recorded: the relay holding it may have died"
    detail = f"claimed {message.attempts} times; last error: {cause}"
    return model.DeadLetter(message.id, model.DeadReason.MAX_ATTEMPTS, detail)


class Relay:
    """One relay's loop. `run_once()` is a single cycle; `run()` cycles until told to stop."""

    def __init__(
        self,
        store: ports.Store,
        publisher: ports.Publisher,
        options: Options = Options(),  # frozen, so sharing the default is safe
        *,
        wake: asyncio.Event | None = None,
        on_cycle: Callable[[model.CycleReport], None] | None = None,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._options = options
        self.wake = wake or asyncio.Event()
        self._on_cycle = on_cycle

    async def run_once(self) -> model.CycleReport:
        """Claim one batch, publish it, settle it. Raises errors.TransientError if a service is down
        before anything was claimed; once rows are claimed, it settles them before returning."""
        await self._publisher.connect()  # never lease rows we could not publish
        claim = await self._store.claim(self._options.batch_size, self._options.lease)
        if not claim.messages:
            return model.CycleReport()
        batch = sorted(claim.messages, key=lambda m: m.id)
        exhausted = [m for m in batch if m.attempts > self._options.max_attempts]
        to_send = [m for m in batch if m.attempts <= self._options.max_attempts]
        results = await self._publisher.publish(to_send) if to_send else []
        settlement = plan(to_send, results, exhausted, self._options)
        counts = await self._settle(claim.claim_id, settlement)
        report = _report(claim, results, settlement, counts)
        _log_transitions(batch, settlement)
        if self._on_cycle is not None:
            self._on_cycle(report)
        return report

    async def run_until_empty(self) -> model.CycleReport:
        """Cycle until a claim finds no due rows; return the sum of the cycles' reports."""
        total = model.CycleReport()
        while (report := await self.run_once()).claimed:
            total = total.combine(report)
        return total

    async def run(self, stop: asyncio.Event) -> None:
        """Cycle until `stop` is set: back-to-back while batches come back full (which sweeps any
        backlog at start-up), otherwise waiting for a NOTIFY (`wake`) or the poll interval.
        Outages are retried with back-off; any other error propagates."""
        while not stop.is_set():
            self.wake.clear()
            report = await self._cycle(stop)
            if report is None or report.claimed >= self._options.batch_size:
                continue
            await _wait_any((self.wake, stop), self._options.poll_interval)

    async def _cycle(self, stop: asyncio.Event) -> model.CycleReport | None:
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retry.is_transient),
            wait=retry.reconnect_wait(maximum=self._options.reconnect_max_delay),
            sleep=lambda seconds: _wait_any((stop,), seconds),
            before_sleep=_log_outage,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                if stop.is_set():
                    return None
                return await self.run_once()
        return None  # pragma: no cover  # tenacity either returns or re-raises

    async def _settle(self, claim_id: UUID, settlement: model.Settlement) -> model.SettleCounts:
        # The broker has spoken; forgetting what it said would re-send the batch after the lease.
        # So a settle is retried for as long as it takes (shutdown's timeout is the outer bound).
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retry.is_transient),
            wait=retry.reconnect_wait(maximum=self._options.reconnect_max_delay),
            before_sleep=_log_outage,
            reraise=True,
        )
        async for attempt in retrying:
            with attempt:
                return await self._store.settle(claim_id, settlement)
        raise AssertionError("unreachable")  # pragma: no cover


def _report(
    claim: model.Claim,
    results: Sequence[model.PublishResult],
    settlement: model.Settlement,
    counts: model.SettleCounts,
) -> model.CycleReport:
    return model.CycleReport(
        claimed=len(claim.messages),
        outcomes=dict(collections.Counter(r.outcome for r in results)),
        dead=dict(collections.Counter(d.reason for d in settlement.dead)),
        settled=counts,
    )


def _log_transitions(batch: Sequence[model.OutboxMessage], settlement: model.Settlement) -> None:
    """Each dead letter is an event of its own; retries are summed up per batch (per message at
    DEBUG), so an outage that re-sends a whole batch writes one line, not five hundred."""
    by_id = {m.id: m for m in batch}
    for dead in settlement.dead:
        message = by_id[dead.id]
        log.warning(
            "dead-lettered message_id=%s attempt=%d reason=%s detail=%s",
            message.message_id,
            message.attempts,
            dead.reason.value,
            dead.detail,
        )
    if not settlement.retry:
        return
    refunded = sum(r.refund for r in settlement.retry)
    log.info(
        "retrying %d of %d messages (%d with unknown outcome, attempt not counted): %s",
        len(settlement.retry),
        len(batch),
        refunded,
        settlement.retry[0].error,
    )
    for again in settlement.retry:
        message = by_id[again.id]
        log.debug(
            "retrying message_id=%s attempt=%d in=%.2fs refund=%s error=%s",
            message.message_id,
            message.attempts,
            again.delay,
            again.refund,
            again.error,
        )


def _log_outage(state: tenacity.RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome else None
    wait = state.next_action.sleep if state.next_action else 0.0
    log.warning("%s; retrying in %.1fs (attempt %d)", exc, wait, state.attempt_number)


async def _wait_any(events: Sequence[asyncio.Event], seconds: float) -> None:
    """Return when any event is set or after `seconds`, whichever is first."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*waiters, return_exceptions=True)
