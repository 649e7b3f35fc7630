-- 0019: the ready lane's gauges read indexes, not the ring. The relay's gauges (every 15 s, in
-- every relay) and `outbox-relay stats` counted the lane as `ready − claims` and `claims − done`:
-- four full counts of the ring, which holds up to four segments of 131,072 rows per table, plus
-- (for stats) an anti-join over the whole lane. With 400,000 rows in the ring that was 166 ms on
-- both cores of this machine (parallel sequential scans) every 15 s, growing as the ring filled:
-- the steady-load latency crept up over a run (p50 4.6 → 10.3 ms across 17 minutes at 500/s)
-- and fell back when a segment was reclaimed. Now, with the same index-only settings as the
-- relay's own functions:
--   due       the rows past the newest one claimed (capped at a million; a row left behind it,
--             whose transaction committed long after later ones, is claimed by the next window
--             but not counted — as for the oldest, since 0015);
--   in_flight the claims whose lease has not run out and that have not ended (one whose lease
--             ran out is an orphan: the next look moves it to messages, where it counts as due);
--   oldest    the oldest of the first thousand rows past the newest claim.
-- Their cost follows the backlog and the leases of the last lease period, not the ring.
--
-- Upgrading: relays of the previous version keep their own statement; `migrate` grants the new
-- function to the relay and operator roles.

CREATE FUNCTION lane_gauges(OUT due bigint, OUT in_flight bigint, OUT oldest timestamptz)
LANGUAGE plpgsql
STABLE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
SET max_parallel_workers_per_gather = 0
AS $$
DECLARE
    v_last bigint;
BEGIN
    SELECT coalesce(max(c.id), 0) INTO v_last FROM claims c;
    SELECT count(*) INTO due FROM (SELECT 1 FROM ready r WHERE r.id > v_last LIMIT 1000000) AS s;
    SELECT min(f.created_at) INTO oldest
    FROM (SELECT r.created_at FROM ready r WHERE r.id > v_last ORDER BY r.id LIMIT 1000) AS f;
    SELECT count(*) INTO in_flight
    FROM claims c
    WHERE c.until > now()
      AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = c.seg AND d.id = c.id);
END;
$$;
