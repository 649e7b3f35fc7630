"""A libpq database URL as the PostgreSQL JDBC driver wants it: a jdbc: URL plus properties."""

from __future__ import annotations

import getpass
import os
from urllib.parse import quote

import psycopg.conninfo

from relay.core import errors

#: libpq parameters the JDBC driver understands, by its own name for them.
_PASSED = {
    "sslmode": "sslmode",
    "sslrootcert": "sslrootcert",
    "sslcert": "sslcert",
    "sslkey": "sslkey",
    "connect_timeout": "connectTimeout",
    "application_name": "ApplicationName",
    "options": "options",
    "target_session_attrs": "targetServerType",
}
#: libpq parameters that only choose what is already chosen above.
_IGNORED = frozenset({"host", "hostaddr", "port", "dbname", "user", "password"})


def target(database_url: str, *, pooled: bool = False) -> tuple[str, dict[str, str]]:
    """The JDBC URL (without credentials) and the connection properties (user, password, TLS…)
    for `database_url`; `pooled` (a transaction pooler on the way): no server-side prepared
    statements (otherwise binary transfer from the first fetch). ConfigError for what JDBC
    cannot do (a Unix socket, an unknown option)."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(database_url)
    except psycopg.ProgrammingError as exc:
        raise errors.ConfigError(f"invalid OUTBOX_DATABASE_URL: {exc}") from None
    hosts = str(params.get("host") or "localhost").split(",")
    if any(h.startswith("/") for h in hosts):
        raise errors.ConfigError(
            "the pipeline reads over JDBC, which needs a TCP host, not a Unix socket: "
            "put host=… in OUTBOX_DATABASE_URL"
        )
    ports = str(params.get("port") or "5432").split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    if len(ports) != len(hosts):
        raise errors.ConfigError("OUTBOX_DATABASE_URL names a different number of hosts and ports")
    user = str(params.get("user") or os.environ.get("PGUSER") or getpass.getuser())
    dbname = str(params.get("dbname") or os.environ.get("PGDATABASE") or user)
    properties = {"user": user, "driver": "org.postgresql.Driver"}
    password = params.get("password") or os.environ.get("PGPASSWORD")
    if password:
        properties["password"] = str(password)
    for name, value in params.items():
        if name in _PASSED:
            properties[_PASSED[name]] = _jdbc_value(name, str(value))
        elif name not in _IGNORED:
            raise errors.ConfigError(
                f"OUTBOX_DATABASE_URL parameter {name!r} has no JDBC equivalent the pipeline knows"
            )
    # Binary transfer from the first fetch (-1): timestamps and bytea arrive as bytes, not text
    # to parse (a tenth of the export's CPU in a profile, docs/decisions/0007); it needs a named
    # server-side statement, which a transaction pooler cannot keep: there, none (0).
    properties["prepareThreshold"] = "0" if pooled else "-1"
    servers = ",".join(f"{h}:{p or 5432}" for h, p in zip(hosts, ports, strict=True))
    return f"jdbc:postgresql://{servers}/{quote(dbname, safe='')}", properties


def _jdbc_value(name: str, value: str) -> str:
    if name == "target_session_attrs":  # libpq's words, JDBC's words
        return {"read-write": "primary", "any": "any"}.get(value, value)
    return value
