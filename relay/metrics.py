"""The relay's Prometheus metrics, on a registry of its own (never the process-global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from relay import model


class Metrics:
    """Counters fed by each cycle's report. Serving them over HTTP is the probes module's job."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.claimed = Counter(
            "outbox_claimed",
            "Rows claimed (each claim counts one attempt).",
            registry=self.registry,
        )
        self.outcomes = Counter(
            "outbox_publish_outcomes",
            "Publish outcomes by class.",
            ["outcome"],
            registry=self.registry,
        )
        self.published = Counter(
            "outbox_published",
            "Messages confirmed by the broker and archived.",
            registry=self.registry,
        )
        self.dead = Counter(
            "outbox_dead_lettered",
            "Messages moved to dead, by reason.",
            ["reason"],
            registry=self.registry,
        )
        self.retried = Counter(
            "outbox_retried", "Messages put back for a later attempt.", registry=self.registry
        )
        self.fenced = Counter(
            "outbox_fenced_settles",
            "Settles skipped because another relay re-claimed the row after its lease ended.",
            registry=self.registry,
        )
        self.blocked = Counter(
            "outbox_blocked_cycles",
            "Cycles that claimed nothing because RabbitMQ was blocking publishes (an alarm).",
            registry=self.registry,
        )
        self.buried = Counter(
            "outbox_buried",
            "Orphans moved to dead unread after their relays kept dying on them.",
            registry=self.registry,
        )
        self.blocked_keys = Gauge(
            "outbox_blocked_keys",
            "Ordering keys held because one of their messages was dead-lettered (policy 'block').",
            registry=self.registry,
        )
        for outcome in model.Outcome:
            self.outcomes.labels(outcome.value)
        for reason in model.DeadReason:
            self.dead.labels(reason.value)

    def record(self, report: model.CycleReport) -> None:
        """Count what one cycle did."""
        self.claimed.inc(report.claimed)
        for outcome, n in report.outcomes.items():
            self.outcomes.labels(outcome.value).inc(n)
        for reason, n in report.dead.items():
            self.dead.labels(reason.value).inc(n)
        self.published.inc(report.settled.archived)
        self.retried.inc(report.settled.retried)
        self.fenced.inc(report.settled.fenced)
        self.buried.inc(report.buried)
        if report.blocked:
            self.blocked.inc()
