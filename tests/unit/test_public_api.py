"""The public surface, exactly: what README tells users to import (the producer functions, the
operators' Admin, the consumers' helpers, dead-letter filters, the errors they raise, settings for
the pipeline from Python). A name added or removed here is a change for users (CHANGELOG.md);
where the code behind it lives is not."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

import relay

SURFACE = {
    "relay": [
        "Message",
        "__version__",
        "enqueue",
        "enqueue_async",
        "enqueue_many",
        "enqueue_many_async",
    ],
    "relay.admin": [
        "Admin",
        "ArchiveStats",
        "BlockedKey",
        "DeadGroup",
        "DeadMessage",
        "DeadRow",
        "KeyPolicy",
    ],
    "relay.config": ["PipelineSettings", "Settings", "load", "load_pipeline"],
    "relay.consumer": ["Delivered", "Inbox", "Problem", "SequenceChecker"],
    "relay.errors": [
        "BrokerRefused",
        "BrokerUnavailable",
        "ConfigError",
        "DatabaseRefused",
        "DatabaseUnavailable",
        "DuplicateMessage",
        "InvalidArgument",
        "InvalidMessage",
        "InvalidMessageType",
        "MigrationError",
        "Refused",
        "RelayError",
        "SchemaMissing",
        "TransientError",
    ],
    "relay.filters": ["DeadFilter", "glob_to_like", "when"],
}
HOMES = {
    "relay": "relay.postgres.producer",
    "relay.admin": "relay.postgres.admin",
    "relay.config": "relay.core.config",
    "relay.consumer": "relay.postgres.consumer",
    "relay.errors": "relay.core.errors",
    "relay.filters": "relay.core.filters",
}


@pytest.mark.parametrize("module", sorted(SURFACE))
def test_each_public_module_exports_exactly_its_names(module: str) -> None:
    public = importlib.import_module(module)
    assert sorted(public.__all__) == SURFACE[module]
    home = importlib.import_module(HOMES[module])
    for name in SURFACE[module]:
        if name != "__version__":
            assert getattr(public, name) is getattr(home, name), name


def test_the_command_is_the_cli_groups_entry_point() -> None:
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="outbox-relay")
    assert script.value == "relay.cli:main"
    assert callable(script.load())


def test_producers_import_no_settings_library() -> None:
    """`relay.enqueue` is imported by applications: it loads psycopg, not pydantic (whose import
    took ~100 ms of the ~260 ms before schema names were checked outside relay.core.config)."""
    probe = (
        "import sys, relay; relay.enqueue; print(sorted(m for m in sys.modules if 'pydantic' in m))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_version_is_past_every_release_the_changelog_names() -> None:
    """0.2.0 shipped saying 0.1.0 (`outbox-relay --version`, the wheel's metadata): the version
    must be above the newest released section, and a development one while [Unreleased] holds
    changes."""
    changelog = (Path(__file__).resolve().parents[2] / "CHANGELOG.md").read_text()
    released = [Version(v) for v in re.findall(r"^## \[(\d+\.\d+\.\d+)\]", changelog, re.M)]
    version = Version(relay.__version__)
    assert released
    assert version > max(released), f"{version} is not past the newest release {max(released)}"
    assert version.is_devrelease, f"{version}: [Unreleased] holds changes, so a .dev version"
