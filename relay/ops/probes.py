"""The relay's HTTP endpoint: /metrics for Prometheus, /livez and /readyz for orchestrators."""

from __future__ import annotations

import logging
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger("relay.probes")  # the name log lines carry: as before the folders

Verdict = Callable[[], tuple[bool, str]]
StartResponse = Callable[[str, list[tuple[str, str]]], Any]


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # the stdlib's name
        """No access log: probes hit this every few seconds."""


class Probes:
    """Serves the metrics of `registry` and the two probes on a thread of its own, so a busy
    event loop never makes a scrape or a probe time out."""

    def __init__(self, registry: CollectorRegistry, live: Verdict, ready: Verdict) -> None:
        self._registry = registry
        self._live = live
        self._ready = ready
        self._server: WSGIServer | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on host:port (port 0: any free one); return the port. OSError if taken."""
        self._server = make_server(
            host, port, self._app, server_class=_ThreadingServer, handler_class=_Quiet
        )
        # A short poll, so that stop() — at every relay exit — does not wait half a second.
        threading.Thread(
            target=self._server.serve_forever, args=(0.05,), name="outbox-probes", daemon=True
        ).start()
        return int(self._server.server_port)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _app(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
            return [generate_latest(self._registry)]
        if path in ("/livez", "/readyz"):
            ok, detail = (self._live if path == "/livez" else self._ready)()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8")],
            )
            return [(detail + "\n").encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"try /metrics, /livez or /readyz\n"]
