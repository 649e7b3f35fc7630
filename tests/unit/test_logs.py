"""Log lines as machines read them: one JSON object each, with the event's own fields typed."""

from __future__ import annotations

import json
import logging
import uuid

from relay.core import logs


def test_an_events_fields_keep_their_json_types_and_none_is_null() -> None:
    message_id = uuid.uuid4()
    record = logging.LogRecord(
        "relay.loop", logging.WARNING, __file__, 1, "dead-lettered", (), None
    )
    fields = logs.event(
        event="dead_lettered", message_id=message_id, attempt=3, ordering_key=None, retried=False
    )
    record.__dict__.update(fields)
    line = json.loads(logs._json().format(record))
    assert line["logger"] == "relay.loop"
    assert line["message_id"] == str(message_id)
    assert (line["attempt"], line["ordering_key"], line["retried"]) == (3, None, False)


def test_passwords_never_reach_a_log_line() -> None:
    record = logging.LogRecord(
        "relay.app", logging.ERROR, __file__, 1, "cannot reach %s", ("amqp://u:hunter2@h/",), None
    )
    for formatter in (logs._json(), logs._text()):
        assert "hunter2" not in formatter.format(record)
