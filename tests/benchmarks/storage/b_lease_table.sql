-- Option B: a narrow lease table. The message row is never updated; a claim inserts (or takes
-- over an expired) lease, and the settle deletes the message and its lease.
CREATE SCHEMA opt;
CREATE TABLE opt.messages (
    id           bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    body         bytea       NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX ON opt.messages (available_at, id);
CREATE TABLE opt.leases (
    id       bigint PRIMARY KEY,
    claim_id uuid        NOT NULL,
    until    timestamptz NOT NULL
);
CREATE TABLE opt.archive (id bigint, body bytea, created_at timestamptz,
                          published_at timestamptz DEFAULT now());

CREATE FUNCTION opt.produce(p_body bytea) RETURNS void LANGUAGE sql AS
$$ INSERT INTO opt.messages (body) VALUES (p_body) $$;

CREATE FUNCTION opt.claim(p_limit int, p_claim uuid)
RETURNS TABLE (id bigint, created_at timestamptz) LANGUAGE sql AS $$
    WITH due AS MATERIALIZED (
        SELECT m.id, m.created_at FROM opt.messages m
        WHERE m.available_at <= now()
          AND NOT EXISTS (SELECT 1 FROM opt.leases l WHERE l.id = m.id AND l.until > now())
        ORDER BY m.available_at, m.id
        LIMIT p_limit
        FOR UPDATE OF m SKIP LOCKED
    ), leased AS (
        INSERT INTO opt.leases AS l (id, claim_id, until)
        SELECT due.id, p_claim, now() + interval '30 seconds' FROM due
        ON CONFLICT (id) DO UPDATE SET claim_id = excluded.claim_id, until = excluded.until
        WHERE l.until <= now()
        RETURNING l.id
    )
    SELECT due.id, due.created_at FROM due JOIN leased USING (id)
$$;

CREATE FUNCTION opt.settle(p_ids bigint[], p_claim uuid) RETURNS integer LANGUAGE sql AS $$
    WITH gone AS (
        DELETE FROM opt.leases WHERE id = ANY(p_ids) AND claim_id = p_claim RETURNING id
    ), moved AS (
        DELETE FROM opt.messages m USING gone WHERE m.id = gone.id
        RETURNING m.id, m.body, m.created_at
    ), archived AS (
        INSERT INTO opt.archive (id, body, created_at) SELECT * FROM moved RETURNING 1
    )
    SELECT count(*)::int FROM archived
$$;
