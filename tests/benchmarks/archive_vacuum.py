"""What the archive's vacuum for inserts costs and saves (not part of the suite).

    .venv/bin/python tests/benchmarks/archive_vacuum.py [--rows 1000000] [--chunk 100000]
        [--prune 0.2]

It fills the archive of a scratch database with `--rows` messages of 1 KiB, prunes its oldest
`--prune` share, and freezes what is left — the archive's life between two prunes, and the vacuum
against wraparound — twice: once with a VACUUM after every `--chunk` inserts (what autovacuum's
insert trigger does on an archive too young for the vacuums its prunes trigger), once without.
Before the prune it reads every row, as the pipeline's export does, and times `count(*)` (an
index-only scan needs pages marked all-visible). Each VACUUM follows a CHECKPOINT, as a vacuum of
pages written minutes ago does. It prints, per vacuum, the pages scanned and dirtied, full-page
images and WAL (from VACUUM VERBOSE), and what the whole server wrote from the fill to the end
(blocks, from pg_stat_bgwriter, and WAL): a reader that sets hint bits writes too. Services
come from OUTBOX_TEST_DATABASE_URL (default: the local one).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.support import services

INSERT = (
    "INSERT INTO outbox.archive (message_id, exchange, routing_key, body, headers, properties,"
    " attempts, created_at) SELECT gen_random_uuid(), 'orders', 'order.created',"
    " convert_to(rpad(g::text, 1024, 'x'), 'UTF8'), '{}', '{}', 1, now()"
    " FROM generate_series(1, %s) g"
)
WAL = re.compile(r"WAL usage: (\d+) records, (\d+) full page images, (\d+) bytes")


@dataclass
class Work:
    label: str
    scanned: int = 0
    dirtied: int = 0
    fpis: int = 0
    wal_bytes: int = 0
    seconds: float = 0.0

    def add(self, other: Work) -> None:
        self.scanned += other.scanned
        self.dirtied += other.dirtied
        self.fpis += other.fpis
        self.wal_bytes += other.wal_bytes
        self.seconds += other.seconds

    def line(self) -> str:
        return (
            f"{self.label}: pages scanned {self.scanned:,}, dirtied {self.dirtied:,}, full-page"
            f" images {self.fpis:,}, WAL {self.wal_bytes / 1e6:,.1f} MB, {self.seconds:.1f} s"
        )


def vacuum(conn: psycopg.Connection[Any], options: str, label: str) -> Work:
    """One VACUUM of the archive after a CHECKPOINT, and what its VERBOSE report says it did."""
    notes: list[str] = []

    def note(diagnostic: psycopg.errors.Diagnostic) -> None:
        notes.append(diagnostic.message_primary or "")

    conn.execute("CHECKPOINT")
    conn.add_notice_handler(note)
    started = time.perf_counter()
    try:
        conn.execute(f"VACUUM ({options}) outbox.archive")
    finally:
        conn.remove_notice_handler(note)
    text = "\n".join(notes)
    wal = WAL.findall(text)
    return Work(
        label,
        scanned=sum(
            int(n) for n in re.findall(r"pages: \d+ removed, \d+ remain, (\d+) scanned", text)
        ),
        dirtied=sum(int(n) for n in re.findall(r"(\d+) dirtied", text)),
        fpis=sum(int(w[1]) for w in wal),
        wal_bytes=sum(int(w[2]) for w in wal),
        seconds=time.perf_counter() - started,
    )


WRITTEN = "SELECT buffers_checkpoint + buffers_clean + buffers_backend FROM pg_stat_bgwriter"


def written(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """Blocks the whole server wrote so far, and its WAL position in bytes."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    row = conn.execute(f"SELECT ({WRITTEN}), pg_current_wal_lsn() - '0/0'").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def life(url: str, rows: int, chunk: int, prune: float, insert_vacuums: bool) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CHECKPOINT")
        blocks, wal = written(conn)
        inserts = Work(f"{-(-rows // chunk)} vacuums for inserts")
        for start in range(0, rows, chunk):
            conn.execute(INSERT, (min(chunk, rows - start),))
            if insert_vacuums:
                inserts.add(vacuum(conn, "VERBOSE", ""))
        # The export reads every row before the pipeline prunes: the first reader of a page
        # sets its hint bits, which dirties it, unless a vacuum did so already.
        conn.execute("CHECKPOINT")
        started = time.perf_counter()
        conn.execute("SELECT sum(length(body)) FROM outbox.archive").fetchone()
        export = time.perf_counter() - started
        counts = []
        for _ in range(3):
            started = time.perf_counter()
            conn.execute("SELECT count(*) FROM outbox.archive").fetchone()
            counts.append(time.perf_counter() - started)
        plan = " ".join(
            str(r[0]).split("(cost=")[0].strip().removeprefix("->").strip()
            for r in conn.execute("EXPLAIN SELECT count(*) FROM outbox.archive").fetchall()
            if "Scan" in str(r[0])
        )
        row = conn.execute("SELECT min(id), max(id) FROM outbox.archive").fetchone()
        assert row is not None
        low, high = row
        conn.execute("DELETE FROM outbox.archive WHERE id < %s", (low + int((high - low) * prune),))
        pruned = vacuum(conn, "VERBOSE", "the vacuum after the prune")
        frozen = vacuum(conn, "FREEZE, VERBOSE", "the vacuum against wraparound (FREEZE)")
        conn.execute("CHECKPOINT")
        blocks_after, wal_after = written(conn)
    print(
        f"{'with' if insert_vacuums else 'without'} vacuums for inserts: the export's read of"
        f" {rows:,} rows {export:.1f} s; count(*) {counts[0] * 1000:.0f} ms, then"
        f" {min(counts) * 1000:.0f} ms ({plan})"
    )
    total = Work("the vacuums")
    steps = ([inserts] if insert_vacuums else []) + [pruned, frozen]
    for step in steps:
        print(f"  {step.line()}")
        total.add(step)
    print(f"  {total.line()}")
    print(
        f"  the server, fill to freeze: {blocks_after - blocks:,} blocks written,"
        f" WAL {(wal_after - wal) / 1e6:,.1f} MB"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=100_000, help="inserts per vacuum for them")
    parser.add_argument("--prune", type=float, default=0.2, help="share of the oldest rows pruned")
    args = parser.parse_args()
    if not 0 < args.prune < 1 or args.rows < 1 or args.chunk < 1:
        raise SystemExit("--rows and --chunk must be positive, --prune between 0 and 1")
    with services.discover() as svc:
        for insert_vacuums in (True, False):
            with svc.scratch_database("outbox_vacuum") as url:
                life(url, args.rows, args.chunk, args.prune, insert_vacuums)


if __name__ == "__main__":
    main()
