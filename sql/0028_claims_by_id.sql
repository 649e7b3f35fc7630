-- 0028: a claim's own rows are found by their ids, never by walking the leases.
--
-- settle and extend_leases picked their claim's rows with `id = ANY(p_ids) AND claim_id = p_id`.
-- `claim_id = p_id` implies the predicate of messages_leased_idx (claim_id IS NOT NULL), and
-- the planner, which counts that index small, walked all of it and filtered by id: a walk whose
-- cost is every leased version the vacuum horizon keeps. Under a pinned horizon (30 s of 500
-- messages/s leaves ~60,000 dead entries in it) each settle and each renewal read them all, and
-- a settle's p99 went up twentyfold. `IS NOT DISTINCT FROM` means the same for a claim id that
-- is never NULL, but implies no index predicate: the rows are found through the primary key,
-- at the cost of their ids alone, pinned or not. For the same reason settle's DELETE and UPDATE
-- name their rows by `id = ANY(…)` rather than by a join alone, whose cached generic plan was
-- seen to walk the whole primary key.
--
-- Upgrading: replaces two function bodies; signatures, grants and callers are unchanged.

-- Every transition of one claim, in one transaction, fenced by the claim id; then, with
-- p_next, the next claim (it sees what this released). Per row of p_ids: its fate ('archive';
-- 'dead' with p_reasons and p_notes as the detail; 'retry' after p_delays seconds with p_notes
-- as the error; 'refund', the same giving back the attempt its claim counted; 'ambiguous', a
-- refund that records a send whose outcome is unknown). p_resent: rows written twice in this
-- claim. The claim's rows are locked first, in id order, waiting (lock_timeout bounds it) only
-- for a moment's holders (a renewal, a producer's commit checking its key): no relay statement
-- waits for anything that waits, so none can deadlock. Rows no longer under the claim are left.
CREATE OR REPLACE FUNCTION settle(p_claim_id uuid, p_ids bigint[], p_fates text[], p_reasons text[],
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
                    WHERE m.id = ANY(p_ids) AND m.claim_id IS NOT DISTINCT FROM p_claim_id
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
        ), deleted AS (
            -- By the primary key and the ids alone: joined to `fate`, the planner may walk the
            -- whole index instead, every version a pinned horizon keeps.
            DELETE FROM messages m WHERE m.id = ANY(ARRAY(SELECT id FROM fate))
            RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers,
                      m.properties, m.ordering_key, m.seq, m.attempts, m.ambiguous, m.created_at,
                      m.replays, m.replayed_at, m.replayed_from
        ), gone AS (
            SELECT d.*, f.fate, f.reason, f.note FROM deleted d JOIN fate f USING (id)
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
        WHERE m.id = ANY(v_mine) AND m.id = f.id AND f.fate IN ('retry', 'refund', 'ambiguous');
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
          WHERE id = ANY(p_ids) AND claim_id IS NOT DISTINCT FROM p_claim_id
          ORDER BY id FOR UPDATE SKIP LOCKED) AS held
    WHERE m.id = held.id
    RETURNING m.id
$$;
