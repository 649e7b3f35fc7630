"""The documentation is a product: the generated reference matches the code, every relative link
and anchor resolves, and every page stays short enough to read (README ≤ 400 lines, a guide ≤ 400,
a decision record ≤ 200; the generated reference has no limit)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from relay.cli import commands as cli
from relay.core import config
from tests.support import reference

ROOT = Path(__file__).resolve().parents[2]
TOP = ("README.md", "DEVELOPERS.md", "ARCHITECTURE.md", "CHANGELOG.md")
PAGES = sorted([*(ROOT / name for name in TOP), *(ROOT / "docs").rglob("*.md")])
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("name", sorted(reference.PAGES))
def test_the_reference_is_what_the_code_says(name: str) -> None:
    page = reference.OUT / name
    assert page.exists(), f"docs/reference/{name} is missing: python -m tests.support.reference"
    assert page.read_text(encoding="utf-8") == reference.PAGES[name](), (
        f"docs/reference/{name} is not what the code says: write it again with "
        "`.venv/bin/python -m tests.support.reference`"
    )


def test_the_commands_page_is_the_same_after_the_commands_ran() -> None:
    """click caches a command's help option when it first builds it, with the names its context
    had then: a page rendered without each command's parents changed once a test had run the
    command in this process (as one worker's order did: `-h, --help` against `--help`)."""
    from click.testing import CliRunner

    for ctx in list(reference.contexts(cli.main, "outbox-relay"))[1:]:
        CliRunner().invoke(cli.main, [*ctx.command_path.split()[1:], "--help"])
    assert reference.commands() == (reference.OUT / "commands.md").read_text(encoding="utf-8")


def test_every_run_flag_is_a_setting() -> None:
    assert set(cli.CONNECTION + cli.RELAY_KNOBS) == set(config.Settings.model_fields)


def test_every_setting_is_in_the_reference() -> None:
    text = (reference.OUT / "settings.md").read_text(encoding="utf-8")
    fields = config.Settings.model_fields | config.PipelineSettings.model_fields
    missing = [config.env_name(f) for f in fields if f"`{config.env_name(f)}`" not in text]
    assert missing == []


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_and_anchor_resolves() -> None:
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert broken == []


def test_pages_stay_short() -> None:
    long = []
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").count("\n")
        relative = page.relative_to(ROOT)
        if relative.parts[:2] == ("docs", "reference") or page.name == "CHANGELOG.md":
            continue
        limit = 200 if relative.parts[:2] == ("docs", "decisions") else 400
        if lines > limit:
            long.append(f"{relative}: {lines} lines (at most {limit})")
    assert long == []


def test_the_changelog_keeps_a_changelog() -> None:
    """Keep a Changelog: versions newest first, each kind once per version, and an [Unreleased]
    short enough to read before an upgrade."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.split(r"^## ", text, flags=re.M)[1:]
    assert versions[0].startswith("[Unreleased]")
    assert versions[0].count("\n") <= 80, "[Unreleased] says what a user notices, in 80 lines"
    kinds = {"Upgrading", "Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
    for version in versions:
        title = version.splitlines()[0]
        headings = re.findall(r"^### (.+)$", version, re.M)
        assert len(headings) == len(set(headings)), f"{title}: a kind twice"
        assert set(headings) <= kinds, f"{title}: {set(headings) - kinds}"
