-- What the Spark pipeline runs on PostgreSQL (relay/pipeline/database.py): the export horizons
-- and the verified prune (its lock is in locks.sql).
-- `{schema}` is replaced by the quoted, validated schema name and `{new_channel}` by the quoted
-- NOTIFY channel; nothing else is ever spliced into these texts.

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

-- name: replay_start
-- A replay from the lake (migration 0021): started with this selection if it is new and
-- `create`; its row either way (none if it is not there).
SELECT position, enqueued, skipped, skips, selection, started_by, started_at
FROM {schema}.start_replay(%(name)s, %(selection)s, %(create)s);

-- name: replay_batch
-- One batch of a replay, enqueued and its position moved, in one transaction (fenced by `after`).
SELECT {schema}.replay_batch(%(name)s, %(after)s, %(ids)s, %(exchanges)s, %(routing_keys)s,
                             %(bodies)s, %(headers)s, %(provenance)s, %(properties)s,
                             %(ordering_keys)s, %(message_ids)s);

-- name: replay_skip
-- One lake row the outbox refused, skipped with its reason (fenced by `after`).
SELECT {schema}.replay_skip(%(name)s, %(after)s, %(id)s, %(message_id)s, %(reason)s);
