-- 0015: the ready lane — append-only storage for the common message (docs/decisions/0004).
--
-- Until now every message was claimed by rewriting its row and settled by deleting it: two dead
-- versions of the whole row per message, which vacuum cannot remove while anything pins the
-- horizon, and which every claim walked over. An unkeyed message that is due at once and carries
-- no caller-chosen message_id — the common one — now goes into `ready` and is never updated or
-- deleted: a claim inserts a narrow row into `claims`, a settle inserts one into `done` (and the
-- copy into archive or dead, as before). The three tables are partitioned alike into a ring of
-- four segments by id (`seg = id / 131072 % 4`); a segment whose every row is done is reclaimed
-- with TRUNCATE, which leaves nothing for vacuum.
--
-- Relays find new rows by windows of committed transactions, as PgQ's batches do: a window is the
-- rows of the transactions that committed between two snapshots (pg_current_snapshot()), read from
-- the `(xid, id)` index as a range past the older snapshot's xmax plus the transactions that were
-- still running at it. A transaction that commits after later ones is simply in a later window;
-- no producer waits for another, and a session pinning the horizon costs one index probe.
--
-- Everything that needs state that changes stays in `messages` (the slow lane), as before:
-- scheduled and keyed messages, those with the caller's message_id (its uniqueness is that
-- table's unique index), retries (a ready row to retry is settled as moved and re-inserted there),
-- orphans (a ready row whose claim's lease ran out is moved there as an expired lease, so the
-- one-at-a-time orphan claim and the attempt limit apply) and replays.
--
-- Relays of the previous version know nothing of the lane, so producers use it only once a relay
-- of this version has started and set settings.fast_lane.
--
-- Every function a relay calls on the lane (claim_batch, settle, extend_leases, release_orphans,
-- and the producer's _ready_has) runs with generic plans and with index look-ups joined by nested
-- loops only (the SET clauses, which apply to everything they call). Each of their statements
-- touches a few rows by key, and neither the planner's estimates nor its custom plans can be
-- trusted with that here: a segment is empty after its TRUNCATE and full a minute later, and its
-- partitions are never analyzed where autovacuum is off; a plan made from a small partition hashed
-- a sequential scan of the whole ring into every settle (0.1 ms at 300 rows, seconds at 500,000),
-- and a custom plan of a statement on four partitions cost more to make (0.1–0.2 ms, on every call)
-- than to run. Measured on one claim → settle of one message (`tests/benchmarks/lane_calls.py`):
-- see docs/decisions/0004.

SET LOCAL lock_timeout = '10s';
ALTER TABLE settings ADD COLUMN fast_lane boolean NOT NULL DEFAULT false;

CREATE TABLE ready (
    seg          smallint    NOT NULL,
    id           bigint      NOT NULL,
    xid          xid8        NOT NULL DEFAULT pg_current_xact_id(),
    message_id   uuid        NOT NULL,
    exchange     text        NOT NULL,
    routing_key  text        NOT NULL,
    body         bytea       NOT NULL,
    headers      jsonb       NOT NULL,
    properties   jsonb       NOT NULL,
    created_at   timestamptz NOT NULL
) PARTITION BY LIST (seg);

-- One row per claim of a ready row (a ready row is claimed once: a retry or an orphan continues in
-- messages). `until` is the lease; a renewal, and a takeover (which also changes claim_id, the
-- fence), update the row — both rare.
CREATE TABLE claims (
    seg        smallint    NOT NULL,
    id         bigint      NOT NULL,
    claim_id   uuid        NOT NULL,
    claimed_by text        NOT NULL,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    until      timestamptz NOT NULL,
    resent     integer     NOT NULL DEFAULT 0
) PARTITION BY LIST (seg);

-- A ready row that is gone: archived, dead, or moved to messages. Its unique key arbitrates every
-- write that ends a claim: whoever inserts it first acts, the others do nothing.
CREATE TABLE done (
    seg smallint NOT NULL,
    id  bigint   NOT NULL
) PARTITION BY LIST (seg);

DO $$
BEGIN
    FOR i IN 0..3 LOOP
        EXECUTE format('CREATE TABLE ready_%s PARTITION OF ready FOR VALUES IN (%s)', i, i);
        EXECUTE format('CREATE TABLE claims_%s PARTITION OF claims FOR VALUES IN (%s)', i, i);
        EXECUTE format('CREATE TABLE done_%s PARTITION OF done FOR VALUES IN (%s)', i, i);
    END LOOP;
END;
$$;
-- The unique keys lead with id, not seg: every row of a partition has the same seg, so a plan made
-- while the partitions were empty (at start, after a TRUNCATE) that looked rows up by `seg` alone
-- read the whole partition on every call (a claim's 24 rows cost 9 ms at 2,000/s).
CREATE UNIQUE INDEX ready_id_seg_idx ON ready (id, seg);
CREATE INDEX ready_xid_idx ON ready (xid, id);
CREATE INDEX ready_message_id_idx ON ready (message_id);
CREATE UNIQUE INDEX claims_id_seg_idx ON claims (id, seg);
CREATE INDEX claims_until_idx ON claims (until);
CREATE UNIQUE INDEX done_id_seg_idx ON done (id, seg);

-- The segment of an id.
CREATE FUNCTION _seg(p_id bigint) RETURNS smallint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT (p_id / 131072 % 4)::smallint $$;

-- Whether a message with this message_id is waiting in the ready lane (it was enqueued with a
-- generated id that the caller now passes again).
CREATE FUNCTION _ready_has(p_message_id uuid) RETURNS boolean
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
                     AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = r.seg AND d.id = r.id));
