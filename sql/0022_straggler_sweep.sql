-- 0022: no whole-lane walk at steady state (docs/decisions/0004, "The walk over the whole lane").
--
-- A relay used to walk the whole ready lane every 5 minutes, in one claim, for the rows its
-- windows had left behind (a row skipped while another relay's claim held it, for longer than the
-- window waits, should that claim roll back). The walk's anti-join probed `claims` once per row of
-- the ring: with 400,000 rows ~0.8–1 s, during which the relay's loop waited — a stall in the
-- latency every 5 minutes. The same walk opened every relay's first window, and every window after
-- an outage. Both are replaced by set-based look-ups, which a hash or merge anti-join answers for
-- the whole ring in a fifth of the time:
--
--   lane_start()          where a relay's first window starts: a snapshot, and the first ready
--                         row visible in it that has no claim (NULL: none). Every row before it
--                         was claimed (claims rows are never deleted but by TRUNCATE), so the
--                         window walks from there, not from the lane's start.
--   sweep_stragglers(…)   a relay chore, on its own pooled connection: the ready rows visible in
--                         a snapshot that the relay's windows passed a while ago and that still
--                         have no claim — each skipped while another claim held it, which then
--                         rolled back — are moved to messages as new, due messages (attempt 0),
--                         where every relay's claim finds them. The claim of a straggler is the
--                         sweep's own: it locks the ready row (SKIP LOCKED: a claim in progress
--                         keeps it) and inserts its `claims` row, whose unique key arbitrates as
--                         for any claim: a relay's claim that got there first makes the sweep
--                         leave the row, and one that comes later finds it claimed.
--
-- Upgrading: new functions only; claim_batch and every other signature is unchanged. Relays of
-- the previous version keep walking the whole lane every 5 minutes (correct, as before); those of
-- this version never do. `migrate` grants the new functions to the relay role.

SET LOCAL lock_timeout = '10s';

-- The snapshot a relay's first window ends at, and the first row visible in it with no claim.
-- A row whose claim is still in progress counts as unclaimed here (its claims row is not yet
-- committed), so the window starts at or before it, and walks it again should that claim roll
-- back. Set-based, for both functions: the planner's hash anti-join of the two tables reads a
-- ring of 400,000 rows in ~225 ms, where claim_batch's nested loop of index probes took 0.8–1 s
-- (its SET clauses forbid every other join, and are not inherited here). In one process: these
-- run beside the relay's loop, and parallel workers would take the cores its claims need.
CREATE FUNCTION lane_start(OUT snapshot text, OUT xid xid8, OUT id bigint)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_hashjoin = on
SET enable_mergejoin = on
SET enable_seqscan = on
SET max_parallel_workers_per_gather = 0
AS $$
#variable_conflict use_column
DECLARE
    v_snapshot pg_snapshot;
BEGIN
    PERFORM _read_committed('lane_start');
    -- Taken before the statement's own snapshot: every row visible in it is visible below.
    v_snapshot := pg_current_snapshot();
    snapshot := v_snapshot::text;
    SELECT r.xid, r.id INTO xid, id
    FROM ready r
    WHERE pg_visible_in_snapshot(r.xid, v_snapshot)
      AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id)
    ORDER BY r.xid, r.id
    LIMIT 1;
END;
$$;

-- The ready rows visible in snapshot p_passed that have no claim, up to p_limit, locked (SKIP
-- LOCKED: a claim in progress keeps its rows, and is never waited for). Set-based, as lane_start.
CREATE FUNCTION _stragglers(p_passed pg_snapshot, p_limit integer)
RETURNS TABLE (seg smallint, id bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_hashjoin = on
SET enable_mergejoin = on
SET enable_seqscan = on
SET max_parallel_workers_per_gather = 0
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    SELECT r.seg, r.id FROM ready r
    WHERE r.xid < pg_snapshot_xmax(p_passed) AND pg_visible_in_snapshot(r.xid, p_passed)
      AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id)
    LIMIT p_limit
    FOR UPDATE OF r SKIP LOCKED;
END;
$$;

-- Move up to p_limit ready rows that are visible in snapshot p_passed and have no claim to
-- messages, as new messages due now (attempt 0, no error: they were never sent). p_passed must be
-- a snapshot every window of the caller ended after a while ago (the caller's business: see
-- relay/postgres/store.py); a row it moves was then skipped by that relay's windows while another
-- claim held it, and that claim has since rolled back. A row still held is skipped; so is one a
-- relay claims meanwhile. Returns how many rows it looked at and how many it moved (fewer looked
-- than p_limit: nothing more to move). Only the search is set-based: the rest runs with 0015's
-- settings (generic plans, nested loops of index look-ups), like every other function that ends
-- ready rows — a plan of _ready_copy's statements made here is cached for the session, and a
-- settle on the same pooled connection would reuse it.
CREATE FUNCTION sweep_stragglers(p_passed text, p_limit integer, OUT looked integer,
                                 OUT moved integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    v_passed pg_snapshot;
    v_claim  uuid := gen_random_uuid();
    v_open   record;
    v_ids    bigint[];
BEGIN
    PERFORM _read_committed('sweep_stragglers');
    IF p_passed IS NULL OR p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'sweep_stragglers: a snapshot and a positive limit are needed'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_passed := p_passed::pg_snapshot;
    IF pg_snapshot_xmax(v_passed) > pg_snapshot_xmax(pg_current_snapshot()) THEN
        -- From the future, or from before transaction ids went backwards (a crash losing WAL, a
        -- failover): it says nothing about the rows here. The relay starts its windows again.
        RAISE EXCEPTION 'sweep_stragglers: snapshot % is ahead of the server''s', p_passed
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT coalesce(array_agg(o.seg), '{}') AS segs, coalesce(array_agg(o.id), '{}') AS ids
    INTO v_open
    FROM _stragglers(v_passed, p_limit) AS o;
    looked := cardinality(v_open.ids);
    WITH taken AS (
        INSERT INTO claims (seg, id, claim_id, claimed_by, until)
        SELECT o.seg, o.id, v_claim, 'straggler sweep', now()
        FROM unnest(v_open.segs, v_open.ids) AS o(seg, id)
        ORDER BY 1, 2  -- one order for every writer
        ON CONFLICT DO NOTHING
        RETURNING claims.id
    )
    SELECT coalesce(array_agg(t.id), '{}') INTO v_ids FROM taken t;
    moved := 0;
    IF cardinality(v_ids) > 0 THEN
        SELECT count(*) INTO moved
        FROM _ready_copy(v_ids, v_ids, array_fill(0::float8, ARRAY[cardinality(v_ids)]),
                         array_fill(NULL::text, ARRAY[cardinality(v_ids)]),
                         array_fill(true, ARRAY[cardinality(v_ids)]),
                         array_fill(false, ARRAY[cardinality(v_ids)]), NULL);
    END IF;
END;
$$;
