"""The errors users catch, by their public name: `relay.errors.InvalidMessage` and the rest
(relay.core.errors)."""

from relay.core.errors import (
    BrokerUnavailable,
    ConfigError,
    DatabaseUnavailable,
    DuplicateMessage,
    InvalidArgument,
    InvalidMessage,
    MigrationError,
    RelayError,
    SchemaMissing,
    TransientError,
)

__all__ = [
    "BrokerUnavailable",
    "ConfigError",
    "DatabaseUnavailable",
    "DuplicateMessage",
    "InvalidArgument",
    "InvalidMessage",
    "MigrationError",
    "RelayError",
    "SchemaMissing",
    "TransientError",
]
