-- 0021: replays from the lake (`outbox-relay pipeline replay`, issue 21).
--
-- After a prune the lake is the only copy of old messages. A replay selects archived messages
-- there (on Spark) and puts them back in the outbox, in the lake's id order, through
-- enqueue_many: fresh message ids, provenance headers, their ordering keys (so a key's messages go
-- out in their original order, behind the key's live ones). The Python side sends them in batches
-- at the operator's rate; here each batch is one transaction that also moves the replay's
-- position, fenced by the position it started from:
--   - a replay interrupted anywhere continues after its last committed batch, and a batch is
--     never enqueued twice (a second run of the same replay at the same time, or a retry of a
--     batch whose commit went through but whose answer was lost, finds the position moved on and
--     is refused, not doubled);
--   - a replay run again adds nothing, unless exports have since brought the lake more rows it
--     selects (their ids are all past its position: the lake's id ranges only grow).
-- The table is the replays' log as well: what each selected, how far it got, and when.
--
-- Upgrading: new objects only; relays of the previous version neither see nor need them.
-- `migrate` grants the functions to the operator role (it reads the table, as every table).

SET LOCAL lock_timeout = '10s';

CREATE TABLE replays (
    name        text PRIMARY KEY
                CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'),
    -- What it selects and where it sends them, resolved at its first run (relative times fixed).
    selection   jsonb NOT NULL,
    -- The last lake archive id enqueued (0: none yet), and how many messages that made.
    position    bigint NOT NULL DEFAULT 0 CHECK (position >= 0),
    enqueued    bigint NOT NULL DEFAULT 0 CHECK (enqueued >= 0),
    started_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE replays IS
    'Replays of archived messages from the lake (outbox-relay pipeline replay): one row each.';

-- The replay `p_name`, started with `p_selection` if it is new; its row either way. The caller
-- compares the selection it finds with its own.
CREATE FUNCTION start_replay(p_name text, p_selection jsonb)
RETURNS SETOF replays
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_selection IS NULL OR jsonb_typeof(p_selection) <> 'object' THEN
        RAISE EXCEPTION 'start_replay: the selection must be a JSON object'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_name IS NULL OR p_name !~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$' THEN
        RAISE EXCEPTION 'start_replay: a replay name is 1 to 128 letters, digits, ".", "_", ":" '
                        'or "-", starting with a letter or digit; not %', quote_nullable(p_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO replays (name, selection) VALUES (p_name, p_selection)
    ON CONFLICT (name) DO NOTHING;
    RETURN QUERY SELECT * FROM replays r WHERE r.name = p_name;
END;
$$;

-- Enqueue one batch of replay `p_name` (lake ids p_after < id <= p_last, in that order) and move
-- its position to p_last, in the caller's transaction; refused (object_in_use) unless the
-- position is p_after. Returns how many messages were enqueued.
CREATE FUNCTION replay_batch(p_name text, p_after bigint, p_last bigint, p_exchanges text[],
                             p_routing_keys text[], p_bodies bytea[], p_headers jsonb[],
                             p_properties jsonb[], p_ordering_keys text[], p_message_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_n integer := coalesce(cardinality(p_message_ids), 0);
BEGIN
    IF p_last IS NULL OR p_after IS NULL OR p_last < p_after THEN
        RAISE EXCEPTION 'replay_batch: the batch must end at or after where it starts (% .. %)',
            p_after, p_last USING ERRCODE = 'invalid_parameter_value';
    END IF;
    UPDATE replays
    SET position = p_last, enqueued = enqueued + v_n, updated_at = now()
    WHERE name = p_name AND position = p_after;
    IF NOT FOUND THEN
        IF NOT EXISTS (SELECT 1 FROM replays WHERE name = p_name) THEN
            RAISE EXCEPTION 'replay_batch: there is no replay %', quote_literal(p_name)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        RAISE EXCEPTION 'replay_batch: replay % has moved on from position % (another run of it '
                        'is going)', quote_literal(p_name), p_after
            USING ERRCODE = 'object_in_use';
    END IF;
    IF v_n > 0 THEN
        PERFORM enqueue_many(p_exchanges, p_routing_keys, p_bodies, p_headers, p_properties,
                             NULL, p_ordering_keys, p_message_ids);
    END IF;
    RETURN v_n;
END;
$$;
