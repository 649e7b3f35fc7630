"""A relay process traced the way operators run it: `opentelemetry-instrument outbox-relay run`,
configured only by OTEL_* variables, exports a publish span linked to the producer's span."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry import trace

import relay
from tests.support.amqp import Broker
from tests.support.processes import RelayProcess, clean_env
from tests.support.tracing import recorded_spans

pytestmark = pytest.mark.slow


def exported_spans(output: str) -> list[dict[str, Any]]:
    """The console exporter's spans: multi-line JSON objects between a lone `{` and `}`."""
    spans, block = [], None
    for line in output.splitlines():
        if line == "{":
            block = [line]
        elif block is not None:
            block.append(line)
            if line == "}":
                spans.append(json.loads("\n".join(block)))
                block = None
    return spans


async def test_an_instrumented_relay_exports_a_linked_publish_span(
    database_url: str, amqp_url: str, broker: Broker
) -> None:
    recorded_spans()  # the producer's spans need a recording SDK in this process
    await broker.declare(binding="#")
    with psycopg.connect(database_url) as conn:
        with trace.get_tracer("shop").start_as_current_span("place order") as producing:
            message_id = relay.enqueue(conn, broker.exchange, "order.placed", {"n": 1})
        conn.commit()
    producer = producing.get_span_context()
    env = clean_env(
        OUTBOX_DATABASE_URL=database_url,
        OUTBOX_AMQP_URL=amqp_url,
        OTEL_SERVICE_NAME="outbox-relay-test",
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    instrument = str(Path(sys.executable).parent / "opentelemetry-instrument")
    with RelayProcess(env, launcher=[instrument]) as proc:
        proc.wait_ready()
        proc.wait_for(f'"trace_id": "0x{producer.trace_id:032x}"')
        assert proc.stop() == 0
        output = proc.output
    (received,) = await broker.collect(1)
    assert received.message_id == str(message_id)

    (span,) = [s for s in exported_spans(output) if s["name"] == f"publish {broker.exchange}"]
    assert span["kind"] == "SpanKind.PRODUCER"
    assert span["attributes"]["messaging.message.id"] == str(message_id)
    assert span["attributes"]["outbox.outcome"] == "acked"
    assert [link["context"] for link in span["links"]] == [
        {
            "trace_id": f"0x{producer.trace_id:032x}",
            "span_id": f"0x{producer.span_id:016x}",
            "trace_state": "[]",
        }
    ]
    assert span["context"]["trace_id"] != f"0x{producer.trace_id:032x}"
    assert span["resource"]["attributes"]["service.name"] == "outbox-relay-test"
