"""The errors users catch, by their public name: `relay.errors.InvalidMessage` and the rest
(relay.core.errors)."""

from relay.core.errors import (
    BrokerRefused,
    BrokerUnavailable,
    ConfigError,
    DatabaseRefused,
    DatabaseUnavailable,
    DuplicateMessage,
    InvalidArgument,
    InvalidMessage,
    InvalidMessageType,
    MigrationError,
    Refused,
    RelayError,
    SchemaMissing,
    TransientError,
)

__all__ = [
    "BrokerRefused",
    "BrokerUnavailable",
    "ConfigError",
    "DatabaseRefused",
    "DatabaseUnavailable",
    "DuplicateMessage",
    "InvalidArgument",
    "InvalidMessage",
    "InvalidMessageType",
    "MigrationError",
    "Refused",
    "RelayError",
    "SchemaMissing",
    "TransientError",
]
