-- Option E: one lane, the row as a state machine (the slow lane of 0004, which every relay
-- version reads), with every index scan bounded below. A claim starts at the relay's cursor less
-- a short look-back (for commits that became visible late), takes expired leases first from its
-- own cursor, commits before the rows travel (claim, then fetch), and a rescue off the loop finds
-- anything that fell behind the cursors.
CREATE SCHEMA opt;
CREATE TABLE opt.messages (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    body         bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempts     integer     NOT NULL DEFAULT 0,
    claim_id     uuid
);
CREATE INDEX messages_due_idx ON opt.messages (available_at, id) WHERE claim_id IS NULL;
CREATE INDEX messages_leased_idx ON opt.messages (available_at, id) WHERE claim_id IS NOT NULL;
CREATE TABLE opt.archive (id bigint, body bytea, created_at timestamptz,
                          published_at timestamptz DEFAULT now());

CREATE FUNCTION opt.produce(p_body bytea) RETURNS void LANGUAGE sql AS
$$ INSERT INTO opt.messages (body) VALUES (p_body) $$;

-- Expired leases from p_orphans_from, then due rows from p_from less p_lookback seconds; only
-- ids come back. `next_from` is where the next claim starts: the last row taken when the batch
-- came back full, else this claim's now().
CREATE FUNCTION opt.claim(p_limit int, p_claim uuid, p_from timestamptz, p_orphans_from timestamptz,
                          p_lookback float8)
RETURNS TABLE (id bigint, next_from timestamptz, orphans_from timestamptz) LANGUAGE sql AS $$
    WITH orphans AS MATERIALIZED (
        SELECT m.id, m.available_at FROM opt.messages m
        WHERE m.claim_id IS NOT NULL AND m.available_at <= now()
          AND m.available_at >= p_orphans_from
        ORDER BY m.available_at, m.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ), due AS MATERIALIZED (
        SELECT m.id, m.available_at FROM opt.messages m
        WHERE m.claim_id IS NULL AND m.available_at <= now()
          AND m.available_at >= least(p_from, now() - make_interval(secs => p_lookback))
        ORDER BY m.available_at, m.id
        LIMIT p_limit - (SELECT count(*) FROM orphans)
        FOR UPDATE SKIP LOCKED
    ), taken AS MATERIALIZED (
        SELECT o.id FROM orphans o UNION ALL SELECT d.id FROM due d
    ), claimed AS (
        UPDATE opt.messages m
        SET attempts = m.attempts + 1, claim_id = p_claim,
            available_at = now() + interval '30 seconds'
        FROM taken WHERE m.id = taken.id
        RETURNING m.id
    )
    SELECT c.id,
           CASE WHEN (SELECT count(*) FROM due) >= p_limit - (SELECT count(*) FROM orphans)
                     AND (SELECT count(*) FROM due) > 0
                THEN (SELECT max(d.available_at) FROM due d) ELSE now() END,
           now()
    FROM claimed c
$$;

CREATE FUNCTION opt.fetch(p_ids bigint[], p_claim uuid)
RETURNS TABLE (id bigint, body bytea, created_at timestamptz) LANGUAGE sql STABLE AS $$
    SELECT m.id, m.body, m.created_at FROM opt.messages m
    WHERE m.id = ANY(p_ids) AND m.claim_id = p_claim
$$;

-- The rescue: the oldest unclaimed due row and the oldest expired lease, from the start.
CREATE FUNCTION opt.behind(p_lookback float8) RETURNS TABLE (due_at timestamptz, orphan_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT (SELECT m.available_at FROM opt.messages m
            WHERE m.claim_id IS NULL AND m.available_at <= now() - make_interval(secs => p_lookback)
            ORDER BY m.available_at, m.id LIMIT 1),
           (SELECT m.available_at FROM opt.messages m
            WHERE m.claim_id IS NOT NULL AND m.available_at <= now() - make_interval(secs => p_lookback)
            ORDER BY m.available_at, m.id LIMIT 1)
$$;

CREATE FUNCTION opt.settle(p_ids bigint[], p_claim uuid) RETURNS integer LANGUAGE sql AS $$
    WITH moved AS (
        DELETE FROM opt.messages WHERE id = ANY(p_ids) AND claim_id = p_claim
        RETURNING id, body, created_at
    ), archived AS (
        INSERT INTO opt.archive (id, body, created_at) SELECT * FROM moved RETURNING 1
    )
    SELECT count(*)::int FROM archived
$$;
