"""Every shell, Python and SQL block in the README and the guides is run, or says why not: the
line before it is `<!-- snippet: … -->`, either `run by` this file (then it runs here, as it is
written, against real PostgreSQL), `tested by` a named test, or `not run:` with the reason."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.processes import clean_env

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
LANGUAGES = ("sh", "python", "sql")
MARK = re.compile(r"^<!-- snippet: (run by|tested by|not run:) ?(.*?) -->$")
HERE = "tests/acceptance/test_snippets.py"


@dataclasses.dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    kind: str | None
    note: str
    text: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        inside = False
        for i, line in enumerate(lines):
            if not line.startswith("```"):
                continue
            inside = not inside
            language = line[3:].strip()
            if not inside or language not in LANGUAGES:
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            mark = MARK.match(lines[i - 1]) if i else None
            kind, note = (mark[1], mark[2]) if mark else (None, "")
            text = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Block(page, i + 1, language, kind, note, text))
    return found


def runnable(language: str) -> list[Block]:
    return [b for b in blocks() if b.kind == "run by" and b.language == language]


def test_every_block_is_run_or_says_why() -> None:
    problems = []
    for block in blocks():
        if block.kind is None:
            problems.append(f"{block}: no <!-- snippet: … --> line before it")
        elif block.kind == "not run:" and len(block.note) < 20:
            problems.append(f"{block}: `not run` needs its reason")
        elif block.kind == "run by" and not block.note.startswith(HERE):
            problems.append(f"{block}: run by {block.note}, not by {HERE}")
        elif block.kind == "tested by":
            test = block.note.split(",")[0].split()[0]
            if not (ROOT / test).exists():
                problems.append(f"{block}: tested by {test}, which does not exist")
    assert problems == []
    assert runnable("sql")
    assert runnable("sh")


ORDERS = """
CREATE TABLE public.orders (id integer PRIMARY KEY, status text NOT NULL);
INSERT INTO public.orders VALUES (42, 'new');
"""


@pytest.mark.parametrize("block", runnable("sql"), ids=str)
def test_sql_blocks_run_as_written(block: Block, database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(ORDERS)
    done = subprocess.run(
        ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", database_url],
        input=block.text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(database_url) as conn:
        status = conn.execute("SELECT status FROM public.orders WHERE id = 42").fetchone()
        waiting = conn.execute("SELECT count(*) FROM outbox.messages").fetchone()
    assert status == ("paid",)
    assert waiting is not None
    assert waiting[0] >= 1


# Slow (up to ~8 s, the keys-policy block of docs/guides/ordering-keys.md): each block's commands
# run as written in a shell, one `outbox-relay` process each (five there); the promise is the
# docs' own lines, verbatim.
@pytest.mark.parametrize("block", runnable("sh"), ids=str)
def test_shell_blocks_run_as_written(block: Block, database_url: str) -> None:
    env = clean_env(OUTBOX_DATABASE_URL=database_url)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", "-e", "-c", block.text],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
