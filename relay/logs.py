"""Logging set-up for the command line: one line per event, never a body or a password."""

from __future__ import annotations

import logging
import sys

from relay import config


class _RedactingFormatter(logging.Formatter):
    """Scrubs any `scheme://user:password@` that found its way into a message or a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        return config.redact_secrets(super().format(record))


def configure(level: str = "INFO") -> None:
    """Send the relay's logs to stderr at `level`; quieten the libraries' chatter."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _RedactingFormatter(
            "%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S%z"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The AMQP libraries log every dropped connection as an ERROR with a traceback; the relay
    # reports the same outage in one line of its own, so theirs only show at DEBUG.
    quiet = root.level if root.level <= logging.DEBUG else logging.CRITICAL
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(quiet)
    logging.getLogger("psycopg.pool").setLevel(max(logging.WARNING, root.level))
