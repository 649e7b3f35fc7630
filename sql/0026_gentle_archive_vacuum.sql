-- 0026: autovacuum works through the archive and the dead letters at a gentler pace
-- (docs/decisions/0004, "Recovery after a pin: a gentler vacuum of the archive").
--
-- Both tables only grow between prunes, and nothing on a relay's hot path reads them. While the
-- vacuum horizon is pinned, none of the pages written to them can become all-visible; when the
-- pin ends, autovacuum visits every one of them at once, and at the default pace (a 2 ms delay
-- per 200 cost units) its page writes and WAL compete with the producers' commits for the disk:
-- the commit → delivery p99 stayed above 1.2x the clean phase's for minutes after a pin at
-- 2,000 commits/s. With a 20 ms delay (PostgreSQL's default before version 12) the same catch-up
-- takes longer and disturbs nothing; the measurements are in the decision record. The server's
-- own settings still apply to every other table, and an operator may set these two otherwise.
--
-- Upgrading: ALTER TABLE ... SET takes SHARE UPDATE EXCLUSIVE, which blocks neither the relays'
-- inserts (relays of the previous version included) nor the pipeline's reads and prunes; it
-- waits for a manual or anti-wraparound vacuum that is running on either table, for at most
-- 10 s (lock_timeout; run it again after one); an ordinary autovacuum gives way to it.

SET LOCAL lock_timeout = '10s';

ALTER TABLE archive SET (autovacuum_vacuum_cost_delay = 20);
ALTER TABLE dead SET (autovacuum_vacuum_cost_delay = 20);
