-- 0023: producers wake a relay only when one sleeps (docs/decisions/0008).
--
-- Every enqueue sent a NOTIFY. PostgreSQL serialises the commits of all transactions that notify,
-- across the whole server: from the notification's queueing to the end of the commit, WAL flush
-- included, each holds one global lock. The producers' commit rate was capped by it — 5,600
-- inserts/s became 3,000 with a NOTIFY each (8 pgbench clients), fewer with more clients, and
-- 880/s beside a busy relay on two cores, where 2,000/s were offered.
--
-- A relay needs the wake-up only when it is about to sleep; a relay that is busy claims again at
-- once. So a relay that finds nothing to do arms a doorbell first: it takes SHARE on the view
-- `doorbell`, which shows nothing (arm_doorbell), holds it in an open transaction — no xid, no
-- snapshot: it pins nothing — while it sleeps, and looks once more for work before sleeping. A
-- producer's enqueue tries ROW EXCLUSIVE on `doorbell`, NOWAIT (_ring): the two modes conflict.
-- A view, not a table: VACUUM, ANALYZE and autovacuum (which would wait for SHARE to go) pass
-- views by, and LOCK treats a view as it does a table.
--
--   * It gets the lock: no relay sleeps, nor is arming. It notifies nobody. It holds the lock to
--     its commit, so a relay that arms from now on waits for that commit before its last look,
--     which therefore sees the row.
--   * It does not (a relay holds the doorbell, or waits for it): it notifies, as before.
--
-- Relays share the doorbell (SHARE does not conflict with itself); producers share it too (ROW
-- EXCLUSIVE neither). A relay that dies lets go with its session. Nothing else locks the view.
--
-- Upgrading: settings.doorbell (false) keeps every producer notifying until the first relay of
-- this version turns it on (use_doorbell, when its doorbell connects). Relays of the previous
-- version never arm: once it is on, they are woken by a producer only while a relay of this
-- version sleeps, and otherwise by their poll (poll_interval, 1 s by default) — a delay while
-- versions are mixed, never a loss. `migrate` grants the new functions to the relay role.

SET LOCAL lock_timeout = '10s';

CREATE VIEW doorbell AS SELECT 1 AS never WHERE false;
COMMENT ON VIEW doorbell IS
    'Never shows a row: relays that sleep hold SHARE on it, producers try ROW EXCLUSIVE (0023).';

ALTER TABLE settings ADD COLUMN doorbell boolean NOT NULL DEFAULT false;

-- Wake a relay that sleeps, from a producer's transaction: NOTIFY only if a relay holds or waits
-- for the doorbell; otherwise hold ROW EXCLUSIVE on it until commit, which makes any relay that
-- arms from now on wait for this transaction before its last look. Called once per row; after
-- the first call of a transaction the lock is this transaction's and the second try is local.
CREATE FUNCTION _ring() RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    IF (SELECT s.doorbell FROM settings s) THEN
        BEGIN
            LOCK TABLE doorbell IN ROW EXCLUSIVE MODE NOWAIT;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- a relay sleeps, or is about to
        END;
    END IF;
    -- PostgreSQL folds identical notifications of one transaction into one, sent at commit
    -- (never on rollback).
    PERFORM pg_notify(current_schema() || '_new', '');
END;
$$;

-- A relay about to sleep: SHARE on the doorbell, waiting for every producer that holds it (their
-- rows are committed, or rolled back, once this returns). The caller holds it in an open READ
-- COMMITTED transaction for as long as it sleeps, and commits to let go.
CREATE FUNCTION arm_doorbell() RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'arm_doorbell: run it in a READ COMMITTED transaction, not %',
            upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'The transaction stays open while the relay sleeps: a snapshot held that '
                         'long would pin the vacuum horizon.';
    END IF;
    LOCK TABLE doorbell IN SHARE MODE;
END;
$$;

-- A relay of this version calls this when its doorbell connects: from then on producers notify
-- only while a relay sleeps.
CREATE FUNCTION use_doorbell() RETURNS void
LANGUAGE sql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
    UPDATE settings SET doorbell = true WHERE NOT doorbell
$$;

-- 0015's, ringing instead of notifying.
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
        PERFORM _ring();
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

    -- Wake a relay that sleeps (_ring). A scheduled or gated row wakes nobody: polling, or the
    -- settle of its predecessor, frees it.
    IF v_due <= v_now AND NOT v_gated THEN
        PERFORM _ring();
    END IF;
    RETURN v_message_id;
END;
$$;

-- 0012's key gate at commit, ringing instead of notifying when it releases the row.
CREATE OR REPLACE FUNCTION _key_gate_at_commit() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_concurrency integer;
    v_interval    interval;
    v_recheck     boolean := false;
BEGIN
    -- A row inserted behind enqueue's back may have no `keys` row: treat it as one at a time.
    SELECT coalesce(max(k.concurrency), 1), coalesce(max(k.min_interval), '0')
    INTO v_concurrency, v_interval
    FROM keys k WHERE k.ordering_key = NEW.ordering_key;
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM messages m
        WHERE m.ordering_key = NEW.ordering_key AND m.seq = NEW.seq - v_concurrency
        FOR KEY SHARE SKIP LOCKED;
        IF FOUND THEN
            RETURN NULL;  -- still waiting; its settle will release this row
        END IF;
    END IF;
    v_recheck := EXISTS (SELECT 1 FROM messages m
                         WHERE m.ordering_key = NEW.ordering_key
                           AND m.seq = NEW.seq - v_concurrency);
    IF v_recheck THEN
        INSERT INTO key_checks (ordering_key, seq) VALUES (NEW.ordering_key, NEW.seq);
        -- The payload tells relays to look at key_checks now (they also do, twice a lease).
        PERFORM pg_notify(current_schema() || '_new', 'recheck');
    ELSIF NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = NEW.ordering_key) THEN
        UPDATE messages m
        SET gated = false,
            available_at = greatest(m.available_at,
                                    (SELECT r.settled_at + v_interval FROM key_releases r
                                     WHERE r.ordering_key = NEW.ordering_key))
        WHERE m.id = NEW.id AND m.gated;
        PERFORM _ring();
    END IF;
    RETURN NULL;
END;
$$;
