-- 0026: one lane (docs/decisions/0004). Every message waits in `messages`, the table relays of
-- every version read; a claim commits before its rows travel; no relay statement waits on a row
-- lock but the settle's own rows; nothing the relay role may call leaves a lock a producer needs.
--
-- The claim starts where the relay's last one ended (its two cursors, in due rows and leases),
-- less a second for commits that became visible late, so a pinned vacuum horizon adds only the
-- dead rows of that second to each claim; a rescue beside the loop (`behind`, relay.sql) finds the
-- rare row left behind every cursor. Keyed rows a race left gated are rechecked in every claim. Expired leases come back through the same claim, first, so a
-- dead relay's rows wait for their lease and nothing else; one claimed more than once before is
-- claimed alone (a row that kills its relay takes only itself down), one out of attempts is moved
-- to dead unread.
--
-- 0027 moves what the ready lane of 0015 still holds into `messages` and drops it.
--
-- Upgrading: no table lock. Relays of 0.1 and 0.2 (migrations 0009 and 0014) keep working: their
-- own claim and lease statements read `messages` as before, and `settle` (12 arguments),
-- `bury_exhausted`, `release_stranded`, `_keys_settled` (4 arguments) and `forget_idle_keys`
-- keep their signatures (the first is now a wrapper of the new `settle`). Relays built from main
-- between 0015 and 0025 call functions 0027 drops: stop them before migrating (their leases run
-- out and their rows are claimed again; nothing is lost).

-- What a relay asks of a claim: one argument instead of the eleven to twenty-three positional
-- ones before.
CREATE TYPE claim_request AS (
    claim_id     uuid,
    claimed_by   text,
    lease        float8,       -- seconds, by the database's clock
    max_rows     integer,
    max_bytes    bigint,       -- bodies, headers and properties; the first row is always taken
    max_attempts integer,      -- an expired lease with this many claims goes to dead unread
    -- The relay's cursors: (available_at, id) where its next claim starts in the due rows and
    -- in the expired leases (NULL: from the start).
    due_at       timestamptz,
    due_id       bigint,
    orphan_at    timestamptz,
    orphan_id    bigint
);

-- What a claim, or a settle that claims, returns: one row whatever the batch's size.
CREATE TYPE claimed AS (
    archived        integer,
    dead            integer,
    retried         integer,
    released        integer,
    blocked         integer,
    ids             bigint[],     -- claimed, in the order they became due
    sizes           bigint[],     -- each one's bytes, for fetching in pages
    more            boolean,      -- due rows were left behind the batch
    alone           boolean,      -- one row whose lease ran out more than once: claim none ahead
    due_at          timestamptz,  -- where the next claim starts (claim_request's cursors)
    due_id          bigint,
    orphan_at       timestamptz,
    orphan_id       bigint,
    buried          uuid[],       -- message_ids moved to dead for their attempts, unread
    buried_attempts integer[]
);

-- Give gated rows their turn, after the key's pace (`min_interval` from its last settle), and no
-- earlier than p_at (now, for whoever releases them): a row that becomes due moves to the front of
-- every relay's cursor. The one statement every release goes through (commit trigger, settle,
-- recheck, operators).
CREATE FUNCTION _ungate(p_ids bigint[], p_at timestamptz DEFAULT now()) RETURNS integer
LANGUAGE sql
SET search_path FROM CURRENT
AS $$
    WITH freed AS (
        UPDATE messages m
        SET gated = false,
            available_at = greatest(m.available_at, p_at,
                                    (SELECT r.settled_at + k.min_interval
                                     FROM key_releases r JOIN keys k USING (ordering_key)
                                     WHERE r.ordering_key = m.ordering_key))
        WHERE m.id = ANY(p_ids) AND m.gated
        RETURNING 1
    )
    SELECT count(*)::integer FROM freed
$$;

