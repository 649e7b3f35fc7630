"""Each cycle report lands in the counters, one per outcome class."""

from __future__ import annotations

from relay.core import model
from relay.ops import metrics


def test_a_report_is_counted_by_class() -> None:
    counters = metrics.Metrics()
    counters.record(
        model.CycleReport(
            claimed=5,
            outcomes={
                model.Outcome.ACKED: 3,
                model.Outcome.AMBIGUOUS: 1,
                model.Outcome.REJECTED: 1,
            },
            dead={model.DeadReason.TOO_LARGE: 1, model.DeadReason.MAX_ATTEMPTS: 2},
            settled=model.SettleCounts(archived=3, dead=1, retried=1, fenced=1),
            buried=2,
        )
    )
    counters.record(model.CycleReport(blocked=True))
    value = counters.registry.get_sample_value
    assert value("outbox_claimed_total") == 5
    assert value("outbox_publish_outcomes_total", {"outcome": "acked"}) == 3
    assert value("outbox_publish_outcomes_total", {"outcome": "ambiguous"}) == 1
    assert value("outbox_publish_outcomes_total", {"outcome": "nacked"}) == 0
    assert value("outbox_dead_lettered_total", {"reason": "too_large"}) == 1
    assert value("outbox_dead_lettered_total", {"reason": "max_attempts"}) == 2
    assert value("outbox_published_total") == 3
    assert value("outbox_fenced_settles_total") == 1
    assert value("outbox_buried_total") == 2
    assert value("outbox_blocked_cycles_total") == 1


def test_each_relay_has_its_own_registry() -> None:
    first, second = metrics.Metrics(), metrics.Metrics()
    first.record(model.CycleReport(claimed=1))
    assert second.registry.get_sample_value("outbox_claimed_total") == 0
