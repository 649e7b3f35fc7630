-- What each role may do in one outbox schema. `{schema}`, `{producer}`, `{relay}`, `{operator}`
-- and `{viewer}` are replaced by quoted, validated identifiers; nothing else is spliced in.
--
-- `outbox-relay roles` runs the whole file: the grants are rebuilt from nothing, so the file is the
-- whole truth. `migrate` (once the roles exist) runs only the part after `-- grants --`, so a new
-- migration's objects are covered but nothing is taken away: relays of the previous version,
-- still running during a rolling upgrade, keep what their statements need until `roles` is run
-- after the rollout (CHANGELOG.md says when an upgrade needs that). A role that `roles` of an
-- earlier version did not create (the viewer) gets statements of its own after `-- grants --`,
-- naming no other role: `migrate` leaves them out until `roles` has created it.
-- The viewer is read-only: dashboards and the web console's read-only mode; SELECT only.
REVOKE ALL ON ALL TABLES IN SCHEMA {schema} FROM {producer}, {relay}, {operator}, {viewer};
REVOKE ALL ON ALL SEQUENCES IN SCHEMA {schema} FROM {producer}, {relay}, {operator}, {viewer};
REVOKE ALL ON ALL FUNCTIONS IN SCHEMA {schema} FROM {producer}, {relay}, {operator}, {viewer};

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

-- Relays: claim (which rechecks keyed rows a race left gated), fetch what they claimed, renew,
-- settle, prune the archive by its retention, arm the doorbell (functions that run as the owner, migration 0026), and read
-- what the gauges count. Nothing else: no UPDATE, DELETE or TRUNCATE on any table (those would
-- let a relay login LOCK a table producers or other relays write to), and no function that leaves
-- a lock a producer needs in the caller's transaction (keys are forgotten by operators).
-- Relays of earlier versions ran statements of their own that need more (UPDATE of the lease
-- columns of messages, DELETE on archive, the functions of 0013-0025): `migrate` never takes
-- grants away, so they keep them until `roles` runs after the rollout; running the earlier
-- version's own `roles` gives them back for a rollback (docs/guides/upgrading.md).
GRANT SELECT ON {schema}.messages, {schema}.archive, {schema}.dead, {schema}.blocked_keys,
                {schema}.schema_migrations
TO {relay};
GRANT EXECUTE ON FUNCTION
    {schema}.claim({schema}.claim_request),
    {schema}.settle(uuid, bigint[], text[], text[], text[], float8[], bigint[], boolean,
                    {schema}.claim_request),
    {schema}.extend_leases(uuid, bigint[], float8),
    {schema}.prune_archive(timestamptz, integer),
    {schema}.arm_doorbell(),
    {schema}.use_doorbell()
TO {relay};

-- Operators: the CLI's dead-letter, archive, keys and stats commands and the data pipeline:
-- read everything, purge dead rows, prune the archive, set key policies, forget idle keys; replay
-- and release keys only through the functions that do it in order (they run as the owner,
-- migration 0008). No
-- write to a waiting message, no change to settings, no DDL. UPDATE of dead.detail is there only
-- because replay and purge lock their batch with FOR UPDATE, which asks for it.
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {operator};
GRANT DELETE ON {schema}.dead, {schema}.archive TO {operator};
GRANT UPDATE (detail) ON {schema}.dead TO {operator};
GRANT INSERT, UPDATE, DELETE ON {schema}.key_policies TO {operator};
-- The web console records each bulk action it runs (migration 0030): who, the filter, the outcome.
GRANT INSERT, UPDATE (done, state, detail, beat_at, finished_at) ON {schema}.console_actions
TO {operator};
GRANT EXECUTE ON FUNCTION
    {schema}.dead_matches({schema}.dead, text[], text, text, text, timestamptz, timestamptz,
                          uuid[]),
    {schema}.replay_dead(bigint[], text, text),
    {schema}.release_key(text, boolean),
    {schema}.key_policy(text),
    {schema}.forget_idle_keys(interval, text, integer),
    {schema}.prune_archive(timestamptz, integer)
TO {operator};

-- Viewers: read-only: dashboards and the web console's read-only mode; SELECT only. They read
-- everything an operator reads, and call dead_matches (a pure SQL function, the dead-letter
-- filters select with it). No INSERT, UPDATE, DELETE or TRUNCATE (so no SELECT ... FOR UPDATE
-- either), no other function: nothing a viewer login runs changes a row or takes a lock stronger
-- than a read's.
GRANT USAGE ON SCHEMA {schema} TO {viewer};
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {viewer};
GRANT EXECUTE ON FUNCTION
    {schema}.dead_matches({schema}.dead, text[], text, text, text, timestamptz, timestamptz,
                          uuid[])
TO {viewer};
