"""The composition root: wires settings into adapters and the loop; runs a relay's life cycle."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import ssl
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import TypeVar
from urllib.parse import urlsplit

import tenacity

from relay import __version__
from relay.amqp.connection import tls_context
from relay.amqp.publisher import AmqpPublisher
from relay.core import (
    chores,
    config,
    errors,
    eventloop,
    loop,
    model,
    retry,
    tracing,
    waiting,
    waking,
)
from relay.ops import lifecycle, metrics, upkeep
from relay.ops.probes import Probes
from relay.ops.probes import listen as probes_listen
from relay.ops.retention import Pruner
from relay.ops.watch import Watcher
from relay.postgres import migrate
from relay.postgres.admin import Admin
from relay.postgres.doorbell import Doorbell
from relay.postgres.listener import Listener
from relay.postgres.store import PgStore

log = logging.getLogger(__name__)
T = TypeVar("T")


def options(settings: config.Settings) -> loop.Options:
    """The loop's knobs, from the settings."""
    return loop.Options(
        batch_size=settings.batch_size,
        lease=settings.lease,
        poll_interval=settings.poll_interval,
        max_attempts=settings.max_attempts,
        max_ambiguous=settings.max_ambiguous,
        retry_delay=settings.retry_delay,
        retry_max_delay=settings.retry_max_delay,
        shutdown_grace=settings.shutdown_timeout,
        prefetch=True,
        confirm_timeout=settings.confirm_timeout,
    )


@dataclasses.dataclass
class Components:
    """Everything a running relay is made of, for `run` and for the demo."""

    settings: config.Settings
    store: PgStore
    publisher: AmqpPublisher
    listener: Listener | None  # None: polling only (a transaction pooler, no OUTBOX_LISTEN_URL)
    doorbell: Doorbell | None  # None with the listener
    relay: loop.Relay
    metrics: metrics.Metrics
    #: The supervised background chores running beside the loop (liveness watches them).
    chores: list[chores.Chore] = dataclasses.field(default_factory=list)


class StoppedWhileStarting(Exception):
    """A stop signal arrived before the relay was ready; nothing had been claimed."""


async def startup(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    within: float,
    stop: asyncio.Event | None = None,
    say: Callable[[str], object] = lambda _: None,
) -> T:
    """Call `attempt` until it succeeds, retrying outages for up to `within` seconds, and `say`
    what it is doing (for /readyz). Raises StoppedWhileStarting as soon as `stop` is set, even
    mid-attempt."""
    stop = stop or asyncio.Event()
    say(f"connecting to {what}")

    def waiting(state: tenacity.RetryCallState) -> None:
        problem = state.outcome.exception() if state.outcome else "?"
        log.warning("waiting for %s: %s", what, problem)
        say(f"waiting for {what} (for up to {within:g}s in all): {problem}")

    retrying = tenacity.AsyncRetrying(
        # A refusal (credentials, a database or vhost that does not exist) fails start-up at once.
        retry=tenacity.retry_if_exception(
            lambda exc: retry.is_transient(exc) and not isinstance(exc, errors.Refused)
        ),
        wait=retry.reconnect_wait(),
        stop=tenacity.stop_after_delay(within),
        sleep=lambda seconds: _unless_stopped(asyncio.sleep(seconds), stop),
        before_sleep=waiting,
        reraise=True,
    )
    async for try_ in retrying:
        with try_:
            return await _unless_stopped(attempt(), stop)
    raise AssertionError("unreachable")  # pragma: no cover


async def _unless_stopped(step: Awaitable[T], stop: asyncio.Event) -> T:
    if stop.is_set():
        raise StoppedWhileStarting
    task = asyncio.ensure_future(step)
    await waiting.done_or_set(task, stop)
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise StoppedWhileStarting
    return task.result()


