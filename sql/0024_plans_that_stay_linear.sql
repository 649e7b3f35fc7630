-- 0024: the ring's look-ups keep their plans linear, whatever the statistics say when they are
-- made (docs/decisions/0004, "The stalls at 2,000/s").
--
-- A segment's partitions are empty after their TRUNCATE, and autovacuum soon analyzes them so.
-- A plan made then and kept for the session (a generic plan: forced, as in the claim and the
-- settle, or chosen by plpgsql's plan cache) takes the empty partition at its word:
--
--   * the claim's anti-join (`_ready_page`: NOT EXISTS in claims) became a nested loop over a
--     Materialize of the whole of `claims`, filtered once per ready row, instead of one index
--     look-up per row. A claim of 100 rows read 20,000 claims rows when the segment held 20,000
--     (tests/integration/test_plans.py); at 2,000/s, with 130,000 rows a segment, claims and
--     settles took 0.3-1.5 s each and the relay fell behind by up to 40 s — until an ANALYZE
--     replaced the plan. It began when producers entered a segment emptied since the session
--     made its plan: the stalls at segment boundaries of the pinned-horizon benchmark.
--   * the straggler sweep and lane_start, written as a hash anti-join over the ring, became a
--     nested loop that scanned `claims_N` whole for every ready row: one sweep took 44 s of a
--     core at 100,000 rows.
--
-- The remedy is in the statements and one index, not in the statistics (which cannot be trusted
-- on a table truncated every minute): each look-up by (seg, id) gets a shape with one plan.
--
--   * Each NOT EXISTS, and each join, that looks a ready, claims or done row up by (seg, id) is a
--     subquery ending in `OFFSET 0`, which PostgreSQL never pulls up into a join: it stays a
--     subplan (NOT EXISTS) or a lateral subquery (the settle's `_ready_end`), run once per row,
--     and with sequential scans off (the callers' settings) its one plan is a probe of the
--     unique index. `release_orphans` updates the claims it took by id arrays, not by a join.
--   * ready's look-ups by id read its (xid, id) index whole, once per row: on an empty partition
--     any index with a column id costs what the unique one does. The cursor's index becomes
--     (xid, id + 0), which no look-up by id can use; the claim and the walk of a window compare
--     and order by (xid, id + 0). claim_batch sorts the rows it took after looking them up.
--   * lane_start and _stragglers may not use nested loops: the hash anti-join they were written
--     for reads each table once; so may reclaim_segment's first check (no lock held). Its second,
--     under the partitions' locks, moves to _segment_open_since, which can only probe.
--
-- The functions below are 0015's, 0017's (claim_batch) and 0019's (lane_gauges), unchanged but
-- for the above; tests/integration/test_plans.py makes their plans on empty partitions, then
-- counts the rows each reads.
--
-- Upgrading: same signatures, same results; relays of the previous version call these functions
-- too and get the fix with the migration. While it builds the new index it holds `ready`
-- (producers and relays wait; about a second per 250,000 rows in the ring).

SET LOCAL lock_timeout = '10s';

-- The cursor's index on (xid, id + 0), in place of 0015's on (xid, id): an index whose second
-- column is id can answer `id = …` by reading all of it, and a plan made while a partition was
-- empty did so for the settle's and the claim's look-ups by id (a full index scan per row).
-- The migration holds ready and its partitions (ACCESS EXCLUSIVE, taken first, so that it waits
-- once and never upgrades a lock) while the index is built: producers' enqueues and relays'
-- claims and settles wait about a second per 250,000 rows in the ring.
LOCK TABLE ready IN ACCESS EXCLUSIVE MODE;  -- one wait, not SHARE then ACCESS EXCLUSIVE
CREATE INDEX ready_cursor_idx ON ready (xid, (id + 0));
DROP INDEX ready_xid_idx;

ALTER FUNCTION lane_start() SET enable_nestloop = off;
ALTER FUNCTION _stragglers(pg_snapshot, integer) SET enable_nestloop = off;

-- 0017's, but for the look-up of the rows taken (at its end).
CREATE OR REPLACE FUNCTION claim_batch(p_limit integer, p_max_bytes bigint, p_claim_id uuid,
                            p_claimed_by text, p_lease float8, p_prev text, p_hi text,
                            p_xid xid8, p_id bigint, p_ready_first boolean, p_verify boolean)
RETURNS TABLE (id bigint, message_id uuid, exchange text, routing_key text, body bytea,
               headers text, properties text, ordering_key text, created_at timestamptz,
               attempts integer, ambiguous integer, last_error text, seq bigint, replays integer,
               replayed_at timestamptz, replayed_from text, locked bigint, lane text,
               window_hi text, window_xid xid8, window_id bigint, window_closed boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    v_prev     pg_snapshot := p_prev::pg_snapshot;
    v_hi       pg_snapshot := coalesce(p_hi::pg_snapshot, pg_current_snapshot());
    v_left     integer := p_limit;
    v_bytes    bigint := p_max_bytes;
    v_locked   bigint := 0;
    v_xid      xid8 := p_xid;
    v_id       bigint := p_id;
    v_range    record;
    v_xips     xid8[];
    v_page     record;
    v_seen     integer;
    v_count    bigint;
    v_cut      boolean := false;
    v_taken    bigint[] := '{}';
    v_closed   boolean := false;
    v_open_xid xid8;
    v_open_id  bigint;
    v_slow_due boolean;
BEGIN
    PERFORM _read_committed('claim_batch');
    IF p_limit < 1 OR p_max_bytes < 1 OR p_lease <= 0 THEN
        RAISE EXCEPTION 'claim_batch: limit, bytes and lease must be positive'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Transaction ids only go forward, except after a crash (ids whose only trace was WAL not
    -- yet flushed are handed out again) or a failover to an asynchronous standby: windows
    -- remembered from before would never contain those ids. Walk the whole lane instead.
    IF pg_snapshot_xmax(pg_current_snapshot())
       < greatest(pg_snapshot_xmax(v_prev), pg_snapshot_xmax(v_hi)) THEN
        v_prev := '1:1:';
        v_hi := pg_current_snapshot();
        v_xid := '0';
        v_id := 0;
    END IF;

    -- Whether the slow lane has anything due: one probe of its due index, where claiming from it
    -- (the locking statement, the bytes it took) costs a quarter of a claim of one ready row.
    v_slow_due := EXISTS (SELECT 1 FROM messages m
                          WHERE m.claim_id IS NULL AND NOT m.gated AND m.available_at <= now());

    IF NOT p_ready_first AND v_slow_due THEN
        RETURN QUERY
        SELECT c.*, 'messages', NULL::text, NULL::xid8, NULL::bigint, NULL::boolean
        FROM _slow_claim(v_left, v_bytes, p_claim_id, p_claimed_by, p_lease) AS c;
        GET DIAGNOSTICS v_seen = ROW_COUNT;
        IF v_seen > 0 THEN
            v_left := v_left - v_seen;
            v_bytes := v_bytes - _claimed_bytes(p_claim_id, p_lease, '{}');
        END IF;
    END IF;

    -- The ready lane: the transactions running when the window opened that have committed since
    -- (one page for all of them: a page each cost a claim at 2,000/s, with four producers, about
    -- four pages), then those that started after it opened (one range). All the first are below
    -- the second's start, so the cursor only moves forward.
    v_xips := ARRAY(SELECT x FROM pg_snapshot_xip(v_prev) AS x
                    WHERE x >= v_xid AND pg_visible_in_snapshot(x, v_hi) ORDER BY x);
    FOR v_range IN
        SELECT 1 AS k, v_xips AS xips, NULL::xid8 AS lo, NULL::xid8 AS hi
        WHERE cardinality(v_xips) > 0
        UNION ALL
        SELECT 2, NULL, greatest(pg_snapshot_xmax(v_prev), v_xid), pg_snapshot_xmax(v_hi)
        ORDER BY 1
    LOOP
        EXIT WHEN v_left < 1 OR v_bytes < 1 OR v_cut;
        v_seen := 0;
        FOR v_page IN
            SELECT * FROM _ready_page(v_range.xips, v_range.lo, v_range.hi, v_hi, v_xid, v_id,
                                      v_left, v_bytes, p_claim_id, p_claimed_by, p_lease)
        LOOP
            IF v_page.seg IS NOT NULL THEN
                v_taken := v_taken || v_page.id;
            ELSE  -- the trailer: the cursor, and the counts
                v_xid := v_page.xid;
                v_id := v_page.id;
                v_seen := v_page.taken;
                v_count := v_page.locked;
            END IF;
        END LOOP;
        IF v_seen > 0 THEN
            v_locked := v_locked + v_count;
            v_cut := v_count > v_seen;  -- the byte limit: the rest stays for the next claim
            v_left := v_left - v_seen;
        END IF;
    END LOOP;
    -- Short of the limit: the window is done — when p_verify, only if no row in it is still
    -- unclaimed (then it is walked again from that row). A relay verifies a window now and then,
    -- one that covers the windows it closed unverified since (a row skipped while another relay's
    -- claim held it is found then, should that claim roll back), not every claim.
    IF v_left >= 1 AND v_bytes >= 1 AND NOT v_cut THEN
        IF p_verify THEN
            SELECT o.xid, o.id INTO v_open_xid, v_open_id FROM _window_first_open(v_prev, v_hi) AS o;
        END IF;
        IF v_open_xid IS NULL THEN
            v_closed := true;
        ELSE
            v_xid := v_open_xid;
            v_id := v_open_id - 1;
        END IF;
    END IF;

    IF cardinality(v_taken) > 0 THEN
        -- Looked up by id in a CTE with no order, then sorted: asked for (xid, id) order, a plan
        -- made on an empty partition read the whole (xid, id) index, filtering by id.
        RETURN QUERY
        WITH taken AS MATERIALIZED (
            SELECT r.id, r.xid, r.message_id, r.exchange, r.routing_key, r.body, r.headers,
                   r.properties, r.created_at
            FROM ready r
            WHERE r.seg = ANY(ARRAY(SELECT DISTINCT _seg(t) FROM unnest(v_taken) AS t))
              AND r.id = ANY(v_taken)
        )
        SELECT r.id, r.message_id, r.exchange, r.routing_key, r.body, r.headers::text,
               r.properties::text, NULL::text, r.created_at, 1, 0, NULL::text, NULL::bigint, 0,
               NULL::timestamptz, NULL::text, v_locked, 'ready', NULL::text, NULL::xid8,
               NULL::bigint, NULL::boolean
        FROM taken r
        ORDER BY r.xid, r.id;
    END IF;

    IF p_ready_first AND v_slow_due AND v_left >= 1 AND NOT v_cut THEN
        v_bytes := v_bytes - _claimed_bytes(p_claim_id, p_lease, v_taken);
        IF v_bytes >= 1 OR cardinality(v_taken) = 0 THEN
            RETURN QUERY
            SELECT c.*, 'messages', NULL::text, NULL::xid8, NULL::bigint, NULL::boolean
            FROM _slow_claim(v_left, greatest(v_bytes, 1), p_claim_id, p_claimed_by, p_lease) AS c;
        END IF;
    END IF;

    RETURN QUERY
    SELECT NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::bytea, NULL::text, NULL::text,
           NULL::text, NULL::timestamptz, NULL::integer, NULL::integer, NULL::text, NULL::bigint,
           NULL::integer, NULL::timestamptz, NULL::text, v_locked, NULL::text, v_hi::text,
           CASE WHEN v_closed THEN '0'::xid8 ELSE v_xid END,
           CASE WHEN v_closed THEN 0 ELSE v_id END, v_closed;
END;
$$;


CREATE OR REPLACE FUNCTION _ready_has(p_message_id uuid) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM ready r
                   WHERE r.message_id = p_message_id
                     AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = r.seg AND d.id = r.id OFFSET 0));
END;
$$;


CREATE OR REPLACE FUNCTION _ready_page(p_xips xid8[], p_from xid8, p_to xid8, p_hi pg_snapshot, p_xid xid8,
                            p_id bigint, p_limit integer, p_max_bytes bigint, p_claim_id uuid,
                            p_claimed_by text, p_lease float8)
RETURNS TABLE (seg smallint, id bigint, xid xid8, taken bigint, locked bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
BEGIN
    -- Two copies of one statement that differ only in how `due` reaches the (xid, id) index: one
    -- probe per transaction, or one range. A single statement with an OR of the two (or with
    -- p_xips spread as a range) reads the index between the oldest and newest transaction.
    IF p_xips IS NOT NULL THEN  -- the transactions of p_xips (committed, all of them)
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT r.seg, r.id, r.xid,
               octet_length(r.body) + pg_column_size(r.headers) + pg_column_size(r.properties)
                   AS bytes
        FROM ready r
        WHERE r.xid = ANY(p_xips)
          AND (r.xid, r.id + 0) > (p_xid, p_id)
          AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id OFFSET 0)
        ORDER BY r.xid, r.id + 0
        LIMIT p_limit
        FOR UPDATE OF r SKIP LOCKED
    ), taken AS MATERIALIZED (
        SELECT s.seg, s.id, s.xid
        FROM (SELECT due.seg, due.id, due.xid, due.bytes,
                     sum(due.bytes) OVER (ORDER BY due.xid, due.id) AS running
              FROM due) AS s
        WHERE s.running <= p_max_bytes OR s.running = s.bytes
    ), ins AS (
        INSERT INTO claims (seg, id, claim_id, claimed_by, until)
        SELECT taken.seg, taken.id, p_claim_id, p_claimed_by,
               now() + make_interval(secs => p_lease)
        FROM taken
        ON CONFLICT DO NOTHING
        RETURNING claims.seg, claims.id
    )
    SELECT ins.seg, ins.id, NULL::xid8, NULL::bigint, NULL::bigint FROM ins
    UNION ALL
    SELECT NULL::smallint, last.id, last.xid, (SELECT count(*) FROM taken),
           (SELECT count(*) FROM due)
    FROM (SELECT t.id, t.xid FROM taken t ORDER BY t.xid DESC, t.id DESC LIMIT 1) AS last;
    ELSE  -- the range: transactions p_from..p_to that had committed at p_hi
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT r.seg, r.id, r.xid,
               octet_length(r.body) + pg_column_size(r.headers) + pg_column_size(r.properties)
                   AS bytes
        FROM ready r
        -- The cursor is the range's only lower bound: given `xid >= p_from` beside it, the
        -- index scan started from the cursor's (0, 0) and stepped over every row of the ring
        -- below p_from (2.5 ms a claim with 120,000 rows in one segment, not 0.01).
        WHERE (r.xid, r.id + 0) > (greatest(p_xid, p_from),
                               CASE WHEN p_xid >= p_from THEN p_id ELSE -1 END)
          AND r.xid <= p_to AND r.xid < pg_snapshot_xmax(p_hi)
          AND r.xid <> ALL(ARRAY(SELECT pg_snapshot_xip(p_hi)))
          AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id OFFSET 0)
        ORDER BY r.xid, r.id + 0
        LIMIT p_limit
        FOR UPDATE OF r SKIP LOCKED
    ), taken AS MATERIALIZED (
        SELECT s.seg, s.id, s.xid
        FROM (SELECT due.seg, due.id, due.xid, due.bytes,
                     sum(due.bytes) OVER (ORDER BY due.xid, due.id) AS running
              FROM due) AS s
        WHERE s.running <= p_max_bytes OR s.running = s.bytes
    ), ins AS (
        INSERT INTO claims (seg, id, claim_id, claimed_by, until)
        SELECT taken.seg, taken.id, p_claim_id, p_claimed_by,
               now() + make_interval(secs => p_lease)
        FROM taken
        ON CONFLICT DO NOTHING
        RETURNING claims.seg, claims.id
    )
    SELECT ins.seg, ins.id, NULL::xid8, NULL::bigint, NULL::bigint FROM ins
    UNION ALL
    SELECT NULL::smallint, last.id, last.xid, (SELECT count(*) FROM taken),
           (SELECT count(*) FROM due)
    FROM (SELECT t.id, t.xid FROM taken t ORDER BY t.xid DESC, t.id DESC LIMIT 1) AS last;
    END IF;
