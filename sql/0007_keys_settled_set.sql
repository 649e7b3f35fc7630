-- 0007: settling keyed rows in one statement. The relay calls _keys_settled once per batch; the
-- row-by-row loop of 0004 ran one UPDATE per key, which made the settle of a batch spread over
-- many keys about twice as slow as a batch without keys. When none of the settled rows was
-- dead-lettered (the common case), nothing can block a key in this call, so every key's next row
-- is released by one UPDATE. Dead letters keep the loop: a key blocked by one row must stop the
-- release of its later rows in the same call, in order.

CREATE OR REPLACE FUNCTION _keys_settled(p_keys text[], p_seqs bigint[], p_reasons text[],
                                         p_message_ids uuid[], OUT released integer,
                                         OUT blocked integer)
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row record;
    v_n   integer;
BEGIN
    released := 0;
    blocked := 0;
    IF NOT EXISTS (SELECT 1 FROM unnest(p_reasons) AS r(reason) WHERE r.reason IS NOT NULL) THEN
        WITH settled AS (
            SELECT s.ordering_key, s.seq, coalesce(k.concurrency, 1) AS concurrency,
                   coalesce(k.min_interval, '0') AS min_interval
            FROM unnest(p_keys, p_seqs) AS s(ordering_key, seq)
            LEFT JOIN keys k USING (ordering_key)
            WHERE s.seq IS NOT NULL
        ), paced AS (
            INSERT INTO key_releases AS r (ordering_key, settled_at)
            SELECT DISTINCT ordering_key, now() FROM settled WHERE min_interval > '0'
            ON CONFLICT (ordering_key) DO UPDATE SET settled_at = excluded.settled_at
        ), freed AS (
            UPDATE messages m
            SET gated = false,
                available_at = greatest(m.available_at, now() + s.min_interval)
            FROM settled s
            WHERE m.ordering_key = s.ordering_key
              AND m.seq = s.seq + s.concurrency
              AND m.gated
              AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = s.ordering_key)
            RETURNING 1
        )
        SELECT count(*) INTO released FROM freed;
        RETURN;
    END IF;
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
