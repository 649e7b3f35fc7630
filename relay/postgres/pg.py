"""What the PostgreSQL adapters share: turning psycopg's errors into the project's."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import psycopg.errors
import psycopg_pool

from relay.core import errors, values
from relay.postgres import sql

#: Every session the relay opens carries this name, so operators can find (and kill) them.
APPLICATION_NAME = "outbox-relay"

#: Errors that mean "the schema is not there (yet)", not "the database is down".
_MISSING = (
    psycopg.errors.UndefinedTable,
    psycopg.errors.InvalidSchemaName,
    psycopg.errors.UndefinedFunction,
)


#: What the server says when it answers but will not let this login in (libpq carries no SQLSTATE
#: for a failed connection, only the server's message: English unless the server's lc_messages
#: says otherwise, in which case such a refusal is retried as an outage).
_REFUSED = re.compile(
    r"FATAL:\s+(.*authentication failed|role \S+ does not exist|database \S+ does not exist"
    r"|no pg_hba\.conf entry|permission denied for database)"
    r"|server does not support SSL, but SSL was required|certificate verify failed"
    r"|root certificate file .* does not exist"
)
#: libpq's words for a URL it cannot parse, or an option value it refuses before it connects:
#: a URL that can never work, told at once and never retried.
_BAD_URL = re.compile(
    r"invalid URI|invalid connection option|invalid percent-encoded|missing \"=\" after"
    r"|matching \"\]\"|unterminated quoted string|forbidden value|unexpected spaces"
    r"|connection is bad: invalid \w+ (value|number)"
)


@contextlib.contextmanager
def translate_errors(schema: str) -> Iterator[None]:
    """Outages become DatabaseUnavailable and a missing schema SchemaMissing; anything else (a bug,
    a constraint) propagates unchanged."""
    try:
        yield
    except _MISSING as exc:
        raise errors.SchemaMissing(
            f'the outbox schema "{schema}" is missing or incomplete ({exc.diag.message_primary}); '
            "run `outbox-relay migrate`"
        ) from exc
    except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected) as exc:
        raise errors.LockTimeout(
            f"PostgreSQL: {first_line(exc)} ({exc.sqlstate}); retrying, as a lock time-out"
        ) from exc
    except (psycopg.ProgrammingError, psycopg.OperationalError) as exc:
        if exc.sqlstate is not None or not _BAD_URL.search(str(exc)):
            if isinstance(exc, psycopg.ProgrammingError):
                raise
            raise _unavailable(exc) from exc
        raise errors.ConfigError(
            f"the PostgreSQL URL cannot work: {first_line(exc)} (see libpq's connection "
            "parameters: https://www.postgresql.org/docs/current/libpq-connect.html)"
        ) from None
    except psycopg_pool.PoolTimeout as exc:
        raise _unavailable(exc) from exc


def _unavailable(exc: Exception) -> errors.DatabaseUnavailable:
    """An outage, or (DatabaseRefused) a server that answers and will not let this login in."""
    line = first_line(exc)
    if _REFUSED.search(str(exc)):
        return errors.DatabaseRefused(
            f"PostgreSQL refused the connection: {line}; check the user, password, database "
            "name and TLS settings in OUTBOX_DATABASE_URL (and pg_hba.conf)"
        )
    return errors.DatabaseUnavailable(f"PostgreSQL unavailable: {line}")


def options(pooled: bool) -> dict[str, Any]:
    """psycopg's connection options for a database URL that goes through a transaction-mode
    pooler (PgBouncer before 1.21 keeps no prepared statement across transactions) or not."""
    return {"prepare_threshold": None} if pooled else {}


@contextlib.contextmanager
def session(
    conninfo: str, schema: str, purpose: str, *, pooled: bool = False
) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for one operator session, named `outbox-relay <purpose>` in
    pg_stat_activity; ConfigError for a bad schema name, DatabaseUnavailable if unreachable."""
    values.check_identifier(schema)
    with translate_errors(schema):
        conn = psycopg.connect(
            conninfo,
            autocommit=True,
            application_name=f"{APPLICATION_NAME} {purpose}",
            **options(pooled),
        )
    with conn:
        yield conn


def first_line(exc: BaseException) -> str:
    """The first line of an error's text (libpq's messages run over several)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class Session:
    """One autocommit connection (from `session`) to one outbox schema, with that schema's
    statements: what the operators' Admin and the pipeline's database side are built on."""

    def __init__(
        self, conn: psycopg.Connection[Any], schema: str, conninfo: str, *, pooled: bool = False
    ) -> None:
        self._conn = conn
        self._schema = schema
        self._q = sql.load(schema)
        self._conninfo = conninfo  # for the locks, held on connections of their own
        self._pooled = pooled


async def one_row(cur: psycopg.AsyncCursor[Any]) -> Any:
    """The one row of an aggregate query (which always returns one)."""
    row = await cur.fetchone()
    assert row is not None
    return row
