-- Option C: today's row (the claim updates it, the settle deletes it), but the claim resumes
-- past the last row it took, and a full pass from the start every second finds what committed
-- late behind the cursor.
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

-- p_after_at/p_after_id: the cursor (NULL: a full pass).
CREATE FUNCTION opt.claim(p_limit int, p_claim uuid, p_after_at timestamptz, p_after_id bigint)
RETURNS TABLE (id bigint, created_at timestamptz, was_at timestamptz) LANGUAGE sql AS $$
    WITH due AS MATERIALIZED (
        SELECT m.id, m.available_at FROM opt.messages m
        WHERE m.claim_id IS NULL AND m.available_at <= now()
          AND (p_after_at IS NULL OR (m.available_at, m.id) > (p_after_at, p_after_id))
        ORDER BY m.available_at, m.id
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    )
    UPDATE opt.messages m
    SET attempts = m.attempts + 1, claim_id = p_claim,
        available_at = now() + interval '30 seconds'
    FROM due WHERE m.id = due.id
    RETURNING m.id, m.created_at, due.available_at
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
