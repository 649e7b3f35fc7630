-- 0025: the relay's functions never JIT-compile their statements (docs/decisions/0004, "Found
-- (2026-11-28): JIT at depth").
--
-- JIT decides by a plan's estimated cost (jit_above_cost, 100,000 by default). The claim and the
-- settle keep generic plans, whose costs grow with the rows the ring holds: at a backlog of
-- 1,000,000 the claim's page (_ready_page) was estimated above the threshold, and every call
-- compiled its plan — 38 ms of the 43 ms a claim of 500 rows took, against 5 ms without JIT. A
-- relay at 1,000,000 spent 0.17 s of PostgreSQL's CPU per 1,000 messages, against 0.07 with the
-- statements before 0024. lane_start (654 ms against 486), lane_gauges (120 against 74) and
-- _window_first_open (2.4 against 0.7) paid too. Each of these functions reads a batch, or the
-- ring once, and what compiling costs rises with the backlog a relay is there to drain.
--
-- So `jit = off` for each function a relay may call (roles.sql's grant); what they call inherits
-- it. Producers' functions insert one row, or an array of them, and never reach the threshold.
--
-- Upgrading: no lock on any table; relays of the previous version call these functions too and
-- get the setting with the migration.

ALTER FUNCTION settle(uuid, bigint[], bigint[], text[], text[], bigint[], float8[], text[],
                      boolean[], boolean[], bigint[], boolean) SET jit = off;
ALTER FUNCTION bury_exhausted(integer, integer) SET jit = off;
ALTER FUNCTION release_stranded(integer) SET jit = off;
ALTER FUNCTION forget_idle_keys(interval, text, integer) SET jit = off;
ALTER FUNCTION claim_batch(integer, bigint, uuid, text, float8, text, text, xid8, bigint,
                           boolean, boolean) SET jit = off;
ALTER FUNCTION settle_then_claim(uuid, bigint[], bigint[], text[], text[], bigint[], float8[],
                                 text[], boolean[], boolean[], bigint[], boolean, integer, bigint,
                                 uuid, text, float8, text, text, xid8, bigint, boolean, boolean)
    SET jit = off;
ALTER FUNCTION extend_leases(uuid, bigint[], float8) SET jit = off;
ALTER FUNCTION release_orphans(timestamptz, integer) SET jit = off;
ALTER FUNCTION reclaim_segment(integer) SET jit = off;
ALTER FUNCTION lane_start() SET jit = off;
ALTER FUNCTION sweep_stragglers(text, integer) SET jit = off;
ALTER FUNCTION use_fast_lane() SET jit = off;
ALTER FUNCTION lane_gauges() SET jit = off;
ALTER FUNCTION arm_doorbell() SET jit = off;
ALTER FUNCTION use_doorbell() SET jit = off;
