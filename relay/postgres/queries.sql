-- Every statement the relay runs, by name. `{schema}` is replaced by the quoted, validated schema name
-- and `{new_channel}` by the quoted NOTIFY channel; nothing else is ever spliced into these texts.

-- name: claim_batch
-- Lease up to %(limit)s due rows that may go now under a new claim id, counting the attempt: the
-- slow lane's (messages: scheduled, keyed, retried, replayed), then a page of the ready lane's
-- window (migration 0015, docs/decisions/0004). The window's state comes back in a trailer row
-- (message_id NULL) and goes into the next claim. SKIP LOCKED lets replicas claim side by side;
-- leases are judged by the database clock, never a relay's. headers and properties come back as
-- text: the relay decodes them row by row, so one row it cannot read is dead-lettered on its own.
-- The batch stops at %(max_bytes)s of bodies, headers and properties (at least one row), so big
-- messages cannot make a batch outgrow the relay's memory; `locked` > rows returned (per lane)
-- tells the relay more are waiting.
SELECT *
FROM {schema}.claim_batch(%(limit)s, %(max_bytes)s, %(claim_id)s, %(claimed_by)s, %(lease)s,
                          %(prev)s, %(hi)s, %(xid)s::xid8, %(cursor)s, %(ready_first)s,
                          %(verify)s);

