-- What operators run (relay/postgres/admin.py: the Admin API behind `dead`, `archive` and
-- `keys`), as the operator role; the relay's pruner runs archive_prune_batch too.
-- `{schema}` is replaced by the quoted, validated schema name and `{new_channel}` by the quoted
-- NOTIFY channel; nothing else is ever spliced into these texts.

-- name: blocked_keys
-- Keys held by the 'block' policy, oldest first, with how many messages wait behind each.
SELECT b.ordering_key, b.message_id, b.seq, b.reason, b.blocked_at,
       (SELECT count(*) FROM {schema}.messages m WHERE m.ordering_key = b.ordering_key) AS waiting
FROM {schema}.blocked_keys AS b
ORDER BY b.blocked_at, b.ordering_key;

-- name: release_key
SELECT {schema}.release_key(%(key)s, %(replay)s);

-- name: forget_idle_keys
-- One page of a pass that forgets keys idle for %(idle)s seconds (migration 0014).
SELECT forgotten, last_key
FROM {schema}.forget_idle_keys(make_interval(secs => %(idle)s), %(after)s, %(limit)s);

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

-- name: dead_ids_starting
-- The message ids of dead letters matching %(pattern)s (an id's start, as PostgreSQL writes uuids,
-- then %%; built and checked by filters.id_prefix), at most two: one is a unique prefix.
SELECT DISTINCT message_id
FROM {schema}.dead
WHERE message_id::text LIKE %(pattern)s
ORDER BY message_id
LIMIT 2;

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
-- Delete the archive's oldest rows, by id (ids grow with published_at), if older than the cutoff
-- (migration 0026: the relay role deletes through this function alone). Returns how many were
-- deleted and how many of the batch were too young (then pruning is done).
SELECT gone, younger FROM {schema}.prune_archive(%(cutoff)s, %(batch)s);

-- name: archive_stats
SELECT c.reltuples::bigint,
       pg_total_relation_size(c.oid),
       (SELECT published_at FROM {schema}.archive ORDER BY id LIMIT 1),
       (SELECT published_at FROM {schema}.archive ORDER BY id DESC LIMIT 1)
FROM pg_class AS c
WHERE c.oid = to_regclass(%(archive)s);

-- name: archive_exact_count
SELECT count(*) FROM {schema}.archive;

-- name: archive_count_older
SELECT count(*) FROM {schema}.archive WHERE published_at < %(cutoff)s;
