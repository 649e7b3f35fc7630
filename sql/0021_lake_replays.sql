-- 0021: replays from the lake (`outbox-relay pipeline replay`, issue 21).
--
-- After a prune the lake is the only copy of old messages. A replay selects archived messages
-- there (on Spark) and puts them back in the outbox, in the lake's id order, through
-- enqueue_many: fresh message ids, provenance headers, their ordering keys (so a key's messages go
-- out in the order they were first published). The Python side sends them in batches at the
-- operator's rate; here each batch is one transaction that also moves the replay's position past
-- the batch's lake ids, fenced by the position it started from:
--   - a replay interrupted anywhere continues after its last committed batch, and a batch is
--     never enqueued twice: a second run of the same replay at the same time, or a retry of a
--     batch whose commit went through but whose answer was lost, finds the position moved on and
--     is refused; a batch must lie wholly past the position it names;
--   - a replay run again adds nothing, unless exports have since brought the lake more rows it
--     selects (their ids are all past its position: the lake's id ranges only grow).
-- A row the outbox refuses today (a body over a since-lowered max_body_bytes, headers that no
-- longer fit with the provenance added) is skipped, not retried for ever: replay_skip moves the
-- position past it under the same fence and records it, with the reason.
--
-- Rights: a replay enqueues, so it runs as a producer (`outbox-relay roles` grants these
-- functions to the producer role, which may enqueue anything anyway); the operator role reads the
-- table, as every table, and cannot enqueue. A replay belongs to the login that started it
-- (session_user): no other login can see, continue, or skip through it, so an application's
-- producer login cannot start a replay under the name an operator's command will use, nor move
-- an operator's replay on.
--
-- Upgrading: new objects only; relays of the previous version neither see nor need them.
-- `migrate` grants the functions to the producer role.

SET LOCAL lock_timeout = '10s';

CREATE TABLE replays (
    name        text PRIMARY KEY
                CHECK (name ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'),
    -- What it selects and where it sends them, resolved at its first run (relative times fixed).
    selection   jsonb NOT NULL,
    -- The last lake archive id done (0: none yet), the messages enqueued and the rows skipped.
    position    bigint NOT NULL DEFAULT 0 CHECK (position >= 0),
    enqueued    bigint NOT NULL DEFAULT 0 CHECK (enqueued >= 0),
    skipped     bigint NOT NULL DEFAULT 0 CHECK (skipped >= 0),
    -- The first 100 rows skipped: lake id, original message_id, reason.
    skips       jsonb NOT NULL DEFAULT '[]',
    started_by  text NOT NULL DEFAULT session_user,
    started_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE replays IS
    'Replays of archived messages from the lake (outbox-relay pipeline replay): one row each.';

-- The replay `p_name`; started with `p_selection` if it is new and p_create. The caller compares
-- the selection it finds with its own.
CREATE FUNCTION start_replay(p_name text, p_selection jsonb, p_create boolean DEFAULT true)
RETURNS SETOF replays
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    IF p_name IS NULL OR p_name !~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$' THEN
        RAISE EXCEPTION 'start_replay: a replay name is 1 to 128 letters, digits, ".", "_", ":" '
                        'or "-", starting with a letter or digit; not %', quote_nullable(p_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_create THEN
        IF p_selection IS NULL OR jsonb_typeof(p_selection) <> 'object' THEN
            RAISE EXCEPTION 'start_replay: the selection must be a JSON object'
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        INSERT INTO replays (name, selection) VALUES (p_name, p_selection)
        ON CONFLICT (name) DO NOTHING;
    END IF;
    PERFORM _replay_owned(p_name);
    RETURN QUERY SELECT * FROM replays r WHERE r.name = p_name;
END;
$$;

-- Refuses (insufficient_privilege) a replay another login started.
CREATE FUNCTION _replay_owned(p_name text) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_by text;
BEGIN
    SELECT r.started_by INTO v_by FROM replays r WHERE r.name = p_name;
    IF FOUND AND v_by IS DISTINCT FROM session_user::text THEN
        RAISE EXCEPTION 'replay % was started by another login (%); only it can see or continue '
                        'it', quote_literal(p_name), v_by USING ERRCODE = 'insufficient_privilege';
    END IF;
END;
$$;

-- The fence of every write to a replay: its position must be p_after, and what follows lies past
-- it. Locks the row until the transaction ends.
CREATE FUNCTION _replay_moves(p_name text, p_after bigint, p_last bigint) RETURNS void
LANGUAGE plpgsql
SET search_path FROM CURRENT
AS $$
DECLARE
    v_position bigint;
BEGIN
    SELECT r.position INTO v_position FROM replays r WHERE r.name = p_name FOR UPDATE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'replay: there is no replay %', quote_literal(p_name)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM _replay_owned(p_name);
    IF v_position IS DISTINCT FROM p_after THEN
        RAISE EXCEPTION 'replay % has moved on from position % to % (another run of it is going)',
            quote_literal(p_name), p_after, v_position
            USING ERRCODE = 'object_in_use';
    END IF;
    IF p_last IS NULL OR p_last <= p_after THEN
        RAISE EXCEPTION 'replay: a batch must lie past the position it names (% .. %)',
            p_after, p_last USING ERRCODE = 'invalid_parameter_value';
    END IF;
END;
$$;

-- Enqueue one batch of replay `p_name` — the lake rows with ids p_ids, all past p_after, in that
-- order — and move its position to the greatest of them, in the caller's transaction; refused
-- (object_in_use) unless the position is p_after. Each message's headers are its lake headers
-- (JSON text, kept exactly: no client round trip through floats) merged with its provenance.
-- Returns how many messages were enqueued.
CREATE FUNCTION replay_batch(p_name text, p_after bigint, p_ids bigint[], p_exchanges text[],
                             p_routing_keys text[], p_bodies bytea[], p_headers text[],
                             p_provenance jsonb[], p_properties text[], p_ordering_keys text[],
                             p_message_ids uuid[])
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
DECLARE
    v_n integer := coalesce(cardinality(p_ids), 0);
BEGIN
    PERFORM _replay_owned(p_name);
    IF v_n = 0 OR array_position(p_ids, NULL) IS NOT NULL
       OR coalesce(cardinality(p_message_ids), 0) <> v_n
       OR array_position(p_message_ids, NULL) IS NOT NULL THEN
        RAISE EXCEPTION 'replay_batch: a batch names at least one lake id and a message_id for '
                        'each, none of them null' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF (SELECT min(i) FROM unnest(p_ids) AS i) <= p_after THEN
        RAISE EXCEPTION 'replay_batch: lake id % is not past the position %',
            (SELECT min(i) FROM unnest(p_ids) AS i), p_after
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    PERFORM _replay_moves(p_name, p_after, (SELECT max(i) FROM unnest(p_ids) AS i));
    PERFORM enqueue_many(p_exchanges, p_routing_keys, p_bodies,
                         ARRAY(SELECT coalesce(h::jsonb, '{}') || coalesce(p, '{}')
                               FROM unnest(p_headers, p_provenance) WITH ORDINALITY AS u(h, p, i)
                               ORDER BY i),
                         ARRAY(SELECT coalesce(x::jsonb, '{}')
                               FROM unnest(p_properties) WITH ORDINALITY AS u(x, i) ORDER BY i),
                         NULL, p_ordering_keys, p_message_ids);
    UPDATE replays
    SET position = (SELECT max(i) FROM unnest(p_ids) AS i), enqueued = enqueued + v_n,
        updated_at = now()
    WHERE name = p_name;
    RETURN v_n;
END;
$$;

-- Skip lake row p_id of replay `p_name` (the outbox refused it: p_reason says why), moving the
-- position to it under the same fence as a batch, and record it among the first 100 skipped.
CREATE FUNCTION replay_skip(p_name text, p_after bigint, p_id bigint, p_message_id text,
                            p_reason text)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path FROM CURRENT
AS $$
BEGIN
    PERFORM _replay_moves(p_name, p_after, p_id);
    UPDATE replays
    SET position = p_id, skipped = skipped + 1, updated_at = now(),
        skips = CASE WHEN jsonb_array_length(skips) < 100
                     THEN skips || jsonb_build_array(jsonb_build_object(
                              'id', p_id, 'message_id', p_message_id,
                              'reason', left(coalesce(p_reason, ''), 1000)))
                     ELSE skips END
    WHERE name = p_name;
END;
$$;
