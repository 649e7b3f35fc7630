"""Finds the psycopg connection under a SQLAlchemy Session or Connection, or under a Django
connection, inside the caller's transaction. Neither library is imported: each is recognised by
the modules its classes come from."""

from __future__ import annotations

from typing import Any, TypeVar

import psycopg

from relay.core import errors

_NOT_PSYCOPG = (
    "relay.enqueue needs SQLAlchemy's psycopg 3 driver (a postgresql+psycopg:// URL); "
    "this engine uses {driver}"
)
_DJANGO_NOT_PSYCOPG = (
    "relay.enqueue needs Django's PostgreSQL backend on psycopg 3 (Django 4.2 or later, with "
    "psycopg 3 installed: the backend then uses it rather than psycopg2); "
    "the connection {alias!r} uses {driver}"
)
_DJANGO_AUTOCOMMIT = (
    "relay.enqueue with Django's connection {alias!r} must run inside transaction.atomic() "
    "(using={alias!r}): in autocommit the message would commit on its own, whether or not the "
    "change it announces does. Wrap the change and the enqueue in one atomic block."
)
_AUTOCOMMIT = (
    "relay.enqueue on a psycopg connection in autocommit mode would commit the message on its "
    "own, whether or not the change it announces does: enqueue inside `with conn.transaction():` "
    "together with that change (or on a connection that is not in autocommit mode)"
)
_DJANGO_ASYNC = (
    "Django's connections are synchronous: call relay.enqueue (not enqueue_async) inside "
    "transaction.atomic(), from async code through asgiref's sync_to_async"
)

_C = TypeVar("_C", psycopg.Connection[Any], psycopg.AsyncConnection[Any])

# A Django connection is one of these, or of a subclass (a third-party backend's wrapper).
_DJANGO_CONNECTIONS = {
    ("django.db.backends.base.base", "BaseDatabaseWrapper"),  # connections[alias]
    ("django.utils.connection", "ConnectionProxy"),  # django.db.connection
}


def sync_connection(conn: Any) -> psycopg.Connection[Any]:
    """`conn` if it is a psycopg Connection; else the one under a SQLAlchemy Session or
    Connection, with its transaction begun (the caller's, which SQLAlchemy commits or rolls back:
    never a second connection, never a commit of our own); else the one under a Django connection
    in a transaction (`_django`). TypeError for anything else."""
    if isinstance(conn, psycopg.Connection):
        return _in_transaction(conn)
    if _is_django(conn):
        return _django(conn)
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
        return _in_transaction(conn)
    if _is_django(conn):
        raise TypeError(_DJANGO_ASYNC)
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


def _in_transaction(conn: _C) -> _C:
    """`conn`, unless the statement would run in a transaction of its own: autocommit, and no
    `conn.transaction()` block open (InvalidArgument). Outside autocommit, psycopg begins the
    caller's transaction with the statement, as with any other."""
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        raise errors.InvalidArgument(_AUTOCOMMIT)
    return conn


def _django(conn: Any) -> psycopg.Connection[Any]:
    """The psycopg Connection under a Django connection (`django.db.connection` or
    `connections[alias]`), connected as Django's next query would connect it. Only inside
    `transaction.atomic()`, or with autocommit turned off (`transaction.set_autocommit(False)`,
    the caller commits): in Django's default autocommit the message would commit at once, alone
    (InvalidArgument). A transaction Django has marked for rollback is refused as Django refuses
    a query in it (TransactionManagementError)."""
    conn.ensure_connection()
    driver = conn.connection
    if not isinstance(driver, psycopg.Connection):
        raise TypeError(_DJANGO_NOT_PSYCOPG.format(alias=conn.alias, driver=_driver(driver)))
    if not conn.in_atomic_block and conn.get_autocommit():
        raise errors.InvalidArgument(_DJANGO_AUTOCOMMIT.format(alias=conn.alias))
    conn.validate_no_broken_transaction()
    return driver


def _driver(driver: Any) -> str:
    kind = type(driver)
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_django(conn: Any) -> bool:
    return any((c.__module__, c.__qualname__) in _DJANGO_CONNECTIONS for c in type(conn).__mro__)


def _is_sqlalchemy(conn: Any) -> bool:
    return type(conn).__module__.split(".")[0] == "sqlalchemy"


def _what_is(conn: Any, kind: str = "Connection") -> str:
    also = " or a Django connection" if kind == "Connection" else ""
    return (
        f"conn must be a psycopg {kind} or a SQLAlchemy Session/Connection{also}, "
        f"not {type(conn).__name__}"
    )