END;
$$;


CREATE OR REPLACE FUNCTION _window_first_open(p_prev pg_snapshot, p_hi pg_snapshot, OUT xid xid8,
                                   OUT id bigint)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
BEGIN
    -- Two lookups the (xid, id) index answers directly: the transactions running at p_prev,
    -- then the range after it (an OR of the two would scan every partition from its start).
    SELECT r.xid, r.id INTO xid, id FROM ready r
    WHERE r.xid = ANY(ARRAY(SELECT x FROM pg_snapshot_xip(p_prev) AS x
                            WHERE pg_visible_in_snapshot(x, p_hi)))
      AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id OFFSET 0)
    ORDER BY r.xid, r.id + 0
    LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT r.xid, r.id INTO xid, id FROM ready r
    WHERE r.xid >= pg_snapshot_xmax(p_prev) AND r.xid < pg_snapshot_xmax(p_hi)
      AND r.xid <> ALL(ARRAY(SELECT pg_snapshot_xip(p_hi)))
      AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id OFFSET 0)
    ORDER BY r.xid, r.id + 0
    LIMIT 1;
END;
$$;


CREATE OR REPLACE FUNCTION release_orphans(p_after timestamptz, p_limit integer, OUT looked integer,
                                OUT moved integer, OUT last_until timestamptz,
                                OUT checked_at timestamptz)
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
    v_claim uuid := gen_random_uuid();
    v_ids   bigint[];
