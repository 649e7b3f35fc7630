-- What each role may do in one outbox schema. `{schema}`, `{producer}`, `{relay}` and `{operator}`
-- are replaced by quoted, validated identifiers; nothing else is spliced in.
--
-- `outbox-relay roles` runs the whole file: the grants are rebuilt from nothing, so the file is the
-- whole truth. `migrate` (once the roles exist) runs only the part after `-- grants --`, so a new
-- migration's objects are covered but nothing is taken away: relays of the previous version,
-- still running during a rolling upgrade, keep what their statements need until `roles` is run
-- after the rollout (CHANGELOG.md says when an upgrade needs that).
REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {producer}, {relay}, {operator};
REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {producer}, {relay}, {operator};
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM {producer}, {relay}, {operator};

-- grants --
GRANT USAGE ON SCHEMA {schema} TO {producer}, {relay}, {operator};

-- Producers: enqueue, nothing else. The functions run as the owner (migration 0008), so a producer
-- can neither read nor change any row, its own included, once enqueued.
GRANT EXECUTE ON FUNCTION
    {schema}.enqueue(text, text, bytea, jsonb, jsonb, timestamptz, text, uuid),
    {schema}.enqueue_json(text, text, jsonb, jsonb, jsonb, timestamptz, text, uuid),
    {schema}.enqueue_many(text[], text[], bytea[], jsonb[], jsonb[], timestamptz[], text[], uuid[]),
    -- Replays from the lake (`pipeline replay`, migration 0021) enqueue, so they run as producers;
    -- these functions enqueue through enqueue_many and keep each replay's position.
    {schema}.start_replay(text, jsonb, boolean),
    {schema}.replay_batch(text, bigint, bigint[], text[], text[], bytea[], text[], jsonb[], text[],
                          text[], uuid[]),
    {schema}.replay_skip(text, bigint, bigint, text, text)
TO {producer};

-- Relays: claim and lease (functions since migration 0015; relays of earlier versions ran their
-- own statements, which need the UPDATE of the lease columns only), settle, bury, release
-- stranded keyed rows, forget idle keys, move the ready lane's orphans and stragglers, find where
-- its first window starts and reclaim its segments (functions that move whole rows and run as
-- the owner, migrations 0013, 0015 and 0022), prune the archive by its retention, and read what
-- the gauges count. A relay cannot write
-- a message's content, destination, key or gate, insert or delete one, insert a dead or archived
-- row, or touch keys, blocks, settings or key policies. (FOR UPDATE in the claim needs UPDATE on a
-- column, which the lease columns are.)
GRANT SELECT ON {schema}.messages, {schema}.archive, {schema}.dead, {schema}.blocked_keys,
                {schema}.ready, {schema}.claims, {schema}.done, {schema}.schema_migrations
TO {relay};
GRANT UPDATE (attempts, claim_id, claimed_by, claimed_at, available_at) ON {schema}.messages
TO {relay};
GRANT DELETE ON {schema}.archive TO {relay};
GRANT EXECUTE ON FUNCTION
    {schema}.settle(uuid, bigint[], bigint[], text[], text[], bigint[], float8[], text[], boolean[],
                    boolean[], bigint[], boolean),
    {schema}.bury_exhausted(integer, integer),
    {schema}.release_stranded(integer),
    {schema}.forget_idle_keys(interval, text, integer),
    {schema}.claim_batch(integer, bigint, uuid, text, float8, text, text, xid8, bigint,
                         boolean, boolean),
    {schema}.settle_then_claim(uuid, bigint[], bigint[], text[], text[], bigint[], float8[],
                               text[], boolean[], boolean[], bigint[], boolean, integer, bigint,
                               uuid, text, float8, text, text, xid8, bigint, boolean, boolean),
    {schema}.extend_leases(uuid, bigint[], float8),
    {schema}.release_orphans(timestamptz, integer),
    {schema}.reclaim_segment(integer),
    {schema}.lane_start(),
    {schema}.sweep_stragglers(text, integer),
    {schema}.use_fast_lane(),
    {schema}.lane_gauges(),
    {schema}.arm_doorbell(),
    {schema}.use_doorbell()
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
    {schema}.key_policy(text),
    {schema}.lane_gauges()
TO {operator};
