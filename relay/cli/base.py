"""What the operator commands share beyond the terminal: an admin session on the database the
settings name (psycopg and pydantic load when a command opens one, not for its help)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relay.postgres import admin


@contextlib.contextmanager
def operator(flags: dict[str, Any]) -> Iterator[admin.Admin]:
    """An admin session on the database the settings name."""
    from relay.core import config
    from relay.postgres import admin

    settings = config.load(**flags)
    with admin.Admin.connect(
        settings.database_url.get_secret_value(),
        settings.db_schema,
        pooled=settings.transaction_pooler,
    ) as ops:
        yield ops
