"""README's "Your first message", run as it is written: the first `sh` block under that heading,
in a copy of the source tree, with a fresh virtualenv, against the local PostgreSQL and RabbitMQ
the block names. What a newcomer copies is what CI runs."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import aio_pika
import psycopg
import pytest

from tests.support import services
from tests.support.processes import clean_env

ROOT = Path(__file__).resolve().parents[2]
#: What the block uses, by name: cleared before and after, so that a run starts as a new user's.
DATABASE, EXCHANGE, QUEUE = "first_message", "orders", "orders.audit"
#: What `pip install .` needs of the tree.
TREE = ("pyproject.toml", "README.md", "LICENSE", "relay", "sql")

pytestmark = pytest.mark.slow


def first_message_block() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Your first message\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"^```sh\n(.*?)^```$", section, re.S | re.M)
    assert block is not None, "README's first-message section has no sh block"
    return block[1]


def test_the_block_is_short_and_early() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert readme.index("## Your first message") < 80
    commands = [
        line
        for line in re.sub(
            r"<<'EOF'.*?^EOF$", "<<'EOF'", first_message_block(), flags=re.S | re.M
        ).splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert len(commands) <= 15, commands


def _clear(svc: services.Services) -> None:
    with psycopg.connect(svc.database_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{DATABASE}" WITH (FORCE)')

    async def topology() -> None:
        connection = await aio_pika.connect(svc.amqp_url)
        async with connection:
            channel = await connection.channel()
            await channel.queue_delete(QUEUE)
            await channel.exchange_delete(EXCHANGE)

    asyncio.run(topology())


# Slow (~19 s): the block's own `python3 -m venv` and `pip install .` (the build and every
# dependency) before its few commands; the promise is that the block runs as written, verbatim.
def test_your_first_message_runs_as_written(svc: services.Services, tmp_path: Path) -> None:
    if not (
        svc.database_url.startswith("postgresql://postgres@127.0.0.1:5432/")
        and svc.amqp_url.startswith("amqp://guest:guest@127.0.0.1:5672")
    ):
        pytest.skip("the README's block names the local servers; these tests use others")
    for name in TREE:
        source = ROOT / name
        copy = shutil.copytree if source.is_dir() else shutil.copy2
        copy(source, tmp_path / name)
    _clear(svc)
    try:
        done = subprocess.run(
            ["bash", "-e", "-c", first_message_block()],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert 'order.paid {"order_id": 42}' in done.stdout.splitlines(), done.stdout
    finally:
        _clear(svc)
