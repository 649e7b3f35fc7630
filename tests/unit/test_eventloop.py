"""The relay's event loop: uvloop when installed or asked for, asyncio's own on request."""

from __future__ import annotations

import asyncio
import importlib

import pytest

from relay.core import config, errors, eventloop


def test_auto_runs_on_uvloop_when_it_is_installed() -> None:
    pytest.importorskip("uvloop")
    assert eventloop.run(_name(), "auto") == "uvloop"
    assert eventloop.run(_name(), "uvloop") == "uvloop"


def test_asyncio_is_asyncios_own_loop() -> None:
    assert eventloop.run(_name(), "asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.import_module

    def missing(name: str, package: str | None = None) -> object:
        if name == "uvloop":
            raise ImportError(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", missing)
    assert eventloop.run(_name(), "auto") == "asyncio"
    with pytest.raises(errors.ConfigError, match="uvloop is not installed"):
        eventloop.run(_name(), "uvloop")


def test_the_setting_names_a_known_loop() -> None:
    assert config.load(event_loop="UVLOOP").event_loop == "uvloop"
    with pytest.raises(errors.ConfigError, match="--event-loop: use auto, uvloop or asyncio"):
        config.load(event_loop="trio")


async def _name() -> str:
    await asyncio.sleep(0)
    return eventloop.name()
