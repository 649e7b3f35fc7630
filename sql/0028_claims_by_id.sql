-- 0028: a claim's own rows are found by their ids, never by walking the leases.
--
-- settle and extend_leases picked their claim's rows with `id = ANY(p_ids) AND claim_id = p_id`.
-- `claim_id = p_id` implies the predicate of messages_leased_idx (claim_id IS NOT NULL), and
-- the planner, which counts that index small, walked all of it and filtered by id: a walk whose
-- cost is every leased version the vacuum horizon keeps. Under a pinned horizon (30 s of 500
-- messages/s leaves ~60,000 dead entries in it) each settle and each renewal read them all, and
-- a settle's p99 went up twentyfold. `IS NOT DISTINCT FROM` means the same for a claim id that
-- is never NULL, but implies no index predicate: the rows are found through the primary key,
-- at the cost of their ids alone, pinned or not. For the same reason settle's DELETE and UPDATE
-- name their rows by `id = ANY(…)` rather than by a join alone, whose cached generic plan was
-- seen to walk the whole primary key; extend_leases locks its rows, then updates them by id.
--
-- A settle that claims takes the successors it finds into the claim's UPDATE (`_claim`'s
-- p_next), after the due rows, rather than releasing them and claiming them again: one row
-- version per keyed message instead of two. `_successors` is `_keys_settled` without the
-- release, which `_keys_settled` (relays of 0.1, `_bury`) still does.
--
-- Upgrading: replaces function bodies, and `_claim` (internal) takes a second argument; the
-- relay-callable functions keep their signatures, grants and callers.

-- After rows of some keys left `messages` (archived, dead, buried): block a key whose message
-- died under the 'block' policy, note the pace of paced keys, and lock each settled row's
-- successor (`held`, still gated: the caller releases it, or claims it). A successor another
-- session holds locked is not waited for: a recheck is queued (release_stranded).
CREATE FUNCTION _successors(p_keys text[], p_seqs bigint[], p_reasons text[],
                            p_message_ids uuid[], OUT held bigint[], OUT blocked integer)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_next bigint[];
BEGIN
    held := '{}';
    blocked := 0;
    IF coalesce(cardinality(p_keys), 0) = 0 THEN
        RETURN;
    END IF;
    -- release_key deletes a block under FOR UPDATE: one of the two waits for the other.
    PERFORM 1 FROM blocked_keys b WHERE b.ordering_key = ANY(p_keys)
    ORDER BY b.ordering_key FOR KEY SHARE;
    WITH died AS (
        SELECT DISTINCT ON (s.ordering_key) s.ordering_key, s.message_id, s.seq, s.reason
        FROM unnest(p_keys, p_seqs, p_reasons, p_message_ids) AS s(ordering_key, seq, reason,
                                                                     message_id)
        WHERE s.reason IS NOT NULL AND (key_policy(s.ordering_key)).on_dead = 'block'
        ORDER BY s.ordering_key, s.seq
    ), added AS (
        INSERT INTO blocked_keys (ordering_key, message_id, seq, reason)
        SELECT ordering_key, message_id, seq, reason FROM died ORDER BY ordering_key
        ON CONFLICT (ordering_key) DO NOTHING
        RETURNING 1
    )
    SELECT count(*) INTO blocked FROM added;
    INSERT INTO key_releases AS r (ordering_key, settled_at)
    SELECT DISTINCT k.ordering_key, now()
    FROM keys k WHERE k.ordering_key = ANY(p_keys) AND k.min_interval > '0'
    ORDER BY k.ordering_key
    ON CONFLICT (ordering_key) DO UPDATE SET settled_at = excluded.settled_at;
    SELECT array_agg(m.id) INTO v_next
    FROM unnest(p_keys, p_seqs) AS s(ordering_key, seq)
    LEFT JOIN keys k USING (ordering_key)
    JOIN messages m ON m.ordering_key = s.ordering_key
                   AND m.seq = s.seq + coalesce(k.concurrency, 1)
    WHERE m.gated
      AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = s.ordering_key);
    IF v_next IS NULL THEN
        RETURN;
    END IF;
    held := ARRAY(SELECT m.id FROM messages m WHERE m.id = ANY(v_next)
                  ORDER BY m.id FOR UPDATE SKIP LOCKED);
    INSERT INTO key_checks (ordering_key, seq)
    SELECT m.ordering_key, m.seq FROM messages m
    WHERE m.id = ANY(v_next) AND m.id <> ALL(held);
END;
$$;

