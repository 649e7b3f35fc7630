"""A relay's login can never make a producer wait: whatever it calls and locks, and however long it
then keeps its transaction open, producers enqueue and commit as if it were not there.

A misbehaving session holding only the relay role (lock_timeout, statement_timeout and
idle_in_transaction_session_timeout at 0) calls, each in a savepoint of one open transaction,
every function in the outbox schema that the role may EXECUTE (found in pg_proc, not listed
here); takes every table lock its privileges allow (each mode, NOWAIT, on every table of the
schema) and every row lock (FOR UPDATE … FOR KEY SHARE); and keeps the transaction open. Producer
logins meanwhile enqueue keyed and unkeyed messages, with generated and explicit ids, scheduled
ones and enqueue_many, and commit, over an id range that puts a row in every partition of any
table they write (the schema's sequences are advanced in strides between rounds, as a long-lived
outbox's are). Each wait is judged in pg_locks/pg_blocking_pids: a producer statement or COMMIT
that waits more than THRESHOLD on a lock held by the relay's backend is recorded (with the call
that took that lock) and cancelled so that the test goes on; the target is none.

Arguments: BUILDERS holds plausible arguments for the functions known today (claim, then settle
what was claimed; every segment number; …). Every function is also called with all arguments NULL
and with a value per argument type (`plausible`), so a function added later is exercised without
a builder. A relay-callable function that no call exercises (every attempt raised) fails the
test: add a builder for it — a function NULLs cannot exercise could otherwise hide a lock.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import psycopg
import pytest
from psycopg import sql

import relay
from relay import app
from relay.errors import RelayError
from relay.postgres import migrate, roles
from tests.support.amqp import Broker
from tests.support.inprocess import settings_for

#: Longest a producer may wait on the relay's backend (seconds).
THRESHOLD = 1.0
#: Ids between two rounds: the size of the current ready lane's segments (docs/decisions/0004);
#: five rounds cover four segments and wrap around. Harmless where ids are not partitioned.
STRIDE = 131072
ROUNDS = 5
TABLE_LOCKS = (
    "ACCESS SHARE",
    "ROW SHARE",
    "ROW EXCLUSIVE",
    "SHARE UPDATE EXCLUSIVE",
    "SHARE",
    "SHARE ROW EXCLUSIVE",
    "EXCLUSIVE",
    "ACCESS EXCLUSIVE",
)
ROW_LOCKS = ("FOR UPDATE", "FOR NO KEY UPDATE", "FOR SHARE", "FOR KEY SHARE")
#: PostgreSQL's lock conflicts (the docs' "Conflicting Lock Modes"), by pg_locks' mode names:
#: the modes each mode waits for.
_AS, _RS, _RX, _SUX, _S, _SRX, _X, _AX = (
    "AccessShareLock",
    "RowShareLock",
    "RowExclusiveLock",
    "ShareUpdateExclusiveLock",
    "ShareLock",
    "ShareRowExclusiveLock",
    "ExclusiveLock",
    "AccessExclusiveLock",
)
CONFLICTS = {
    _AS: {_AX},
    _RS: {_X, _AX},
    _RX: {_S, _SRX, _X, _AX},
    _SUX: {_SUX, _S, _SRX, _X, _AX},
    _S: {_RX, _SUX, _SRX, _X, _AX},
    _SRX: {_RX, _SUX, _S, _SRX, _X, _AX},
    _X: {_RS, _RX, _SUX, _S, _SRX, _X, _AX},
    _AX: {_AS, _RS, _RX, _SUX, _S, _SRX, _X, _AX},
}


@dataclasses.dataclass(frozen=True)
class Secured:
    owner_url: str
    schema: str

    def url(self, login: str) -> str:
        parts = urlsplit(self.owner_url)
        return parts._replace(netloc=f"{login}@{parts.hostname}:{parts.port or 5432}").geturl()


@pytest.fixture
def secured(empty_database_url: str) -> Iterator[Secured]:
    """A schema of its own with its roles (`roles.ensure`, as `outbox-relay roles`), a login in
    the relay role and one in the producer role."""
    schema = f"s{uuid.uuid4().hex[:10]}"
    migrate.migrate(empty_database_url, schema)
    made = roles.ensure(empty_database_url, schema)
    logins = {f"{schema}_relay_login": made.relay, f"{schema}_producer_login": made.producer}
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        for login, group in logins.items():
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    sql.Identifier(login), sql.Identifier(group)
                )
            )
    try:
        yield Secured(empty_database_url, schema)
    finally:
        names = [*logins, *made.names()]
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            for name in names:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        admin = urlsplit(empty_database_url)._replace(path="/postgres").geturl()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = ANY(%s)",
                [list(logins)],
            )
            for name in names:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


# -- The misbehaving session ----------------------------------------------------------------------


@dataclasses.dataclass
class Context:
    """What the session learnt from its own calls, for the builders of the next ones."""

    claims: list[tuple[uuid.UUID, list[int]]] = dataclasses.field(default_factory=list)
    snapshot: str | None = None

    def held(self) -> Iterator[tuple[uuid.UUID, list[int]]]:
        yield from self.claims or [(uuid.uuid4(), [])]


def _claim(ready_first: bool) -> list[Any]:
    return [1000, None, uuid.uuid4(), "rogue", 3600.0, "1:1:", None, "0", 0, ready_first, False]


def _request() -> tuple[Any, ...]:
    """A claim_request (migration 0026): a claim from the start, big and long."""
    return (uuid.uuid4(), "rogue", 3600.0, 1000, 1 << 30, 10, None, None, None, None)


def _settle_now(ids: list[int], claim: uuid.UUID, then: bool) -> list[Any]:
    """The nine-argument settle (migration 0026): every row retried, or archived and a claim."""
    fates = ["archive" if then else "retry"] * len(ids)
    none = [None] * len(ids)
    return [claim, ids, fates, none, none, [0.0] * len(ids), [], True, _request() if then else None]


def _settle(ids: list[int], claim: uuid.UUID, archive: bool) -> list[Any]:
    retry = [] if archive else ids
    return [
        claim,
        ids if archive else [],
        [],
        [],
        [],
        retry,
        [0.0] * len(retry),
        ["rogue"] * len(retry),
        [False] * len(retry),
        [False] * len(retry),
        [],
        True,
    ]


#: Plausible arguments of the functions a relay calls today (relay/postgres/queries/relay.sql),
#: by name: one list per call, run in this order (claims first: settles use what they held).
BUILDERS: dict[str, Callable[[Context], list[list[Any]]]] = {
    "lane_start": lambda c: [[]],
    "use_fast_lane": lambda c: [[]],
    "use_doorbell": lambda c: [[]],
    "arm_doorbell": lambda c: [[]],
    "claim": lambda c: [[_request()], [_request()]],
    "claim_batch": lambda c: [_claim(True), _claim(False)],
    "extend_leases": lambda c: [[claim, ids, 3600.0] for claim, ids in c.held()],
    "settle": lambda c: [
        *(_settle(ids, claim, archive=False) for claim, ids in c.held()),
        *(_settle_now(ids, claim, then=False) for claim, ids in c.held()),
        *(_settle_now(ids, claim, then=True) for claim, ids in c.held()),
    ],
    "prune_archive": lambda c: [["infinity", 100000], ["-infinity", 100000]],
    "settle_then_claim": lambda c: [
        [*_settle(ids, claim, archive=True), *_claim(True)] for claim, ids in c.held()
    ],
    "bury_exhausted": lambda c: [[1, 1000]],
    "release_stranded": lambda c: [[1000]],
    "release_orphans": lambda c: [["-infinity", 1000]],
    "sweep_stragglers": lambda c: [[c.snapshot or "1:1:", 1000]],
    "forget_idle_keys": lambda c: [[timedelta(hours=1), None, 1000]],  # its least
    "reclaim_segment": lambda c: [[seg] for seg in range(4)],
    "lane_gauges": lambda c: [[]],
}


def _unknown(context: Context) -> list[list[Any]]:
    return []  # NULLs and `plausible` values only


def plausible(type_name: str, context: Context) -> Any:
    """A value of `type_name` a relay might pass: limits high, leases long, times far back."""
    claim, ids = next(context.held())
    values: dict[str, Any] = {
        "smallint": 1,
        "integer": 1000,
        "bigint": 1000,
        "double precision": 3600.0,
        "real": 3600.0,
        "numeric": 1000,
        "boolean": True,
        "text": "rogue",
        "uuid": claim,
        "interval": timedelta(hours=1),
        "timestamp with time zone": "-infinity",
        "jsonb": "{}",
        "bigint[]": ids,
        "integer[]": [],
        "text[]": [],
        "uuid[]": [claim],
        "boolean[]": [],
        "double precision[]": [],
        "xid8": "0",
        "pg_snapshot": context.snapshot or "1:1:",
    }
    return values.get(type_name)


@dataclasses.dataclass(frozen=True)
class Function:
    name: str
    types: tuple[str, ...]

    @property
    def signature(self) -> str:
        return f"{self.name}({', '.join(self.types)})"


LockKey = tuple[Any, ...]  # pg_locks' identity of a lock, mode last


class Rogue:
    """An open transaction of the relay's login: every call in its own savepoint; the locks each
    call left held are noted (from pg_locks), to name the call behind a producer's wait."""

    def __init__(self, url: str, admin: psycopg.Connection[Any], schema: str) -> None:
        self.conn = psycopg.connect(url)
        self.admin = admin
        self.schema = schema
        self.pid = self.conn.info.backend_pid
        self.taken: dict[LockKey, str] = {}  # each lock held -> the first call that took it
        self.exercised: set[str] = set()
        self.outcomes: list[tuple[str, str]] = []
        self.context = Context()
        for setting in ("lock_timeout", "statement_timeout", "idle_in_transaction_session_timeout"):
            self.conn.execute("SELECT set_config(%s, '0', false)", [setting])
        self.conn.commit()
        self.conn.execute("SELECT 1")  # BEGIN

    def close(self) -> None:
        self.conn.rollback()
        self.conn.close()

    def locks(self) -> list[LockKey]:
        return [
            tuple(row)
            for row in self.admin.execute(
                "SELECT locktype, relation::regclass::text, page, tuple, transactionid::text,"
                " classid, objid, objsubid, mode FROM pg_locks WHERE pid = %s AND granted",
                [self.pid],
            )
        ]

    def run(
        self, label: str, statement: bytes, params: list[Any] | None = None
    ) -> list[tuple[Any, ...]]:
        self.conn.execute("SAVEPOINT rogue")
        try:
            cur = self.conn.execute(statement, params)
            rows = cur.fetchall() if cur.description else []  # LOCK TABLE returns none
        except psycopg.Error as exc:
            self.conn.execute("ROLLBACK TO SAVEPOINT rogue")
            self.outcomes.append((label, f"SQLSTATE {exc.sqlstate}"))
            return []
        self.conn.execute("RELEASE SAVEPOINT rogue")
        for lock in self.locks():
            self.taken.setdefault(lock, label)
        self.outcomes.append((label, f"ok, {len(rows)} rows"))
        return rows

    def functions(self) -> list[Function]:
        rows = self.conn.execute(
            "SELECT p.proname, array(SELECT format_type(t, NULL) FROM unnest(p.proargtypes) t)"
            " FROM pg_proc p"
            " WHERE p.pronamespace = %s::regnamespace AND p.prokind = 'f'"
            " AND p.prorettype NOT IN ('trigger'::regtype, 'event_trigger'::regtype)"
            " AND has_function_privilege(p.oid, 'EXECUTE') ORDER BY p.proname",
            [self.schema],
        ).fetchall()
        return [Function(name, tuple(types)) for name, types in rows]

    def call_everything(self) -> list[Function]:
        found = self.functions()
        order = list(BUILDERS)
        found.sort(key=lambda f: order.index(f.name) if f.name in order else len(order))
        for function in found:
            builder = BUILDERS.get(function.name, _unknown)
            attempts = [
                *builder(self.context),
                [None] * len(function.types),
                [plausible(t, self.context) for t in function.types],
            ]
            tried: list[list[Any]] = []
            for args in attempts:
                if len(args) != len(function.types) or args in tried:
                    continue
                tried.append(args)
                if self.call(function, args):
                    self.exercised.add(function.signature)
        return found

    def call(self, function: Function, args: list[Any]) -> bool:
        placeholders = ", ".join(f"%s::{t}" for t in function.types)
        statement = f'SELECT * FROM "{self.schema}"."{function.name}"({placeholders})'
        label = f"{function.name}({', '.join(_short(a) for a in args)})"
        before = len(self.outcomes)
        rows = self.run(label, statement.encode(), args)
        ok = self.outcomes[before][1].startswith("ok")
        claiming = {"claim_batch": 2, "settle_then_claim": 14}  # where the claim id goes
        if ok and function.name == "claim" and rows and rows[0][5]:
            self.context.claims.append((args[0][0], list(rows[0][5])))
        if ok and function.name in claiming:
            ids = [r[0] for r in rows if isinstance(r[0], int) and r[1] is not None]
            if ids:
                self.context.claims.append((args[claiming[function.name]], ids))
        if ok and function.name == "lane_start" and rows:
            self.context.snapshot = str(rows[0][0])
        return ok

    def lock_everything(self) -> None:
        tables = self.conn.execute(
            "SELECT c.relname FROM pg_class c WHERE c.relnamespace = %s::regnamespace"
            " AND c.relkind IN ('r', 'p', 'v') ORDER BY c.relname",
            [self.schema],
        ).fetchall()
        for (table,) in tables:
            name = f'"{self.schema}"."{table}"'
            for mode in TABLE_LOCKS:
                self.run(
                    f"LOCK {table} IN {mode} MODE",
                    f"LOCK TABLE {name} IN {mode} MODE NOWAIT".encode(),
                )
            for strength in ROW_LOCKS:
                self.run(
                    f"SELECT FROM {table} {strength}",
                    f"SELECT 1 FROM {name} {strength} SKIP LOCKED".encode(),
                )


