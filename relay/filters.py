"""Dead-letter filters, by their public name: `from relay.filters import DeadFilter`
(relay.core.filters)."""

from relay.core.filters import DeadFilter, glob_to_like, when

__all__ = ["DeadFilter", "glob_to_like", "when"]
