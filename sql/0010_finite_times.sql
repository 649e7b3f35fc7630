-- 0010: times are finite. enqueue refused available_at => 'infinity' but took '-infinity', and a
-- row due since "minus infinity" broke every query that measures how long a row has waited (the
-- gauges, `stats`, `top`). Now enqueue refuses both, and so does the table itself.
--
-- Rows already stored with an infinite time become due at their creation (what '-infinity' meant:
-- due at once). The constraint is added NOT VALID here, so this transaction holds its lock on
-- messages only for the moment the catalog changes; 0011 validates it without blocking writes.
-- That moment needs every open transaction that wrote to messages to end first; rather than queue
-- every producer behind it meanwhile, the migration gives up after ten seconds (run it again).
SET LOCAL lock_timeout = '10s';

CREATE OR REPLACE FUNCTION _check_message(
    p_exchange     text,
    p_routing_key  text,
    p_body         bytea,
    p_headers      jsonb,
    p_properties   jsonb,
    p_due          timestamptz,
    p_ordering_key text
) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_limits settings%ROWTYPE;
    v_key    text;
    v_value  jsonb;
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
    IF NOT isfinite(p_due) THEN
        RAISE EXCEPTION 'enqueue: available_at must be a finite time, not %', p_due
            USING ERRCODE = 'invalid_parameter_value';
    END IF;

    IF jsonb_typeof(p_headers) <> 'object' THEN
        RAISE EXCEPTION 'enqueue: headers must be a JSON object, not %', jsonb_typeof(p_headers)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(p_headers::text) > v_limits.max_header_bytes THEN
        RAISE EXCEPTION 'enqueue: headers are % bytes as JSON; the limit is % bytes',
            octet_length(p_headers::text), v_limits.max_header_bytes
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'The limit is settings.max_header_bytes in the outbox schema.';
    END IF;
    FOR v_key IN SELECT jsonb_object_keys(p_headers) LOOP
        IF v_key LIKE 'x-outbox-%' THEN
            RAISE EXCEPTION 'enqueue: header "%" uses the reserved prefix x-outbox-', v_key
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF octet_length(v_key) > 128 THEN
            RAISE EXCEPTION 'enqueue: a header name is % bytes long; AMQP allows at most 128',
                octet_length(v_key) USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;

    IF jsonb_typeof(p_properties) <> 'object' THEN
        RAISE EXCEPTION 'enqueue: properties must be a JSON object, not %', jsonb_typeof(p_properties)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR v_key, v_value IN SELECT key, value FROM jsonb_each(p_properties) LOOP
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
END;
$$;

UPDATE messages SET available_at = created_at WHERE NOT isfinite(available_at);
ALTER TABLE messages
    ADD CONSTRAINT messages_available_at_finite CHECK (isfinite(available_at)) NOT VALID;