def _short(value: Any) -> str:
    if isinstance(value, list):
        return f"[{len(value)}]"
    if isinstance(value, uuid.UUID):
        return "uuid"
    return repr(value)


# -- Producers and the watch on their waits -------------------------------------------------------


@dataclasses.dataclass
class Wait:
    producer: str  # its kind (KINDS)
    statement: str
    lock: str
    seconds: float
    taken_by: list[str]


class Watch:
    """Polls pg_locks for producers blocked by the relay's backend; one blocked past THRESHOLD is
    recorded, with the calls that took the lock it waits for, and its statement is cancelled."""

    def __init__(self, admin_url: str, rogue: Rogue, producers: dict[int, str]) -> None:
        self.admin = psycopg.connect(admin_url, autocommit=True)
        self.rogue = rogue
        self.producers = producers
        self.waits: list[Wait] = []
        self.longest = 0.0
        self._since: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self.admin.close()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            rows = self.admin.execute(
                "SELECT a.pid, a.query, l.locktype, l.relation::regclass::text, l.page,"
                " l.tuple, l.transactionid::text, l.classid, l.objid, l.objsubid, l.mode"
                " FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid AND NOT l.granted"
                " WHERE a.pid = ANY(%s) AND %s = ANY(pg_blocking_pids(a.pid))",
                [list(self.producers), self.rogue.pid],
            ).fetchall()
            now = time.monotonic()
            blocked = {row[0]: row for row in rows}
            for pid in list(self._since):
                if pid not in blocked:
                    self.longest = max(self.longest, now - self._since.pop(pid))
            for pid, row in blocked.items():
                since = self._since.setdefault(pid, now)
                if now - since < THRESHOLD:
                    continue
                identity, mode = row[2:10], row[10]
                taken_by = sorted(
                    {
                        f"{call} ({lock[-1]})"
                        for lock, call in self.rogue.taken.items()
                        if lock[:8] == identity and lock[-1] in CONFLICTS.get(mode, {lock[-1]})
                    }
                )
                what = row[3] or f"{row[2]} {row[6] or ''}"
                statement = " ".join(row[1].split())[:50]
                lock = f"{mode} on {what}"
                self.waits.append(Wait(self.producers[pid], statement, lock, now - since, taken_by))
                self.admin.execute("SELECT pg_cancel_backend(%s)", [pid])
                self._since.pop(pid)
                self.longest = max(self.longest, now - since)