-- After rows of some keys left `messages` (archived, dead, buried): block a key whose message
-- died under the 'block' policy, note the pace of paced keys, and release each settled row's
-- successor. A successor another session holds locked is not waited for: a recheck is queued
-- (release_stranded). Relays of 0.1 call this directly.
CREATE OR REPLACE FUNCTION _keys_settled(p_keys text[], p_seqs bigint[], p_reasons text[],
                                         p_message_ids uuid[], OUT released integer,
                                         OUT blocked integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_next bigint[];
    v_held bigint[];
BEGIN
    released := 0;
    blocked := 0;
    IF coalesce(cardinality(p_keys), 0) = 0 THEN
        RETURN;
    END IF;
    -- release_key deletes a block under FOR UPDATE: one of the two waits for the other.
    PERFORM 1 FROM blocked_keys b WHERE b.ordering_key = ANY(p_keys)
    ORDER BY b.ordering_key FOR KEY SHARE;
    WITH died AS (
        SELECT DISTINCT ON (s.ordering_key) s.ordering_key, s.message_id, s.seq, s.reason
        FROM unnest(p_keys, p_seqs, p_reasons, p_message_ids) AS s(ordering_key, seq, reason,
                                                                     message_id)
        WHERE s.reason IS NOT NULL AND (key_policy(s.ordering_key)).on_dead = 'block'
        ORDER BY s.ordering_key, s.seq
    ), added AS (
        INSERT INTO blocked_keys (ordering_key, message_id, seq, reason)
        SELECT ordering_key, message_id, seq, reason FROM died ORDER BY ordering_key
        ON CONFLICT (ordering_key) DO NOTHING
        RETURNING 1
    )
    SELECT count(*) INTO blocked FROM added;
    INSERT INTO key_releases AS r (ordering_key, settled_at)
    SELECT DISTINCT k.ordering_key, now()
    FROM keys k WHERE k.ordering_key = ANY(p_keys) AND k.min_interval > '0'
    ORDER BY k.ordering_key
    ON CONFLICT (ordering_key) DO UPDATE SET settled_at = excluded.settled_at;
    SELECT array_agg(m.id) INTO v_next
    FROM unnest(p_keys, p_seqs) AS s(ordering_key, seq)
    LEFT JOIN keys k USING (ordering_key)
    JOIN messages m ON m.ordering_key = s.ordering_key
                   AND m.seq = s.seq + coalesce(k.concurrency, 1)
    WHERE m.gated
      AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = s.ordering_key);
    IF v_next IS NULL THEN
        RETURN;
    END IF;
    v_held := ARRAY(SELECT m.id FROM messages m WHERE m.id = ANY(v_next)
                    ORDER BY m.id FOR UPDATE SKIP LOCKED);
    released := _ungate(v_held);
    INSERT INTO key_checks (ordering_key, seq)
    SELECT m.ordering_key, m.seq FROM messages m
    WHERE m.id = ANY(v_next) AND m.id <> ALL(v_held);
END;
$$;

-- Rows whose attempts are used up go to dead unread, with their keys settled: a lease that ran out
-- once too often (its relays kept dying on it), or a due row with as many attempts when
-- max_attempts was lowered. The relay's claim and `bury_exhausted` (relays of 0.2) share it.
-- p_ids are locked already.
CREATE FUNCTION _bury(p_ids bigint[], OUT buried uuid[], OUT attempts integer[])
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
#variable_conflict use_column
DECLARE
    v_keys text[];
    v_seqs bigint[];
    v_ids  uuid[];
