"""What a cycle's outcomes become: the loop's options, each published message's row transition
(`plan`, the one place the policy lives), the cycle's report, and its log lines. Pure but for
the logging."""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Sequence

from relay.core import logs, model, retry

log = logging.getLogger("relay.loop")  # the loop's: the lines a cycle writes, as they always were

Outcome = model.Outcome


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
    """The knobs the loop reads (built from config.Settings by the composition root)."""

    batch_size: int = 500
    lease: float = 10.0
    poll_interval: float = 1.0
    max_attempts: int = 10
    max_ambiguous: int = 5
    retry_delay: float = 1.0
    retry_max_delay: float = 300.0
    reconnect_max_delay: float = retry.LONGEST_WAIT
    shutdown_grace: float = 30.0
    #: Claim the next batch while a full one is being published, so the database's work overlaps
    #: the broker's (the composition root turns it on; a cycle then leaves the next batch leased).
    prefetch: bool = False
    #: One liveness rule for every part /livez watches (the loop, the heartbeat, the watcher): a
    #: part is hung once it has not moved for this long. Longer than any wait one makes on purpose
    #: (a reconnect back-off, a confirm, a lease, a poll), twice over; 60 s at least. A hung
    #: heartbeat is safe meanwhile: its leases lapse and `valid` stops their publishing.
    confirm_timeout: float = 10.0

    @property
    def stalled_after(self) -> float:
        """How long a part of the relay may go without moving before /livez calls it hung."""
        waits = retry.LONGEST_WAIT + self.confirm_timeout + self.lease + self.poll_interval
        return max(60.0, 2 * waits)


def plan(
    published: Sequence[model.OutboxMessage],
    results: Sequence[model.PublishResult],
    options: Options,
    *,
    stopping: bool = False,
) -> model.Settlement:
    """Map each message's outcome to its row transition. Pure: the policy lives here, only here."""
    archive: list[int] = []
    dead: list[model.DeadLetter] = []
    retries: list[model.Retry] = []
    for message, result in zip(published, results, strict=True):
        match result.outcome:
            case Outcome.ACKED:
                archive.append(message.id)
            case Outcome.RETURNED:
                dead.append(_dead(message, model.DeadReason.UNROUTABLE, result))
            case Outcome.NO_EXCHANGE:
                dead.append(_dead(message, model.DeadReason.NO_EXCHANGE, result))
            case Outcome.INVALID:
                dead.append(_dead(message, model.DeadReason.INVALID, result))
            case Outcome.REJECTED:
                dead.append(_dead(message, result.reason or model.DeadReason.REJECTED, result))
            case Outcome.UNSENT:
                # Never written: give it back untried, at once, for whoever holds it now.
                retries.append(
                    model.Retry(message.id, 0.0, result.detail, refund=True, why="released")
                )
            case Outcome.AMBIGUOUS if message.ambiguous < options.max_ambiguous:
                # It may have arrived: send it again soon, without spending one of its attempts
                # (at once if this relay is stopping, so another replica takes it).
                delay = 0.0 if stopping else options.retry_delay
                retries.append(
                    model.Retry(
                        message.id,
                        delay,
                        result.detail,
                        refund=True,
                        ambiguous=True,
                        why="ambiguous",
                    )
                )
            case Outcome.NACKED | Outcome.AMBIGUOUS | Outcome.FAILED:
                if message.attempts >= options.max_attempts:
                    detail = f"attempt {message.attempts} {result.outcome.value}: {result.detail}"
                    dead.append(model.DeadLetter(message.id, model.DeadReason.MAX_ATTEMPTS, detail))
                else:
                    delay = retry.message_delay(
                        message.attempts, options.retry_delay, options.retry_max_delay
                    )
                    why = result.outcome.value  # nacked, ambiguous (past its cap) or failed
                    retries.append(model.Retry(message.id, delay, result.detail, why=why))
    resent = tuple(m.id for m, r in zip(published, results, strict=True) if r.resent)
    return model.Settlement(tuple(archive), tuple(dead), tuple(retries), resent)


def release(batch: Sequence[model.OutboxMessage], why: str) -> model.Settlement:
    """Give claimed rows back untried (attempt refunded), due at once for any replica."""
    return model.Settlement(
        retry=tuple(model.Retry(m.id, 0.0, why, refund=True, why="released") for m in batch)
    )


def _dead(
    message: model.OutboxMessage, reason: model.DeadReason, result: model.PublishResult
) -> model.DeadLetter:
    return model.DeadLetter(message.id, reason, result.detail)


def report(
    claim: model.Claim,
    claim_seconds: float,
    published: Sequence[model.OutboxMessage],
    results: Sequence[model.PublishResult],
    settlement: model.Settlement,
    counts: model.SettleCounts,
) -> model.CycleReport:
    """The cycle's counts and measurements, for the metrics and `run_until_empty`."""
    acked = [(m, r) for m, r in zip(published, results, strict=True) if r.outcome is Outcome.ACKED]
    return model.CycleReport(
        claimed=len(claim.messages),
        cut_short=claim.cut_short,
        outcomes=dict(collections.Counter(r.outcome for r in results)),
        dead=dict(collections.Counter(d.reason for d in settlement.dead)),
        settled=counts,
        retried=dict(collections.Counter(r.why for r in settlement.retry)),
        ambiguous=sum(r.ambiguous for r in settlement.retry) + len(settlement.resent),
        batch_sizes=(len(claim.messages),),
        claim_seconds=(claim_seconds,),
        publish_seconds=tuple(r.seconds for _, r in acked if r.seconds is not None),
        commit_seconds=tuple(
            max(0.0, r.confirmed_at - m.created_at.timestamp())
            for m, r in acked
            if r.confirmed_at is not None
        ),
    )


def log_transitions(
    batch: Sequence[model.OutboxMessage], settlement: model.Settlement, counts: model.SettleCounts
) -> None:
    """Each dead letter is an event of its own; retries are summed up per batch (per message at
    DEBUG), so an outage that re-sends a whole batch writes one line, not five hundred."""
    by_id = {m.id: m for m in batch}
    for dead in settlement.dead:
        message = by_id[dead.id]
        _dead_lettered(
            message.message_id,
            message.attempts,
            dead.reason.value,
            dead.detail,
            message.ordering_key,
        )
    if counts.fenced:
        log.warning(
            "%d rows had been re-claimed by another relay: their settle was skipped", counts.fenced
        )
    if not settlement.retry:
        return
    refunded = sum(r.refund for r in settlement.retry)
    log.info(
        "retrying %d of %d messages (%d not counted as attempts): %s",
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


def log_buried(buried: Sequence[tuple[object, int]]) -> None:
    """Each orphan buried unread (its relays kept dying) is a dead letter of its own."""
    for message_id, attempts in buried:
        _dead_lettered(message_id, attempts, "max_attempts", "attempts used up (moved unread)")


def _dead_lettered(
    message_id: object, attempt: int, reason: str, detail: str, key: str | None = None
) -> None:
    log.warning(
        "dead-lettered message_id=%s attempt=%d reason=%s detail=%s",
        message_id,
        attempt,
        reason,
        detail,
        extra=logs.event(
            event="dead_lettered",
            message_id=message_id,
            attempt=attempt,
            reason=reason,
            detail=detail,
            ordering_key=key,
        ),
    )
