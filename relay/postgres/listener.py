"""A self-reconnecting LISTEN connection whose only job is to set the relay's wake-up events."""

from __future__ import annotations

import asyncio
import logging

import psycopg

from relay.core import errors, retry
from relay.postgres import pg, sql
from relay.postgres.pg import translate_errors

log = logging.getLogger("relay.listener")  # the name log lines carry: as before the folders


class Listener:
    """Sets `wake` on every NOTIFY from enqueue, and once after each (re)connect, because
    notifications sent while it was away are gone: polling is the guarantee, NOTIFY only a hint."""

    def __init__(
        self,
        conninfo: str,
        schema: str,
        wake: asyncio.Event,
        quick_loss: float = retry.LONGEST_WAIT,
    ) -> None:
        self._conninfo = conninfo
        self._quick_loss = quick_loss  # a loss this soon after connecting backs off (retry)
        self._schema = schema
        self._q = sql.load(schema)
        self.wake = wake
        self.connected = asyncio.Event()
        self.connects = 0
        self.notifications = 0

    async def run(self) -> None:
        """Listen until cancelled, reconnecting with back-off when the connection drops (from
        its shortest wait again after each connection that worked)."""
        await retry.reconnecting(
            self._listen_once,
            lambda exc: log.warning(
                "LISTEN connection failed (%s); polling covers the gap, reconnecting", exc
            ),
            lambda exc: log.warning(
                "LISTEN connection lost (%s); polling covers the gap, reconnecting", exc
            ),
            self._quick_loss,
        )

    async def _listen_once(self) -> None:
        with translate_errors(self._schema):
            conn = await psycopg.AsyncConnection.connect(
                self._conninfo, autocommit=True, application_name=pg.APPLICATION_NAME
            )
        try:
            with translate_errors(self._schema):
                if conn.info.server_version >= 140000:
                    await conn.execute(self._q.no_idle_session_timeout)
                await conn.execute(self._q.listen)
            self.connects += 1
            self.connected.set()
            self.wake.set()  # notifications sent while away are gone
            try:
                with translate_errors(self._schema):
                    async for _ in conn.notifies():
                        self.notifications += 1
                        self.wake.set()
            except errors.TransientError as exc:
                raise retry.Lost(str(exc)) from exc
            raise retry.Lost("LISTEN connection closed")
        finally:
            self.connected.clear()
            await conn.close()
