"""Which exchanges exist on the broker: passive declares on a channel of their own, cached."""

from __future__ import annotations

import asyncio
import logging
import re
import time

import aio_pika.abc
import aiormq.exceptions

from relay.amqp import outcomes

log = logging.getLogger("relay.publisher")  # the publisher's: the lines the probe writes, as before

#: How long an exchange seen to exist is trusted before it is checked again.
EXCHANGE_TTL = 30.0
_NAMED_EXCHANGE = re.compile(r"exchange '((?:[^'\\]|\\.)*)'")


def named(error: BaseException) -> str | None:
    """The exchange the broker's reply names (as it wrote it), if it names one."""
    found = _NAMED_EXCHANGE.search(str(error))
    return None if found is None else found[1]


class ExchangeProbe:
    """Passive declares on a channel apart from the publishing one (which a missing exchange
    would close, failing every unconfirmed message on it). An exchange seen to exist is trusted
    for `ttl` seconds; one that cannot be checked counts as present: the publish will tell."""

    def __init__(self, timeout: float, ttl: float = EXCHANGE_TTL) -> None:
        self._timeout = timeout
        self._ttl = ttl
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._seen: dict[str, float] = {}

    def forget_channel(self) -> None:
        """Its connection is going: the next check opens a channel on the next one."""
        self._channel = None

    async def missing(
        self,
        connection: aio_pika.abc.AbstractConnection | None,
        names: set[str],
        abort: asyncio.Event,
    ) -> set[str]:
        """Which of `names` do not exist, by passive declare (the default exchange always does).
        An exchange that cannot be checked in time (or before `abort`) counts as present: the
        publish will tell."""
        now = time.monotonic()
        missing: set[str] = set()

        async def check() -> None:
            for name in sorted(n for n in names if n and self._seen.get(n, 0) < now):
                if await self._exists(connection, name):
                    self._seen[name] = now + self._ttl
                else:
                    missing.add(name)

        checking = asyncio.ensure_future(check())
        await outcomes.wait_all([checking], self._timeout, abort)
        if checking.cancelled():
            log.warning(
                "exchange check unfinished after %gs or at shutdown; publishing unchecked",
                self._timeout,
            )
            self._channel = None  # its RPC was abandoned mid-flight; open a fresh one next time
        return missing

    async def _exists(self, connection: aio_pika.abc.AbstractConnection | None, name: str) -> bool:
        try:
            channel = await self._channel_on(connection)
            await channel.get_exchange(name, ensure=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        except (*outcomes.BROKER_ERRORS, RuntimeError) as exc:
            log.debug("could not check exchange %r: %s", name, outcomes.describe(exc))
        return True

    async def _channel_on(
        self, connection: aio_pika.abc.AbstractConnection | None
    ) -> aio_pika.abc.AbstractChannel:
        if self._channel is None or self._channel.is_closed:
            if connection is None:
                raise aiormq.exceptions.ChannelInvalidStateError("not connected")
            self._channel = await connection.channel(publisher_confirms=False)
        return self._channel
