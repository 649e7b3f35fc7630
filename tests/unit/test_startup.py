"""The command line starts light: help and shell completion read the settings from
relay/console/settings.json (checked here against the models) and load no driver, no pydantic and
no rich, which the commands import when they run (issue 20: a second for `--help`, before)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from relay.console import settings

#: What a command imports when it runs and its help must not: together, nearly all of a second.
HEAVY = (
    "aio_pika",
    "aiormq",
    "asyncio",
    "pamqp",
    "prometheus_client",
    "psycopg",
    "psycopg_pool",
    "pydantic",
    "pydantic_core",
    "pydantic_settings",
    "pyspark",
    "rich",
)

#: Run in a fresh interpreter: the help of every command and group, a completion and the warning
#: about a misspelt variable; then what was imported.
HELP_EVERYWHERE = """
import json, sys
import click
from click.testing import CliRunner
from relay.cli.commands import main

def paths(group, prefix):
    for name, command in group.commands.items():
        yield [*prefix, name]
        if isinstance(command, click.Group):
            yield from paths(command, [*prefix, name])

runner = CliRunner()
said = {}
for path in [[], *paths(main, [])]:
    result = runner.invoke(main, [*path, "--help"], prog_name="outbox-relay")
    said[" ".join(path)] = (result.exit_code, result.stdout)
complete = {"_OUTBOX_RELAY_COMPLETE": "bash_complete", "COMP_WORDS": "outbox-relay de"}
result = runner.invoke(main, [], prog_name="outbox-relay", env={**complete, "COMP_CWORD": "1"})
said["completion"] = (result.exit_code, result.stdout)
result = runner.invoke(main, ["--help"], prog_name="outbox-relay", env={"OUTBOX_BATCH_SIZ": "1"})
said["warning"] = (result.exit_code, result.stderr)
print(json.dumps({"said": said, "loaded": sorted(sys.modules)}))
"""


def test_the_settings_file_is_what_the_models_say() -> None:
    assert Path(settings.FILE).read_text(encoding="utf-8") == settings.generate(), (
        "relay/console/settings.json is not what relay/core/config.py says: write it again with "
        "`.venv/bin/python -m relay.console.settings`"
    )


def test_help_and_completion_load_no_driver_no_pydantic_no_rich() -> None:
    ran = subprocess.run(
        [sys.executable, "-c", HELP_EVERYWHERE],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    report = json.loads(ran.stdout)
    said = report.pop("said")
    for command in ("", "run", "dead list", "keys policy set", "pipeline export", "keys forget"):
        code, text = said[command]
        assert code == 0, command
        assert text.startswith(f"Usage: outbox-relay {command}".rstrip()), command
    assert "--batch-size INTEGER" in said["run"][1]
    assert "--lake TEXT" in said["pipeline export"][1]
    assert said["completion"] == [0, "plain,dead\nplain,demo\n"]
    assert "did you mean OUTBOX_BATCH_SIZE?" in said["warning"][1]
    assert all(code == 0 for code, _ in said.values())
    loaded = {name.split(".")[0] for name in report["loaded"]}
    assert sorted(loaded & set(HEAVY)) == []
