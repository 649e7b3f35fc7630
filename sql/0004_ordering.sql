-- 0004: ordering keys. Messages of one key are released in commit order, one at a time (or up to
-- a key's concurrency), each numbered 1, 2, 3… within its key with no gaps.
--
-- How commit order is obtained: enqueue takes the key's row in `keys` (an upsert) and holds its
-- lock until the transaction ends, so producers of one key are serialised and each draws the next
-- sequence number only after the previous holder committed or rolled back. Sequence order is
-- therefore commit order, and a rollback returns its number. The price: a producer of a key waits
-- for any open transaction that enqueued to the same key (keep such transactions short, and
-- enqueue to several keys in a consistent order to avoid deadlocks).
--
-- How the relay keeps order: a keyed row is *gated* (invisible to claims) while the row
-- `concurrency` places before it is still waiting or in flight. Settling a row releases the one
-- `concurrency` places after it, in the same transaction. A commit-time trigger closes the one
-- race: a producer that saw its predecessor pending while a relay was settling it.

-- What happens to a key when one of its messages is dead-lettered, and how fast it may flow.
-- The longest matching prefix wins; '' matches every key.
CREATE TABLE key_policies (
    prefix       text PRIMARY KEY,
    on_dead      text     NOT NULL DEFAULT 'block' CHECK (on_dead IN ('block', 'skip')),
    concurrency  integer  NOT NULL DEFAULT 1 CHECK (concurrency BETWEEN 1 AND 1000),
    min_interval interval NOT NULL DEFAULT '0' CHECK (min_interval >= '0')
);
INSERT INTO key_policies (prefix) VALUES ('');

-- One row per key ever used: the producers' lock and counter. concurrency and min_interval are
-- taken from the policy whenever the key is idle, so a change applies once its backlog drains.
CREATE TABLE keys (
    ordering_key text PRIMARY KEY,
    last_seq     bigint   NOT NULL,
    concurrency  integer  NOT NULL,
    min_interval interval NOT NULL,
    released_at  timestamptz  -- when the producers last made a message of this key due
);

-- When relays last settled a message of a rate-limited key (written by relays only, so producers
-- never wait for a relay and the reverse). The next message is due min_interval after it.
CREATE TABLE key_releases (
    ordering_key text PRIMARY KEY,
    settled_at   timestamptz NOT NULL
);

-- Keys held by the 'block' policy: their next messages wait until an operator releases the key.
CREATE TABLE blocked_keys (
    ordering_key text PRIMARY KEY,
    message_id   uuid        NOT NULL,
    seq          bigint      NOT NULL,
    reason       text        NOT NULL,
    blocked_at   timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE messages ADD COLUMN seq bigint, ADD COLUMN gated boolean NOT NULL DEFAULT false;
ALTER TABLE archive ADD COLUMN seq bigint;
ALTER TABLE dead ADD COLUMN seq bigint;

CREATE UNIQUE INDEX messages_key_seq_idx ON messages (ordering_key, seq)
    WHERE ordering_key IS NOT NULL;
-- Claims read only rows that may go now: a hot key's backlog (gated) costs them nothing.
DROP INDEX messages_due_idx;
CREATE INDEX messages_due_idx ON messages (available_at, id) WHERE claim_id IS NULL AND NOT gated;

-- The policy for a key: its longest matching prefix.
CREATE FUNCTION key_policy(p_key text) RETURNS key_policies
LANGUAGE sql STABLE
SET search_path FROM CURRENT
AS $$
    SELECT * FROM key_policies
    WHERE left(p_key, length(prefix)) = prefix
    ORDER BY length(prefix) DESC
    LIMIT 1
$$;

-- Draw the next sequence number of a key (locking the key until commit) and decide whether the
-- new row must wait. Returns the sequence number, whether the row is gated, and the earliest time
-- it may be released (later than p_due when the key is rate-limited).
CREATE FUNCTION _key_next(p_key text, p_due timestamptz, OUT seq bigint, OUT gated boolean,
                          OUT due timestamptz)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_policy key_policies := key_policy(p_key);
    v_key    keys%ROWTYPE;
BEGIN
    INSERT INTO keys AS k (ordering_key, last_seq, concurrency, min_interval)
    VALUES (p_key, 1, v_policy.concurrency, v_policy.min_interval)
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = k.last_seq + 1
    RETURNING * INTO v_key;
    IF v_key.last_seq > 1 AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.ordering_key = p_key)
    THEN
        -- Idle key: a changed policy applies from now on.
        UPDATE keys SET concurrency = v_policy.concurrency, min_interval = v_policy.min_interval
        WHERE ordering_key = p_key
        RETURNING * INTO v_key;
    END IF;
    seq := v_key.last_seq;
    gated := EXISTS (SELECT 1 FROM messages m
                     WHERE m.ordering_key = p_key AND m.seq = v_key.last_seq - v_key.concurrency)
             OR EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = p_key);
    due := p_due;
    IF NOT gated AND v_key.min_interval > '0' THEN
        due := greatest(p_due, v_key.released_at + v_key.min_interval,
                        (SELECT r.settled_at + v_key.min_interval FROM key_releases r
                         WHERE r.ordering_key = p_key));
        UPDATE keys SET released_at = due WHERE ordering_key = p_key;
    END IF;
