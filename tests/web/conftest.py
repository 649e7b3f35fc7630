"""`web`: the console under Starlette's test client (tests/web/support.py). `serving`: the
console served for real (uvicorn on a port the OS gives, in a thread of its own), and `browser`:
a headless Chromium, the machine's own (Debian's `chromium`; deploy/dev installs it), driven by
Playwright. Without that browser the browser tests fail: they never skip."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn
from playwright.async_api import Browser, async_playwright
from starlette.testclient import TestClient

from relay.web import app
from tests.support.wait import until
from tests.web.support import client


@contextlib.contextmanager
def serving(config: app.Config, host: str = "127.0.0.1") -> Iterator[tuple[str, app.Console]]:
    """The console on `host`, at a port the OS chose; its base URL, and its state (for a test
    that forges what only the server knows, such as a CSRF token)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    application = app.create_app(config)
    server = uvicorn.Server(uvicorn.Config(application, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        until(lambda: server.started, timeout=30, message="the console to start")
        yield f"http://127.0.0.1:{port}", application.state.console
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        raise AssertionError(
            "no chromium on PATH: the browser tests need Debian's chromium (deploy/dev test "
            "installs it: apt-get install chromium)"
        )
    return found


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    args = ["--no-sandbox"] if os.geteuid() == 0 else []  # Chromium's sandbox refuses root
    async with async_playwright() as p:
        launched = await p.chromium.launch(executable_path=chromium(), args=args)
        try:
            yield launched
        finally:
            await launched.close()


@pytest.fixture
def web(database_url: str) -> Iterator[TestClient]:
    with client(database_url) as c:
        yield c


def config(database_url: str, **changes: Any) -> app.Config:
    return app.Config(database_url, refresh_seconds=1, **changes)