END;
$$;

CREATE OR REPLACE FUNCTION _enqueue(
    p_exchange             text,
    p_routing_key          text,
    p_body                 bytea,
    p_headers              jsonb,
    p_properties           jsonb,
    p_available_at         timestamptz,
    p_ordering_key         text,
    p_message_id           uuid,
    p_default_content_type text
) RETURNS uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_headers    jsonb := coalesce(p_headers, '{}');
    v_properties jsonb := coalesce(p_properties, '{}');
    v_now        timestamptz := clock_timestamp();
    v_due        timestamptz := coalesce(p_available_at, v_now);
    v_message_id uuid := coalesce(p_message_id, gen_random_uuid());
    v_seq        bigint;
    v_gated      boolean := false;
    v_id         bigint;
BEGIN
    PERFORM _check_message(p_exchange, p_routing_key, p_body, v_headers, v_properties, v_due,
                           p_ordering_key);
    IF NOT v_properties ? 'content_type' THEN
        v_properties := v_properties || jsonb_build_object('content_type', p_default_content_type);
    END IF;

    IF p_ordering_key IS NULL AND p_message_id IS NULL AND v_due <= v_now
       AND (SELECT s.fast_lane FROM settings s) THEN
        v_id := nextval('messages_id_seq');
        INSERT INTO ready (seg, id, message_id, exchange, routing_key, body, headers, properties,
                           created_at)
        VALUES (_seg(v_id), v_id, v_message_id, p_exchange, p_routing_key, p_body, v_headers,
                v_properties, v_now);
        PERFORM pg_notify(current_schema() || '_new', '');
        RETURN v_message_id;
    END IF;

    IF p_message_id IS NOT NULL AND _ready_has(p_message_id) THEN
        RAISE EXCEPTION 'enqueue: message_id % is already in the outbox', v_message_id
            USING ERRCODE = 'unique_violation',
                  HINT = 'A message_id identifies one message; it can be reused once the first '
                         'is published or dead-lettered.';
    END IF;
    IF p_ordering_key IS NOT NULL THEN
        SELECT k.seq, k.gated, k.due INTO v_seq, v_gated, v_due FROM _key_next(p_ordering_key, v_due) k;
    END IF;

    INSERT INTO messages (message_id, exchange, routing_key, body, headers, properties,
                          ordering_key, seq, gated, created_at, available_at)
    VALUES (v_message_id, p_exchange, p_routing_key, p_body, v_headers, v_properties,
            p_ordering_key, v_seq, v_gated, v_now, v_due)
    ON CONFLICT ON CONSTRAINT messages_message_id_key DO NOTHING;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'enqueue: message_id % is already in the outbox', v_message_id
            USING ERRCODE = 'unique_violation',
                  HINT = 'A message_id identifies one message; it can be reused once the first '
                         'is published or dead-lettered.';
    END IF;

    -- Wake the relays. PostgreSQL folds identical notifications of one transaction into one, so a
    -- transaction that enqueues a thousand rows sends a single wake-up, at commit (never on rollback).
    -- A scheduled or gated row wakes nobody: polling, or the settle of its predecessor, frees it.
    IF v_due <= v_now AND NOT v_gated THEN
        PERFORM pg_notify(current_schema() || '_new', '');
    END IF;
    RETURN v_message_id;
