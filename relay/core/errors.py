"""The project's exceptions: adapters translate driver errors into these, so no upper layer
sees a driver's."""

from __future__ import annotations


class RelayError(Exception):
    """Base of every error outbox-relay raises on purpose."""


class ConfigError(RelayError, ValueError):
    """A setting is missing or malformed (raised before anything connects)."""


class InvalidArgument(RelayError, ValueError):
    """An operator command or API call was given an argument it cannot use; nothing changed."""


class InvalidMessage(RelayError, ValueError):
    """`enqueue` was given arguments that cannot become an AMQP message; nothing was written."""


class InvalidMessageType(InvalidMessage, TypeError):
    """An `enqueue` argument of the wrong type (a body that is an int, headers as a list): an
    InvalidMessage, and a TypeError as Python's own checks would raise."""


class DuplicateMessage(InvalidMessage):
    """A message with this `message_id` is already waiting in the outbox."""


class SchemaMissing(RelayError):
    """The outbox schema or one of its objects does not exist: `outbox-relay migrate` never ran."""


class MigrationError(RelayError):
    """The migrations on disk disagree with the ones recorded in the database."""


class TransientError(RelayError):
    """A service is unreachable or a connection dropped; the operation may succeed if retried."""


class DatabaseUnavailable(TransientError):
    """PostgreSQL could not be reached, or the connection broke mid-operation."""


class LockTimeout(TransientError):
    """A statement gave up waiting for a lock (lock_timeout), or PostgreSQL broke a deadlock by
    ending it: retried, and counted, but not an outage."""


class BrokerUnavailable(TransientError):
    """RabbitMQ could not be reached, or the connection broke mid-operation."""


class Refused(TransientError):
    """A service answered and refused this relay: wrong credentials, or a database, role or
    virtual host that does not exist. Start-up fails at once on it (retrying cannot help until
    the settings change); a running relay goes on retrying, saying why (credentials rotate)."""


class DatabaseRefused(DatabaseUnavailable, Refused):
    """PostgreSQL refused the connection (authentication, role, database)."""


class BrokerRefused(BrokerUnavailable, Refused):
    """RabbitMQ refused the connection (login, virtual host)."""