-- name: claim_orphans
-- The same for orphans: rows whose lease ran out without a settle because their relay died.
-- The loop takes them one at a time, so a row that kills its relay can only take itself down.
-- Orphans that used up their attempts are bury_exhausted's: their body never reaches a relay.
WITH due AS MATERIALIZED (
    SELECT id
    FROM {schema}.messages
    WHERE claim_id IS NOT NULL AND available_at <= now() AND attempts < %(max_attempts)s
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
RETURNING m.id, m.message_id, m.exchange, m.routing_key, m.body, m.headers::text,
          m.properties::text, m.ordering_key, m.created_at, m.attempts, m.ambiguous, m.last_error,
          m.seq, m.replays, m.replayed_at, m.replayed_from, 1::bigint AS locked;

-- name: bury_exhausted
-- Up to %(limit)s orphans that used up their attempts, moved to dead in SQL (migration 0013).
SELECT buried_id, buried_attempts
FROM {schema}.bury_exhausted(%(max_attempts)s, %(limit)s);

-- name: extend_leases
-- A heartbeat, or the check before publishing: push the lease of rows this claim still holds, in
-- either lane, and say which those are (rows re-claimed elsewhere are skipped, and must not be
-- published).
SELECT id FROM {schema}.extend_leases(%(claim_id)s, %(ids)s::bigint[], %(lease)s) AS id;

-- name: release_orphans
-- One page of moving the ready lane's orphans (leases run out since %(after)s) into messages,
-- where the orphan claim and bury_exhausted take them (migration 0015).
SELECT looked, moved, last_until, checked_at
FROM {schema}.release_orphans(%(after)s, %(limit)s);

-- name: reclaim_segment
-- TRUNCATE one segment of the ready lane's ring if every row in it is done (migration 0015).
SELECT {schema}.reclaim_segment(%(seg)s);

-- name: use_fast_lane
-- From now on producers use the ready lane (a relay of this version is running).
SELECT {schema}.use_fast_lane();

-- name: settle
-- Every transition of one claim, in one statement and one transaction (migration 0013).
SELECT archived, dead, retried, released, blocked
FROM {schema}.settle(
    %(claim_id)s, %(archive)s::bigint[], %(dead)s::bigint[], %(reasons)s::text[],
    %(details)s::text[], %(retry)s::bigint[], %(delays)s::float8[], %(errors)s::text[],
    %(refunds)s::boolean[], %(ambiguous)s::boolean[], %(resent)s::bigint[], %(durable)s);

-- name: settle_then_claim
-- settle, then claim_batch for the next batch, in one transaction and one round trip (migration
-- 0020): claim_batch's rows and trailer, then a row with the settle's counts (lane 'settled').
SELECT *
FROM {schema}.settle_then_claim(
    %(claim_id)s, %(archive)s::bigint[], %(dead)s::bigint[], %(reasons)s::text[],
    %(details)s::text[], %(retry)s::bigint[], %(delays)s::float8[], %(errors)s::text[],
    %(refunds)s::boolean[], %(ambiguous)s::boolean[], %(resent)s::bigint[], %(durable)s,
    %(limit)s, %(max_bytes)s, %(next_id)s, %(claimed_by)s, %(lease)s, %(prev)s, %(hi)s,
    %(xid)s::xid8, %(cursor)s, %(ready_first)s, %(verify)s);

-- name: release_stranded
-- Keyed rows whose producer committed while their predecessor was being settled (migration 0012).
SELECT looked, released FROM {schema}.release_stranded(%(limit)s);

-- name: forget_idle_keys
-- One page of a pass that forgets keys idle for %(idle)s seconds (migration 0014).
SELECT forgotten, last_key
FROM {schema}.forget_idle_keys(make_interval(secs => %(idle)s), %(after)s, %(limit)s);

-- name: message_stats
-- The ready lane's part comes from lane_gauges (migration 0019): index look-ups whose cost follows
-- the backlog, not the ring.
WITH slow AS (
    SELECT
        count(*) FILTER (WHERE NOT leased) AS pending,
        count(*) FILTER (WHERE NOT leased AND available_at <= now()) AS due,
        count(*) FILTER (WHERE NOT leased AND available_at > now()) AS scheduled,
        count(*) FILTER (WHERE leased) AS in_flight,
        min(created_at) FILTER (WHERE NOT leased AND available_at <= now()) AS oldest
    FROM (
        SELECT created_at, available_at, claim_id IS NOT NULL AND available_at > now() AS leased
        FROM {schema}.messages
    ) AS m
)
SELECT slow.pending + fast.due AS pending, slow.due + fast.due AS due, slow.scheduled,
       slow.in_flight + fast.in_flight AS in_flight,
       extract(epoch FROM now() - least(slow.oldest, fast.oldest)) AS oldest_pending_age
FROM slow, {schema}.lane_gauges() AS fast;

-- name: blocked_key_count
SELECT count(*) FROM {schema}.blocked_keys;

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

-- name: enqueue_many
-- Many messages in one round trip; delays (like enqueue's) are added to the database's clock.
SELECT id FROM {schema}.enqueue_many(
    %(exchanges)s::text[], %(routing_keys)s::text[], %(bodies)s::bytea[], %(headers)s::jsonb[],
    %(properties)s::jsonb[],
    ARRAY(SELECT coalesce(a, clock_timestamp() + d)
          FROM unnest(%(available_at)s::timestamptz[], %(delays)s::interval[])
               WITH ORDINALITY AS t(a, d, n)
          ORDER BY n),
    %(ordering_keys)s::text[], %(message_ids)s::uuid[]) AS id;

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

-- name: revoke_public_execute
-- After every migrate: only the owner and the roles granted by `outbox-relay roles` may call the
-- schema's functions (PostgreSQL grants EXECUTE to PUBLIC on every new function).
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} FROM PUBLIC;

-- name: relay_session
-- Each pooled connection of a relay. Its claims are durable before anything is published: a
-- server that does not wait for the WAL flush by default (`off`) is overruled for this session
-- (stricter settings are kept); settles may then opt out (settle's p_durable). And it reads
-- committed data: the key gate's decisions rest on what each statement sees committed.
SELECT set_config('synchronous_commit', 'on', false)
WHERE current_setting('synchronous_commit') = 'off'
UNION ALL
SELECT set_config('default_transaction_isolation', 'read committed', false);

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations;

-- name: blocked_keys
-- Keys held by the 'block' policy, oldest first, with how many messages wait behind each.
SELECT b.ordering_key, b.message_id, b.seq, b.reason, b.blocked_at,
       (SELECT count(*) FROM {schema}.messages m WHERE m.ordering_key = b.ordering_key) AS waiting
FROM {schema}.blocked_keys AS b
ORDER BY b.blocked_at, b.ordering_key;

-- name: release_key
SELECT {schema}.release_key(%(key)s, %(replay)s);

-- name: set_fast_lane
-- Turn the ready lane on or off for producers (migration 0018; the schema owner's).
SELECT fast_lane, fast_lane_off FROM {schema}.set_fast_lane(%(on)s);

-- name: fast_lane_state
-- The lane's switch, how many of its rows still wait, and the database's clock.
SELECT s.fast_lane, s.fast_lane_off,
       (SELECT count(*) FROM {schema}.waiting w WHERE w.lane = 'ready') AS waiting,
       now() AS checked_at
FROM {schema}.settings s;

-- name: transactions_since
-- Other sessions on this database with a transaction open since before %(since)s (autovacuum's
-- aside: it writes no message), plus every prepared transaction (it may have begun before, and
-- commits whenever someone says); and the sessions this role cannot see into: another role's
-- without pg_read_all_stats (PostgreSQL then shows no backend_type, state or xact_start), or
-- one with track_activities off (state 'disabled').
SELECT count(*) FILTER (WHERE a.backend_type <> 'autovacuum worker' AND a.xact_start < %(since)s)
           + (SELECT count(*) FROM pg_prepared_xacts p WHERE p.database = current_database())
           AS open_before,
       count(*) FILTER (WHERE a.backend_type IS NULL OR a.state = 'disabled') AS unseen
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid();

-- name: key_policies
SELECT prefix, on_dead, concurrency, extract(epoch FROM min_interval)::float8
FROM {schema}.key_policies
ORDER BY prefix;

-- name: set_key_policy
INSERT INTO {schema}.key_policies AS p (prefix, on_dead, concurrency, min_interval)
VALUES (%(prefix)s, coalesce(%(on_dead)s, 'block'), coalesce(%(concurrency)s, 1),
        make_interval(secs => coalesce(%(min_interval)s, 0)))
ON CONFLICT (prefix) DO UPDATE
SET on_dead = coalesce(%(on_dead)s, p.on_dead),
    concurrency = coalesce(%(concurrency)s, p.concurrency),
    min_interval = coalesce(make_interval(secs => %(min_interval)s), p.min_interval)
RETURNING prefix, on_dead, concurrency, extract(epoch FROM min_interval)::float8;

-- name: delete_key_policy
DELETE FROM {schema}.key_policies WHERE prefix = %(prefix)s AND prefix <> '';

-- name: observe
-- The gauges' one query: backlog by state, the longest wait, dead rows, blocked keys, and the
-- database's health. Every count of messages reads an index (capped at a million), never the
-- table; the ready lane's come from lane_gauges (index look-ups, migration 0019).
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                           WHERE claim_id IS NULL AND NOT gated AND available_at <= now()
                           LIMIT 1000000) AS s)
    + lane.due AS due,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                           WHERE claim_id IS NULL AND NOT gated AND available_at > now()
                           LIMIT 1000000) AS s) AS scheduled,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages WHERE gated
                           LIMIT 1000000) AS s) AS gated,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                           WHERE claim_id IS NOT NULL AND available_at > now()
                           LIMIT 1000000) AS s)
    + lane.in_flight AS in_flight,
    extract(epoch FROM now() - least(
        (SELECT available_at FROM {schema}.messages
         WHERE claim_id IS NULL AND NOT gated AND available_at <= now()
         ORDER BY available_at, id LIMIT 1),
        -- The ready lane's (lane_gauges, migration 0019): the oldest of the first thousand rows
        -- past the newest one claimed — an index range where a backlog waits. A row left behind
        -- the newest claim (its transaction committed long after later ones; the next window
        -- claims it) is not counted: finding it takes an anti-join over the whole lane.
        lane.oldest
    )) AS oldest_due,
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.dead LIMIT 1000000) AS s) AS dead,
    (SELECT count(*) FROM {schema}.blocked_keys) AS blocked_keys,
    (SELECT n_dead_tup FROM pg_stat_user_tables
     WHERE relid = to_regclass(%(messages)s)) AS dead_tuples,
    (SELECT extract(epoch FROM last_autovacuum) FROM pg_stat_user_tables
     WHERE relid = to_regclass(%(messages)s)) AS last_autovacuum,
    -- Off for the server or for the table: the queue bloats and its statistics go stale.
    (SELECT current_setting('autovacuum')::boolean
            AND coalesce((SELECT option_value::boolean FROM pg_options_to_table(c.reloptions)
                          WHERE option_name = 'autovacuum_enabled'), true)
     FROM pg_class AS c WHERE c.oid = to_regclass(%(messages)s)) AS autovacuum_on,
    h.seconds, h.xids, h.pid, h.state
