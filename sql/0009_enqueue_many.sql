-- 0009: enqueue without a subtransaction per message, and enqueue_many for batches.
--
-- _enqueue caught a duplicate message_id with an EXCEPTION block. PL/pgSQL runs such a block as a
-- subtransaction, and the INSERT inside gave each message a subtransaction id of its own: a
-- producer enqueueing more than 64 messages in one transaction overflowed its subtransaction
-- cache, after which every snapshot in the database has to consult pg_subtrans — a known
-- performance cliff for the whole server. ON CONFLICT on message_id detects the duplicate without
-- one. (Other unique violations, none expected, keep PostgreSQL's own message.)
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
BEGIN
    PERFORM _check_message(p_exchange, p_routing_key, p_body, v_headers, v_properties, v_due,
                           p_ordering_key);
    IF NOT v_properties ? 'content_type' THEN
        v_properties := v_properties || jsonb_build_object('content_type', p_default_content_type);
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
            USING ERRCODE = 'unique_violation';
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

-- Many messages in one call (one round trip), in array order; returns their message_ids in the
-- same order. The arrays after `bodies` may be NULL (defaults for every message) or hold one entry
-- per message (NULL entries take the default). Each message is checked exactly as enqueue checks
-- it; the first bad one fails the call, naming its position, and the caller's transaction aborts
-- as after any error. Like enqueue it runs as the schema's owner (the producer role needs no table
-- rights) and never commits.
CREATE FUNCTION enqueue_many(
    exchanges     text[],
    routing_keys  text[],
    bodies        bytea[],
    headers       jsonb[]       DEFAULT NULL,
    properties    jsonb[]       DEFAULT NULL,
    available_at  timestamptz[] DEFAULT NULL,
    ordering_keys text[]        DEFAULT NULL,
    message_ids   uuid[]        DEFAULT NULL
) RETURNS SETOF uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_n integer := coalesce(cardinality(bodies), 0);
    v_i integer := 0;
BEGIN
    IF exchanges IS NULL OR routing_keys IS NULL OR bodies IS NULL THEN
        RAISE EXCEPTION 'enqueue_many: exchanges, routing_keys and bodies must not be NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF cardinality(exchanges) <> v_n OR cardinality(routing_keys) <> v_n
       OR coalesce(cardinality(headers), v_n) <> v_n
       OR coalesce(cardinality(properties), v_n) <> v_n
       OR coalesce(cardinality(available_at), v_n) <> v_n
       OR coalesce(cardinality(ordering_keys), v_n) <> v_n
       OR coalesce(cardinality(message_ids), v_n) <> v_n THEN
        RAISE EXCEPTION 'enqueue_many: every array must hold one entry per message (% bodies)', v_n
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    BEGIN  -- one subtransaction for the whole call, only to say which message failed
        WHILE v_i < v_n LOOP  -- not FOR: its loop variable would be gone in the handler
            v_i := v_i + 1;
            RETURN NEXT _enqueue(exchanges[v_i], routing_keys[v_i], bodies[v_i], headers[v_i],
                                 properties[v_i], available_at[v_i], ordering_keys[v_i],
                                 message_ids[v_i], 'application/octet-stream');
        END LOOP;
    EXCEPTION WHEN invalid_parameter_value OR unique_violation THEN
        DECLARE
            v_message text;
            v_state   text;
        BEGIN
            GET STACKED DIAGNOSTICS v_message = MESSAGE_TEXT, v_state = RETURNED_SQLSTATE;
            RAISE EXCEPTION 'enqueue_many: message % of %: %', v_i, v_n, v_message
                USING ERRCODE = v_state;
        END;
    END;
END;
$$;

COMMENT ON FUNCTION enqueue_many(text[], text[], bytea[], jsonb[], jsonb[], timestamptz[], text[],
                                 uuid[]) IS
    'Queue many AMQP messages in the current transaction, in order; returns their message_ids.';