BEGIN
    PERFORM _read_committed('release_orphans');
    checked_at := now();
    WITH expired AS (
        SELECT c.seg, c.id FROM claims c
        WHERE c.until < now() AND c.until >= coalesce(p_after, '-infinity')
          AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = c.seg AND d.id = c.id OFFSET 0)
        ORDER BY c.until
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), taken AS (
        UPDATE claims c SET claim_id = v_claim  -- by id: a join may read all of claims
        WHERE c.seg = ANY(ARRAY(SELECT DISTINCT e.seg FROM expired e))
          AND c.id = ANY(ARRAY(SELECT e.id FROM expired e)) AND c.until < now()
        RETURNING c.id, c.until
    )
    SELECT coalesce(array_agg(t.id), '{}'), max(t.until) INTO v_ids, last_until FROM taken t;
    looked := cardinality(v_ids);
    moved := 0;
    IF cardinality(v_ids) > 0 THEN
        SELECT count(*) INTO moved
        FROM _ready_copy(v_ids, v_ids, array_fill(0::float8, ARRAY[cardinality(v_ids)]),
                         array_fill('its relay stopped renewing the lease'::text,
                                    ARRAY[cardinality(v_ids)]),
                         array_fill(false, ARRAY[cardinality(v_ids)]),
                         array_fill(false, ARRAY[cardinality(v_ids)]), v_claim);
    END IF;
