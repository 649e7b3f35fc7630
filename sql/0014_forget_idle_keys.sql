-- 0014: forget ordering keys nobody uses any more. `keys` (and `key_releases`, for rate-limited
-- keys) gained a row per key ever used, and per-order keys are what the README recommends: they
-- grew without bound. A key whose row nobody has written for p_idle_for, with no message waiting
-- and no block, is forgotten; if it is used again, its numbering starts at 1 again (consumers see
-- x-outbox-sequence 1 after a long silence: relay.consumer.SequenceChecker reports a "restart").
--
-- One call looks at up to p_limit keys after p_after, in key order (the primary key), so a pass
-- over millions of keys is many short transactions that never scan the table; it returns how many
-- it forgot and the last key it looked at (NULL: the pass is over). Keys a producer or an operator
-- holds right now are skipped, not waited for: they are not idle.
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
    IF p_idle_for IS NULL OR p_idle_for <= interval '0' THEN
        RAISE EXCEPTION 'forget_idle_keys: p_idle_for must be a positive interval, not %', p_idle_for
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
          AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = k.ordering_key)
        RETURNING k.ordering_key
    ), paced AS (
        DELETE FROM key_releases r USING gone WHERE r.ordering_key = gone.ordering_key
    )
    SELECT count(*) INTO forgotten FROM gone;
END;
$$;
