"""Periodic observation of a running relay: the backlog and database-health gauges, the
vacuum-horizon warning, and the liveness and readiness the probes report."""

from __future__ import annotations

import dataclasses
import logging
import time

from relay.core import errors, logs, ports
from relay.ops import metrics

log = logging.getLogger("relay.watch")  # the name log lines carry: as before the folders


@dataclasses.dataclass
class Verdict:
    ok: bool
    detail: str  # one line per part; never a URL, so never a password


class Watcher:
    """Refreshes the gauges every `stats_interval`, warns when a transaction pins PostgreSQL's
    vacuum horizon longer than `xmin_warning` or autovacuum is off for the queue table, and keeps
    the verdicts /livez and /readyz serve."""

    def __init__(
        self,
        store: ports.Readings,
        publisher: ports.BrokerState,
        relay: ports.Progress,
        counters: metrics.Metrics,
        *,
        stats_interval: float,
        xmin_warning: float,
        schema_version: int,
        stall_after: float,
    ) -> None:
        self._store = store
        self._publisher = publisher
        self._relay = relay
        self._metrics = counters
        self._stats_interval = stats_interval
        self._xmin_warning = xmin_warning
        self._schema_version = schema_version
        self._stall_after = stall_after
        self._next_observation = 0.0
        self._warned_pid: int | None = None
        self._warned_autovacuum = False
        self.readiness = Verdict(False, "starting: first look at the database and the broker")

    def liveness(self) -> Verdict:
        """Alive while the loop cycles or waits on purpose; a loop stuck for `stall_after`
        seconds (a deadlock, a hung call) is not."""
        idle = time.monotonic() - self._relay.last_progress
        if idle > self._stall_after:
            return Verdict(False, f"the relay loop has made no progress for {idle:.0f}s")
        return Verdict(True, "ok")

    async def run_once(self) -> None:
        """Check readiness; refresh the gauges if they are due. Never raises for an outage."""
        self._metrics.broker_connected.set(self._publisher.connected)
        self._metrics.broker_blocked.set(self._publisher.blocked)
        self._metrics.last_cycle.set(time.time() - (time.monotonic() - self._relay.last_progress))
        database = await self._check_database()
        broker = "ok" if self._publisher.connected else "not connected"
        ready = database.startswith("ok") and broker == "ok"
        self.readiness = Verdict(ready, f"database: {database}\nbroker: {broker}")
        if ready and time.monotonic() >= self._next_observation:
            self._next_observation = time.monotonic() + self._stats_interval
            await self.observe()

    async def _check_database(self) -> str:
        try:
            version = await self._store.schema_version()
        except errors.SchemaMissing:
            return "the outbox schema is missing"
        except errors.TransientError:
            return "unreachable"
        if version < self._schema_version:
            return f"schema at version {version}, this relay needs {self._schema_version}"
        return f"ok (schema version {version})"

    async def observe(self) -> None:
        try:
            seen = await self._store.observe()
        except errors.TransientError as exc:
            log.debug("could not refresh the gauges: %s", exc)
            return
        self._metrics.observe(seen)
        self._check_autovacuum(seen.autovacuum_on)
        if seen.xmin_seconds is not None and seen.xmin_seconds > self._xmin_warning:
            if seen.xmin_pid != self._warned_pid:
                log.warning(
                    "vacuum horizon pinned for %.0fs (%s transaction ids) by pid %s (%s): the "
                    "messages table cannot be vacuumed and claims will slow down",
                    seen.xmin_seconds,
                    seen.xmin_xids,
                    seen.xmin_pid,
                    seen.xmin_state,
                    extra=logs.event(
                        event="vacuum_horizon_pinned",
                        seconds=seen.xmin_seconds,
                        xids=seen.xmin_xids,
                        pid=seen.xmin_pid,
                        state=seen.xmin_state,
                    ),
                )
                self._warned_pid = seen.xmin_pid
        else:
            self._warned_pid = None

    def _check_autovacuum(self, on: bool) -> None:
        """Warn once each time autovacuum is found off: nothing then removes the two dead row
        versions every message leaves, nor refreshes the statistics the claim is planned on."""
        if on or self._warned_autovacuum:
            self._warned_autovacuum = not on
            return
        log.warning(
            "autovacuum is off for the messages table (server setting `autovacuum` or the "
            "table's autovacuum_enabled): every message leaves dead rows that nothing removes "
            "and the claim is planned on stale statistics; turn it on, or VACUUM (ANALYZE) "
            "the table on a schedule",
            extra=logs.event(event="autovacuum_off"),
        )
        self._warned_autovacuum = True
