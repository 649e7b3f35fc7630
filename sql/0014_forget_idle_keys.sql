-- 0014: forget ordering keys nobody uses any more. `keys` (and `key_releases`, for rate-limited
-- keys) gained a row per key ever used, and per-order keys are what the README recommends: they
-- grew without bound. A key whose row nobody has written for p_idle_for (an hour at least), with
-- no message waiting, none in dead (a replay puts it back in its place: it needs the numbering)
-- and no block, is forgotten; if it is used again, its numbering starts at 1 again (consumers see
-- x-outbox-sequence 1 after a long silence: relay.consumer.SequenceChecker reports a "restart").
--
-- An older snapshot cannot tell a forgotten key's new row from its old one, so a REPEATABLE READ
-- producer whose snapshot still sees the key blocked when its enqueue makes the key's row anew
-- gets a serialization failure (see _key_next below), as for any change to the key since.
--
-- One call looks at up to p_limit keys after p_after, in key order (the primary key), so a pass
-- over millions of keys is many short transactions that never scan the table; it returns how many
-- it forgot and the last key it looked at (NULL: the pass is over). Keys a producer or an operator
-- holds right now are skipped, not waited for: they are not idle.
-- Finding a key's dead rows reads this index, not the table. Building it holds writes to dead
-- (dead letters) back for as long as it takes; give up after ten seconds if it cannot start.
SET LOCAL lock_timeout = '10s';
CREATE INDEX dead_ordering_key_idx ON dead (ordering_key) WHERE ordering_key IS NOT NULL;

CREATE FUNCTION forget_idle_keys(p_idle_for interval, p_after text, p_limit integer,
                                 OUT forgotten integer, OUT last_key text)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_keys text[];
BEGIN
    PERFORM _read_committed('forget_idle_keys');
    IF p_idle_for IS NULL OR p_idle_for < interval '1 hour' THEN
        RAISE EXCEPTION 'forget_idle_keys: p_idle_for must be an hour or more, not %', p_idle_for
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    forgotten := 0;
    SELECT max(ordering_key) INTO last_key
    FROM (SELECT ordering_key FROM keys WHERE ordering_key > coalesce(p_after, '')
          ORDER BY ordering_key LIMIT greatest(p_limit, 1)) AS page;
    IF last_key IS NULL THEN
        RETURN;
    END IF;
    -- Lock the idle ones: from here on no producer or operator can add a message to them.
    SELECT array_agg(ordering_key) INTO v_keys
    FROM (SELECT ordering_key FROM keys
          WHERE ordering_key > coalesce(p_after, '') AND ordering_key <= last_key
            AND touched_at < now() - p_idle_for
          FOR UPDATE SKIP LOCKED) AS idle;
    IF v_keys IS NULL THEN
        RETURN;
    END IF;
    WITH gone AS (
        DELETE FROM keys k
        WHERE k.ordering_key = ANY(v_keys)
          AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.ordering_key = k.ordering_key)
          AND NOT EXISTS (SELECT 1 FROM dead d WHERE d.ordering_key = k.ordering_key)
          AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = k.ordering_key)
        RETURNING k.ordering_key
    ), paced AS (
        DELETE FROM key_releases r USING gone WHERE r.ordering_key = gone.ordering_key
    )
    SELECT count(*) INTO forgotten FROM gone;
END;
$$;

-- _key_next as in 0012, and: a key row made anew (last_seq 1) while this snapshot still sees the
-- key blocked means the key was released and forgotten since the snapshot; at REPEATABLE READ and
-- SERIALIZABLE that is a serialization failure (retry), never a message gated behind a block gone.
CREATE OR REPLACE FUNCTION _key_next(p_key text, p_due timestamptz, OUT seq bigint, OUT gated boolean,
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
    ON CONFLICT (ordering_key) DO UPDATE SET last_seq = k.last_seq + 1, touched_at = now()
    RETURNING * INTO v_key;
    IF v_key.last_seq = 1 AND current_setting('transaction_isolation') <> 'read committed'
       AND EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = p_key) THEN
        RAISE EXCEPTION 'enqueue: ordering key % changed since this transaction''s snapshot', p_key
            USING ERRCODE = 'serialization_failure', HINT = 'Retry the transaction.';
    END IF;
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
