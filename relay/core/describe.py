"""How the settings are told to people: a flag's metavar and help read off a setting's definition,
and the table of every setting and variable that the command line reads instead of the models
(relay/console/settings.json, written by `python -m relay.console.settings`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import BeforeValidator, SecretStr

from relay.core.config import SECRETS, PipelineSettings, Settings, env_name, flag_name
from relay.core.values import parse_duration, redact_url


@dataclasses.dataclass(frozen=True, slots=True)
class Described:
    """What a user is told about a setting, all of it read off its definition."""

    metavar: str  # INTEGER, SECONDS, BOOLEAN, PATH, URL or TEXT
    help: str  # the description, then [default …; range …; env: OUTBOX_…]


def describe(field: str) -> Described:
    """A setting of Settings or PipelineSettings as a flag's help shows it: its type, its default
    (secrets' passwords redacted), its range, and its environment variable."""
    info = Settings.model_fields.get(field) or PipelineSettings.model_fields[field]
    durations = any(
        isinstance(m, BeforeValidator) and m.func is parse_duration for m in info.metadata
    )
    kind = info.annotation
    if durations:
        metavar = "SECONDS"
    elif kind is bool:
        metavar = "BOOLEAN"
    elif kind is int:
        metavar = "INTEGER"
    elif kind is SecretStr:
        metavar = "URL"
    elif field.endswith(("_file", "_jar", "_dir")):
        metavar = "PATH"
    else:
        metavar = "TEXT"
    facts = []
    if info.default_factory is None and info.default is not None:  # else the description says
        default = info.default
        if isinstance(default, SecretStr):
            default = redact_url(default.get_secret_value())
        elif durations:
            default = f"{default:g}"
        elif isinstance(default, bool):
            default = str(default).lower()
        facts.append(f"default: {default}")
    facts.extend(_bounds(info.metadata))
    if durations:
        facts.append("or 250ms, 30s, 5m, 2h, 7d")
    facts.append(f"env: {env_name(field)}")
    return Described(metavar, f"{info.description} [{'; '.join(facts)}]")


def _bounds(metadata: list[Any]) -> list[str]:
    """pydantic's range constraints, in words: `≥ 1`, `≤ 10000`, `> 0`."""
    said = []
    for item in metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            bound = getattr(item, attr, None)
            if bound is not None:
                said.append(f"{sign} {bound}")
    return said


def table() -> dict[str, Any]:
    """Every setting as the command line tells it, in the order the models define them (Settings',
    then the pipeline's own): its flag, metavar, help, variable and the models that have it; and
    every OUTBOX_* variable some setting reads, the `_FILE` ones of secrets included."""
    models = {"Settings": Settings.model_fields, "PipelineSettings": PipelineSettings.model_fields}
    fields = dict.fromkeys(field for known in models.values() for field in known)
    settings = []
    for field in fields:
        told = describe(field)
        settings.append(
            {
                "field": field,
                "flag": flag_name(field),
                "env": env_name(field),
                "metavar": told.metavar,
                "help": told.help,
                "models": [name for name, known in models.items() if field in known],
            }
        )
    variables = {env_name(field) for field in fields}
    variables |= {f"{env_name(field)}_FILE" for field in SECRETS}
    return {"settings": settings, "variables": sorted(variables)}
