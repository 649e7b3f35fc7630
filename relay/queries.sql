-- Every statement the relay runs, by name. `{schema}` is replaced by the quoted, validated schema name
-- and `{new_channel}` by the quoted NOTIFY channel; nothing else is ever spliced into these texts.

-- name: claim_batch
-- Lease up to %(limit)s due rows under a new claim id, counting the attempt. SKIP LOCKED lets replicas
-- claim side by side; the lease is judged by the database clock (now()), never a relay's.
WITH due AS MATERIALIZED (
    SELECT id
    FROM {schema}.messages
    WHERE available_at <= now()
    ORDER BY available_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.messages AS m
SET attempts = m.attempts + 1,
    claim_id = %(claim_id)s,
    claimed_by = %(claimed_by)s,
    claimed_at = now(),
    available_at = now() + make_interval(secs => %(lease)s)
FROM due
WHERE m.id = due.id
RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers, m.properties,
          m.ordering_key, m.created_at, m.attempts, m.ambiguous, m.last_error;

-- name: archive_published
-- Move confirmed rows to the archive. Rows whose claim_id changed (re-claimed elsewhere) are left alone.
WITH done AS (
    DELETE FROM {schema}.messages
    WHERE id = ANY(%(ids)s::bigint[]) AND claim_id = %(claim_id)s
    RETURNING message_id, exchange, routing_key, body, headers, properties, ordering_key,
              attempts, created_at
)
INSERT INTO {schema}.archive (message_id, exchange, routing_key, body, headers, properties,
                              ordering_key, attempts, created_at)
SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key,
       attempts, created_at
FROM done;

-- name: dead_letter
-- Move failed rows to dead with a reason each, under the same fence as archive_published.
WITH failed AS (
    SELECT *
    FROM unnest(%(ids)s::bigint[], %(reasons)s::text[], %(details)s::text[]) AS f(id, reason, detail)
), gone AS (
    DELETE FROM {schema}.messages AS m
    USING failed AS f
    WHERE m.id = f.id AND m.claim_id = %(claim_id)s
    RETURNING m.message_id, m.exchange, m.routing_key, m.body, m.headers, m.properties,
              m.ordering_key, m.attempts, m.created_at, f.reason, f.detail
)
INSERT INTO {schema}.dead (message_id, exchange, routing_key, body, headers, properties,
                           ordering_key, attempts, created_at, reason, detail)
SELECT message_id, exchange, routing_key, body, headers, properties, ordering_key,
       attempts, created_at, reason, detail
FROM gone;

-- name: retry_later
-- End the lease of rows to be tried again after a delay each. A refund gives back the attempt the
-- claim counted (the outcome was unknown, so it may have arrived), and counts it as ambiguous instead.
UPDATE {schema}.messages AS m
SET available_at = now() + make_interval(secs => r.delay),
    attempts = m.attempts - r.refund::int,
    ambiguous = m.ambiguous + r.refund::int,
    claim_id = NULL,
    claimed_by = NULL,
    claimed_at = NULL,
    last_error = r.error
FROM unnest(%(ids)s::bigint[], %(delays)s::float8[], %(errors)s::text[], %(refunds)s::bool[])
     AS r(id, delay, error, refund)
WHERE m.id = r.id AND m.claim_id = %(claim_id)s;

-- name: message_stats
SELECT
    count(*) FILTER (WHERE NOT leased) AS pending,
    count(*) FILTER (WHERE NOT leased AND available_at <= now()) AS due,
    count(*) FILTER (WHERE NOT leased AND available_at > now()) AS scheduled,
    count(*) FILTER (WHERE leased) AS in_flight,
    extract(epoch FROM now() - min(created_at) FILTER (WHERE NOT leased AND available_at <= now()))
        AS oldest_pending_age
FROM (
    SELECT created_at, available_at, claim_id IS NOT NULL AND available_at > now() AS leased
    FROM {schema}.messages
) AS m;

-- name: archive_count
SELECT count(*) FROM {schema}.archive;

-- name: dead_by_reason
SELECT reason, count(*) FROM {schema}.dead GROUP BY reason ORDER BY reason;

-- name: listen
LISTEN {new_channel};

-- name: enqueue
-- The casts pin the overload, so a missing function can only mean a missing migration. A delay is
-- added to the database's clock, not the producer's.
SELECT {schema}.enqueue(
    %(exchange)s::text, %(routing_key)s::text, %(body)s::bytea, %(headers)s::jsonb,
    %(properties)s::jsonb,
    coalesce(%(available_at)s::timestamptz, clock_timestamp() + %(delay)s::interval),
    %(ordering_key)s::text, %(message_id)s::uuid);

-- name: migration_lock
-- One migrate at a time per schema, across processes and hosts (session-level advisory lock).
SELECT pg_advisory_lock(hashtextextended('outbox-relay migrate ' || %(schema)s, 0));

-- name: migration_unlock
SELECT pg_advisory_unlock(hashtextextended('outbox-relay migrate ' || %(schema)s, 0));

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: create_migrations_table
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer PRIMARY KEY,
    name       text        NOT NULL,
    checksum   text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: applied_migrations
SELECT version, name, checksum FROM {schema}.schema_migrations ORDER BY version;

-- name: migration_search_path
-- Migrations create unqualified objects in the outbox schema; pg_temp last so it cannot shadow them.
SET LOCAL search_path TO {schema}, pg_temp;

-- name: record_migration
INSERT INTO {schema}.schema_migrations (version, name, checksum)
VALUES (%(version)s, %(name)s, %(checksum)s);

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations;
