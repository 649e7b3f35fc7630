-- 0008: least privilege. `outbox-relay roles` creates the producer, relay and operator roles and
-- grants them what their job needs (relay/roles.sql); this migration makes that possible.
--
-- A producer gets EXECUTE on the enqueue functions and no right on any table, so the functions
-- run as the schema's owner (SECURITY DEFINER; their search_path has been pinned since 0002, so
-- a caller's objects cannot stand in for ours). They check every argument and touch nothing but
-- the new message. The deferred trigger that releases a keyed message at commit runs after
-- enqueue has returned, as the producer, so it too runs as the owner.
ALTER FUNCTION enqueue(text, text, bytea, jsonb, jsonb, timestamptz, text, uuid) SECURITY DEFINER;
ALTER FUNCTION enqueue_json(text, text, jsonb, jsonb, jsonb, timestamptz, text, uuid)
    SECURITY DEFINER;
ALTER FUNCTION _key_gate_at_commit() SECURITY DEFINER;

-- Likewise an operator moves dead rows back into the queue only through replay_dead (which keeps
-- a key's order and records where the message came from) and frees a key only through
-- release_key: neither needs the right to write messages or key state directly.
ALTER FUNCTION replay_dead(bigint[], text, text) SECURITY DEFINER;
ALTER FUNCTION release_key(text, boolean) SECURITY DEFINER;

-- PostgreSQL lets PUBLIC execute every new function. Here nobody but the owner and the roles
-- `outbox-relay roles` grants may: a SECURITY DEFINER function callable by anyone would be a way
-- around the table grants. `migrate` revokes it again after every run (query
-- revoke_public_execute), which covers the functions later migrations create: a per-schema
-- ALTER DEFAULT PRIVILEGES cannot take away what PostgreSQL grants PUBLIC by default.
DO $$
BEGIN
    EXECUTE format('REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA %I FROM PUBLIC', current_schema());
END
$$;