END;
$$;

-- At commit, a gated row whose predecessor has meanwhile been settled releases itself. The
-- FOR KEY SHARE waits for a relay that is deleting the predecessor right now, and then sees it gone.
CREATE FUNCTION _key_gate_at_commit() RETURNS trigger
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_concurrency integer;
    v_interval    interval;
BEGIN
    -- A row inserted behind enqueue's back may have no `keys` row: treat it as one at a time.
    SELECT coalesce(max(k.concurrency), 1), coalesce(max(k.min_interval), '0')
    INTO v_concurrency, v_interval
    FROM keys k WHERE k.ordering_key = NEW.ordering_key;
    PERFORM 1 FROM messages m
    WHERE m.ordering_key = NEW.ordering_key AND m.seq = NEW.seq - v_concurrency
    FOR KEY SHARE;
    IF NOT FOUND AND NOT EXISTS (SELECT 1 FROM blocked_keys b
                                 WHERE b.ordering_key = NEW.ordering_key) THEN
        UPDATE messages m
        SET gated = false,
            available_at = greatest(m.available_at,
                                    (SELECT r.settled_at + v_interval FROM key_releases r
                                     WHERE r.ordering_key = NEW.ordering_key))
        WHERE m.id = NEW.id AND m.gated;
        PERFORM pg_notify(current_schema() || '_new', '');
    END IF;
    RETURN NULL;
END;
$$;

CREATE CONSTRAINT TRIGGER messages_key_gate
    AFTER INSERT ON messages
    DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW WHEN (NEW.gated)
    EXECUTE FUNCTION _key_gate_at_commit();

-- Relays call this in the transaction that settles keyed rows (archived, or dead-lettered with
-- p_reasons set): each key either releases its next row, or, by its policy, is blocked. Returns how
-- many rows it released (the caller should claim again at once) and how many keys it blocked.
CREATE FUNCTION _keys_settled(p_keys text[], p_seqs bigint[], p_reasons text[],
                              p_message_ids uuid[], OUT released integer, OUT blocked integer)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row record;
    v_n   integer;
BEGIN
    released := 0;
    blocked := 0;
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

-- An operator lets a blocked key go on: with p_replay its dead message goes back in its place
-- (first, with its own sequence number), otherwise the key skips it and its next message goes.
-- Takes the key's lock, so no producer is mid-enqueue while the gates are reopened.
CREATE FUNCTION release_key(p_key text, p_replay boolean DEFAULT false) RETURNS boolean
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_block blocked_keys%ROWTYPE;
    v_key   keys%ROWTYPE;
BEGIN
    SELECT * INTO v_key FROM keys WHERE ordering_key = p_key FOR UPDATE;
    v_key.concurrency := coalesce(v_key.concurrency, 1);
    DELETE FROM blocked_keys WHERE ordering_key = p_key RETURNING * INTO v_block;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF p_replay THEN
        WITH revived AS (
            DELETE FROM dead WHERE message_id = v_block.message_id
            RETURNING message_id, exchange, routing_key, body, headers, properties, ordering_key,
                      seq, created_at
        )
        INSERT INTO messages (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, seq, created_at, available_at)
        SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key,
               seq, created_at, now()
        FROM revived;
        IF FOUND THEN
            PERFORM pg_notify(current_schema() || '_new', '');
            RETURN true;  -- its successors stay gated behind it, as before it died
        END IF;
    END IF;
    -- Skip the dead message: release every row whose gate is no longer pending.
    UPDATE messages m
    SET gated = false
    WHERE m.ordering_key = p_key AND m.gated
      AND NOT EXISTS (SELECT 1 FROM messages p
                      WHERE p.ordering_key = p_key AND p.seq = m.seq - v_key.concurrency);
    PERFORM pg_notify(current_schema() || '_new', '');
    RETURN true;
END;
$$;

-- enqueue's argument checks, in a function of their own so that later changes to enqueue need
-- not restate them. Raises SQLSTATE 22023 naming the argument; returns nothing.
CREATE FUNCTION _check_message(
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
    IF p_due = 'infinity' THEN
        RAISE EXCEPTION 'enqueue: available_at must be a finite time'
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

-- enqueue, now numbering keyed messages.
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

    BEGIN
        INSERT INTO messages (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, seq, gated, created_at, available_at)
        VALUES (v_message_id, p_exchange, p_routing_key, p_body, v_headers, v_properties,
                p_ordering_key, v_seq, v_gated, v_now, v_due);
    EXCEPTION WHEN unique_violation THEN
        RAISE EXCEPTION 'enqueue: message_id % is already in the outbox', v_message_id
            USING ERRCODE = 'unique_violation';
    END;

    -- Wake the relays. PostgreSQL folds identical notifications of one transaction into one, so a
    -- transaction that enqueues a thousand rows sends a single wake-up, at commit (never on rollback).
    -- A scheduled or gated row wakes nobody: polling, or the settle of its predecessor, frees it.
    IF v_due <= v_now AND NOT v_gated THEN
        PERFORM pg_notify(current_schema() || '_new', '');
    END IF;
    RETURN v_message_id;
END;
$$;
