"""The relay's side of the doorbell (migration 0023): armed while it sleeps, so producers notify."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg

from relay.core import errors, retry, waiting
from relay.postgres import pg, sql
from relay.postgres.pg import translate_errors

log = logging.getLogger("relay.doorbell")

#: Its session is `idle in transaction` for as long as its relay sleeps (with no xid and no
#: snapshot: it pins nothing); a monitor that alerts on such sessions can leave this name out.
APPLICATION_NAME = f"{pg.APPLICATION_NAME} doorbell"
#: TCP keepalives of the session, both ends: a probe after this many idle seconds, then one as
#: often. A connection a NAT dropped while the relay slept is noticed within about two minutes
#: (the system's probe count, 9 on Linux), and the server lets go of the lock it held.
KEEPALIVE = 10


class Doorbell:
    """Producers NOTIFY only while some relay holds the doorbell (docs/decisions/0008). The loop
    calls `arm()` before it sleeps and `disarm()` once it works back to back. `armed` is set while
    the doorbell is held, and `arms` counts the times it was taken: every producer that committed
    without notifying did so before the latest arm, so a look for work that began after it sees
    their rows. `lost` is set when the server ended a session that held it.

    Its own connection holds the lock in an open READ COMMITTED transaction with no xid and no
    snapshot, so it pins nothing. It reconnects by itself; while it is away, polling covers the
    gap (producers notify nobody, as while every relay is busy)."""

    def __init__(self, conninfo: str, schema: str) -> None:
        self._conninfo = conninfo
        self._schema = schema
        self._q = sql.load(schema)
        self.armed = asyncio.Event()
        self.lost = asyncio.Event()
        self.arms = 0
        self._wanted = asyncio.Event()
        self._unwanted = asyncio.Event()
        self._unwanted.set()

    def arm(self) -> None:
        """Take the doorbell in the background (`armed` is set once it is held)."""
        self.lost.clear()
        self._unwanted.clear()
        self._wanted.set()

    def disarm(self) -> None:
        """Let go of it in the background; `armed` is clear from now on."""
        self.armed.clear()
        self._wanted.clear()
        self._unwanted.set()

    async def run(self) -> None:
        """Serve arm() and disarm() until cancelled, reconnecting with back-off (which starts
        again from its shortest wait after a connection that worked)."""
        await retry.reconnecting(
            self._serve,
            lambda exc: log.warning(
                "doorbell connection failed (%s); polling covers the gap, retrying", exc
            ),
            lambda exc: log.warning("doorbell connection lost (%s); polling covers the gap", exc),
        )

    async def _serve(self) -> None:
        with translate_errors(self._schema):
            conn = await psycopg.AsyncConnection.connect(
                self._conninfo,
                autocommit=True,
                application_name=APPLICATION_NAME,
                prepare_threshold=None,  # a prepared statement's portal would keep a snapshot
                keepalives=1,
                keepalives_idle=KEEPALIVE,
                keepalives_interval=KEEPALIVE,
            )
        try:
            with translate_errors(self._schema):
                await conn.execute(self._q.use_doorbell)
                await conn.execute(self._q.doorbell_session, {"keepalive": str(KEEPALIVE)})
                if conn.info.server_version >= 140000:
                    await conn.execute(self._q.no_idle_session_timeout)
                if conn.info.server_version >= 170000:
                    await conn.execute(self._q.doorbell_no_transaction_timeout)
                await conn.set_autocommit(False)
                await conn.set_isolation_level(psycopg.IsolationLevel.READ_COMMITTED)
            await self._serve_on(conn)
        finally:
            self.armed.clear()
            await conn.close()

    async def _serve_on(self, conn: psycopg.AsyncConnection[Any]) -> None:
        try:
            while True:
                await self._wanted.wait()
                if await self._take(conn):
                    await self._hold(conn)
                await conn.rollback()  # lets go (the transaction wrote nothing)
        except (psycopg.OperationalError, errors.DatabaseUnavailable) as exc:
            if self.armed.is_set() or self._wanted.is_set():
                self.lost.set()
            self.armed.clear()
            raise retry.Lost(str(exc) or type(exc).__name__) from exc

    async def _hold(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Until the loop lets go. An idle session hears from the server only when it is ended
        (terminated, or the server goes down): then the lock is gone, and so is `armed`."""
        loop = asyncio.get_running_loop()
        spoken = asyncio.Event()
        loop.add_reader(conn.fileno(), spoken.set)
        try:
            await waiting.any_event((self._unwanted, spoken), None)
        finally:
            loop.remove_reader(conn.fileno())
        if spoken.is_set():
            raise errors.DatabaseUnavailable("the server ended the doorbell's session")
        self.armed.clear()

    async def _take(self, conn: psycopg.AsyncConnection[Any]) -> bool:
        """Wait for the lock unless the loop stops wanting it first; whether it is held."""
        locking = asyncio.ensure_future(conn.execute(self._q.arm_doorbell))
        try:
            await waiting.done_or_set(locking, self._unwanted)
            while not locking.done():
                await conn.cancel_safe()
                # Again after a while: a cancel that reaches the server between the
                # transaction's BEGIN and the lock's statement is ignored.
                await asyncio.wait({locking}, timeout=retry.FIRST_WAIT)
        finally:
            # Left by a cancel or a failed cancel_safe: it must end before its connection closes
            # (a socket psycopg still watches, closed, could pass its number to the next one).
            await waiting.finish(locking)
        if isinstance(locking.exception(), psycopg.errors.QueryCanceled):
            return False  # withdrawn: the serving loop takes it again if it is wanted again
        locking.result()
        if self._unwanted.is_set():
            return False
        self.arms += 1
        self.lost.clear()  # held again: a sleeper waits for this session, not the last one
        self.armed.set()
        return True