END;
$$;


CREATE OR REPLACE FUNCTION lane_gauges(OUT due bigint, OUT in_flight bigint, OUT oldest timestamptz)
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
      AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = c.seg AND d.id = c.id OFFSET 0);
END;
$$;

-- 0015's, the settle's look-ups made lateral subqueries, each a probe of a unique index.
CREATE OR REPLACE FUNCTION _ready_end(p_ids bigint[])
RETURNS TABLE (id bigint, message_id uuid, exchange text, routing_key text, body bytea,
               headers jsonb, properties jsonb, created_at timestamptz, resent integer,
               claimed_by text)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH marked AS (
        INSERT INTO done (seg, id)
        SELECT _seg(i), i FROM unnest(p_ids) AS i
        ORDER BY 1, 2  -- one order for every writer: a late settle and a takeover never deadlock
        ON CONFLICT DO NOTHING
        RETURNING done.seg, done.id
    )
    SELECT r.id, r.message_id, r.exchange, r.routing_key, r.body, r.headers, r.properties,
           r.created_at, c.resent, c.claimed_by
    FROM marked m
    CROSS JOIN LATERAL (SELECT r.* FROM ready r WHERE r.seg = m.seg AND r.id = m.id OFFSET 0) r
    CROSS JOIN LATERAL (SELECT c.resent, c.claimed_by FROM claims c
                        WHERE c.seg = m.seg AND c.id = m.id OFFSET 0) c;
