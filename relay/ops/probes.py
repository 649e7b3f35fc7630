"""The relay's HTTP endpoint: /metrics for Prometheus, /livez and /readyz for orchestrators."""

from __future__ import annotations

import errno
import logging
import socketserver
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from relay.core import errors

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
        # prometheus_client's own exposition: gzip when asked, OpenMetrics when the scraper's
        # Accept header prefers it, and `name[]=` filters.
        self._metrics = make_wsgi_app(registry)
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
            result: Iterable[bytes] = self._metrics(environ, start_response)
            return result
        if path in ("/livez", "/readyz"):
            ok, detail = (self._live if path == "/livez" else self._ready)()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "text/plain; charset=utf-8")],
            )
            return [(detail + "\n").encode()]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"try /metrics, /livez or /readyz\n"]


#: A metrics port in use (another replica on this host) moves to one of the next ones.
PORT_TRIES = 10


def listen(probes: Probes, host: str, port: int) -> None:
    """Serve /metrics, /livez and /readyz. A port in use (a second replica on the same host with
    the same settings) never stops a relay from relaying: it takes the next free one of
    PORT_TRIES, or, if all are taken, runs without them, and says so in one line. Any other
    failure to listen is a setting to fix (ConfigError)."""
    tries = [port] if port == 0 else [p for p in range(port, port + PORT_TRIES) if p <= 65535]
    for candidate in tries:
        try:
            bound = probes.start(host, candidate)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                continue
            raise errors.ConfigError(
                f"cannot serve metrics on {host}:{candidate}: {exc.strerror or exc}; "
                "set OUTBOX_METRICS_HOST or OUTBOX_METRICS_PORT"
            ) from None
        where = f"metrics and probes on http://{host}:{bound}/metrics (/livez, /readyz)"
        if candidate == tries[0]:
            log.info("%s", where)
        else:
            log.warning(
                "metrics port %d is in use (another replica on this host?): %s", port, where
            )
        return
    log.error(
        "metrics ports %d to %d are all in use: relaying without /metrics, /livez and /readyz; "
        "give each replica its own OUTBOX_METRICS_PORT",
        tries[0],
        tries[-1],
    )
