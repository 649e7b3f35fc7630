"""The operators' API, by its public name: `from relay.admin import Admin`."""

from relay.postgres.admin import (
    Admin,
    ArchiveStats,
    BlockedKey,
    DeadGroup,
    DeadMessage,
    DeadRow,
    KeyPolicy,
)

__all__ = [
    "Admin",
    "ArchiveStats",
    "BlockedKey",
    "DeadGroup",
    "DeadMessage",
    "DeadRow",
    "KeyPolicy",
]