END;
$$;

-- A page of ready rows for one claim: rows of the transactions p_xips (all committed), or else of
-- transactions p_from..p_to (xid8, both included) that committed before p_hi was taken, past the
-- cursor (p_xid, p_id), in (xid, id) order, up to p_limit rows and p_max_bytes (at least one
-- row), locked with SKIP LOCKED and not claimed yet.
-- Inserts their claims and returns one row per row claimed here (`taken` NULL; a row another relay
-- claimed after this statement's snapshot is taken but not claimed), then, if it took any, a
-- trailer (seg NULL) with the last row taken (where the cursor moves), how many it took, and how
-- many it locked in all (more than it took: the byte limit cut the page short). Nothing joins the
-- CTEs row by row: planned on their estimates (one row each), such a join was a nested loop that
-- cost a page of 500 rows 38 ms.
--
-- The page is read from the (xid, id) index and nothing else, whatever the statistics say:
-- PostgreSQL has no statistics for ranges of xid8 and estimates the window at a few rows, so on
-- its own it scanned the whole lane and sorted it (a claim of 500 from a backlog of 100,000:
-- 250 ms, not 5). Hence the two settings below, which apply to this function only.
CREATE FUNCTION _ready_page(p_xips xid8[], p_from xid8, p_to xid8, p_hi pg_snapshot, p_xid xid8,
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
          AND (r.xid, r.id) > (p_xid, p_id)
          AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id)
        ORDER BY r.xid, r.id
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
        WHERE (r.xid, r.id) > (greatest(p_xid, p_from),
                               CASE WHEN p_xid >= p_from THEN p_id ELSE -1 END)
          AND r.xid <= p_to AND r.xid < pg_snapshot_xmax(p_hi)
          AND r.xid <> ALL(ARRAY(SELECT pg_snapshot_xip(p_hi)))
          AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id)
        ORDER BY r.xid, r.id
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

-- The first row of the window (p_prev, p_hi] that nobody claimed, if any: one a claim skipped
-- because another relay held it locked, and whose claim then rolled back (or has not committed
-- yet). The window is then walked again from there.
CREATE FUNCTION _window_first_open(p_prev pg_snapshot, p_hi pg_snapshot, OUT xid xid8,
                                   OUT id bigint)
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    -- Two lookups the (xid, id) index answers directly: the transactions running at p_prev,
    -- then the range after it (an OR of the two would scan every partition from its start).
    SELECT r.xid, r.id INTO xid, id FROM ready r
    WHERE r.xid = ANY(ARRAY(SELECT x FROM pg_snapshot_xip(p_prev) AS x
                            WHERE pg_visible_in_snapshot(x, p_hi)))
      AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id)
    ORDER BY r.xid, r.id
    LIMIT 1;
    IF FOUND THEN
        RETURN;
    END IF;
    SELECT r.xid, r.id INTO xid, id FROM ready r
    WHERE r.xid >= pg_snapshot_xmax(p_prev) AND r.xid < pg_snapshot_xmax(p_hi)
      AND r.xid <> ALL(ARRAY(SELECT pg_snapshot_xip(p_hi)))
      AND NOT EXISTS (SELECT 1 FROM claims c WHERE c.seg = r.seg AND c.id = r.id)
    ORDER BY r.xid, r.id
    LIMIT 1;
