-- 0026: no vacuum of the archive for its inserts alone (docs/decisions/0004, "The archive's
-- vacuum for inserts, turned off (migration 0026)").
--
-- The archive only grows between prunes. PostgreSQL vacuums a table for its inserts once they
-- pass 1,000 rows and 20 % of it, and such a vacuum dirties every page written since the last one
-- (hint bits, all-visible) — at 2,000 messages/s once a minute some 17,000 pages in seconds,
-- whose writes compete with producers' commits for the disk; after a pinned horizon, every page
-- written during the pin at once. The same pages are visited anyway by the vacuum a prune
-- triggers (0006: 1 % of the archive deleted) and by the one against wraparound, which freezes
-- them: measured, a whole cycle (fill, prune, freeze) dirties 9 % fewer pages without the insert
-- vacuums, and writes the same WAL. So that work moves to the vacuum after each prune, which runs
-- when the operator prunes. What it costs: `count(*)` of the archive (`outbox-relay stats`) reads
-- the table instead of its primary key's index, 3–4 times slower.
--
-- Upgrading: ALTER TABLE … SET takes SHARE UPDATE EXCLUSIVE on the archive, which conflicts with
-- no statement a relay or producer runs (only with VACUUM, ANALYZE and other DDL): relays of the
-- previous version go on. A vacuum of the archive in progress is cancelled by autovacuum itself
-- after deadlock_timeout, or makes this give up after 10 s (run it again). To go back:
-- `ALTER TABLE outbox.archive RESET (autovacuum_vacuum_insert_threshold)`.

SET LOCAL lock_timeout = '10s';

ALTER TABLE archive SET (autovacuum_vacuum_insert_threshold = -1);
