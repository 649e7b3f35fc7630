-- 0020: a settle that claims the relay's next batch in the same transaction and round trip
-- (docs/decisions/0005).
--
-- A relay's cycle was claim → publish → settle, each claim and each settle a round trip and a
-- durable commit of its own. settle_then_claim settles a batch and claims the next one in one
-- call and one transaction. The keyed rows the settle releases — the successors of the keyed rows
-- it archived — are claimed by the same UPDATE that releases them, when they are due and not
-- paced by their key's minimum interval: one row version instead of two (release, then claim),
-- and none of the claim's walk of the due index for them. Then claim_batch claims the rest of the
-- batch, as any claim does; it sees what the settle did. The call is durable whenever it claimed
-- anything, whatever the settle asked for (p_durable applies to a call that claimed nothing). It
-- returns the released rows it claimed (lane 'successor'), claim_batch's rows and trailer, then
-- one row with the settle's counts (lane 'settled').
--
-- settle keeps its signature and what it does (its body moves into _settle, which both use), and
-- so does the four-argument _keys_settled that bury_exhausted calls; relays of the previous
-- version are unaffected. `migrate` grants the new function to the relay role.

SET LOCAL lock_timeout = '10s';

-- _keys_settled of 0012, which also claims the rows it releases under p_claim (when given): up
-- to p_limit of them and p_max_bytes (at least one row), those due now and not paced. A row
-- another session released first is neither released nor claimed here (the UPDATE checks
-- `gated` again on the row's newest version), as before.
CREATE FUNCTION _keys_settled(p_keys text[], p_seqs bigint[], p_reasons text[],
                              p_message_ids uuid[], p_claim uuid, p_claimed_by text,
                              p_lease float8, p_limit integer, p_max_bytes bigint,
                              OUT released integer, OUT blocked integer, OUT claimed integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row record;
    v_n   integer;
BEGIN
    released := 0;
    blocked := 0;
    claimed := 0;
    PERFORM 1 FROM blocked_keys b
    WHERE b.ordering_key = ANY(p_keys)
    ORDER BY b.ordering_key
    FOR KEY SHARE;
    IF p_claim IS NULL
       AND NOT EXISTS (SELECT 1 FROM unnest(p_reasons) AS r(reason) WHERE r.reason IS NOT NULL)
    THEN  -- releasing only: 0012's statement, which reads each successor once
        WITH settled AS (
            SELECT s.ordering_key, s.seq, coalesce(k.concurrency, 1) AS concurrency,
                   coalesce(k.min_interval, '0') AS min_interval
            FROM unnest(p_keys, p_seqs) AS s(ordering_key, seq)
            LEFT JOIN keys k USING (ordering_key)
            WHERE s.seq IS NOT NULL
        ), paced AS (
            INSERT INTO key_releases AS r (ordering_key, settled_at)
            SELECT DISTINCT ordering_key, now() FROM settled WHERE min_interval > '0'
            ON CONFLICT (ordering_key) DO UPDATE SET settled_at = excluded.settled_at
        ), freed AS (
            UPDATE messages m
            SET gated = false,
                available_at = greatest(m.available_at, now() + s.min_interval)
            FROM settled s
            WHERE m.ordering_key = s.ordering_key
              AND m.seq = s.seq + s.concurrency
              AND m.gated
              AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = s.ordering_key)
            RETURNING 1
        )
        SELECT count(*) INTO released FROM freed;
        RETURN;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM unnest(p_reasons) AS r(reason) WHERE r.reason IS NOT NULL) THEN
        WITH settled AS (
            SELECT s.ordering_key, s.seq, coalesce(k.concurrency, 1) AS concurrency,
                   coalesce(k.min_interval, '0') AS min_interval
            FROM unnest(p_keys, p_seqs) AS s(ordering_key, seq)
            LEFT JOIN keys k USING (ordering_key)
            WHERE s.seq IS NOT NULL
        ), paced AS (
            INSERT INTO key_releases AS r (ordering_key, settled_at)
            SELECT DISTINCT ordering_key, now() FROM settled WHERE min_interval > '0'
            ON CONFLICT (ordering_key) DO UPDATE SET settled_at = excluded.settled_at
        ), following AS MATERIALIZED (
            SELECT m.id, s.min_interval,
                   p_claim IS NOT NULL AND s.min_interval = '0' AND m.claim_id IS NULL
                       AND m.available_at <= now() AS due,
                   octet_length(m.body) + pg_column_size(m.headers)
                       + pg_column_size(m.properties) AS bytes
            FROM settled s
            JOIN messages m ON m.ordering_key = s.ordering_key AND m.seq = s.seq + s.concurrency
            WHERE m.gated
              AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = s.ordering_key)
        ), ranked AS (
            SELECT f.id, f.min_interval,
                   f.due AND count(*) OVER w <= p_limit
                         AND (sum(f.bytes) OVER w <= p_max_bytes
                              OR sum(f.bytes) OVER w = f.bytes) AS take
            FROM following f
            WINDOW w AS (PARTITION BY f.due ORDER BY f.id)
        ), freed AS (
            UPDATE messages m
            SET gated = false,
                available_at = CASE WHEN r.take THEN now() + make_interval(secs => p_lease)
                                    ELSE greatest(m.available_at, now() + r.min_interval) END,
                attempts = m.attempts + r.take::integer,
                claim_id = CASE WHEN r.take THEN p_claim ELSE m.claim_id END,
                claimed_by = CASE WHEN r.take THEN p_claimed_by ELSE m.claimed_by END,
                claimed_at = CASE WHEN r.take THEN now() ELSE m.claimed_at END
            FROM ranked r
            WHERE m.id = r.id AND m.gated
            RETURNING r.take
        )
        SELECT count(*), count(*) FILTER (WHERE take) INTO released, claimed FROM freed;
        RETURN;
    END IF;
    FOR v_row IN
        SELECT s.*, coalesce(k.concurrency, 1) AS concurrency,
               coalesce(k.min_interval, '0') AS min_interval
        FROM unnest(p_keys, p_seqs, p_reasons, p_message_ids)
             AS s(ordering_key, seq, reason, message_id)
        LEFT JOIN keys k USING (ordering_key)
        WHERE s.seq IS NOT NULL
        ORDER BY s.ordering_key, s.seq
    LOOP
        IF v_row.reason IS NOT NULL AND (key_policy(v_row.ordering_key)).on_dead = 'block' THEN
            INSERT INTO blocked_keys (ordering_key, message_id, seq, reason)
            VALUES (v_row.ordering_key, v_row.message_id, v_row.seq, v_row.reason)
            ON CONFLICT (ordering_key) DO NOTHING;
            blocked := blocked + 1;
            CONTINUE;
        END IF;
        IF v_row.min_interval > '0' THEN
            INSERT INTO key_releases (ordering_key, settled_at)
            VALUES (v_row.ordering_key, now())
            ON CONFLICT (ordering_key) DO UPDATE SET settled_at = excluded.settled_at;
        END IF;
        UPDATE messages m
        SET gated = false,
            available_at = greatest(m.available_at, now() + v_row.min_interval)
        WHERE m.ordering_key = v_row.ordering_key
          AND m.seq = v_row.seq + v_row.concurrency
          AND m.gated
          AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = v_row.ordering_key);
        GET DIAGNOSTICS v_n = ROW_COUNT;
        released := released + v_n;
    END LOOP;