@contextlib.asynccontextmanager
async def components(
    settings: config.Settings,
    stop: asyncio.Event | None = None,
    counters: metrics.Metrics | None = None,
    say: Callable[[str], object] = lambda _: None,
) -> AsyncIterator[Components]:
    """Open the store, the publisher and the LISTEN connection; close them all on exit.
    Raises DatabaseUnavailable/BrokerUnavailable after `startup_timeout`, SchemaMissing, or
    StoppedWhileStarting if `stop` is set before everything is open."""
    database_url = settings.database_url.get_secret_value()
    store = await startup(
        "PostgreSQL",
        lambda: PgStore.open(
            database_url,
            settings.db_schema,
            settings.relay_name,
            synchronous_commit=settings.synchronous_commit,
            batch_max_bytes=settings.batch_max_bytes,
            lock_timeout=settings.lock_timeout,
            pooled=settings.transaction_pooler,
            # The loop's claim ahead and settle, the heartbeat, and the chores' reads.
            max_size=3,
        ),
        settings.startup_timeout,
        stop,
        say,
    )
    publisher = AmqpPublisher(
        settings.amqp_url.get_secret_value(),
        confirm_timeout=settings.confirm_timeout,
        tls=amqp_tls(settings),
    )
    try:
        await startup("RabbitMQ", publisher.connect, settings.startup_timeout, stop, say)
        say("starting the relay loop")
        wake = asyncio.Event()
        listen_url = _listen_url(settings)
        listener = None if listen_url is None else Listener(listen_url, settings.db_schema, wake)
        # Only a relay that hears NOTIFY arms the doorbell (docs/decisions/0008).
        doorbell = (
            Doorbell(listen_url, settings.db_schema)
            if listen_url is not None and settings.doorbell
            else None
        )
        counters = counters or metrics.Metrics()
        relay = loop.Relay(
            store,
            tracing.traced(publisher),
            options(settings),
            waker=waking.Waker(wake, doorbell, settings.poll_interval),
            on_cycle=counters.record,
            on_chore_error=counters.chore_failed,
            on_lock_retry=counters.lock_retries.inc,
        )

        rescue = upkeep.Rescue(store, counters, wake, soonest=settings.poll_interval)
        # The listener and the doorbell reconnect by themselves; chores only so that a bug
        # cannot end them silently.
        supervised = [
            chores.Chore(
                "rescue",
                rescue.run_once,
                retry.LONGEST_WAIT,
                pace=lambda: rescue.next_delay,
                on_error=counters.chore_failed,
            ),
            relay.heartbeat,
        ]
        # Their runs end only by a bug: then again after a poll (a failure backs off, doubling).
        again = settings.poll_interval
        if listener is not None:
            listening = chores.Chore(
                "listener", listener.run, again, on_error=counters.chore_failed
            )
            supervised.insert(0, listening)
        if doorbell is not None:
            ringing = chores.Chore("doorbell", doorbell.run, again, on_error=counters.chore_failed)
            supervised.insert(1, ringing)
        background = [
            asyncio.create_task(chore.run(), name=f"outbox-{chore.name}")
            for chore in supervised
            if chore is not relay.heartbeat  # the relay's run beats it
        ]
        try:
            yield Components(
                settings, store, publisher, listener, doorbell, relay, counters, supervised
            )
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
    finally:
        await publisher.close()
        await store.close()


async def run(
    settings: config.Settings, *, until_empty: bool = False, stop: asyncio.Event | None = None
) -> model.CycleReport | None:
    """Run one relay until SIGINT/SIGTERM (or `stop`), or until no row is due with `until_empty`,
    serving /metrics, /livez and /readyz meanwhile.

    On a stop signal it claims nothing more, gives the batch in flight up to `shutdown_timeout` for
    its confirms, settles it (what is still unconfirmed goes back to the queue at once, for any
    replica), and returns. A second signal cancels outright: rows then keep their leases until they
    run out, and are published again by whichever relay claims them next. Signals count from the
    start: one that arrives while the relay is still connecting ends start-up at once."""
    stop = stop or asyncio.Event()
    process = lifecycle.Process()
    counters = metrics.Metrics()
    counters.info.info(
        {"version": __version__, "relay_name": settings.relay_name, "schema": settings.db_schema}
    )
    probes = Probes(counters.registry, process.live, process.ready)
    probes_listen(probes, settings.metrics_host, settings.metrics_port)
    try:
        with lifecycle.signals_set(stop, process.cancel):
            async with components(settings, stop, counters, process.starting) as parts:
                process.watcher = _watcher(settings, parts)
                process.chores = [*_chores(settings, parts, process.watcher), *parts.chores]
                supervised = [
                    asyncio.create_task(chore.run(), name=f"outbox-{chore.name}")
                    for chore in process.chores
                    if chore not in parts.chores  # those run already
                ]
                try:
                    log.info(
                        "relay %s ready: schema=%s batch_size=%d lease=%gs loop=%s",
                        settings.relay_name,
                        settings.db_schema,
                        settings.batch_size,
                        settings.lease,
                        eventloop.name(),
                    )
                    if until_empty:
                        drain = asyncio.create_task(_drain(parts.relay, stop), name="outbox-drain")
                        process.work = drain
                        await lifecycle.until_stopped(
                            drain, stop, settings.shutdown_timeout, settings.lease
                        )
                        return drain.result()
                    process.work = asyncio.create_task(parts.relay.run(stop), name="outbox-relay")
                    await lifecycle.until_stopped(
                        process.work, stop, settings.shutdown_timeout, settings.lease
                    )
                finally:
                    for task in supervised:
                        task.cancel()
                    await asyncio.gather(*supervised, return_exceptions=True)
    except StoppedWhileStarting:
        log.info("stopped before it was ready: nothing was claimed")
    finally:
        probes.stop()
    return None


