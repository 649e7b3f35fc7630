"""A self-reconnecting LISTEN connection whose only job is to set the relay's wake-up events."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import tenacity

from relay.core import errors, retry
from relay.postgres import pg, sql
from relay.postgres.pg import translate_errors

log = logging.getLogger("relay.listener")  # the name log lines carry: as before the folders

#: The payload of the NOTIFY a producer's commit sends after queueing a key recheck (0012).
RECHECK = "recheck"


class Listener:
    """Sets `wake` on every NOTIFY from enqueue, and once after each (re)connect, because
    notifications sent while it was away are gone: polling is the guarantee, NOTIFY only a hint.
    Sets `recheck` too when the payload asks for it (and after each connect)."""

    def __init__(
        self,
        conninfo: str,
        schema: str,
        wake: asyncio.Event,
        recheck: asyncio.Event | None = None,
    ) -> None:
        self._conninfo = conninfo
        self._schema = schema
        self._listen = sql.load(schema).listen
        self.wake = wake
        #: Set (with `wake`) by a NOTIFY whose payload is `recheck`: a keyed row's commit raced
        #: its predecessor's settle, and the relays should look at key_checks now.
        self.recheck = recheck or asyncio.Event()
        self.connected = asyncio.Event()
        self.connects = 0
        self.notifications = 0

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with back-off when the connection drops."""
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception(retry.is_transient),
            wait=retry.reconnect_wait(),
            before_sleep=lambda state: log.warning(
                "LISTEN connection lost (%s); polling covers the gap, reconnecting",
                state.outcome.exception() if state.outcome else "?",
            ),
        )
        async for attempt in retrying:
            with attempt:
                await self._listen_once()

    async def _listen_once(self) -> None:
        with translate_errors(self._schema):
            conn = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, application_name=pg.APPLICATION_NAME
            )
            try:
                await conn.execute(self._listen)
                self.connects += 1
                self.connected.set()
                self.wake.set()
                self.recheck.set()  # notifications sent while away are gone
                async for notify in conn.notifies():
                    self.notifications += 1
                    if notify.payload == RECHECK:
                        self.recheck.set()
                    self.wake.set()
            finally:
                self.connected.clear()
                await conn.close()
        raise errors.DatabaseUnavailable("LISTEN connection closed")