END;
$$;

-- The slow lane's part of a claim, as the claim_batch statement of earlier versions did it (their
-- relays still run it themselves during a rolling upgrade).
CREATE FUNCTION _slow_claim(p_limit integer, p_max_bytes bigint, p_claim_id uuid,
                            p_claimed_by text, p_lease float8)
RETURNS TABLE (id bigint, message_id uuid, exchange text, routing_key text, body bytea,
               headers text, properties text, ordering_key text, created_at timestamptz,
               attempts integer, ambiguous integer, last_error text, seq bigint, replays integer,
               replayed_at timestamptz, replayed_from text, locked bigint)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH due AS MATERIALIZED (
        SELECT m.id, m.available_at,
               octet_length(m.body) + pg_column_size(m.headers) + pg_column_size(m.properties)
                   AS bytes
        FROM messages m
        WHERE m.claim_id IS NULL AND NOT m.gated AND m.available_at <= now()
        ORDER BY m.available_at, m.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), taken AS MATERIALIZED (
        SELECT s.id
        FROM (SELECT due.id, due.bytes,
                     sum(due.bytes) OVER (ORDER BY due.available_at, due.id) AS running
              FROM due) AS s
        WHERE s.running <= p_max_bytes OR s.running = s.bytes
    )
    UPDATE messages AS m
    SET attempts = m.attempts + 1,
        claim_id = p_claim_id,
        claimed_by = p_claimed_by,
        claimed_at = now(),
        available_at = now() + make_interval(secs => p_lease)
    FROM taken
    WHERE m.id = taken.id
    RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers::text,
              m.properties::text, m.ordering_key, m.created_at, m.attempts, m.ambiguous,
              m.last_error, m.seq, m.replays, m.replayed_at, m.replayed_from,
              (SELECT count(*) FROM due);
END;
$$;

