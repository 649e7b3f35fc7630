"""deploy/ and docker-compose.yml hang together (no Docker engine is needed to check that)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from relay import cli, config

ROOT = Path(__file__).resolve().parents[2]


def compose() -> dict[str, Any]:
    loaded = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def test_compose_services_reference_what_exists() -> None:
    services = compose()["services"]
    assert {"postgres", "rabbitmq", "migrate", "relay"} <= set(services)
    known_settings = {config.env_name(f) for f in config.Settings.model_fields}
    commands = set(cli.main.commands)
    for name, service in services.items():
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        if "build" in service:
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
            assert service["command"][0] in commands
            assert set(service["environment"]) <= known_settings


def test_relay_replicas_wait_for_migrations() -> None:
    relay = compose()["services"]["relay"]
    assert relay["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert relay["deploy"]["replicas"] >= 2


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "deploy/dev test     #" in readme
    assert ci.strip().splitlines()[-1] == "exec deploy/dev test"
