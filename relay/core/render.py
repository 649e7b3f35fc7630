"""Stored bytes and text made safe to print: bodies as text or base64, control codes escaped."""

from __future__ import annotations

import base64
import dataclasses

_LAYOUT = frozenset("\n\r\t")


@dataclasses.dataclass(frozen=True, slots=True)
class Body:
    """A message body for people: `text` is the body itself when it is printable UTF-8, else
    its base64; `truncated` when `text` stops short of the whole."""

    encoding: str  # "utf-8" or "base64"
    bytes: int
    text: str
    truncated: bool


def body(raw: bytes, limit: int | None = None) -> Body:
    """`raw` as printable text, cut to `limit` characters unless None."""
    try:
        text = raw.decode("utf-8")
        encoding = "utf-8"
        if not all(c.isprintable() or c in _LAYOUT for c in text):
            raise ValueError("not printable")
    except ValueError:  # UnicodeDecodeError is one
        text = base64.b64encode(raw).decode("ascii")
        encoding = "base64"
    truncated = limit is not None and len(text) > limit
    return Body(encoding, len(raw), text[:limit] if truncated else text, truncated)


def printable(text: str) -> str:
    """`text` with every character a terminal would act on (escapes, newlines) spelt out."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


def count(n: int, noun: str) -> str:
    """`1 row`, `1,000 rows`."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")
