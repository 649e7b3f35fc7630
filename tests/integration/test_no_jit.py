"""No statement a relay runs is JIT-compiled (migration 0025): a generic plan's cost grows with
the rows its tables hold, and once past `jit_above_cost` every call paid the compilation — 38 ms
of a 43 ms claim at a backlog of 1,000,000, against 5 ms without (docs/decisions/0004). The
thresholds are lowered here, so that a few thousand rows stand in for a million."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

Conn = psycopg.Connection[Any]

ROLES_SQL = Path(__file__).parents[2] / "relay" / "postgres" / "roles.sql"
ROWS = 5_000
#: A cost above any of the test's own top-level statements (a function scan: ~10) and below what
#: the functions' statements over ROWS rows cost.
JIT_ABOVE = 100


def relay_functions() -> list[str]:
    """The functions roles.sql lets a relay execute."""
    text = ROLES_SQL.read_text()
    grant = re.search(r"GRANT EXECUTE ON FUNCTION((?:(?!GRANT).)*?)TO \{relay\};", text, re.S)
    assert grant is not None
    return re.findall(r"\{schema\}\.(\w+)\(", grant.group(1))


@pytest.fixture
def conn(database_url: str) -> Iterator[Conn]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        # pg_jit_available() is false while jit is off, whatever is installed: turn it on first.
        conn.execute("SET jit = on")
        if conn.execute("SELECT pg_jit_available()").fetchone() != (True,):
            pytest.skip("this server cannot load its JIT provider (llvmjit): nothing could compile")
        conn.execute(
            "SELECT outbox.enqueue('x', 'k', convert_to(g::text, 'UTF8'),"
            " ordering_key => CASE WHEN g %% 10 = 0 THEN 'key-' || g %% 7 END)"
            " FROM generate_series(1, %s) AS g",
            [ROWS],
        )
        conn.execute("ANALYZE outbox.messages")
        yield conn


class Plans:
    """The plans auto_explain reports, as notices, for every statement this session runs (with
    those nested in functions), and whether each was JIT-compiled."""

    def __init__(self, conn: Conn) -> None:
        self.notices: list[str] = []
        conn.add_notice_handler(lambda d: self.notices.append(d.message_primary or ""))
        try:
            conn.execute("LOAD 'auto_explain'")
        except (psycopg.errors.UndefinedFile, psycopg.errors.InsufficientPrivilege) as exc:
            pytest.skip(
                f"auto_explain cannot be loaded here (a contrib module, as a superuser): {exc}"
            )
        for name, value in {
            "client_min_messages": "notice",
            "auto_explain.log_min_duration": "0",
            "auto_explain.log_analyze": "on",
            "auto_explain.log_timing": "off",
            "auto_explain.log_nested_statements": "on",
            "auto_explain.log_level": "notice",
            "jit": "on",
            "jit_above_cost": str(JIT_ABOVE),
            "jit_inline_above_cost": str(JIT_ABOVE),
            "jit_optimize_above_cost": str(JIT_ABOVE),
        }.items():
            conn.execute("SELECT set_config(%s, %s, false)", [name, value])
        self.notices.clear()

    def compiled(self) -> list[str]:
        return [n for n in self.notices if "JIT:" in n]


def request(claim_id: uuid.UUID, limit: int = 200) -> tuple[object, ...]:
    """A claim_request (migration 0026) from the start."""
    return (claim_id, "p", 30, limit, 100_000_000, 5, None, None, None, None)


def a_relays_work(conn: Conn) -> None:
    """A relay's statements once each: claim, renew, settle-and-claim, settle, the rescue's
    recheck, the doorbell and the pruner."""
    claim_id = uuid.uuid4()
    (ids,) = conn.execute(
        "SELECT ids FROM outbox.claim(%s::outbox.claim_request)", [request(claim_id)]
    ).fetchone() or ([],)
    assert ids
    conn.execute("SELECT * FROM outbox.extend_leases(%s, %s, 30)", [claim_id, ids]).fetchall()
    next_claim = uuid.uuid4()
    (following,) = conn.execute(
        "SELECT ids FROM outbox.settle(%s, %s, array_fill('archive'::text, ARRAY[%s]), NULL, NULL,"
        " NULL, '{}', true, %s::outbox.claim_request)",
        [claim_id, ids, len(ids), request(next_claim)],
    ).fetchone() or ([],)
    assert following
    # The batch that settle took, settled on its own (no next claim).
    archived = conn.execute(
        "SELECT archived FROM outbox.settle(%s, %s, array_fill('archive'::text, ARRAY[%s]), NULL,"
        " NULL, NULL, '{}', true, NULL)",
        [next_claim, following, len(following)],
    ).fetchone()
    assert archived == (len(following),)
    for statement in (
        "SELECT outbox.use_doorbell()",
        "SELECT outbox.arm_doorbell()",
        "SELECT * FROM outbox.release_stranded(500)",
        "SELECT * FROM outbox.prune_archive(now(), 500)",
    ):
        conn.execute(statement).fetchall()


def test_no_statement_of_a_relay_is_jit_compiled(conn: Conn) -> None:
    plans = Plans(conn)
    # The control: a statement of this session's own above the threshold does compile, so the
    # check below can see a compilation.
    conn.execute(
        "SELECT count(*) FROM outbox.messages a JOIN outbox.messages b USING (id)"
    ).fetchone()
    assert plans.compiled(), "JIT did not compile a statement above the lowered threshold"
    plans.notices.clear()

    a_relays_work(conn)

    assert len(plans.notices) > 20, "auto_explain reported too few plans to judge"
    compiled = plans.compiled()
    assert not compiled, f"{len(compiled)} statements JIT-compiled, e.g.:\n{compiled[0]}"


def test_every_function_a_relay_may_call_turns_jit_off(conn: Conn) -> None:
    # The grant is the list of a relay's entry points; what they call inherits their setting.
    names = relay_functions()
    assert "claim" in names
    assert "settle" in names
    rows = conn.execute(
        "SELECT p.proname FROM pg_proc p"
        " WHERE p.pronamespace = 'outbox'::regnamespace AND p.proname = ANY(%s)"
        "   AND NOT coalesce('jit=off' = ANY(p.proconfig), false)",
        [names],
    ).fetchall()
    assert rows == []