-- The bytes of bodies, headers and properties of the rows claim p_claim_id just took in either
-- lane (the slow lane's all have the same lease end, which messages_leased_idx finds).
CREATE FUNCTION _claimed_bytes(p_claim_id uuid, p_lease float8, p_ready bigint[]) RETURNS bigint
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN coalesce((SELECT sum(octet_length(m.body) + pg_column_size(m.headers)
                                + pg_column_size(m.properties))
                     FROM messages m
                     WHERE m.claim_id IS NOT NULL
                       AND m.available_at = now() + make_interval(secs => p_lease)
                       AND m.claim_id = p_claim_id), 0)
           + coalesce((SELECT sum(octet_length(r.body) + pg_column_size(r.headers)
                                  + pg_column_size(r.properties))
                       FROM ready r
                       WHERE r.seg = ANY(ARRAY(SELECT DISTINCT _seg(t) FROM unnest(p_ready) AS t))
                         AND r.id = ANY(p_ready)), 0);
END;
$$;

-- The relay's claim: up to p_limit due rows (and p_max_bytes, at least one row), counting an
-- attempt each, under claim id p_claim_id for p_lease seconds: the slow lane's and a page of the
-- ready lane's window, one lane first or the other (p_ready_first; relays alternate, so that a
-- backlog in one never starves the other). p_prev is where the relay's last closed window ended,
-- p_hi where the open one ends (NULL: open one now), (p_xid, p_id) the cursor in it, p_verify
-- whether to close it only once nothing in it is left unclaimed (below); a relay starts with
-- p_prev = '1:1:', a window over the whole lane. Returns the rows (`lane` says which;
-- `locked` more than the lane's rows returned: cut short by p_max_bytes, more are waiting), then
-- one trailer row (message_id NULL) with the window: its end, the cursor, and whether it is
-- closed (the relay then starts the next at its end); its `locked` counts the ready lane's.
CREATE FUNCTION claim_batch(p_limit integer, p_max_bytes bigint, p_claim_id uuid,
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

    IF NOT p_ready_first THEN
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

    RETURN QUERY
    SELECT r.id, r.message_id, r.exchange, r.routing_key, r.body, r.headers::text,
           r.properties::text, NULL::text, r.created_at, 1, 0, NULL::text, NULL::bigint, 0,
           NULL::timestamptz, NULL::text, v_locked, 'ready', NULL::text, NULL::xid8,
           NULL::bigint, NULL::boolean
    FROM ready r
    WHERE r.seg = ANY(ARRAY(SELECT DISTINCT _seg(t) FROM unnest(v_taken) AS t))
      AND r.id = ANY(v_taken)
    ORDER BY r.xid, r.id;

    IF p_ready_first AND v_left >= 1 AND NOT v_cut THEN
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

-- Renew the leases of the rows p_claim_id still holds, in either lane; return those rows. A ready
-- row's lease is its `claims` row; one taken over (its claim_id changed) is not renewed.
CREATE FUNCTION extend_leases(p_claim_id uuid, p_ids bigint[], p_lease float8)
RETURNS SETOF bigint
LANGUAGE sql
SECURITY DEFINER
SET search_path FROM CURRENT
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
    WITH slow AS (
        UPDATE messages
        SET available_at = now() + make_interval(secs => p_lease)
        WHERE id = ANY(p_ids) AND claim_id = p_claim_id
        RETURNING id
    ), fast AS (
        UPDATE claims AS c
        SET until = now() + make_interval(secs => p_lease)
        WHERE c.seg = ANY(ARRAY(SELECT DISTINCT _seg(i) FROM unnest(p_ids) AS i))
          AND c.id = ANY(p_ids) AND c.claim_id = p_claim_id
        RETURNING c.id
    )
    SELECT id FROM slow UNION ALL SELECT id FROM fast
$$;

-- The ready rows among p_ids that claim p_claim_id holds.
CREATE FUNCTION _held(p_claim_id uuid, p_ids bigint[]) RETURNS bigint[]
LANGUAGE plpgsql STABLE
SET search_path FROM CURRENT
AS $$
BEGIN
    RETURN (SELECT coalesce(array_agg(c.id), '{}')
            FROM claims c
            WHERE c.seg = ANY(ARRAY(SELECT DISTINCT _seg(i) FROM unnest(p_ids) AS i))
              AND c.id = ANY(p_ids) AND c.claim_id = p_claim_id);
END;
$$;

-- End ready rows: insert their `done` rows (the ones already there — a takeover or a settle got
-- there first — are skipped) and return the rows this call ended, with their message.
CREATE FUNCTION _ready_end(p_ids bigint[])
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
    JOIN ready r ON r.seg = m.seg AND r.id = m.id
    JOIN claims c ON c.seg = m.seg AND c.id = m.id;
END;
$$;

-- settle as in 0013, for both lanes. A ready row never moves in place: archived or dead-lettered
-- it is copied there, to retry it is copied into messages with its attempt, back-off and error
-- (a later claim there counts attempt 2), and in each case its `done` row is what makes the move
-- happen once. A ready row is never keyed, so it releases no key.
CREATE OR REPLACE FUNCTION settle(
    p_claim_id   uuid,
    p_archive    bigint[],
    p_dead       bigint[],
    p_reasons    text[],
    p_details    text[],
    p_retry      bigint[],
    p_delays     float8[],
    p_errors     text[],
    p_refunds    boolean[],
    p_ambiguous  boolean[],
    p_resent     bigint[],
    p_durable    boolean,
    OUT archived integer,
    OUT dead     integer,
    OUT retried  integer,
    OUT released integer,
    OUT blocked  integer
)
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
    v_keys    text[];
    v_seqs    bigint[];
    v_reasons text[];
    v_ids     uuid[];
    v_ready   bigint[];
    v_slow    bigint[];
    v_n       integer;
BEGIN
    PERFORM _read_committed('settle');
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    archived := 0;
    dead := 0;
    retried := 0;
    v_keys := '{}';
    v_seqs := '{}';
    v_reasons := '{}';
    v_ids := '{}';
    v_ready := _held(p_claim_id, p_archive || p_dead || p_retry || p_resent);

    -- Each part runs only when it has rows (the common settle only archives): a statement with
    -- nothing to do still plans and opens its scans, which a pinned vacuum horizon makes dear.
    IF cardinality(p_resent) > 0 THEN
        UPDATE messages SET ambiguous = ambiguous + 1
        WHERE id = ANY(p_resent) AND claim_id = p_claim_id AND NOT gated;
        IF cardinality(v_ready) > 0 THEN
            UPDATE claims c SET resent = c.resent + 1
            WHERE c.seg = ANY(ARRAY(SELECT DISTINCT _seg(i) FROM unnest(p_resent) AS i))
              AND c.id = ANY(p_resent) AND c.id = ANY(v_ready) AND c.claim_id = p_claim_id;
        END IF;
    END IF;

    IF cardinality(p_archive) > 0 AND cardinality(v_ready) > 0 THEN
        WITH moved AS (
            INSERT INTO archive (message_id, exchange, routing_key, body, headers, properties,
                                 attempts, ambiguous, created_at)
            SELECT e.message_id, e.exchange, e.routing_key, e.body, e.headers, e.properties, 1,
                   e.resent, e.created_at
            FROM _ready_end(ARRAY(SELECT i FROM unnest(p_archive) AS i WHERE i = ANY(v_ready))) e
            RETURNING 1
        )
        SELECT count(*) INTO archived FROM moved;
    END IF;
    v_slow := ARRAY(SELECT i FROM unnest(p_archive) AS i WHERE i <> ALL(v_ready));
    IF cardinality(v_slow) > 0 THEN
        WITH done AS (
            DELETE FROM messages
            WHERE id = ANY(v_slow) AND claim_id = p_claim_id AND NOT gated
            RETURNING message_id, exchange, routing_key, body, headers, properties, ordering_key, seq,
                      attempts, ambiguous, created_at, replays, replayed_at, replayed_from
        ), moved AS (
            INSERT INTO archive (message_id, exchange, routing_key, body, headers, properties,
                                 ordering_key, seq, attempts, ambiguous, created_at, replays,
                                 replayed_at, replayed_from)
            SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key, seq,
                   attempts, ambiguous, created_at, replays, replayed_at, replayed_from
            FROM done
            RETURNING message_id, ordering_key, seq
        )
        SELECT archived + count(*),
               coalesce(array_agg(ordering_key) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(seq) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(NULL::text) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(message_id) FILTER (WHERE ordering_key IS NOT NULL), '{}')
        INTO archived, v_keys, v_seqs, v_reasons, v_ids
        FROM moved;
    END IF;

    IF cardinality(p_dead) > 0 THEN
        IF cardinality(v_ready) > 0 THEN
            WITH failed AS (
                SELECT * FROM unnest(p_dead, p_reasons, p_details) AS f(id, reason, detail)
                WHERE f.id = ANY(v_ready)
            ), moved AS (
                INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties,
                                  attempts, ambiguous, created_at, reason, detail)
                SELECT e.message_id, e.exchange, e.routing_key, e.body, e.headers, e.properties, 1,
                       e.resent, e.created_at, f.reason, f.detail
                FROM _ready_end(ARRAY(SELECT f.id FROM failed f)) e
                JOIN failed f ON f.id = e.id
                RETURNING 1
            )
            SELECT count(*) INTO dead FROM moved;
        END IF;
        WITH failed AS (
            SELECT * FROM unnest(p_dead, p_reasons, p_details) AS f(id, reason, detail)
        ), gone AS (
            DELETE FROM messages AS m
            USING failed AS f
            WHERE m.id = f.id AND m.claim_id = p_claim_id AND NOT m.gated
            RETURNING m.message_id, m.exchange, m.routing_key, m.body, m.headers, m.properties,
                      m.ordering_key, m.seq, m.attempts, m.ambiguous, m.created_at, m.replays,
                      m.replayed_at, m.replayed_from, f.reason, f.detail
        ), moved AS (
            INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, seq, attempts, ambiguous, created_at, replays,
                              replayed_at, replayed_from, reason, detail)
            SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key, seq,
                   attempts, ambiguous, created_at, replays, replayed_at, replayed_from, reason, detail
            FROM gone
            RETURNING message_id, ordering_key, seq, reason
        )
        SELECT dead + count(*),
               v_keys || coalesce(array_agg(ordering_key) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               v_seqs || coalesce(array_agg(seq) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               v_reasons || coalesce(array_agg(reason) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               v_ids || coalesce(array_agg(message_id) FILTER (WHERE ordering_key IS NOT NULL), '{}')
        INTO dead, v_keys, v_seqs, v_reasons, v_ids
        FROM moved;
    END IF;

    -- A refund gives back the attempt the claim counted (the row was not really tried); an
    -- ambiguous one counts the claim as a send that may have arrived.
    IF cardinality(p_retry) > 0 THEN
        IF cardinality(v_ready) > 0 THEN
            SELECT count(*) INTO v_n
            FROM _ready_copy(ARRAY(SELECT i FROM unnest(p_retry) AS i WHERE i = ANY(v_ready)),
                             p_retry, p_delays, p_errors, p_refunds, p_ambiguous, NULL);
            retried := v_n;
        END IF;
        UPDATE messages AS m
        SET available_at = now() + make_interval(secs => r.delay),
            attempts = m.attempts - r.refund::int,
            ambiguous = m.ambiguous + r.ambiguous::int,
            claim_id = NULL,
            claimed_by = NULL,
            claimed_at = NULL,
            last_error = r.error
        FROM unnest(p_retry, p_delays, p_errors, p_refunds, p_ambiguous)
             AS r(id, delay, error, refund, ambiguous)
        WHERE m.id = r.id AND m.claim_id = p_claim_id AND NOT m.gated;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        retried := retried + v_n;
    END IF;

    released := 0;
    blocked := 0;
    IF cardinality(v_keys) > 0 THEN
        SELECT s.released, s.blocked INTO released, blocked
        FROM _keys_settled(v_keys, v_seqs, v_reasons, v_ids) AS s;
    END IF;
END;
$$;

-- Move ready rows to messages: end them (their `done` rows) and insert each there with its attempt
-- (1, less a refund), its sends that may have arrived, a back-off and its error — a retry — or, for
-- an orphan (p_orphan: the claim id that took it over), as a lease that has run out, which the
-- orphan claim takes one at a time. A copy whose message_id is meanwhile waiting in messages (the
-- caller enqueued it again under that id) cannot go there: it is dead-lettered, so that nothing is
-- lost and nothing stops the relays. p_all, p_delays, p_errors, p_refunds and p_ambiguous hold one
-- entry per row (p_all says which). Returns the rows it moved.
CREATE FUNCTION _ready_copy(p_ids bigint[], p_all bigint[], p_delays float8[], p_errors text[],
                            p_refunds boolean[], p_ambiguous boolean[], p_orphan uuid)
RETURNS SETOF bigint
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row record;
BEGIN
    FOR v_row IN
        SELECT e.*, r.delay, r.error, r.refund, r.sent
        FROM _ready_end(p_ids) AS e
        JOIN unnest(p_all, p_delays, p_errors, p_refunds, p_ambiguous)
             AS r(id, delay, error, refund, sent) ON r.id = e.id
        ORDER BY e.id
    LOOP
        INSERT INTO messages (message_id, exchange, routing_key, body, headers, properties,
                              created_at, available_at, attempts, ambiguous, last_error,
                              claim_id, claimed_by, claimed_at)
        VALUES (v_row.message_id, v_row.exchange, v_row.routing_key, v_row.body, v_row.headers,
                v_row.properties, v_row.created_at, now() + make_interval(secs => v_row.delay),
                1 - v_row.refund::int, v_row.resent + v_row.sent::int, v_row.error, p_orphan,
                CASE WHEN p_orphan IS NOT NULL THEN v_row.claimed_by END,
                CASE WHEN p_orphan IS NOT NULL THEN now() END)
        ON CONFLICT ON CONSTRAINT messages_message_id_key DO NOTHING;
        IF NOT FOUND THEN
            INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties,
                              attempts, ambiguous, created_at, reason, detail)
            VALUES (v_row.message_id, v_row.exchange, v_row.routing_key, v_row.body,
                    v_row.headers, v_row.properties, 1, v_row.resent + v_row.sent::int,
                    v_row.created_at, 'invalid',
                    format('could not be retried: message_id %s was enqueued again while this '
                           'message was waiting (last error: %s)', v_row.message_id,
                           coalesce(v_row.error, 'none')));
        END IF;
        RETURN NEXT v_row.id;
    END LOOP;
END;
$$;

-- Ready rows whose claim's lease ran out without a settle (their relay died, or lost the database
-- for longer than a lease): each claim is taken over — a new claim id, so that the old relay's late
-- renewal or settle does nothing — and its row moved to messages as an expired lease, where the
-- orphan claim takes it one at a time and bury_exhausted counts its attempts, as for any orphan.
-- Looks at leases that ran out from p_after on (the caller's cursor; NULL: all), the oldest first,
-- up to p_limit; returns how many it took over (fewer than p_limit: the range is done), how many
-- of those it moved (a settle may have ended one first), the newest expiry among them (NULL:
-- none) and the time it judged expiry by.
CREATE FUNCTION release_orphans(p_after timestamptz, p_limit integer, OUT looked integer,
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
          AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = c.seg AND d.id = c.id)
        ORDER BY c.until
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), taken AS (
        UPDATE claims c SET claim_id = v_claim
        FROM expired e
        WHERE c.seg = e.seg AND c.id = e.id AND c.until < now()
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

-- Reclaim ring segment p_seg when every ready row in it is done: TRUNCATE its three partitions,
-- which leaves nothing behind for vacuum. Never the segment the id sequence is in, nor the next
-- one. Checks without a lock first; then takes the partitions — or gives up at once when anyone
-- holds them, such as a long reader (NOWAIT: waiting would queue every claim behind it), and the
-- next call tries again — and checks again only the rows that committed since. Run it in a
-- transaction of its own: the locks last until that ends. Returns whether it reclaimed.
CREATE FUNCTION reclaim_segment(p_seg integer) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
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
    IF EXISTS (SELECT 1 FROM ready r
               WHERE r.seg = p_seg
                 AND (r.xid = ANY(ARRAY(SELECT pg_snapshot_xip(v_checked)))
                      OR r.xid >= pg_snapshot_xmax(v_checked))
                 AND NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = p_seg AND d.id = r.id)) THEN
        RETURN false;
    END IF;
    EXECUTE format('TRUNCATE %I, %I, %I', 'ready_' || p_seg, 'claims_' || p_seg, 'done_' || p_seg);
    RETURN true;
END;
$$;

-- A relay of this version calls this when it starts: from then on producers use the ready lane.
CREATE FUNCTION use_fast_lane() RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    UPDATE settings SET fast_lane = true WHERE NOT fast_lane
$$;

-- Every message not yet archived or dead, in either lane, with its lease: what `messages` alone
-- showed before this migration (for operators' queries; the relays never read it).
CREATE VIEW waiting AS
SELECT 'messages' AS lane, m.id, m.message_id, m.exchange, m.routing_key, m.ordering_key, m.seq,
       m.gated, m.created_at, m.available_at, m.attempts, m.ambiguous, m.claim_id, m.claimed_by,
       m.claimed_at, m.last_error
FROM messages m
UNION ALL
SELECT 'ready', r.id, r.message_id, r.exchange, r.routing_key, NULL, NULL, false, r.created_at,
       coalesce(c.until, r.created_at), (c.id IS NOT NULL)::int, coalesce(c.resent, 0),
       c.claim_id, c.claimed_by, c.claimed_at, NULL
FROM ready r
LEFT JOIN claims c ON c.seg = r.seg AND c.id = r.id
WHERE NOT EXISTS (SELECT 1 FROM done d WHERE d.seg = r.seg AND d.id = r.id);