def _unkeyed(conn: psycopg.Connection[Any], ex: str, schema: str, r: int) -> None:
    relay.enqueue(conn, ex, "p", b"unkeyed", schema=schema)


def _own_id(conn: psycopg.Connection[Any], ex: str, schema: str, r: int) -> None:
    relay.enqueue(conn, ex, "p", b"own id", message_id=uuid.uuid4(), schema=schema)


def _keyed(conn: psycopg.Connection[Any], ex: str, schema: str, r: int) -> None:
    relay.enqueue(conn, ex, "p", b"keyed", ordering_key="history-keyed", schema=schema)


def _new_key(conn: psycopg.Connection[Any], ex: str, schema: str, r: int) -> None:
    relay.enqueue(conn, ex, "p", b"new key", ordering_key=f"new-{r}", schema=schema)


def _scheduled(conn: psycopg.Connection[Any], ex: str, schema: str, r: int) -> None:
    relay.enqueue(conn, ex, "p", b"later", available_at=timedelta(hours=1), schema=schema)


def _many(conn: psycopg.Connection[Any], ex: str, schema: str, r: int) -> None:
    batch = [
        relay.Message(ex, "p", b"many"),
        relay.Message(ex, "p", b"many, keyed", ordering_key="history-many"),
        relay.Message(ex, "p", b"many, new key", ordering_key=f"new-many-{r}"),
        relay.Message(ex, "p", b"many, own id", message_id=uuid.uuid4()),
    ]
    relay.enqueue_many(conn, batch, schema=schema)


