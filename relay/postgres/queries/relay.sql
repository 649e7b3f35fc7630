-- What a relay runs (relay/postgres/store.py, listener.py, doorbell.py), as the relay role:
-- claims, leases, settles, the orphan and key chores, the doorbell, and the gauges' readings.
-- `{schema}` is replaced by the quoted, validated schema name and `{new_channel}` by the quoted
-- NOTIFY channel; nothing else is ever spliced into these texts.

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

-- name: lane_start
-- Where a relay's first window starts (migration 0022): a snapshot, and the first ready row
-- visible in it with no claim (NULL: none).
SELECT snapshot, xid, id FROM {schema}.lane_start();

-- name: sweep_stragglers
-- Move up to %(limit)s ready rows visible in %(passed)s that still have no claim to messages, as
-- new due messages (migration 0022): how many it looked at and moved.
SELECT looked, moved FROM {schema}.sweep_stragglers(%(passed)s, %(limit)s);

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
-- The states are the gauges' (observe): due = may be claimed now (a lease that ran out included),
-- scheduled = later, gated = behind an earlier message of its key; pending is all three.
WITH slow AS (
    SELECT
        count(*) FILTER (WHERE NOT leased) AS pending,
        count(*) FILTER (WHERE NOT leased AND NOT gated AND available_at <= now()) AS due,
        count(*) FILTER (WHERE NOT leased AND NOT gated AND available_at > now()) AS scheduled,
        count(*) FILTER (WHERE NOT leased AND gated) AS gated,
        count(*) FILTER (WHERE leased) AS in_flight,
        min(created_at) FILTER (WHERE NOT leased AND NOT gated AND available_at <= now())
            AS oldest
    FROM (
        SELECT created_at, available_at, gated,
               claim_id IS NOT NULL AND available_at > now() AS leased
        FROM {schema}.messages
    ) AS m
)
SELECT slow.pending + fast.due AS pending, slow.due + fast.due AS due, slow.scheduled, slow.gated,
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

-- name: arm_doorbell
-- SHARE on the doorbell, once every producer that holds it has committed (migration 0023): from
-- now on producers NOTIFY. Held, in an open READ COMMITTED transaction, while the relay sleeps.
SELECT {schema}.arm_doorbell();

-- name: doorbell_session
-- The doorbell's session waits for its lock as long as producers hold it, then holds it in an
-- idle transaction as long as its relay sleeps: no timeout of the server's may end either. The
-- server's TCP keepalives notice a client gone silently (a NAT that dropped the connection), so
-- that the lock does not outlive it by hours (no effect over a Unix socket).
SELECT set_config('lock_timeout', '0', false), set_config('statement_timeout', '0', false),
       set_config('idle_in_transaction_session_timeout', '0', false),
       set_config('tcp_keepalives_idle', '30', false),
       set_config('tcp_keepalives_interval', '10', false);

-- name: no_idle_session_timeout
-- PostgreSQL 14's idle_session_timeout would end the doorbell's session between two arms, and the
-- LISTEN session whenever no NOTIFY comes for that long: off, for these two sessions.
SELECT set_config('idle_session_timeout', '0', false);

-- name: doorbell_no_transaction_timeout
-- PostgreSQL 17's transaction_timeout would end it while it holds the doorbell: off.
SELECT set_config('transaction_timeout', '0', false);

-- name: use_doorbell
-- From now on producers NOTIFY only while a relay sleeps (a relay of this version is running).
SELECT {schema}.use_doorbell();

-- name: relay_session
-- Each pooled connection of a relay. Its claims are durable before anything is published: a
-- server that does not wait for the WAL flush by default (`off`) is overruled for this session
-- (stricter settings are kept); settles may then opt out (settle's p_durable). And it reads
-- committed data: the key gate's decisions rest on what each statement sees committed.
SELECT set_config('synchronous_commit', 'on', false)
WHERE current_setting('synchronous_commit') = 'off'
UNION ALL
SELECT set_config('default_transaction_isolation', 'read committed', false);

-- name: relay_settings
-- What relay_session sets, read instead behind a transaction pooler (where it must be the role's).
SELECT current_setting('synchronous_commit'), current_setting('default_transaction_isolation'),
       quote_ident(current_user);

-- name: schema_version
SELECT coalesce(max(version), 0) FROM {schema}.schema_migrations;

-- name: observe
-- The gauges' one query: backlog by state, the longest wait, dead rows, blocked keys, and the
-- database's health. Every count of messages reads an index (capped at a million), never the
-- table; the ready lane's come from lane_gauges (index look-ups, migration 0019).
SELECT
    (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                           WHERE claim_id IS NULL AND NOT gated AND available_at <= now()
                           LIMIT 1000000) AS s)
    -- leases that ran out (their relay died): due again, for the orphan claim
    + (SELECT count(*) FROM (SELECT 1 FROM {schema}.messages
                             WHERE claim_id IS NOT NULL AND available_at <= now()
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