BEGIN
    WITH gone AS (
        DELETE FROM messages WHERE id = ANY(p_ids)
        RETURNING message_id, exchange, routing_key, body, headers, properties, ordering_key,
                  seq, attempts, ambiguous, created_at, claimed_by, last_error, replays,
                  replayed_at, replayed_from
    ), moved AS (
        INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties,
                          ordering_key, seq, attempts, ambiguous, created_at, replays,
                          replayed_at, replayed_from, reason, detail)
        SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key, seq,
               attempts, ambiguous, created_at, replays, replayed_at, replayed_from,
               'max_attempts',
               format('claimed %s times, its attempts used up: moved here unread (last claimed '
                      'by %s; last error: %s)',
                      attempts, coalesce(claimed_by, 'unknown'),
                      coalesce(last_error, 'none: its relays died or lost their lease'))
        FROM gone
        RETURNING message_id, attempts, ordering_key, seq
    )
    SELECT coalesce(array_agg(message_id), '{}'), coalesce(array_agg(moved.attempts), '{}'),
           coalesce(array_agg(ordering_key) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
           coalesce(array_agg(seq) FILTER (WHERE ordering_key IS NOT NULL), '{}'),
           coalesce(array_agg(message_id) FILTER (WHERE ordering_key IS NOT NULL), '{}')
    INTO buried, attempts, v_keys, v_seqs, v_ids
    FROM moved;
    PERFORM _keys_settled(v_keys, v_seqs,
                          array_fill('max_attempts'::text, ARRAY[cardinality(v_keys)]), v_ids);
END;
$$;

-- One claim: expired leases first (from the orphan cursor), then due rows (from the due cursor,
-- less LOOKBACK), each skipping what another session holds; leased for `lease` seconds under
-- `claim_id`, an attempt counted. Only ids and sizes come back: the transaction ends before any
-- row travels (the relay fetches them next), so a relay frozen while reading holds no lock.
CREATE FUNCTION _claim(p claim_request) RETURNS claimed
LANGUAGE plpgsql
SET search_path FROM CURRENT
-- An index scan in due order is the only plan whose cost does not grow with the dead rows
-- behind the cursor (a pinned vacuum horizon keeps every one of them).
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    -- A producer's row becomes visible at its commit but is placed at its insert: a claim looks
    -- back this far behind its cursor for rows that committed late. A row later than that (a
    -- long transaction, a stalled WAL flush, a claim that rolled back) waits for the rescue.
    LOOKBACK CONSTANT interval := '1 second';
    r          claimed;
    v_now      timestamptz := now();
    v_from     timestamptz;
    v_from_id  bigint;
    v_ids      bigint[];
    v_at       timestamptz[];
    v_tries    integer[];
    v_bytes    bigint[];
    v_take     bigint[] := '{}';
    v_sizes    bigint[] := '{}';
    v_dead     bigint[] := '{}';
    v_acted    integer := 0;
    v_alone    boolean := false;
    v_room     integer;
    v_budget   bigint;
    i          integer;
BEGIN
    IF p.max_rows IS NULL OR p.max_rows < 1 OR p.lease IS NULL OR p.lease <= 0
       OR p.max_bytes IS NULL OR p.max_bytes < 1 OR p.max_attempts IS NULL OR p.max_attempts < 1
       OR p.claim_id IS NULL THEN
        RAISE EXCEPTION 'claim: claim_id, a positive max_rows, lease, max_bytes and max_attempts '
                        'are required, not %', p
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    r := ROW(0, 0, 0, 0, 0, '{}', '{}', false, false, v_now, 0, v_now, 0, '{}', '{}');
    -- Keyed rows a race left gated (key_checks), released first: this claim may take them.
    IF EXISTS (SELECT 1 FROM key_checks) THEN
        PERFORM release_stranded(100);
    END IF;

    -- Leases that ran out: their relay died or stalled.
    SELECT array_agg(o.id ORDER BY o.available_at, o.id),
           array_agg(o.available_at ORDER BY o.available_at, o.id),
           array_agg(o.attempts ORDER BY o.available_at, o.id),
           array_agg(o.bytes ORDER BY o.available_at, o.id)
    INTO v_ids, v_at, v_tries, v_bytes
    FROM (SELECT m.id, m.available_at, m.attempts,
                 octet_length(m.body) + pg_column_size(m.headers)
                     + pg_column_size(m.properties) AS bytes
          FROM messages m
          WHERE m.claim_id IS NOT NULL AND m.available_at <= v_now
            AND (m.available_at, m.id)
                >= (coalesce(p.orphan_at, '-infinity'), coalesce(p.orphan_id, 0))
          ORDER BY m.available_at, m.id
          LIMIT p.max_rows
          FOR UPDATE SKIP LOCKED) AS o;
    v_budget := p.max_bytes;
    FOR i IN 1 .. coalesce(cardinality(v_ids), 0) LOOP
        IF v_tries[i] >= p.max_attempts THEN
            v_dead := v_dead || v_ids[i];
        ELSIF v_tries[i] >= 2 THEN
            -- Claimed and lost more than once: alone, so that it takes no other row down.
            IF cardinality(v_take) = 0 THEN
                v_take := ARRAY[v_ids[i]];
                v_sizes := ARRAY[v_bytes[i]];
                v_acted := i;
                v_alone := true;
            END IF;
            EXIT;
        ELSIF cardinality(v_take) > 0 AND v_bytes[i] > v_budget THEN
            EXIT;
        ELSE
            v_take := v_take || v_ids[i];
            v_sizes := v_sizes || v_bytes[i];
            v_budget := v_budget - v_bytes[i];
        END IF;
        v_acted := i;
    END LOOP;
    r.alone := v_alone;
    IF v_alone OR (v_acted > 0 AND v_acted = cardinality(v_ids) AND v_acted = p.max_rows) THEN
        r.orphan_at := v_at[v_acted];  -- more may be waiting from here
        r.orphan_id := v_ids[v_acted];
        r.more := true;
    ELSIF v_acted < coalesce(cardinality(v_ids), 0) THEN
        r.orphan_at := v_at[v_acted + 1];
        r.orphan_id := v_ids[v_acted + 1];
        r.more := true;
    END IF;
    IF cardinality(v_dead) > 0 THEN
        SELECT b.buried, b.attempts INTO r.buried, r.buried_attempts FROM _bury(v_dead) AS b;
    END IF;

    -- Due rows, from the cursor, or from LOOKBACK ago if the cursor is closer than that.
    v_room := p.max_rows - cardinality(v_take);
    IF p.due_at IS NULL THEN
        v_from := '-infinity';
        v_from_id := 0;
    ELSIF p.due_at < v_now - LOOKBACK THEN
        v_from := p.due_at;
        v_from_id := coalesce(p.due_id, 0);
    ELSE
        v_from := v_now - LOOKBACK;
        v_from_id := 0;
    END IF;
    IF r.more THEN
        r.due_at := p.due_at;  -- this claim did not look: no further
        r.due_id := p.due_id;
    ELSE
        SELECT array_agg(d.id ORDER BY d.available_at, d.id),
               array_agg(d.available_at ORDER BY d.available_at, d.id),
               array_agg(d.attempts ORDER BY d.available_at, d.id),
               array_agg(d.bytes ORDER BY d.available_at, d.id)
        INTO v_ids, v_at, v_tries, v_bytes
        FROM (SELECT m.id, m.available_at, m.attempts,
                     octet_length(m.body) + pg_column_size(m.headers)
                         + pg_column_size(m.properties) AS bytes
              FROM messages m
              WHERE m.claim_id IS NULL AND NOT m.gated AND m.available_at <= v_now
                AND (m.available_at, m.id) >= (v_from, v_from_id)
              ORDER BY m.available_at, m.id
              LIMIT v_room
              FOR UPDATE SKIP LOCKED) AS d;
        v_acted := 0;
        v_dead := '{}';
        FOR i IN 1 .. coalesce(cardinality(v_ids), 0) LOOP
            IF v_tries[i] >= p.max_attempts THEN  -- max_attempts was lowered
                v_dead := v_dead || v_ids[i];
            ELSE
                EXIT WHEN cardinality(v_take) > 0 AND v_bytes[i] > v_budget;
                v_take := v_take || v_ids[i];
                v_sizes := v_sizes || v_bytes[i];
                v_budget := v_budget - v_bytes[i];
            END IF;
            v_acted := i;
        END LOOP;
        IF cardinality(v_dead) > 0 THEN
            SELECT r.buried || b.buried, r.buried_attempts || b.attempts
            INTO r.buried, r.buried_attempts
            FROM _bury(v_dead) AS b;
        END IF;
        IF v_acted < coalesce(cardinality(v_ids), 0) THEN  -- cut by bytes: from the first left
            r.due_at := v_at[v_acted + 1];
            r.due_id := v_ids[v_acted + 1];
            r.more := true;
        ELSIF v_acted > 0 AND v_acted >= v_room THEN  -- cut by rows: on from the last taken
            r.due_at := v_at[v_acted];
            r.due_id := v_ids[v_acted];
            r.more := true;
        END IF;
    END IF;

    -- Run even with nothing taken: its statement trigger releases what rechecks are queued.
    UPDATE messages m
    SET attempts = m.attempts + 1,
        claim_id = p.claim_id,
        claimed_by = p.claimed_by,
        claimed_at = v_now,
        available_at = v_now + make_interval(secs => p.lease)
    WHERE m.id = ANY(v_take);
    r.ids := v_take;
    r.sizes := v_sizes;
    RETURN r;
END;
$$;

CREATE FUNCTION claim(p_request claim_request) RETURNS claimed
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
SET jit = off
AS $$
BEGIN
    PERFORM _read_committed('claim');
    RETURN _claim(p_request);
END;
$$;

-- Every transition of one claim, in one transaction, fenced by the claim id; then, with
-- p_next, the next claim (it sees what this released). Per row of p_ids: its fate ('archive';
-- 'dead' with p_reasons and p_notes as the detail; 'retry' after p_delays seconds with p_notes
-- as the error; 'refund', the same giving back the attempt its claim counted; 'ambiguous', a
-- refund that records a send whose outcome is unknown). p_resent: rows written twice in this
-- claim. The claim's rows are locked first, in id order, waiting (lock_timeout bounds it) only
-- for a moment's holders (a renewal, a producer's commit checking its key): no relay statement
-- waits for anything that waits, so none can deadlock. Rows no longer under the claim are left.
CREATE FUNCTION settle(p_claim_id uuid, p_ids bigint[], p_fates text[], p_reasons text[],
                       p_notes text[], p_delays float8[], p_resent bigint[], p_durable boolean,
                       p_next claim_request)