#: What producers do, each kind on a connection of its own, one transaction per round.
KINDS: dict[str, Callable[[psycopg.Connection[Any], str, str, int], None]] = {
    "unkeyed": _unkeyed,
    "own id": _own_id,
    "keyed": _keyed,
    "new key": _new_key,
    "scheduled": _scheduled,
    "enqueue_many": _many,
}


def produce(
    producers: dict[str, psycopg.Connection[Any]], ex: str, schema: str, r: int
) -> dict[str, str]:
    """A round: each kind of producer, side by side, enqueues and commits; what happened."""
    outcomes = dict.fromkeys(producers, "still waiting")

    def one(kind: str) -> None:
        conn = producers[kind]
        try:
            KINDS[kind](conn, ex, schema, r)
            conn.commit()
            outcomes[kind] = "committed"
        except (psycopg.Error, RelayError) as exc:
            conn.rollback()
            outcomes[kind] = f"{type(exc).__name__}"

    threads = [threading.Thread(target=one, args=(kind,)) for kind in producers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return outcomes


def advance_ids(owner: psycopg.Connection[Any], schema: str) -> None:
    """Every sequence of the schema STRIDE further on, as after that many messages."""
    for (name,) in owner.execute(
        "SELECT sequencename FROM pg_sequences WHERE schemaname = %s", [schema]
    ).fetchall():
        owner.execute(
            "SELECT setval(%s::regclass, coalesce((SELECT last_value FROM pg_sequences"
            " WHERE schemaname = %s AND sequencename = %s), 1) + %s)",
            [f'"{schema}"."{name}"', schema, name, STRIDE],
        )


def partition_rows(owner: psycopg.Connection[Any], schema: str) -> dict[tuple[str, str], int]:
    """Rows in each leaf partition of the schema's partitioned tables, by (parent, partition)."""
    found = {}
    for parent, leaf in owner.execute(
        "SELECT p.relname, c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid"
        " JOIN pg_class p ON p.oid = i.inhparent WHERE p.relnamespace = %s::regnamespace"
        " AND p.relkind = 'p' AND c.relkind = 'r'",
        [schema],
    ).fetchall():
        row = owner.execute(f'SELECT count(*) FROM "{schema}"."{leaf}"'.encode()).fetchone()
        found[(parent, leaf)] = int(row[0]) if row else 0
    return found


async def drain(url: str, amqp_url: str, schema: str) -> None:
    """A relay (the relay's login) publishes everything due, then stops."""
    async with app.components(settings_for(url, amqp_url, db_schema=schema)) as parts:
        await parts.relay.run_until_empty()


async def test_a_relay_login_cannot_make_a_producer_wait(
    secured: Secured, amqp_url: str, broker: Broker
) -> None:
    s = secured
    await broker.declare()
    relay_url, producer_url = s.url(f"{s.schema}_relay_login"), s.url(f"{s.schema}_producer_login")
    owner = psycopg.connect(s.owner_url, autocommit=True)
    producers = {kind: psycopg.connect(producer_url) for kind in KINDS}
    committed = dict.fromkeys(KINDS, "committed")
    try:
        # A history: messages of every kind published through the whole id range, so that
        # whatever a relay may clean up or reclaim is there; then some left waiting (keyed ones
        # with a backlog behind them) for the session to claim.
        for r in range(4):
            assert produce(producers, broker.exchange, s.schema, r) == committed
            await drain(relay_url, amqp_url, s.schema)
            advance_ids(owner, s.schema)
        for r in (8, 9):
            assert produce(producers, broker.exchange, s.schema, r) == committed
        before = partition_rows(owner, s.schema)
        rogue = Rogue(relay_url, owner, s.schema)
        found = rogue.call_everything()
        rogue.lock_everything()
        outcomes: list[dict[str, str]] = []
        pids = {conn.info.backend_pid: kind for kind, conn in producers.items()}
        with Watch(s.owner_url, rogue, pids) as watch:
            for r in range(ROUNDS):
                outcomes.append(produce(producers, broker.exchange, s.schema, 10 + r))
                advance_ids(owner, s.schema)
        rogue.close()
        after = partition_rows(owner, s.schema)
    finally:
        for conn in (*producers.values(), owner):
            conn.close()
    for label, outcome in rogue.outcomes:
        if not label.startswith(("LOCK", "SELECT FROM")) or outcome.startswith("ok"):
            print(f"  {label}: {outcome}")
    for r, round_ in enumerate(outcomes):
        print(f"  round {r}: {round_}")
    for w in watch.waits:
        print(f"  {w.producer} waited {w.seconds:.1f}s in {w.statement!r}")
        print(f"    for {w.lock}, taken by {w.taken_by}")
    failed = [
        f"round {r}: {kind}"
        for r, o in enumerate(outcomes)
        for kind, v in o.items()
        if v != "committed"
    ]
    causes = sorted({c for w in watch.waits for c in w.taken_by})
    figures = (
        f"{len(found)} relay functions, {len(rogue.exercised)} exercised; "
        f"{len(watch.waits)} producer statements waited over {THRESHOLD:g}s on the relay's "
        f"backend (target 0), {len(failed)} of {len(outcomes) * len(KINDS)} producer "
        f"transactions did not commit; longest wait seen {watch.longest:.1f}s"
    )
    print(figures)
    print(f"waits on locks taken by {causes}")
    missing = sorted({f.signature for f in found} - rogue.exercised)
    assert not missing, f"relay functions no call exercised (add a builder): {missing}"
    waits = sorted({f"{w.producer}: {w.lock}" for w in watch.waits})
    assert not watch.waits, f"{figures}: {waits}; the relay's session took them in {causes}"
    assert not failed, f"{figures}: {failed}"
    grew = {parent for (parent, leaf), n in after.items() if n > before[(parent, leaf)]}
    untouched = [
        leaf
        for (parent, leaf), n in after.items()
        if parent in grew and n == before[(parent, leaf)]
    ]
    assert not untouched, f"producers wrote no row in {untouched}: the ids did not cover them"
