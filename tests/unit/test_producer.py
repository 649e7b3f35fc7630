"""How the Python producer API turns a body into bytes and a content type."""

from __future__ import annotations

import pytest

from relay.core import errors
from relay.postgres import producer


@pytest.mark.parametrize(
    ("body", "payload", "content_type"),
    [
        (b"\x00raw", b"\x00raw", None),
        (bytearray(b"ba"), b"ba", None),
        (memoryview(b"mv"), b"mv", None),
        ("héllo", "héllo".encode(), "text/plain; charset=utf-8"),
        ({"a": [1, None]}, b'{"a":[1,null]}', "application/json"),
        ([1, "two"], b'[1,"two"]', "application/json"),
    ],
)
def test_encode_body(body: producer.Body, payload: bytes, content_type: str | None) -> None:
    assert producer.encode_body(body) == (payload, content_type)


def test_non_json_values_are_refused() -> None:
    with pytest.raises(errors.InvalidMessage, match="not JSON-serialisable"):
        producer.encode_body({"x": {1, 2}})
    with pytest.raises(errors.InvalidMessage):
        producer.encode_body({"x": float("inf")})


def test_other_types_are_refused() -> None:
    with pytest.raises(TypeError, match="body must be bytes, str, dict or list"):
        producer.encode_body(3.14)  # type: ignore[arg-type]
