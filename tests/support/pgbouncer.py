"""A real PgBouncer in transaction pooling mode, in front of the test PostgreSQL, on a free port."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.support.processes import end
from tests.support.wait import until

BINARY = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _accepting(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


@contextlib.contextmanager
def pgbouncer(database_url: str, *, pool_size: int = 10) -> Iterator[str]:
    """Start PgBouncer (`pool_mode = transaction`) in front of `database_url`'s server; yield the
    same URL through it. Skips the test where PgBouncer is not installed (`deploy/dev test`
    installs it from Debian)."""
    if not os.path.exists(BINARY):
        pytest.skip("pgbouncer not installed (deploy/dev test installs Debian's pgbouncer)")
    target = urlsplit(database_url)
    user = target.username or "postgres"
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="pgbouncer-") as folder:
        here = Path(folder)
        (here / "users.txt").write_text(f'"{user}" ""\n')
        (here / "pgbouncer.ini").write_text(
            f"""[databases]
* = host={target.hostname or "127.0.0.1"} port={target.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {here / "users.txt"}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 500
ignore_startup_parameters = extra_float_digits,options
logfile = {here / "pgbouncer.log"}
"""
        )
        command = [BINARY, "-q", str(here / "pgbouncer.ini")]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            runner = pwd.getpwnam("postgres")
            os.chown(folder, runner.pw_uid, runner.pw_gid)
            for name in ("users.txt", "pgbouncer.ini"):
                os.chown(here / name, runner.pw_uid, runner.pw_gid)
            command[1:1] = ["-u", "postgres"]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        try:
            until(
                lambda: _accepting(port) or process.poll() is not None,
                timeout=15,
                message="PgBouncer to listen",
            )
            if process.poll() is not None:
                out = process.stdout.read().decode() if process.stdout else ""
                raise AssertionError(f"PgBouncer did not start: {out}")
            credentials = target.netloc.rpartition("@")[0] or user
            yield target._replace(netloc=f"{credentials}@127.0.0.1:{port}").geturl()
        finally:
            end(process)
