"""The README's settings table matches the code: every setting, its flag and its default."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import SecretStr

from relay.cli import commands as cli
from relay.core import config

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| `(OUTBOX_\w+)` \| `(--[\w-]+)` \| `([^`]*)` \| .+ \|$")


def documented() -> dict[str, tuple[str, str]]:
    rows = (ROW.match(line) for line in README.read_text(encoding="utf-8").splitlines())
    return {m[1]: (m[2], m[3]) for m in rows if m}


def test_every_setting_is_documented_with_its_flag_and_default() -> None:
    expected = {}
    fields = config.Settings.model_fields | config.PipelineSettings.model_fields
    for name, field in fields.items():
        default = field.default
        if isinstance(default, SecretStr):
            default = default.get_secret_value()
        shown = "host:pid" if field.default_factory is not None else str(default)
        expected[config.env_name(name)] = (cli.flag(name), shown)
    assert documented() == expected


def test_every_run_flag_is_a_setting() -> None:
    assert set(cli.CONNECTION + cli.RELAY_KNOBS) == set(config.Settings.model_fields)
