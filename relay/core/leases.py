"""The lease keeper: everything a relay holds (the batch being published, the one claimed ahead,
an orphan), renewed for the relay's whole life, and until when each hold is known to be safe.

A lease is judged by the database's clock, which a relay cannot read without asking. So each hold
is trusted by the relay's own clock from the moment the request that claimed or renewed it was
*sent*: the database stamped the lease later than that, so it runs out later too. `TRUST` keeps a
margin for the two clocks' rates. A claim is published only while its hold is trusted, and a claim
with little trust left is renewed first (`confirm`): a relay never publishes rows another relay
may already have taken over (docs/decisions/0001).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping
from uuid import UUID

from relay.core import errors, model, ports

log = logging.getLogger("relay.leases")  # the name log lines carry: as before the folders

#: The share of a lease a hold is trusted for, from the moment its claim or renewal was sent.
TRUST = 0.9
#: Heartbeats per lease. Each renews only the holds that would not last two more beats (less than
#: (BEATS - 1) / BEATS of a lease of trust left): the next beat comes in time for the rest, and a
#: batch claimed moments ago is not rewritten for nothing (each renewal leaves a dead version of
#: every row it extends). Three: a renewal may fail, or come late, once and its rows still hold.
BEATS = 3


@dataclasses.dataclass(frozen=True, slots=True)
class _Hold:
    ids: frozenset[int]
    until: float  # by the relay's clock


class Keeper:
    """Holds a relay's claims, renews them (`run_once`, every third of a lease) and says which
    rows may still be published. Raises errors.DatabaseUnavailable only from `confirm`."""

    def __init__(
        self, store: ports.Store, lease: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._lease = lease
        self._renew_below = lease * (BEATS - 1) / BEATS
        #: How often `run_once` should run.
        self.heartbeat = lease / BEATS
        self._clock = clock
        self._holds: dict[UUID, _Hold] = {}
        #: The next batch, claimed while this one is published (or with its settle): at most one.
        self._ahead: asyncio.Future[tuple[model.Claim, float]] | None = None

    @property
    def claimed_ahead(self) -> bool:
        """Whether a batch is claimed (or being claimed) ahead of the next cycle."""
        return self._ahead is not None

    def keep_ahead(self, claiming: asyncio.Future[tuple[model.Claim, float]]) -> None:
        """Keep the batch being claimed ahead (its rows are held once the claim returns)."""
        assert self._ahead is None, "one batch is claimed ahead at a time"
        self._ahead = claiming

    def take_ahead(self) -> asyncio.Future[tuple[model.Claim, float]] | None:
        """Hand over the batch claimed ahead, if any: the caller publishes or gives it back."""
        ahead, self._ahead = self._ahead, None
        return ahead

    def hold(self, claim: model.Claim, sent_at: float) -> None:
        """Keep `claim`'s rows, claimed by a request sent at `sent_at` (by this keeper's clock)."""
        if claim.messages:
            ids = frozenset(m.id for m in claim.messages)
            self._holds[claim.claim_id] = _Hold(ids, sent_at + self._lease * TRUST)

    def drop(self, claim_id: UUID, ids: frozenset[int] | None = None) -> None:
        """Stop keeping a claim (it was settled or given back), or only its rows `ids` (a part of
        it was settled: the rest is still held, and renewed, until its own settle)."""
        hold = self._holds.get(claim_id)
        if hold is None:
            return
        rest = frozenset() if ids is None else hold.ids - ids
        if rest:
            self._holds[claim_id] = _Hold(rest, hold.until)
        else:
            del self._holds[claim_id]

    def valid(self, claim_id: UUID, ids: frozenset[int]) -> bool:
        """Whether rows `ids` of the claim are all still surely this relay's: publishing them is
        safe. A row a renewal did not keep was taken over and stays lost, even once the claim's
        other rows are trusted again."""
        hold = self._holds.get(claim_id)
        return hold is not None and ids <= hold.ids and self._clock() < hold.until

    def trusted(self, claim_id: UUID) -> bool:
        """Whether the claim is still held and trusted (some of its rows, for now)."""
        hold = self._holds.get(claim_id)
        return hold is not None and bool(hold.ids) and self._clock() < hold.until

    def held(self) -> Mapping[UUID, frozenset[int]]:
        """The rows of every claim whose hold is trusted now, by claim."""
        now = self._clock()
        return {c: h.ids for c, h in self._holds.items() if h.ids and now < h.until}

    async def confirm(self, claim_id: UUID) -> frozenset[int]:
        """The claim's rows it may publish now. With less trust left than two heartbeats (a batch
        claimed ahead a while ago), the lease is renewed first, as the heartbeat would, and only
        the rows the renewal kept are returned. Raises DatabaseUnavailable if the database
        cannot say."""
        hold = self._holds.get(claim_id)
        if hold is None:
            return frozenset()
        if hold.until - self._clock() < self._renew_below:
            await self._renew(claim_id, hold)
        return frozenset(self.held().get(claim_id, ()))

    async def run_once(self) -> None:
        """Renew every hold with less trust left than two heartbeats. A hold the
        database cannot be asked about keeps its old term and so lapses by itself if the outage
        lasts; a lost row is logged and let go."""
        failed: list[str] = []
        soon = self._clock() + self._renew_below
        for claim_id, hold in list(self._holds.items()):
            if hold.until >= soon:
                continue
            try:
                await self._renew(claim_id, hold)
            except errors.TransientError as exc:
                failed.append(str(exc))
        if failed:
            log.warning(
                "could not renew %d lease(s) (%s); if they run out, another relay may publish "
                "their rows too",
                len(failed),
                failed[0],
            )

    async def _renew(self, claim_id: UUID, hold: _Hold) -> None:
        sent = self._clock()
        kept = await self._store.extend(claim_id, sorted(hold.ids), self._lease)
        current = self._holds.get(claim_id)
        if current is None:
            return  # settled meanwhile
        lost = current.ids - kept
        if lost:
            log.warning(
                "%d of %d rows held were re-claimed by another relay after their lease ran out; "
                "they will not be published here",
                len(lost),
                len(current.ids),
            )
        until = max(current.until, sent + self._lease * TRUST) if kept else current.until
        self._holds[claim_id] = _Hold(current.ids & kept, until)
