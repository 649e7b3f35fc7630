-- What each role may do in one outbox schema, applied by `outbox-relay roles` (and again by
-- `migrate` once the roles exist, so later migrations' objects are covered). `{schema}`,
-- `{producer}`, `{relay}` and `{operator}` are replaced by quoted, validated identifiers; nothing
-- else is spliced in. The grants are rebuilt from nothing each time, so the file is the whole truth.
REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {producer}, {relay}, {operator};
REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {producer}, {relay}, {operator};
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM {producer}, {relay}, {operator};
GRANT USAGE ON SCHEMA {schema} TO {producer}, {relay}, {operator};

-- Producers: enqueue, nothing else. The functions run as the owner (migration 0008), so a producer
-- can neither read nor change any row, its own included, once enqueued.
GRANT EXECUTE ON FUNCTION
    {schema}.enqueue(text, text, bytea, jsonb, jsonb, timestamptz, text, uuid),
    {schema}.enqueue_json(text, text, jsonb, jsonb, jsonb, timestamptz, text, uuid),
    {schema}.enqueue_many(text[], text[], bytea[], jsonb[], jsonb[], timestamptz[], text[], uuid[])
TO {producer};

-- Relays: claim, lease, settle (archive, dead-letter, retry), release keys, prune the archive by
-- its retention, and read what the gauges count. No INSERT into messages (a relay cannot forge a
-- message), no change to settings or key policies, no DDL.
GRANT SELECT, UPDATE, DELETE ON {schema}.messages TO {relay};
GRANT SELECT, INSERT, DELETE ON {schema}.archive TO {relay};
GRANT SELECT, INSERT ON {schema}.dead TO {relay};
GRANT SELECT, UPDATE ON {schema}.keys TO {relay};
GRANT SELECT, INSERT, UPDATE ON {schema}.key_releases TO {relay};
GRANT SELECT, INSERT ON {schema}.blocked_keys TO {relay};
GRANT SELECT ON {schema}.key_policies, {schema}.schema_migrations TO {relay};
GRANT EXECUTE ON FUNCTION
    {schema}._keys_settled(text[], bigint[], text[], uuid[]),
    {schema}.key_policy(text)
TO {relay};

-- Operators: the CLI's dead-letter, archive, keys and stats commands and the data pipeline:
-- read everything, purge dead rows, prune the archive, set key policies; replay and release keys
-- only through the functions that do it in order (they run as the owner, migration 0008). No
-- write to a waiting message, no change to settings, no DDL. UPDATE of dead.detail is there only
-- because replay and purge lock their batch with FOR UPDATE, which asks for it.
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {operator};
GRANT DELETE ON {schema}.dead, {schema}.archive TO {operator};
GRANT UPDATE (detail) ON {schema}.dead TO {operator};
GRANT INSERT, UPDATE, DELETE ON {schema}.key_policies TO {operator};
GRANT EXECUTE ON FUNCTION
    {schema}.dead_matches({schema}.dead, text[], text, text, text, timestamptz, timestamptz,
                          uuid[]),
    {schema}.replay_dead(bigint[], text, text),
    {schema}.release_key(text, boolean),
    {schema}.key_policy(text)
TO {operator};
