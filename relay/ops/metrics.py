"""The relay's Prometheus metrics, on a registry of its own (never the process-global one)."""

from __future__ import annotations

import functools

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
)

from relay.core import model

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    300,
)
_BATCH_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000)
#: Retries by why the message is tried again.
RETRY_CLASSES = ("nacked", "ambiguous", "failed", "released")
#: The background chores a relay runs (chores.Chore names).
CHORES = ("watcher", "pruner", "listener", "doorbell", "leases", "keys")


class Metrics:
    """Everything the relay exports. Counters and histograms are fed by each cycle's report;
    backlog and database gauges by the watcher's periodic query (never per scrape)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        # The process's own: memory (process_resident_memory_bytes, to set against a container's
        # limit), CPU seconds, open file descriptors; the Python version; garbage collections.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.info = Info("outbox_relay", "This relay: version, name and schema.", registry=r)
        # What the loop did.
        self.claimed = Counter(
            "outbox_claimed", "Rows claimed (each claim counts one attempt).", registry=r
        )
        self.outcomes = Counter(
            "outbox_publish_outcomes", "Publish outcomes, by class.", ["outcome"], registry=r
        )
        self.published = Counter(
            "outbox_published", "Messages confirmed by the broker and archived.", registry=r
        )
        self.dead = Counter(
            "outbox_dead_lettered", "Messages moved to dead, by reason.", ["reason"], registry=r
        )
        self.retried = Counter(
            "outbox_retried", "Messages put back for another try, by why.", ["outcome"], registry=r
        )
        self.ambiguous = Counter(
            "outbox_ambiguous_resends",
            "Sends whose outcome was unknown (lost connection, confirm timeout, channel error): "
            "the message is sent again and may arrive twice.",
            registry=r,
        )
        self.fenced = Counter(
            "outbox_fenced_settles",
            "Settles skipped because another relay re-claimed the row after its lease ended.",
            registry=r,
        )
        self.buried = Counter(
            "outbox_buried",
            "Orphans moved to dead unread after their relays kept dying on them.",
            registry=r,
        )
        self.blocked_cycles = Counter(
            "outbox_blocked_cycles",
            "Cycles that claimed nothing because RabbitMQ was blocking publishes (an alarm).",
            registry=r,
        )
        self.keys_blocked = Counter(
            "outbox_keys_blocked", "Ordering keys blocked by a dead-lettered message.", registry=r
        )
        latency = functools.partial(Histogram, buckets=_LATENCY_BUCKETS, registry=r)  # in seconds
        self.publish_seconds = latency(
            "outbox_publish_confirm_seconds", "From a message's publish to its broker confirm."
        )
        self.commit_seconds = latency(
            "outbox_commit_confirm_seconds",
            "From enqueue (the database's clock) to the broker's confirm (the relay's clock).",
        )
        self.batch_size = Histogram(
            "outbox_batch_size",
            "Rows per claim that found any.",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.claim_seconds = latency(
            "outbox_claim_seconds",
            "Latency of the claim call (for a claim made with a settle, of the whole call).",
        )
        # The background chores.
        self.chore_errors = Counter(
            "outbox_chore_errors",
            "Runs of a background chore (watcher, pruner, listener, doorbell, leases, rescue) "
            "that failed with an error that is no outage; each is logged at ERROR with its "
            "traceback, and the chore runs again after a back-off.",
            ["chore"],
            registry=r,
        )
        self.lock_retries = Counter(
            "outbox_lock_retries",
            "Cycles retried because a statement waited for a lock past OUTBOX_LOCK_TIMEOUT "
            "(55P03) or PostgreSQL broke a deadlock (40P01): not outages.",
            registry=r,
        )
        self.rescued = Counter(
            "outbox_rescues",
            "Times the rescue found rows behind the claims' cursors (a commit long after its "
            "insert, a claim that rolled back) and moved a cursor back to them.",
            registry=r,
        )
        # What the archive pruner did.
        self.pruned = Counter(
            "outbox_archive_pruned", "Archived rows deleted by retention.", registry=r
        )
        self.prune_runs = Counter(
            "outbox_archive_prune_runs",
            "Scheduled prune runs, by result: done, skipped (another replica was pruning), failed.",
            ["result"],
            registry=r,
        )
        # What the watcher observes.
        self.messages = Gauge(
            "outbox_messages",
            "Rows in the outbox by state: due, scheduled, gated (behind an earlier message of "
            "their key), in_flight (leased). Counts stop at one million.",
            ["state"],
            registry=r,
        )
        self.oldest_due = Gauge(
            "outbox_oldest_due_seconds",
            "How long the longest-waiting due message has been due.",
            registry=r,
        )
        self.dead_rows = Gauge(
            "outbox_dead_messages", "Rows in dead (stops at one million).", registry=r
        )
        self.blocked_keys = Gauge(
            "outbox_blocked_keys",
            "Ordering keys held because one of their messages was dead-lettered (policy 'block').",
            registry=r,
        )
        self.dead_tuples = Gauge(
            "outbox_db_dead_tuples",
            "Dead tuples in the messages table (vacuum's backlog).",
            registry=r,
        )
        self.last_autovacuum = Gauge(
            "outbox_db_last_autovacuum_timestamp_seconds",
            "When autovacuum last finished on the messages table (0: never).",
            registry=r,
        )
        self.autovacuum_on = Gauge(
            "outbox_db_autovacuum_enabled",
            "1 if autovacuum is on for the server and the messages table; 0 if it is off.",
            registry=r,
        )
        self.xmin_age = Gauge(
            "outbox_db_oldest_xmin_seconds",
            "Age of the oldest transaction holding back PostgreSQL's vacuum horizon.",
            registry=r,
        )
        self.xmin_xids = Gauge(
            "outbox_db_oldest_xmin_xids",
            "How many transaction ids the vacuum horizon is held back by.",
            registry=r,
        )
        self.observed_at = Gauge(
            "outbox_observed_timestamp_seconds",
            "When the backlog and database gauges were last refreshed.",
            registry=r,
        )
        # The relay's own state.
        self.broker_connected = Gauge(
            "outbox_broker_connected",
            "1 while the relay holds an open broker connection.",
            registry=r,
        )
        self.broker_blocked = Gauge(
            "outbox_broker_blocked",
            "1 while RabbitMQ blocks this relay's publishes (an alarm).",
            registry=r,
        )
        self.last_cycle = Gauge(
            "outbox_last_cycle_timestamp_seconds",
            "When the relay loop last made progress.",
            registry=r,
        )
        for outcome in model.Outcome:
            self.outcomes.labels(outcome.value)
        for reason in model.DeadReason:
            self.dead.labels(reason.value)
        for why in RETRY_CLASSES:
            self.retried.labels(why)
        for result in ("done", "skipped", "failed"):
            self.prune_runs.labels(result)
        for chore in CHORES:
            self.chore_errors.labels(chore)

    def chore_failed(self, chore: str) -> None:
        """Count a failed run of a background chore (chores.Chore's on_error)."""
        self.chore_errors.labels(chore).inc()

    def record(self, report: model.CycleReport) -> None:
        """Count what one cycle did."""
        self.claimed.inc(report.claimed)
        for outcome, n in report.outcomes.items():
            self.outcomes.labels(outcome.value).inc(n)
        for reason, n in report.dead.items():
            self.dead.labels(reason.value).inc(n)
        for why, n in report.retried.items():
            self.retried.labels(why).inc(n)
        self.published.inc(report.settled.archived)
        self.ambiguous.inc(report.ambiguous)
        self.fenced.inc(report.settled.fenced)
        self.buried.inc(report.buried)
        self.keys_blocked.inc(report.settled.blocked)
        if report.blocked:
            self.blocked_cycles.inc()
        for n in report.batch_sizes:
            self.batch_size.observe(n)
        for seconds in report.claim_seconds:
            self.claim_seconds.observe(seconds)
        for seconds in report.publish_seconds:
            self.publish_seconds.observe(seconds)
        for seconds in report.commit_seconds:
            self.commit_seconds.observe(seconds)

    def observe(self, seen: model.Observation) -> None:
        """Set the gauges from one observation of the outbox and the database."""
        for state, n in (
            ("due", seen.due),
            ("scheduled", seen.scheduled),
            ("gated", seen.gated),
            ("in_flight", seen.in_flight),
        ):
            self.messages.labels(state).set(n)
        self.oldest_due.set(seen.oldest_due_seconds or 0.0)
        self.dead_rows.set(seen.dead)
        self.blocked_keys.set(seen.blocked_keys)
        self.dead_tuples.set(seen.dead_tuples)
        self.last_autovacuum.set(seen.last_autovacuum or 0.0)
        self.autovacuum_on.set(1 if seen.autovacuum_on else 0)
        self.xmin_age.set(seen.xmin_seconds or 0.0)
        self.xmin_xids.set(seen.xmin_xids or 0)
        self.observed_at.set_to_current_time()