RETURNS claimed
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
DECLARE
    r       claimed;
    v_mine  bigint[];
    v_keys  text[] := '{}';
    v_seqs  bigint[] := '{}';
    v_why   text[] := '{}';
    v_mids  uuid[] := '{}';
    v_n     integer;
BEGIN
    PERFORM _read_committed('settle');
    IF cardinality(p_ids) <> cardinality(p_fates)
       OR cardinality(p_ids) <> coalesce(cardinality(p_reasons), cardinality(p_ids))
       OR cardinality(p_ids) <> coalesce(cardinality(p_notes), cardinality(p_ids))
       OR cardinality(p_ids) <> coalesce(cardinality(p_delays), cardinality(p_ids)) THEN
        RAISE EXCEPTION 'settle: p_fates, p_reasons, p_notes and p_delays need one entry per id'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT 1 FROM unnest(p_fates) AS f
               WHERE f IS NULL OR f NOT IN ('archive', 'dead', 'retry', 'refund', 'ambiguous')) THEN
        RAISE EXCEPTION 'settle: a fate is archive, dead, retry, refund or ambiguous'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT p_durable THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    r := ROW(0, 0, 0, 0, 0, '{}', '{}', false, false, NULL, NULL, NULL, NULL, '{}', '{}');
    v_mine := ARRAY(SELECT m.id FROM messages m
                    WHERE m.id = ANY(p_ids) AND m.claim_id = p_claim_id
                    ORDER BY m.id FOR UPDATE);

    IF cardinality(v_mine) > 0 THEN
        IF cardinality(p_resent) > 0 THEN
            UPDATE messages SET ambiguous = ambiguous + 1
            WHERE id = ANY(p_resent) AND id = ANY(v_mine);
        END IF;
        WITH fate AS (
            SELECT f.* FROM unnest(p_ids, p_fates, p_reasons, p_notes)
                            AS f(id, fate, reason, note)
            WHERE f.id = ANY(v_mine) AND f.fate IN ('archive', 'dead')
        ), gone AS (
            DELETE FROM messages m USING fate f WHERE m.id = f.id
            RETURNING m.message_id, m.exchange, m.routing_key, m.body, m.headers, m.properties,
                      m.ordering_key, m.seq, m.attempts, m.ambiguous, m.created_at, m.replays,
                      m.replayed_at, m.replayed_from, f.fate, f.reason, f.note
        ), archived AS (
            INSERT INTO archive (message_id, exchange, routing_key, body, headers, properties,
                                 ordering_key, seq, attempts, ambiguous, created_at, replays,
                                 replayed_at, replayed_from)
            SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key,
                   seq, attempts, ambiguous, created_at, replays, replayed_at, replayed_from
            FROM gone WHERE fate = 'archive'
            RETURNING 1
        ), died AS (
            INSERT INTO dead (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, seq, attempts, ambiguous, created_at, replays,
                              replayed_at, replayed_from, reason, detail)
            SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key,
                   seq, attempts, ambiguous, created_at, replays, replayed_at, replayed_from,
                   coalesce(reason, 'rejected'), coalesce(note, '')
            FROM gone WHERE fate = 'dead'
            RETURNING 1
        )
        SELECT (SELECT count(*) FROM archived), (SELECT count(*) FROM died),
               coalesce(array_agg(g.ordering_key) FILTER (WHERE g.ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(g.seq) FILTER (WHERE g.ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(CASE WHEN g.fate = 'dead' THEN coalesce(g.reason, 'rejected') END)
                            FILTER (WHERE g.ordering_key IS NOT NULL), '{}'),
               coalesce(array_agg(g.message_id) FILTER (WHERE g.ordering_key IS NOT NULL), '{}')
        INTO r.archived, r.dead, v_keys, v_seqs, v_why, v_mids
        FROM gone g;

        UPDATE messages AS m
        SET available_at = now() + make_interval(secs => greatest(coalesce(f.delay, 0), 0)),
            attempts = m.attempts - (f.fate IN ('refund', 'ambiguous'))::integer,
            ambiguous = m.ambiguous + (f.fate = 'ambiguous')::integer,
            claim_id = NULL,
            claimed_by = NULL,
            claimed_at = NULL,
            last_error = f.note
        FROM unnest(p_ids, p_fates, p_notes, p_delays) AS f(id, fate, note, delay)
        WHERE m.id = f.id AND f.id = ANY(v_mine) AND f.fate IN ('retry', 'refund', 'ambiguous');
        GET DIAGNOSTICS v_n = ROW_COUNT;
        r.retried := v_n;

        IF cardinality(v_keys) > 0 THEN
            SELECT s.released, s.blocked INTO r.released, r.blocked
            FROM _keys_settled(v_keys, v_seqs, v_why, v_mids) AS s;
        END IF;
    END IF;

    IF (p_next).claim_id IS NOT NULL THEN
        DECLARE
            c claimed := _claim(p_next);
        BEGIN
            r.ids := c.ids;
            r.sizes := c.sizes;
            r.more := c.more;
            r.alone := c.alone;
            r.due_at := c.due_at;
            r.due_id := c.due_id;
            r.orphan_at := c.orphan_at;
            r.orphan_id := c.orphan_id;
            r.buried := c.buried;
            r.buried_attempts := c.buried_attempts;
        END;
    END IF;
    RETURN r;
END;
$$;

-- Relays of 0.2 settle with twelve arguments: the same settle.
CREATE OR REPLACE FUNCTION settle(p_claim_id uuid, p_archive bigint[], p_dead bigint[],
                                  p_reasons text[], p_details text[], p_retry bigint[],
                                  p_delays float8[], p_errors text[], p_refunds boolean[],
                                  p_ambiguous boolean[], p_resent bigint[], p_durable boolean,
                                  OUT archived integer, OUT dead integer, OUT retried integer,
                                  OUT released integer, OUT blocked integer)
LANGUAGE sql SECURITY DEFINER
SET search_path FROM CURRENT
SET jit = off
AS $$
    SELECT s.archived, s.dead, s.retried, s.released, s.blocked
    FROM settle(
        p_claim_id,
        coalesce(p_archive, '{}') || coalesce(p_dead, '{}') || coalesce(p_retry, '{}'),
        array_fill('archive'::text, ARRAY[cardinality(coalesce(p_archive, '{}'))])
            || array_fill('dead'::text, ARRAY[cardinality(coalesce(p_dead, '{}'))])
            || ARRAY(SELECT CASE WHEN a THEN 'ambiguous' WHEN f THEN 'refund' ELSE 'retry' END
                     FROM unnest(p_refunds, p_ambiguous) WITH ORDINALITY AS t(f, a, n)
                     ORDER BY n),
        array_fill(NULL::text, ARRAY[cardinality(coalesce(p_archive, '{}'))])
            || coalesce(p_reasons, '{}')
            || array_fill(NULL::text, ARRAY[cardinality(coalesce(p_retry, '{}'))]),
        array_fill(NULL::text, ARRAY[cardinality(coalesce(p_archive, '{}'))])
            || coalesce(p_details, '{}') || coalesce(p_errors, '{}'),
        array_fill(NULL::float8, ARRAY[cardinality(coalesce(p_archive, '{}'))
                                        + cardinality(coalesce(p_dead, '{}'))])
            || coalesce(p_delays, '{}'),
        coalesce(p_resent, '{}'),
        p_durable,
        NULL::claim_request) AS s
$$;

-- Renew a claim's leases; the rows still under it come back. Never waits: a row locked by
-- another session (its own settle, a relay taking it over) is not renewed and not returned.
CREATE OR REPLACE FUNCTION extend_leases(p_claim_id uuid, p_ids bigint[], p_lease float8)
RETURNS SETOF bigint
LANGUAGE sql SECURITY DEFINER
SET search_path FROM CURRENT
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off
AS $$
    UPDATE messages m
    SET available_at = now() + make_interval(secs => p_lease)
    FROM (SELECT id FROM messages
          WHERE id = ANY(p_ids) AND claim_id = p_claim_id
          ORDER BY id FOR UPDATE SKIP LOCKED) AS held
    WHERE m.id = held.id
    RETURNING m.id
$$;

-- Rechecks queued by producers' commits (and by settles that found a successor held): release
-- the row once its predecessor is gone. Never waits: a predecessor or a row another session holds
-- keeps its check for the next look. Every claim runs it (_rechecks); relays of 0.2 call it.
CREATE OR REPLACE FUNCTION release_stranded(p_limit integer, OUT looked integer,
                                            OUT released integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
SET jit = off
AS $$
DECLARE
    v_checks  bigint[];
    v_rows    bigint[];
    v_preds   bigint[];
    v_blocked boolean[];
    v_idle    bigint[];
    v_free    bigint[];
    v_done    bigint[] := '{}';
    i         integer;
BEGIN
    PERFORM _read_committed('release_stranded');
    released := 0;
    -- Each check with its row (if still gated) and its predecessor (if still there).
    SELECT array_agg(c.id ORDER BY c.id), array_agg(m.id ORDER BY c.id),
           array_agg(p.id ORDER BY c.id),
           array_agg(EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = c.ordering_key)
                     ORDER BY c.id)
    INTO v_checks, v_rows, v_preds, v_blocked
    FROM (SELECT * FROM key_checks ORDER BY id LIMIT p_limit FOR UPDATE SKIP LOCKED) AS c
    LEFT JOIN keys k ON k.ordering_key = c.ordering_key
    LEFT JOIN messages m ON m.ordering_key = c.ordering_key AND m.seq = c.seq AND m.gated
    LEFT JOIN messages p ON p.ordering_key = c.ordering_key
                        AND p.seq = c.seq - coalesce(k.concurrency, 1);
    looked := coalesce(cardinality(v_checks), 0);
    IF looked = 0 THEN
        RETURN;
    END IF;
    -- A predecessor nobody holds waits for its own settle, which will release the row; one held
    -- may be being settled right now: look again later.
    v_idle := ARRAY(SELECT m.id FROM messages m WHERE m.id = ANY(v_preds)
                    FOR KEY SHARE SKIP LOCKED);
    v_free := ARRAY(SELECT m.id FROM messages m
                    WHERE m.id = ANY(ARRAY(SELECT r FROM unnest(v_rows, v_preds, v_blocked)
                                                        AS t(r, p, b)
                                           WHERE r IS NOT NULL AND p IS NULL AND NOT b))
                    ORDER BY m.id FOR UPDATE SKIP LOCKED);
    released := _ungate(v_free);
    FOR i IN 1 .. looked LOOP
        IF v_rows[i] IS NULL OR v_blocked[i] OR v_preds[i] = ANY(v_idle)
           OR v_rows[i] = ANY(v_free) THEN
            v_done := v_done || v_checks[i];
        END IF;
    END LOOP;
    DELETE FROM key_checks WHERE id = ANY(v_done);
    IF released > 0 THEN
        PERFORM pg_notify(current_schema() || '_new', '');
    END IF;
END;
$$;

-- The rechecks run in every claim, by relays of every version (0.1's and 0.2's claims are their
-- own UPDATEs; `_claim` runs them first, and its UPDATE even when it took nothing): a keyed row a
-- race left gated goes at the next claim of any relay, with no chore and no relay of this
-- release needed.
CREATE FUNCTION _rechecks() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
SET jit = off
AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM key_checks) THEN
        PERFORM release_stranded(100);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER messages_rechecks AFTER UPDATE OF claim_id ON messages
FOR EACH STATEMENT EXECUTE FUNCTION _rechecks();

-- Relays of 0.2 bury exhausted orphans with this; relays now do it in their claim.
CREATE OR REPLACE FUNCTION bury_exhausted(p_max_attempts integer, p_limit integer)
RETURNS TABLE (buried_id uuid, buried_attempts integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
SET jit = off
AS $$
DECLARE
    v_ids bigint[];
    v     record;
BEGIN
    PERFORM _read_committed('bury_exhausted');
    IF p_max_attempts IS NULL OR p_max_attempts < 1 THEN
        RAISE EXCEPTION 'bury_exhausted: p_max_attempts must be at least 1, not %', p_max_attempts
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_ids := ARRAY(SELECT id FROM messages
                   WHERE claim_id IS NOT NULL AND available_at <= now()
                     AND attempts >= p_max_attempts AND NOT gated
                   ORDER BY available_at, id LIMIT p_limit FOR UPDATE SKIP LOCKED);
    SELECT * INTO v FROM _bury(v_ids);
    RETURN QUERY SELECT * FROM unnest(v.buried, v.attempts);
END;
$$;

-- The relay's pruner: archived rows published before p_cutoff, oldest first, p_batch at a time;
-- how many went and how many of the batch were younger (then the prune is done). The relay role
-- deletes through this alone: a DELETE privilege would let it LOCK the archive every settle
-- writes to.
CREATE FUNCTION prune_archive(p_cutoff timestamptz, p_batch integer, OUT gone integer,
                              OUT younger integer)
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
SET jit = off
AS $$
BEGIN
    IF p_cutoff IS NULL OR p_cutoff > now() THEN
        RAISE EXCEPTION 'prune_archive: p_cutoff must be a time in the past, not %', p_cutoff
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'prune_archive: p_batch must be from 1 to 100000, not %', p_batch
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    WITH oldest AS (
        SELECT id, published_at FROM archive ORDER BY id LIMIT p_batch
    ), deleted AS (
        DELETE FROM archive AS a USING oldest AS o
        WHERE a.id = o.id AND o.published_at < p_cutoff
        RETURNING a.id
    )
    SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM oldest WHERE published_at >= p_cutoff)
    INTO gone, younger;
END;
$$;

-- A producer's commit: release its keyed row if its predecessor is gone (placed at the commit,
-- not the insert: in front of every relay's cursor), or queue a recheck if it cannot tell.
CREATE OR REPLACE FUNCTION _key_gate_at_commit() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_concurrency integer;
BEGIN
    -- A row inserted behind enqueue's back may have no `keys` row: treat it as one at a time.
    SELECT coalesce(max(k.concurrency), 1) INTO v_concurrency
    FROM keys k WHERE k.ordering_key = NEW.ordering_key;
    IF current_setting('transaction_isolation') = 'read committed' THEN
        PERFORM 1 FROM messages m
        WHERE m.ordering_key = NEW.ordering_key AND m.seq = NEW.seq - v_concurrency
        FOR KEY SHARE SKIP LOCKED;
        IF FOUND THEN
            RETURN NULL;  -- still waiting; its settle will release this row
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM messages m
               WHERE m.ordering_key = NEW.ordering_key AND m.seq = NEW.seq - v_concurrency) THEN
        -- Held by a session that may be settling it: the next claim looks again (never this
        -- commit); wake a relay that sleeps, so that there is a next claim.
        INSERT INTO key_checks (ordering_key, seq) VALUES (NEW.ordering_key, NEW.seq);
        PERFORM _ring();
    ELSIF NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = NEW.ordering_key) THEN
        PERFORM _ungate(ARRAY[NEW.id], clock_timestamp());  -- not the transaction's start
        PERFORM _ring();
    END IF;
    RETURN NULL;
