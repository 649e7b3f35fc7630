"""The consumers' helpers, by their public name: `from relay.consumer import Inbox, SequenceChecker`
(relay.postgres.consumer)."""

from relay.postgres.consumer import Delivered, Inbox, Problem, SequenceChecker

__all__ = ["Delivered", "Inbox", "Problem", "SequenceChecker"]