def _chores(settings: config.Settings, parts: Components, watcher: Watcher) -> list[chores.Chore]:
    """The chores beside the loop: gauges and readiness, and archive retention."""
    failed = parts.metrics.chore_failed
    found = [
        chores.Chore(
            "watcher",
            watcher.run_once,
            settings.poll_interval,  # readiness follows an outage as fast as the loop sees it
            stall_after=options(settings).stalled_after,
            on_error=failed,
        )
    ]
    if settings.archive_retention > 0:
        pruner = _pruner(settings, parts.metrics)
        found.append(
            chores.Chore(
                "pruner", pruner.run_once, settings.archive_prune_interval, on_error=failed
            )
        )
    return found


def _watcher(settings: config.Settings, parts: Components) -> Watcher:
    return Watcher(
        parts.store,
        parts.publisher,
        parts.relay,
        parts.metrics,
        stats_interval=settings.stats_interval,
        xmin_warning=settings.xmin_warning,
        schema_version=len(migrate.discover()),
        stall_after=options(settings).stalled_after,
    )


def _pruner(settings: config.Settings, counters: metrics.Metrics) -> Pruner:
    database_url = settings.database_url.get_secret_value()
    retention = timedelta(seconds=settings.archive_retention)

    def prune(stop: threading.Event) -> int | None:
        with Admin.connect(
            database_url, settings.db_schema, pooled=settings.transaction_pooler
        ) as ops:
            return ops.archive_prune(retention, stop=stop)

    return Pruner(prune, settings.archive_prune_interval, counters)


async def _drain(relay: loop.Relay, stop: asyncio.Event) -> model.CycleReport:
    report = await relay.run_until_empty(stop)
    log.info(
        "%s: %d claimed, %d archived, %d dead",
        "stopped before the backlog was empty" if stop.is_set() else "no due rows left",
        report.claimed,
        report.settled.archived,
        report.settled.dead,
    )
    return report


async def stats(settings: config.Settings) -> model.Stats:
    """A snapshot of the outbox. Raises DatabaseUnavailable or SchemaMissing."""
    store = await PgStore.open(
        settings.database_url.get_secret_value(),
        settings.db_schema,
        settings.relay_name,
        max_size=1,
        pooled=settings.transaction_pooler,
    )
    try:
        return await store.stats()
    finally:
        await store.close()


def _listen_url(settings: config.Settings) -> str | None:
    """Where to LISTEN: OUTBOX_LISTEN_URL, else the database's URL unless a transaction pooler
    is in the way (NOTIFY cannot come through one: None, and the relay polls)."""
    if settings.listen_url is not None:
        return settings.listen_url.get_secret_value()
    if settings.transaction_pooler:
        log.warning(
            "OUTBOX_TRANSACTION_POOLER is set without OUTBOX_LISTEN_URL: NOTIFY cannot reach the "
            "relay through the pooler, so it polls every %gs (a message waits half of that on "
            "average); set OUTBOX_LISTEN_URL to a direct URL to wake at each commit",
            settings.poll_interval,
        )
        return None
    return settings.database_url.get_secret_value()


def amqp_tls(settings: config.Settings) -> ssl.SSLContext | None:
    """The broker connection's TLS context for `amqps://` URLs (None: plain AMQP)."""
    if urlsplit(settings.amqp_url.get_secret_value()).scheme != "amqps":
        return None
    return tls_context(settings.amqp_ca_file, settings.amqp_cert_file, settings.amqp_key_file)
