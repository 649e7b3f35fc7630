"""Finds the psycopg connection under a SQLAlchemy Session or Connection, inside its transaction."""

from __future__ import annotations

from typing import Any

import psycopg

_NOT_PSYCOPG = (
    "relay.enqueue needs SQLAlchemy's psycopg 3 driver (a postgresql+psycopg:// URL); "
    "this engine uses {driver}"
)


def sync_connection(conn: Any) -> psycopg.Connection[Any]:
    """`conn` if it is a psycopg Connection; else the one under a SQLAlchemy Session or
    Connection, with its transaction begun (the caller's, which SQLAlchemy commits or rolls back:
    never a second connection, never a commit of our own). TypeError for anything else."""
    if isinstance(conn, psycopg.Connection):
        return conn
    if not _is_sqlalchemy(conn):
        raise TypeError(_what_is(conn))
    if callable(getattr(conn, "get_bind", None)):  # a Session: its connection, transaction begun
        conn = conn.connection()
    elif not conn.in_transaction():  # a Connection: begin as its first execute would
        conn.begin()
    driver = conn.connection.driver_connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError(_NOT_PSYCOPG.format(driver=type(driver).__module__))
    return driver


async def async_connection(conn: Any) -> psycopg.AsyncConnection[Any]:
    """`sync_connection` for psycopg's AsyncConnection and SQLAlchemy's AsyncSession and
    AsyncConnection."""
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if not _is_sqlalchemy(conn):
        raise TypeError(_what_is(conn, "AsyncConnection"))
    if callable(getattr(conn, "get_bind", None)):  # an AsyncSession
        conn = await conn.connection()
    elif not conn.in_transaction():
        await conn.begin()
    raw = await conn.get_raw_connection()
    driver = raw.driver_connection
    if not isinstance(driver, psycopg.AsyncConnection):
        raise TypeError(_NOT_PSYCOPG.format(driver=type(driver).__module__))
    return driver


def _is_sqlalchemy(conn: Any) -> bool:
    return type(conn).__module__.split(".")[0] == "sqlalchemy"


def _what_is(conn: Any, kind: str = "Connection") -> str:
    return (
        f"conn must be a psycopg {kind} or a SQLAlchemy Session/Connection, "
        f"not {type(conn).__name__}"
    )
