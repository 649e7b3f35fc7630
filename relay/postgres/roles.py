"""Creates the producer, relay, operator and viewer roles of an outbox schema and grants them
roles.sql."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection
from importlib import resources
from typing import Any, LiteralString, cast

import psycopg

from relay.core import errors, values
from relay.postgres import pg

#: The jobs, in the order `roles` reports them.
JOBS = ("producer", "relay", "operator", "viewer")

#: The jobs `roles` of an earlier version did not create: an installation set up by one lacks
#: them until `roles` runs again, and `migrate` leaves their grants out until then.
LATER = ("viewer",)


@dataclasses.dataclass(frozen=True, slots=True)
class Roles:
    """The group roles (NOLOGIN) of one schema, one per job; grant them to login users."""

    producer: str
    relay: str
    operator: str
    viewer: str
    created: tuple[str, ...] = ()

    def names(self) -> tuple[str, str, str, str]:
        """In the order of JOBS."""
        return self.producer, self.relay, self.operator, self.viewer


def names(schema: str) -> Roles:
    """`<schema>_producer`, `<schema>_relay`, `<schema>_operator`, `<schema>_viewer`. ConfigError
    if too long."""
    values.check_identifier(schema)
    producer, relay, operator, viewer = (f"{schema}_{job}" for job in JOBS)
    longest = max(len(job) for job in JOBS) + 1  # "_operator"
    if len(schema) + longest > 63:  # PostgreSQL would silently truncate the name
        raise errors.ConfigError(
            f"schema name {schema!r} is too long for role names (at most {63 - longest} characters)"
        )
    return Roles(producer, relay, operator, viewer)


#: The line where roles.sql's grants start: `migrate` applies only what follows (it never takes
#: away); the line alone, so that a mention of it elsewhere in the file cannot count.
_GRANTS = "\n-- grants --\n"


def grants(schema: str, *, revoke: bool = True, without: Collection[str] = ()) -> LiteralString:
    """roles.sql bound to `schema` and its role names; without `revoke`, only its grants, less
    the statements granting to the jobs in `without` (their roles do not exist yet)."""
    roles = names(schema)
    text = resources.files("relay.postgres").joinpath("roles.sql").read_text(encoding="utf-8")
    if not revoke:
        text = text[text.index(_GRANTS) :]
    if without:
        if revoke:
            raise ValueError("the REVOKE lines name every role: leave roles out of grants only")
        text = _leave_out(text, without)
    for placeholder, name in (
        ("{schema}", schema),
        ("{producer}", roles.producer),
        ("{relay}", roles.relay),
        ("{operator}", roles.operator),
        ("{viewer}", roles.viewer),
    ):
        text = text.replace(placeholder, f'"{name}"')  # names check_identifier() admitted
    return cast(LiteralString, text)  # type: ignore[redundant-cast]  # see sql.load


def _leave_out(text: str, jobs: Collection[str]) -> str:
    """`text` (roles.sql's grants) without its comments and without the statements that grant to
    one of `jobs`. ValueError if such a statement names another role too: leaving it out would
    take that role's grant away with it (roles.sql gives those jobs statements of their own)."""
    unknown = set(jobs) - set(JOBS)
    if unknown:
        raise ValueError(f"no such jobs: {sorted(unknown)}")
    kept = []
    for statement in re.sub(r"--[^\n]*", "", text).split(";"):  # roles.sql has no literals
        named = set(re.findall(r"\{(\w+)\}", statement)) - {"schema"}
        if not named & set(jobs):
            kept.append(statement)
        elif named - set(jobs):
            raise ValueError(f"roles.sql grants to {sorted(named)} in one statement: {statement}")
    return ";".join(kept)


def ensure(conninfo: str, schema: str) -> Roles:
    """Create the roles that are missing and (re)grant all of them. Needs the schema's owner with
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
    """Grant roles.sql's grants again after a migration, revoking nothing, so relays of the
    previous version keep working through a rolling upgrade; whether it did. Nothing if `roles`
    has not set the roles up (a role of a job outside LATER is missing). A role of LATER's that an
    earlier version's `roles` did not create is left out, the others get theirs: `ensure` (the
    `roles` command) is what creates roles (`migrate` needs no CREATEROLE), and what takes away
    rights a release no longer needs."""
    roles = names(schema)
    rows = conn.execute(
        "SELECT rolname FROM pg_roles WHERE rolname = ANY(%s)", [list(roles.names())]
    ).fetchall()
    found = {str(name) for (name,) in rows}
    missing = [job for job, name in zip(JOBS, roles.names(), strict=True) if name not in found]
    if any(job not in LATER for job in missing):
        return False
    conn.execute(grants(schema, revoke=False, without=missing))
    return True


def _create(conn: psycopg.Connection[Any], name: str) -> bool:
    exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", [name]).fetchone()
    if exists:
        return False
    conn.execute(psycopg.sql.SQL("CREATE ROLE {} NOLOGIN").format(psycopg.sql.Identifier(name)))
    return True