END;
$$;

CREATE OR REPLACE FUNCTION _keys_settled(p_keys text[], p_seqs bigint[], p_reasons text[],
                                         p_message_ids uuid[], OUT released integer,
                                         OUT blocked integer)
LANGUAGE sql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    SELECT s.released, s.blocked
    FROM _keys_settled(p_keys, p_seqs, p_reasons, p_message_ids, NULL, NULL, NULL, NULL, NULL) AS s
$$;

-- settle of 0015, which can also claim the keyed rows it releases (p_next_id; NULL: it does not).
CREATE FUNCTION _settle(
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
    p_next_id    uuid,
    p_claimed_by text,
    p_lease      float8,
    p_limit      integer,
    p_max_bytes  bigint,
    OUT archived integer,
    OUT dead     integer,
    OUT retried  integer,
    OUT released integer,
    OUT blocked  integer,
    OUT claimed  integer
)
LANGUAGE plpgsql
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
    claimed := 0;
    IF cardinality(v_keys) > 0 THEN
        SELECT s.released, s.blocked, s.claimed INTO released, blocked, claimed
        FROM _keys_settled(v_keys, v_seqs, v_reasons, v_ids, p_next_id, p_claimed_by, p_lease,
                           p_limit, p_max_bytes) AS s;
    END IF;
END;
$$;

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
LANGUAGE sql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    SELECT s.archived, s.dead, s.retried, s.released, s.blocked
    FROM _settle(p_claim_id, p_archive, p_dead, p_reasons, p_details, p_retry, p_delays,
                 p_errors, p_refunds, p_ambiguous, p_resent, p_durable, NULL, NULL, NULL, NULL,
                 NULL) AS s
$$;

