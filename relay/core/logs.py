"""Logging set-up: one line per event — JSON for machines, text for terminals — never a message
body (nothing logs one) and never a password (URLs are scrubbed on the way out)."""

from __future__ import annotations

import logging
import sys
from typing import Any

from pythonjsonlogger.json import JsonFormatter

from relay.core import values


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return values.redact_secrets(super().format(record))


class _JsonLines(JsonFormatter):
    """`{"time": …, "level": …, "logger": …, "message": …}` plus the event's own fields
    (message_id, attempt, reason, …) passed to the logger as `extra`."""

    def format(self, record: logging.LogRecord) -> str:
        return values.redact_secrets(super().format(record))


def configure(level: str = "INFO", fmt: str = "auto") -> None:
    """Send the relay's logs to stderr at `level`: JSON lines unless `fmt` is 'text', or is
    'auto' and stderr is a terminal. The AMQP libraries' own chatter is kept out."""
    handler = logging.StreamHandler(sys.stderr)
    as_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    handler.setFormatter(_json() if as_json else _text())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # The AMQP libraries log every dropped connection as an ERROR with a traceback; the relay
    # reports the same outage in one line of its own, so theirs only show at DEBUG.
    quiet = root.level if root.level <= logging.DEBUG else logging.CRITICAL
    for noisy in ("aiormq", "aio_pika"):
        logging.getLogger(noisy).setLevel(quiet)
    # psycopg_pool warns at each failed reconnect; the relay's one outage line says the same.
    logging.getLogger("psycopg.pool").setLevel(quiet if quiet == root.level else logging.ERROR)


def _text() -> logging.Formatter:
    return _TextFormatter(
        "%(asctime)s %(levelname)-7s %(name)s: %(message)s", "%Y-%m-%dT%H:%M:%S%z"
    )


def _json() -> logging.Formatter:
    return _JsonLines(
        "%(asctime)s %(levelname)s %(name)s %(message)s",
        rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        datefmt="%Y-%m-%dT%H:%M:%S%z",
    )


def event(**fields: Any) -> dict[str, Any]:
    """`extra=` for a log call: the event's fields as JSON keys (text logs show the message).
    Numbers, booleans and None stay what they are (a missing ordering key is null, not "None");
    anything else (a UUID, an enum, a time) is its text."""
    return {
        key: value if value is None or isinstance(value, int | float | bool) else str(value)
        for key, value in fields.items()
    }
