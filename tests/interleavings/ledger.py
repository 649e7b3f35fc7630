"""What the interleaving tests check, kept apart from how they drive the world: every send is
judged the moment it happens, and the end state once the steps stop."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any
from uuid import UUID

from relay.core import model


@dataclasses.dataclass(frozen=True, slots=True)
class Send:
    """One message written to the broker by one relay's claim."""

    relay: str
    message_id: UUID
    key: str | None
    seq: int | None
    attempt: int
    replays: int


@dataclasses.dataclass(frozen=True, slots=True)
class RowNow:
    """The row of a message being sent, as the database has it at that moment."""

    claim_id: UUID | None
    attempts: int
    lease_live: bool
    concurrency: int


class Ledger:
    """The producers' outcomes and the relays' sends, and the invariants over them."""

    def __init__(self) -> None:
        self.committed: set[UUID] = set()
        self.aborted: set[UUID] = set()
        self.sends: list[Send] = []
        self.violations: list[str] = []
        #: Keyed messages that were skipped (dead, and their key let go past them, by the `skip`
        #: policy or a release without replay): replayed, they may come after their successors.
        self.skipped: set[tuple[str, int]] = set()

    def violate(self, what: str) -> None:
        self.violations.append(what)

    def send(
        self,
        send: Send,
        row: RowNow | None,
        claims: Iterable[UUID],
    ) -> None:
        """Judge one send as it happens: a committed message, written by the claim that holds
        it (same claim, same attempt, lease still running), no copy with a lower attempt after a
        higher one (since its last replay from dead, which starts attempts again), and nothing
        of a key after a successor in its lane was sent: with `concurrency` c a key runs as c
        lanes (settling n releases n + c), each in order, side by side."""
        what = f"{send.relay} sent {_name(send)} (attempt {send.attempt})"
        if send.message_id not in self.committed:
            self.violate(f"{what}: its transaction did not commit")
        if row is None:
            self.violate(f"{what}: its row was already settled elsewhere")
        elif row.claim_id not in set(claims) or row.attempts != send.attempt:
            self.violate(f"{what}: by a claim that no longer holds it")
        elif not row.lease_live:
            self.violate(f"{what}: after its lease ran out")
        earlier = [  # a replay from dead starts its attempts again: compare within one life
            s.attempt
            for s in self.sends
            if s.message_id == send.message_id and s.replays == send.replays
        ]
        if earlier and send.attempt < max(earlier):
            self.violate(f"{what} after a copy with attempt {max(earlier)}")
        if send.key is not None and send.seq is not None and row is not None:
            for before in self.sends:
                if (
                    before.key == send.key
                    and before.seq is not None
                    and _behind(send.seq, before.seq, row.concurrency)
                    and not (send.replays and (send.key, send.seq) in self.skipped)
                ):
                    self.violate(f"{what} after its successor {_name(before)} was sent")
                    break
        self.sends.append(send)

    def final(
        self,
        waiting: list[dict[str, Any]],
        archived: Mapping[UUID, tuple[str | None, int | None]],
        dead: Mapping[UUID, tuple[str | None, int | None]],
    ) -> list[str]:
        """What is wrong once the relays have drained everything they could: a message still
        waiting, a committed one neither published nor dead, an aborted one that was, and a
        key whose numbers are not 1, 2, 3… without gaps."""
        problems = [f"still waiting after the drain: {row}" for row in waiting]
        settled = {**archived, **dead}
        for missing in self.committed - settled.keys():
            problems.append(f"committed message {missing} was neither published nor dead-lettered")
        for leaked in (self.aborted & settled.keys()) | (self.aborted & _sent(self.sends)):
            problems.append(f"message {leaked} of a transaction that never committed got out")
        by_key: dict[str, list[int]] = collections.defaultdict(list)
        for key, seq in settled.values():
            if key is not None and seq is not None:
                by_key[key].append(seq)
        for key, seqs in by_key.items():
            if sorted(seqs) != list(range(1, len(seqs) + 1)):
                problems.append(f"key {key} numbered {sorted(seqs)}: not 1..n without gaps")
        return problems


def _behind(seq: int, later: int, concurrency: int) -> bool:
    """Whether `later` comes after `seq` in its lane (a key with `concurrency` lanes)."""
    return later > seq and (later - seq) % concurrency == 0


def _name(send: Send) -> str:
    return f"{send.key}#{send.seq}" if send.key is not None else str(send.message_id)[:8]


def _sent(sends: list[Send]) -> set[UUID]:
    return {s.message_id for s in sends}


def outcome(kind: str, i: int) -> model.PublishResult:
    """What the fake broker answers for the i-th message of a batch, by the test's choice."""
    match kind:
        case "ack":
            return model.PublishResult(model.Outcome.ACKED)
        case "nack":
            return model.PublishResult(model.Outcome.NACKED, "nacked")
        case "return":
            return model.PublishResult(model.Outcome.RETURNED, "returned: unroutable")
        case "lost":
            return model.PublishResult(model.Outcome.AMBIGUOUS, "connection lost after the write")
        case "mixed":
            return outcome("ack" if i % 2 == 0 else "nack", i)
        case "return_first":
            return outcome("return" if i == 0 else "ack", i)
    raise ValueError(kind)


KINDS = ("ack", "nack", "return", "lost", "mixed", "return_first")
