-- 0012: the key gate without waits, and without stale snapshots (docs/decisions/0002).
--
-- Three orders of events broke the gate of 0004:
-- * A producer's commit took FOR KEY SHARE on each predecessor, one after another, and so waited
--   for a relay deleting one of them; with two keys in one transaction, taken in the other order
--   by the relay's statement, PostgreSQL aborted one of the two: sometimes the producer's
--   business transaction. Now the commit never waits: SKIP LOCKED, and when a predecessor is
--   being settled at that moment, the row asks the relays to look at it again (key_checks) once
--   both transactions are over.
-- * A producer in REPEATABLE READ (or SERIALIZABLE) decides its gate on its snapshot. An
--   operator's release or replay only locked the key's row, so a producer whose snapshot was older
--   committed its message gated behind a block it could not see lifted: stranded for good. Now
--   release_key and replay_dead write a new version of the key's row, so such a producer fails its
--   enqueue with a serialization failure (40001): retry the transaction, as those levels require.
--   And its commit-time check no longer locks the predecessor (which failed with 40001 whenever a
--   relay had claimed it meanwhile): it queues a recheck instead.
-- * A relay settling a key's message and an operator releasing the key, both in flight, each
--   decided on what the other had not committed (write skew), and a later message stayed gated.
--   Now the settle locks the key's block FOR KEY SHARE before deciding, so the release (which
--   deletes it) waits for the settle to commit, or the settle for the release.

-- When a producer or an operator last wrote the key. Writing it is also what makes an older
-- snapshot's enqueue fail (above), and what 0014 uses to find keys nobody uses any more.
-- A new column with a constant default is a catalog change, but it needs a moment of exclusive
-- lock on keys: give up after ten seconds rather than queue producers behind it (run it again).
SET LOCAL lock_timeout = '10s';
ALTER TABLE keys ADD COLUMN touched_at timestamptz NOT NULL DEFAULT now();

-- Gated rows a relay must look at again: their producer committed while the predecessor was being
-- settled (or, at REPEATABLE READ and above, could not know). No unique index, so inserting never
-- waits for anyone; relays delete what they have looked at (release_stranded).
CREATE TABLE key_checks (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    ordering_key text   NOT NULL,
    seq          bigint NOT NULL
);

-- Functions whose decisions rest on what each statement sees committed refuse older snapshots.
CREATE FUNCTION _read_committed(p_what text) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION '%: run it in a READ COMMITTED transaction, not %', p_what,
            upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Ordering keys are released on what is committed when each statement '
                         'runs; an older snapshot could leave a message gated for good.';
    END IF;
END;
$$;

-- A producer's upsert of the key now also stamps touched_at (see above).
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

-- At commit, a gated row whose predecessor has meanwhile been settled releases itself — without
-- ever waiting for the relay settling it.
--   READ COMMITTED: if the predecessor is there and nobody is changing it, hold it (FOR KEY SHARE)
--   until this commit is over: a relay's settle of it then waits for this commit (a moment) and
--   sees this row. If it is there but locked (being settled or claimed right now), do not wait:
--   queue a recheck. If it is gone, release this row now (unless the key is blocked: the
--   operator's release, which waits for this transaction's lock on the key, will).
--   REPEATABLE READ and SERIALIZABLE: the snapshot may be older than the predecessor's settle, and
--   locking a row changed since the snapshot fails; so a row that looks gated queues a recheck.
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
        PERFORM pg_notify(current_schema() || '_new', '');
    END IF;
    RETURN NULL;
END;
$$;