FROM {schema}.lane_gauges() AS lane
LEFT JOIN LATERAL (
    -- Who holds back the vacuum horizon: the session with the oldest snapshot.
    SELECT extract(epoch FROM now() - coalesce(xact_start, query_start)) AS seconds,
           age(backend_xmin) AS xids, pid, state
    FROM pg_stat_activity
    WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid()
    ORDER BY age(backend_xmin) DESC
    LIMIT 1
) AS h ON true;

-- name: table_inserts
-- Rows ever inserted into each outbox table, from PostgreSQL's statistics (cheap; refreshed by
-- PostgreSQL about once a second): differences over time give enqueue, publish and dead rates.
SELECT relname, n_tup_ins
FROM pg_stat_user_tables
WHERE schemaname = %(schema)s AND relname IN ('messages', 'archive', 'dead');

-- name: dead_list
SELECT message_id, failed_at, reason, detail, exchange, routing_key, ordering_key, seq, attempts,
       replays
FROM {schema}.dead AS d
WHERE {schema}.dead_matches(d, %(reasons)s::text[], %(exchange)s::text, %(routing_key)s::text,
                              %(key)s::text, %(since)s::timestamptz, %(until)s::timestamptz,
                              %(ids)s::uuid[])
ORDER BY failed_at, id
LIMIT %(limit)s;

