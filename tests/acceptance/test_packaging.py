"""The wheel: built here, installed into a fresh virtualenv, and run from outside the source tree,
so `pip install outbox-relay && outbox-relay migrate` needs nothing but the wheel."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import venv
import zipfile
from pathlib import Path

import psycopg
import pytest

import relay
from tests.support.amqp import Broker
from tests.support.processes import clean_env

ROOT = Path(__file__).resolve().parents[2]
Completed = subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(ROOT)],
        check=True,
        timeout=300,
    )
    (built,) = out.glob("outbox_relay-*.whl")
    return built


def test_the_wheel_carries_migrations_queries_and_type_hints(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    migrations = sorted(p.name for p in (ROOT / "sql").glob("*.sql"))
    assert {f"relay/migrations/{m}" for m in migrations} <= names
    roles = ("relay", "producer", "migrate", "admin", "pipeline", "locks", "console")
    queries = {f"relay/postgres/queries/{n}.sql" for n in roles}
    shipped = {"relay/postgres/roles.sql", "relay/py.typed", "relay/console/settings.json"}
    shipped |= {"relay/web/templates/base.html", "relay/web/static/htmx.min.js"}
    assert queries | shipped <= names
    assert not any(n.startswith("tests/") for n in names)
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    extras = {
        line.split(":", 1)[1].strip()
        for line in zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
        if line.startswith("Provides-Extra:")
    }
    assert {"sqlalchemy", "otel", "spark", "web"} <= extras
    assert "dev" not in extras  # the project's tools are a dependency group, not a user's extra
    fields = zipfile.ZipFile(wheel).read(metadata).decode().splitlines()
    assert f"Version: {relay.__version__}" in fields  # one source: relay/__init__.py
    assert any(line.startswith("Requires-Dist: aiormq") for line in fields)
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`outbox-relay` of a fresh virtualenv holding the wheel and its dependencies only.
    This venv's pip installs them there (`--python`): what gets installed is the same as with a
    pip of its own, without the ~4 s of ensurepip; `--no-compile` spares byte-compiling every
    dependency (16-18 s -> 4-5 s for the whole fixture, 3 pairs)."""
    home = tmp_path_factory.mktemp("venv")
    venv.create(home, with_pip=False)
    python = str(home / "bin" / "python")
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile"]
    subprocess.run([*pip, str(wheel)], check=True, timeout=600)
    return home / "bin" / "outbox-relay"


def outbox_relay(command: Path, env: dict[str, str], *args: str) -> Completed:
    """Run the installed command from an empty folder: nothing of the source tree can be found."""
    with tempfile.TemporaryDirectory() as empty:
        return subprocess.run(
            [str(command), *args],
            cwd=empty,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )


# Slow (~5 s): the module's `installed` fixture: a fresh virtualenv, and `pip install` of the wheel
# with its dependencies; the promise is what a user's `pip install outbox-relay` gets.
def test_the_installed_wheel_leaves_the_extras_out(installed: Path) -> None:
    """So the test below shows the relay migrating and running without any of them."""
    python = str(installed.parent / "python")
    for optional in ("opentelemetry", "sqlalchemy", "pyspark", "starlette", "uvicorn"):
        probe = subprocess.run(
            [python, "-c", f"import {optional}"], capture_output=True, check=False
        )
        assert probe.returncode != 0, f"{optional} is installed without its extra"


async def test_installed_wheel_migrates_and_relays(
    installed: Path, empty_database_url: str, amqp_url: str, broker: Broker
) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=empty_database_url, OUTBOX_AMQP_URL=amqp_url)
    env.pop("PYTHONPATH", None)
    migrated = await asyncio.to_thread(outbox_relay, installed, env, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert "0001_tables" in migrated.stdout
    await broker.declare(binding="wheel.#")
    with psycopg.connect(empty_database_url) as conn:
        conn.execute("SELECT outbox.enqueue(%s, 'wheel.ok', 'from the wheel')", [broker.exchange])
    ran = await asyncio.to_thread(outbox_relay, installed, env, "run", "--until-empty")
    assert ran.returncode == 0, ran.stderr
    assert [m.body for m in await broker.collect(1)] == [b"from the wheel"]


def test_the_console_without_its_extra_says_how_to_get_it(
    installed: Path, database_url: str
) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url)
    env.pop("PYTHONPATH", None)
    result = outbox_relay(installed, env, "console")
    assert result.returncode == 2, result.stderr
    assert "pip install 'outbox-relay[web]'" in result.stderr
    assert "Traceback" not in result.stderr