END;
$$;

-- Operators release a key (skipping its dead head) or replay it: both through _ungate.
CREATE OR REPLACE FUNCTION release_key(p_key text, p_replay boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER
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
    PERFORM _ungate(ARRAY(
        SELECT m.id FROM messages m
        WHERE m.ordering_key = p_key AND m.gated
          AND NOT EXISTS (SELECT 1 FROM messages p
                          WHERE p.ordering_key = p_key AND p.seq = m.seq - v_concurrency)));
    PERFORM pg_notify(current_schema() || '_new', '');
    RETURN true;
END;
$$;

CREATE OR REPLACE FUNCTION replay_dead(p_ids bigint[], p_exchange text DEFAULT NULL,
                                       p_routing_key text DEFAULT NULL)
RETURNS SETOF uuid
LANGUAGE plpgsql SECURITY DEFINER
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
                v_row.properties, v_row.ordering_key, v_row.seq, v_gated, v_row.created_at,
                clock_timestamp(), v_row.replays + 1, now(), v_row.reason);
        RETURN NEXT v_row.message_id;
    END LOOP;
    PERFORM _ungate(ARRAY(
        SELECT m.id FROM messages m
        WHERE m.ordering_key = ANY(v_keys) AND m.gated
          AND NOT EXISTS (SELECT 1 FROM blocked_keys b WHERE b.ordering_key = m.ordering_key)
          AND NOT EXISTS (SELECT 1 FROM messages p
                          WHERE p.ordering_key = m.ordering_key
                            AND p.seq = m.seq - (SELECT coalesce(max(k.concurrency), 1)
                                                 FROM keys k
                                                 WHERE k.ordering_key = m.ordering_key))));
    PERFORM pg_notify(current_schema() || '_new', '');
END;
$$;

-- Every message goes into `messages`. A message_id already waiting is refused with
-- unique_violation: here when it is visible, else by the unique index itself (a transaction
-- still open, or one that committed after this one's snapshot), at any isolation level. No
-- ON CONFLICT: under REPEATABLE READ it turns that case into a serialization failure.
CREATE OR REPLACE FUNCTION _enqueue(p_exchange text, p_routing_key text, p_body bytea,
                                    p_headers jsonb, p_properties jsonb,
                                    p_available_at timestamptz, p_ordering_key text,
                                    p_message_id uuid, p_default_content_type text)
RETURNS uuid
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
    IF p_message_id IS NOT NULL
       AND EXISTS (SELECT 1 FROM messages m WHERE m.message_id = p_message_id) THEN
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
            p_ordering_key, v_seq, v_gated, v_now, v_due);
    -- Wake a relay that sleeps (_ring). A scheduled or gated row wakes nobody: polling, or the
    -- settle of its predecessor, frees it.
    IF v_due <= v_now AND NOT v_gated THEN
        PERFORM _ring();
    END IF;
    RETURN v_message_id;
END;
$$;
