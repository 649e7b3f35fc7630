"""`outbox-relay console`: the web console (the `[web]` extra), and its users file."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from relay.console.options import DATABASE, fail_cleanly, settings_options
from relay.core import errors

#: Where the console listens unless told: this machine only.
HOST, PORT = "127.0.0.1", 8089


@click.group(invoke_without_command=True)
@click.option("--host", default=HOST, show_default=True, help="The address to listen on.")
@click.option("--port", default=PORT, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--users-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Ask for a login (HTTP Basic) against this file of `name:scrypt$…` lines "
    "(`console add-user` writes it). Needed to listen beyond loopback, unless --trusted-header.",
)
@click.option(
    "--trusted-header",
    default=None,
    metavar="NAME",
    help="Take the person from this request header, set by an authenticating reverse proxy "
    "in front (e.g. X-Forwarded-User). Only safe when nothing else can reach the console.",
)
@click.option("--read-only", is_flag=True, help="No buttons; every change refused.")
@settings_options(*DATABASE, "log_level")
@click.pass_context
@fail_cleanly
def console(
    ctx: click.Context,
    /,
    host: str,
    port: int,
    users_file: Path | None,
    trusted_header: str | None,
    read_only: bool,
    **flags: Any,
) -> None:
    """Serve the web console: what waits, what died, which keys are held; bulk replay.

    It acts as the database login it connects with: as a viewer role's login it only reads."""
    if ctx.invoked_subcommand is not None:
        return
    from relay.core import config, logs
    from relay.web import security

    if users_file is not None and trusted_header is not None:
        raise errors.ConfigError("give --users-file or --trusted-header, not both")
    users = security.read_users(users_file) if users_file is not None else None
    access = security.Access(users, trusted_header)
    if access.open and not security.loopback(host):
        raise errors.ConfigError(
            f"the console would listen on {host} with no login: give --users-file (or "
            "--trusted-header behind a proxy that logs people in), or listen on 127.0.0.1"
        )
    settings = config.load(**flags)
    logs.configure(settings.log_level, settings.log_format)
    _serve(settings, host, port, access, read_only)


def _serve(settings: Any, host: str, port: int, access: Any, read_only: bool) -> None:
    try:
        import uvicorn

        from relay.web import app
    except ImportError as exc:
        raise errors.ConfigError(
            f"the console needs the web extra ({exc.name} is missing): "
            "pip install 'outbox-relay[web]'"
        ) from None
    web = app.create_app(
        app.Config(
            settings.database_url.get_secret_value(),
            settings.db_schema,
            pooled=settings.transaction_pooler,
            read_only=read_only,
            access=access,
        )
    )
    click.echo(f"outbox-relay console on http://{host}:{port}/ (schema {settings.db_schema})")
    uvicorn.run(web, host=host, port=port, log_level="warning", access_log=False)


@console.command(name="add-user")
@click.argument("name")
@click.option(
    "--users-file",
    "path",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The file to add the user to (created, readable by its owner only).",
)
@fail_cleanly
def add_user(name: str, path: Path) -> None:
    """Add NAME to a users file, or change its password. The password is read from the
    terminal (asked twice), or from the first line of standard input: never from a flag."""
    from relay.web import security

    security.check_name(name)
    if sys.stdin.isatty():
        password = click.prompt("password", hide_input=True, confirmation_prompt=True)
    else:
        password = sys.stdin.readline().rstrip("\n")
    new = security.add_user(path, name, password)
    click.echo(f"{'added' if new else 'changed the password of'} {name} in {path}")
