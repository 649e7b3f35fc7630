-- 0006: the operator's side of dead letters and the archive: one filter for every dead-letter
-- command, replay that moves rows back transactionally with provenance, and retention settings.

-- Provenance of replayed messages: how often, when, and from which dead reason. Published as the
-- x-outbox-replays / x-outbox-replayed-at / x-outbox-replayed-from headers, and kept through the
-- archive and dead, so a message that dies again is replayed with the count going on.
ALTER TABLE messages ADD COLUMN replays integer NOT NULL DEFAULT 0,
                     ADD COLUMN replayed_at timestamptz,
                     ADD COLUMN replayed_from text;
ALTER TABLE archive ADD COLUMN replays integer NOT NULL DEFAULT 0,
                    ADD COLUMN replayed_at timestamptz,
                    ADD COLUMN replayed_from text;
ALTER TABLE dead ADD COLUMN replays integer NOT NULL DEFAULT 0,
                 ADD COLUMN replayed_at timestamptz,
                 ADD COLUMN replayed_from text;

-- The archive is pruned by small batches of its oldest rows (see the README): vacuum should keep
-- up with each pruning pass instead of waiting for a fifth of the table to be dead.
ALTER TABLE archive SET (autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 10000);

-- Whether a dead row matches an operator's filter. NULL means "any". Patterns are LIKE patterns
-- with backslash escapes (the relay turns shell globs into them). Every dead-letter command uses
-- this, so list, count, replay and purge always agree on what a filter means. It reads no table,
-- so PostgreSQL inlines it: a bound on failed_at still uses its index, and a batch ordered by id
-- stops after the batch.
CREATE FUNCTION dead_matches(
    d             dead,
    p_reasons     text[]      DEFAULT NULL,
    p_exchange    text        DEFAULT NULL,
    p_routing_key text        DEFAULT NULL,
    p_key         text        DEFAULT NULL,
    p_since       timestamptz DEFAULT NULL,
    p_until       timestamptz DEFAULT NULL,
    p_ids         uuid[]      DEFAULT NULL
) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT (p_reasons IS NULL OR d.reason = ANY(p_reasons))
       AND (p_exchange IS NULL OR d.exchange = p_exchange)
       AND (p_routing_key IS NULL OR d.routing_key LIKE p_routing_key ESCAPE '\')
       AND (p_key IS NULL OR coalesce(d.ordering_key LIKE p_key ESCAPE '\', false))
       AND (p_since IS NULL OR d.failed_at >= p_since)
       AND (p_until IS NULL OR d.failed_at < p_until)
       AND (p_ids IS NULL OR d.message_id = ANY(p_ids))
$$;

-- Move dead rows back to messages, each leaving dead in the same transaction it enters messages:
-- same message_id, attempts reset, optionally sent to another exchange or routing key, with its
-- provenance recorded. A keyed message goes back in its place: with its own sequence number, and
-- if it is the one blocking its key, the key is unblocked and it goes first. Rows whose message_id
-- is already waiting in messages stay in dead. Returns the message_ids moved.
--
-- A gated row waits for its predecessor (seq - concurrency) in messages, or for its key's block to
-- be lifted. After the moves, every gated row of a touched, unblocked key whose predecessor is not
-- waiting is released: a row replayed behind a blocker goes once the blocker is replayed too.
CREATE FUNCTION replay_dead(p_ids bigint[], p_exchange text DEFAULT NULL,
                            p_routing_key text DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row         dead%ROWTYPE;
    v_gated       boolean;
    v_concurrency integer;
    v_keys        text[] := '{}';
BEGIN
    IF octet_length(p_exchange) > 255 THEN
        RAISE EXCEPTION 'replay_dead: exchange is % bytes long; AMQP allows at most 255',
            octet_length(p_exchange) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(p_routing_key) > 255 THEN
        RAISE EXCEPTION 'replay_dead: routing_key is % bytes long; AMQP allows at most 255',
            octet_length(p_routing_key) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR v_row IN
        SELECT * FROM dead WHERE id = ANY(p_ids) ORDER BY ordering_key NULLS FIRST, seq, id
        FOR UPDATE
    LOOP
        CONTINUE WHEN EXISTS (SELECT 1 FROM messages m WHERE m.message_id = v_row.message_id);
        v_gated := false;
        IF v_row.ordering_key IS NOT NULL THEN
            -- The key's lock: no producer is mid-enqueue while its gates are decided.
            SELECT coalesce(max(k.concurrency), 1) INTO v_concurrency
            FROM keys k WHERE k.ordering_key = v_row.ordering_key;
            PERFORM 1 FROM keys k WHERE k.ordering_key = v_row.ordering_key FOR UPDATE;
            DELETE FROM blocked_keys b
            WHERE b.ordering_key = v_row.ordering_key AND b.message_id = v_row.message_id;
            v_gated := EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = v_row.ordering_key)
                       OR EXISTS (SELECT 1 FROM messages m
                                  WHERE m.ordering_key = v_row.ordering_key
                                    AND m.seq = v_row.seq - v_concurrency);
            v_keys := array_append(v_keys, v_row.ordering_key);
        END IF;
        DELETE FROM dead WHERE id = v_row.id;
        INSERT INTO messages (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, seq, gated, created_at, available_at,
                              replays, replayed_at, replayed_from)
        VALUES (v_row.message_id, coalesce(p_exchange, v_row.exchange),
                coalesce(p_routing_key, v_row.routing_key), v_row.body, v_row.headers,
                v_row.properties, v_row.ordering_key, v_row.seq, v_gated, v_row.created_at, now(),
                v_row.replays + 1, now(), v_row.reason);
        RETURN NEXT v_row.message_id;
    END LOOP;
    UPDATE messages m
    SET gated = false
    WHERE m.ordering_key = ANY(v_keys) AND m.gated
      AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = m.ordering_key)
      AND NOT EXISTS (SELECT 1 FROM messages p
                      WHERE p.ordering_key = m.ordering_key
                        AND p.seq = m.seq - (SELECT coalesce(max(k.concurrency), 1) FROM keys k
                                             WHERE k.ordering_key = m.ordering_key));
    PERFORM pg_notify(current_schema() || '_new', '');
END;
$$;

-- release_key's replay is now replay_dead: one way to put a message back.
CREATE OR REPLACE FUNCTION release_key(p_key text, p_replay boolean DEFAULT false) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_block       blocked_keys%ROWTYPE;
    v_concurrency integer;
BEGIN
    PERFORM 1 FROM keys WHERE ordering_key = p_key FOR UPDATE;
    SELECT coalesce(max(concurrency), 1) INTO v_concurrency FROM keys WHERE ordering_key = p_key;
    SELECT * INTO v_block FROM blocked_keys WHERE ordering_key = p_key;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_replay AND EXISTS (SELECT 1 FROM dead WHERE message_id = v_block.message_id) THEN
        PERFORM replay_dead(ARRAY(SELECT id FROM dead WHERE message_id = v_block.message_id));
        RETURN true;  -- its successors stay gated behind it, as before it died
    END IF;
    DELETE FROM blocked_keys WHERE ordering_key = p_key;
    -- Skip the dead message: release every row whose gate is no longer pending.
    UPDATE messages m
    SET gated = false
    WHERE m.ordering_key = p_key AND m.gated
      AND NOT EXISTS (SELECT 1 FROM messages p
                      WHERE p.ordering_key = p_key AND p.seq = m.seq - v_concurrency);
    PERFORM pg_notify(current_schema() || '_new', '');
    RETURN true;
END;
$$;
