"""Plain values checked and converted: schema names (before they are quoted into SQL), durations,
and passwords taken out of text. Standard library only, so the producer's and the SQL loader's
imports stay light (pydantic is config's)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from relay.core import errors

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,58}")
_DURATION = re.compile(r"\s*(-?(?:\d+(?:\.\d*)?|\.\d+))\s*(ms|s|m|h|d)?\s*")
_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)\S*@")
#: libpq's key/value form (`password=…`, quoted or not) and a URL's `password=` parameter; also
#: `sslpassword`, the client key's passphrase.
_KEYWORD_PASSWORD = re.compile(
    r"(\b(?:ssl)?password\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s&'#]+)", re.IGNORECASE
)
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def check_identifier(name: str) -> str:
    """Return `name` if it is a safe schema name, else raise ConfigError saying why."""
    if not _IDENTIFIER.fullmatch(name):
        raise errors.ConfigError(
            f"invalid schema name {name!r}: use letters, digits and underscores, "
            "starting with a letter or underscore, at most 59 characters"
        )
    if name.lower().startswith("pg_"):
        raise errors.ConfigError(f"invalid schema name {name!r}: the pg_ prefix is reserved")
    return name


def parse_duration(value: Any) -> float:
    """Seconds from a number or a string such as `250ms`, `30s`, `5m`, `2h`, `7d`."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    match = _DURATION.fullmatch(str(value))
    if match is None:
        raise ValueError(f"not a duration: {value!r} (examples: 1.5, 250ms, 30s, 5m, 2h, 7d)")
    return float(match.group(1)) * _UNITS[match.group(2)]


def redact_url(url: str) -> str:
    """The URL with any password replaced by `***`, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def redact_secrets(text: str) -> str:
    """`text` with every password in it replaced by `***`: a URL's (`scheme://user:pw@`, or its
    `?password=` parameter) and libpq's key/value form (`password=pw`, `password = 'p w'`)."""
    return _KEYWORD_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", text))