-- name: dead_count
SELECT count(*)
FROM {schema}.dead AS d
WHERE {schema}.dead_matches(d, %(reasons)s::text[], %(exchange)s::text, %(routing_key)s::text,
                              %(key)s::text, %(since)s::timestamptz, %(until)s::timestamptz,
                              %(ids)s::uuid[]);

-- name: dead_get
SELECT message_id, failed_at, reason, detail, exchange, routing_key, ordering_key, seq, attempts,
       replays, created_at, ambiguous, replayed_at, replayed_from, headers, properties, body
FROM {schema}.dead
WHERE message_id = %(message_id)s
ORDER BY id DESC
LIMIT 1;

-- name: dead_last_id
-- Replay and purge act on the rows dead when they start, not on ones that die meanwhile.
SELECT coalesce(max(id), 0) FROM {schema}.dead;

-- name: dead_stats
SELECT reason, exchange, count(*) AS count, min(failed_at) AS first, max(failed_at) AS last
FROM {schema}.dead
GROUP BY reason, exchange
ORDER BY count(*) DESC, reason, exchange;

-- name: dead_replay_batch
-- One batch of a replay, one transaction: the filter's next rows by id after the last batch
-- (skipping rows another replay holds, and rows whose message_id is already waiting), moved by
-- replay_dead. Returns the batch's last id (NULL: nothing left) and how many rows moved.
WITH picked AS (
    SELECT d.id
    FROM {schema}.dead AS d
    WHERE {schema}.dead_matches(d, %(reasons)s::text[], %(exchange)s::text, %(routing_key)s::text,
                              %(key)s::text, %(since)s::timestamptz, %(until)s::timestamptz,
                              %(ids)s::uuid[])
      AND d.id > %(after)s AND d.id <= %(upto)s
      AND NOT EXISTS (SELECT 1 FROM {schema}.messages AS m WHERE m.message_id = d.message_id)
    ORDER BY d.id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
SELECT (SELECT max(id) FROM picked),
       (SELECT count(*)
        FROM {schema}.replay_dead(ARRAY(SELECT id FROM picked), %(to_exchange)s::text,
                                   %(to_routing_key)s::text));

-- name: dead_purge_batch
-- One batch of a purge, one transaction; the same shape as a replay's.
WITH gone AS (
    DELETE FROM {schema}.dead
    WHERE id IN (SELECT d.id
                 FROM {schema}.dead AS d
                 WHERE {schema}.dead_matches(d, %(reasons)s::text[], %(exchange)s::text, %(routing_key)s::text,
                              %(key)s::text, %(since)s::timestamptz, %(until)s::timestamptz,
                              %(ids)s::uuid[])
                   AND d.id > %(after)s AND d.id <= %(upto)s
                 ORDER BY d.id
                 LIMIT %(batch)s
                 FOR UPDATE SKIP LOCKED)
    RETURNING id
)
SELECT max(id), count(*) FROM gone;

-- name: archive_prune_batch
-- Delete the archive's oldest rows, by id (ids grow with published_at), if older than the cutoff.
-- Returns how many were deleted and how many of the batch were too young (then pruning is done).
WITH oldest AS (
    SELECT id, published_at FROM {schema}.archive ORDER BY id LIMIT %(batch)s
), gone AS (
    DELETE FROM {schema}.archive AS a
    USING oldest AS o
    WHERE a.id = o.id AND o.published_at < %(cutoff)s
    RETURNING a.id
)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM oldest WHERE published_at >= %(cutoff)s);

