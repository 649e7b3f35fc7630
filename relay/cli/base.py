"""What the operator commands share beyond the terminal: an admin session on the database the
settings name."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from relay.core import config
from relay.postgres import admin


@contextlib.contextmanager
def operator(flags: dict[str, Any]) -> Iterator[admin.Admin]:
    """An admin session on the database the settings name."""
    settings = config.load(**flags)
    with admin.Admin.connect(settings.database_url.get_secret_value(), settings.db_schema) as ops:
        yield ops