END;
$$;

-- Whether segment p_seg has a ready row not done among those that committed after p_checked was
-- taken (reclaim_segment's second look, under the partitions' ACCESS EXCLUSIVE locks: it must read
-- only those rows, each looked up in done's unique index, never the whole of done).
CREATE FUNCTION _segment_open_since(p_seg integer, p_checked pg_snapshot) RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
SET enable_seqscan = off
AS $$
BEGIN
    RETURN EXISTS (SELECT 1 FROM ready r
                   WHERE r.seg = p_seg
                     AND (r.xid = ANY(ARRAY(SELECT pg_snapshot_xip(p_checked)))
                          OR r.xid >= pg_snapshot_xmax(p_checked))
                     AND NOT EXISTS (SELECT 1 FROM done d
                                     WHERE d.seg = p_seg AND d.id = r.id OFFSET 0));
END;
$$;

-- 0015's, with its second look in _segment_open_since, and hash joins for its first.
CREATE OR REPLACE FUNCTION reclaim_segment(p_seg integer) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_nestloop = off
AS $$
DECLARE
    v_current smallint;
    v_checked pg_snapshot;
BEGIN
    -- Each check below must see what committed before it ran: under one snapshot for the whole
    -- transaction (REPEATABLE READ), a row committed after the first check would be truncated.
    PERFORM _read_committed('reclaim_segment');
    IF p_seg IS NULL OR p_seg NOT BETWEEN 0 AND 3 THEN
        RAISE EXCEPTION 'reclaim_segment: segment must be 0 to 3, not %', p_seg
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- One relay at a time (the others would only queue for the same locks).
    IF NOT pg_try_advisory_xact_lock(hashtext(current_schema() || '.reclaim_segment')) THEN
        RETURN false;
    END IF;
    SELECT _seg(s.last_value) INTO v_current FROM messages_id_seq s;
    IF p_seg IN (v_current, (v_current + 1) % 4)
       OR NOT EXISTS (SELECT 1 FROM ready r WHERE r.seg = p_seg) THEN
        RETURN false;
    END IF;
    v_checked := pg_current_snapshot();
    IF EXISTS (SELECT 1 FROM ready r
               WHERE r.seg = p_seg
                 AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = p_seg AND d.id = r.id)) THEN
        RETURN false;
    END IF;
    BEGIN
        EXECUTE format('LOCK TABLE %I, %I, %I IN ACCESS EXCLUSIVE MODE NOWAIT',
                       'ready_' || p_seg, 'claims_' || p_seg, 'done_' || p_seg);
    EXCEPTION WHEN lock_not_available THEN
        RETURN false;
    END;
    IF _segment_open_since(p_seg, v_checked) THEN
        RETURN false;
    END IF;
    EXECUTE format('TRUNCATE %I, %I, %I', 'ready_' || p_seg, 'claims_' || p_seg, 'done_' || p_seg);
    RETURN true;
END;
$$;
