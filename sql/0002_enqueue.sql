-- 0002: the producer API, enqueue() and enqueue_json(), callable from any language inside the
-- caller's own transaction. Every check runs before the insert, so a rejected call writes nothing.
--
-- Errors are raised with SQLSTATE 22023 (invalid_parameter_value) and a message naming the argument.
-- Functions pin search_path to the outbox schema (captured at migration time) with pg_temp last, so
-- a caller's search_path can never redirect them to other tables.

CREATE FUNCTION _enqueue(
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
    v_limits     settings%ROWTYPE;
    v_headers    jsonb := coalesce(p_headers, '{}');
    v_properties jsonb := coalesce(p_properties, '{}');
    v_now        timestamptz := clock_timestamp();
    v_due        timestamptz := coalesce(p_available_at, v_now);
    v_message_id uuid := coalesce(p_message_id, gen_random_uuid());
    v_key        text;
    v_value      jsonb;
BEGIN
    SELECT * INTO STRICT v_limits FROM settings;

    IF p_exchange IS NULL THEN
        RAISE EXCEPTION 'enqueue: exchange must not be NULL'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Use the empty string for the default exchange.';
    END IF;
    IF p_routing_key IS NULL THEN
        RAISE EXCEPTION 'enqueue: routing_key must not be NULL'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Use the empty string when the exchange ignores routing keys.';
    END IF;
    IF octet_length(p_exchange) > 255 THEN
        RAISE EXCEPTION 'enqueue: exchange is % bytes long; AMQP allows at most 255',
            octet_length(p_exchange) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(p_routing_key) > 255 THEN
        RAISE EXCEPTION 'enqueue: routing_key is % bytes long; AMQP allows at most 255',
            octet_length(p_routing_key) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_body IS NULL THEN
        RAISE EXCEPTION 'enqueue: body must not be NULL'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Send an empty body as ''''::bytea.';
    END IF;
    IF octet_length(p_body) > v_limits.max_body_bytes THEN
        RAISE EXCEPTION 'enqueue: body is % bytes; the limit is % bytes',
            octet_length(p_body), v_limits.max_body_bytes
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'The limit is settings.max_body_bytes in the outbox schema.';
    END IF;
    IF p_ordering_key = '' OR octet_length(p_ordering_key) > 255 THEN
        RAISE EXCEPTION 'enqueue: ordering_key must be 1 to 255 bytes, or NULL for no ordering'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF v_due = 'infinity' THEN
        RAISE EXCEPTION 'enqueue: available_at must be a finite time'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    IF jsonb_typeof(v_headers) <> 'object' THEN
        RAISE EXCEPTION 'enqueue: headers must be a JSON object, not %', jsonb_typeof(v_headers)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(v_headers::text) > v_limits.max_header_bytes THEN
        RAISE EXCEPTION 'enqueue: headers are % bytes as JSON; the limit is % bytes',
            octet_length(v_headers::text), v_limits.max_header_bytes
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'The limit is settings.max_header_bytes in the outbox schema.';
    END IF;
    FOR v_key IN SELECT jsonb_object_keys(v_headers) LOOP
        IF v_key LIKE 'x-outbox-%' THEN
            RAISE EXCEPTION 'enqueue: header "%" uses the reserved prefix x-outbox-', v_key
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(v_key) > 128 THEN
            RAISE EXCEPTION 'enqueue: a header name is % bytes long; AMQP allows at most 128',
                octet_length(v_key) USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;

    IF jsonb_typeof(v_properties) <> 'object' THEN
        RAISE EXCEPTION 'enqueue: properties must be a JSON object, not %', jsonb_typeof(v_properties)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR v_key, v_value IN SELECT key, value FROM jsonb_each(v_properties) LOOP
        CASE
            WHEN v_key IN ('content_type', 'content_encoding', 'correlation_id', 'reply_to',
                           'type', 'user_id', 'app_id') THEN
                IF jsonb_typeof(v_value) <> 'string' OR octet_length(v_value #>> '{}') > 255 THEN
                    RAISE EXCEPTION 'enqueue: property % must be a string of at most 255 bytes', v_key
                        USING ERRCODE = 'invalid_parameter_value';
                END IF;
            WHEN v_key = 'delivery_mode' THEN
                IF v_value NOT IN ('1'::jsonb, '2'::jsonb) THEN
                    RAISE EXCEPTION 'enqueue: property delivery_mode must be 1 (transient) or 2 (persistent)'
                        USING ERRCODE = 'invalid_parameter_value';
                END IF;
            WHEN v_key = 'priority' THEN
                IF jsonb_typeof(v_value) <> 'number' OR v_value::text !~ '^\d+$'
                   OR v_value::text::numeric > 255 THEN
                    RAISE EXCEPTION 'enqueue: property priority must be an integer from 0 to 255'
                        USING ERRCODE = 'invalid_parameter_value';
                END IF;
            WHEN v_key = 'expiration' THEN
                IF jsonb_typeof(v_value) NOT IN ('number', 'string') OR (v_value #>> '{}') !~ '^\d{1,10}$' THEN
                    RAISE EXCEPTION 'enqueue: property expiration must be a whole number of milliseconds'
                        USING ERRCODE = 'invalid_parameter_value';
                END IF;
            WHEN v_key IN ('message_id', 'timestamp') THEN
                RAISE EXCEPTION 'enqueue: property % is set by the relay', v_key
                    USING ERRCODE = 'invalid_parameter_value',
                          HINT = 'Pass your own id as the message_id argument.';
            ELSE
                RAISE EXCEPTION 'enqueue: unknown AMQP property "%"', v_key
                    USING ERRCODE = 'invalid_parameter_value',
                          HINT = 'Known: content_type, content_encoding, delivery_mode, priority, '
                                 'correlation_id, reply_to, expiration, type, user_id, app_id.';
        END CASE;
    END LOOP;
    IF NOT v_properties ? 'content_type' THEN
        v_properties := v_properties || jsonb_build_object('content_type', p_default_content_type);
    END IF;

    BEGIN
        INSERT INTO messages (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, created_at, available_at)
        VALUES (v_message_id, p_exchange, p_routing_key, p_body, v_headers, v_properties,
                p_ordering_key, v_now, v_due);
    EXCEPTION WHEN unique_violation THEN
        RAISE EXCEPTION 'enqueue: message_id % is already in the outbox', v_message_id
            USING ERRCODE = 'unique_violation';
    END;

    -- Wake the relays. PostgreSQL folds identical notifications of one transaction into one, so a
    -- transaction that enqueues a thousand rows sends a single wake-up, at commit (never on rollback).
    -- A scheduled row wakes nobody: the relays' polling finds it when it is due.
    IF v_due <= v_now THEN
        PERFORM pg_notify(current_schema() || '_new', '');
    END IF;
    RETURN v_message_id;
END;
$$;

CREATE FUNCTION enqueue(
    exchange     text,
    routing_key  text,
    body         bytea,
    headers      jsonb       DEFAULT '{}',
    properties   jsonb       DEFAULT '{}',
    available_at timestamptz DEFAULT NULL,
    ordering_key text        DEFAULT NULL,
    message_id   uuid        DEFAULT NULL
) RETURNS uuid
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT _enqueue($1, $2, $3, $4, $5, $6, $7, $8, 'application/octet-stream')
$$;

COMMENT ON FUNCTION enqueue(text, text, bytea, jsonb, jsonb, timestamptz, text, uuid) IS
    'Queue one AMQP message in the current transaction; returns its message_id.';

CREATE FUNCTION enqueue_json(
    exchange     text,
    routing_key  text,
    body         jsonb,
    headers      jsonb       DEFAULT '{}',
    properties   jsonb       DEFAULT '{}',
    available_at timestamptz DEFAULT NULL,
    ordering_key text        DEFAULT NULL,
    message_id   uuid        DEFAULT NULL
) RETURNS uuid
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    SELECT _enqueue($1, $2, convert_to($3::text, 'UTF8'), $4, $5, $6, $7, $8, 'application/json')
$$;

COMMENT ON FUNCTION enqueue_json(text, text, jsonb, jsonb, jsonb, timestamptz, text, uuid) IS
    'Queue one AMQP message with a JSON body (content type application/json); returns its message_id.';
