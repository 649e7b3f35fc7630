-- What `outbox-relay migrate` runs (relay/postgres/migrate.py), as the schema's owner.
-- `{schema}` is replaced by the quoted, validated schema name and `{new_channel}` by the quoted
-- NOTIFY channel; nothing else is ever spliced into these texts.

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migrations_recorded
-- Whether this schema has a migrations table yet (`migrate --status` and `--print-sql` only read).
SELECT to_regclass(%(table)s) IS NOT NULL;

-- name: applied_migrations
SELECT version, name, checksum FROM {schema}.schema_migrations ORDER BY version;

-- name: migration_search_path
-- Migrations create unqualified objects in the outbox schema; pg_temp last so it cannot shadow them.
SET LOCAL search_path TO {schema}, pg_temp;

-- name: migration_lock_timeout
-- A migration waits this long for a table lock (producers, relays and readers hold theirs briefly),
-- then gives up, which lets everyone queued behind its request go on, and tries again: a long
-- wait would hold every producer of that table behind it.
SET LOCAL lock_timeout = '2s';

-- name: record_migration
INSERT INTO {schema}.schema_migrations (version, name, checksum)
VALUES (%(version)s, %(name)s, %(checksum)s);

-- name: revoke_public_execute
-- After every migrate: only the owner and the roles granted by `outbox-relay roles` may call the
-- schema's functions (PostgreSQL grants EXECUTE to PUBLIC on every new function).
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} FROM PUBLIC;
