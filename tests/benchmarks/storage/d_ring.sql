-- Option D: append-only ready rows in a ring of partitions, claims and settles as inserts into
-- narrow tables partitioned alike, claims walking windows of committed transactions (pg_snapshot
-- pairs, as PgQ's batches), segments reclaimed by TRUNCATE once every row is done.
CREATE SCHEMA opt;
CREATE SEQUENCE opt.ready_id;
CREATE TABLE opt.ready (
    seg        smallint    NOT NULL,
    id         bigint      NOT NULL,
    xid        xid8        NOT NULL DEFAULT pg_current_xact_id(),
    body       bytea       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp()
) PARTITION BY LIST (seg);
CREATE TABLE opt.claims (
    seg      smallint    NOT NULL,
    id       bigint      NOT NULL,
    claim_id uuid        NOT NULL,
    until    timestamptz NOT NULL
) PARTITION BY LIST (seg);
CREATE TABLE opt.done (seg smallint NOT NULL, id bigint NOT NULL) PARTITION BY LIST (seg);
DO $$
BEGIN
    FOR i IN 0..7 LOOP
        EXECUTE format('CREATE TABLE opt.ready_%s PARTITION OF opt.ready FOR VALUES IN (%s)', i, i);
        EXECUTE format('CREATE TABLE opt.claims_%s PARTITION OF opt.claims FOR VALUES IN (%s)', i, i);
        EXECUTE format('CREATE TABLE opt.done_%s PARTITION OF opt.done FOR VALUES IN (%s)', i, i);
    END LOOP;
END $$;
CREATE INDEX ON opt.ready (xid, id);
CREATE UNIQUE INDEX ON opt.ready (seg, id);
CREATE UNIQUE INDEX ON opt.claims (seg, id);
CREATE UNIQUE INDEX ON opt.done (seg, id);
CREATE TABLE opt.archive (id bigint, body bytea, created_at timestamptz,
                          published_at timestamptz DEFAULT now());

CREATE FUNCTION opt.produce(p_body bytea) RETURNS void LANGUAGE sql AS $$
    INSERT INTO opt.ready (seg, id, body)
    SELECT (n / 20000 % 8)::smallint, n, p_body FROM nextval('opt.ready_id') AS n
$$;

-- One page of the window (p_prev, p_hi]: rows of transactions that committed after p_prev was
-- taken and before p_hi was, past the cursor (p_xid, p_id), in (xid, id) order. Returns every
-- row it looked at, and whether this call claimed it.
CREATE FUNCTION opt.claim(p_limit int, p_claim uuid, p_prev pg_snapshot, p_hi pg_snapshot,
                          p_xid xid8, p_id bigint)
RETURNS TABLE (id bigint, created_at timestamptz, xid xid8, claimed boolean)
LANGUAGE plpgsql AS $$
DECLARE
    v_prev_xip  xid8[] := ARRAY(SELECT pg_snapshot_xip(p_prev));
    v_hi_xip    xid8[] := ARRAY(SELECT pg_snapshot_xip(p_hi));
    v_prev_xmax xid8   := pg_snapshot_xmax(p_prev);
    v_hi_xmax   xid8   := pg_snapshot_xmax(p_hi);
    v_n         int    := 0;
BEGIN
    IF cardinality(v_prev_xip) > 0 AND p_xid < v_prev_xmax THEN
        RETURN QUERY
        WITH due AS MATERIALIZED (
            SELECT r.seg, r.id, r.xid, r.created_at FROM opt.ready r
            WHERE r.xid = ANY(v_prev_xip) AND r.xid <> ALL(v_hi_xip)
              AND (r.xid, r.id) > (p_xid, p_id)
              AND NOT EXISTS (SELECT 1 FROM opt.claims c WHERE c.seg = r.seg AND c.id = r.id)
            ORDER BY r.xid, r.id
            LIMIT p_limit
            FOR UPDATE OF r SKIP LOCKED
        ), ins AS (
            INSERT INTO opt.claims (seg, id, claim_id, until)
            SELECT due.seg, due.id, p_claim, now() + interval '30 seconds' FROM due
            ON CONFLICT DO NOTHING
            RETURNING claims.seg, claims.id
        )
        SELECT due.id, due.created_at, due.xid, ins.id IS NOT NULL
        FROM due LEFT JOIN ins ON ins.seg = due.seg AND ins.id = due.id;
        GET DIAGNOSTICS v_n = ROW_COUNT;
    END IF;
    IF v_n < p_limit THEN
        RETURN QUERY
        WITH due AS MATERIALIZED (
            SELECT r.seg, r.id, r.xid, r.created_at FROM opt.ready r
            WHERE r.xid >= v_prev_xmax AND r.xid < v_hi_xmax AND r.xid <> ALL(v_hi_xip)
              AND (r.xid, r.id) > (p_xid, p_id)
              AND NOT EXISTS (SELECT 1 FROM opt.claims c WHERE c.seg = r.seg AND c.id = r.id)
            ORDER BY r.xid, r.id
            LIMIT p_limit - v_n
            FOR UPDATE OF r SKIP LOCKED
        ), ins AS (
            INSERT INTO opt.claims (seg, id, claim_id, until)
            SELECT due.seg, due.id, p_claim, now() + interval '30 seconds' FROM due
            ON CONFLICT DO NOTHING
            RETURNING claims.seg, claims.id
        )
        SELECT due.id, due.created_at, due.xid, ins.id IS NOT NULL
        FROM due LEFT JOIN ins ON ins.seg = due.seg AND ins.id = due.id;
    END IF;
END;
$$;

-- Whether the window still has a row nobody claimed (one a claim skipped while another relay
-- held it, and that relay's claim rolled back): then the window is walked again.
CREATE FUNCTION opt.window_open(p_prev pg_snapshot, p_hi pg_snapshot) RETURNS boolean
LANGUAGE sql AS $$
    SELECT EXISTS (
        SELECT 1 FROM opt.ready r
        WHERE (r.xid = ANY(ARRAY(SELECT pg_snapshot_xip(p_prev)))
               OR (r.xid >= pg_snapshot_xmax(p_prev) AND r.xid < pg_snapshot_xmax(p_hi)))
          AND r.xid <> ALL(ARRAY(SELECT pg_snapshot_xip(p_hi)))
          AND NOT EXISTS (SELECT 1 FROM opt.claims c WHERE c.seg = r.seg AND c.id = r.id)
    )
$$;

CREATE FUNCTION opt.settle(p_ids bigint[], p_claim uuid) RETURNS integer LANGUAGE sql AS $$
    WITH mine AS (
        SELECT c.seg, c.id FROM opt.claims c
        WHERE c.seg = ANY(ARRAY(SELECT DISTINCT (i / 20000 % 8)::smallint FROM unnest(p_ids) i))
          AND c.id = ANY(p_ids) AND c.claim_id = p_claim
    ), marked AS (
        INSERT INTO opt.done (seg, id) SELECT seg, id FROM mine
        ON CONFLICT DO NOTHING RETURNING seg, id
    ), archived AS (
        INSERT INTO opt.archive (id, body, created_at)
        SELECT r.id, r.body, r.created_at FROM opt.ready r JOIN marked m USING (seg, id)
        RETURNING 1
    )
    SELECT count(*)::int FROM archived
$$;

-- Reclaim segment p_seg if every row in it is done: TRUNCATE its three partitions. Gives up at
-- once (lock_timeout) when anyone holds them.
CREATE FUNCTION opt.reclaim(p_seg int) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    SET LOCAL lock_timeout = '50ms';
    EXECUTE format('LOCK opt.ready_%1$s, opt.claims_%1$s, opt.done_%1$s IN ACCESS EXCLUSIVE MODE',
                   p_seg);
    IF NOT EXISTS (SELECT 1 FROM opt.ready r WHERE r.seg = p_seg)
       OR EXISTS (SELECT 1 FROM opt.ready r WHERE r.seg = p_seg
                  AND NOT EXISTS (SELECT 1 FROM opt.done d WHERE d.seg = p_seg AND d.id = r.id)) THEN
        RETURN false;
    END IF;
    EXECUTE format('TRUNCATE opt.ready_%1$s, opt.claims_%1$s, opt.done_%1$s', p_seg);
    RETURN true;
EXCEPTION WHEN lock_not_available THEN
    RETURN false;
END;
$$;
