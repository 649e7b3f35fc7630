"""Creates the producer, relay and operator roles of an outbox schema and grants them roles.sql."""

from __future__ import annotations

import dataclasses
from importlib import resources
from typing import Any, LiteralString, cast

import psycopg

from relay.core import errors, values
from relay.postgres import pg

#: The jobs, in the order `roles` reports them.
JOBS = ("producer", "relay", "operator")


@dataclasses.dataclass(frozen=True, slots=True)
class Roles:
    """The three group roles (NOLOGIN) of one schema; grant them to login users."""

    producer: str
    relay: str
    operator: str
    created: tuple[str, ...] = ()

    def names(self) -> tuple[str, str, str]:
        return self.producer, self.relay, self.operator


def names(schema: str) -> Roles:
    """`<schema>_producer`, `<schema>_relay`, `<schema>_operator`. ConfigError if too long."""
    values.check_identifier(schema)
    producer, relay, operator = (f"{schema}_{job}" for job in JOBS)
    if len(operator) > 63:  # PostgreSQL would silently truncate the name
        raise errors.ConfigError(
            f"schema name {schema!r} is too long for role names (at most 54 characters)"
        )
    return Roles(producer, relay, operator)


#: The line where roles.sql's grants start: `migrate` applies only what follows (it never takes
#: away); the line alone, so that a mention of it elsewhere in the file cannot count.
_GRANTS = "\n-- grants --\n"


def grants(schema: str, *, revoke: bool = True) -> LiteralString:
    """roles.sql bound to `schema` and its role names; without `revoke`, only its grants."""
    roles = names(schema)
    text = resources.files("relay.postgres").joinpath("roles.sql").read_text(encoding="utf-8")
    if not revoke:
        text = text[text.index(_GRANTS) :]
    for placeholder, name in (
        ("{schema}", schema),
        ("{producer}", roles.producer),
        ("{relay}", roles.relay),
        ("{operator}", roles.operator),
    ):
        text = text.replace(placeholder, f'"{name}"')  # names check_identifier() admitted
    return cast(LiteralString, text)  # type: ignore[redundant-cast]  # see sql.load


def ensure(conninfo: str, schema: str) -> Roles:
    """Create the roles that are missing and (re)grant all three. Needs the schema's owner with
    CREATEROLE (or a superuser). Raises DatabaseUnavailable or RelayError."""
    roles = names(schema)
    with pg.translate_errors(schema):  # no schema yet: SchemaMissing, "run migrate"
        try:
            with psycopg.connect(conninfo) as conn:
                created = tuple(name for name in roles.names() if _create(conn, name))
                conn.execute(grants(schema))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise errors.RelayError(
                f"cannot set up the roles: {pg.first_line(exc)}; run `roles` as the outbox "
                "schema's owner, with CREATEROLE"
            ) from None
        except psycopg.errors.UndefinedObject as exc:
            raise errors.RelayError(
                f"cannot set up the roles: {pg.first_line(exc)}; run `outbox-relay migrate` first"
            ) from None
    return dataclasses.replace(roles, created=created)


def refresh(conn: psycopg.Connection[Any], schema: str) -> bool:
    """Grant roles.sql's grants again if all three roles exist (after a migration), revoking
    nothing, so relays of the previous version keep working through a rolling upgrade; whether it
    did. `ensure` (the `roles` command) is what takes away rights a release no longer needs."""
    roles = names(schema)
    found = conn.execute(
        "SELECT count(*) FROM pg_roles WHERE rolname = ANY(%s)", [list(roles.names())]
    ).fetchone()
    if found is None or found[0] != len(JOBS):
        return False
    conn.execute(grants(schema, revoke=False))
    return True


def _create(conn: psycopg.Connection[Any], name: str) -> bool:
    exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [name]).fetchone()
    if exists:
        return False
    conn.execute(psycopg.sql.SQL("CREATE ROLE {} NOLOGIN").format(psycopg.sql.Identifier(name)))
    return True