-- The relay's settle and next claim in one: settle p_claim_id's batch as settle does, claiming
-- the keyed rows it releases under p_next_id — at most p_limit − 1 of them and half of
-- p_max_bytes (one larger row alone), so that the claim that follows always has room and
-- unkeyed rows and new keys never wait behind a keyed backlog — then claim_batch for the rest of
-- p_limit and p_max_bytes under the same id (its other parameters are claim_batch's). As with
-- any claim, a batch may end one row past p_max_bytes (a claim's first row always goes); and
-- claim_batch counts the released rows' bytes once more when it moves from one lane to the
-- other, so with messages of megabytes a batch is smaller than it could be.
CREATE FUNCTION settle_then_claim(
    p_claim_id    uuid,
    p_archive     bigint[],
    p_dead        bigint[],
    p_reasons     text[],
    p_details     text[],
    p_retry       bigint[],
    p_delays      float8[],
    p_errors      text[],
    p_refunds     boolean[],
    p_ambiguous   boolean[],
    p_resent      bigint[],
    p_durable     boolean,
    p_limit       integer,
    p_max_bytes   bigint,
    p_next_id     uuid,
    p_claimed_by  text,
    p_lease       float8,
    p_prev        text,
    p_hi          text,
    p_xid         xid8,
    p_id          bigint,
    p_ready_first boolean,
    p_verify      boolean)
RETURNS TABLE (id bigint, message_id uuid, exchange text, routing_key text, body bytea,
               headers text, properties text, ordering_key text, created_at timestamptz,
               attempts integer, ambiguous integer, last_error text, seq bigint, replays integer,
               replayed_at timestamptz, replayed_from text, locked bigint, lane text,
               window_hi text, window_xid xid8, window_id bigint, window_closed boolean,
               archived integer, dead integer, retried integer, released integer,
               blocked integer)
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
    v_counts  record;
    v_commit  text := current_setting('synchronous_commit');
    v_bytes   bigint := 0;
    v_claimed bigint;
BEGIN
    IF p_limit < 1 OR p_max_bytes < 1 OR p_lease <= 0 THEN
        RAISE EXCEPTION 'settle_then_claim: limit, bytes and lease must be positive'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_next_id IS NULL OR p_next_id = p_claim_id THEN
        RAISE EXCEPTION 'settle_then_claim: the next claim needs an id of its own'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO v_counts
    FROM _settle(p_claim_id, p_archive, p_dead, p_reasons, p_details, p_retry, p_delays,
                 p_errors, p_refunds, p_ambiguous, p_resent, p_durable, p_next_id, p_claimed_by,
                 p_lease, p_limit - 1, greatest(p_max_bytes / 2, 1));
    IF v_counts.claimed > 0 THEN
        -- The rows it claimed all have the same lease end, which messages_leased_idx finds.
        RETURN QUERY
        SELECT m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers::text,
               m.properties::text, m.ordering_key, m.created_at, m.attempts, m.ambiguous,
               m.last_error, m.seq, m.replays, m.replayed_at, m.replayed_from, NULL::bigint,
               'successor', NULL::text, NULL::xid8, NULL::bigint, NULL::boolean,
               NULL::integer, NULL::integer, NULL::integer, NULL::integer, NULL::integer
        FROM messages m
        WHERE m.claim_id IS NOT NULL
          AND m.available_at = now() + make_interval(secs => p_lease)
          AND m.claim_id = p_next_id;
        v_bytes := _claimed_bytes(p_next_id, p_lease, '{}');
    END IF;
    RETURN QUERY
    SELECT c.*, NULL::integer, NULL::integer, NULL::integer, NULL::integer, NULL::integer
    FROM claim_batch(p_limit - v_counts.claimed, greatest(p_max_bytes - v_bytes, 1), p_next_id,
                     p_claimed_by, p_lease, p_prev, p_hi, p_xid, p_id, p_ready_first,
                     p_verify) AS c;
    GET DIAGNOSTICS v_claimed = ROW_COUNT;
    IF v_counts.claimed > 0 OR v_claimed > 1 THEN  -- a claim is durable before it returns
        PERFORM set_config('synchronous_commit',
                           CASE WHEN v_commit = 'off' THEN 'on' ELSE v_commit END, true);
    END IF;
    RETURN QUERY
    SELECT NULL::bigint, NULL::uuid, NULL::text, NULL::text, NULL::bytea, NULL::text, NULL::text,
           NULL::text, NULL::timestamptz, NULL::integer, NULL::integer, NULL::text, NULL::bigint,
           NULL::integer, NULL::timestamptz, NULL::text, NULL::bigint, 'settled', NULL::text,
           NULL::xid8, NULL::bigint, NULL::boolean, v_counts.archived, v_counts.dead,
           v_counts.retried, v_counts.released, v_counts.blocked;
END;
$$;
