"""How the settings are told to people: a flag's metavar and help read off a setting's definition,
and the OUTBOX_* variables that no setting reads."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import BeforeValidator, SecretStr

from relay.core.config import SECRETS, PipelineSettings, Settings, env_name
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


def unknown_variables(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The OUTBOX_* variables in `environ` that no setting reads, each with the closest name one
    does (None if nothing is close): a misspelt variable is otherwise silently ignored."""
    known = {
        env_name(f) for f in Settings.model_fields.keys() | PipelineSettings.model_fields.keys()
    }
    known |= {f"{env_name(field)}_FILE" for field in SECRETS}
    return [
        (name, next(iter(difflib.get_close_matches(name, known, n=1, cutoff=0.8)), None))
        for name in sorted(environ)
        if name.startswith("OUTBOX_") and name not in known
    ]