-- Relays of 0.1 call this directly, and `_bury` does: the successors found are released.
CREATE OR REPLACE FUNCTION _keys_settled(p_keys text[], p_seqs bigint[], p_reasons text[],
                                         p_message_ids uuid[], OUT released integer,
                                         OUT blocked integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_held bigint[];
BEGIN
    SELECT s.held, s.blocked INTO v_held, blocked
    FROM _successors(p_keys, p_seqs, p_reasons, p_message_ids) AS s;
    released := _ungate(v_held);
END;
$$;

DROP FUNCTION _claim(claim_request);

-- One claim: expired leases first (from the orphan cursor), then due rows (from the due cursor,
-- less LOOKBACK), each skipping what another session holds; leased for `lease` seconds under
-- `claim_id`, an attempt counted. Only ids and sizes come back: the transaction ends before any
-- row travels (the relay fetches them next), so a relay frozen while reading holds no lock.
-- p_next: successors a settle in this transaction found (gated, locked by it); what room the due
-- rows leave takes them, in the one UPDATE that claims them (one row version each, where a
-- release and then a claim made two: the keyed drain's cost), and the rest are released.
CREATE FUNCTION _claim(p claim_request, p_next bigint[] DEFAULT '{}') RETURNS claimed
LANGUAGE plpgsql
SET search_path FROM CURRENT
-- An index scan in due order is the only plan whose cost does not grow with the dead rows
-- behind the cursor (a pinned vacuum horizon keeps every one of them).
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    -- A producer's row becomes visible at its commit but is placed at its insert: a claim looks
    -- back this far behind its cursor for rows that committed late. A row later than that (a
    -- long transaction, a stalled WAL flush, a claim that rolled back) waits for the rescue.
    LOOKBACK CONSTANT interval := '1 second';
    r          claimed;
    v_now      timestamptz := now();
    v_from     timestamptz;
    v_from_id  bigint;
    v_ids      bigint[];
    v_at       timestamptz[];
    v_tries    integer[];
    v_bytes    bigint[];
    v_take     bigint[] := '{}';
    v_sizes    bigint[] := '{}';
    v_dead     bigint[] := '{}';
    v_acted    integer := 0;
    v_alone    boolean := false;
    v_room     integer;
    v_budget   bigint;
    i          integer;
BEGIN
    IF p.max_rows IS NULL OR p.max_rows < 1 OR p.lease IS NULL OR p.lease <= 0
       OR p.max_bytes IS NULL OR p.max_bytes < 1 OR p.max_attempts IS NULL OR p.max_attempts < 1
       OR p.claim_id IS NULL THEN
        RAISE EXCEPTION 'claim: claim_id, a positive max_rows, lease, max_bytes and max_attempts '
                        'are required, not %', p
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    r := ROW(0, 0, 0, 0, 0, '{}', '{}', false, false, v_now, 0, v_now, 0, '{}', '{}');
    -- Keyed rows a race left gated (key_checks), released first: this claim may take them.
    IF EXISTS (SELECT 1 FROM key_checks) THEN
        PERFORM release_stranded(100);
    END IF;

    -- Leases that ran out: their relay died or stalled.
    SELECT array_agg(o.id ORDER BY o.available_at, o.id),
           array_agg(o.available_at ORDER BY o.available_at, o.id),
           array_agg(o.attempts ORDER BY o.available_at, o.id),
           array_agg(o.bytes ORDER BY o.available_at, o.id)
    INTO v_ids, v_at, v_tries, v_bytes
    FROM (SELECT m.id, m.available_at, m.attempts,
                 octet_length(m.body) + pg_column_size(m.headers)
                     + pg_column_size(m.properties) AS bytes
          FROM messages m
          WHERE m.claim_id IS NOT NULL AND m.available_at <= v_now
            AND (m.available_at, m.id)
                >= (coalesce(p.orphan_at, '-infinity'), coalesce(p.orphan_id, 0))
          ORDER BY m.available_at, m.id
          LIMIT p.max_rows
          FOR UPDATE SKIP LOCKED) AS o;
    v_budget := p.max_bytes;
    FOR i IN 1 .. coalesce(cardinality(v_ids), 0) LOOP
        IF v_tries[i] >= p.max_attempts THEN
            v_dead := v_dead || v_ids[i];
        ELSIF v_tries[i] >= 2 THEN
            -- Claimed and lost more than once: alone, so that it takes no other row down.
            IF cardinality(v_take) = 0 THEN
                v_take := ARRAY[v_ids[i]];
                v_sizes := ARRAY[v_bytes[i]];
                v_acted := i;
                v_alone := true;
            END IF;
            EXIT;
        ELSIF cardinality(v_take) > 0 AND v_bytes[i] > v_budget THEN
            EXIT;
        ELSE
            v_take := v_take || v_ids[i];
            v_sizes := v_sizes || v_bytes[i];
            v_budget := v_budget - v_bytes[i];
        END IF;
        v_acted := i;
    END LOOP;
    r.alone := v_alone;
    IF v_alone OR (v_acted > 0 AND v_acted = cardinality(v_ids) AND v_acted = p.max_rows) THEN
        r.orphan_at := v_at[v_acted];  -- more may be waiting from here
        r.orphan_id := v_ids[v_acted];
        r.more := true;
    ELSIF v_acted < coalesce(cardinality(v_ids), 0) THEN
        r.orphan_at := v_at[v_acted + 1];
        r.orphan_id := v_ids[v_acted + 1];
        r.more := true;
    END IF;
    IF cardinality(v_dead) > 0 THEN
        SELECT b.buried, b.attempts INTO r.buried, r.buried_attempts FROM _bury(v_dead) AS b;
    END IF;

    -- Due rows, from the cursor, or from LOOKBACK ago if the cursor is closer than that.
    v_room := p.max_rows - cardinality(v_take);
    IF p.due_at IS NULL THEN
        v_from := '-infinity';
        v_from_id := 0;
    ELSIF p.due_at < v_now - LOOKBACK THEN
        v_from := p.due_at;
        v_from_id := coalesce(p.due_id, 0);
    ELSE
        v_from := v_now - LOOKBACK;
        v_from_id := 0;
    END IF;
    IF r.more THEN
        r.due_at := p.due_at;  -- this claim did not look: no further
        r.due_id := p.due_id;
    ELSE
        SELECT array_agg(d.id ORDER BY d.available_at, d.id),
               array_agg(d.available_at ORDER BY d.available_at, d.id),
               array_agg(d.attempts ORDER BY d.available_at, d.id),
               array_agg(d.bytes ORDER BY d.available_at, d.id)
        INTO v_ids, v_at, v_tries, v_bytes
        FROM (SELECT m.id, m.available_at, m.attempts,
                     octet_length(m.body) + pg_column_size(m.headers)
                         + pg_column_size(m.properties) AS bytes
              FROM messages m
              WHERE m.claim_id IS NULL AND NOT m.gated AND m.available_at <= v_now
                AND (m.available_at, m.id) >= (v_from, v_from_id)
              ORDER BY m.available_at, m.id
              LIMIT v_room
              FOR UPDATE SKIP LOCKED) AS d;
        v_acted := 0;
        v_dead := '{}';
        FOR i IN 1 .. coalesce(cardinality(v_ids), 0) LOOP
            IF v_tries[i] >= p.max_attempts THEN  -- max_attempts was lowered
                v_dead := v_dead || v_ids[i];
            ELSE
                EXIT WHEN cardinality(v_take) > 0 AND v_bytes[i] > v_budget;
                v_take := v_take || v_ids[i];
                v_sizes := v_sizes || v_bytes[i];
                v_budget := v_budget - v_bytes[i];
            END IF;
            v_acted := i;
        END LOOP;
        IF cardinality(v_dead) > 0 THEN
            SELECT r.buried || b.buried, r.buried_attempts || b.attempts
            INTO r.buried, r.buried_attempts
            FROM _bury(v_dead) AS b;
        END IF;
        IF v_acted < coalesce(cardinality(v_ids), 0) THEN  -- cut by bytes: from the first left
            r.due_at := v_at[v_acted + 1];
            r.due_id := v_ids[v_acted + 1];
            r.more := true;
        ELSIF v_acted > 0 AND v_acted >= v_room THEN  -- cut by rows: on from the last taken
            r.due_at := v_at[v_acted];
            r.due_id := v_ids[v_acted];
            r.more := true;
        END IF;
    END IF;

    -- Successors, after the due rows (released, they would wait behind them): those a paced key
    -- still holds back, or out of attempts, are released instead.
    IF cardinality(p_next) > 0 THEN
        v_room := p.max_rows - cardinality(v_take);
        IF v_room > 0 AND NOT r.more THEN
            SELECT array_agg(n.id ORDER BY n.id), array_agg(n.bytes ORDER BY n.id)
            INTO v_ids, v_bytes
            FROM (SELECT m.id, octet_length(m.body) + pg_column_size(m.headers)
                                   + pg_column_size(m.properties) AS bytes
                  FROM messages m
                  WHERE m.id = ANY(p_next) AND m.gated AND m.attempts < p.max_attempts
                    AND m.available_at <= v_now
                    AND NOT EXISTS (SELECT 1 FROM key_releases kr JOIN keys k USING (ordering_key)
                                    WHERE kr.ordering_key = m.ordering_key
                                      AND kr.settled_at + k.min_interval > v_now)
                  ORDER BY m.id
                  LIMIT v_room) AS n;
            FOR i IN 1 .. coalesce(cardinality(v_ids), 0) LOOP
                EXIT WHEN cardinality(v_take) > 0 AND v_bytes[i] > v_budget;
                v_take := v_take || v_ids[i];
                v_sizes := v_sizes || v_bytes[i];
                v_budget := v_budget - v_bytes[i];
                r.released := r.released + 1;
            END LOOP;
        END IF;
        r.released := r.released + _ungate(ARRAY(SELECT unnest(p_next) EXCEPT
                                                 SELECT unnest(v_take)));
    END IF;

    -- Run even with nothing taken: its statement trigger releases what rechecks are queued.
    UPDATE messages m
    SET attempts = m.attempts + 1,
        gated = false,
        claim_id = p.claim_id,
        claimed_by = p.claimed_by,
        claimed_at = v_now,
        available_at = v_now + make_interval(secs => p.lease)
    WHERE m.id = ANY(v_take);
    r.ids := v_take;
    r.sizes := v_sizes;
    RETURN r;
END;
$$;

-- Every transition of one claim, in one transaction, fenced by the claim id; then, with
-- p_next, the next claim (it sees what this released). Per row of p_ids: its fate ('archive';
-- 'dead' with p_reasons and p_notes as the detail; 'retry' after p_delays seconds with p_notes
-- as the error; 'refund', the same giving back the attempt its claim counted; 'ambiguous', a
-- refund that records a send whose outcome is unknown). p_resent: rows written twice in this
-- claim. The claim's rows are locked first, in id order, waiting (lock_timeout bounds it) only
-- for a moment's holders (a renewal, a producer's commit checking its key): no relay statement
-- waits for anything that waits, so none can deadlock. Rows no longer under the claim are left.
CREATE OR REPLACE FUNCTION settle(p_claim_id uuid, p_ids bigint[], p_fates text[], p_reasons text[],
                       p_notes text[], p_delays float8[], p_resent bigint[], p_durable boolean,
                       p_next claim_request)
RETURNS claimed
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    r       claimed;
    v_mine  bigint[];
    v_keys  text[] := '{}';
    v_seqs  bigint[] := '{}';
    v_why   text[] := '{}';
    v_mids  uuid[] := '{}';
    v_next  bigint[] := '{}';
    v_n     integer;
BEGIN
    PERFORM _read_committed('settle');
    IF cardinality(p_ids) <> cardinality(p_fates)
       OR cardinality(p_ids) <> coalesce(cardinality(p_reasons), cardinality(p_ids))
       OR cardinality(p_ids) <> coalesce(cardinality(p_notes), cardinality(p_ids))
       OR cardinality(p_ids) <> coalesce(cardinality(p_delays), cardinality(p_ids)) THEN
        RAISE EXCEPTION 'settle: p_fates, p_reasons, p_notes and p_delays need one entry per id'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_fates) AS f
               WHERE f IS NULL OR f NOT IN ('archive', 'dead', 'retry', 'refund', 'ambiguous')) THEN
        RAISE EXCEPTION 'settle: a fate is archive, dead, retry, refund or ambiguous'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    r := ROW(0, 0, 0, 0, 0, '{}', '{}', false, false, NULL, NULL, NULL, NULL, '{}', '{}');
    v_mine := ARRAY(SELECT m.id FROM messages m
                    WHERE m.id = ANY(p_ids) AND m.claim_id IS NOT DISTINCT FROM p_claim_id
                    ORDER BY m.id FOR UPDATE);

    IF cardinality(v_mine) > 0 THEN
        IF cardinality(p_resent) > 0 THEN
            UPDATE messages SET ambiguous = ambiguous + 1
            WHERE id = ANY(p_resent) AND id = ANY(v_mine);
        END IF;
        WITH fate AS (
            SELECT f.* FROM unnest(p_ids, p_fates, p_reasons, p_notes)
                            AS f(id, fate, reason, note)
            WHERE f.id = ANY(v_mine) AND f.fate IN ('archive', 'dead')
        ), deleted AS (
            -- By the primary key and the ids alone: joined to `fate`, the planner may walk the
            -- whole index instead, every version a pinned horizon keeps.
            DELETE FROM messages m WHERE m.id = ANY(ARRAY(SELECT id FROM fate))
            RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers,
                      m.properties, m.ordering_key, m.seq, m.attempts, m.ambiguous, m.created_at,
                      m.replays, m.replayed_at, m.replayed_from
        ), gone AS (
            SELECT d.*, f.fate, f.reason, f.note FROM deleted d JOIN fate f USING (id)
        ), archived AS (
            INSERT INTO archive (message_id, exchange, routing_key, body, headers, properties,
                                 ordering_key, seq, attempts, ambiguous, created_at, replays,
                                 replayed_at, replayed_from)
            SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key,
                   seq, attempts, ambiguous, created_at, replays, replayed_at, replayed_from
            FROM gone WHERE fate = 'archive'
            RETURNING 1
        ), died AS (
            INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, seq, attempts, ambiguous, created_at, replays,
                              replayed_at, replayed_from, reason, detail)
            SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key,
                   seq, attempts, ambiguous, created_at, replays, replayed_at, replayed_from,
                   coalesce(reason, 'rejected'), coalesce(note, '')
            FROM gone WHERE fate = 'dead'
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM archived), (SELECT count(*) FROM died),
               coalesce(array_agg(g.ordering_key) FILTER (WHERE g.ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(g.seq) FILTER (WHERE g.ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(CASE WHEN g.fate = 'dead' THEN coalesce(g.reason, 'rejected') END)
                            FILTER (WHERE g.ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(g.message_id) FILTER (WHERE g.ordering_key IS NOT NULL), '{}')
        INTO r.archived, r.dead, v_keys, v_seqs, v_why, v_mids
        FROM gone g;

        UPDATE messages AS m
        SET available_at = now() + make_interval(secs => greatest(coalesce(f.delay, 0), 0)),
            attempts = m.attempts - (f.fate IN ('refund', 'ambiguous'))::integer,
            ambiguous = m.ambiguous + (f.fate = 'ambiguous')::integer,
            claim_id = NULL,
            claimed_by = NULL,
            claimed_at = NULL,
            last_error = f.note
        FROM unnest(p_ids, p_fates, p_notes, p_delays) AS f(id, fate, note, delay)
        WHERE m.id = ANY(v_mine) AND m.id = f.id AND f.fate IN ('retry', 'refund', 'ambiguous');
        GET DIAGNOSTICS v_n = ROW_COUNT;
        r.retried := v_n;

        IF cardinality(v_keys) > 0 THEN
            SELECT s.held, s.blocked INTO v_next, r.blocked
            FROM _successors(v_keys, v_seqs, v_why, v_mids) AS s;
        END IF;
    END IF;

    IF (p_next).claim_id IS NULL THEN
        r.released := _ungate(v_next);
    ELSE
        DECLARE
            c claimed := _claim(p_next, v_next);
        BEGIN
            r.released := c.released;
            r.ids := c.ids;
            r.sizes := c.sizes;
            r.more := c.more;
            r.alone := c.alone;
            r.due_at := c.due_at;
            r.due_id := c.due_id;
            r.orphan_at := c.orphan_at;
            r.orphan_id := c.orphan_id;
            r.buried := c.buried;
            r.buried_attempts := c.buried_attempts;
        END;
    END IF;
    RETURN r;
END;
$$;


-- Renew a claim's leases; the rows still under it come back. Never waits: a row locked by
-- another session (its own settle, a relay taking it over) is not renewed and not returned.
CREATE OR REPLACE FUNCTION extend_leases(p_claim_id uuid, p_ids bigint[], p_lease float8)
RETURNS SETOF bigint
LANGUAGE sql SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    -- Locked first, then updated by their ids: a join of the two lets the planner run the
    -- locking scan once per row (or merge over the whole index).
    WITH held AS MATERIALIZED (
        SELECT id FROM messages
        WHERE id = ANY(p_ids) AND claim_id IS NOT DISTINCT FROM p_claim_id
        ORDER BY id FOR UPDATE SKIP LOCKED
    )
    UPDATE messages m
    SET available_at = now() + make_interval(secs => p_lease)
    WHERE m.id = ANY(ARRAY(SELECT id FROM held))
    RETURNING m.id
$$;
