-- 0013: the relay's writes through functions, so its role needs no right to write a message's
-- content (docs/decisions/0003).
--
-- Until now a relay inserted into archive and dead and deleted from messages itself, and its role
-- held UPDATE on every column of messages: it could rewrite a waiting message's body or
-- destination, insert a dead row (which `dead replay --all` would turn into a real message), or
-- ungate a key's next message out of order. These functions do the moves for it, each fenced by
-- the claim id, and run as the schema's owner; `outbox-relay roles` now grants the relay role
-- EXECUTE on them and UPDATE only on the lease columns its claims and heartbeats write.
-- Relays of the previous version keep using their own statements (and rights) until `roles` is
-- run again after the rollout; see CHANGELOG.md.

-- Apply one claim's transitions, in one transaction, each fenced by p_claim_id (and never to a
-- gated row: a claimed row never is one, and a relay's login may write claim_id, so a relay must
-- not be able to settle a key's later message out of order this way): count the resent
-- rows' extra sends, archive the confirmed ones, dead-letter the failed ones with their reasons,
-- put the ones to retry back, and release (or block) the keys of the rows moved. Without
-- p_durable the commit does not wait for the WAL flush (the relay's OUTBOX_SYNCHRONOUS_COMMIT=off):
-- a crash can then undo the settle, and the rows are sent again under a new claim — which counts
-- its attempt, so `attempts + ambiguous` still bounds the sends. Returns how many rows each
-- transition moved, how many keyed rows it released and how many keys it blocked.
CREATE FUNCTION settle(
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
AS $$
DECLARE
    v_keys    text[];
    v_seqs    bigint[];
    v_reasons text[];
    v_ids     uuid[];
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
    -- Each part runs only when it has rows (the common settle only archives): a statement with
    -- nothing to do still plans and opens its scans, which a pinned vacuum horizon makes dear.
    IF cardinality(p_resent) > 0 THEN
        UPDATE messages SET ambiguous = ambiguous + 1
        WHERE id = ANY(p_resent) AND claim_id = p_claim_id AND NOT gated;
    END IF;

    IF cardinality(p_archive) > 0 THEN
        WITH done AS (
            DELETE FROM messages
            WHERE id = ANY(p_archive) AND claim_id = p_claim_id AND NOT gated
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
        SELECT count(*),
               coalesce(array_agg(ordering_key) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(seq) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(NULL::text) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(message_id) FILTER (WHERE ordering_key IS NOT NULL), '{}')
        INTO archived, v_keys, v_seqs, v_reasons, v_ids
        FROM moved;
    END IF;

    IF cardinality(p_dead) > 0 THEN
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
        SELECT count(*),
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
        GET DIAGNOSTICS retried = ROW_COUNT;
    END IF;

    released := 0;
    blocked := 0;
    IF cardinality(v_keys) > 0 THEN
        SELECT s.released, s.blocked INTO released, blocked
        FROM _keys_settled(v_keys, v_seqs, v_reasons, v_ids) AS s;
    END IF;
END;
$$;

-- Move up to p_limit orphans that used up their attempts to dead, in SQL: their body never reaches
-- a relay, because reading it may be exactly what kills relays. Their keys are then released or
-- blocked as for any dead letter. The relay calls it until it returns fewer than p_limit rows.
CREATE FUNCTION bury_exhausted(p_max_attempts integer, p_limit integer)
RETURNS TABLE (buried_id uuid, buried_attempts integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_ids      uuid[];
    v_attempts integer[];
    v_keys     text[];
    v_seqs     bigint[];
    v_keyed    uuid[];
BEGIN
    PERFORM _read_committed('bury_exhausted');
    IF p_max_attempts IS NULL OR p_max_attempts < 1 THEN
        RAISE EXCEPTION 'bury_exhausted: p_max_attempts must be at least 1, not %', p_max_attempts
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH gone AS (
        DELETE FROM messages
        WHERE id IN (
            SELECT id
            FROM messages
            WHERE claim_id IS NOT NULL AND available_at <= now() AND attempts >= p_max_attempts
              AND NOT gated
            ORDER BY available_at, id
            LIMIT p_limit
            FOR UPDATE SKIP LOCKED
        )
        RETURNING message_id, exchange, routing_key, body, headers, properties, ordering_key,
                  seq, attempts, ambiguous, created_at, claimed_by, last_error, replays,
                  replayed_at, replayed_from
    ), moved AS (
        INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties,
                          ordering_key, seq, attempts, ambiguous, created_at, replays,
                          replayed_at, replayed_from, reason, detail)
        SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key, seq,
               attempts, ambiguous, created_at, replays, replayed_at, replayed_from,
               'max_attempts',
               format('claimed %s times and never settled: the relays publishing it died or '
                      'lost their lease (last claimed by %s; last error: %s)',
                      attempts, coalesce(claimed_by, 'unknown'), coalesce(last_error, 'none'))
        FROM gone
        RETURNING message_id, attempts, ordering_key, seq
    )
    SELECT coalesce(array_agg(message_id), '{}'), coalesce(array_agg(attempts), '{}'),
           coalesce(array_agg(ordering_key) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
           coalesce(array_agg(seq) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
           coalesce(array_agg(message_id) FILTER (WHERE ordering_key IS NOT NULL), '{}')
    INTO v_ids, v_attempts, v_keys, v_seqs, v_keyed
    FROM moved;
    IF cardinality(v_keys) > 0 THEN
        PERFORM _keys_settled(v_keys, v_seqs,
                              array_fill('max_attempts'::text, ARRAY[cardinality(v_keys)]),
                              v_keyed);
    END IF;
    RETURN QUERY SELECT * FROM unnest(v_ids, v_attempts);
END;
$$;