-- Relays call this in the transaction that settles keyed rows. It now first locks the blocks of
-- the settled keys that exist (FOR KEY SHARE): an operator's release in flight is waited for and
-- then seen, and a release that starts later waits for this transaction and then sees the settle.
-- It runs as the owner: relays of the previous release call it with their own rights during a
-- rolling upgrade, and a row lock needs a right on blocked_keys their role never had.
CREATE OR REPLACE FUNCTION _keys_settled(p_keys text[], p_seqs bigint[], p_reasons text[],
                                         p_message_ids uuid[], OUT released integer,
                                         OUT blocked integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row record;
    v_n   integer;
BEGIN
    released := 0;
    blocked := 0;
    PERFORM 1 FROM blocked_keys b
    WHERE b.ordering_key = ANY(p_keys)
    ORDER BY b.ordering_key
    FOR KEY SHARE;
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

-- The relays' side of key_checks: each queued row that is still gated, whose predecessor is gone
-- and whose key is not blocked, goes. Looks at up to p_limit checks; returns how many it looked
-- at (fewer than p_limit: the queue is empty) and how many rows it released.
CREATE FUNCTION release_stranded(p_limit integer, OUT looked integer, OUT released integer)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_keys text[];
    v_seqs bigint[];
BEGIN
    PERFORM _read_committed('release_stranded');
    released := 0;
    WITH looked AS (
        DELETE FROM key_checks
        WHERE id IN (SELECT id FROM key_checks ORDER BY id LIMIT p_limit FOR UPDATE SKIP LOCKED)
        RETURNING ordering_key, seq
    )
    SELECT count(*), array_agg(ordering_key), array_agg(seq) INTO looked, v_keys, v_seqs
    FROM looked;
    IF looked = 0 THEN
        RETURN;
    END IF;
    -- A check was queued because its predecessor was locked (being settled or claimed) or could
    -- not be judged at all: decide on what that transaction did, not on what it has not committed
    -- yet. FOR KEY SHARE waits for a settle deleting the predecessor (a relay waiting a moment for
    -- a relay; producers never wait here), and then finds it gone.
    PERFORM 1
    FROM (SELECT DISTINCT s.ordering_key, s.seq - coalesce(k.concurrency, 1) AS seq
          FROM unnest(v_keys, v_seqs) AS s(ordering_key, seq)
          LEFT JOIN keys k USING (ordering_key)) AS c
    JOIN messages p ON p.ordering_key = c.ordering_key AND p.seq = c.seq
    ORDER BY p.id  -- the order a settle's DELETE takes them in: no deadlock between the two
    FOR KEY SHARE OF p;
    PERFORM 1 FROM blocked_keys b
    WHERE b.ordering_key = ANY(v_keys)
    ORDER BY b.ordering_key
    FOR KEY SHARE;
    UPDATE messages m
    SET gated = false,
        available_at = greatest(m.available_at,
                                (SELECT r.settled_at + c.min_interval FROM key_releases r
                                 WHERE r.ordering_key = c.ordering_key))
    FROM (SELECT DISTINCT s.ordering_key, s.seq, coalesce(k.concurrency, 1) AS concurrency,
                 coalesce(k.min_interval, '0') AS min_interval
          FROM unnest(v_keys, v_seqs) AS s(ordering_key, seq)
          LEFT JOIN keys k USING (ordering_key)) AS c
    WHERE m.ordering_key = c.ordering_key AND m.seq = c.seq AND m.gated
      AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = c.ordering_key)
      AND NOT EXISTS (SELECT 1 FROM messages p
                      WHERE p.ordering_key = c.ordering_key AND p.seq = c.seq - c.concurrency);
    GET DIAGNOSTICS released = ROW_COUNT;
    IF released > 0 THEN
        PERFORM pg_notify(current_schema() || '_new', '');
    END IF;
END;
$$;

-- An operator lets a blocked key go on. As before, plus: the key's row gets a new version (see the
-- top), and older snapshots are refused.
CREATE OR REPLACE FUNCTION release_key(p_key text, p_replay boolean DEFAULT false) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_block       blocked_keys%ROWTYPE;
    v_concurrency integer;
BEGIN
    PERFORM _read_committed('release_key');
    UPDATE keys SET touched_at = now() WHERE ordering_key = p_key;
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

-- replay_dead as in 0006, with the same two changes as release_key.
CREATE OR REPLACE FUNCTION replay_dead(p_ids bigint[], p_exchange text DEFAULT NULL,
                                       p_routing_key text DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_row         dead%ROWTYPE;
    v_gated       boolean;
    v_concurrency integer;
    v_keys        text[] := '{}';
BEGIN
    PERFORM _read_committed('replay_dead');
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
            -- The key's lock, and a new version of its row: no producer is mid-enqueue while
            -- its gates are decided, and none with an older snapshot can commit after.
            UPDATE keys k SET touched_at = now() WHERE k.ordering_key = v_row.ordering_key;
            SELECT coalesce(max(k.concurrency), 1) INTO v_concurrency
            FROM keys k WHERE k.ordering_key = v_row.ordering_key;
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