-- name: archive_stats
SELECT c.reltuples::bigint,
       pg_total_relation_size(c.oid),
       (SELECT published_at FROM {schema}.archive ORDER BY id LIMIT 1),
       (SELECT published_at FROM {schema}.archive ORDER BY id DESC LIMIT 1)
FROM pg_class AS c
WHERE c.oid = to_regclass(%(archive)s);

-- name: archive_exact_count
SELECT count(*) FROM {schema}.archive;

-- name: prune_lock
-- One pruner at a time per schema, across replicas and operators (session-level, non-blocking).
SELECT pg_try_advisory_lock(hashtextextended('outbox-relay prune ' || %(schema)s, 0));

-- name: prune_unlock
SELECT pg_advisory_unlock(hashtextextended('outbox-relay prune ' || %(schema)s, 0));

-- name: archive_count_older
SELECT count(*) FROM {schema}.archive WHERE published_at < %(cutoff)s;

-- name: pipeline_lock
-- One pipeline run (export or prune) at a time per schema.
SELECT pg_try_advisory_lock(hashtextextended('outbox-relay pipeline ' || %(schema)s, 0));

-- name: pipeline_unlock
SELECT pg_advisory_unlock(hashtextextended('outbox-relay pipeline ' || %(schema)s, 0));

-- name: export_horizon_archive
-- The last archived id old enough to export, and the snapshot it was read in: once every
-- transaction in progress then has ended, no row with a smaller id can still appear.
SELECT pg_current_snapshot()::text, coalesce(max(id), 0)
FROM {schema}.archive
WHERE published_at < %(cutoff)s;

-- name: export_horizon_dead
SELECT pg_current_snapshot()::text, coalesce(max(id), 0)
FROM {schema}.dead
WHERE failed_at < %(cutoff)s;

-- name: snapshot_settled
SELECT NOT EXISTS (SELECT 1
                   FROM pg_snapshot_xip(%(snapshot)s::pg_snapshot) AS x
                   WHERE pg_xact_status(x) = 'in progress');

-- name: pipeline_prune_batch
-- Delete archive rows lo < id <= hi if the table holds exactly what the lake holds there: the
-- same count, sum of ids and sum of message_id hashes (the first 48 bits of md5 of its text; the
-- lake side computes the same in relay/pipeline/prune.py). Returns rows there, and rows deleted.
WITH here AS (
    SELECT count(*) AS n, coalesce(sum(id), 0) AS ids,
           coalesce(sum(('x' || substr(md5(message_id::text), 1, 12))::bit(48)::bigint), 0) AS hashes
    FROM {schema}.archive
    WHERE id > %(lo)s AND id <= %(hi)s
), gone AS (
    DELETE FROM {schema}.archive AS a
    USING here
    WHERE a.id > %(lo)s AND a.id <= %(hi)s
      AND here.n = %(n)s AND here.ids = %(ids)s AND here.hashes = %(hashes)s
    RETURNING a.id
)
SELECT (SELECT n FROM here), (SELECT count(*) FROM gone);

-- name: pipeline_prune_rows
-- The slow path, for a batch whose sums differ (a row arrived after its range was exported):
-- delete exactly the rows the lake lists, by id and message_id.
DELETE FROM {schema}.archive AS a
USING unnest(%(ids)s::bigint[], %(message_ids)s::uuid[]) AS l(id, message_id)
WHERE a.id = l.id AND a.message_id = l.message_id;
