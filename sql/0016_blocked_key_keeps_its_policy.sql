-- 0016: a blocked key keeps its concurrency until it is released. A key with no message waiting
-- took a changed policy at its next enqueue — even when it was blocked by its dead head. That head
-- comes back by a replay (replay_dead, or release_key with replay) with its old seq, and the gate
-- of the messages enqueued meanwhile had been decided with the new concurrency: with 2 lanes
-- turned into 1, a#5 looked for its predecessor at a#4 (archived) instead of a#3 (the blocked
-- head), and was sent before the replayed a#3. Found by the interleaving test once it could hold a
-- claim open (tests/interleavings/test_named_cases.py,
-- test_a_blocked_key_keeps_its_concurrency_until_released). A blocked key is not idle: the policy
-- applies once it is released and nothing of it waits.
--
-- Each decision reads the messages and the block in one statement, as 0014 did: under READ
-- COMMITTED every statement has its own snapshot, and a relay dead-lettering the key's head
-- deletes the head and inserts the block in one transaction — one statement sees one or the
-- other, two statements could see neither (the head gone, the block not yet there).
--
-- Upgrading: only the producers' _key_next changes; relays of either version are unaffected.

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
    -- Idle key (nothing waits, nothing blocks it — one statement, one snapshot): a changed
    -- policy applies from now on.
    IF v_key.last_seq > 1
       AND NOT EXISTS (SELECT 1 FROM messages m WHERE m.ordering_key = p_key)
       AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = p_key) THEN
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
